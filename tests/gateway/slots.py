"""Every lookup slot of a cache taken, as a flood of made-up keys or model names takes them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from controlplane.worker_threads import FairSlots


@asynccontextmanager
async def every_slot_held(slots) -> AsyncIterator[None]:
    """Within: each of `slots`' slots held by a task of its own (`held_async`; of fair slots, `FairSlots`, each by an
    owner of its own, as a flood from as many organisations takes them); all given back on leaving."""
    held, release = [], asyncio.Event()
    total = slots.total if isinstance(slots, FairSlots) else slots.max_concurrent

    async def hold(n: int):
        async with slots.held(f"flood-{n}") if isinstance(slots, FairSlots) else slots.held_async():
            held.append(1)
            await release.wait()

    holders = [asyncio.ensure_future(hold(n)) for n in range(total)]
    while len(held) < total:
        await asyncio.sleep(0)
    try:
        yield
    finally:
        release.set()
        await asyncio.gather(*holders)
