"""The agents' API (`/agent/v1/`): register, heartbeat and the long-poll watch."""

from django.urls import path

from endpoints.fleet import api

urlpatterns = [
    path("register", api.register, name="agent-register"),
    path("heartbeat", api.heartbeat, name="agent-heartbeat"),
    path("watch", api.watch, name="agent-watch"),
]
