"""The web process's PostgreSQL connections: a pool (psycopg_pool, through Django's `OPTIONS["pool"]`).

Under ASGI, Django runs each request's synchronous code (middleware, views) in a thread of the request's own, so
`CONN_MAX_AGE` never reuses a connection there: every console page, `/api/` call and agent heartbeat paid a
PostgreSQL connect and authentication, and the server a backend fork. With the pool, a request takes an open
connection and its end (`close()`, in `controlplane.asgi`) hands it back; the pool checks each one as it hands it out
(`CONN_HEALTH_CHECKS`), so one a PostgreSQL restart broke is replaced, never given to a request.

Only the web process pools (`controlplane.asgi` calls `use_in_this_process()` before Django reads its settings).
A Celery prefork worker forks its children, and a pool's connections and threads must never be shared across a
fork; its tasks run one at a time per process, where `CONN_MAX_AGE` does reuse a connection. Beat, `manage.py`
commands and the test process open few connections and keep `CONN_MAX_AGE`.

NOTE: pooling needs `CONN_MAX_AGE` 0 (Django refuses both): a request's connection goes back to the pool when the
request ends, a gateway worker thread's after each call (`controlplane.worker_threads`).
"""

from __future__ import annotations

import sys

from django.http import HttpResponse, JsonResponse
from django.views import defaults

_in_this_process = False


def use_in_this_process() -> None:
    """This process pools its connections: the web process's entry point calls it before Django is set up."""
    global _in_this_process
    _in_this_process = True


# NOTE: psycopg_pool's default (300 s) retried a failed connect in the background with a backoff (1 s, doubling), and
# while such a retry was pending the pool started no other: after a real PostgreSQL restart (20 s down) `/api/` kept
# answering 503 for 6 s after PostgreSQL was back (more after a longer outage), where without the pool the first
# request after was answered. With 0 a failed connect is tried once more at once, then given up: the next request
# that finds no free connection tries again, as each request did without the pool.
RECONNECT_TIMEOUT_S = 0.0


def pool_options(*, min_size: int, max_size: int, max_idle_s: float, timeout_s: float) -> dict | None:
    """The `pool` entry of `DATABASES["default"]["OPTIONS"]` for this process; None where it does not pool."""
    if not _in_this_process or max_size == 0:
        return None
    return {
        "name": "web",
        "min_size": min(min_size, max_size),
        "max_size": max_size,
        "max_idle": max_idle_s,
        "timeout": timeout_s,
        "reconnect_timeout": RECONNECT_TIMEOUT_S,
    }


def _waited_for_a_pooled_connection(exc: BaseException | None) -> bool:
    """Whether `exc` (Django's `OperationalError` wraps psycopg's) is the pool's: no connection free in time."""
    from psycopg_pool import PoolTimeout

    while exc is not None:
        if isinstance(exc, PoolTimeout):
            return True
        exc = exc.__cause__
    return False


def server_error(request):
    """The project's 500 (`handler500`), but a 503 with `Retry-After` when every pooled connection stayed taken for
    the pool's `timeout` (`DATABASE_POOL_TIMEOUT_S`): the request is refused soon, never left waiting.

    NOTE: Django calls it inside the `except` that caught the request's exception, so `sys.exc_info()` names it. In
    debug mode Django shows its own error page instead."""
    if _waited_for_a_pooled_connection(sys.exc_info()[1]):
        message = "The database is busy: try again shortly."
        if request.path.startswith("/api/"):
            response = JsonResponse({"detail": message}, status=503)
        elif request.path.startswith("/agent/"):  # the agent API's own error shape (`endpoints.fleet.api`)
            response = JsonResponse({"error": {"message": message}}, status=503)
        else:
            response = HttpResponse(message, content_type="text/plain", status=503)
        response["Retry-After"] = "1"
        return response
    return defaults.server_error(request)
