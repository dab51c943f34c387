"""The counter rebuild threads shared fairly between organisations: one organisation's slow rebuilds hold at most
`REBUILD_THREADS_PER_ORGANIZATION` of them, the last free one is kept for an organisation holding none, and a
rebuild's reads all give up at its window.

A rebuild is slowed by a real lock: the test holds a PostgreSQL advisory lock, and the slow organisation's key counter
reads wait for it in their snapshot (a test-only wrapper around the ledger read), as a read held up by a huge ledger or
a lock would; or a table's or a row's lock, as a migration or a webhook holds them."""

import asyncio
import contextlib
import time
from decimal import Decimal

import psycopg
import pytest
from django.db import connection

from billing.models import ApiKeySpendCap, BillingAccount
from billing.periods import period_containing
from billing.quota import reads, rebuild
from billing.quota.rebuild import RebuildTooSlow, RebuildUnfinished
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
    # kept as taking twice its window (how long it would have taken is not known): its next window, twice that
    assert took is not None and int(took) == 2 * rebuild.REBUILD_MAX_S
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


def _key_counter_lost(organization) -> tuple[ApiKey, str]:
    (key,) = _keys(organization, 1)
    asyncio.run(_reserve(organization.pk, key.pk, "first"))  # every counter built
    counter = redis_keys.key_period_key(organization.pk, key.pk, period_containing().key)
    get_redis().delete(counter)
    return key, counter


def test_a_rebuilds_reads_together_end_at_its_window(monkeypatch):
    # Before, each read of the snapshot was given the whole window: three reads each just under it held the rebuild's
    # thread (and its call) three windows, and after the window had grown to an hour, three hours.
    organization = OrganizationFactory()
    key, _counter = _key_counter_lost(organization)
    monkeypatch.setattr(rebuild, "REBUILD_MAX_S", 1)
    finished = []

    def slow(name):
        read = getattr(rebuild, name)

        def slow_read(*args, **kwargs):
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_sleep(0.45)")  # under the window, and three of them over it
            finished.append(name)
            return read(*args, **kwargs)

        monkeypatch.setattr(rebuild, name, slow_read)

    for name in ("_replays_in_snapshot", "period_spend_and_pending", "_held"):
        slow(name)

    with pytest.raises(RebuildTooSlow):
        asyncio.run(_reserve(organization.pk, key.pk, "held-up"))
    assert "_held" not in finished, f"every read ran to its end: {finished}"


def test_a_read_outside_the_snapshot_held_up_by_a_table_lock_is_cancelled_at_the_window(monkeypatch):
    # Before, the key's cap (read after the snapshot) and the account (before it) had no timeout: a migration holding
    # the table's lock held the rebuild's thread, its slot and its call for as long as it lasted.
    organization = OrganizationFactory()
    key, _counter = _key_counter_lost(organization)
    monkeypatch.setattr(rebuild, "REBUILD_MAX_S", 1)

    async def held_up_call() -> BaseException | None:
        call = asyncio.ensure_future(_reserve(organization.pk, key.pk, "held-up"))
        done, _ = await asyncio.wait({call}, timeout=WAIT_S)
        holder.rollback()  # the migration ends
        assert done, "the read of the key's cap waited for the table's lock"
        return call.exception()

    with psycopg.connect(**_connection_params()) as holder:
        holder.execute(f"LOCK TABLE {ApiKeySpendCap._meta.db_table} IN ACCESS EXCLUSIVE MODE")
        refused = asyncio.run(held_up_call())

    assert isinstance(refused, RebuildTooSlow)
    asyncio.run(_reserve(organization.pk, key.pk, "after"))  # the lock gone, the next rebuild writes it
    assert reads.reserved_now(organization.pk) == Decimal("0.02")


def test_reading_an_organisations_limits_again_gives_up_on_its_account_row_held_locked(monkeypatch):
    # Before, the refresh after an organisation counter's rebuild waited for the account's row lock (a webhook's or a
    # migration's transaction) for as long as it was held, in its slot, on its thread, its call held all that while.
    organization = OrganizationFactory()
    asyncio.run(_reserve(organization.pk, None, "first"))
    get_redis().delete(redis_keys.org_period_key(organization.pk, period_containing().key))
    monkeypatch.setattr(rebuild, "LIMITS_AGAIN_MAX_S", 0.5)
    account = BillingAccount.objects.for_organization(organization.pk)

    async def call_while_locked() -> bool:
        call = asyncio.ensure_future(_reserve(organization.pk, None, "while-locked"))
        done, _ = await asyncio.wait({call}, timeout=WAIT_S)
        holder.rollback()
        await call
        assert rebuild._rebuild_slots.num_held(organization.pk) == 0
        return bool(done)

    with psycopg.connect(**_connection_params()) as holder:
        holder.execute(
            f"SELECT 1 FROM {BillingAccount._meta.db_table} WHERE id = %s FOR UPDATE", [account.pk]
        )
        admitted = asyncio.run(call_while_locked())

    assert admitted, "the call waited for the account's row lock"
    assert reads.reserved_now(organization.pk) == Decimal("0.02")  # the counter rebuilt, its limits as read


def test_a_rebuild_cancelled_by_an_operator_is_a_503_that_leaves_the_next_window_as_it_was(monkeypatch):
    # Before, any cancel counted as the window passing: an operator's `pg_cancel_backend` moments in answered
    # `RebuildTooSlow`, logged it as taking over the window, and doubled the counter's next window.
    organization = OrganizationFactory()
    key, counter = _key_counter_lost(organization)

    async def cancelled_call(holder) -> BaseException | None:
        call = asyncio.ensure_future(_reserve(organization.pk, key.pk, "cancelled"))
        waiting = []

        def read_waits() -> bool:
            waiting[:] = holder.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objid = %s AND NOT granted",
                [LEDGER_LOCK],
            ).fetchall()
            return bool(waiting)

        assert await _until(read_waits)
        holder.execute("SELECT pg_cancel_backend(%s)", [waiting[0][0]])  # an operator's cancel
        done, _ = await asyncio.wait({call}, timeout=WAIT_S)
        assert done
        return call.exception()

    with _ledger_locked(organization, monkeypatch) as (_num_waiting, _release):
        with psycopg.connect(**_connection_params(), autocommit=True) as operator:
            refused = asyncio.run(cancelled_call(operator))

    assert isinstance(refused, RebuildUnfinished) and not isinstance(refused, RebuildTooSlow), repr(refused)
    took = get_redis().hget(redis_keys.rebuilding_key(organization.pk), f"{rebuild.TOO_SLOW_PREFIX}{counter}")
    assert took is None  # its next window: as it was
    asyncio.run(_reserve(organization.pk, key.pk, "after"))
    assert reads.reserved_now(organization.pk) == Decimal("0.02")


def test_a_ledger_slower_than_its_window_is_refused_once_before_its_counter_is_written(monkeypatch):
    # Before, a read cancelled at the window was kept as taking the window: a ledger taking 2.5 windows to read was
    # refused (503) at windows of 1 and 2 before the third (4) wrote it; a read to the end, as before reads were
    # cancelled, once.
    organization = OrganizationFactory()
    asyncio.run(_reserve(organization.pk, None, "first"))
    get_redis().delete(redis_keys.org_period_key(organization.pk, period_containing().key))
    monkeypatch.setattr(rebuild, "REBUILD_MAX_S", 1)
    read = rebuild.period_spend_and_pending

    def slow_read(*args, **kwargs):
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_sleep(2.5)")  # a ledger that takes 2.5 windows to read
        return read(*args, **kwargs)

    monkeypatch.setattr(rebuild, "period_spend_and_pending", slow_read)
    num_refused = 0
    for attempt in range(4):
        try:
            asyncio.run(_reserve(organization.pk, None, f"try-{attempt}"))
            break
        except RebuildTooSlow:
            num_refused += 1
    assert num_refused == 1
    assert reads.reserved_now(organization.pk) == Decimal("0.02")
