"""ASGI entry point: console, management API, agent API and the async inference gateway."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
application = get_asgi_application()
