"""Liveness and readiness probes.

`/readyz` also reports `usage_backlog`: usage rows waiting in this machine's journal for the
ledger (`billing.usage_journal`), and `usage_journal_bytes`. A backlog alone keeps the gateway ready: the rows are safe
on disk and replayed as soon as PostgreSQL answers, and taking every gateway out of rotation over a
database blip would turn a billing delay into an outage. An operator alerts on a backlog that stays.

A process told to stop (SIGTERM) is not ready while it drains its calls in flight (`endpoints.gateway.drain`): it
takes no new call.

A journal past its limit (`INFERPLANE_USAGE_JOURNAL_MAX_BYTES`) is not ready: the gateway refuses new calls then
(their usage could not be recorded), and the load balancer should send them to a server whose journal has room. It is
ready again once the journal is replayed below its limit.
"""

import asyncio

from asgiref.sync import sync_to_async
from django.db import connection
from django.http import JsonResponse

from billing.usage_writer import journal
from controlplane.redis_client import get_async_redis
from endpoints.gateway import drain


async def healthz(request):
    """The process is alive and serving; checks nothing else, so a database outage restarts no pod."""
    return JsonResponse({"status": "ok"})


def _database_answers() -> None:
    # NOTE: runs in the request's own thread, where Django's request signals already dropped a
    # connection left dead by a PostgreSQL restart. Closed after: that thread ends with the request, and a
    # connection kept for reuse (CONN_MAX_AGE) stayed open with nobody to reuse it, one idle session per probe
    # (every 5 s per pod) until PostgreSQL refused clients.
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    finally:
        connection.close()


async def readyz(request):
    """Ready for traffic: the database and Redis both answer, the usage journal has room and the process is not
    stopping."""
    checks = {}
    try:
        await asyncio.wait_for(sync_to_async(_database_answers)(), timeout=2)
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        await asyncio.wait_for(get_async_redis().ping(), timeout=2)
        checks["redis"] = "ok"
    except Exception as exc:  # noqa: BLE001
        checks["redis"] = f"error: {type(exc).__name__}"
    usage_journal = journal()
    checks["usage_journal"] = "full" if usage_journal.full else "ok"
    checks["process"] = "stopping" if drain.draining() else "ok"
    ready = all(value == "ok" for value in checks.values())
    backlog = await asyncio.to_thread(usage_journal.backlog)
    return JsonResponse({"status": "ok" if ready else "unavailable", "checks": checks, "usage_backlog": backlog,
                         "usage_journal_bytes": usage_journal.num_bytes}, status=200 if ready else 503)
