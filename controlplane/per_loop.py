"""One object per running event loop: the registry every per-loop singleton uses.

An asyncio connection (a redis-py pool, the pipelined script connection, the pub/sub listener, the
usage writer's PostgreSQL connection) belongs to the loop that opened it, so each is made once per
loop, on first use there. A process normally runs one loop (the gateway's); tests and scripts run
several in turn (`asyncio.run`), and each gets its own.

NOTE: loops are held weakly: a loop that is gone takes its entry along (after `on_loop_gone`, if
given), and a new loop that happens to reuse a dead one's id never gets the dead one's object.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PerLoop(Generic[T]):
    """`get()` returns the running loop's object, made by `factory()` on its first use there."""

    def __init__(self, factory: Callable[[], T], *, on_loop_gone: Callable[[T], None] | None = None):
        self._factory = factory
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
            current = self._objects[loop] = self._factory()
            if self._on_loop_gone is not None:
                weakref.finalize(loop, self._on_loop_gone, current)
        self._latest = (weakref.ref(loop), current)
        return current

    def all(self) -> list[T]:
        """Every loop's object still held (a closed loop's last one too, until another loop asks)."""
        objects = list(self._objects.values())
        latest = self._latest[1]
        if latest is not None and not any(latest is existing for existing in objects):
            objects.append(latest)
        return objects
