"""ASGI entry point.

`/v1/…` (the inference gateway) and `/metrics` are served by a lean ASGI app
ahead of Django; everything else (console, management API, agent API) is Django, each request
with its line in the access log (`controlplane.access_log`).
"""

import os

from django.core.asgi import get_asgi_application
from django.urls import reverse

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_application = get_asgi_application()

from controlplane.access_log import AccessLog  # noqa: E402
from endpoints.batches.api import refuse_upload_before_its_body  # noqa: E402
from endpoints.batches.views import console_upload_max_body_bytes  # noqa: E402
from endpoints.gateway.app import Gateway  # noqa: E402 - needs Django set up first

application = Gateway(
    fallback=AccessLog(django_application),
    refuse_upload=refuse_upload_before_its_body,
    console_uploads={reverse("console:batches"): console_upload_max_body_bytes()},
)
