"""One object per running event loop: the registry every per-loop singleton uses.

An asyncio connection (a redis-py pool, the pipelined script connection, the pub/sub listener, the
usage writer's PostgreSQL connection) belongs to the loop that opened it, so each is made once per
loop, on first use there. A process normally runs one loop (the gateway's); tests and scripts run
several in turn (`asyncio.run`), and each gets its own.

NOTE: an object that holds connections is closed as its loop ends (`close`), while the loop still runs: a
loop ended by `asyncio.run` (or asgiref's, or uvicorn's) closes its unfinished async generators, and each
loop has one here whose `finally` closes that loop's objects and forgets them. Before, nothing closed them:
each object (a connection's reader) held its loop, so the weakly held loop never went, and every ended
loop (a batch slice's `asyncio.run` in the worker, a test's) kept its Redis and PostgreSQL sockets open
until the process ran out of file descriptors.

Loops are held weakly: a loop that is gone takes its entry along (after `on_loop_gone`, if given: for an
object that does not hold its loop, of a loop closed without closing its async generators), and a new loop
that happens to reuse a dead one's id never gets the dead one's object.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import sys
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

STEP_TIMEOUT_S = 5.0  # one closing step at most: a loop's end never hangs on a connection that does not answer


class _LoopEnd:
    """What runs as one loop ends (each registry's closing of its objects), and the generator that runs it."""

    __slots__ = ("steps", "began", "generator", "__weakref__")

    def __init__(self) -> None:
        self.steps: list[Callable] = []
        self.began = False  # the loop's end has begun running the steps: none may be added (nothing would run it)
        self.generator: AsyncIterator | None = None


# loop -> its `_LoopEnd`
_at_end: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopEnd] = weakref.WeakKeyDictionary()


async def _ending(end: _LoopEnd) -> AsyncIterator[None]:
    try:
        yield
    finally:
        end.began = True
        while end.steps:
            try:
                done = end.steps.pop()()
                if inspect.isawaitable(done):
                    await asyncio.wait_for(done, STEP_TIMEOUT_S)
            except (Exception, asyncio.CancelledError):  # NOTE: one step's failure never skips the others
                logger.warning("closing an object of an ending event loop failed", exc_info=True)


def at_loop_end(loop: asyncio.AbstractEventLoop, step: Callable) -> bool:
    """Run `step()` (awaited, at most `STEP_TIMEOUT_S`, if it returns an awaitable) as the running `loop` ends, the
    last added first; False (and nothing added) once the loop's end has begun: nothing would run it then.

    NOTE: the loop closes its async generators as it ends (`shutdown_asyncgens`), after it cancelled its
    tasks; the generator here is started at once (run up to its `yield`), in the running loop, so that the
    loop's first-iteration hook registers it. One generator per loop; neither it nor a step may hold the loop
    (it would never go). A loop closed without closing its generators (`run_until_complete` and `close` by hand: no
    path here ends one so) runs no step: its objects stay open, and an object that holds its loop keeps it. uvloop does
    not say whether its end has begun: an object first asked for then (only at the gateway's exit) is kept."""
    end = _at_end.get(loop)
    if end is None:
        if getattr(loop, "_asyncgens_shutdown_called", False):
            return False
        end = _at_end[loop] = _LoopEnd()
        end.generator = _ending(end)
        # NOTE: registered by the loop's own first-iteration hook, but with a finalizer of its own: the loop's (its
        # bound method) would make the generator, held here, hold the loop for ever.
        firstiter, finalizer = sys.get_asyncgen_hooks()
        sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=_left)
        try:
            end.generator.__anext__().send(None)
        except StopIteration:
            pass
        finally:
            sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=finalizer)
        weakref.finalize(loop, _drop, end)
    if end.began:
        return False
    end.steps.append(step)
    return True


def _left(ending: AsyncIterator) -> None:
    """An ending generator collected unfinished: nothing to run (`_drop` ends each before)."""


def _drop(end: _LoopEnd) -> None:
    end.steps.clear()
    try:
        end.generator.aclose().send(None)  # nothing left to await: its `finally` ends at once
    except (StopIteration, RuntimeError):
        pass


class PerLoop(Generic[T]):
    """`get()` returns the running loop's object, made by `factory()` on its first use there."""

    def __init__(self, factory: Callable[[], T], *, close: Callable[[T], object] | None = None,
                 on_loop_gone: Callable[[T], None] | None = None):
        """`close(obj)` (awaited if it returns an awaitable) closes a loop's object as that loop ends;
        `on_loop_gone(obj)` once the loop itself is gone, for a loop that ended without closing it."""
        self._factory = factory
        self._close = close
        self._on_loop_gone = on_loop_gone
        self._objects: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T] = weakref.WeakKeyDictionary()
        # NOTE: the last loop asked about and its object: the gateway's one loop, without a weak-dict lookup.
        self._latest: tuple[Callable[[], asyncio.AbstractEventLoop | None], T | None] = (lambda: None, None)

    def get(self) -> T:
        loop = asyncio.get_running_loop()
        latest_loop, latest = self._latest
        if latest_loop() is loop:
            return latest
        current = self._objects.get(loop)
        if current is None:
            current = self._factory()
            gone = None if self._on_loop_gone is None else weakref.finalize(loop, self._on_loop_gone, current)
            if not at_loop_end(loop, functools.partial(self._forget, weakref.ref(loop), current, gone)):
                # NOTE: first asked for as the loop ends (in a generator's `finally`): not kept, so that it never keeps
                # the loop; it goes with its caller's last reference (and `on_loop_gone` with the loop).
                return current
            self._objects[loop] = current
        self._latest = (weakref.ref(loop), current)
        return current

    def peek(self) -> T | None:
        """The running loop's object if it has one; none is made."""
        loop = asyncio.get_running_loop()
        latest_loop, latest = self._latest
        return latest if latest_loop() is loop else self._objects.get(loop)

    def _forget(self, loop_ref: weakref.ref, current: T, gone: weakref.finalize | None):
        """The ending loop's object let go (so that nothing keeps the loop), and closed."""
        if gone is not None:
            gone.detach()
        loop = loop_ref()
        if loop is not None and self._objects.get(loop) is current:
            del self._objects[loop]
        if self._latest[1] is current:
            self._latest = (lambda: None, None)
        return None if self._close is None else self._close(current)

    def all(self) -> list[T]:
        """Every loop's object still held (one of a loop closed without ending its generators too, until another
        loop asks)."""
        objects = list(self._objects.values())
        latest = self._latest[1]
        if latest is not None and not any(latest is existing for existing in objects):
            objects.append(latest)
        return objects
