"""Spend whose usage rows wait in the journal (the ledger refused them) counts in the quota counters exactly once: in
those that counted it at its settlement, and, once its replay writes it, in those Redis rebuilt meanwhile from a
ledger without it (`billing.quota.replayed`)."""

import asyncio
import dataclasses
import threading
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db.models import F

from billing import periods, usage_writer
from billing.credits import grant_credits
from billing.ledger import record_usage_batch
from billing.models import BillingMode, UsageRecord
from billing.quota import reads, rebuild, replayed, sweeper
from billing.quota.counters import QuotaExceeded, from_units
from billing.services import set_billing_mode
from billing.usage_writer import Recorded
from controlplane import redis_keys
from controlplane.accounts.models import ApiKey
from controlplane.accounts.services import SYSTEM
from controlplane.redis_client import get_redis
from controlplane.redis_scripts import Script
from endpoints.gateway import admission
from tests.billing.conftest import usage_report
from tests.billing.test_quota import ENDPOINT, _caller, _cap, reserve
from tests.factories import EndpointFactory
from tests.outages import database_refusing_connections

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def journal_dir(tmp_path, settings):
    settings.USAGE_JOURNAL_DIR = str(tmp_path / "journal")
    settings.USAGE_JOURNAL_SHIP = False
    usage_writer.journal.cache_clear()
    yield tmp_path / "journal"
    usage_writer.journal.cache_clear()


def _priced_endpoint():
    return EndpointFactory(price_input_per_million=Decimal("1"), price_output_per_million=Decimal("0"))


def _served_in_a_ledger_outage(endpoint, request_id: str, *, api_key=None) -> tuple[admission.Admission, Recorded]:
    """A $0.60 call admitted ($0.70 held) and answered while PostgreSQL is down: its row goes to the journal."""
    admitted = asyncio.run(reserve(organization_id=endpoint.organization_id, api_key_id=api_key.pk if api_key else None,
                                   amount=Decimal("0.70"), request_id=request_id))
    report = dataclasses.replace(usage_report(endpoint, api_key=api_key, request_id=request_id, prompt_tokens=600_000,
                                              completion_tokens=0), max_cost=Decimal("0.70"),
                                 billing_mode=admitted.billing_mode)  # as the gateway's report says
    with database_refusing_connections():
        recorded = asyncio.run(usage_writer.arecord_usage(report))
    return admitted, recorded


def _settle(admitted: admission.Admission, recorded: Recorded) -> None:
    """The call's finish, as the gateway's (`InferenceCall`): told whether its row was journaled."""
    reservation = admitted.reservation
    asyncio.run(admission.finish(caller=_caller(reservation.organization_id, reservation.api_key_id),
                                 endpoint_id=ENDPOINT, admission=admitted, release=None, num_tokens=0,
                                 cost=Decimal("0.60"), fresh_id=True, journaled=recorded == Recorded.JOURNALED))


def _replay() -> None:
    """PostgreSQL is back: the writer replays the journal into the ledger."""

    async def replay():
        await usage_writer.writer_for_this_loop().replay()

    asyncio.run(replay())


def _key_spend(organization_id: int, api_key_id: int) -> Decimal:
    period_key = periods.period_containing().key
    return from_units(int(get_redis().hget(redis_keys.key_period_key(organization_id, api_key_id, period_key), "spent")))


def test_a_counter_rebuilt_while_rows_wait_in_the_journal_counts_them_once_replayed():
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    key = ApiKey.objects.create(organization=organization, name="k", lookup="k", digest="x")
    _cap(organization, "1.00")
    admitted, recorded = _served_in_a_ledger_outage(endpoint, "journaled", api_key=key)
    assert recorded is Recorded.JOURNALED
    _settle(admitted, recorded)
    assert reads.counted_spend(organization.pk) == Decimal("0.60")

    # Redis loses its memory; PostgreSQL is back; a call rebuilds the counters before the journal is replayed (its
    # replay backs off up to 5 s; a dead pod's shipped segments wait for the worker's minute).
    get_redis().flushdb()
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=key.pk, amount=Decimal("0.01"), request_id="first"))
    assert reads.counted_spend(organization.pk) == 0
    _replay()

    assert UsageRecord.objects.filter(request_id="journaled").exists()
    assert reads.counted_spend(organization.pk) == Decimal("0.60") == _key_spend(organization.pk, key.pk)
    with pytest.raises(QuotaExceeded):  # $0.60 spent and $0.01 held of a $1.00 cap
        asyncio.run(reserve(organization_id=organization.pk, api_key_id=key.pk, amount=Decimal("0.80"),
                            request_id="over-the-cap"))
    _replay()  # nothing left to write: nothing counted again
    assert reads.counted_spend(organization.pk) == Decimal("0.60")


def test_a_journaled_row_its_settlement_counted_is_not_counted_again_by_its_replay():
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    key = ApiKey.objects.create(organization=organization, name="k", lookup="k", digest="x")
    admitted, recorded = _served_in_a_ledger_outage(endpoint, "journaled", api_key=key)
    _settle(admitted, recorded)
    # The outage outlasts the call's settled marker of minutes (`CALL_SETTLED_MARKER_TTL_S`).
    get_redis().delete(redis_keys.settled_key(organization.pk, "journaled"))

    _replay()
    assert reads.counted_spend(organization.pk) == Decimal("0.60") == _key_spend(organization.pk, key.pk)


def test_a_journaled_row_replayed_before_its_call_settles_counts_once():
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    admitted, recorded = _served_in_a_ledger_outage(endpoint, "journaled")
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"), request_id="other"))

    _replay()  # the writer's replay ran before the call's own finish
    _settle(admitted, recorded)
    assert reads.counted_spend(organization.pk) == Decimal("0.60")
    assert reads.reserved_now(organization.pk) == Decimal("0.01")  # its hold released, the other's kept


def test_a_credit_figure_rebuilt_while_rows_wait_in_the_journal_draws_them_once_replayed():
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    set_billing_mode(SYSTEM, organization, mode=BillingMode.PREPAID)
    grant_credits(SYSTEM, organization, amount=Decimal("1.00"))
    admitted, recorded = _served_in_a_ledger_outage(endpoint, "journaled")
    _settle(admitted, recorded)

    get_redis().delete(redis_keys.credit_key(organization.pk))  # the figure expired (it lasts an hour at most)
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"), request_id="first"))
    _replay()

    with pytest.raises(QuotaExceeded) as refused:  # $0.40 left, $0.01 of it held
        asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.50"),
                            request_id="over-the-credit"))
    assert refused.value.reason == "credit"
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.39"), request_id="fits"))


def _credit_left(organization_id: int) -> Decimal:
    return from_units(int(get_redis().get(redis_keys.credit_key(organization_id))))


def test_a_replay_counts_each_organisations_rows_in_one_script_call(monkeypatch):
    # One script per organisation (one Redis Cluster slot) and batch: a round trip per row, in asgiref's one thread
    # for sync code, held every other sync call of the gateway process behind a large replay.
    endpoints = [_priced_endpoint(), _priced_endpoint()]
    usage_writer.journal().append([  # one segment: a batch of the replay
        dataclasses.replace(usage_report(endpoints[n % 2], request_id=f"journaled-{n}", prompt_tokens=600_000,
                                         completion_tokens=0), billing_mode=BillingMode.POSTPAID) for n in range(6)])
    for endpoint in endpoints:  # their counters are built before the replay, from a ledger without them
        asyncio.run(reserve(organization_id=endpoint.organization_id, api_key_id=None, amount=Decimal("0.01"),
                            request_id=f"first-{endpoint.organization_id}"))
    counts = []
    run_sync = Script.run_sync

    def recording_run_sync(self, *, keys, args):
        if self.sha == replayed._COUNT_REPLAYED.sha:
            counts.append(keys)
        return run_sync(self, keys=keys, args=args)

    monkeypatch.setattr(Script, "run_sync", recording_run_sync)
    _replay()

    assert len(counts) == 2
    for endpoint in endpoints:
        assert reads.counted_spend(endpoint.organization_id) == Decimal("1.80")


def _rebuilt_on_insert(monkeypatch, organization_id: int, api_key_id: int | None) -> None:
    """The replay's INSERT commits, then a call rebuilds the counters Redis lost, before the replay counts its rows."""
    insert = usage_writer.UsageWriter._write_rows

    async def insert_then_rebuild(self, reports, **kwargs):
        written = await insert(self, reports, **kwargs)
        await reserve(organization_id=organization_id, api_key_id=api_key_id, amount=Decimal("0.01"),
                      request_id="rebuilds")
        return written

    monkeypatch.setattr(usage_writer.UsageWriter, "_write_rows", insert_then_rebuild)


def _replayed_on_write(monkeypatch) -> None:
    """A rebuild reads the ledger, then the journal's replay writes and counts its rows, then the rebuild writes the
    counter it read."""
    write = rebuild._write_rebuild

    async def replay_then_write(*args, **kwargs):
        if journal_segments():
            await usage_writer.writer_for_this_loop().replay()
        return await write(*args, **kwargs)

    monkeypatch.setattr(rebuild, "_write_rebuild", replay_then_write)


def journal_segments():
    journal = usage_writer.journal()
    journal.seal()
    return journal.list_segments()


@pytest.mark.parametrize("interleaving", ["rebuilt between the commit and the count",
                                          "read before the commit, written after the count"])
def test_a_counter_rebuilt_during_a_replay_counts_its_row_once(monkeypatch, interleaving):
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    key = ApiKey.objects.create(organization=organization, name="k", lookup="k", digest="x")
    admitted, recorded = _served_in_a_ledger_outage(endpoint, "journaled", api_key=key)
    _settle(admitted, recorded)
    get_redis().flushdb()  # Redis lost its counters while the row waited in the journal

    if interleaving == "rebuilt between the commit and the count":
        _rebuilt_on_insert(monkeypatch, organization.pk, key.pk)
        _replay()
    else:
        _replayed_on_write(monkeypatch)
        asyncio.run(reserve(organization_id=organization.pk, api_key_id=key.pk, amount=Decimal("0.01"),
                            request_id="rebuilds"))
        assert not journal_segments()

    assert UsageRecord.objects.filter(request_id="journaled").exists()
    assert reads.counted_spend(organization.pk) == Decimal("0.60") == _key_spend(organization.pk, key.pk)
    _replay()  # nothing left: nothing counted again
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=key.pk, amount=Decimal("0.01"), request_id="next"))
    assert reads.counted_spend(organization.pk) == Decimal("0.60") == _key_spend(organization.pk, key.pk)


@pytest.mark.parametrize("interleaving", ["rebuilt between the commit and the count",
                                          "read before the commit, written after the count"])
def test_a_credit_figure_rebuilt_during_a_replay_draws_its_row_once(monkeypatch, interleaving):
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    set_billing_mode(SYSTEM, organization, mode=BillingMode.PREPAID)
    grant_credits(SYSTEM, organization, amount=Decimal("1.00"))
    admitted, recorded = _served_in_a_ledger_outage(endpoint, "journaled")
    _settle(admitted, recorded)
    get_redis().delete(redis_keys.credit_key(organization.pk))  # the figure expired (it lasts an hour at most)

    if interleaving == "rebuilt between the commit and the count":
        _rebuilt_on_insert(monkeypatch, organization.pk, None)
        _replay()
    else:
        _replayed_on_write(monkeypatch)
        asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"),
                            request_id="rebuilds"))

    assert _credit_left(organization.pk) == Decimal("0.40")  # $1.00 granted, $0.60 spent ($0.01 held apart)


def test_a_row_replayed_after_redis_lost_the_rebuild_under_way_is_counted_once(monkeypatch):
    # A rebuild read the ledger before the replay's commit; Redis then lost the rebuilds under way (a failover to a
    # replica without them), and the replay's count found the counter missing and no rebuild under way to tell. Before,
    # the rebuild wrote the counter anyway, from a snapshot without the row: counted nowhere. It now begins again.
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    admitted, recorded = _served_in_a_ledger_outage(endpoint, "journaled")
    _settle(admitted, recorded)
    get_redis().flushdb()  # Redis lost its counters while the row waited in the journal
    write, writes = rebuild._write_rebuild, []

    async def lost_and_replayed_then_write(*args, **kwargs):
        if journal_segments():
            get_redis().delete(redis_keys.rebuilding_key(organization.pk))
            await usage_writer.writer_for_this_loop().replay()
        writes.append(await write(*args, **kwargs))
        return writes[-1]

    monkeypatch.setattr(rebuild, "_write_rebuild", lost_and_replayed_then_write)
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"),
                        request_id="rebuilds"))

    assert not journal_segments() and UsageRecord.objects.filter(request_id="journaled").exists()
    assert reads.counted_spend(organization.pk) == Decimal("0.60")
    assert writes == [rebuild.LOST_MEANWHILE, 1]


def test_a_row_an_older_pod_settled_unmarked_is_counted_by_its_replay_never_left_out():
    # A pod from before the marks settles its journaled calls as any (no `j:` marks); its rows replayed by a newer
    # one are counted again where it counted them (the platform errs toward refusing, as with a call's worst case), and
    # in every counter rebuilt since, where skipping them would let spend past the cap. A guard: passes either way.
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    key = ApiKey.objects.create(organization=organization, name="k", lookup="k", digest="x")
    admitted, _ = _served_in_a_ledger_outage(endpoint, "journaled", api_key=key)
    _settle(admitted, Recorded.WRITTEN)  # as an older pod settled it: unmarked
    get_redis().delete(redis_keys.org_period_key(organization.pk, periods.period_containing().key))  # rebuilt since

    asyncio.run(reserve(organization_id=organization.pk, api_key_id=key.pk, amount=Decimal("0.01"), request_id="first"))
    _replay()

    assert reads.counted_spend(organization.pk) == Decimal("0.60")  # rebuilt without it: counted once
    assert _key_spend(organization.pk, key.pk) == Decimal("1.20")  # counted at its settlement, and again


def test_a_replay_written_and_counted_while_a_rebuild_reads_the_ledger_counts_once(monkeypatch):
    # The worker's replay of a shipped segment (register, write, count: `journal_shipping`) runs whole after the
    # rebuild's snapshot began and before it reads the registrations: the snapshot lacks the row, its count found no
    # counter, and the rebuild adds the cost the count left it.
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    report = dataclasses.replace(usage_report(endpoint, request_id="journaled", prompt_tokens=600_000,
                                              completion_tokens=0), billing_mode=BillingMode.POSTPAID)
    ask = replayed.replays_to_ask_about

    def replayed_then_asked(organization_id, counter):
        def replay():  # a thread of its own: another connection than the rebuild's snapshot
            replayed.register_replaying_sync([report])
            replayed.count_replayed(record_usage_batch([report]))

        thread = threading.Thread(target=replay)
        thread.start()
        thread.join()
        return ask(organization_id, counter)

    monkeypatch.setattr(replayed, "replays_to_ask_about", replayed_then_asked)
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"), request_id="first"))

    assert UsageRecord.objects.filter(request_id="journaled").exists()
    assert reads.counted_spend(organization.pk) == Decimal("0.60")


def test_a_row_replayed_while_its_call_is_still_reserved_counts_once_when_a_rebuild_lands_before_its_count(
        monkeypatch):
    # The rebuild leaves the row's cost out (its call is reserved, not settled), the count adds it and sets its settled
    # marker, and the call's own settlement then adds nothing. A guard: passes on HEAD's source too.
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    admitted, recorded = _served_in_a_ledger_outage(endpoint, "journaled")
    get_redis().delete(redis_keys.org_period_key(organization.pk, periods.period_containing().key))

    _rebuilt_on_insert(monkeypatch, organization.pk, None)
    _replay()
    _settle(admitted, recorded)

    assert reads.counted_spend(organization.pk) == Decimal("0.60")


# --- a replayer killed between its commit and its count ----------------------------------------------------------------
# Found, left open last stop: the INSERT committed, the count never came, and the next replay of the segment (another
# gateway's at its start, the worker's of a shipped copy) wrote nothing and so counted nothing: the row stayed out of
# every counter that existed then, spend past the cap, until each was rebuilt.
KILLED_REPLAYS = ["replayed again", "rebuilt after its registration lapsed, then replayed again"]


class _Killed(Exception):
    """The replaying process dies (SIGKILL, an OOM kill) right after its INSERT committed."""


@pytest.mark.parametrize("then", KILLED_REPLAYS)
def test_a_row_whose_replayer_was_killed_before_its_count_is_counted_once_by_the_next_replay(monkeypatch, then):
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    key = ApiKey.objects.create(organization=organization, name="k", lookup="k", digest="x")
    _cap(organization, "1.00")
    admitted, recorded = _served_in_a_ledger_outage(endpoint, "journaled", api_key=key)
    _settle(admitted, recorded)
    get_redis().delete(redis_keys.org_period_key(organization.pk, periods.period_containing().key),
                       redis_keys.key_period_key(organization.pk, key.pk, periods.period_containing().key))
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=key.pk, amount=Decimal("0.01"), request_id="first"))
    assert reads.counted_spend(organization.pk) == 0  # rebuilt from a ledger without the row

    async def killed(*args, **kwargs):
        raise _Killed()

    monkeypatch.setattr(usage_writer, "_count_replayed", killed)
    with pytest.raises(_Killed):
        _replay()
    monkeypatch.undo()
    assert UsageRecord.objects.filter(request_id="journaled").exists()  # committed, not counted
    if then == "rebuilt after its registration lapsed, then replayed again":
        get_redis().hset(redis_keys.replaying_key(organization.pk), "journaled", 1)  # its deadline long past
        get_redis().delete(redis_keys.org_period_key(organization.pk, periods.period_containing().key),
                           redis_keys.key_period_key(organization.pk, key.pk, periods.period_containing().key))
        asyncio.run(reserve(organization_id=organization.pk, api_key_id=key.pk, amount=Decimal("0.01"),
                            request_id="second"))  # its snapshot holds the row
    _replay()  # the segment was left: the next replay takes it

    assert reads.counted_spend(organization.pk) == Decimal("0.60") == _key_spend(organization.pk, key.pk)
    with pytest.raises(QuotaExceeded):  # $0.60 spent and $0.01 or $0.02 held of a $1.00 cap
        asyncio.run(reserve(organization_id=organization.pk, api_key_id=key.pk, amount=Decimal("0.80"),
                            request_id="over-the-cap"))
    _replay()  # nothing left: nothing counted again
    assert reads.counted_spend(organization.pk) == Decimal("0.60") == _key_spend(organization.pk, key.pk)


def test_a_call_the_sweeper_settles_after_its_killed_replays_registration_lapsed_is_not_counted_again(monkeypatch,
                                                                                                      settings):
    # Its gateway died after journaling its row, before settling; the replay was killed after its INSERT; the sweeper
    # settles the hold with the row's cost once the registration lapsed, and drops it: the next replay counts nothing.
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    _served_in_a_ledger_outage(endpoint, "journaled")  # never settled

    async def killed(*args, **kwargs):
        raise _Killed()

    monkeypatch.setattr(usage_writer, "_count_replayed", killed)
    with pytest.raises(_Killed):
        _replay()
    monkeypatch.undo()
    assert sweeper.sweep_expired_reservations(now=time.time() + 601) == 1  # the registration's 300 s are past
    assert reads.counted_spend(organization.pk) == Decimal("0.60") and reads.reserved_now(organization.pk) == 0

    _replay()
    assert reads.counted_spend(organization.pk) == Decimal("0.60")


def test_a_row_written_before_its_replay_registered_it_is_not_taken_for_a_killed_replays():
    # The gateway's own INSERT was cut short by its timeout and committed all the same (its row journaled, its call
    # settled as such); the counter was rebuilt from a ledger with the row; a replay registered it and failed (the
    # ledger down again); the next replay finds it registered and in the ledger, recorded before: not owed.
    endpoint = _priced_endpoint()
    organization = endpoint.organization
    admitted = asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.70"),
                                   request_id="journaled"))
    report = dataclasses.replace(usage_report(endpoint, request_id="journaled", prompt_tokens=600_000,
                                              completion_tokens=0), max_cost=Decimal("0.70"),
                                 billing_mode=admitted.billing_mode)
    with database_refusing_connections():
        assert asyncio.run(usage_writer.arecord_usage(report)) is Recorded.JOURNALED
    _settle(admitted, Recorded.JOURNALED)
    assert record_usage_batch([report]) == {"journaled"}  # the INSERT cut short, committed (5 s before its journal)
    UsageRecord.objects.update(recorded_at=F("recorded_at") - timedelta(seconds=10))
    get_redis().delete(redis_keys.org_period_key(organization.pk, periods.period_containing().key))
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"), request_id="first"))
    assert reads.counted_spend(organization.pk) == Decimal("0.60")  # rebuilt with the row
    replayed.register_replaying_sync([report])  # a replay that failed after it registered it

    _replay()
    assert reads.counted_spend(organization.pk) == Decimal("0.60")
