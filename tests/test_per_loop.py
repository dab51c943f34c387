"""The per-event-loop registry: one object per loop, a new one for a new loop, released with its loop."""

import asyncio
import gc

from controlplane.per_loop import PerLoop


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
