"""ASGI entry point.

`/v1/…` (the inference gateway) and `/metrics` are served by a lean ASGI app
ahead of Django; everything else (console, management API, agent API) is Django.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_application = get_asgi_application()

from endpoints.gateway.app import Gateway  # noqa: E402 - needs Django set up first

application = Gateway(fallback=django_application)
