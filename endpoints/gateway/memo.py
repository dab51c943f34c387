"""A per-process cache of lookups the gateway makes on every request (keys, endpoints, replicas).

Stale-while-revalidate with one load per key at a time: once an entry is older than `ttl_s`, the
first caller starts one reload in the background and every caller keeps the previous answer until
it lands (at most `STALE_FOR_S` longer). An entry never loaded (or, with `wait_when_empty`, an
empty answer) waits for the load, and concurrent waiters share it. So the hot path never queues
behind the database, and a cache expiry under load costs one query, not one per request.

The cache is bounded and evicts the least recently used entry, never everything at once: a flood
of new keys costs the oldest entries, not the hot ones. (Refused credentials are remembered apart,
in `controlplane.credential_lookups`.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from controlplane.credential_lookups import LookupSlots
from controlplane.worker_threads import in_worker_thread

logger = logging.getLogger("inferplane.gateway")

STALE_FOR_S = 5.0


class Memo:
    def __init__(self, load: Callable, ttl_s: float | Callable[[], float], *, wait_when_empty: bool = False,
                 max_entries: int = 100_000, max_concurrent_loads: int | None = None,
                 merge: Callable | None = None):
        self._load = in_worker_thread(load)
        # `merge(cached, loaded, load started at)`: what a load that lands replaces its entry with (by default what it
        # loaded): the process may have learned of the entry since the load read the database.
        self._merge = merge
        # NOTE: each load holds a worker thread and its own PostgreSQL connection while it runs; where the keys are
        # an attacker's to choose (API keys), a flood of new ones would take up to the pool's 32 threads and as many
        # connections per process, queueing every other lookup behind them. At most this many first loads at once.
        self._load_slots = LookupSlots(max_concurrent_loads) if max_concurrent_loads else None
        self._ttl_s = ttl_s
        self.wait_when_empty = wait_when_empty
        self.max_entries = max_entries
        self.entries: OrderedDict = OrderedDict()  # key -> (load started at, value), least recently used first
        self._loading: dict = {}  # key -> task
        self._load_began: dict = {}  # key -> when (monotonic) its task in `_loading` was started

    @property
    def ttl_s(self) -> float:
        return self._ttl_s() if callable(self._ttl_s) else self._ttl_s

    def answers_at_once(self, key: Hashable) -> bool:
        """`get(key)` answers from this cache, never waiting for a load (the database)."""
        entry = self.entries.get(key)
        return (entry is not None and time.monotonic() - entry[0] < self.ttl_s + STALE_FOR_S
                and not (self.wait_when_empty and not entry[1]))

    def held(self, key: Hashable):
        """What `get(key)` answers from this cache, never loading (nor starting a reload); None when it would
        wait for a load."""
        return self.entries[key][1] if self.answers_at_once(key) else None

    def reload_if_older(self, key: Hashable, age_s: float, *load_args) -> asyncio.Task | None:
        """Start a reload of `key` in the background (one at a time), never waited for, when its entry is older than
        `age_s` or gone: what keeps an entry `held` while a long call that needs it at its end runs. The reload's task,
        or None when the entry is young enough."""
        entry = self.entries.get(key)
        if entry is None or time.monotonic() - entry[0] >= age_s:
            return self._loader(key, load_args)
        return None

    async def get(self, key: Hashable, *load_args, fresh: bool = False, fresh_since: float | None = None):
        """The value for `key`, loaded by `load(*load_args)` (by default `load(key)`).

        `fresh` reads it now; `fresh_since` (monotonic) takes a load begun at or after then, the one running or the last
        that landed, else reads it now: callers woken by one message share one read (`adapter_hold`)."""
        entry = self.entries.get(key)
        if fresh_since is not None:
            if entry is not None and entry[0] >= fresh_since:
                self.entries.move_to_end(key)
                return entry[1]
            task = self._loading.get(key)
            if (task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop()
                    and self._load_began.get(key, 0.0) >= fresh_since):
                return await asyncio.shield(task)
            fresh = True
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
            self._load_began[key] = time.monotonic()
            task = self._loading[key] = asyncio.ensure_future(self._reload(key, load_args or (key,)))
            task.add_done_callback(_note_failure)
        return task

    async def _reload(self, key, load_args: tuple):
        started = time.monotonic()
        try:
            # NOTE: only a first load takes a slot: the reload of an entry in use (an endpoint, a key that exists)
            # never queues behind a flood of made-up ones; reloads are at most one per entry and `ttl_s`.
            if self._load_slots is None or key in self.entries:
                value = await self._load(*load_args)
            else:
                async with self._load_slots.held_async():
                    value = await self._load(*load_args)
        finally:
            if self._loading.get(key) is asyncio.current_task():
                del self._loading[key]
                self._load_began.pop(key, None)
        current = self.entries.get(key)
        if current is None or current[0] <= started:
            if self._merge is not None and current is not None:
                value = self._merge(current[1], value, started)
            self.entries[key] = (started, value)
            self.entries.move_to_end(key)
            while len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)
        return value

    def forget(self, key: Hashable) -> None:
        self.entries.pop(key, None)

    def clear(self) -> None:
        self.entries.clear()


def _note_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("gateway lookup failed: %s", repr(task.exception()))  # a string: no frame kept
