from django.urls import path

from gpu_agent import api

urlpatterns = [
    path("register", api.register, name="agent-register"),
    path("heartbeat", api.heartbeat, name="agent-heartbeat"),
    path("watch", api.watch, name="agent-watch"),
]
