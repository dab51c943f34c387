"""Spend counters rebuilt while Redis loses a call's hold more than once: each call counted once.

A counter Redis lost is rebuilt from the ledger (`billing.quota.rebuild`) and told what was settled meanwhile; these
tests drive a rebuild step by step against real Redis and PostgreSQL, with the hold lost, held again and lost again
around it, as a flush, a restart or a failover leaves it."""

import asyncio
import dataclasses
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing import periods, usage_writer
from billing.credits import grant_credits
from billing.ledger import record_usage
from billing.models import BillingMode, UsageRecord
from billing.quota import reads, rebuild, sweeper
from billing.quota.counters import from_units, record_progress
from billing.services import set_billing_mode, set_key_spend_cap
from controlplane import redis_keys
from controlplane.accounts.models import ApiKey
from controlplane.accounts.services import SYSTEM
from controlplane.redis_client import get_async_redis, get_redis
from endpoints.gateway import presence
from tests.billing.conftest import usage_report
from tests.billing.test_quota import (
    _cap,
    _holds_and_counter_lost,
    _in_another_connection,
    _progress,
    reserve,
    settle,
)
from tests.factories import EndpointFactory

# NOTE: admission rebuilds counters in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def gateway(monkeypatch, settings):
    """This process's gateway, serving nothing yet; a reservation holds ten minutes."""
    settings.BILLING_RESERVATION_TTL_S = 600
    monkeypatch.setattr(presence, "serving", {})
    monkeypatch.setattr(presence, "_repair", presence._Repair())
    monkeypatch.setattr(presence, "_extended", presence._Extended())


def _running_with_its_row(endpoint, request_id: str):
    """A call admitted and tracked by this gateway, served a while, its usage row written and not settled yet: its
    admission, its `presence.Held` and its cost."""
    admitted = asyncio.run(reserve(organization_id=endpoint.organization_id, api_key_id=None, amount=Decimal("0.50"),
                                   request_id=request_id))
    held = presence.track(request_id, endpoint.organization_id, str(endpoint.pk), None,
                          reservation=admitted.reservation)
    held.since -= 120  # served two minutes: its beat pushes its deadline on
    held.writes_row = True  # as its gateway does before its row's write (the call tracked until it returns)
    record_usage(dataclasses.replace(usage_report(endpoint, request_id=request_id), max_cost=Decimal("0.50")))
    return admitted, held, UsageRecord.objects.get(request_id=request_id).cost


class _Later:
    """Redis as the gateway's beat finds it `seconds` later (its clock read then)."""

    def __init__(self, redis, seconds: int):
        self._redis, self._seconds = redis, seconds

    async def time(self):
        seconds, microseconds = await self._redis.time()
        return seconds + self._seconds, microseconds

    def pipeline(self, **kwargs):
        return self._redis.pipeline(**kwargs)


def _beat_pushes_deadlines_on(seconds_later: int) -> None:
    async def beat():
        await presence._push_deadlines_on(_Later(get_async_redis(), seconds_later))

    asyncio.run(beat())


def _held_again(organization_id: int, request_id: str, held) -> None:
    """Its gateway's reconcile holds the call again after Redis lost its hold (`presence._hold_again`)."""
    assert asyncio.run(presence._hold_again(organization_id, [(request_id, held)])) == 1


def test_a_call_whose_hold_was_lost_again_after_it_was_held_again_its_deadline_pushed_after_a_rebuild_counts_once(
        gateway):
    # Found by a review: Redis lost the call's hold (a flush), its gateway held it again, Redis lost it again; a call
    # rebuilt the counter (its snapshot has the row, the call not reserved), then the gateway's beat pushed the call's
    # deadline on (a minute later, here 10 s) and the call settled with no hold. Before, the push took the call as held
    # though nothing was pushed (ZADD XX found no deadline), so the counter rebuilt before it was not dropped and the
    # settlement added the cost on top of the snapshot: counted twice.
    endpoint = EndpointFactory()
    organization = endpoint.organization
    _cap(organization, "1.00")
    running, held, cost = _running_with_its_row(endpoint, "req_running")
    _holds_and_counter_lost(organization.pk)
    _held_again(organization.pk, "req_running", held)
    _holds_and_counter_lost(organization.pk)
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"), request_id="next"))
    assert reads.counted_spend(organization.pk) == cost > 0  # the rebuild's snapshot has the row

    _beat_pushes_deadlines_on(10)
    asyncio.run(settle(running, cost, fresh_id=True, lapsed_at=held.lapses_at))
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"), request_id="after"))

    assert reads.counted_spend(organization.pk) == cost
    assert reads.reserved_now(organization.pk) == Decimal("0.02")


def test_a_beat_takes_a_call_as_held_only_where_its_deadline_was_pushed_on(gateway):
    # A guard of the push itself: a call still held has its deadline pushed on and is taken as held from then; one whose
    # hold Redis lost keeps the time it was last known held.
    endpoint = EndpointFactory()
    kept, kept_held, _ = _running_with_its_row(endpoint, "req_kept")
    lost, lost_held, _ = _running_with_its_row(endpoint, "req_lost")
    get_redis().hdel(redis_keys.reservations_key(endpoint.organization_id), "req_lost")
    get_redis().zrem(redis_keys.deadlines_key(endpoint.organization_id), "req_lost")
    lost_before, kept_before = lost_held.lapses_at, kept_held.lapses_at

    _beat_pushes_deadlines_on(10)

    assert kept_held.lapses_at >= kept_before + 9
    assert lost_held.lapses_at == lost_before


def test_a_call_held_again_after_its_counters_rebuild_was_written_counts_once(gateway):
    # Redis lost the counter and the call's hold after its row was written; a call rebuilt the counter at once (its
    # snapshot has the row, the call not reserved) and wrote it; then the call's gateway held it again and the call
    # settled, its hold found. Before, the settlement added its cost to the counter that had it: counted twice. Now the
    # hold again drops a counter rebuilt since its call was last known held, and the next call rebuilds it, the call
    # reserved then.
    endpoint = EndpointFactory()
    organization = endpoint.organization
    _cap(organization, "1.00")
    running, held, cost = _running_with_its_row(endpoint, "req_running")
    _holds_and_counter_lost(organization.pk)
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"), request_id="next"))
    assert reads.counted_spend(organization.pk) == cost > 0

    _held_again(organization.pk, "req_running", held)
    asyncio.run(settle(running, cost, fresh_id=True, lapsed_at=held.lapses_at))
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"), request_id="after"))

    assert reads.counted_spend(organization.pk) == cost
    assert reads.reserved_now(organization.pk) == Decimal("0.02")


@pytest.mark.parametrize("what", ["key", "credit"])
def test_a_call_held_again_after_its_key_counter_or_credit_figure_was_rebuilt_counts_once(gateway, what):
    # As above, for its key's counter and for the credit figure (a prepaid call): before, the settlement added its cost
    # to the key's counter, or took it from the figure, rebuilt from a snapshot that had its row: counted twice.
    endpoint = EndpointFactory()
    organization = endpoint.organization
    _cap(organization, "1.00")
    key = None
    if what == "key":
        key = ApiKey.objects.create(organization=organization, name="k", lookup="heldagain", digest="x")
        set_key_spend_cap(SYSTEM, key, spend_cap=Decimal("1.00"))
    else:
        set_billing_mode(SYSTEM, organization, mode=BillingMode.PREPAID)
        grant_credits(SYSTEM, organization, amount=Decimal("2.00"), expires_at=timezone.now() + timedelta(days=30))
    api_key_id = key.pk if key else None
    admitted = asyncio.run(reserve(organization_id=organization.pk, api_key_id=api_key_id, amount=Decimal("0.50"),
                                   request_id="req_running"))
    held = presence.track("req_running", organization.pk, str(endpoint.pk), None, reservation=admitted.reservation)
    held.writes_row = True
    record_usage(dataclasses.replace(usage_report(endpoint, api_key=key, request_id="req_running"),
                                     max_cost=Decimal("0.50"), billing_mode=admitted.billing_mode))
    cost = UsageRecord.objects.get(request_id="req_running").cost
    counter = (redis_keys.key_period_key(organization.pk, api_key_id, periods.period_containing().key) if key
               else redis_keys.credit_key(organization.pk))
    get_redis().delete(counter, redis_keys.reservations_key(organization.pk), redis_keys.deadlines_key(organization.pk),
                       redis_keys.org_reserved_key(organization.pk),
                       *([redis_keys.key_reserved_key(organization.pk, api_key_id)] if key else []))
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=api_key_id, amount=Decimal("0.01"),
                        request_id="next"))  # its rebuild's snapshot has the row, the call not reserved

    _held_again(organization.pk, "req_running", held)
    asyncio.run(settle(admitted, cost, fresh_id=True, lapsed_at=held.lapses_at))
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=api_key_id, amount=Decimal("0.01"),
                        request_id="after"))

    assert cost > 0
    assert reads.counted_spend(organization.pk) == cost
    if key:
        assert from_units(int(get_redis().hget(counter, "spent"))) == cost
    else:
        assert from_units(int(get_redis().get(counter))) == Decimal("2.00") - cost


def test_a_running_call_held_again_after_its_counters_rebuild_leaves_the_counter_and_counts_once(gateway):
    # A guard (passes either way): after a flush, a call still streaming (no row yet) is held again after a rebuild
    # wrote the counter; that snapshot cannot have its row, so the counter is kept (no second rebuild of every
    # organisation's counters after a flush) and the call's settlement adds its cost once.
    endpoint = EndpointFactory()
    organization = endpoint.organization
    _cap(organization, "1.00")
    admitted = asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.50"),
                                   request_id="req_streaming"))
    held = presence.track("req_streaming", organization.pk, str(endpoint.pk), None, reservation=admitted.reservation)
    _holds_and_counter_lost(organization.pk)
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"), request_id="next"))
    counter = redis_keys.org_period_key(organization.pk, periods.period_containing().key)
    rebuilt_at = get_redis().hget(counter, "rb")

    _held_again(organization.pk, "req_streaming", held)
    assert get_redis().hget(counter, "rb") == rebuilt_at  # kept
    held.writes_row = True
    record_usage(dataclasses.replace(usage_report(endpoint, request_id="req_streaming"), max_cost=Decimal("0.50")))
    cost = UsageRecord.objects.get(request_id="req_streaming").cost
    asyncio.run(settle(admitted, cost, fresh_id=True, lapsed_at=held.lapses_at))

    assert reads.counted_spend(organization.pk) == cost > 0
    assert reads.reserved_now(organization.pk) == Decimal("0.01")


@pytest.mark.parametrize("what", ["org", "credit"])
def test_a_lost_row_swept_while_its_counter_is_missing_is_counted_once_by_a_rebuild_begun_after(gateway, what):
    # A rebuild of the counter (or of the credit figure) began and its gateway was killed before its write (its window
    # still open); the sweeper then wrote a lost gateway's call's `gateway_lost` row from its progress and settled it,
    # leaving its cost to the rebuild (`m:`); the next call's rebuild began after (the call no longer reserved) with the
    # row in its snapshot. Before, the rebuild did not take a `gateway_lost` row as one its snapshot has for that note,
    # and added the cost on top of it: counted twice (drawn twice from the credit).
    endpoint = EndpointFactory()
    organization = endpoint.organization
    _cap(organization, "1.00")
    if what == "credit":
        set_billing_mode(SYSTEM, organization, mode=BillingMode.PREPAID)
        grant_credits(SYSTEM, organization, amount=Decimal("2.00"), expires_at=timezone.now() + timedelta(days=30))
    streaming = asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.50"),
                                    request_id="req_streaming"))
    _progress(streaming, endpoint, prompt_tokens=100, completion_tokens=20)
    counter = (redis_keys.org_period_key(organization.pk, periods.period_containing().key) if what == "org"
               else redis_keys.credit_key(organization.pk))
    get_redis().delete(counter)
    rebuild._BEGIN_REBUILD.run_sync(keys=[redis_keys.rebuilding_key(organization.pk),
                                          redis_keys.reservations_key(organization.pk)],
                                    args=[counter, rebuild.REBUILD_MAX_S, rebuild.REBUILD_LONGEST_S])
    assert sweeper.sweep_expired_reservations(now=time.time() + 601) == 1
    row = UsageRecord.objects.get(request_id="req_streaming")
    assert row.status == "gateway_lost" and row.cost > 0

    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"), request_id="next"))

    assert reads.counted_spend(organization.pk) == row.cost
    if what == "credit":
        assert from_units(int(get_redis().get(counter))) == Decimal("2.00") - row.cost


@pytest.mark.parametrize("what", ["org", "key", "credit"])
def test_a_frozen_gateways_call_swept_then_flushed_then_held_again_counts_once(gateway, what):
    # Found by a review: a call admitted, its progress recorded; its gateway froze past the deadline and the sweeper
    # wrote its `gateway_lost` row and settled it; Redis was flushed (counters, holds, the sweeper's marker); the next
    # call rebuilt the counters (the lost row in the snapshot, the call not reserved); the gateway woke and its
    # reconcile held the call again (no marker, within `told_until`; not writing its row yet, it streams on); its own
    # row superseded the lost one and its settlement found its hold. Before, nothing was dropped for a call not
    # writing its row: the settlement added its whole cost on top of the lost row's (0.000041 for 0.000025), on the
    # organisation counter, its key's counter and the credit figure alike.
    endpoint = EndpointFactory()
    organization = endpoint.organization
    _cap(organization, "1.00")
    key = None
    if what == "key":
        key = ApiKey.objects.create(organization=organization, name="k", lookup="sweptheld", digest="x")
        set_key_spend_cap(SYSTEM, key, spend_cap=Decimal("1.00"))
    elif what == "credit":
        set_billing_mode(SYSTEM, organization, mode=BillingMode.PREPAID)
        grant_credits(SYSTEM, organization, amount=Decimal("2.00"), expires_at=timezone.now() + timedelta(days=30))
    api_key_id = key.pk if key else None
    admitted = asyncio.run(reserve(organization_id=organization.pk, api_key_id=api_key_id, amount=Decimal("0.50"),
                                   request_id="req_frozen"))
    held = presence.track("req_frozen", organization.pk, str(endpoint.pk), None, reservation=admitted.reservation)
    report = dataclasses.replace(usage_report(endpoint, api_key=key, request_id="req_frozen", prompt_tokens=100,
                                              completion_tokens=20),
                                 status="gateway_lost", max_cost=Decimal("0.50"), billing_mode=admitted.billing_mode)
    assert asyncio.run(record_progress(organization.pk, [report])) == ["req_frozen"]
    assert sweeper.sweep_expired_reservations(now=time.time() + 601) == 1  # its gateway frozen past the deadline
    lost = UsageRecord.objects.get(request_id="req_frozen")
    assert lost.status == "gateway_lost" and lost.cost > 0
    held.lapses_at = time.time() - 5  # as its gateway, woken past its deadline, last pushed it
    get_redis().flushdb()
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=api_key_id, amount=Decimal("0.01"),
                        request_id="next"))  # its rebuild's snapshot has the lost row, the call not reserved

    _held_again(organization.pk, "req_frozen", held)
    held.writes_row = True
    asyncio.run(usage_writer.arecord_usage(dataclasses.replace(  # as its gateway writes it: it supersedes the lost row
        usage_report(endpoint, api_key=key, request_id="req_frozen"), max_cost=Decimal("0.50"),
        billing_mode=admitted.billing_mode)))
    row = UsageRecord.objects.get(request_id="req_frozen")
    asyncio.run(settle(admitted, row.cost, fresh_id=True, lapsed_at=held.lapses_at))
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=api_key_id, amount=Decimal("0.01"),
                        request_id="after"))

    assert row.cost > lost.cost  # its own row superseded the lost one
    if what == "key":
        counter = redis_keys.key_period_key(organization.pk, api_key_id, periods.period_containing().key)
        assert from_units(int(get_redis().hget(counter, "spent"))) == row.cost
    elif what == "credit":
        assert from_units(int(get_redis().get(redis_keys.credit_key(organization.pk)))) == Decimal("2.00") - row.cost
    assert reads.counted_spend(organization.pk) == row.cost


def test_a_call_past_its_deadline_not_swept_held_again_after_a_flush_costs_a_rebuild_and_counts_once(gateway):
    # A call whose hold may have lapsed but that the sweeper did not sweep (no row in the ledger) is held again after a
    # flush and a rebuild; the rebuilt counter is dropped (it may have had a sweeper's row) and rebuilt by the next
    # call with the call reserved: one more rebuild, its cost counted once. (Before, the counter was kept: its cost
    # counted once all the same.)
    endpoint = EndpointFactory()
    organization = endpoint.organization
    _cap(organization, "1.00")
    admitted = asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.50"),
                                   request_id="req_late"))
    held = presence.track("req_late", organization.pk, str(endpoint.pk), None, reservation=admitted.reservation)
    held.lapses_at = time.time() - 5  # as its gateway, woken past its deadline, last pushed it
    get_redis().flushdb()
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"), request_id="next"))

    _held_again(organization.pk, "req_late", held)
    counter = redis_keys.org_period_key(organization.pk, periods.period_containing().key)
    assert not get_redis().exists(counter)  # dropped: rebuilt by the next call
    held.writes_row = True
    record_usage(dataclasses.replace(usage_report(endpoint, request_id="req_late"), max_cost=Decimal("0.50")))
    cost = UsageRecord.objects.get(request_id="req_late").cost
    asyncio.run(settle(admitted, cost, fresh_id=True, lapsed_at=held.lapses_at))
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"), request_id="after"))

    assert reads.counted_spend(organization.pk) == cost > 0
    assert reads.reserved_now(organization.pk) == Decimal("0.02")


OLD_PRIMARY = "0" * 39 + "1"  # the replication id of the primary a rebuild began on, before a failover


def _begun_on_the_old_primary(monkeypatch) -> None:
    """The first rebuild began on a primary since failed over: its run (`r:<counter>`, kept by the replica) carries
    that primary's replication id, not the one the replica took when promoted (every later rebuild: this Redis's)."""
    begin = rebuild._BEGIN_REBUILD

    class _OnTheOldPrimary:
        first = True

        async def __call__(self, *, keys, args):
            now, window_s, reserved, run = await begin(keys=keys, args=args)
            if self.first:
                self.first = False
                run = f"{_text(run).partition('@')[0]}@{OLD_PRIMARY}"
                await get_async_redis().hset(keys[0], f"r:{args[0]}", run)
            return now, window_s, reserved, run

    monkeypatch.setattr(rebuild, "_BEGIN_REBUILD", _OnTheOldPrimary())


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def test_a_rebuild_whose_redis_failed_over_to_a_replica_without_a_settlements_note_begins_again(gateway, monkeypatch):
    # Redis lost the call's hold (a flush); a call began rebuilding the counter; the call then wrote its row (after the
    # snapshot) and settled with no hold, leaving its cost to the rebuild (`m:`, its mark, its settled marker); Redis
    # then failed over to a replica behind by those writes, which keeps the run (`r:`, `c:`, written before). Before,
    # the rebuild wrote the counter without the call's cost, and nothing counted it: spend past the cap for the month.
    # Now a run carries the replication id of the Redis it began on, and a rebuild that finds another writes nothing and
    # begins again, with a snapshot that has the row.
    endpoint = EndpointFactory()
    organization = endpoint.organization
    _cap(organization, "1.00")
    admitted = asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.50"),
                                   request_id="req_running"))
    held = presence.track("req_running", organization.pk, str(endpoint.pk), None, reservation=admitted.reservation)
    _holds_and_counter_lost(organization.pk)
    counter = redis_keys.org_period_key(organization.pk, periods.period_containing().key)
    _begun_on_the_old_primary(monkeypatch)
    read, write, writes = rebuild.period_spend_and_pending, rebuild._write_rebuild, []

    def ends():
        record_usage(dataclasses.replace(usage_report(endpoint, request_id="req_running"), max_cost=Decimal("0.50")))
        asyncio.run(settle(admitted, UsageRecord.objects.get(request_id="req_running").cost, fresh_id=True,
                           lapsed_at=held.lapses_at))
        # the failover: the replica lacks the settlement's writes
        redis = get_redis()
        assert redis.hdel(redis_keys.rebuilding_key(organization.pk), f"m:{counter}|req_running") == 1
        assert redis.srem(redis_keys.held_again_key(counter), "req_running") == 1
        assert redis.delete(redis_keys.settled_key(organization.pk, "req_running")) == 1

    def read_then_ends(*args, **kwargs):
        result = read(*args, **kwargs)
        if not writes:
            _in_another_connection(ends)
        return result

    async def write_once(*args):
        writes.append(await write(*args))
        return writes[-1]

    monkeypatch.setattr(rebuild, "period_spend_and_pending", read_then_ends)
    monkeypatch.setattr(rebuild, "_write_rebuild", write_once)
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"), request_id="next"))

    assert reads.counted_spend(organization.pk) == UsageRecord.objects.get(request_id="req_running").cost > 0
    assert writes == [rebuild.LOST_MEANWHILE, 1]
