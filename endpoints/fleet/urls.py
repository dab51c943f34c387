from django.urls import path

from endpoints.fleet import api

urlpatterns = [
    path("register", api.register, name="agent-register"),
    path("heartbeat", api.heartbeat, name="agent-heartbeat"),
    path("watch", api.watch, name="agent-watch"),
]
