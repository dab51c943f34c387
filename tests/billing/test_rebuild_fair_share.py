"""The counter rebuild threads shared fairly between organisations: one organisation's slow rebuilds hold at most
`REBUILD_THREADS_PER_ORGANIZATION` of them, the last free one is kept for an organisation holding none, and each
read gives up at its rebuild's window.

A rebuild is slowed by a real lock: the test holds a PostgreSQL advisory lock, and the slow organisation's key counter
reads wait for it in their snapshot (a test-only wrapper around the ledger read), as a read held up by a huge ledger or
a lock would."""

import asyncio
import contextlib
import time
from decimal import Decimal

import psycopg
import pytest
from django.db import connection

from billing.periods import period_containing
from billing.quota import reads, rebuild
from billing.quota.rebuild import RebuildTooSlow
from controlplane import redis_keys
from controlplane.accounts.models import ApiKey
from controlplane.redis_client import get_redis
from controlplane.worker_threads import FairSlots
from endpoints.gateway import admission
from endpoints.gateway.auth import Caller
from tests.factories import OrganizationFactory

# NOTE: admission rebuilds counters in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

ENDPOINT = "0b7a1d7e-0000-4000-8000-000000000003"
LEDGER_LOCK = 0x5EB1  # the advisory lock the slow organisation's key counter reads wait for
WAIT_S = 20  # far longer than any rebuild here takes when it is not held up


async def _reserve(organization_id: int, api_key_id: int | None, request_id: str) -> admission.Admission:
    caller = Caller(
        organization_id=organization_id,
        api_key_id=api_key_id,
        user_id=1,
        can_infer=True,
        requests_per_minute=0,
        tokens_per_minute=0,
    )
    return await admission.admit(
        caller=caller,
        endpoint_id=ENDPOINT,
        request_id=request_id,
        amount=Decimal("0.01"),
        num_tokens=0,
        candidates=[],
    )


def _keys(organization, number: int) -> list[ApiKey]:
    return [
        ApiKey.objects.create(
            organization=organization, name=f"k{n}", lookup=f"k{n}-{organization.pk}", digest="x"
        )
        for n in range(number)
    ]


def _connection_params() -> dict:
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    return params


@contextlib.contextmanager
def _ledger_locked(organizations, monkeypatch):
    """While it lasts, each key counter read of `organizations` (one or several) waits (in its snapshot, on its
    rebuild thread's own connection) for an advisory lock this test holds; yields how many wait now, and the lock's
    release."""
    read = rebuild.period_spend_and_pending
    if not isinstance(organizations, list):
        organizations = [organizations]
    held_up = {organization.pk for organization in organizations}

    def held_up_read(organization_id, *args, api_key_id=None, **kwargs):
        if organization_id in held_up and api_key_id is not None:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock_shared(%s)", [LEDGER_LOCK])
        return read(organization_id, *args, api_key_id=api_key_id, **kwargs)

    with psycopg.connect(**_connection_params(), autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", [LEDGER_LOCK])
        monkeypatch.setattr(rebuild, "period_spend_and_pending", held_up_read)

        def num_waiting() -> int:
            return holder.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s AND NOT granted",
                [LEDGER_LOCK],
            ).fetchone()[0]

        try:
            yield num_waiting, lambda: holder.execute("SELECT pg_advisory_unlock(%s)", [LEDGER_LOCK])
        finally:
            holder.execute("SELECT pg_advisory_unlock_all()")


async def _until(condition, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def test_one_organisations_slow_key_counters_leave_other_organisations_rebuilds_a_thread(monkeypatch):
    # Redis lost every counter; one organisation's eight keys each need their counter rebuilt, and each read is held
    # up (a huge ledger, or one made slow on purpose). Before, four of them took all four rebuild threads and the
    # other organisation's rebuild waited behind them, its call held until they ended (or a 503 past its window).
    slow, other = OrganizationFactory(), OrganizationFactory()
    keys = _keys(slow, 2 * rebuild.REBUILD_THREADS)
    get_redis().flushdb()

    async def scenario(num_waiting, release) -> tuple[bool, int]:
        slow_calls = asyncio.gather(*(_reserve(slow.pk, key.pk, f"slow-{key.pk}") for key in keys))
        try:
            assert await _until(lambda: num_waiting() >= rebuild.REBUILD_THREADS_PER_ORGANIZATION)
            other_call = asyncio.ensure_future(_reserve(other.pk, None, "other"))
            done, _ = await asyncio.wait({other_call}, timeout=WAIT_S)
            num_held_up = num_waiting()
            release()
            await other_call
            return bool(done), num_held_up
        finally:
            release()
            await slow_calls

    with _ledger_locked(slow, monkeypatch) as (num_waiting, release):
        other_rebuilt, num_held_up = asyncio.run(scenario(num_waiting, release))

    assert other_rebuilt, "the other organisation's rebuild waited for the slow organisation's"
    assert num_held_up == rebuild.REBUILD_THREADS_PER_ORGANIZATION, (
        f"{num_held_up} threads held by one organisation"
    )
    assert reads.reserved_now(other.pk) == Decimal("0.01")
    # its queued counters all rebuilt in turn
    assert reads.reserved_now(slow.pk) == len(keys) * Decimal("0.01")


def test_a_rebuild_read_held_up_past_its_window_is_cancelled_and_its_next_rebuild_is_given_longer(
    monkeypatch,
):
    # Before, a read held up (a lock, a huge ledger) held its rebuild thread and connection until it ended, however
    # long past the window that made its rebuild write nothing; its call waited all that while.
    organization = OrganizationFactory()
    (key,) = _keys(organization, 1)
    asyncio.run(_reserve(organization.pk, key.pk, "first"))  # every counter built
    counter = redis_keys.key_period_key(organization.pk, key.pk, period_containing().key)
    get_redis().delete(counter)
    monkeypatch.setattr(rebuild, "REBUILD_MAX_S", 1)

    async def held_up_call(num_waiting) -> BaseException | None:
        call = asyncio.ensure_future(_reserve(organization.pk, key.pk, "held-up"))
        done, _ = await asyncio.wait({call}, timeout=WAIT_S)
        assert done, "the held-up read was not cancelled at its window"
        assert num_waiting() == 0  # its thread's read is gone from PostgreSQL
        return call.exception()

    with _ledger_locked(organization, monkeypatch) as (num_waiting, _release):
        refused = asyncio.run(held_up_call(num_waiting))

    assert isinstance(refused, RebuildTooSlow)  # a 503 with Retry-After, as a rebuild that read to the end
    took = get_redis().hget(redis_keys.rebuilding_key(organization.pk), f"{rebuild.TOO_SLOW_PREFIX}{counter}")
    assert took is not None and int(took) >= 1  # its next window: twice that
    asyncio.run(_reserve(organization.pk, key.pk, "after"))  # the lock gone, the next rebuild writes it
    assert reads.reserved_now(organization.pk) == Decimal("0.02")


def test_a_freed_slot_goes_to_the_organisation_holding_fewest_before_a_busy_ones_next():
    slots = FairSlots(3, per_owner=2)
    order = []

    async def scenario():
        release = asyncio.Event()

        async def hold(owner, name):
            async with slots.held(owner):
                order.append(name)
                await release.wait()

        busy = [asyncio.ensure_future(hold("busy", f"busy-{n}")) for n in range(4)]
        await asyncio.sleep(0)
        light = asyncio.ensure_future(hold("light", "light"))
        await asyncio.sleep(0)
        other = asyncio.ensure_future(hold("other", "other"))
        await asyncio.sleep(0)
        # the pool is full: busy and other wait, in their own queues
        assert order == ["busy-0", "busy-1", "light"]
        release.set()
        await asyncio.gather(*busy, light, other)

    asyncio.run(scenario())
    assert order == ["busy-0", "busy-1", "light", "other", "busy-2", "busy-3"]


def test_an_organisation_already_holding_a_slot_leaves_the_last_free_one_to_an_organisation_holding_none():
    slots = FairSlots(4, per_owner=2)

    async def scenario() -> list[str]:
        release, entered = asyncio.Event(), []

        async def hold(owner):
            async with slots.held(owner):
                entered.append(owner)
                await release.wait()

        hostile = [asyncio.ensure_future(hold(owner)) for owner in ("a1", "a1", "a1", "a2", "a2", "a2")]
        await asyncio.sleep(0)
        victim = asyncio.ensure_future(hold("victim"))
        await asyncio.sleep(0)
        holders = list(entered)
        release.set()
        await asyncio.gather(*hostile, victim)
        assert sorted(entered) == ["a1", "a1", "a1", "a2", "a2", "a2", "victim"]
        return holders

    # before, a1 and a2 (a stranger can make a second organisation) held all four and the victim waited behind them
    assert asyncio.run(scenario()) == ["a1", "a1", "a2", "victim"]


def test_a_waiter_cancelled_after_it_was_given_a_slot_passes_the_slot_on():
    slots = FairSlots(1, per_owner=1)

    async def scenario() -> list[str]:
        entered = []

        async def hold(owner):
            async with slots.held(owner):
                entered.append(owner)

        async with slots.held("a"):
            given_then_cancelled, after = asyncio.ensure_future(hold("b")), asyncio.ensure_future(hold("c"))
            await asyncio.sleep(0)  # both wait for the one slot
        given_then_cancelled.cancel()  # given the slot as "a" let it go, cancelled before it ran
        await asyncio.gather(given_then_cancelled, after, return_exceptions=True)
        assert slots.num_held("b") == slots.num_held("c") == 0
        return entered

    assert asyncio.run(scenario()) == ["c"]


def test_two_organisations_slow_key_counters_leave_a_third_organisations_rebuild_a_thread(monkeypatch):
    # Before, two organisations' slow counters (a stranger can make a second organisation) took two threads each, all
    # four, and a third organisation's rebuild waited behind them.
    slow, also_slow, other = OrganizationFactory(), OrganizationFactory(), OrganizationFactory()
    keys = _keys(slow, 3) + _keys(also_slow, 3)
    get_redis().flushdb()

    async def scenario(num_waiting, release) -> tuple[bool, int]:
        slow_calls = asyncio.gather(
            *(_reserve(key.organization_id, key.pk, f"slow-{key.pk}") for key in keys)
        )
        try:
            assert await _until(lambda: num_waiting() >= rebuild.REBUILD_THREADS - 1)
            other_call = asyncio.ensure_future(_reserve(other.pk, None, "other"))
            done, _ = await asyncio.wait({other_call}, timeout=WAIT_S)
            num_held_up = num_waiting()
            release()
            await other_call
            return bool(done), num_held_up
        finally:
            release()
            await slow_calls

    with _ledger_locked([slow, also_slow], monkeypatch) as (num_waiting, release):
        other_rebuilt, num_held_up = asyncio.run(scenario(num_waiting, release))

    assert other_rebuilt, "the third organisation's rebuild waited for the two slow organisations'"
    # the last thread was kept for an organisation holding none
    assert num_held_up == rebuild.REBUILD_THREADS - 1
    assert reads.reserved_now(other.pk) == Decimal("0.01")
    assert reads.reserved_now(slow.pk) == reads.reserved_now(also_slow.pk) == 3 * Decimal("0.01")
