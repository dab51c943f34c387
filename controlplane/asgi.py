"""ASGI entry point.

`/v1/…` (the inference gateway) and `/metrics` are served by a lean ASGI app
ahead of Django; everything else (console, management API, agent API) is Django, each request
with its line in the access log (`controlplane.access_log`).
"""

import os

import django
from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.db import connections
from django.urls import reverse

from controlplane import database_pool

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
database_pool.use_in_this_process()  # NOTE: before the settings are read: the web process pools its connections
django.setup(set_prefix=False)


class RequestThreadsClosingConnections(ASGIHandler):
    """Django's ASGI handler, with the connections a request's thread opened closed as the request ends.

    NOTE: Django runs a request's synchronous code (middleware, views) in a thread of the request's own
    (`ThreadSensitiveContext`), which ends with it; a connection it opened is never used again. Before,
    `CONN_MAX_AGE` kept each open past its thread's end, until the garbage collector happened on it (a full
    collection, every few hundred requests): a web process held one idle PostgreSQL session per request since
    (`tests/test_web_process_leaks.py`). The context entered here is the request's (Django's own, nested, adds
    none), so the closing runs in that same thread, after the view (and a cancelled request's view) is done.
    With the pool (`controlplane.database_pool`), closing hands the connection back to it, open, for the next request.
    """

    async def __call__(self, scope, receive, send):
        async with ThreadSensitiveContext():
            try:
                await super().__call__(scope, receive, send)
            finally:
                await sync_to_async(connections.close_all)()


django_application = RequestThreadsClosingConnections()

from controlplane.access_log import AccessLog  # noqa: E402
from controlplane.accounts.mail_sender import send_backlog_before_stopping  # noqa: E402
from endpoints.batches.api import refuse_upload_before_its_body  # noqa: E402
from endpoints.batches.views import console_upload_max_body_bytes  # noqa: E402
from endpoints.gateway.app import Gateway  # noqa: E402 - needs Django set up first

application = Gateway(
    fallback=AccessLog(django_application),
    refuse_upload=refuse_upload_before_its_body,
    console_uploads={reverse("console:batches"): console_upload_max_body_bytes()},
    at_shutdown=send_backlog_before_stopping,  # NOTE: a pod's stop never runs `atexit` (uvicorn re-raises SIGTERM)
)
