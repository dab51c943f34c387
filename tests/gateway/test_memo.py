"""The gateway's per-process lookups: one load per key at a time, stale answers while reloading,
and never a wait on the hot path once a key is known."""

import asyncio
import threading
import time

import pytest

from endpoints.gateway import memo
from endpoints.gateway.memo import Memo


class Loader:
    def __init__(self, delay_s: float = 0.05):
        self.delay_s = delay_s
        self.calls = 0
        self.answer = "first"
        self.fail = False
        self._lock = threading.Lock()

    def __call__(self, key):
        with self._lock:
            self.calls += 1
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("database down")
        return f"{key}:{self.answer}"


def test_concurrent_misses_share_one_load():
    loader = Loader()
    cache = Memo(loader, ttl_s=10)

    async def storm():
        return await asyncio.gather(*(cache.get("k") for _ in range(50)))

    assert asyncio.run(storm()) == ["k:first"] * 50
    assert loader.calls == 1


def test_an_expired_entry_is_answered_at_once_and_reloaded_once_in_the_background():
    loader = Loader(delay_s=0.2)
    cache = Memo(loader, ttl_s=0.05)

    async def scenario():
        await cache.get("k")
        await asyncio.sleep(0.1)  # expired, within the stale window
        loader.answer = "second"
        started = time.monotonic()
        stale = await asyncio.gather(*(cache.get("k") for _ in range(20)))
        waited = time.monotonic() - started
        await asyncio.sleep(0.3)  # the background reload lands
        loads = loader.calls
        return stale, waited, loads, await cache.get("k")

    stale, waited, loads, fresh = asyncio.run(scenario())

    assert stale == ["k:first"] * 20 and waited < 0.1
    assert loads == 2  # the first load, then one reload for all twenty callers
    assert fresh == "k:second"


def test_fresh_reads_and_empty_answers_wait_for_the_database():
    loader = Loader(delay_s=0.01)
    replicas = Memo(lambda key: loader(key) if loader.answer else [], ttl_s=0.01, wait_when_empty=True)

    async def scenario():
        loader.answer = ""
        assert await replicas.get("e") == []
        await asyncio.sleep(0.02)
        loader.answer = "ready"
        after_empty = await replicas.get("e")  # an expired empty list is not served stale
        loader.answer = "newer"
        return after_empty, await replicas.get("e", fresh=True)

    assert asyncio.run(scenario()) == ("e:ready", "e:newer")


def test_a_failed_background_reload_keeps_the_old_answer_until_the_stale_window_ends(monkeypatch):
    monkeypatch.setattr(memo, "STALE_FOR_S", 0.3)
    loader = Loader(delay_s=0.01)
    cache = Memo(loader, ttl_s=0.05)

    async def scenario():
        await cache.get("k")
        loader.fail = True
        await asyncio.sleep(0.1)
        during = await cache.get("k")  # stale answer; its reload fails in the background
        await asyncio.sleep(0.4)
        with pytest.raises(RuntimeError, match="database down"):
            await cache.get("k")
        return during

    assert asyncio.run(scenario()) == "k:first"


def test_a_full_cache_evicts_the_least_recently_used_entry_and_keeps_the_hot_ones():
    loader = Loader(delay_s=0)
    cache = Memo(loader, ttl_s=60, max_entries=2)

    async def scenario():
        await cache.get("hot")
        await cache.get("cold")
        await cache.get("hot")  # used again: now the most recent
        await cache.get("new")  # one over the bound
        loads_before = loader.calls
        await cache.get("hot")
        return loads_before, loader.calls

    loads_before, loads_after = asyncio.run(scenario())

    assert loads_after == loads_before  # "hot" stayed cached
    assert list(cache.entries) == ["new", "hot"]
