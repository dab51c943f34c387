"""Every lookup slot of a cache taken, as a flood of made-up keys or model names takes them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


@asynccontextmanager
async def every_slot_held(slots) -> AsyncIterator[None]:
    """Within: each of `slots`' `max_concurrent` slots held by a task of its own (`held_async`); all given back on
    leaving."""
    held, release = [], asyncio.Event()

    async def hold():
        async with slots.held_async():
            held.append(1)
            await release.wait()

    holders = [asyncio.ensure_future(hold()) for _ in range(slots.max_concurrent)]
    while len(held) < slots.max_concurrent:
        await asyncio.sleep(0)
    try:
        yield
    finally:
        release.set()
        await asyncio.gather(*holders)
