"""What Django's requests (console, management API, agent API) answer when PostgreSQL cannot serve them: a 503 with
`Retry-After`, in each API's error shape, never a 500.

Two cases, with the web process's pool (`controlplane.database_pool`) on or off: every pooled connection stayed taken
for the pool's `timeout` (`DATABASE_POOL_TIMEOUT_S`: the database is busy, or down and the pool connects none), or
PostgreSQL could not be reached or cut the request's session (down, restarting, failing over: unavailable).

NOTE: only failures of the connection itself. Any other `OperationalError` (a statement cancelled or timed out, a lock
not granted, a disk full) stays a 500 as every other error: it may be a bug, and a 503 would hide it.
"""

from __future__ import annotations

import logging
import sys

import psycopg
import psycopg.errors
from django.http import HttpResponse, JsonResponse
from django.views import defaults
from psycopg_pool import PoolTimeout

logger = logging.getLogger(__name__)

# What PostgreSQL sends as it ends a session (a shutdown, a crash, an administrator's terminate, a restart not yet
# done, a connection-level failure, a session idle too long, in a transaction or not), beside libpq's own failures (a
# plain `psycopg.OperationalError`, no SQLSTATE: a refused or failed connect, a session closed under a query, a closed
# connection used); and a server that takes no write (25006: a demoted primary or a standby, stale DNS after a
# failover), where every write would fail until the address points at the new primary.
_SESSION_ENDED = (
    psycopg.errors.ConnectionException,
    psycopg.errors.AdminShutdown,
    psycopg.errors.CrashShutdown,
    psycopg.errors.CannotConnectNow,
    psycopg.errors.IdleSessionTimeout,
    psycopg.errors.IdleInTransactionSessionTimeout,
    psycopg.errors.ReadOnlySqlTransaction,
)

BUSY = "The database is busy or unavailable: try again shortly."
UNAVAILABLE = "The database is unavailable: try again shortly."


def database_failure(exc: BaseException | None) -> str | None:
    """Why `exc` (Django's `OperationalError` wraps psycopg's) means PostgreSQL cannot serve now: `BUSY`,
    `UNAVAILABLE`, or None for any other error."""
    while exc is not None:
        if isinstance(exc, PoolTimeout):
            return BUSY
        if type(exc) is psycopg.OperationalError or isinstance(exc, _SESSION_ENDED):
            return UNAVAILABLE
        exc = exc.__cause__
    return None


def _innermost(exc: BaseException) -> BaseException:
    """psycopg's own error (its class names the failure) under Django's wrappers."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def server_error(request):
    """The project's 500 (`handler500`), but a 503 with `Retry-After: 1` where PostgreSQL cannot serve now
    (`database_failure`): the client is told to try again, not that the platform failed. Each 503 is logged with the
    error's class and message, so an operator sees why.

    NOTE: Django calls it inside the `except` that caught the request's exception, so `sys.exc_info()` names it. In
    debug mode Django shows its own error page instead."""
    exc = sys.exc_info()[1]
    message = database_failure(exc)
    if message is None:
        return defaults.server_error(request)
    cause = _innermost(exc)
    logger.warning("%s %s answered 503: %s: %s", request.method, request.path, type(cause).__name__, cause)
    if request.path.startswith("/api/"):
        response = JsonResponse({"detail": message}, status=503)
    elif request.path.startswith("/agent/"):  # the agent API's own error shape (`endpoints.fleet.api`)
        response = JsonResponse({"error": {"message": message}}, status=503)
    else:
        response = HttpResponse(message, content_type="text/plain", status=503)
    response["Retry-After"] = "1"
    return response
