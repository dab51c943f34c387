"""Usage journaled during a database outage outlives the pod that journaled it: its segments go to the files bucket,
and the worker replays them from there, each row once."""

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from decimal import Decimal

import boto3
import psycopg
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from django.core.management import call_command
from django.db import OperationalError, connections

from billing import journal_shipping, usage_journal, usage_writer
from billing.models import UsageRecord
from billing.periods import period_containing
from billing.quota import reads, rebuild, replayed, sweeper
from billing.usage_journal import REJECTED_NAME, encode
from controlplane import redis_keys
from controlplane.redis_client import get_redis
from controlplane.worker_threads import in_worker_thread
from tests.batches.conftest import S3_KEY, S3_SECRET, files_bucket, files_bucket_name, s3_child, s3_server  # noqa: F401 - fixtures used here
from tests.billing.conftest import usage_report
from tests.billing.test_quota import _progress, reserve
from tests.billing.test_usage_journal import line_of_a_newer_version
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def outage(settings, tmp_path, monkeypatch, files_bucket):  # noqa: F811
    """PostgreSQL refusing writes (a demoted primary) until `outage.end()`; the journal in a folder of this test,
    shipped to the test's bucket once the outage has lasted `USAGE_JOURNAL_SHIP_AFTER_S` (0 here)."""
    settings.USAGE_JOURNAL_DIR = str(tmp_path / "journal")
    settings.USAGE_JOURNAL_SHIP, settings.USAGE_JOURNAL_SHIP_AFTER_S = True, 0.0
    usage_writer.journal.cache_clear()
    journal_shipping._client.cache_clear()
    monkeypatch.setattr(usage_writer, "OUTAGE_PROBE_S", 0.05)
    monkeypatch.setattr(usage_writer, "REPLAY_RETRY_MAX_S", 0.1)
    insert = usage_writer.record_usage_batch_on

    class Outage:
        on = True

        def end(self):
            self.on = False

    state = Outage()

    async def insert_unless_read_only(connection, batch):
        if state.on:
            raise psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction")
        return await insert(connection, batch)

    monkeypatch.setattr(usage_writer, "record_usage_batch_on", insert_unless_read_only)
    yield state
    usage_writer.journal.cache_clear()
    journal_shipping._client.cache_clear()


def _bucket_keys(bucket: str, prefix: str) -> list[str]:
    s3 = boto3.client("s3", endpoint_url=journal_shipping.settings.FILES_S3_ENDPOINT_URL, region_name="us-east-1",
                      aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET)
    return [item["Key"] for item in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]


def _journal_rows_while_down(reports, *, replay_for_s: float, shipped: bool = True) -> None:
    """`reports` journaled while PostgreSQL takes no writes, and the writer's replay loop left to meet the outage for
    `replay_for_s`; or (`shipped`, a reachable bucket) until it shipped every segment off the pod (at most 20 s).

    NOTE: waited for, not timed: on a loaded machine a fixed 0.5 s once ended before the segment reached the bucket
    (and where it came sooner, the rest of the 0.5 s was time lost)."""
    async def calls():
        writer = usage_writer.writer_for_this_loop()
        assert await asyncio.gather(*(writer.write(report) for report in reports)) == [usage_writer.Recorded.JOURNALED] * len(reports)
        # The writer's replay loop meets the outage again and again meanwhile.
        if shipped and replay_for_s:
            deadline = time.monotonic() + 20
            while usage_writer.journal().backlog() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        else:
            await asyncio.sleep(replay_for_s)

    asyncio.run(calls())


def _replay_here() -> None:
    """The local journal replayed into the ledger (a gateway's writer, once the database is back)."""

    async def replay():
        await asyncio.wait_for(usage_writer.writer_for_this_loop().replay_soon(), 10)

    asyncio.run(replay())


def test_usage_journaled_in_an_outage_outlives_the_pod(outage, files_bucket, settings):  # noqa: F811
    # A web pod journaled its calls' usage while PostgreSQL took no writes, and was deleted (a rollout; a scale-down
    # takes the pods that are not ready first, and a pod whose journal is full is not ready) before it came back:
    # its journal went with its volume, and every call it had answered went unbilled.
    endpoint = EndpointFactory()
    reports = [usage_report(endpoint, request_id=f"ship-{number:02d}") for number in range(6)]
    _journal_rows_while_down(reports, replay_for_s=0.5)

    assert _bucket_keys(files_bucket, journal_shipping.PREFIX), "the outage lasted: the segments are in the bucket"
    shutil.rmtree(settings.USAGE_JOURNAL_DIR, ignore_errors=True)  # the pod is gone, its volume with it
    outage.end()

    assert journal_shipping.replay_shipped() == len(reports)
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == [r.request_id for r in reports]
    assert _bucket_keys(files_bucket, journal_shipping.PREFIX) == []
    assert journal_shipping.replay_shipped() == 0 and UsageRecord.objects.count() == len(reports)


def test_a_process_stopping_in_an_outage_ships_what_it_could_not_replay(outage, files_bucket, settings):  # noqa: F811
    settings.USAGE_JOURNAL_SHIP_AFTER_S = 3600.0  # a short outage: nothing shipped while the process runs
    endpoint = EndpointFactory()
    reports = [usage_report(endpoint, request_id=f"stop-{number:02d}") for number in range(3)]

    async def calls_then_stop():
        writer = usage_writer.writer_for_this_loop()
        assert await asyncio.gather(*(writer.write(report) for report in reports)) == [usage_writer.Recorded.JOURNALED] * len(reports)
        await asyncio.sleep(0.2)
        assert _bucket_keys(files_bucket, journal_shipping.PREFIX) == []
        await usage_writer.replay_before_the_loop_ends(0.2)  # the gateway's shutdown, a batch run's end

    asyncio.run(calls_then_stop())

    assert usage_writer.journal().segments() == []
    assert len(_bucket_keys(files_bucket, journal_shipping.PREFIX)) >= 1
    outage.end()
    assert journal_shipping.replay_shipped() == len(reports)
    assert UsageRecord.objects.count() == len(reports)


def test_a_segment_both_shipped_and_replayed_here_counts_once(outage, files_bucket):  # noqa: F811
    # A process killed between its upload and its local delete leaves the segment in both places.
    endpoint = EndpointFactory()
    reports = [usage_report(endpoint, request_id=f"twice-{number:02d}") for number in range(4)]
    _journal_rows_while_down(reports, replay_for_s=0.0)
    usage_writer.journal().seal()
    [segment] = usage_writer.journal().segments()
    kept = segment.read_bytes()
    assert journal_shipping.ship(usage_writer.journal()) == 1
    segment.write_bytes(kept)
    outage.end()

    _replay_here()
    assert journal_shipping.replay_shipped() == 0
    assert UsageRecord.objects.count() == len(reports)


def test_a_counter_rebuilt_while_rows_wait_in_the_bucket_counts_them_once_the_worker_replays_them(
        outage, files_bucket):  # noqa: F811
    endpoint = EndpointFactory(price_input_per_million=Decimal("1"), price_output_per_million=Decimal("0"))
    organization_id = endpoint.organization_id
    reports = [usage_report(endpoint, request_id=f"spent-{number}", prompt_tokens=100_000, completion_tokens=0)
               for number in range(3)]  # $0.10 each
    _journal_rows_while_down(reports, replay_for_s=0.5)
    assert _bucket_keys(files_bucket, journal_shipping.PREFIX)

    # Redis lost its counters; PostgreSQL is back; a call rebuilds them from a ledger the rows are not in yet.
    get_redis().flushdb()
    outage.end()
    asyncio.run(reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"), request_id="first"))
    assert reads.counted_spend(organization_id) == 0

    assert journal_shipping.replay_shipped() == len(reports)
    assert reads.counted_spend(organization_id) == Decimal("0.30")
    assert journal_shipping.replay_shipped() == 0 and reads.counted_spend(organization_id) == Decimal("0.30")


def _shipped_then_billed_lost(outage, files_bucket, settings) -> int:  # noqa: F811
    """A stream's gateway journaled its whole row ($0.50), shipped it, and was killed before settling; PostgreSQL came
    back after the hold lapsed, and the sweeper billed the call from its last progress (20,000 of 200,000 tokens:
    $0.14). Returns its organisation."""
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = EndpointFactory(price_input_per_million=Decimal("1"), price_output_per_million=Decimal("2"))
    organization_id = endpoint.organization_id
    admitted = asyncio.run(reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.70"),
                                   request_id="shipped"))
    _progress(admitted, endpoint, prompt_tokens=100_000, completion_tokens=20_000)
    whole = dataclasses.replace(usage_report(endpoint, request_id="shipped", prompt_tokens=100_000,
                                             completion_tokens=200_000),
                                max_cost=Decimal("0.70"), billing_mode=admitted.billing_mode)
    _journal_rows_while_down([whole], replay_for_s=0.5)
    assert _bucket_keys(files_bucket, journal_shipping.PREFIX)
    outage.end()
    assert sweeper.sweep_expired_reservations(now=time.time() + 601) == 1
    return organization_id


def test_a_shipped_row_supersedes_the_row_the_sweeper_wrote_from_its_progress_once(outage, files_bucket, settings):  # noqa: F811
    organization_id = _shipped_then_billed_lost(outage, files_bucket, settings)
    assert reads.counted_spend(organization_id) == Decimal("0.14")

    assert journal_shipping.replay_shipped() == 0  # no row written: one superseded

    row = UsageRecord.objects.get()
    assert (row.status, row.completion_tokens, row.cost) == ("ok", 200_000, Decimal("0.50"))
    assert reads.counted_spend(organization_id) == Decimal("0.50") and reads.reserved_now(organization_id) == 0


def test_an_unreachable_bucket_keeps_the_segments_here(outage, settings):
    settings.FILES_S3_ENDPOINT_URL = "http://127.0.0.1:9"  # nothing listens
    journal_shipping._client.cache_clear()
    endpoint = EndpointFactory()
    reports = [usage_report(endpoint, request_id=f"kept-{number:02d}") for number in range(2)]
    _journal_rows_while_down(reports, replay_for_s=0.3, shipped=False)

    assert usage_writer.journal().backlog() == len(reports)
    outage.end()
    _replay_here()
    assert UsageRecord.objects.count() == len(reports)


def test_rows_the_ledger_refuses_are_kept_aside_in_the_bucket(outage, files_bucket, settings):  # noqa: F811
    endpoint = EndpointFactory()
    gone = EndpointFactory(organization=endpoint.organization)
    reports = [usage_report(endpoint, request_id="kept-ok"), usage_report(gone, request_id="kept-gone")]
    _journal_rows_while_down(reports, replay_for_s=0.3)
    gone.delete()
    outage.end()

    assert journal_shipping.replay_shipped() == 1
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == ["kept-ok"]
    assert _bucket_keys(files_bucket, journal_shipping.PREFIX) == []
    assert len(_bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX)) == 1
    assert not (usage_writer.journal().directory / REJECTED_NAME).exists()


def _put(bucket: str, key: str, data: bytes, **metadata) -> None:
    s3 = boto3.client("s3", endpoint_url=journal_shipping.settings.FILES_S3_ENDPOINT_URL, region_name="us-east-1",
                      aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET)
    s3.put_object(Bucket=bucket, Key=key, Body=data, Metadata=metadata)


def _put_signed(bucket: str, key: str, data: bytes) -> None:
    """`data` under `key`, signed by this platform as the shipping signs it (both signatures)."""
    _put(bucket, key, data, **journal_shipping._signatures(key, data))


def test_a_segment_the_platform_did_not_sign_is_never_billed(outage, files_bucket):  # noqa: F811
    # Whoever may write to the files bucket could put usage there for any organisation at any price.
    endpoint = EndpointFactory()
    forged = encode(dataclasses.replace(usage_report(endpoint, request_id="forged-1"), prompt_tokens=10**6))
    _put(files_bucket, journal_shipping.PREFIX + "evil-1-1.jsonl", forged)
    _put(files_bucket, journal_shipping.PREFIX + "evil-1-2.jsonl", forged,
         **{journal_shipping.SIGNATURE: "0" * 64})
    outage.end()

    assert journal_shipping.replay_shipped() == 0
    assert UsageRecord.objects.count() == 0
    assert _bucket_keys(files_bucket, journal_shipping.PREFIX) == []
    assert len(_bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX)) == 2


def test_a_shipped_line_this_version_cannot_read_is_kept_aside_in_the_bucket(outage, files_bucket):  # noqa: F811
    # New web pods shipped it; an older worker replays it (workers roll in no order, or the deploy is rolled back).
    # Before: logged "unreadable, skipped" and deleted with its segment: the call's usage unbilled for good.
    endpoint = EndpointFactory()
    newer = line_of_a_newer_version(usage_report(endpoint, request_id="newer-1"))
    data = newer + encode(usage_report(endpoint, request_id="known-1"))
    _put_signed(files_bucket, journal_shipping.PREFIX + "web-1-1.jsonl", data)
    outage.end()

    assert journal_shipping.replay_shipped() == 1
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == ["known-1"]
    assert _bucket_keys(files_bucket, journal_shipping.PREFIX) == []
    kept = journal_shipping.REJECTED_PREFIX + "web-1-1.jsonl"
    assert _bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX) == [kept]
    s3 = boto3.client("s3", endpoint_url=journal_shipping.settings.FILES_S3_ENDPOINT_URL, region_name="us-east-1",
                      aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET)
    assert s3.get_object(Bucket=files_bucket, Key=kept)["Body"].read() == newer


def test_rows_the_ledger_refuses_for_what_they_hold_do_not_block_the_segments_after(outage, files_bucket):  # noqa: F811
    endpoint = EndpointFactory()
    poisoned = encode(dataclasses.replace(usage_report(endpoint, request_id="poison-1"), prompt_tokens=2**31))
    good = encode(usage_report(endpoint, request_id="after-1"))
    for name, data in (("a-1-1.jsonl", poisoned), ("b-1-1.jsonl", good)):
        _put_signed(files_bucket, journal_shipping.PREFIX + name, data)
    outage.end()

    assert journal_shipping.replay_shipped() == 1
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == ["after-1"]
    assert _bucket_keys(files_bucket, journal_shipping.PREFIX) == []
    assert _bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX) == [journal_shipping.REJECTED_PREFIX + "a-1-1.jsonl"]


@pytest.mark.parametrize("interleaving", ["rebuilt before the supersede",
                                          "read before the supersede, written after its count"])
def test_a_counter_rebuilt_while_a_shipped_row_supersedes_a_lost_row_counts_its_difference_once(
        outage, files_bucket, settings, monkeypatch, interleaving):  # noqa: F811
    # As the gateway's replay (tests/billing/test_lost_row_superseded.py): the worker's replay registered the row, so a
    # rebuild that read the lost row ($0.14) marked it counted, and a count that found the counter missing told its
    # rebuild nothing: $0.14 counted for $0.50.
    organization_id = _shipped_then_billed_lost(outage, files_bucket, settings)
    get_redis().flushdb()  # Redis lost its counters

    async def rebuilds():
        await reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"), request_id="rebuilds")

    if interleaving == "rebuilt before the supersede":
        supersede = journal_shipping.supersede_lost_rows

        def rebuild_then_supersede(*args, **kwargs):
            asyncio.run(rebuilds())
            return supersede(*args, **kwargs)

        monkeypatch.setattr(journal_shipping, "supersede_lost_rows", rebuild_then_supersede)
        assert journal_shipping.replay_shipped() == 0
    else:
        write, done = rebuild._write_rebuild, []

        async def replay_then_write(*args, **kwargs):
            if not done:  # the organisation counter's rebuild read the lost row (as a worker's task: its own connection)
                done.append(await in_worker_thread(journal_shipping.replay_shipped)())
            return await write(*args, **kwargs)

        monkeypatch.setattr(rebuild, "_write_rebuild", replay_then_write)
        asyncio.run(rebuilds())
        assert done == [0]

    assert UsageRecord.objects.get().cost == Decimal("0.50")
    assert reads.counted_spend(organization_id) == Decimal("0.50")


def _replay_held_up(lock_sql: str) -> bool:
    """Replays the shipped segments while another connection holds `lock_sql`'s lock for 3.5 s (past a registration
    of 2 s); True when PostgreSQL cancelled the replay's write (past `replayed.WRITE_TIMEOUT_S`: nothing committed,
    the segment waits for the next run)."""
    holder = psycopg.connect(**{name: value for name, value in connections["default"].get_connection_params().items()
                                if name != "cursor_factory"})
    holder.execute(lock_sql)
    releases = threading.Timer(3.5, holder.rollback)
    releases.start()
    try:
        journal_shipping.replay_shipped()
        return False
    except OperationalError:
        return True
    finally:
        releases.join()
        holder.close()


def test_a_shipped_batch_held_up_past_its_registration_never_commits_late_to_be_counted_twice(
        outage, files_bucket, monkeypatch):  # noqa: F811
    # Before, the worker's INSERT had no statement timeout: held up (a lock here) past its registration's life, it
    # committed after it, and a counter rebuilt between its commit and its count read the rows without asking about
    # them (no registration): the count added them again, $0.60 counted for $0.30.
    monkeypatch.setattr(replayed, "REGISTRATION_TTL_S", 2)
    monkeypatch.setattr(replayed, "WRITE_TIMEOUT_S", 1, raising=False)
    endpoint = EndpointFactory(price_input_per_million=Decimal("1"), price_output_per_million=Decimal("0"))
    organization_id = endpoint.organization_id
    reports = [usage_report(endpoint, request_id=f"late-{number}", prompt_tokens=100_000, completion_tokens=0)
               for number in range(3)]  # $0.10 each
    _journal_rows_while_down(reports, replay_for_s=0.5)
    outage.end()
    asyncio.run(reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"), request_id="first"))
    assert reads.counted_spend(organization_id) == 0

    count, rebuilds = replayed.count_replayed, []

    def rebuilt_then_counted(request_ids, **kwargs):  # a call rebuilds the counter between the commit and the count
        get_redis().delete(redis_keys.org_period_key(organization_id, period_containing().key))
        rebuilds.append(asyncio.run(reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"),
                                            request_id=f"rebuilds-{len(rebuilds)}")))
        return count(request_ids, **kwargs)

    monkeypatch.setattr(replayed, "count_replayed", rebuilt_then_counted)
    cancelled = _replay_held_up(f"LOCK TABLE {UsageRecord._meta.db_table} IN SHARE MODE")  # an INSERT waits for it
    if cancelled:
        assert not UsageRecord.objects.filter(request_id__startswith="late-").exists()
        assert journal_shipping.replay_shipped() == len(reports)  # registered again, written, counted
    assert UsageRecord.objects.filter(request_id__startswith="late-").count() == len(reports)
    assert reads.counted_spend(organization_id) == Decimal("0.30")
    assert cancelled


def test_a_shipped_rows_supersede_held_up_past_its_registration_never_commits_late_to_count_its_difference_twice(
        outage, files_bucket, settings, monkeypatch):  # noqa: F811
    # Before, the worker's supersede UPDATE ran in autocommit with no statement timeout: held up (a lock on the lost
    # row) past its registration's life, it committed after it. A counter rebuilt then still asks about the lapsed
    # registration (kept a day, `replayed.REGISTRATION_KEPT_S`), so the difference is counted once either way; bounded
    # as the INSERT is, it commits inside the registration's life or not at all (the segment waits, and its next run
    # supersedes and counts).
    monkeypatch.setattr(replayed, "REGISTRATION_TTL_S", 2)
    monkeypatch.setattr(replayed, "WRITE_TIMEOUT_S", 1)
    organization_id = _shipped_then_billed_lost(outage, files_bucket, settings)
    assert reads.counted_spend(organization_id) == Decimal("0.14")
    count = replayed.count_superseded

    # A call rebuilds the counter between the supersede's commit and its count.
    def rebuilt_then_counted(lost_costs, **kwargs):
        get_redis().delete(redis_keys.org_period_key(organization_id, period_containing().key))
        asyncio.run(reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"),
                            request_id=f"rebuilds-{len(lost_costs)}"))
        return count(lost_costs, **kwargs)

    monkeypatch.setattr(replayed, "count_superseded", rebuilt_then_counted)
    cancelled = _replay_held_up(f"SELECT id FROM {UsageRecord._meta.db_table} WHERE request_id = 'shipped' FOR UPDATE")
    if cancelled:
        assert UsageRecord.objects.get(request_id="shipped").status == "gateway_lost"
        assert journal_shipping.replay_shipped() == 0  # registered again, superseded, its difference counted once
    assert UsageRecord.objects.get(request_id="shipped").cost == Decimal("0.50")
    assert reads.counted_spend(organization_id) == Decimal("0.50")
    assert cancelled


class _Killed(Exception):
    """The worker dies (an OOM kill, a node lost) right after its INSERT committed."""


def test_shipped_rows_whose_worker_was_killed_before_their_count_are_counted_by_its_next_run(
        outage, files_bucket, monkeypatch):  # noqa: F811
    # Before, the next run wrote nothing and so counted nothing: the rows stayed out of the counters that existed.
    endpoint = EndpointFactory(price_input_per_million=Decimal("1"), price_output_per_million=Decimal("0"))
    organization_id = endpoint.organization_id
    reports = [usage_report(endpoint, request_id=f"spent-{number}", prompt_tokens=100_000, completion_tokens=0)
               for number in range(3)]  # $0.10 each
    _journal_rows_while_down(reports, replay_for_s=0.5)
    assert _bucket_keys(files_bucket, journal_shipping.PREFIX)
    outage.end()
    asyncio.run(reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"), request_id="first"))
    assert reads.counted_spend(organization_id) == 0

    def killed(*args, **kwargs):
        raise _Killed()

    monkeypatch.setattr(replayed, "count_replayed", killed)
    with pytest.raises(_Killed):
        journal_shipping.replay_shipped()
    monkeypatch.undo()
    assert UsageRecord.objects.count() == len(reports)  # committed, not counted; the segment still in the bucket

    assert journal_shipping.replay_shipped() == 0  # nothing written now
    assert reads.counted_spend(organization_id) == Decimal("0.30")
    assert journal_shipping.replay_shipped() == 0 and reads.counted_spend(organization_id) == Decimal("0.30")


def _paused_at(monkeypatch, name: str):
    """`replayed.<name>` held, in the thread of `_replay_in_a_thread` and only there, until `go` is set: a worker paused
    at that seam (a long GC, a stopped process, a redelivered task's first run). Returns (`paused`, `go`)."""
    paused, go, seam = threading.Event(), threading.Event(), getattr(replayed, name)

    def held(*args, **kwargs):
        if threading.current_thread().name == "paused replay" and args[0]:  # rows to write or count
            paused.set()
            assert go.wait(30)
        return seam(*args, **kwargs)

    monkeypatch.setattr(replayed, name, held)
    return paused, go


def _replay_in_a_thread() -> threading.Thread:
    def replay():
        try:
            journal_shipping.replay_shipped()
        finally:
            connections.close_all()

    thread = threading.Thread(target=replay, name="paused replay")
    thread.start()
    return thread


def _three_rows_shipped(outage, prefix: str) -> tuple[int, list]:
    """Three rows ($0.10 each) journaled and shipped in an outage, PostgreSQL back, the counter built by a call.
    Returns their organisation and the rows."""
    endpoint = EndpointFactory(price_input_per_million=Decimal("1"), price_output_per_million=Decimal("0"))
    organization_id = endpoint.organization_id
    reports = [usage_report(endpoint, request_id=f"{prefix}-{number}", prompt_tokens=100_000, completion_tokens=0)
               for number in range(3)]
    _journal_rows_while_down(reports, replay_for_s=0.5)
    outage.end()
    asyncio.run(reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"), request_id="first"))
    return organization_id, reports


def test_two_replays_of_a_segment_at_once_count_each_row_once(outage, files_bucket, monkeypatch):  # noqa: F811
    # Two workers (or a task Celery redelivered while its first run still ran) replay the same segment: the first
    # wrote the rows and paused before its count; the second wrote nothing, found the rows registered by a replay that
    # had not counted them (`owed`) and counted them; the first then counted them again: $0.60 counted for $0.30.
    organization_id, reports = _three_rows_shipped(outage, "both")
    paused, go = _paused_at(monkeypatch, "count_replayed")

    first = _replay_in_a_thread()
    assert paused.wait(30)
    assert UsageRecord.objects.filter(request_id__startswith="both-").count() == len(reports)  # committed, not counted
    assert journal_shipping.replay_shipped() == 0  # the second: nothing written now
    go.set()
    first.join(30)
    assert not first.is_alive()

    assert reads.counted_spend(organization_id) == Decimal("0.30")
    assert journal_shipping.replay_shipped() == 0 and reads.counted_spend(organization_id) == Decimal("0.30")


def test_two_replays_registering_in_turn_count_the_rows_the_second_wrote_once(outage, files_bucket, monkeypatch):  # noqa: F811
    # The other order: the first registered the rows and paused before its INSERT; the second registered them too,
    # wrote them and paused before its count; the first, writing nothing, dropped their registrations uncounted; a
    # counter rebuilt then read the rows without asking about them, and the second's count added them again: $0.60
    # counted for $0.30.
    organization_id, reports = _three_rows_shipped(outage, "turn")
    paused, go = _paused_at(monkeypatch, "record_registered_batch")
    count, counted = replayed.count_replayed, threading.Event()

    def counted_after_the_first(request_ids, **kwargs):  # the second's count, once the first's is done
        if threading.current_thread().name != "paused replay":
            go.set()
            assert counted.wait(30)
            get_redis().delete(redis_keys.org_period_key(organization_id, period_containing().key))
            asyncio.run(reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"),
                                request_id="rebuilds"))
            return count(request_ids, **kwargs)
        try:
            return count(request_ids, **kwargs)
        finally:
            counted.set()

    monkeypatch.setattr(replayed, "count_replayed", counted_after_the_first)
    first = _replay_in_a_thread()
    assert paused.wait(30)
    assert journal_shipping.replay_shipped() == len(reports)  # the second wrote them
    first.join(30)
    assert not first.is_alive()

    assert reads.counted_spend(organization_id) == Decimal("0.30")


def test_a_shipped_rows_supersede_killed_before_its_count_is_counted_by_the_next_run(
        outage, files_bucket, settings, monkeypatch):  # noqa: F811
    # Before, the next run found no lost row left to supersede and counted nothing: $0.14 counted for $0.50 (spend
    # past the cap, or past the prepaid credit, until the counter was next rebuilt).
    organization_id = _shipped_then_billed_lost(outage, files_bucket, settings)
    assert reads.counted_spend(organization_id) == Decimal("0.14")

    def killed(*args, **kwargs):
        raise _Killed()

    monkeypatch.setattr(replayed, "count_superseded", killed)
    with pytest.raises(_Killed):
        journal_shipping.replay_shipped()
    monkeypatch.undo()
    assert UsageRecord.objects.get(request_id="shipped").cost == Decimal("0.50")  # superseded, not counted

    assert journal_shipping.replay_shipped() == 0
    assert reads.counted_spend(organization_id) == Decimal("0.50")
    assert journal_shipping.replay_shipped() == 0 and reads.counted_spend(organization_id) == Decimal("0.50")


def test_a_shipped_rows_supersede_paused_before_its_count_while_another_run_replays_it_counts_its_difference_once(
        outage, files_bucket, settings, monkeypatch):  # noqa: F811
    organization_id = _shipped_then_billed_lost(outage, files_bucket, settings)
    paused, go = _paused_at(monkeypatch, "count_superseded")

    first = _replay_in_a_thread()
    assert paused.wait(30)
    assert journal_shipping.replay_shipped() == 0  # the second: counts what the first left
    go.set()
    first.join(30)
    assert not first.is_alive()

    assert UsageRecord.objects.get(request_id="shipped").cost == Decimal("0.50")
    assert reads.counted_spend(organization_id) == Decimal("0.50")


def test_a_line_an_older_version_kept_aside_is_billed_once_by_replay_rejected_usage(outage, files_bucket):  # noqa: F811
    """Before, nothing ever read the rejected prefix again (and its objects were not signed, so nothing could trust
    them): a line an older worker could not read during a rolling deploy or a rollback was never billed."""
    endpoint = EndpointFactory()
    known = encode(usage_report(endpoint, request_id="known-2"))
    newer = encode(usage_report(endpoint, request_id="newer-2"))  # what this version reads, an older one did not
    gone = EndpointFactory(organization=endpoint.organization)
    refused = encode(usage_report(gone, request_id="refused-2"))  # its endpoint deleted: the ledger refuses it
    gone.delete()
    data = known + newer + refused
    _put_signed(files_bucket, journal_shipping.PREFIX + "web-2-1.jsonl", data)
    forged = encode(usage_report(endpoint, request_id="forged-2"))
    _put(files_bucket, journal_shipping.REJECTED_PREFIX + "evil-2-1.jsonl", forged)
    outage.end()
    assert journal_shipping.replay_shipped() == 3 - 1  # the refused row kept aside, signed
    # An older worker's replay had kept `newer-2` aside too: as it would have, the known row's line with it.
    UsageRecord.objects.filter(request_id="newer-2").delete()
    s3 = boto3.client("s3", endpoint_url=journal_shipping.settings.FILES_S3_ENDPOINT_URL, region_name="us-east-1",
                      aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET)
    kept = journal_shipping.REJECTED_PREFIX + "web-2-1.jsonl"
    aside = s3.get_object(Bucket=files_bucket, Key=kept)["Body"].read() + known + newer
    _put_signed(files_bucket, kept, aside)

    call_command("replay_rejected_usage")
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == ["known-2", "newer-2"]
    call_command("replay_rejected_usage")  # again: each row once
    assert UsageRecord.objects.filter(request_id__in=["known-2", "newer-2"]).count() == 2
    assert _bucket_keys(files_bucket, journal_shipping.PREFIX) == []
    # The refused row is kept again (signed, for a later run); the forged object never billed, left as it is.
    assert sorted(_bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX)) == [
        journal_shipping.REJECTED_PREFIX + "evil-2-1.jsonl", kept]
    assert [json.loads(line)["request_id"] for line in s3.get_object(Bucket=files_bucket, Key=kept)["Body"].read()
            .splitlines()] == ["refused-2"]


def test_what_a_gateways_replay_sets_aside_is_shipped_off_the_pod_and_counted(outage, files_bucket, settings):  # noqa: F811
    """Before, `rejected.jsonl` stayed on the pod's volume (an emptyDir, gone with the pod), never shipped, and no
    metric said it had lines: an operator learnt of them from the log alone, if at all."""
    endpoint = EndpointFactory()
    newer = line_of_a_newer_version(usage_report(endpoint, request_id="newer-3"))
    directory = usage_writer.journal().directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "gone-3-1.jsonl").write_bytes(newer + encode(usage_report(endpoint, request_id="known-3")))
    counted = usage_journal.lines_set_aside.labels(reason="unreadable")._value.get()
    outage.end()

    _replay_here()
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == ["known-3"]
    assert usage_journal.lines_set_aside.labels(reason="unreadable")._value.get() == counted + 1
    # NOTE: waited for: the set-aside lines are shipped by a thread of their own once the replay ended (a whole-suite
    # run of the tests read the bucket before that thread's upload, and found nothing).
    deadline = time.monotonic() + 20
    while not (_bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX)
               and (directory / REJECTED_NAME).read_bytes() == b"") and time.monotonic() < deadline:
        time.sleep(0.05)
    (shipped,) = _bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX)
    assert shipped.endswith(REJECTED_NAME)
    s3 = boto3.client("s3", endpoint_url=journal_shipping.settings.FILES_S3_ENDPOINT_URL, region_name="us-east-1",
                      aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET)
    answer = s3.get_object(Bucket=files_bucket, Key=shipped)
    body = answer["Body"].read()
    assert body == newer and journal_shipping._signed(shipped, body, answer["Metadata"])
    assert (directory / REJECTED_NAME).read_bytes() == b""  # handed over: nothing twice


def test_replay_rejected_usage_goes_on_when_the_beats_replay_took_the_moved_segment_first(
        outage, files_bucket, monkeypatch):  # noqa: F811
    """`replay_rejected_usage` moves a kept object back under the shipped prefix, where the beat's
    `replay_shipped_usage` may replay (and delete) it first. Before, the command then crashed with NoSuchKey, and the
    objects listed after it were left for another run."""
    endpoint = EndpointFactory()
    for number in (1, 2):
        data = encode(usage_report(endpoint, request_id=f"aside-4-{number}"))
        _put_signed(files_bucket, journal_shipping.REJECTED_PREFIX + f"web-4-{number}.jsonl", data)
    outage.end()
    replay_one = journal_shipping._replay_one

    def the_beat_replays_it_first(key):
        replay_one(key)  # the beat's run, between the move and the command's own replay
        return replay_one(key)

    monkeypatch.setattr(journal_shipping, "_replay_one", the_beat_replays_it_first)
    assert journal_shipping.replay_rejected() == (0, [])  # each row written by the beat's run, none twice
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == ["aside-4-1", "aside-4-2"]
    assert _bucket_keys(files_bucket, journal_shipping.PREFIX) == []


def test_a_slow_bucket_holds_a_loops_end_no_longer_than_its_replay_time(outage, files_bucket, monkeypatch):  # noqa: F811
    """Before, what a replay set aside was shipped without `timeout_s`'s bound: a put that took 3 s held
    `replay_before_the_loop_ends(0.5)` (a gateway's shutdown, a batch run's end) 3 s, and a slow bucket up to its
    attempts' ~26 s. Now it is waited for until the time is up; it goes on in its own thread."""
    endpoint = EndpointFactory()
    directory = usage_writer.journal().directory
    directory.mkdir(parents=True, exist_ok=True)
    line = line_of_a_newer_version(usage_report(endpoint, request_id="newer-5"))
    (directory / REJECTED_NAME).write_bytes(line)
    client = journal_shipping._client()
    put_object = client.put_object

    def slowly(**kwargs):  # NOTE: 2 s (3 before): waited for, the loop's end would take 2.5 s and more, past 1.5
        time.sleep(2)
        return put_object(**kwargs)

    monkeypatch.setattr(client, "put_object", slowly)
    outage.end()
    started = time.monotonic()
    asyncio.run(usage_writer.replay_before_the_loop_ends(0.5))
    assert time.monotonic() - started < 1.5
    usage_writer.ship_set_aside_soon().join(10)  # it went on meanwhile
    assert len(_bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX)) == 1
    assert (directory / REJECTED_NAME).read_bytes() == b""


def test_what_the_workers_replay_of_the_bucket_sets_aside_is_counted(outage, files_bucket):  # noqa: F811
    """The README says each line set aside is counted; before, the worker's replay of a shipped segment set lines
    aside under the rejected prefix and counted none (only a gateway's replay did)."""
    endpoint = EndpointFactory()
    gone = EndpointFactory(organization=endpoint.organization)
    refused = encode(usage_report(gone, request_id="refused-6"))  # its endpoint deleted: the ledger refuses it
    gone.delete()
    data = line_of_a_newer_version(usage_report(endpoint, request_id="newer-6")) + refused
    _put_signed(files_bucket, journal_shipping.PREFIX + "web-6-1.jsonl", data)
    counted = {reason: usage_journal.lines_set_aside.labels(reason=reason)._value.get()
               for reason in ("refused", "unreadable")}
    outage.end()
    assert journal_shipping.replay_shipped() == 0
    assert {reason: usage_journal.lines_set_aside.labels(reason=reason)._value.get() - counted[reason]
            for reason in counted} == {"refused": 1, "unreadable": 1}


def _s3():
    return boto3.client("s3", endpoint_url=journal_shipping.settings.FILES_S3_ENDPOINT_URL, region_name="us-east-1",
                        aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET)


def test_a_signed_object_copied_under_another_name_is_never_billed(outage, files_bucket):  # noqa: F811
    """Before, the signature covered an object's bytes alone: a set-aside object copied under the shipped prefix (or
    under any other name) was read as signed, and its rows written into the ledger (the test saw 1 row and no key
    left aside as unsigned)."""
    endpoint = EndpointFactory()
    data = encode(usage_report(endpoint, request_id="copied-7"))
    kept = journal_shipping.REJECTED_PREFIX + "web-7-1.jsonl"
    _put_signed(files_bucket, kept, data)
    s3 = _s3()
    for copy in (journal_shipping.PREFIX + "web-7-1.jsonl", journal_shipping.REJECTED_PREFIX + "other-7-1.jsonl"):
        # with its metadata, both signatures, as a copy keeps them (`aws s3 cp`, a bucket's replication)
        s3.copy_object(Bucket=files_bucket, Key=copy, CopySource={"Bucket": files_bucket, "Key": kept},
                       MetadataDirective="COPY")
    s3.delete_object(Bucket=files_bucket, Key=kept)
    outage.end()

    assert journal_shipping.replay_shipped() == 0  # the copy under the shipped prefix: refused, kept aside unsigned
    assert journal_shipping.replay_rejected() == (0, sorted(
        [journal_shipping.REJECTED_PREFIX + "other-7-1.jsonl", journal_shipping.REJECTED_PREFIX + "web-7-1.jsonl"]))
    assert UsageRecord.objects.count() == 0


def test_an_object_the_previous_release_signed_over_its_bytes_alone_is_still_replayed(outage, files_bucket):  # noqa: F811
    # Shipped by the previous release's pods during a rolling deploy: its signature covers the bytes, not the key.
    from django.utils.crypto import salted_hmac

    endpoint = EndpointFactory()
    data = encode(usage_report(endpoint, request_id="older-8"))
    legacy = salted_hmac("billing.journal_shipping", data, algorithm="sha256").hexdigest()
    _put(files_bucket, journal_shipping.REJECTED_PREFIX + "web-8-1.jsonl", data, **{journal_shipping.SIGNATURE: legacy})
    outage.end()

    assert journal_shipping.replay_rejected() == (1, [])
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == ["older-8"]


def _object_lines(bucket: str, prefix: str) -> list[bytes]:
    s3 = _s3()
    return [line for key in _bucket_keys(bucket, prefix)
            for line in s3.get_object(Bucket=bucket, Key=key)["Body"].read().splitlines(keepends=True)]


def test_a_large_set_aside_goes_in_parts_and_a_put_failing_midway_leaves_here_exactly_what_the_bucket_lacks(
        outage, files_bucket, monkeypatch):  # noqa: F811
    """Before, the whole of `rejected.jsonl` was read into memory and sent as one object, however large an outage had
    made it (the test saw one object of 12 lines, 3 times the part's bound)."""
    endpoint = EndpointFactory()
    lines = [encode(usage_report(endpoint, request_id=f"aside-9-{number:02}")) for number in range(12)]
    directory = usage_writer.journal().directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / REJECTED_NAME).write_bytes(b"".join(lines))
    part_bytes = max(map(len, lines)) * 4  # four lines at most a part
    monkeypatch.setattr(journal_shipping, "SET_ASIDE_PART_BYTES", part_bytes)
    client = journal_shipping._client()
    put_object, num_puts = client.put_object, [0]

    def third_put_fails(**kwargs):
        num_puts[0] += 1
        if num_puts[0] == 3:
            raise EndpointConnectionError(endpoint_url="http://bucket.test")
        return put_object(**kwargs)

    monkeypatch.setattr(client, "put_object", third_put_fails)
    assert 0 < journal_shipping.ship_set_aside(usage_writer.journal()) < len(b"".join(lines))
    shipped = _object_lines(files_bucket, journal_shipping.REJECTED_PREFIX)
    left = (directory / REJECTED_NAME).read_bytes().splitlines(keepends=True)
    assert shipped and left
    assert sorted(shipped + left) == sorted(lines)  # each line in exactly one place
    s3 = _s3()
    assert all(s3.head_object(Bucket=files_bucket, Key=key)["ContentLength"] <= part_bytes
               for key in _bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX))

    journal_shipping.ship_set_aside(usage_writer.journal())  # the bucket answers again
    assert sorted(_object_lines(files_bucket, journal_shipping.REJECTED_PREFIX)) == sorted(lines)
    assert (directory / REJECTED_NAME).read_bytes() == b""
    assert all(s3.head_object(Bucket=files_bucket, Key=key)["ContentLength"] <= part_bytes
               for key in _bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX))
    outage.end()
    assert journal_shipping.replay_rejected() == (12, [])  # every part signed: each line billed once


def _wait_until_shipped(bucket: str, directory, num_objects: int = 1) -> None:
    """Until the bucket's rejected prefix holds `num_objects` and `rejected.jsonl` is empty here (at most 20 s): the
    shipper is a thread of its own."""
    deadline = time.monotonic() + 20
    while not (len(_bucket_keys(bucket, journal_shipping.REJECTED_PREFIX)) >= num_objects
               and (directory / REJECTED_NAME).read_bytes() == b"") and time.monotonic() < deadline:
        time.sleep(0.05)


def test_lines_set_aside_before_an_outage_mid_replay_are_shipped_by_the_next_replay(
        outage, files_bucket, settings, monkeypatch):  # noqa: F811
    """Before, a replay shipped what it set aside only after its loop: one that met an outage on a later segment
    raised past it, and the next replay, which set nothing new aside, shipped nothing (the test saw an empty rejected
    prefix and the line still in `rejected.jsonl` 20 s on: on the pod's emptyDir, lost with it)."""
    settings.USAGE_JOURNAL_SHIP_AFTER_S = 30.0  # the default: a blip shorter than it ships no segment
    endpoint = EndpointFactory()
    directory = usage_writer.journal().directory
    directory.mkdir(parents=True, exist_ok=True)
    newer = line_of_a_newer_version(usage_report(endpoint, request_id="newer-10"))
    (directory / "gone-10-1.jsonl").write_bytes(newer)  # unreadable: set aside, nothing to write
    (directory / "gone-10-2.jsonl").write_bytes(encode(usage_report(endpoint, request_id="known-10")))
    client = journal_shipping._client()
    put_object, reachable = client.put_object, threading.Event()

    def out_of_reach_until_set(**kwargs):
        if not reachable.is_set():
            raise EndpointConnectionError(endpoint_url="http://files.invalid")
        return put_object(**kwargs)

    monkeypatch.setattr(client, "put_object", out_of_reach_until_set)

    async def replay():
        await usage_writer.writer_for_this_loop().replay()

    with pytest.raises(usage_writer.OUTAGES):
        asyncio.run(replay())  # segment 1 set aside, segment 2 meets the outage
    usage_writer.ship_set_aside_soon().join(1)  # tried, the bucket out of reach: the line stays here
    assert (directory / REJECTED_NAME).read_bytes() == newer
    reachable.set()
    outage.end()
    asyncio.run(replay())  # segment 2 written, nothing new set aside: what is still here is tried again
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == ["known-10"]
    _wait_until_shipped(files_bucket, directory)
    (shipped,) = _bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX)
    assert _s3().get_object(Bucket=files_bucket, Key=shipped)["Body"].read() == newer
    assert (directory / REJECTED_NAME).read_bytes() == b""


def test_lines_set_aside_after_the_running_shipper_read_the_file_are_shipped_too(outage, files_bucket, monkeypatch):  # noqa: F811
    """Before, `ship_set_aside_soon` returned a running shipper as it was, though it may have read the file already:
    a line appended after that read waited for a later trigger, maybe none (the test saw one object in the bucket
    and the second line left in `rejected.jsonl`)."""
    endpoint = EndpointFactory()
    directory = usage_writer.journal().directory
    directory.mkdir(parents=True, exist_ok=True)
    first = line_of_a_newer_version(usage_report(endpoint, request_id="newer-11-1"))
    later = line_of_a_newer_version(usage_report(endpoint, request_id="newer-11-2"))
    (directory / REJECTED_NAME).write_bytes(first)
    ship_set_aside, calls = journal_shipping.ship_set_aside, []

    def then_another_replay_sets_a_line_aside(journal):
        shipped = ship_set_aside(journal)
        calls.append(shipped)
        if len(calls) == 1:  # the shipper has read and emptied the file, and is still alive: a replay's `done` now
            journal.done(directory / "gone-11-1.jsonl", [], [later.rstrip(b"\n")])
            usage_writer.ship_set_aside_soon()
        return shipped

    monkeypatch.setattr(journal_shipping, "ship_set_aside", then_another_replay_sets_a_line_aside)
    usage_writer.ship_set_aside_soon().join(20)
    _wait_until_shipped(files_bucket, directory, num_objects=2)
    assert sorted(_object_lines(files_bucket, journal_shipping.REJECTED_PREFIX)) == sorted([first, later])
    assert (directory / REJECTED_NAME).read_bytes() == b""


def test_lines_a_bucket_blip_left_here_are_shipped_with_the_database_up(files_bucket, settings, monkeypatch,  # noqa: F811
                                                                         tmp_path):
    """Before, only a replay (a database outage, a process start) or a stop tried the set-aside lines again: a bucket
    blip as a replay set them aside left them on the pod's emptyDir while the database stayed up, possibly for days
    (the test saw, after 20 writes over 4 s with the bucket back, an empty rejected prefix and the line still in
    `rejected.jsonl`). Now the shipper retries by itself, backing off, until the file is empty."""
    settings.USAGE_JOURNAL_DIR, settings.USAGE_JOURNAL_SHIP = str(tmp_path / "journal"), True
    usage_writer.journal.cache_clear()
    journal_shipping._client.cache_clear()
    monkeypatch.setattr(usage_writer, "SET_ASIDE_RETRY_FIRST_S", 0.5)
    endpoint = EndpointFactory()
    directory = usage_writer.journal().directory
    directory.mkdir(parents=True, exist_ok=True)
    newer = line_of_a_newer_version(usage_report(endpoint, request_id="newer-13"))
    (directory / "gone-13-1.jsonl").write_bytes(newer)  # a dead process's segment, one unreadable line
    client = journal_shipping._client()
    put_object, reachable, num_tries = client.put_object, threading.Event(), []

    def blip(**kwargs):
        num_tries.append(1)
        if not reachable.is_set():
            raise EndpointConnectionError(endpoint_url="http://files.invalid")
        return put_object(**kwargs)

    monkeypatch.setattr(client, "put_object", blip)

    async def traffic():
        writer = usage_writer.writer_for_this_loop()
        await writer.replay()  # the database up: the line is set aside, the bucket blips
        while not num_tries:
            await asyncio.sleep(0.01)
        reachable.set()  # the bucket is back
        # NOTE: 10 writes over 2 s (20 over 4 s before): no write replays, so no number of them ships the line; the
        # shipper's own tries (0.5 s, then 1 s) come within them, and the wait below bounds the rest.
        for i in range(10):  # normal traffic, the database up: no replay
            await writer.write(usage_report(endpoint, request_id=f"ok-13-{i}"))
            await asyncio.sleep(0.2)
        await writer.close()

    asyncio.run(traffic())
    assert UsageRecord.objects.filter(request_id__startswith="ok-13-").count() == 10
    _wait_until_shipped(files_bucket, directory)
    assert _object_lines(files_bucket, journal_shipping.REJECTED_PREFIX) == [newer]
    assert (directory / REJECTED_NAME).read_bytes() == b""


def test_a_stop_in_an_outage_ships_no_longer_than_its_budget(files_bucket, settings, monkeypatch, tmp_path):  # noqa: F811
    """Before, a process that stopped in an outage shipped every segment, then the set-aside parts inline, with no
    bound: the grace period's SIGKILL could cut an upload (the test, a budget of 3 s and a bucket taking 1.5 s a put,
    saw the stop take ~7.5 s, every segment shipped). Now no upload begins that could end past the budget; what is
    left stays in the journal."""
    settings.USAGE_JOURNAL_DIR, settings.USAGE_JOURNAL_SHIP = str(tmp_path / "journal"), True
    usage_writer.journal.cache_clear()
    journal_shipping._client.cache_clear()
    monkeypatch.setattr(usage_writer, "SET_ASIDE_STOP_WAIT_S", 3.0)
    monkeypatch.setattr(journal_shipping, "ONE_PUT_BOUND_S", 2.0)
    endpoint = EndpointFactory()
    directory = usage_writer.journal().directory
    directory.mkdir(parents=True, exist_ok=True)
    for number in range(4):  # dead processes' segments
        (directory / f"gone-14-{number}.jsonl").write_bytes(encode(usage_report(endpoint, request_id=f"r-14-{number}")))
    (directory / REJECTED_NAME).write_bytes(line_of_a_newer_version(usage_report(endpoint, request_id="newer-14")))
    client = journal_shipping._client()
    put_object = client.put_object

    def slowly(**kwargs):
        time.sleep(1.5)
        return put_object(**kwargs)

    monkeypatch.setattr(client, "put_object", slowly)
    started = time.monotonic()
    num_shipped = asyncio.run(usage_writer.ship_what_is_left(time.monotonic(), process_stops=True))
    assert time.monotonic() - started < 3.5
    assert num_shipped == len(_bucket_keys(files_bucket, journal_shipping.PREFIX)) == 1
    assert len(usage_writer.journal().list_segments()) == 3  # left for the next start
    assert len(_bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX)) == 1  # shipped meanwhile
    assert (directory / REJECTED_NAME).read_bytes() == b""


def test_a_stop_in_an_outage_gives_the_shipping_what_the_drain_left_of_the_grace_period(files_bucket, settings, monkeypatch, tmp_path):  # noqa: F811
    """A fixed bound after the replay left segments on the pod (lost with it) while the grace period still had the
    drain's unused time: with the same 3 s bound and a bucket taking 1.5 s a put, the stop shipped 1 of 4 segments.
    Given what is left of the stop's budget (`ship_until`, `drain.stop_budget_end`), it ships all 4, within it."""
    settings.USAGE_JOURNAL_DIR, settings.USAGE_JOURNAL_SHIP = str(tmp_path / "journal"), True
    usage_writer.journal.cache_clear()
    journal_shipping._client.cache_clear()
    monkeypatch.setattr(usage_writer, "SET_ASIDE_STOP_WAIT_S", 3.0)
    monkeypatch.setattr(journal_shipping, "ONE_PUT_BOUND_S", 2.0)
    endpoint = EndpointFactory()
    directory = usage_writer.journal().directory
    directory.mkdir(parents=True, exist_ok=True)
    for number in range(4):  # dead processes' segments
        (directory / f"gone-15-{number}.jsonl").write_bytes(encode(usage_report(endpoint, request_id=f"r-15-{number}")))
    client = journal_shipping._client()
    put_object = client.put_object

    def slowly(**kwargs):
        time.sleep(1.5)
        return put_object(**kwargs)

    monkeypatch.setattr(client, "put_object", slowly)
    started = time.monotonic()
    num_shipped = asyncio.run(usage_writer.ship_what_is_left(time.monotonic(), process_stops=True,
                                                             ship_until=started + 12))
    assert time.monotonic() - started < 12
    assert num_shipped == len(_bucket_keys(files_bucket, journal_shipping.PREFIX)) == 4
    assert usage_writer.journal().list_segments() == []


def test_a_signalled_stops_shipping_ends_with_its_budget_when_that_is_shorter(files_bucket, settings, monkeypatch,  # noqa: F811
                                                                              tmp_path):
    """A signalled stop's budget (`ship_until`) is capped by the pod's grace period (`drain.stop_budget_end`), but
    the shipping took the later of it and 30 s after the replay: with a cap 3.5 s away and 10 s after the replay,
    1 s a put, it shipped on to +10 s, past the cap (as SIGKILL would come). Now no upload begins that could end past
    `ship_until`."""
    settings.USAGE_JOURNAL_DIR, settings.USAGE_JOURNAL_SHIP = str(tmp_path / "journal"), True
    usage_writer.journal.cache_clear()
    journal_shipping._client.cache_clear()
    monkeypatch.setattr(usage_writer, "SET_ASIDE_STOP_WAIT_S", 10.0)
    monkeypatch.setattr(journal_shipping, "ONE_PUT_BOUND_S", 2.0)
    endpoint = EndpointFactory()
    directory = usage_writer.journal().directory
    directory.mkdir(parents=True, exist_ok=True)
    for number in range(8):  # dead processes' segments
        (directory / f"gone-93-{number}.jsonl").write_bytes(encode(usage_report(endpoint, request_id=f"r-93-{number}")))
    client = journal_shipping._client()
    put_object = client.put_object
    uploads = []

    def slowly(**kwargs):
        uploads.append(time.monotonic())
        time.sleep(1.0)
        return put_object(**kwargs)

    monkeypatch.setattr(client, "put_object", slowly)
    started = time.monotonic()
    ship_until = started + 3.5
    num_shipped = asyncio.run(usage_writer.ship_what_is_left(started, process_stops=True, ship_until=ship_until))
    assert time.monotonic() < ship_until
    assert [round(at - started, 2) for at in uploads if at > ship_until - 2.0 + 0.05] == []
    assert num_shipped + len(usage_writer.journal().list_segments()) == 8
    usage_writer.journal.cache_clear()
    journal_shipping._client.cache_clear()


def test_a_stop_also_bounds_the_shipping_a_replay_loop_began_in_an_outage(outage, files_bucket, monkeypatch):  # noqa: F811
    """A replay loop shipping an outage's segments (after `USAGE_JOURNAL_SHIP_AFTER_S`) does so in an executor
    thread, which went on when its task was cancelled at the stop, past the stop's bound, and the loop's close waited
    for it: the third review saw the stop's loop end 10.1 s after the stop began against a 3.5 s bound, uploads begun
    at 2.55, 4.05, ... 8.59 s. Now no upload begins, in any thread, that could end past the stop's bound."""
    monkeypatch.setattr(usage_writer, "SET_ASIDE_STOP_WAIT_S", 3.0)
    monkeypatch.setattr(journal_shipping, "ONE_PUT_BOUND_S", 2.0)
    endpoint = EndpointFactory()
    directory = usage_writer.journal().directory
    directory.mkdir(parents=True, exist_ok=True)
    for number in range(8):
        (directory / f"gone-77-{number}.jsonl").write_bytes(encode(usage_report(endpoint, request_id=f"r-77-{number}")))
    client = journal_shipping._client()
    put_object = client.put_object
    uploads = []

    def slowly(**kwargs):
        uploads.append(time.monotonic())
        time.sleep(1.5)
        return put_object(**kwargs)

    monkeypatch.setattr(client, "put_object", slowly)
    began = []

    async def gateway():
        usage_writer.writer_for_this_loop().replay_soon()  # lifespan startup: the replay meets the outage
        await asyncio.sleep(0.5)  # ... and ships (USAGE_JOURNAL_SHIP_AFTER_S is 0 here) in an executor thread
        began.append(time.monotonic())
        await usage_writer.replay_before_the_loop_ends(0.5, process_stops=True)

    asyncio.run(gateway())
    assert time.monotonic() - began[0] < 3.0 + 0.5 + 1.5  # the bound, the replay's wait, one put begun before it
    assert [round(at - began[0], 2) for at in uploads if at - began[0] > 3.5 - 2.0] == []
    # what was not shipped is still here, each line once in all
    shipped = len(_bucket_keys(files_bucket, journal_shipping.PREFIX))
    assert shipped + len(usage_writer.journal().list_segments()) == 8


def test_a_stop_also_bounds_the_set_aside_parts_a_replay_loops_shipping_began(outage, files_bucket, monkeypatch):  # noqa: F811
    """A replay loop's `ship` in an outage, past its segments and into its set-aside parts before the stop, uploaded
    every part, each up to `ONE_PUT_BOUND_S`, with no look at the stop's bound, as did the daemon shipper; and the
    loop's close waited for its executor thread: the fourth review saw the stop's coroutine return at +3.0 s, the loop
    close at +10.6 s, and uploads begun after the bound in both threads. Now no part begins that could end past it,
    and what was not shipped stays in the file, each line once in all."""
    monkeypatch.setattr(usage_writer, "SET_ASIDE_STOP_WAIT_S", 2.5)
    monkeypatch.setattr(journal_shipping, "ONE_PUT_BOUND_S", 2.0)
    endpoint = EndpointFactory()
    directory = usage_writer.journal().directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "gone-91-0.jsonl").write_bytes(encode(usage_report(endpoint, request_id="r-91-0")))
    lines = [encode(usage_report(endpoint, request_id=f"aside-91-{number:02}")) for number in range(12)]
    (directory / REJECTED_NAME).write_bytes(b"".join(lines))
    monkeypatch.setattr(journal_shipping, "SET_ASIDE_PART_BYTES", max(map(len, lines)))  # one line a part
    client = journal_shipping._client()
    put_object = client.put_object
    uploads = []

    def slowly(**kwargs):
        uploads.append((time.monotonic(), threading.current_thread().name))
        time.sleep(1.0)
        return put_object(**kwargs)

    monkeypatch.setattr(client, "put_object", slowly)
    began = []

    async def gateway():
        usage_writer.writer_for_this_loop().replay_soon()  # lifespan startup: the replay meets the outage
        await asyncio.sleep(1.5)  # ... ships the segment and is in its inline `ship_set_aside`, in an executor thread
        began.append(time.monotonic())
        await usage_writer.replay_before_the_loop_ends(0.5, process_stops=True)  # the stop's bound: +3.0 s

    asyncio.run(gateway())
    bound = began[0] + 0.5 + 2.5
    assert time.monotonic() < bound + 1.0  # one put begun before the bound's last second, and no more
    assert [(round(at - bound, 2), thread) for at, thread in uploads if at > bound - 2.0 + 0.05] == []
    usage_writer.ship_set_aside_soon().join(5)  # the daemon shipper, asked again, begins no part either
    assert [(round(at - bound, 2), thread) for at, thread in uploads if at > bound - 2.0 + 0.05] == []
    in_the_bucket = _object_lines(files_bucket, journal_shipping.REJECTED_PREFIX)
    left = (directory / REJECTED_NAME).read_bytes().splitlines(keepends=True)
    assert left and sorted(in_the_bucket + left) == sorted(lines)


def test_a_stop_in_an_outage_ships_its_segments_after_a_replay_that_used_its_whole_time(outage, files_bucket,  # noqa: F811
                                                                                         settings, monkeypatch):
    """The shipping's floor (`SET_ASIDE_STOP_WAIT_S`) was counted from before the replay, which in an outage uses its
    whole time: at production's numbers / 10 (a 0.5 s replay, 3 s, a 2.6 s put) that left 2.5 s < 2.6 s, and the
    fourth review saw no segment shipped, with no signal to give it more (`ship_until` None). Now the floor is counted
    from the replay's deadline, as web.yaml's grace period counts the two (5 + 30 s)."""
    settings.USAGE_JOURNAL_SHIP_AFTER_S = 3600.0  # a young outage: the replay loop has not shipped
    monkeypatch.setattr(usage_writer, "SET_ASIDE_STOP_WAIT_S", 3.0)
    monkeypatch.setattr(journal_shipping, "ONE_PUT_BOUND_S", 2.6)
    endpoint = EndpointFactory()
    reports = [usage_report(endpoint, request_id=f"r-92-{number}") for number in range(3)]

    async def calls_then_stop():
        writer = usage_writer.writer_for_this_loop()
        await asyncio.gather(*(writer.write(report) for report in reports))
        await asyncio.sleep(0.2)
        await usage_writer.replay_before_the_loop_ends(0.5, process_stops=True)

    asyncio.run(calls_then_stop())
    assert _bucket_keys(files_bucket, journal_shipping.PREFIX) != []
    assert usage_writer.journal().list_segments() == []


def test_a_stop_waits_for_set_aside_lines_alone_no_longer_than_their_own_bound(files_bucket, settings, monkeypatch, tmp_path):  # noqa: F811
    """Set-aside lines a bucket never takes (a wrong name or credentials) held every signalled stop for the whole
    stop's budget, an idle pod's too (the third review: ~155 s a pod, a rollout fixing the bucket paid it for each old
    pod). With no segment to ship they are waited for `SET_ASIDE_STOP_WAIT_S`, whatever the budget left."""
    settings.USAGE_JOURNAL_DIR, settings.USAGE_JOURNAL_SHIP = str(tmp_path / "journal"), True
    usage_writer.journal.cache_clear()
    journal_shipping._client.cache_clear()
    monkeypatch.setattr(usage_writer, "SET_ASIDE_STOP_WAIT_S", 1.0)
    endpoint = EndpointFactory()
    directory = usage_writer.journal().directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / REJECTED_NAME).write_bytes(line_of_a_newer_version(usage_report(endpoint, request_id="newer-16")))
    client = journal_shipping._client()

    def refused(**kwargs):
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "denied"}}, "PutObject")

    monkeypatch.setattr(client, "put_object", refused)
    started = time.monotonic()
    asyncio.run(usage_writer.replay_before_the_loop_ends(0.2, process_stops=True, ship_until=started + 20))
    assert time.monotonic() - started < 3.0
    assert (directory / REJECTED_NAME).read_bytes() != b""  # kept here, for the next start


_STOPPING_CHILD = r"""
import asyncio, inspect, time, django
django.setup()
from billing import journal_shipping, usage_writer
client = journal_shipping._client()
put = client.put_object
def slowly(**kwargs):
    time.sleep(1.5)  # a slow bucket (boto3 retrying): past the replay's 0.5 s by 1 s
    return put(**kwargs)
client.put_object = slowly
started = time.monotonic()
# as the gateway's lifespan shutdown calls it (endpoints/gateway/app.py), the process ending right after
stops = {"process_stops": True} if "process_stops" in inspect.signature(usage_writer.replay_before_the_loop_ends).parameters else {}
asyncio.run(usage_writer.replay_before_the_loop_ends(0.5, **stops))
print("returned after", round(time.monotonic() - started, 2))
"""


def test_a_gateway_that_stops_waits_for_its_set_aside_lines_to_reach_the_bucket(files_bucket, tmp_path):  # noqa: F811
    """Before, a gateway's shutdown waited for the set-aside shipper only until its replay's deadline (often ~0 s
    left), then exited, and the daemon thread died with it mid-upload (the test saw the child return after 0.5 s, an
    empty rejected prefix, and the line still in `rejected.jsonl`, on an emptyDir that goes with the pod)."""
    directory = tmp_path / "journal"
    directory.mkdir()
    (directory / REJECTED_NAME).write_bytes(b'{"request_id": "aside-12"}\n')
    env = {**os.environ, "INFERPLANE_USAGE_JOURNAL_DIR": str(directory), "INFERPLANE_USAGE_JOURNAL_SHIP": "1",
           "DJANGO_SETTINGS_MODULE": "tests.settings"}
    done = subprocess.run([sys.executable, "-c", _STOPPING_CHILD], env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(_bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX)) == 1, done.stdout
    assert (directory / REJECTED_NAME).read_bytes() == b""



def test_a_gateways_lifespan_shutdown_replays_as_a_process_that_stops(monkeypatch):
    """The wait above is the gateway's only if its shutdown says the process stops after (before, it could not)."""
    from controlplane.asgi import application
    from endpoints.gateway import app

    called = []

    async def replay_before_the_loop_ends(timeout_s, **kwargs):
        called.append((timeout_s, kwargs))

    monkeypatch.setattr(app, "replay_before_the_loop_ends", replay_before_the_loop_ends)

    async def receive():
        return {"type": "lifespan.shutdown"}

    async def send(message):
        pass

    asyncio.run(application({"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}, receive, send))
    assert called == [(app.SHUTDOWN_REPLAY_S, {"process_stops": True, "ship_until": None})]  # no signal, no drain


def test_a_signalled_gateways_shipping_may_run_to_the_end_of_the_stops_budget(monkeypatch, settings):
    """After a SIGTERM the shipping is given the stop's budget counted from the signal (web.yaml's grace period:
    the drain, uvicorn's graceful shutdown, the cut calls' finishes, the replay, the shipping), not 30 s from
    whenever the replay ended: before, a stop whose drain ended at once left segments on the pod after 30 s."""
    from controlplane.asgi import application
    from controlplane.serve import GRACEFUL_SHUTDOWN_S
    from endpoints.gateway import app, call, drain

    settings.GATEWAY_DRAIN_S = 100
    signalled = time.monotonic() - 1.0
    monkeypatch.setattr(drain, "_draining_since", signalled)
    called = []

    async def replay_before_the_loop_ends(timeout_s, **kwargs):
        called.append((timeout_s, kwargs))

    monkeypatch.setattr(app, "replay_before_the_loop_ends", replay_before_the_loop_ends)

    async def receive():
        return {"type": "lifespan.shutdown"}

    async def send(message):
        pass

    asyncio.run(application({"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}, receive, send))
    budget = 100 + GRACEFUL_SHUTDOWN_S + call.SHUTDOWN_FINISH_WAIT_S + app.SHUTDOWN_REPLAY_S + usage_writer.SET_ASIDE_STOP_WAIT_S
    assert budget <= 170 - 10  # the pod's grace period less its preStop sleep (infra/k8s/base/web.yaml)
    assert called == [(app.SHUTDOWN_REPLAY_S, {"process_stops": True, "ship_until": signalled + budget})]

def test_a_signalled_gateways_shipping_never_runs_past_the_pods_grace_period(monkeypatch, settings):
    """The README's rule for `INFERPLANE_GATEWAY_DRAIN_S` counted neither the journal's replay (5 s) nor its shipping
    (30 s): with grace 170 s it allowed a drain of 140 s, and the fourth review saw the shipping given to +195 s after
    the signal, SIGKILL coming at +160 s. With the grace period known (`GATEWAY_STOP_GRACE_S`), the budget ends before
    it, whatever the drain says."""
    from endpoints.gateway import app, drain

    settings.GATEWAY_DRAIN_S = 170 - 10 - 10 - 10  # the README's old rule: grace, preStop, graceful, finishes
    settings.GATEWAY_STOP_GRACE_S = 170 - 10  # web.yaml: the grace period less the preStop sleep
    monkeypatch.setattr(drain, "_draining_since", 1000.0)
    assert drain.stop_budget_end(app.AFTER_GRACEFUL_S) - 1000.0 <= 160 - drain.STOP_EXIT_S
    settings.GATEWAY_DRAIN_S = 100  # web.yaml's: the steps' bounds, within the cap
    assert drain.stop_budget_end(app.AFTER_GRACEFUL_S) - 1000.0 == 100 + 10 + 10 + 5 + 30
    settings.GATEWAY_STOP_GRACE_S = 600  # stated longer than the pod's: never lengthens the shipping
    assert drain.stop_budget_end(app.AFTER_GRACEFUL_S) - 1000.0 == 100 + 10 + 10 + 5 + 30
    settings.GATEWAY_DRAIN_S, settings.GATEWAY_STOP_GRACE_S = 140, 0  # the grace period not known: no cap
    assert drain.stop_budget_end(app.AFTER_GRACEFUL_S) - 1000.0 == 140 + 10 + 10 + 5 + 30
    # ... but steps that overran keep the shipping's own 30 s after the replay
    assert drain.stop_budget_end(app.AFTER_GRACEFUL_S, at_least=1200.0) == 1200.0


def test_a_drain_set_past_the_grace_periods_room_is_cut_short_for_the_steps_after_it(monkeypatch, settings):
    """`GATEWAY_STOP_GRACE_S` capped the shipping alone: a drain set by the README's old rule (140 s with grace 170 s)
    ran the graceful wait and the cut calls' finishes into SIGKILL, and the journal's replay and shipping never ran
    (the fifth review). Now the drain leaves them their room."""
    from endpoints.gateway import app, drain

    monkeypatch.setattr(drain, "_graceful_shutdown_s", 10)
    monkeypatch.setattr(drain, "_after_graceful_s", app.AFTER_GRACEFUL_S)
    settings.GATEWAY_DRAIN_S, settings.GATEWAY_STOP_GRACE_S = 140, 160
    assert drain.drain_bound_s() == 160 - drain.STOP_EXIT_S - 10 - (10 + 5 + 30)
    settings.GATEWAY_DRAIN_S = 100  # web.yaml's fits: kept
    assert drain.drain_bound_s() == 100
    settings.GATEWAY_STOP_GRACE_S = 0  # not known: as configured
    settings.GATEWAY_DRAIN_S = 140
    assert drain.drain_bound_s() == 140


def test_a_stop_whose_steps_overran_still_ships_what_fits_before_the_grace_periods_end(
    outage, files_bucket, settings, monkeypatch  # noqa: F811
):
    """Production numbers (drain 100, graceful 10, grace 160): the steps before the shipping overran by 3 s, the
    replay's deadline at signal + 128. SIGKILL comes 32 s later, room for one 27 s put before the exit's 3 s; before,
    the shipping ended at the steps' summed bounds (signal + 155, 27 s after the replay, no room for a put begun after
    it) and shipped nothing (the fifth review's test, which overran by 5.5 s)."""
    from endpoints.gateway import app, drain

    settings.GATEWAY_DRAIN_S, settings.GATEWAY_STOP_GRACE_S = 100, 160
    endpoint = EndpointFactory()
    directory = usage_writer.journal().directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "gone-5-0.jsonl").write_bytes(encode(usage_report(endpoint, request_id="r-5-0")))
    replay_deadline = time.monotonic()
    monkeypatch.setattr(drain, "_draining_since", replay_deadline - 128)
    monkeypatch.setattr(drain, "_graceful_shutdown_s", 10)
    ship_until = drain.stop_budget_end(app.AFTER_GRACEFUL_S, at_least=replay_deadline + 30)
    assert ship_until - replay_deadline == pytest.approx(160 - 128 - drain.STOP_EXIT_S)
    assert asyncio.run(usage_writer.ship_what_is_left(replay_deadline, process_stops=True, ship_until=ship_until)) == 1


def test_a_signalled_gateways_budget_counts_the_graceful_wait_its_server_was_given(monkeypatch, settings):
    """The budget counted `controlplane.serve.GRACEFUL_SHUTDOWN_S` (10 s) whatever `--timeout-graceful-shutdown` the
    server was given: with 30 s, uvicorn's wait alone could use 20 s of the shipping's time unseen. Now the drain reads
    it from the server it hooks (`drain.install`)."""
    import signal

    import uvicorn

    from endpoints.gateway import app, drain

    settings.GATEWAY_DRAIN_S, settings.GATEWAY_STOP_GRACE_S = 100, 0
    server = uvicorn.Server(uvicorn.Config("controlplane.asgi:application", timeout_graceful_shutdown=30))
    monkeypatch.setattr(drain, "_graceful_shutdown_s", None)
    before = signal.signal(signal.SIGTERM, server.handle_exit)
    try:
        async def starts():
            return drain.install()

        assert asyncio.run(starts())
    finally:
        signal.signal(signal.SIGTERM, before)
    monkeypatch.setattr(drain, "_draining_since", 1000.0)
    assert drain.stop_budget_end(app.AFTER_GRACEFUL_S) - 1000.0 == 100 + 30 + 10 + 5 + 30


def _previous_releases_check(body: bytes, metadata: dict[str, str]) -> bool:
    """The previous release's verification (52dcf06, billing/journal_shipping.py: `_signed(body, metadata[SIGNATURE])`),
    as it was: an HMAC of the bytes alone, under the metadata name `inferplane-signature`."""
    from django.conf import settings
    from django.utils.crypto import constant_time_compare, salted_hmac

    signature = metadata.get("inferplane-signature", "")
    return any(constant_time_compare(signature, salted_hmac("billing.journal_shipping", body, secret=secret,
                                                            algorithm="sha256").hexdigest())
               for secret in (settings.SECRET_KEY, *settings.SECRET_KEY_FALLBACKS))


def test_what_this_release_ships_is_billed_by_a_worker_rolled_back_past_it(outage, files_bucket, settings):  # noqa: F811
    """Before, this release signed its objects over their key and bytes alone, under the name the previous release
    reads as a bytes-only signature: a worker rolled back past it refused every segment and set-aside object this one
    shipped, and set them aside unsigned, billed by no release (the test saw the previous release's check refuse
    both objects)."""
    endpoint = EndpointFactory()
    _journal_rows_while_down([usage_report(endpoint, request_id="rollback-13")], replay_for_s=0.5)
    directory = usage_writer.journal().directory
    (directory / REJECTED_NAME).write_bytes(line_of_a_newer_version(usage_report(endpoint, request_id="newer-13")))
    journal_shipping.ship_set_aside(usage_writer.journal())
    s3 = _s3()
    keys = _bucket_keys(files_bucket, journal_shipping.PREFIX) + _bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX)
    assert len(keys) == 2
    for key in keys:
        answer = s3.get_object(Bucket=files_bucket, Key=key)
        body, metadata = answer["Body"].read(), answer["Metadata"]
        assert _previous_releases_check(body, metadata), key
        assert journal_shipping._signed(key, body, metadata), key


def test_a_copy_stripped_of_its_keyed_signature_is_read_as_the_previous_releases_and_bills_once(outage, files_bucket):  # noqa: F811
    """What the bytes-only signature, kept for a rollback, still lets through: a deliberate copy of a shipped segment,
    under another name, without its keyed signature. It holds rows this platform wrote, and the ledger's dedupe by
    request id bills each once, however often it is replayed."""
    endpoint = EndpointFactory()
    _journal_rows_while_down([usage_report(endpoint, request_id="copied-14")], replay_for_s=0.5)
    (shipped,) = _bucket_keys(files_bucket, journal_shipping.PREFIX)
    s3 = _s3()
    legacy = s3.head_object(Bucket=files_bucket, Key=shipped)["Metadata"][journal_shipping.SIGNATURE]
    for copy in ("copy-14-1.jsonl", "copy-14-2.jsonl"):
        s3.copy_object(Bucket=files_bucket, Key=journal_shipping.PREFIX + copy,
                       CopySource={"Bucket": files_bucket, "Key": shipped},
                       Metadata={journal_shipping.SIGNATURE: legacy}, MetadataDirective="REPLACE")
    outage.end()

    assert journal_shipping.replay_shipped() == 1  # the original and its two copies: one row written
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == ["copied-14"]
    assert _bucket_keys(files_bucket, journal_shipping.PREFIX) == []
    assert _bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX) == []


def test_a_keyed_signature_that_does_not_match_is_refused_whatever_the_bytes_only_one_says(outage, files_bucket):  # noqa: F811
    # The bytes-only signature counts only on an object without a keyed one (the previous release's).
    endpoint = EndpointFactory()
    data = encode(usage_report(endpoint, request_id="moved-15"))
    metadata = journal_shipping._signatures(journal_shipping.REJECTED_PREFIX + "web-15-1.jsonl", data)
    _put(files_bucket, journal_shipping.PREFIX + "web-15-1.jsonl", data, **metadata)
    outage.end()

    assert journal_shipping.replay_shipped() == 0
    assert UsageRecord.objects.count() == 0


_EXITING_WORKER = r"""
import os, sys, time, django
django.setup()
import billing.tasks  # noqa: F401 - as the worker's autodiscovery imports it, with its receivers
from billing import journal_shipping, usage_writer
client = journal_shipping._client()
put = client.put_object
def slowly(**kwargs):
    time.sleep(1.2)  # a slow bucket (boto3 retrying): past the child's exit (0.2 s in) by 1 s
    return put(**kwargs)
client.put_object = slowly
if sys.argv[1] == "child":
    from celery.concurrency.prefork import process_destructor
    usage_writer.ship_set_aside_soon()  # a batch run's replay set lines aside; its end did not wait
    time.sleep(0.2)
    process_destructor(os.getpid(), 0)  # what billiard's pool child runs as it exits (its `on_exit`)
else:
    from celery.signals import worker_shutdown
    worker_shutdown.send(sender=None)  # the main process, its pool gone
os._exit(0)  # as billiard's child exits: no atexit, daemon threads killed
"""


@pytest.mark.parametrize("process", ["child", "main"])
def test_a_batch_worker_process_that_exits_waits_for_its_set_aside_lines_to_reach_the_bucket(
        files_bucket, tmp_path, process):  # noqa: F811
    """Before, nothing waited for the set-aside shipper as a Celery worker's process exited: a pool child's
    `os._exit` killed it mid-upload, and the main process never shipped (the test saw an empty rejected prefix and
    the line still in `rejected.jsonl`, on an emptyDir that goes with the pod)."""
    directory = tmp_path / "journal"
    directory.mkdir()
    (directory / REJECTED_NAME).write_bytes(b'{"request_id": "aside-15"}\n')
    env = {**os.environ, "INFERPLANE_USAGE_JOURNAL_DIR": str(directory), "INFERPLANE_USAGE_JOURNAL_SHIP": "1",
           "DJANGO_SETTINGS_MODULE": "tests.settings"}
    done = subprocess.run([sys.executable, "-c", _EXITING_WORKER, process], env=env, capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(_bucket_keys(files_bucket, journal_shipping.REJECTED_PREFIX)) == 1, done.stderr[-2000:]
    assert (directory / REJECTED_NAME).read_bytes() == b""
