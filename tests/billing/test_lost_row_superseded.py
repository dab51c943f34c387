"""A call whose gateway journaled its whole row (PostgreSQL down) and was killed before settling, with PostgreSQL back
only after its hold lapsed: the sweeper bills it from its last progress (`gateway_lost`), and the journal's replay of
its whole row supersedes that row, its difference counted once in the counters and the rollups
(`billing.ledger.supersede_lost_rows`, `billing.quota.replayed.count_superseded`). So does the row of a gateway that
froze past the hold (not killed), woke and finished the call: its own write supersedes the lost row, and its
settlement adds nothing and releases nothing twice."""

import asyncio
import dataclasses
import time
from datetime import timedelta
from decimal import Decimal

import psycopg
import pytest
from django.db.models import Sum
from django.utils import timezone

from billing import ledger, periods, stripe_sync, usage_writer
from billing.credits import grant_credits
from billing.models import BillingAccount, BillingMode, RollupKind, UsageRecord, UsageRollup
from billing.quota import reads, rebuild, replayed, sweeper
from billing.quota.counters import from_units, to_units
from billing.rollups import rollup_usage
from billing.services import set_billing_mode
from billing.usage_writer import Recorded
from controlplane import redis_keys
from controlplane.accounts.models import ApiKey
from controlplane.accounts.services import SYSTEM
from controlplane.redis_client import get_redis
from controlplane.worker_threads import in_worker_thread
from tests.billing.conftest import usage_report
from tests.billing.test_journaled_spend import _key_spend, _replay, journal_dir  # noqa: F401 - a fixture used here
from tests.billing.test_quota import _progress, reserve, settle
from tests.factories import EndpointFactory
from tests.outages import database_refusing_connections

pytestmark = pytest.mark.django_db(transaction=True)

HELD = Decimal("0.70")


def _priced_endpoint():
    return EndpointFactory(price_input_per_million=Decimal("1"), price_cached_input_per_million=Decimal("1"),
                           price_output_per_million=Decimal("2"))


def _prepaid_endpoint():
    """`_priced_endpoint` of an organisation billed prepaid, with $2 of credit."""
    endpoint = _priced_endpoint()
    set_billing_mode(SYSTEM, endpoint.organization, mode=BillingMode.PREPAID)
    grant_credits(SYSTEM, endpoint.organization, amount=Decimal("2.00"))
    return endpoint


def _streaming_with_progress(endpoint, request_id: str, *, api_key=None, lost_at=None):
    """A stream admitted ($0.70 held) whose last beat recorded 20,000 of its 200,000 tokens ($0.14). Returns its
    admission and its whole row ($0.50)."""
    admitted = asyncio.run(reserve(organization_id=endpoint.organization_id, api_key_id=api_key.pk if api_key else None,
                                   amount=HELD, request_id=request_id))
    lost_at = lost_at or timezone.now() - timedelta(seconds=1)
    _progress(admitted, endpoint, api_key=api_key, prompt_tokens=100_000, completion_tokens=20_000, finished_at=lost_at)
    whole = dataclasses.replace(usage_report(endpoint, api_key=api_key, request_id=request_id, prompt_tokens=100_000,
                                             completion_tokens=200_000, finished_at=lost_at + timedelta(seconds=1)),
                                max_cost=HELD, billing_mode=admitted.billing_mode)
    return admitted, whole


def _killed_after_its_journal_append(endpoint, request_id: str, *, api_key=None, lost_at=None):
    """A stream (`_streaming_with_progress`) whose whole row went to the journal (PostgreSQL down), and whose gateway
    was killed before it settled. Returns the row."""
    _, whole = _streaming_with_progress(endpoint, request_id, api_key=api_key, lost_at=lost_at)
    with database_refusing_connections():
        assert asyncio.run(usage_writer.arecord_usage(whole)) is Recorded.JOURNALED
    return whole


def _sweep_after_the_hold_lapsed() -> None:
    assert sweeper.sweep_expired_reservations(now=time.time() + 601) == 1


def _assert_rollups_equal_the_ledger():
    fields = ["prompt_tokens", "cached_tokens", "completion_tokens", "cost"]
    ledger = UsageRecord.objects.aggregate(*(Sum(f) for f in fields))
    rollups = UsageRollup.objects.aggregate(*(Sum(f) for f in fields))
    assert list(ledger.values()) == list(rollups.values())
    assert UsageRollup.objects.aggregate(n=Sum("num_requests"))["n"] == UsageRecord.objects.count()


def test_a_journaled_row_replayed_after_the_sweep_supersedes_the_lost_row_and_is_counted_once(settings):
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    key = ApiKey.objects.create(organization=organization, name="k", lookup="k", digest="x")
    whole = _killed_after_its_journal_append(endpoint, "streamed", api_key=key)
    _sweep_after_the_hold_lapsed()  # PostgreSQL back: the sweeper first
    lost = UsageRecord.objects.get()
    assert (lost.status, lost.completion_tokens, lost.cost) == ("gateway_lost", 20_000, Decimal("0.14"))
    assert reads.counted_spend(organization.pk) == Decimal("0.14")
    rollup_usage()

    _replay()  # then the journal's replay

    row = UsageRecord.objects.get()
    assert (row.status, row.prompt_tokens, row.completion_tokens) == ("ok", 100_000, 200_000)
    assert row.cost == ledger.cost_of(endpoint, 100_000, 0, 200_000) == Decimal("0.50")
    assert row.finished_at == lost.finished_at  # billed in the hour and month it was
    assert reads.counted_spend(organization.pk) == Decimal("0.50") == _key_spend(organization.pk, key.pk)
    assert reads.reserved_now(organization.pk) == 0
    rollup_usage()
    _assert_rollups_equal_the_ledger()

    # The same line again (a segment both shipped and replayed here), or the lost row's progress: nothing changes.
    lost_report = dataclasses.replace(whole, completion_tokens=20_000, status="gateway_lost")
    assert ledger.supersede_lost_rows([whole]) == ledger.supersede_lost_rows([lost_report]) == {}
    assert replayed.count_superseded({}) == 0
    assert UsageRecord.objects.get().completion_tokens == 200_000
    assert reads.counted_spend(organization.pk) == Decimal("0.50")


def test_the_difference_of_a_closed_hour_is_an_adjustment_pushed_to_stripe_on_its_own(settings, fake_stripe):
    # PostgreSQL back after the lost row's hour closed and its rollup was pushed to Stripe: the difference is a new
    # ADJUSTMENT rollup, pushed as its own meter events; the closed one never changes.
    settings.BILLING_RESERVATION_TTL_S = 600
    settings.BILLING_ROLLUP_CLOSE_AFTER_S = 0
    endpoint = _priced_endpoint()
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=2)
    _killed_after_its_journal_append(endpoint, "streamed", lost_at=hour + timedelta(minutes=10))
    _sweep_after_the_hold_lapsed()
    rollup_usage()
    closed = UsageRollup.objects.get()
    assert closed.closed_at is not None and closed.cost == Decimal("0.14")
    assert stripe_sync.push_pending_rollups() == 1

    _replay()
    rollup_usage()
    rollup_usage()  # and again: still one adjustment

    primary, adjustment = UsageRollup.objects.order_by("sequence")
    assert (primary.cost, primary.completion_tokens) == (Decimal("0.14"), 20_000)
    assert (adjustment.kind, adjustment.sequence, adjustment.num_requests) == (RollupKind.ADJUSTMENT, 1, 0)
    assert (adjustment.completion_tokens, adjustment.cost) == (180_000, Decimal("0.36"))
    assert adjustment.push_uid != primary.push_uid
    _assert_rollups_equal_the_ledger()
    assert stripe_sync.push_pending_rollups() == 1 and stripe_sync.push_pending_rollups() == 0
    customer_id = BillingAccount.objects.get(organization=endpoint.organization).stripe_customer_id
    totals = fake_stripe.meter_totals()
    assert totals[customer_id, "inferplane_output_tokens"] == 200_000
    assert totals[customer_id, "inferplane_usage_cost"] == 500_000  # micro-dollars: $0.50, not $0.14 + $0.50


def test_a_lost_row_not_settled_yet_is_counted_whole_by_the_replay_and_its_settlement_adds_nothing(settings):
    # The sweeper wrote the lost row and was killed before it settled the hold; the replay comes before its next run.
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = _prepaid_endpoint()
    organization = endpoint.organization
    _killed_after_its_journal_append(endpoint, "streamed")
    credit_before = int(get_redis().get(redis_keys.credit_key(organization.pk)))
    assert sweeper._record_lost_calls(get_redis(), organization.pk, ["streamed"]) == 1
    assert reads.reserved_now(organization.pk) == HELD

    _replay()
    _sweep_after_the_hold_lapsed()

    assert UsageRecord.objects.get().cost == Decimal("0.50")
    assert reads.counted_spend(organization.pk) == Decimal("0.50") and reads.reserved_now(organization.pk) == 0
    assert int(get_redis().get(redis_keys.credit_key(organization.pk))) == credit_before - to_units(Decimal("0.50"))


def test_a_journaled_row_replayed_before_the_sweep_leaves_no_lost_row(settings):
    # The reverse order (the replay first: PostgreSQL back before the hold lapsed): the sweeper settles the row.
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    _killed_after_its_journal_append(endpoint, "streamed")

    _replay()
    _sweep_after_the_hold_lapsed()

    row = UsageRecord.objects.get()
    assert (row.status, row.completion_tokens, row.cost) == ("ok", 200_000, Decimal("0.50"))
    assert reads.counted_spend(organization.pk) == Decimal("0.50") and reads.reserved_now(organization.pk) == 0
    assert not get_redis().hlen(redis_keys.progress_key(organization.pk))


def _wakes_and_finishes(admitted, whole) -> Recorded:
    """A stream's gateway froze (a long pause, its VM paused), then wakes and ends its call as `InferenceCall._finish`
    does: its row, then its settlement."""
    recorded = asyncio.run(usage_writer.arecord_usage(whole))
    asyncio.run(settle(admitted, Decimal("0.50"), fresh_id=True))  # its cost, as it priced its row
    return recorded


def test_a_frozen_gateways_own_row_written_after_the_sweep_supersedes_the_lost_row_and_is_counted_once(settings):
    # Before, its row was refused as a duplicate: the call stayed gateway_lost with 20,000 tokens, billed $0.14.
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    key = ApiKey.objects.create(organization=organization, name="k", lookup="k", digest="x")
    admitted, whole = _streaming_with_progress(endpoint, "frozen", api_key=key)
    _sweep_after_the_hold_lapsed()  # the hold lapsed while it was frozen: lost row written and settled
    lost = UsageRecord.objects.get()
    assert (lost.status, lost.cost) == ("gateway_lost", Decimal("0.14"))
    assert reads.counted_spend(organization.pk) == Decimal("0.14") and reads.reserved_now(organization.pk) == 0
    rollup_usage()

    recorded = _wakes_and_finishes(admitted, whole)

    row = UsageRecord.objects.get()
    assert (row.status, row.prompt_tokens, row.completion_tokens, row.cost) == ("ok", 100_000, 200_000, Decimal("0.50"))
    assert recorded is Recorded.WRITTEN
    assert row.finished_at == lost.finished_at and row.api_key_id == key.pk
    # Counted once: the lost row's $0.14 and the difference, not the settlement's $0.50 on top; nothing released twice.
    assert reads.counted_spend(organization.pk) == Decimal("0.50") == _key_spend(organization.pk, key.pk)
    assert reads.reserved_now(organization.pk) == 0
    assert int(get_redis().get(redis_keys.key_reserved_key(organization.pk, key.pk)) or 0) == 0
    rollup_usage()
    _assert_rollups_equal_the_ledger()

    # A second attempt (the same finish again), and the sweeper again: nothing changes.
    assert _wakes_and_finishes(admitted, whole) is Recorded.DUPLICATE
    assert sweeper.sweep_expired_reservations(now=time.time() + 86_400) == 0
    row = UsageRecord.objects.get()
    assert (row.status, row.completion_tokens, row.cost) == ("ok", 200_000, Decimal("0.50"))
    assert reads.counted_spend(organization.pk) == Decimal("0.50") == _key_spend(organization.pk, key.pk)
    assert reads.reserved_now(organization.pk) == 0


def test_a_frozen_gateways_row_over_a_lost_row_not_settled_yet_is_counted_whole_and_its_hold_released_once(settings):
    # The sweeper wrote the lost row and was killed before it settled; the gateway wakes before its next run: its write
    # counts the whole cost (and marks it settled), its settlement only releases the hold, and the sweep finds nothing.
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = _prepaid_endpoint()
    organization = endpoint.organization
    admitted, whole = _streaming_with_progress(endpoint, "frozen")
    credit_before = int(get_redis().get(redis_keys.credit_key(organization.pk)))
    assert sweeper._record_lost_calls(get_redis(), organization.pk, ["frozen"]) == 1

    recorded = _wakes_and_finishes(admitted, whole)
    assert sweeper.sweep_expired_reservations(now=time.time() + 601) == 0

    row = UsageRecord.objects.get()
    assert (row.status, row.completion_tokens, row.cost) == ("ok", 200_000, Decimal("0.50"))
    assert recorded is Recorded.WRITTEN
    assert reads.counted_spend(organization.pk) == Decimal("0.50") and reads.reserved_now(organization.pk) == 0
    assert int(get_redis().get(redis_keys.credit_key(organization.pk))) == credit_before - to_units(Decimal("0.50"))


def test_rows_a_replay_wrote_are_counted_though_its_supersede_failed_after_the_insert(settings, monkeypatch):
    """The replay's insert and its supersede ran as one step, and its rows were counted after both: a supersede that
    failed (PostgreSQL gone again) after the insert committed left the rows written then uncounted for good, since
    their retry writes nothing new (found by this stop's review)."""
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    _, whole = _streaming_with_progress(endpoint, "streamed")
    _sweep_after_the_hold_lapsed()  # the lost row, $0.14
    fresh = usage_report(endpoint, request_id="fresh", prompt_tokens=100_000, completion_tokens=100_000)

    async def journaled_together():
        return await asyncio.gather(usage_writer.arecord_usage(whole), usage_writer.arecord_usage(fresh))

    with database_refusing_connections():
        assert asyncio.run(journaled_together()) == [Recorded.JOURNALED] * 2
    assert reads.counted_spend(organization.pk) == Decimal("0.14")
    supersede, calls = usage_writer.supersede_lost_rows_on, []

    async def gone_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise psycopg.OperationalError("the connection is lost")
        return await supersede(*args, **kwargs)

    monkeypatch.setattr(usage_writer, "supersede_lost_rows_on", gone_once)
    with pytest.raises(psycopg.OperationalError):
        _replay()
    assert UsageRecord.objects.get(request_id="fresh").cost == Decimal("0.30")
    assert reads.counted_spend(organization.pk) == Decimal("0.14") + Decimal("0.30")  # the fresh row counted

    _replay()  # the segment waited: its retry supersedes the lost row
    assert UsageRecord.objects.get(request_id="streamed").status == "ok"
    assert reads.counted_spend(organization.pk) == Decimal("0.50") + Decimal("0.30")


# --- a counter rebuilt while a lost row is superseded ------------------------------------------------------------------
# The row's difference is counted once whichever way the rebuild (its ledger snapshot, then its write) and the supersede
# (its commit, then its count) interleave, for a journal's replayed row and for a woken gateway's own row (found by a
# review: the replay's registration of the row made a rebuild that read the lost row mark it counted, and a count that
# found the counter missing told its rebuild nothing; both left $0.14 counted for $0.50).
INTERLEAVINGS = ["rebuilt before the supersede", "rebuilt between the supersede and its count",
                 "read before the supersede, written after its count", "read after the supersede, written after its count"]


def _lost_then_counters_lost(endpoint, path: str, api_key=None):
    """A stream billed lost by the sweeper ($0.14), its whole row ($0.50) in the journal (`path` "replayed") or in a
    frozen gateway about to wake ("woken"), then Redis lost the spend counters and the credit figure. Returns the
    supersede to come: the journal's replay, or the gateway's own write."""
    if path == "replayed":
        _killed_after_its_journal_append(endpoint, "streamed", api_key=api_key)
    else:
        _, whole = _streaming_with_progress(endpoint, "streamed", api_key=api_key)
    _sweep_after_the_hold_lapsed()
    assert UsageRecord.objects.get().cost == Decimal("0.14")
    period_key = periods.period_containing().key
    organization_id = endpoint.organization_id
    get_redis().delete(redis_keys.org_period_key(organization_id, period_key),
                       redis_keys.key_period_key(organization_id, api_key.pk if api_key else None, period_key),
                       redis_keys.credit_key(organization_id))

    async def supersede():
        if path == "replayed":
            await usage_writer.writer_for_this_loop().replay()
        else:
            assert await usage_writer.arecord_usage(whole) is Recorded.WRITTEN

    return supersede


def _rebuilt_during(monkeypatch, interleaving: str, supersede, organization_id: int, api_key_id: int | None,
                    counter: str) -> None:
    """Run `supersede` with a call that rebuilds the lost counters interleaved as `interleaving` says (a rebuild of
    `counter` read before the supersede: its write waits for the supersede's count)."""

    async def rebuilds():
        await reserve(organization_id=organization_id, api_key_id=api_key_id, amount=Decimal("0.01"),
                      request_id="rebuilds")

    if interleaving == "rebuilt before the supersede":
        original = usage_writer.UsageWriter._supersede

        async def rebuild_then_supersede(self, reports, written, **kwargs):
            await rebuilds()
            return await original(self, reports, written, **kwargs)

        monkeypatch.setattr(usage_writer.UsageWriter, "_supersede", rebuild_then_supersede)
    elif interleaving == "rebuilt between the supersede and its count":
        count = usage_writer._count_superseded

        async def rebuild_then_count(lost_costs, **kwargs):
            await rebuilds()
            await count(lost_costs, **kwargs)

        monkeypatch.setattr(usage_writer, "_count_superseded", rebuild_then_count)
    elif interleaving == "read after the supersede, written after its count":
        count, write, counts = usage_writer._count_superseded, rebuild._write_rebuild, []

        async def rebuild_before_the_count(lost_costs, **kwargs):
            counts.append((lost_costs, kwargs))
            await rebuilds()

        async def count_then_write(rebuilt, *args, **kwargs):
            if rebuilt.key == counter and counts:  # its rebuild read the row superseded; the count finds it missing
                lost_costs, how = counts.pop()
                await count(lost_costs, **how)
            return await write(rebuilt, *args, **kwargs)

        monkeypatch.setattr(usage_writer, "_count_superseded", rebuild_before_the_count)
        monkeypatch.setattr(rebuild, "_write_rebuild", count_then_write)
        asyncio.run(supersede())
        assert not counts
        return
    else:
        write, done = rebuild._write_rebuild, []

        async def supersede_then_write(rebuilt, *args, **kwargs):
            if rebuilt.key == counter and not done:  # its rebuild read the lost row; the supersede commits and counts
                done.append(await supersede())
            return await write(rebuilt, *args, **kwargs)

        monkeypatch.setattr(rebuild, "_write_rebuild", supersede_then_write)
        asyncio.run(rebuilds())
        assert done
        return
    asyncio.run(supersede())


@pytest.mark.parametrize("interleaving", INTERLEAVINGS)
@pytest.mark.parametrize("path", ["replayed", "woken"])
def test_a_counter_rebuilt_while_a_lost_row_is_superseded_counts_its_difference_once(settings, monkeypatch, path,
                                                                                     interleaving):
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    key = ApiKey.objects.create(organization=organization, name="k", lookup="k", digest="x")
    supersede = _lost_then_counters_lost(endpoint, path, api_key=key)

    period_key = periods.period_containing().key
    _rebuilt_during(monkeypatch, interleaving, supersede, organization.pk, key.pk,
                    redis_keys.org_period_key(organization.pk, period_key))

    assert UsageRecord.objects.get(request_id="streamed").cost == Decimal("0.50")
    assert reads.counted_spend(organization.pk) == Decimal("0.50") == _key_spend(organization.pk, key.pk)
    monkeypatch.undo()
    _replay()  # nothing left: nothing counted again
    assert reads.counted_spend(organization.pk) == Decimal("0.50") == _key_spend(organization.pk, key.pk)


@pytest.mark.parametrize("interleaving", INTERLEAVINGS)
@pytest.mark.parametrize("path", ["replayed", "woken"])
def test_a_credit_figure_rebuilt_while_a_lost_row_is_superseded_draws_its_difference_once(settings, monkeypatch, path,
                                                                                           interleaving):
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = _prepaid_endpoint()
    organization = endpoint.organization
    supersede = _lost_then_counters_lost(endpoint, path)

    _rebuilt_during(monkeypatch, interleaving, supersede, organization.pk, None, redis_keys.credit_key(organization.pk))

    assert UsageRecord.objects.get(request_id="streamed").cost == Decimal("0.50")
    # $2.00 granted, $0.50 spent (the rebuilding call's $0.01 held apart)
    assert from_units(int(get_redis().get(redis_keys.credit_key(organization.pk)))) == Decimal("1.50")


# --- the sweeper between a replay's or a supersede's commit and its count ------------------------------------------
# Found, left open last stop: the sweeper read the row as committed (whole, or superseded) and settled the call's hold
# with its cost in the round trip before the count, which then added it (or its difference) again: $0.86 or $1.00
# counted for $0.50.
SWEPT_BEFORE_THE_COUNT = ["a replayed row", "a replayed row over a lost row", "a woken gateway's row over a lost row"]


@pytest.mark.parametrize("path", SWEPT_BEFORE_THE_COUNT)
def test_the_sweeper_between_a_commit_and_its_count_leaves_the_call_to_the_count(settings, monkeypatch, path):
    settings.BILLING_RESERVATION_TTL_S = 0  # its hold lapses a second after it is taken (Redis's clock)
    endpoint = _prepaid_endpoint()
    organization = endpoint.organization
    key = ApiKey.objects.create(organization=organization, name="k", lookup="k", digest="x")
    if path == "a woken gateway's row over a lost row":
        admitted, whole = _streaming_with_progress(endpoint, "streamed", api_key=key)
    else:
        _killed_after_its_journal_append(endpoint, "streamed", api_key=key)
    credit_before = int(get_redis().get(redis_keys.credit_key(organization.pk)))
    if path != "a replayed row":  # the sweeper wrote the lost row and was stopped before it settled the hold
        assert sweeper._record_lost_calls(get_redis(), organization.pk, ["streamed"]) == 1
    counter = "_count_replayed" if path == "a replayed row" else "_count_superseded"
    count, swept = getattr(usage_writer, counter), []

    async def sweep_then_count(request_ids, **kwargs):
        if request_ids:
            swept.append(await in_worker_thread(sweeper.sweep_expired_reservations)(now=time.time() + 2, batch_size=1))
        await count(request_ids, **kwargs)

    monkeypatch.setattr(usage_writer, counter, sweep_then_count)
    if path == "a woken gateway's row over a lost row":
        assert _wakes_and_finishes(admitted, whole) is Recorded.WRITTEN
    else:
        _replay()
    monkeypatch.undo()
    sweeper.sweep_expired_reservations(now=time.time() + 2)  # its next run releases what is left

    assert UsageRecord.objects.get().cost == Decimal("0.50")
    assert reads.counted_spend(organization.pk) == Decimal("0.50") == _key_spend(organization.pk, key.pk)
    assert reads.reserved_now(organization.pk) == 0
    assert int(get_redis().get(redis_keys.credit_key(organization.pk))) == credit_before - to_units(Decimal("0.50"))
    assert swept == [0]  # the sweep in the round trip left the call to its count


class _Killed(Exception):
    """The gateway dies (an OOM kill, a node lost) right after its replay's supersede committed."""


def test_a_replays_supersede_killed_before_its_count_is_counted_by_the_next_replay(settings, monkeypatch):
    # Before, the next replay found no lost row left to supersede and counted nothing: $0.14 counted for $0.50, spend
    # past the cap and the prepaid credit until the counters were next rebuilt.
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = _prepaid_endpoint()
    organization = endpoint.organization
    key = ApiKey.objects.create(organization=organization, name="k", lookup="k", digest="x")
    _killed_after_its_journal_append(endpoint, "streamed", api_key=key)
    _sweep_after_the_hold_lapsed()
    assert reads.counted_spend(organization.pk) == Decimal("0.14")

    async def killed(*args, **kwargs):
        raise _Killed()

    monkeypatch.setattr(usage_writer, "_count_superseded", killed)
    with pytest.raises(_Killed):
        _replay()
    monkeypatch.undo()
    assert UsageRecord.objects.get().cost == Decimal("0.50")  # superseded, not counted; the segment still there

    _replay()
    assert reads.counted_spend(organization.pk) == Decimal("0.50") == _key_spend(organization.pk, key.pk)
    assert from_units(int(get_redis().get(redis_keys.credit_key(organization.pk)))) == Decimal("1.50")  # $2 - $0.50
    _replay()  # nothing left: nothing counted again
    assert reads.counted_spend(organization.pk) == Decimal("0.50") == _key_spend(organization.pk, key.pk)


# --- the lost row's settlement and its supersede in one rebuild ------------------------------------------------------
# Found, left open last stop: both told the rebuild their cost in one field (`m:<counter>|<id>`), the second overwriting
# the first: $0.36 counted for $0.50 (the lost row after the snapshot), or $0.14 (before it: the call reserved when the
# rebuild began, its notes were all taken for rows its snapshot held).
@pytest.mark.parametrize("its_count", ["before the rebuild's write", "after the rebuild's write"])
@pytest.mark.parametrize("lost_row", ["written before the snapshot", "written after the snapshot"])
def test_a_lost_rows_settlement_and_its_supersede_during_one_rebuild_are_both_counted(settings, monkeypatch, lost_row,
                                                                                       its_count):
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    key = ApiKey.objects.create(organization=organization, name="k", lookup="k", digest="x")
    admitted, whole = _streaming_with_progress(endpoint, "frozen", api_key=key)
    if lost_row == "written before the snapshot":  # the sweeper wrote it and was stopped before it settled the hold
        assert sweeper._record_lost_calls(get_redis(), organization.pk, ["frozen"]) == 1
    period_key = periods.period_containing().key
    counter = redis_keys.org_period_key(organization.pk, period_key)
    get_redis().delete(counter, redis_keys.key_period_key(organization.pk, key.pk, period_key))
    write, done = rebuild._write_rebuild, []

    async def settled_and_superseded_then_write(rebuilt, *args, **kwargs):
        if rebuilt.key == counter and not done:  # its snapshot read; the sweeper settles, then the gateway wakes
            await in_worker_thread(_sweep_after_the_hold_lapsed)()
            done.append(await usage_writer.arecord_usage(whole))
            await settle(admitted, Decimal("0.50"), fresh_id=True)  # its cost, as it priced its row
        return await write(rebuilt, *args, **kwargs)

    monkeypatch.setattr(rebuild, "_write_rebuild", settled_and_superseded_then_write)
    count, counts = usage_writer._count_superseded, []
    if its_count == "after the rebuild's write":  # the woken gateway froze again between its supersede and its count

        async def frozen_before_the_count(lost_costs, **kwargs):
            counts.append((lost_costs, kwargs))

        monkeypatch.setattr(usage_writer, "_count_superseded", frozen_before_the_count)
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=key.pk, amount=Decimal("0.01"),
                        request_id="rebuilds"))
    monkeypatch.undo()
    for lost_costs, kwargs in counts:
        asyncio.run(count(lost_costs, **kwargs))

    assert done == [Recorded.WRITTEN]
    assert UsageRecord.objects.get(request_id="frozen").cost == Decimal("0.50")
    assert reads.counted_spend(organization.pk) == Decimal("0.50") == _key_spend(organization.pk, key.pk)
    assert not [field for field in get_redis().hkeys(redis_keys.rebuilding_key(organization.pk))
                if field.startswith(("m:", "d:"))]


def test_a_woken_gateways_supersede_killed_before_its_count_is_counted_by_the_sweeper(settings, monkeypatch):
    # Before, no journal segment was left to replay: $0.14 counted for $0.50 until the counters were next rebuilt.
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = _prepaid_endpoint()
    organization = endpoint.organization
    key = ApiKey.objects.create(organization=organization, name="k", lookup="k", digest="x")
    admitted, whole = _streaming_with_progress(endpoint, "frozen", api_key=key)
    _sweep_after_the_hold_lapsed()
    assert reads.counted_spend(organization.pk) == Decimal("0.14")

    async def killed(*args, **kwargs):
        raise _Killed()

    monkeypatch.setattr(usage_writer, "_count_superseded", killed)
    with pytest.raises(_Killed):
        asyncio.run(usage_writer.arecord_usage(whole))
    monkeypatch.undo()
    assert UsageRecord.objects.get().cost == Decimal("0.50")  # superseded, not counted
    sweeper.sweep_expired_reservations(now=time.time())  # its registration still lasts: its writer may count yet
    assert reads.counted_spend(organization.pk) == Decimal("0.14")

    sweeper.sweep_expired_reservations(now=time.time() + replayed.REGISTRATION_TTL_S + 1)
    assert reads.counted_spend(organization.pk) == Decimal("0.50") == _key_spend(organization.pk, key.pk)
    assert from_units(int(get_redis().get(redis_keys.credit_key(organization.pk)))) == Decimal("1.50")  # $2 - $0.50
    sweeper.sweep_expired_reservations(now=time.time() + replayed.REGISTRATION_TTL_S + 1)  # again: nothing more
    asyncio.run(settle(admitted, Decimal("0.50"), fresh_id=True))  # a second freeze's gateway wakes, ends its call
    assert reads.counted_spend(organization.pk) == Decimal("0.50") == _key_spend(organization.pk, key.pk)


def test_a_woken_gateway_frozen_past_its_registration_before_its_count_adds_nothing_the_sweeper_counted(settings,
                                                                                                        monkeypatch):
    # The sweeper counts a supersede whose registration lapsed (`replayed.count_lapsed_supersedes`); the live write's
    # own count, coming after it, counts only if it drops the registration (with it counting whatever: $0.86 for $0.50).
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    admitted, whole = _streaming_with_progress(endpoint, "frozen")
    _sweep_after_the_hold_lapsed()
    count, swept = usage_writer._count_superseded, []

    async def frozen_again_then_count(lost_costs, **kwargs):
        await in_worker_thread(sweeper.sweep_expired_reservations)(now=time.time() + replayed.REGISTRATION_TTL_S + 1)
        swept.append(reads.counted_spend(organization.pk))
        await count(lost_costs, **kwargs)

    monkeypatch.setattr(usage_writer, "_count_superseded", frozen_again_then_count)
    assert _wakes_and_finishes(admitted, whole) is Recorded.WRITTEN
    monkeypatch.undo()

    assert swept == [Decimal("0.50")]  # the sweeper counted it
    assert reads.counted_spend(organization.pk) == Decimal("0.50")
