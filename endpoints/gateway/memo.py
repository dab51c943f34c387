"""A per-process cache of lookups the gateway makes on every request (keys, endpoints, replicas).

Stale-while-revalidate with one load per key at a time: once an entry is older than `ttl_s`, the
first caller starts one reload in the background and every caller keeps the previous answer until
it lands (at most `STALE_FOR_S` longer). An entry never loaded (or, with `wait_when_empty`, an
empty answer) waits for the load, and concurrent waiters share it. So the hot path never queues
behind the database, and a cache expiry under load costs one query, not one per request.

The cache is bounded and evicts the least recently used entry, never everything at once: a flood
of new keys costs the oldest entries, not the hot ones. (Refused credentials are remembered apart,
in `controlplane.credential_lookups`.)

With `group_of` (a value's owner: the API keys' organisation), a full cache evicts from the group
holding the most entries, its least recently used one (the inserting group's own first where it
is among the largest): a tenant's keys are pushed out only by a group no larger than its own, so
one or many organisations calling with all their keys in turn evict each other, never a quiet
tenant's hot key. A value of no group (None) is answered and never kept. A hit costs what it did:
its group's order is in its entry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from controlplane.credential_lookups import LookupsBusy, LookupSlots
from controlplane.worker_threads import FairSlots, in_worker_thread

logger = logging.getLogger("inferplane.gateway")

STALE_FOR_S = 5.0


class Memo:
    def __init__(self, load: Callable, ttl_s: float | Callable[[], float], *, wait_when_empty: bool = False,
                 max_entries: int = 100_000, max_concurrent_loads: int | None = None,
                 load_wait_s: float | None = None, merge: Callable | None = None, group_of: Callable | None = None,
                 load_owner: Callable | None = None, fair_loads: bool = False,
                 max_concurrent_known_loads: int | None = None):
        self._load = in_worker_thread(load)
        # `merge(cached, loaded, load started at)`: what a load that lands replaces its entry with (by default what it
        # loaded): the process may have learned of the entry since the load read the database.
        self._merge = merge
        # NOTE: each load holds a worker thread and its own PostgreSQL connection while it runs; where the keys are
        # an attacker's to choose (API keys), a flood of new ones would take up to the pool's 32 threads and as many
        # connections per process, queueing every other lookup behind them. At most this many first loads at once.
        # A first load waits at most `load_wait_s` (None: as long as it takes) for one, then raises `LookupsBusy`.
        # With `load_owner` (a key's owner, known before its load: an endpoint name's organisation), the slots are
        # shared fairly between owners (`FairSlots`: at most half of them one owner's, the last free one kept for an
        # owner holding none). NOTE: a plain semaphore let one organisation's flood of made-up names take every slot,
        # and every other organisation's first lookup waited `load_wait_s`, then was refused.
        # With `fair_loads`, the owner is the caller's to name at each `get` (`owner`: an API key's sender's address,
        # which the key cannot tell before its load).
        self._load_owner = load_owner
        self._load_slots = (None if not max_concurrent_loads
                            else LookupSlots(max_concurrent_loads, wait_s=load_wait_s)
                            if load_owner is None and not fair_loads
                            else FairSlots(max_concurrent_loads, per_owner=max(1, max_concurrent_loads // 2),
                                           wait_s=load_wait_s))
        # The first loads of keys the caller knows to be real elsewhere (`get`'s `known_owner`: an API key marked by
        # `known_credentials`) take none of those slots, which a flood of made-up keys holds, but one of these, shared
        # fairly between the keys' owners (their organisations). NOTE: without a bound, one organisation's many real
        # keys (1,000 live each, sign-up is open), each a first load after a deploy or past its share of the cache,
        # all ran at once, holding every worker thread and connection while every other lookup queued behind them.
        self._known_load_slots = (None if not max_concurrent_known_loads
                                  else FairSlots(max_concurrent_known_loads,
                                                 per_owner=max(1, max_concurrent_known_loads // 2),
                                                 wait_s=load_wait_s))
        self._ttl_s = ttl_s
        self.wait_when_empty = wait_when_empty
        self.max_entries = max_entries
        self.entries: OrderedDict = OrderedDict()  # key -> (load started at, value), least recently used first
        # NOTE: with `group_of`, an entry is (load started at, value, its group's order, its group): the order of use
        # is kept per group (`_groups`, least recently used first), and `entries` holds no order. Each group is in
        # `_groups_of_size` under its number of entries (those of one size least recently loaded first), so the
        # largest is found at once; all of it bounded by `max_entries`.
        self._group_of = group_of
        self._groups: dict = {}  # group -> OrderedDict of its keys (values None), least recently used first
        self._groups_of_size: dict[int, dict] = {}  # number of entries -> {group: None}
        self._largest = 0
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

    async def get(self, key: Hashable, *load_args, fresh: bool = False, fresh_since: float | None = None,
                  known_owner: Hashable = None, owner: Hashable = None):
        """The value for `key`, loaded by `load(*load_args)` (by default `load(key)`).

        `known_owner`: a first load of `key` takes no slot of `max_concurrent_loads` (as the reload of an entry in use
        never does), but one of `max_concurrent_known_loads` as `known_owner`'s: for a key the caller knows to be real
        elsewhere (an API key another process served, and its organisation: `auth`). `owner`:
        whose the first load is among fair slots (`fair_loads`; by default `load_owner(key)`).

        `fresh` reads it now; `fresh_since` (monotonic) takes a load begun at or after then, the one running or the last
        that landed, else reads it now: callers woken by one message share one read (`adapter_hold`)."""
        entry = self.entries.get(key)
        if fresh_since is not None:
            if entry is not None and entry[0] >= fresh_since:
                (self.entries if self._group_of is None else entry[2]).move_to_end(key)
                return entry[1]
            task = self._loading.get(key)
            if (task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop()
                    and self._load_began.get(key, 0.0) >= fresh_since):
                return await asyncio.shield(task)
            fresh = True
        if entry is not None and not fresh:
            (self.entries if self._group_of is None else entry[2]).move_to_end(key)
            age, ttl_s = time.monotonic() - entry[0], self.ttl_s
            if age < ttl_s:
                return entry[1]
            if age < ttl_s + STALE_FOR_S and not (self.wait_when_empty and not entry[1]):
                self._loader(key, load_args)
                return entry[1]
        return await asyncio.shield(self._loader(key, load_args, fresh=fresh, known_owner=known_owner,
                                                 owner=owner))

    def _loader(self, key, load_args: tuple, *, fresh: bool = False, known_owner: Hashable = None,
                owner: Hashable = None) -> asyncio.Task:
        task = self._loading.get(key)
        # NOTE: a fresh read must not take a load that began before it was asked for.
        if fresh or task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            self._load_began[key] = time.monotonic()
            task = self._loading[key] = asyncio.ensure_future(self._reload(key, load_args or (key,), known_owner,
                                                                           owner))
            task.add_done_callback(_note_failure)
        return task

    async def _reload(self, key, load_args: tuple, known_owner: Hashable = None, owner: Hashable = None):
        started = time.monotonic()
        try:
            # NOTE: only a first load takes a slot: the reload of an entry in use (an endpoint, a key that exists)
            # never queues behind a flood of made-up ones; reloads are at most one per entry and `ttl_s`.
            if self._load_slots is None or key in self.entries or (
                    known_owner is not None and self._known_load_slots is None):
                value = await self._load(*load_args)
            elif known_owner is not None:
                async with self._known_load_slots.held(known_owner):
                    value = await self._load(*load_args)
            else:
                async with (self._load_slots.held_async() if isinstance(self._load_slots, LookupSlots)
                            else self._load_slots.held(owner if self._load_owner is None else self._load_owner(key))):
                    value = await self._load(*load_args)
        finally:
            if self._loading.get(key) is asyncio.current_task():
                del self._loading[key]
                self._load_began.pop(key, None)
        current = self.entries.get(key)
        if current is None or current[0] <= started:
            if self._merge is not None and current is not None:
                value = self._merge(current[1], value, started)
            if self._group_of is None:
                self.entries[key] = (started, value)
                self.entries.move_to_end(key)
                while len(self.entries) > self.max_entries:
                    self.entries.popitem(last=False)
            else:
                self._store_in_group(key, started, value)
        return value

    def _store_in_group(self, key, started: float, value) -> None:
        group = self._group_of(value)
        if group is None:
            # NOTE: a value of no group (an API key that names none) is answered, never kept: stored, one over the
            # bound pushed a real entry out before its caller forgot it, so each new bogus key sent to a full cache
            # cost a real key its place (anyone may send them).
            self.forget(key)
            return
        current = self.entries.get(key)
        if current is not None and current[3] != group:
            self._drop(key)
            current = None
        if current is None:
            order = self._groups.get(group)
            if order is None:
                order = self._groups[group] = OrderedDict()
            order[key] = None
            self._resize(group, len(order) - 1, len(order))
        else:
            order = current[2]
            order.move_to_end(key)
            # NOTE: among groups of one size, the one loaded last is evicted from last (a hot key is reloaded each
            # `ttl_s`); the work of a load, never of a hit.
            same_size = self._groups_of_size[len(order)]
            del same_size[group]
            same_size[group] = None
        self.entries[key] = (started, value, order, group)
        while len(self.entries) > self.max_entries:
            self._evict(group)

    def _evict(self, group) -> None:
        """Drops the least recently used entry of the largest group: `group`'s (which just stored one, now its most
        recently used) where it is among the largest and holds another, else that of the largest loaded least
        recently."""
        own = self._groups[group]
        if not (len(own) == self._largest and len(own) > 1):
            group = next(g for g in self._groups_of_size[self._largest] if g != group)
        victim = next(iter(self._groups[group]))
        self._drop(victim)

    def _drop(self, key) -> None:
        entry = self.entries.pop(key)
        order, group = entry[2], entry[3]
        del order[key]
        self._resize(group, len(order) + 1, len(order))
        if not order:
            del self._groups[group]

    def _resize(self, group, was: int, now: int) -> None:
        """`group` went from `was` entries to `now` (one more or one fewer)."""
        if was:
            same_size = self._groups_of_size[was]
            del same_size[group]
            if not same_size:
                del self._groups_of_size[was]
        if now:
            self._groups_of_size.setdefault(now, {})[group] = None
        if now > self._largest:
            self._largest = now
        elif was == self._largest and was not in self._groups_of_size:
            self._largest = now  # one fewer: it is still the largest

    def forget(self, key: Hashable) -> None:
        if self._group_of is None:
            self.entries.pop(key, None)
        elif key in self.entries:
            self._drop(key)

    def clear(self) -> None:
        self.entries.clear()
        self._groups.clear()
        self._groups_of_size.clear()
        self._largest = 0


def _note_failure(task: asyncio.Task) -> None:
    # NOTE: not a load that found every slot taken (a flood's, each its caller's 503): one line each was a log flood.
    if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), LookupsBusy):
        logger.warning("gateway lookup failed: %s", repr(task.exception()))  # a string: no frame kept
