"""A per-process cache of lookups the gateway makes on every request (keys, endpoints, replicas).

Stale-while-revalidate with one load per key at a time: once an entry is older than `ttl_s`, the
first caller starts one reload in the background and every caller keeps the previous answer until
it lands (at most `STALE_FOR_S` longer). An entry never loaded (or, with `wait_when_empty`, an
empty answer) waits for the load, and concurrent waiters share it. So the hot path never queues
behind the database, and a cache expiry under load costs one query, not one per request.

Both caches here are bounded and evict the least recently used entry, never everything at once:
a flood of new keys costs the oldest entries, not the hot ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from controlplane.per_loop import PerLoop

logger = logging.getLogger("inferplane.gateway")

STALE_FOR_S = 5.0


def in_worker_thread(function: Callable) -> Callable:
    """`function` (which uses the ORM) as a coroutine run in a worker thread that treats each call as
    Django treats a request: stale or broken connections (a PostgreSQL restart, a terminated backend)
    are dropped before and after, so a broken one never serves the next call.

    NOTE: Django cleans connections only around HTTP requests; these threads never see one. (Django
    keys connections by context, and each gateway lookup runs in a fresh one, so today a broken
    connection is mostly left behind rather than reused; this keeps it so if that changes.)
    """

    def call(*args, **kwargs):
        close_old_connections()
        try:
            return function(*args, **kwargs)
        finally:
            close_old_connections()

    return sync_to_async(call, thread_sensitive=False)


class Memo:
    def __init__(self, load: Callable, ttl_s: float | Callable[[], float], *, wait_when_empty: bool = False,
                 max_entries: int = 100_000, max_concurrent_loads: int | None = None):
        self._load = in_worker_thread(load)
        # NOTE: each load holds a worker thread and its own PostgreSQL connection while it runs; where the keys are
        # an attacker's to choose (API keys), a flood of new ones would take up to the pool's 32 threads and as many
        # connections per process, queueing every other lookup behind them. At most this many load at once.
        self._load_slots = PerLoop(lambda: asyncio.Semaphore(max_concurrent_loads)) if max_concurrent_loads else None
        self._ttl_s = ttl_s
        self.wait_when_empty = wait_when_empty
        self.max_entries = max_entries
        self.entries: OrderedDict = OrderedDict()  # key -> (load started at, value), least recently used first
        self._loading: dict = {}  # key -> task

    @property
    def ttl_s(self) -> float:
        return self._ttl_s() if callable(self._ttl_s) else self._ttl_s

    async def get(self, key: Hashable, *load_args, fresh: bool = False):
        """The value for `key`, loaded by `load(*load_args)` (by default `load(key)`)."""
        entry = self.entries.get(key)
        if entry is not None and not fresh:
            self.entries.move_to_end(key)
            age, ttl_s = time.monotonic() - entry[0], self.ttl_s
            if age < ttl_s:
                return entry[1]
            if age < ttl_s + STALE_FOR_S and not (self.wait_when_empty and not entry[1]):
                self._loader(key, load_args)
                return entry[1]
        return await asyncio.shield(self._loader(key, load_args, fresh=fresh))

    def _loader(self, key, load_args: tuple, *, fresh: bool = False) -> asyncio.Task:
        task = self._loading.get(key)
        # NOTE: a fresh read must not take a load that began before it was asked for.
        if fresh or task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            task = self._loading[key] = asyncio.ensure_future(self._reload(key, load_args or (key,)))
            task.add_done_callback(_note_failure)
        return task

    async def _reload(self, key, load_args: tuple):
        started = time.monotonic()
        try:
            if self._load_slots is None:
                value = await self._load(*load_args)
            else:
                async with self._load_slots.get():
                    value = await self._load(*load_args)
        finally:
            if self._loading.get(key) is asyncio.current_task():
                del self._loading[key]
        current = self.entries.get(key)
        if current is None or current[0] <= started:
            self.entries[key] = (started, value)
            self.entries.move_to_end(key)
            while len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)
        return value

    def forget(self, key: Hashable) -> None:
        self.entries.pop(key, None)

    def clear(self) -> None:
        self.entries.clear()


class ExpiringSet:
    """A bounded set whose members expire after `ttl_s`, evicting the least recently added first.

    The gateway remembers tokens it has refused here, so that the same bogus token sent again
    costs no query, and a flood of different ones pushes out only each other.
    """

    def __init__(self, ttl_s: float | Callable[[], float], *, max_entries: int):
        self._ttl_s = ttl_s
        self.max_entries = max_entries
        self._expires_at: OrderedDict = OrderedDict()  # member -> monotonic expiry, oldest first

    def __contains__(self, member: Hashable) -> bool:
        expires_at = self._expires_at.get(member)
        if expires_at is None:
            return False
        if expires_at < time.monotonic():
            del self._expires_at[member]
            return False
        return True

    def __len__(self) -> int:
        return len(self._expires_at)

    def add(self, member: Hashable) -> None:
        ttl_s = self._ttl_s() if callable(self._ttl_s) else self._ttl_s
        self._expires_at[member] = time.monotonic() + ttl_s
        self._expires_at.move_to_end(member)
        while len(self._expires_at) > self.max_entries:
            self._expires_at.popitem(last=False)

    def discard(self, member: Hashable) -> None:
        self._expires_at.pop(member, None)

    def clear(self) -> None:
        self._expires_at.clear()


def _note_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("gateway lookup failed: %r", task.exception())
