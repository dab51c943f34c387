"""The inference gateway: OpenAI's REST API (`/v1/…`) in front of the replicas.

It is a lean ASGI application mounted ahead of Django (see `controlplane/asgi.py`):
the hot path pays for no Django request/response machinery, only for what it
needs (a cached key lookup, a cached replica list, a few Redis round trips).
"""
