"""The gateway's per-process lookups: one load per key at a time, stale answers while reloading,
and never a wait on the hot path once a key is known."""

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from endpoints.gateway import memo
from endpoints.gateway.memo import Memo


class Loader:
    """A lookup that the test can hold: while `gate` is clear, every load waits for it."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.calls = 0
        self.failures = 0
        self.answer = "first"
        self.fail = False
        self._lock = threading.Lock()

    def __call__(self, key):
        with self._lock:
            self.calls += 1
        assert self.gate.wait(30), "the test never released the load"
        if self.fail:
            with self._lock:
                self.failures += 1
            raise RuntimeError("database down")
        return f"{key}:{self.answer}"


class Ttl:
    """A time to live the test moves: entries expire when it says so, not when a clock does."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self) -> float:
        return self.seconds

    def expire(self) -> None:
        self.seconds = 0  # every entry is older: expired, within the stale window

    def expire_past_the_stale_window(self) -> None:
        self.seconds = -memo.STALE_FOR_S - 1


async def until(condition, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        await asyncio.sleep(0.01)


def test_concurrent_misses_share_one_load():
    loader = Loader()
    loader.gate.clear()
    cache = Memo(loader, ttl_s=10)

    async def storm():
        callers = asyncio.gather(*(cache.get("k") for _ in range(50)))
        await until(lambda: loader.calls >= 1)
        await asyncio.sleep(0)  # every caller has asked by now
        loader.gate.set()
        return await callers

    assert asyncio.run(storm()) == ["k:first"] * 50
    assert loader.calls == 1


def test_an_expired_entry_is_answered_at_once_and_reloaded_once_in_the_background():
    loader = Loader()
    ttl = Ttl(60)
    cache = Memo(loader, ttl_s=ttl)

    async def scenario():
        await cache.get("k")
        ttl.expire()
        loader.answer = "second"
        loader.gate.clear()  # the reload is held: a caller that waited for it would never be answered
        stale = await asyncio.wait_for(asyncio.gather(*(cache.get("k") for _ in range(20))), 30)
        loader.gate.set()
        await until(lambda: cache.entries["k"][1] == "k:second")  # the background reload lands
        loads = loader.calls
        ttl.seconds = 60
        return stale, loads, await cache.get("k")

    stale, loads, fresh = asyncio.run(scenario())

    assert stale == ["k:first"] * 20
    assert loads == 2  # the first load, then one reload for all twenty callers
    assert fresh == "k:second"


def test_an_entry_a_long_call_keeps_is_reloaded_in_the_background_never_waited_for_and_stays_held():
    # A cut Responses stream's prompt is counted by replicas held (`Memo.held`), never loaded then: a stopping process's
    # finish must not wait on PostgreSQL. `directory.keep_replicas_held` keeps them held while the stream runs.
    loader = Loader()
    cache = Memo(loader, ttl_s=0.5)

    async def scenario():
        await cache.get("k")
        cache.entries["k"] = (time.monotonic() - 60, cache.entries["k"][1])  # past its trust: no longer held
        assert cache.held("k") is None
        loader.answer = "second"
        loader.gate.clear()  # the reload is held: a caller that waited for it would never return
        cache.reload_if_older("k", 0.5)
        cache.reload_if_older("k", 0.5)  # one reload at a time
        loader.gate.set()
        await until(lambda: cache.held("k") == "k:second")
        cache.reload_if_older("k", 60)  # younger than that: nothing loaded
        await asyncio.sleep(0.05)
        return loader.calls

    assert asyncio.run(scenario()) == 2


def test_fresh_reads_and_empty_answers_wait_for_the_database():
    loader = Loader()
    ttl = Ttl(60)
    replicas = Memo(lambda key: loader(key) if loader.answer else [], ttl_s=ttl, wait_when_empty=True)

    async def scenario():
        loader.answer = ""
        assert await replicas.get("e") == []
        ttl.expire()
        loader.answer = "ready"
        after_empty = await replicas.get("e")  # an expired empty list is not served stale
        ttl.seconds = 60
        loader.answer = "newer"
        return after_empty, await replicas.get("e", fresh=True)

    assert asyncio.run(scenario()) == ("e:ready", "e:newer")


def test_a_failed_background_reload_keeps_the_old_answer_until_the_stale_window_ends():
    loader = Loader()
    ttl = Ttl(60)
    cache = Memo(loader, ttl_s=ttl)

    async def scenario():
        await cache.get("k")
        loader.fail = True
        ttl.expire()
        during = [await cache.get("k")]  # stale answer; its reload fails in the background
        await until(lambda: loader.failures == 1 and not cache._loading)
        during.append(await cache.get("k"))  # the failed reload left the old answer in place
        await until(lambda: loader.failures == 2 and not cache._loading)
        ttl.expire_past_the_stale_window()
        with pytest.raises(RuntimeError, match="database down"):
            await cache.get("k")
        return during

    assert asyncio.run(scenario()) == ["k:first", "k:first"]


def test_a_full_cache_evicts_the_least_recently_used_entry_and_keeps_the_hot_ones():
    loader = Loader()
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


def test_a_flood_of_new_keys_loads_at_most_the_allowed_number_at_once():
    # Anyone may send well-formed API keys never seen before, each a PostgreSQL query in a worker thread: a flood
    # took up to the pool's 32 threads and as many connections per process, and queued every other lookup.
    from endpoints.gateway import auth

    running, peak, lock = [0], [0], threading.Lock()

    def load(key):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return None

    lookups = Memo(load, 60, max_concurrent_loads=auth.MAX_KEY_LOOKUPS)

    async def flood():
        return await asyncio.gather(*(lookups.get(f"ip_bogus_{index}") for index in range(40)))

    assert asyncio.run(flood()) == [None] * 40
    assert peak[0] == auth.MAX_KEY_LOOKUPS
    assert asyncio.run(flood()) == [None] * 40  # another loop (a test's, a script's) gets its own slots
    assert auth._callers_by_key._load_slots is not None  # the gateway's key lookups are bounded so


def test_the_reload_of_an_entry_in_use_never_waits_behind_a_flood_of_first_loads():
    # The loads were capped together: an endpoint's reload (every 2 s) queued behind every made-up name looked up
    # before it, another tenant's flood stalling its calls. Only first loads take a slot now.
    released = threading.Event()

    def load(key):
        if key.startswith("made-up"):
            released.wait(10)
            return None
        return key

    lookups = Memo(load, 60, max_concurrent_loads=1)

    async def scenario():
        await lookups.get("in-use")
        flood = [asyncio.ensure_future(lookups.get(f"made-up-{index}")) for index in range(5)]
        await asyncio.sleep(0.05)  # the first made-up name holds the one slot, the others wait for it
        try:
            reloaded = await asyncio.wait_for(lookups.get("in-use", fresh=True), 5)
            return reloaded, sum(task.done() for task in flood)
        finally:
            released.set()
            await asyncio.gather(*flood)

    assert asyncio.run(scenario()) == ("in-use", 0)


def test_listing_models_reads_the_database_once_per_organisation_and_ttl(monkeypatch):
    # `GET /v1/models` is not rate-limited: each call was a query of the organisation's endpoints, however often
    # a client (or an attacker with a key) asked.
    from endpoints.gateway import directory

    loads = []

    async def load(organization_id):
        loads.append(organization_id)
        return []

    monkeypatch.setattr(directory._models, "_load", load)
    directory._models.clear()

    async def list_often():
        return [await directory.list_endpoints(7) for _ in range(20)]

    assert asyncio.run(list_often()) == [[]] * 20
    assert loads == [7]


def test_callers_woken_by_one_message_share_one_fresh_read_and_never_take_an_older_one():
    # The calls held for an adapter's load (`adapter_hold`): each woken by the endpoint's message read the replicas
    # fresh, one read per call per message; a read begun before the message may miss what it announced.
    loader = Loader()
    cache = Memo(loader, ttl_s=60)

    async def scenario():
        await cache.get("k")
        loader.gate.clear()
        older = asyncio.ensure_future(cache.get("k", fresh=True))  # begun before the message: not taken
        await until(lambda: loader.calls == 2)
        loader.answer = "announced"
        arrived_at = time.monotonic()
        woken = asyncio.gather(*(cache.get("k", fresh_since=arrived_at) for _ in range(20)))
        await until(lambda: loader.calls == 3)
        await asyncio.sleep(0.05)  # every woken caller has asked by now
        loader.gate.set()
        answers = await woken
        await older
        return answers, await cache.get("k", fresh_since=arrived_at)

    answers, after = asyncio.run(scenario())

    assert answers == ["k:announced"] * 20 and after == "k:announced"
    assert loader.calls == 3  # the first load, the older fresh read, then one for the twenty woken and the one after


def _grouped(max_entries: int) -> Memo:
    # a key "org/n" loads a value of group "org"
    return Memo(lambda key: key, ttl_s=60, max_entries=max_entries,
                group_of=lambda value: value.split("/")[0] or None)  # "/n": of no group, never kept


def _check_groups(cache: Memo) -> None:
    """The grouped cache's bookkeeping says what its entries hold, and is bounded by them."""
    assert len(cache.entries) <= cache.max_entries
    by_group: dict = {}
    for key, (_, value, order, group) in cache.entries.items():
        assert group == cache._group_of(value) and cache._groups[group] is order and key in order
        by_group[group] = by_group.get(group, 0) + 1
    assert {group: len(order) for group, order in cache._groups.items()} == by_group
    sizes: dict = {}
    for group, size in by_group.items():
        sizes.setdefault(size, set()).add(group)
    assert {size: set(groups) for size, groups in cache._groups_of_size.items()} == sizes
    assert cache._largest == max(by_group.values(), default=0)


def test_a_grouped_cache_evicts_from_the_group_holding_the_most_never_a_quiet_groups_hot_entry():
    cache = _grouped(max_entries=10)

    async def scenario():
        await cache.get("quiet/1")
        await cache.get("quiet/2")
        for _ in range(3):  # three groups, 20 keys each, in turn: far more than the cache holds
            for n in range(20):
                for flooding in ("a", "b", "c"):
                    await cache.get(f"{flooding}/{n}")
                    _check_groups(cache)

    asyncio.run(scenario())
    assert {"quiet/1", "quiet/2"} <= set(cache.entries)
    assert sorted(len(order) for order in cache._groups.values()) == [2, 2, 3, 3]


def test_a_grouped_caches_bookkeeping_follows_any_sequence_of_loads_hits_and_forgets():
    import random

    rng = random.Random(7)
    cache = _grouped(max_entries=16)

    async def scenario():
        for _ in range(3000):
            key = f"{rng.choice(['a', 'b', 'c', 'd', 'e', 'f', 'g', ''])}/{rng.randrange(12)}"
            if rng.random() < 0.15:
                cache.forget(key)
            else:
                await cache.get(key, fresh=rng.random() < 0.1)
            _check_groups(cache)
            assert not any(key.startswith("/") for key in cache.entries)
        cache.clear()
        _check_groups(cache)

    asyncio.run(scenario())
    assert cache.entries == {} and cache._groups == {} and cache._groups_of_size == {}


def test_a_grouped_cache_evicts_its_own_least_recently_used_entry_when_its_group_is_the_largest():
    cache = _grouped(max_entries=4)

    async def scenario():
        for key in ("a/1", "a/2", "a/3", "b/1"):
            await cache.get(key)
        await cache.get("a/1")  # used again: "a/2" is now a's least recently used
        await cache.get("a/4")

    asyncio.run(scenario())
    assert set(cache.entries) == {"a/1", "a/3", "a/4", "b/1"}


def test_a_grouped_cache_where_every_group_holds_one_entry_keeps_a_new_groups_and_drops_the_least_recently_loaded():
    cache = _grouped(max_entries=3)

    async def scenario():
        for key in ("a/1", "b/1", "c/1"):
            await cache.get(key)
        await cache.get("a/1", fresh=True)  # loaded again: b's is now the one loaded least recently
        await cache.get("d/1")
        _check_groups(cache)

    asyncio.run(scenario())
    assert set(cache.entries) == {"a/1", "c/1", "d/1"}


_OPS = st.one_of(
    # a load of `key` whose value names `group` (None: a key that names none), fresh or not, left in flight
    st.tuples(st.just("load"), st.integers(0, 5), st.sampled_from(["a", "b", "c", "d", None]), st.booleans()),
    st.tuples(st.just("land"), st.integers(0, 20), st.booleans()),  # one load in flight lands (or fails)
    st.tuples(st.just("hit"), st.integers(0, 5)),
    st.tuples(st.just("forget"), st.integers(0, 5)),
    st.tuples(st.just("clear"),),
)


@settings(max_examples=400, deadline=None)
@given(max_entries=st.integers(1, 4), ops=st.lists(_OPS, max_size=60))
def test_a_grouped_caches_bookkeeping_holds_under_any_interleaving_of_loads_in_flight_forgets_and_clears(
        max_entries, ops):
    # NOTE: loads land in any order, after their key was evicted, forgotten or cleared, and a key's group may
    # change between loads: the bookkeeping must still say what the entries hold.
    cache = Memo(lambda value: value, ttl_s=60, max_entries=max_entries,
                 group_of=lambda value: None if value is None else value.split("/")[0])
    in_flight: list = []

    async def held_load(value):
        landing = asyncio.get_running_loop().create_future()
        in_flight.append(landing)
        if await landing:
            raise RuntimeError("database down")
        return value

    cache._load = held_load

    async def settle():
        for _ in range(5):
            await asyncio.sleep(0)

    async def scenario():
        callers = []
        for op in ops:
            if op[0] == "load":
                _, key, group, fresh = op
                value = None if group is None else f"{group}/{key}"
                callers.append(asyncio.ensure_future(cache.get(key, value, fresh=fresh)))
            elif op[0] == "land" and in_flight:
                landing = in_flight.pop(op[1] % len(in_flight))
                landing.set_result(op[2])
            elif op[0] == "hit" and cache.answers_at_once(op[1]):
                await cache.get(op[1])
            elif op[0] == "forget":
                cache.forget(op[1])
            elif op[0] == "clear":
                cache.clear()
            await settle()
            _check_groups(cache)
            assert all(entry[1] is not None for entry in cache.entries.values())
        while in_flight:
            in_flight.pop(0).set_result(False)
            await settle()
            _check_groups(cache)
        answers = await asyncio.gather(*callers, return_exceptions=True)
        # each caller has what its load read, or the database's failure: never the bookkeeping's own error
        assert all(not isinstance(answer, Exception) or str(answer) == "database down" for answer in answers), answers

    asyncio.run(scenario())
