"""What a credential the anonymous internet may send costs before it is known to be bogus.

Every surface that takes a credential (API keys on `/v1` and `/api/v1`, console sessions on the gateway's
playground path, node secrets and join tokens on the agent API) looks it up in PostgreSQL, and anyone may send
well-formed ones never seen before. So each kind has one `CredentialLookups`:

- a bogus credential sent again costs no query: its SHA-256 (never the credential) is remembered as refused for
  a short while, in a bounded set where a flood of different ones pushes out only each other. A credential issued
  later is random and new, so it is never among them;
- at most `max_concurrent` lookups of the kind run at once per process, each holding a worker thread and a
  database connection; the rest wait (a coroutine, no thread) at most `wait_s`, then are refused with
  `LookupsBusy`, which each surface answers with its own 503. So a flood of bogus credentials holds a few
  threads and connections, never the pool every other lookup needs;
- a credential that matched a real one in this process (its SHA-256 remembered as known for `KNOWN_FOR_S`, until
  refused) is looked up again without waiting for a slot (`slot_for`): still looked up, so a revoked key or a retired
  node's secret stops at once, but never behind a flood. NOTE: every call with a key on `/api/v1` (which caches no
  key) and every heartbeat of a node took a slot, the same few a flood of made-up ones takes: anyone sending them fast
  enough had every tenant's automation answered 503, and the nodes' heartbeats refused until they were judged
  silent. A surface may also ask whether another process knows it (`slot_for`'s `known_elsewhere`: the shared marks
  of `controlplane.accounts.known_credentials`), so a real credential new to this process skips the slots too.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Iterator
from contextlib import asynccontextmanager, contextmanager

from controlplane.per_loop import PerLoop

REFUSED_MAX = 100_000
# Credentials that matched a real one, remembered so long (each match renews it), at most so many (a live key or node
# each; one pushed out waits for a slot again, as before).
KNOWN_FOR_S = 3600.0
KNOWN_MAX = 10_000
# How long a lookup waits for a slot before its request is refused (a 503 that says to retry).
WAIT_S = 2.0


class LookupsBusy(Exception):
    """Too many lookups of this kind are running for longer than a caller may wait: retry shortly."""


class ExpiringSet:
    """A bounded set whose members expire after `ttl_s`, evicting the least recently added first.

    A member may be added with a group (`add(member, group=)`: a credential's organisation): a full set then evicts
    from the group holding the most members, its least recently added one (the adding group's own first where it is
    among the largest), so one group's members are pushed out only by a group no larger than its own. Members of no
    group (None) are one group. NOTE: least recently added first, whoever's, an organisation calling in turn with as
    many keys as it holds (ten at the live-key limit: sign-up is open) pushed every other tenant's key out of the keys
    known to be real (`CredentialLookups.known`), each of their calls then waiting behind a flood of made-up ones.

    NOTE: safe to share between threads (the control plane's sync views) and coroutines (the gateway).
    """

    def __init__(self, ttl_s: float | Callable[[], float], *, max_entries: int):
        self._ttl_s = ttl_s
        self.max_entries = max_entries
        self._expires_at: OrderedDict = OrderedDict()  # member -> monotonic expiry, oldest first
        self._group_of: dict = {}  # member -> its group
        self._groups: dict = {}  # group -> OrderedDict of its members (values None), least recently added first
        self._lock = threading.Lock()

    def __contains__(self, member: Hashable) -> bool:
        with self._lock:
            expires_at = self._expires_at.get(member)
            if expires_at is None:
                return False
            if expires_at < time.monotonic():
                self._drop(member)
                return False
            return True

    def __len__(self) -> int:
        return len(self._expires_at)

    def add(self, member: Hashable, *, group: Hashable = None) -> None:
        ttl_s = self._ttl_s() if callable(self._ttl_s) else self._ttl_s
        now = time.monotonic()
        with self._lock:
            if member in self._expires_at and self._group_of[member] != group:
                self._drop(member)
            self._expires_at[member] = now + ttl_s
            self._expires_at.move_to_end(member)
            self._group_of[member] = group
            members = self._groups.setdefault(group, OrderedDict())
            members[member] = None
            members.move_to_end(member)
            # NOTE: the oldest added first, so those whose time is up are dropped here: before, they stayed until
            # `max_entries` newer ones pushed them out, and a trickle of made-up credentials (~200 bytes each) grew a
            # web process for a day or more, to ~20 MB a kind, rather than holding the last TTL's worth.
            while self._expires_at:
                oldest, oldest_expires_at = next(iter(self._expires_at.items()))
                if oldest_expires_at >= now:
                    break
                self._drop(oldest)
            while len(self._expires_at) > self.max_entries:
                self._drop(next(iter(self._groups[self._group_to_evict_from(group)])))

    def _group_to_evict_from(self, adding: Hashable) -> Hashable:
        largest = max(len(members) for members in self._groups.values())
        own = self._groups.get(adding)
        if own is not None and len(own) == largest and (largest > 1 or len(self._groups) == 1):
            return adding
        return next(group for group, members in self._groups.items() if len(members) == largest and group != adding)

    def _drop(self, member: Hashable) -> None:
        del self._expires_at[member]
        group = self._group_of.pop(member)
        members = self._groups[group]
        del members[member]
        if not members:
            del self._groups[group]

    def discard(self, member: Hashable) -> None:
        with self._lock:
            if member in self._expires_at:
                self._drop(member)

    def clear(self) -> None:
        with self._lock:
            self._expires_at.clear()
            self._group_of.clear()
            self._groups.clear()


class LookupSlots:
    """At most `max_concurrent` lookups at once: per event loop for coroutines (`held_async`, waiting costs no
    thread) and per process for threads (`held`). A caller waits at most `wait_s` (None: as long as it takes)."""

    def __init__(self, max_concurrent: int, *, wait_s: float | None = None):
        self.max_concurrent = max_concurrent
        self.wait_s = wait_s
        self._per_loop = PerLoop(lambda: asyncio.Semaphore(max_concurrent))
        self._threads = threading.BoundedSemaphore(max_concurrent)

    @asynccontextmanager
    async def held_async(self):
        slots = self._per_loop.get()
        try:
            async with asyncio.timeout(self.wait_s):
                await slots.acquire()
        except TimeoutError:
            raise LookupsBusy() from None
        try:
            yield
        finally:
            slots.release()

    @contextmanager
    def held(self) -> Iterator[None]:
        if not self._threads.acquire(timeout=self.wait_s):
            raise LookupsBusy()
        try:
            yield
        finally:
            self._threads.release()


class CredentialLookups:
    """One kind of credential's refused hashes and lookup slots (see the module's docstring)."""

    def __init__(
        self,
        *,
        max_concurrent: int,
        refused_for_s: float | Callable[[], float],
        wait_s: float | None = WAIT_S,
        max_refused: int = REFUSED_MAX,
    ):
        self.slots = LookupSlots(max_concurrent, wait_s=wait_s)
        self.refused = ExpiringSet(refused_for_s, max_entries=max_refused)
        self.known = ExpiringSet(KNOWN_FOR_S, max_entries=KNOWN_MAX)

    @staticmethod
    def digest(plain: str) -> str:
        return hashlib.sha256(plain.encode()).hexdigest()

    def is_refused(self, plain: str) -> bool:
        return self.digest(plain) in self.refused

    def refuse(self, plain: str) -> None:
        digest = self.digest(plain)
        self.known.discard(digest)
        self.refused.add(digest)

    def know(self, plain: str, *, owner: Hashable = None) -> None:
        """`plain` matched a real credential (of `owner`, an organisation: `ExpiringSet`'s group, so another owner's
        many never push it out): its next lookups take no slot (`slot_for`)."""
        self.known.add(self.digest(plain), group=owner)

    @contextmanager
    def slot_for(self, plain: str, *, known_elsewhere: Callable[[str], bool] | None = None) -> Iterator[None]:
        """A lookup slot for `plain` (`LookupSlots.held`), none for a credential known to be real: here, or (asked
        only of one not known here) by `known_elsewhere(its digest)` (every process's: `known_credentials`)."""
        digest = self.digest(plain)
        if digest in self.known or (known_elsewhere is not None and known_elsewhere(digest)):
            yield
            return
        with self.slots.held():
            yield

    @asynccontextmanager
    async def slot_for_async(self, plain: str, *, known_elsewhere: Callable[[str], Awaitable[bool]] | None = None):
        """`slot_for` for a coroutine (`LookupSlots.held_async`)."""
        digest = self.digest(plain)
        if digest in self.known or (known_elsewhere is not None and await known_elsewhere(digest)):
            yield
            return
        async with self.slots.held_async():
            yield

    def clear(self) -> None:
        self.refused.clear()
        self.known.clear()
