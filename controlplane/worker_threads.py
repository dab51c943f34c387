"""How a coroutine runs blocking ORM work: in a worker thread, never on the event loop's one shared thread.

asgiref's default (`thread_sensitive=True`) runs every such call of a process without a request's own context (the
gateway's `/v1` path sets none up) on ONE thread, one after another: one slow call queued every other behind it. So
each runs apart (`thread_sensitive=False`), in asgiref's pool or in a small pool of its own (`executor`) where many
calls may come at once and each holds a PostgreSQL connection while it runs (`billing.quota.rebuild`); `FairSlots`
shares such a pool's threads among its callers' owners (organisations), so none takes them all. A short-lived loop
(`run_briefly`: a batch run's) may give its ORM calls a few threads of their own, and so hold that many sessions.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Hashable
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import psycopg
from asgiref.sync import sync_to_async
from django.db import DatabaseError, close_old_connections, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from controlplane.credential_lookups import LookupsBusy
from controlplane.database_pool.base import CHECK_TIMEOUT_S, check_within_deadline
from controlplane.per_loop import PerLoop

T = TypeVar("T")


def in_worker_thread(function: Callable, *, executor: Executor | None = None) -> Callable:
    """`function` (which uses the ORM) as a coroutine run in a worker thread (of `executor`, if given) that treats
    each call as Django treats a request: stale or broken connections (a PostgreSQL restart, a terminated backend)
    are dropped before and after, so a broken one never serves the next call. A call on `executor`'s threads closes its
    connections after it: those threads are few and long-lived, and work there (a rebuild) comes in bursts. Without
    `executor`, under a `run_briefly` loop that has database threads of its own, it runs on one of those.

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
            connections.close_all()

    if executor is not None:
        return sync_to_async(call, thread_sensitive=False, executor=executor)
    checked = connections_checked(function)
    on_the_default_executor = sync_to_async(checked, thread_sensitive=False)

    async def on_a_worker_thread(*args, **kwargs):
        kept = _run_connections.get()
        if kept is None or kept.database_threads is None:
            return await on_the_default_executor(*args, **kwargs)
        return await sync_to_async(checked, thread_sensitive=False, executor=kept.database_threads)(*args, **kwargs)

    return on_a_worker_thread


def on_database_thread(function: Callable) -> Callable:
    """`function` (sync, ORM), called from a worker thread of a `run_briefly` loop that has database threads of its
    own (a batch run's `asyncio.to_thread` store, whose S3 put must hold none of them), run on one of those and waited
    for, its connections checked there (`connections_checked`); anywhere else it runs where it is called.

    At most all those threads but one run such calls at once (`_RunConnections.held_back`, waited for in the calling
    thread), so one is always free for the loop's own (`in_worker_thread`: a run's lease checks, its lookups). NOTE: a
    store waits for its organisation's row lock; two stores so blocked (another run's store of the same organisation, a
    slow PostgreSQL) held both of the two threads, the lease check queued behind them for 7 s, and a lease of 3 s lapsed
    with lines in flight (another worker could take the batch and run them again).

    NOTE: a thread of those calls it in place: one waiting for another of the same few threads could wait for good."""
    checked = connections_checked(function)

    def call(*args, **kwargs):
        kept = _run_connections.get()
        if kept is None or kept.database_threads is None or getattr(_on_database_thread, "yes", False):
            return checked(*args, **kwargs)
        with kept.held_back:
            try:
                done = kept.database_threads.submit(contextvars.copy_context().run, checked, *args, **kwargs)
            except RuntimeError:  # NOTE: the loop has ended (a soft time limit): the call ends here, as it did before
                return checked(*args, **kwargs)
            return done.result()

    return call


_on_database_thread = threading.local()  # `yes` on a run's database threads


def _mark_database_thread() -> None:
    _on_database_thread.yes = True


class _RunConnections:
    """The connections a short-lived event loop's calls opened (`run_briefly`), one a thread at most: each kept across
    its thread's calls, closed when the loop ends. NOTE: closed after each call, a batch run opened a PostgreSQL session
    per lease check (one a second) and per stored line.

    NOTE: the loop can end while a call still runs in its thread: Celery's soft time limit raised while `asyncio.run`
    joined them. `close_all` then closed a connection that thread was mid-query on (a store lost), and a call that
    ended after it kept its connection in the emptied list (a session open until a garbage collection). So a thread's
    connections are closed by `close_all` only between its calls; a call ending after it closes its own."""

    def __init__(self, num_database_threads: int | None = None) -> None:
        # NOTE: every ORM call of the loop runs on these, when given (`in_worker_thread`, `on_database_thread`): on the
        # loop's default executor each of up to min(32, CPUs + 4) threads kept a PostgreSQL session till the run ended
        self.database_threads = None if num_database_threads is None else ThreadPoolExecutor(
            num_database_threads, thread_name_prefix="run-database", initializer=_mark_database_thread)
        # how many `on_database_thread` calls may hold those threads at once: all but one (one thread alone is shared)
        self.held_back = threading.BoundedSemaphore(max(1, (num_database_threads or 1) - 1))
        self._lock = threading.Lock()
        # id(wrapper) -> (its thread, the wrapper)
        self._kept: dict[int, tuple[int, BaseDatabaseWrapper]] = {}
        self._num_calls_in: Counter[int] = Counter()  # thread -> its calls running now
        self.closed = False

    def enter(self) -> None:
        """This thread begins a call: its connections are its own until `leave`."""
        with self._lock:
            self._num_calls_in[threading.get_ident()] += 1

    def leave(self) -> None:
        """This thread's call ended: its open connections kept to close as the loop ends, or closed now if it has."""
        thread = threading.get_ident()
        with self._lock:
            self._num_calls_in[thread] -= 1
            if not self._num_calls_in[thread]:
                del self._num_calls_in[thread]
            closed = self.closed
            if not closed:
                for wrapper in connections.all(initialized_only=True):
                    if wrapper.connection is not None:
                        self._kept[id(wrapper)] = thread, wrapper
        if closed:
            connections.close_all()

    def close_all(self) -> None:
        """Close every connection noted of a thread between calls, from this thread; a thread still inside a call
        closes its own as the call ends (`leave`)."""
        with self._lock:
            self.closed = True
            kept = [wrapper for thread, wrapper in self._kept.values() if thread not in self._num_calls_in]
            self._kept = {}
        for wrapper in kept:
            wrapper.inc_thread_sharing()  # NOTE: Django refuses a connection's close outside its thread otherwise
            try:
                wrapper.close()
            except DatabaseError:  # NOTE: a connection already broken is as closed
                pass
            finally:
                wrapper.dec_thread_sharing()


# Set in a short-lived event loop's main task (`run_briefly`): its calls' connections, closed as it ends.
_run_connections: contextvars.ContextVar[_RunConnections | None] = contextvars.ContextVar(
    "run_connections", default=None
)


def run_briefly(coroutine: Coroutine[Any, Any, T], *, num_database_threads: int | None = None) -> T:
    """`asyncio.run(coroutine)`, the connection each thread of its `connections_checked` calls (its tasks copy its
    context) opened kept across those calls and closed as it ends. NOTE: for an event loop that ends soon (a batch
    run's): its pool's threads end with it, and the connection each kept (Django keeps them per thread) stayed open
    with no one to close it until a garbage collection found it, a few sessions a run.

    With `num_database_threads`, its ORM calls (`in_worker_thread`, `on_database_thread`) share that many threads of
    their own, so it holds at most that many sessions, and this thread's own are closed first (the loop runs here, and
    the ORM refuses to run on it): a batch run held one a thread of the default executor, up to min(32, CPUs + 4),
    beside its task's idle one, and eight runs took PostgreSQL past its `max_connections`."""
    kept = _RunConnections(num_database_threads)
    if num_database_threads is not None and not any(
            wrapper.in_atomic_block for wrapper in connections.all(initialized_only=True)):
        connections.close_all()

    async def keeping_connections() -> T:
        _run_connections.set(kept)  # the main task's own context
        return await coroutine

    try:
        return asyncio.run(keeping_connections())
    finally:
        try:
            if kept.database_threads is not None:
                kept.database_threads.shutdown(wait=True)  # NOTE: joined as `asyncio.run` joins its default executor's
        finally:
            kept.close_all()  # NOTE: after `asyncio.run` has joined its threads (or was interrupted)


def _close_broken_connections(*, check_within_s: float | None = None) -> None:
    """Close this thread's connections that an error left unusable (a PostgreSQL restart, a terminated backend), or
    left outside autocommit, as `close_old_connections` does, but keep a healthy one past `CONN_MAX_AGE`. With
    `check_within_s`, each kept one is checked now, and closed unless it answers within that long.

    NOTE: Django's own check (`CONN_HEALTH_CHECKS`: a `SELECT 1` at a kept connection's next use) has no deadline: a
    session gone silent (a partition, a failover with no RST, a proxy that stopped relaying but still acknowledges
    every byte, so no TCP timeout fires) held a batch run's lease check, and its loop with it, for good."""
    for wrapper in connections.all(initialized_only=True):
        if wrapper.connection is None:
            continue
        # NOTE: checked again at its next use (`CONN_HEALTH_CHECKS`), as at a request's start
        wrapper.health_check_done = False
        if wrapper.get_autocommit() != wrapper.settings_dict["AUTOCOMMIT"]:
            wrapper.close()
        elif wrapper.errors_occurred:
            if wrapper.is_usable():
                wrapper.errors_occurred = False
            else:
                wrapper.close()
        if check_within_s is None or wrapper.connection is None:
            continue
        try:
            check_within_deadline(wrapper.connection, check_within_s)
        except psycopg.Error:
            try:
                wrapper.close()
            except DatabaseError:  # NOTE: a connection already broken is as closed
                pass
        else:
            wrapper.health_check_done = True  # NOTE: just checked: Django's own (no deadline) would only repeat it


def connections_checked(function: Callable) -> Callable:
    """`function` (which uses the ORM, in a thread that never sees a request) with its thread's connections treated as
    Django treats a request's: a stale or broken one (a PostgreSQL restart, a terminated backend) dropped before and
    after the call, so it never serves the next. Under `run_briefly` a healthy one is kept for the thread's next call
    and closed as the loop ends; a broken one is closed at once."""

    def call(*args, **kwargs):
        kept = _run_connections.get()
        if kept is None:
            close_old_connections()
            try:
                return function(*args, **kwargs)
            finally:
                close_old_connections()
        kept.enter()
        try:
            _close_broken_connections(check_within_s=CHECK_TIMEOUT_S)
            return function(*args, **kwargs)
        finally:
            try:
                _close_broken_connections()
            finally:
                kept.leave()

    return call


class FairSlots:
    """At most `total` holders at once per event loop (a pool's threads: `held`), at most `per_owner` of them one
    owner's (an organisation's), and the last free slot only ever an owner's that holds none. The rest wait as
    coroutines (no thread) in their owner's own queue, first come first served; a slot that frees goes to the waiting
    owner that holds fewest now (among equals, the one that waited longest since its last turn), never to one at its
    `per_owner`. So one owner's many slow holders take `per_owner` slots, and an owner holding none waits at most for
    one holder's turn (a holder's time is its caller's to bound: `billing.quota.rebuild`'s window).

    NOTE: without the last slot kept, two owners (a stranger can make a second organisation) each took `per_owner`
    of four, and every other owner waited behind them.

    NOTE: a holder must never wait for another slot of the same slots (a nested `held`): an owner's `per_owner`
    holders waiting for their own owner's next turn would wait for each other for good.

    With `wait_s`, a holder waits at most that long for its slot, then `LookupsBusy` (a lookup's caller answers it
    with a 503 that says to retry: `endpoints.gateway.memo`).
    """

    def __init__(self, total: int, *, per_owner: int, wait_s: float | None = None):
        if not 1 <= per_owner <= total:
            raise ValueError(f"per_owner must be between 1 and total ({total}), not {per_owner}")
        self.total = total
        self.per_owner = per_owner
        self.wait_s = wait_s
        self._per_loop = PerLoop(_FairQueue)

    def num_held(self, owner: Hashable) -> int:
        """How many slots `owner` holds now in the running event loop."""
        return self._per_loop.get().num_held_by.get(owner, 0)

    @asynccontextmanager
    async def held(self, owner: Hashable):
        queue = self._per_loop.get()
        try:
            async with asyncio.timeout(self.wait_s):
                await queue.acquire(owner, total=self.total, per_owner=self.per_owner)
        except TimeoutError:
            raise LookupsBusy() from None
        try:
            yield
        finally:
            queue.release(owner, total=self.total, per_owner=self.per_owner)


class _FairQueue:
    """One event loop's `FairSlots`. NOTE (invariant, after every call): no waiting owner could take a free slot."""

    def __init__(self):
        self.num_held = 0
        self.num_held_by: dict[Hashable, int] = {}
        # owner -> its waiters, first come first; the dict's order is the owners' turn order (one served goes last)
        self.waiting: dict[Hashable, deque[asyncio.Future]] = {}

    async def acquire(self, owner: Hashable, *, total: int, per_owner: int) -> None:
        if owner not in self.waiting and self._may_take(owner, total=total, per_owner=per_owner):
            self._take(owner)
            return
        granted = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(owner, deque()).append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            # given a slot, then cancelled before it ran: it passes the slot on
            if granted.done() and not granted.cancelled():
                self.release(owner, total=total, per_owner=per_owner)
            else:
                waiters = self.waiting.get(owner)
                if waiters is not None and granted in waiters:
                    waiters.remove(granted)
                    if not waiters:
                        del self.waiting[owner]
            raise

    def release(self, owner: Hashable, *, total: int, per_owner: int) -> None:
        self.num_held -= 1
        if self.num_held_by[owner] == 1:
            del self.num_held_by[owner]
        else:
            self.num_held_by[owner] -= 1
        self._grant(total=total, per_owner=per_owner)

    def _may_take(self, owner: Hashable, *, total: int, per_owner: int) -> bool:
        num_free = total - self.num_held
        num_held_by_owner = self.num_held_by.get(owner, 0)
        # the last free slot is kept for an owner that holds none
        return num_free > 0 and num_held_by_owner < per_owner and (num_held_by_owner == 0 or num_free > 1)

    def _take(self, owner: Hashable) -> None:
        self.num_held += 1
        self.num_held_by[owner] = self.num_held_by.get(owner, 0) + 1

    def _grant(self, *, total: int, per_owner: int) -> None:
        while self.num_held < total:
            eligible = [
                owner for owner in self.waiting if self._may_take(owner, total=total, per_owner=per_owner)
            ]
            if not eligible:
                return
            # the first (in turn order) of those holding fewest
            owner = min(eligible, key=lambda candidate: self.num_held_by.get(candidate, 0))
            waiters = self.waiting.pop(owner)
            granted = waiters.popleft()
            if waiters:
                self.waiting[owner] = waiters  # its next waits behind every other owner's
            if granted.done():  # NOTE: cancelled, its waiter not resumed yet to take it out: it takes no slot
                continue
            self._take(owner)
            granted.set_result(None)
