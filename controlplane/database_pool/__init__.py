"""The web process's PostgreSQL connections: a pool (psycopg_pool, through Django's `OPTIONS["pool"]`).

Under ASGI, Django runs each request's synchronous code (middleware, views) in a thread of the request's own, so
`CONN_MAX_AGE` never reuses a connection there: every console page, `/api/` call and agent heartbeat paid a
PostgreSQL connect and authentication, and the server a backend fork. With the pool, a request takes an open
connection and its end (`close()`, in `controlplane.asgi`) hands it back; the pool checks each one as it hands it out
(`controlplane.database_pool.base`, this package's Django database backend), so one a PostgreSQL restart broke is
replaced, never given to a request; and since a restart or a failover cuts every session at once, the first broken one
drops every idle one with it and the request gets a fresh connection at once.

Only the web process pools (`controlplane.asgi` calls `use_in_this_process()` before Django reads its settings).
A Celery prefork worker forks its children, and a pool's connections and threads must never be shared across a
fork; its tasks run one at a time per process, where `CONN_MAX_AGE` does reuse a connection. Beat, `manage.py`
commands and the test process open few connections and keep `CONN_MAX_AGE`.

NOTE: pooling needs `CONN_MAX_AGE` 0 (Django refuses both): a request's connection goes back to the pool when the
request ends, a gateway worker thread's after each call (`controlplane.worker_threads`).
"""

from __future__ import annotations

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


# The `ENGINE` of a pooling process's database: Django's PostgreSQL backend, its pool's connections checked by
# `base.DatabaseWrapper`.
ENGINE = "controlplane.database_pool"


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
