"""How a coroutine runs blocking ORM work: in a worker thread, never on the event loop's one shared thread.

asgiref's default (`thread_sensitive=True`) runs every such call of a process without a request's own context (the
gateway's `/v1` path sets none up) on ONE thread, one after another: one slow call queued every other behind it. So
each runs apart (`thread_sensitive=False`), in asgiref's pool or in a small pool of its own (`executor`) where many
calls may come at once and each holds a PostgreSQL connection while it runs (`billing.quota.rebuild`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor

from asgiref.sync import sync_to_async
from django.db import close_old_connections, connections


def in_worker_thread(function: Callable, *, executor: Executor | None = None) -> Callable:
    """`function` (which uses the ORM) as a coroutine run in a worker thread (of `executor`, if given) that treats
    each call as Django treats a request: stale or broken connections (a PostgreSQL restart, a terminated backend)
    are dropped before and after, so a broken one never serves the next call. A call on `executor`'s threads closes its
    connections after it: those threads are few and long-lived, and work there (a rebuild) comes in bursts.

    NOTE: `CONN_MAX_AGE` is checked only when a thread's next call begins: the rebuild pool's four threads each kept a
    PostgreSQL session open and idle for good after a burst of rebuilds.

    NOTE: Django cleans connections only around HTTP requests; these threads never see one. (Django
    keys connections by context, and each gateway lookup runs in a fresh one, so today a broken
    connection is mostly left behind rather than reused; this keeps it so if that changes.)
    """

    def call(*args, **kwargs):
        close_old_connections()
        try:
            return function(*args, **kwargs)
        finally:
            if executor is None:
                close_old_connections()
            else:
                connections.close_all()

    return sync_to_async(call, thread_sensitive=False, executor=executor)
