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

import psycopg
from django.db import connection
from django.http import JsonResponse

from billing.usage_writer import journal
from controlplane.redis_client import get_async_redis
from endpoints.gateway import drain


async def healthz(request):
    """The process is alive and serving; checks nothing else, so a database outage restarts no pod."""
    return JsonResponse({"status": "ok"})


# NOTE: the probe's own budget for each of its checks: the kubelet's readiness probe gives up after 5 s.
CHECK_TIMEOUT_S = 2.0


async def _database_answers() -> None:
    """`SELECT 1` on a connection of the probe's own, opened and closed here on the event loop (psycopg's async
    connection), within `CHECK_TIMEOUT_S`.

    NOTE: never a request's connection nor the web process's pool (`controlplane.database_pool`): a burst of slow
    console or API requests (a lock, a slow PostgreSQL) held every pooled connection and the probe waited for one
    until the kubelet gave up, so every pod left the load balancer at once; and a pooled session that stalled (a
    partition, no RST) hung the probe's thread, past an `asyncio.wait_for` that cannot stop a thread. A coroutine is
    cancelled at the deadline, its socket closed."""
    params = connection.get_connection_params()
    for key in ("cursor_factory", "context"):  # Django's, for its own synchronous connections
        params.pop(key, None)
    params["connect_timeout"] = max(2, int(CHECK_TIMEOUT_S))  # NOTE: libpq's minimum is 2 s

    async def select_one() -> None:
        async with await psycopg.AsyncConnection.connect(**params, autocommit=True) as probe:
            await probe.execute("SELECT 1")

    await asyncio.wait_for(select_one(), timeout=CHECK_TIMEOUT_S)


async def readyz(request):
    """Ready for traffic: the database and Redis both answer, the usage journal has room and the process is not
    stopping."""
    checks = {}
    try:
        await _database_answers()
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        await asyncio.wait_for(get_async_redis().ping(), timeout=CHECK_TIMEOUT_S)
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
