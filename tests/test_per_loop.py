"""The per-event-loop registry: one object per loop, a new one for a new loop, closed as its loop ends."""

import asyncio
import contextlib
import gc
import os
import weakref

import pytest

from billing import usage_writer
from controlplane import per_loop, pubsub
from controlplane.per_loop import PerLoop
from controlplane.redis_client import get_async_redis, get_redis
from controlplane.redis_scripts import Script


class _Thing:
    pass


def test_each_loop_gets_its_own_object_and_keeps_it():
    registry = PerLoop(_Thing)

    async def twice():
        return registry.get(), registry.get()

    first_a, first_b = asyncio.run(twice())
    second_a, second_b = asyncio.run(twice())

    assert first_a is first_b and second_a is second_b
    assert first_a is not second_a


def test_peek_gives_the_running_loops_object_and_makes_none():
    registry = PerLoop(_Thing)

    async def peek_get_peek():
        return registry.peek(), registry.get(), registry.peek()

    before, made, after = asyncio.run(peek_get_peek())
    assert before is None and after is made
    assert asyncio.run(peek_get_peek())[0] is None  # another loop's object is not this one's


def test_a_loop_that_is_gone_takes_its_object_along():
    released = []
    registry = PerLoop(_Thing, on_loop_gone=released.append)

    async def take():
        return registry.get()

    loop = asyncio.new_event_loop()
    thing = loop.run_until_complete(take())
    loop.close()
    del loop
    gc.collect()

    assert released == [thing]
    assert registry.all() == [thing]  # the last one asked for, until another loop asks
    asyncio.run(take())
    assert thing not in registry.all()


def _sockets() -> int:
    """This process's open sockets."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


@pytest.mark.django_db(transaction=True)
def test_loops_that_end_close_their_redis_and_postgresql_connections():
    # Before, each ended loop's objects held the loop (a connection's reader), so the weakly held loop never went and
    # nothing closed them: 20 loops (a worker's batch slices) kept 80 sockets open, and the suite ran out of fds.
    ping = Script("return 1")

    async def use_each():
        await get_async_redis().ping()
        assert await ping(keys=["x"], args=[]) == 1
        async with pubsub.subscribe("per-loop-test"):
            pass
        writer = usage_writer.writer_for_this_loop()
        writer._connection = await usage_writer._connect()  # as its first write opens it

    asyncio.run(use_each())
    gc.collect()
    clients = len(get_redis().client_list())  # the sync client's own connection opened first
    sockets = _sockets()
    for _ in range(20):
        asyncio.run(use_each())
    gc.collect()
    assert _sockets() <= sockets
    assert len(get_redis().client_list()) <= clients


class _HoldsItsLoop:
    """As a connected client does (its reader holds the loop)."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()


def test_an_object_first_asked_for_as_its_loop_ends_never_keeps_the_loop():
    # Before, it was kept in the registry and its closing step added after the loop's end had run its steps: closed
    # by no one, it kept its loop (and its connections) for ever: 5 loops of 5 kept.
    registry = PerLoop(_HoldsItsLoop, close=lambda thing: None)
    loops, generators = [], []

    async def asks_as_it_ends():
        try:
            yield
        finally:
            registry.get()

    async def main():
        loops.append(weakref.ref(asyncio.get_running_loop()))
        generator = asks_as_it_ends()
        await generator.__anext__()
        generators.append(generator)

    for _ in range(5):
        asyncio.run(main())
    generators.clear()
    gc.collect()
    assert [loop for loop in loops if loop() is not None] == []


def test_a_closing_step_that_fails_or_hangs_never_stops_the_others_nor_the_loop_s_end(monkeypatch):
    # Before, a step raising CancelledError skipped every step after it (its loop kept), and one that never returned
    # hung `asyncio.run` for ever.
    monkeypatch.setattr(per_loop, "STEP_TIMEOUT_S", 0.2)
    closed = []

    def cancelled(thing):
        raise asyncio.CancelledError()

    async def hangs(thing):
        await asyncio.Event().wait()

    first = PerLoop(_HoldsItsLoop, close=closed.append)
    registries = [first, PerLoop(_HoldsItsLoop, close=hangs), PerLoop(_HoldsItsLoop, close=cancelled)]

    async def main():
        return [registry.get() for registry in registries]

    made = asyncio.run(main())
    assert closed == [made[0]]  # the first registered, closed last

