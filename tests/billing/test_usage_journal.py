"""The usage journal keeps every field of a report exactly, money included, and is bounded: past its limit the
gateway admits no new call until it is replayed."""

import asyncio
import dataclasses
import fcntl
import io
import json
import os
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from django.utils import timezone

from billing import usage_journal, usage_writer
from billing.ledger import UsageReport
from billing.models import BillingMode, UsageRecord
from billing.usage_journal import REJECTED_NAME, UsageJournal, decode, encode, read_segment
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory


def test_a_journalled_report_comes_back_exactly_with_its_reserved_cost():
    started = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    report = UsageReport(
        request_id="req-1", organization_id=7, api_key_id=3, endpoint_id="6f0c3f5e-0000-4000-8000-000000000001",
        replica_id=None, prompt_tokens=12, cached_tokens=4, completion_tokens=30, started_at=started,
        first_token_at=started + timedelta(seconds=1), finished_at=started + timedelta(seconds=2), status="ok",
        cold_start_s=0.5, max_cost=Decimal("0.000123456789"), billing_mode=BillingMode.PREPAID,
    )
    assert decode(encode(report)) == report
    unreserved = dataclasses.replace(report, max_cost=None)
    assert decode(encode(unreserved)) == unreserved
    assert decode(_without_mode(encode(report))) == dataclasses.replace(report, billing_mode=None,
                                                                         mode_when_started=True)


def test_a_journal_line_is_every_field_of_its_report_and_leaves_the_report_as_it_was():
    """A line holds each field (a cold start's phases, money as text, times with their offset) as the deep copy it was
    encoded from before; the report it came from, and the phases it names, are left unchanged."""
    started = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    phases = {"queue": 120, "load": 3400}
    report = UsageReport(
        request_id="req-2", organization_id=7, api_key_id=None, endpoint_id="6f0c3f5e-0000-4000-8000-000000000002",
        replica_id="r-1", prompt_tokens=12, cached_tokens=4, completion_tokens=30, started_at=started,
        first_token_at=None, finished_at=started + timedelta(seconds=2), status="ok", cold_start_s=3.52,
        max_cost=Decimal("0.000123456789"), batch_id="batch_1", cold_start_ms=3520, cold_start_phases=phases,
        adapter="sql", price_input_per_million=Decimal("0.5"), price_cached_input_per_million=Decimal("0.25"),
        price_output_per_million=Decimal("1.50"), price_fraction=Decimal("0.5"), billing_mode=BillingMode.POSTPAID,
    )
    expected = dataclasses.asdict(report) | {
        "started_at": "2026-11-30T12:00:00Z", "first_token_at": None, "finished_at": "2026-11-30T12:00:02Z",
        "max_cost": "0.000123456789", "price_input_per_million": "0.5", "price_cached_input_per_million": "0.25",
        "price_output_per_million": "1.50", "price_fraction": "0.5"}
    line = encode(report)
    assert line == json.dumps(expected, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
    assert decode(line) == report
    assert report.started_at == started and report.max_cost == Decimal("0.000123456789")
    assert report.cold_start_phases is phases and phases == {"queue": 120, "load": 3400}


def test_a_line_written_before_lines_used_msgspec_reads_back_the_same():
    """Lines of journals (and progress in Redis) written through the json module, times with "+00:00", still replay."""
    started = datetime(2026, 11, 30, 12, 0, 1, 250000, tzinfo=UTC)
    report = UsageReport(
        request_id="req-3", organization_id=7, api_key_id=2, endpoint_id="6f0c3f5e-0000-4000-8000-000000000003",
        replica_id=None, prompt_tokens=5, cached_tokens=0, completion_tokens=9, started_at=started,
        first_token_at=started, finished_at=started + timedelta(seconds=1), status="ok",
        max_cost=Decimal("0.5"), billing_mode=BillingMode.POSTPAID,
    )
    written_before = json.dumps(report.as_json_row(), separators=(",", ":")).encode() + b"\n"
    assert b"+00:00" in written_before and written_before != encode(report)
    assert decode(written_before) == decode(encode(report)) == report


def test_a_report_msgspec_cannot_encode_is_journalled_all_the_same():
    """A lone surrogate (no UTF-8 for it) in a report: its line is the json module's, escaped, and reads back."""
    started = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    report = UsageReport(
        request_id="req-\ud800", organization_id=7, api_key_id=None, endpoint_id="6f0c3f5e-0000-4000-8000-000000000004",
        replica_id=None, prompt_tokens=5, cached_tokens=0, completion_tokens=9, started_at=started, first_token_at=None,
        finished_at=started, status="ok", billing_mode=BillingMode.POSTPAID,
    )
    line = encode(report)
    assert b"\\ud800" in line and line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode(line) == report


def test_a_batch_msgspec_cannot_encode_is_written_by_the_json_module_whatever_sequence_holds_it():
    """The ledger's statement takes any sequence of reports: a tuple holding a lone surrogate was an AttributeError
    (only a list was taken for a batch), which no replay sets aside."""
    from billing.ledger import reports_json

    started = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    report = UsageReport(
        request_id="req-\ud800", organization_id=7, api_key_id=None, endpoint_id="6f0c3f5e-0000-4000-8000-000000000004",
        replica_id=None, prompt_tokens=5, cached_tokens=0, completion_tokens=9, started_at=started, first_token_at=None,
        finished_at=started, status="ok", billing_mode=BillingMode.POSTPAID,
    )
    assert json.loads(reports_json((report, report))) == json.loads(reports_json([report, report]))
    assert len(json.loads(reports_json((report,)))) == 1


def _without_mode(line: bytes) -> bytes:
    """A journal line as gateways wrote it before reports carried the billing mode of their admission."""
    row = json.loads(line)
    for name in ("billing_mode", "mode_when_started"):
        row.pop(name, None)
    return json.dumps(row).encode() + b"\n"


def _replayed(settings, journal_dir: Path) -> int:
    """A replay of the journal in `journal_dir` by this loop's writer: how many lines it left."""
    settings.USAGE_JOURNAL_DIR = str(journal_dir)
    usage_writer.journal.cache_clear()

    async def replay():
        return await asyncio.wait_for(usage_writer.writer_for_this_loop().replay(), 10)

    try:
        return asyncio.run(replay())
    finally:
        usage_writer.journal.cache_clear()


@pytest.mark.django_db(transaction=True)
def test_a_journal_replayed_after_switches_of_mode_bills_each_call_in_the_mode_it_was_admitted_under(
        settings, tmp_path):
    """Before, a line without the mode (a journal of gateways before reports carried it) took the mode of the replay:
    a call admitted postpaid before a switch to prepaid was drawn from credit and never invoiced. It takes the mode in
    effect when the call started, from the switches' audit; a line that says its mode keeps it."""
    from billing.services import set_billing_mode
    from controlplane.accounts.services import SYSTEM

    endpoint = EndpointFactory()

    def call(name: str, **fields) -> UsageReport:
        started_at = timezone.now()
        return dataclasses.replace(usage_report(endpoint, request_id=name), started_at=started_at,
                                   first_token_at=started_at, finished_at=started_at + timedelta(seconds=1), **fields)

    before = call("before-the-switches")  # admitted postpaid
    set_billing_mode(SYSTEM, endpoint.organization, mode=BillingMode.PREPAID)
    between = call("between-the-switches")  # admitted prepaid
    set_billing_mode(SYSTEM, endpoint.organization, mode=BillingMode.POSTPAID)
    set_billing_mode(SYSTEM, endpoint.organization, mode=BillingMode.PREPAID)
    after = call("after-the-switches")  # admitted prepaid: the mode now
    said = call("says-its-mode", billing_mode=BillingMode.POSTPAID)  # as the gateway writes it now
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    (journal_dir / "gone-1-1.jsonl").write_bytes(
        b"".join(_without_mode(encode(report)) for report in (before, between, after)) + encode(said))
    assert _replayed(settings, journal_dir) == 0  # none left
    assert dict(UsageRecord.objects.values_list("request_id", "billing_mode")) == {
        "before-the-switches": BillingMode.POSTPAID, "between-the-switches": BillingMode.PREPAID,
        "after-the-switches": BillingMode.PREPAID, "says-its-mode": BillingMode.POSTPAID}


def line_of_a_newer_version(report) -> bytes:
    """`report`'s journal line as a newer version writes it: a status this version does not know (its decode refuses
    it, as an older worker's refuses a value added since)."""
    line = encode(report).replace(b'"status":"ok"', b'"status":"evicted"')
    assert b'"status":"evicted"' in line
    return line


@pytest.mark.django_db(transaction=True)
def test_a_journal_line_this_version_cannot_read_is_kept_aside_and_only_a_torn_last_line_is_dropped(settings, tmp_path):
    """A rolling deploy or a rollback has an older process replay a newer one's lines. Before: the line was logged
    "unreadable, skipped" and deleted with its segment: the call's usage was nowhere, unbilled."""
    endpoint = EndpointFactory()
    newer = line_of_a_newer_version(usage_report(endpoint, request_id="newer"))
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    (journal_dir / "gone-1-1.jsonl").write_bytes(
        newer + encode(usage_report(endpoint, request_id="known")) + b'{"request_id": "torn", "organiz')
    assert _replayed(settings, journal_dir) == 0  # none left
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == ["known"]
    assert sorted(path.name for path in journal_dir.iterdir()) == [REJECTED_NAME]
    assert (journal_dir / REJECTED_NAME).read_bytes() == newer  # as it was written: a newer replay bills it


@pytest.mark.django_db
@pytest.mark.parametrize("unreadable", [b"null", b"[1, 2]", b'"text"', "money"])
def test_a_journal_line_that_is_no_object_or_bad_money_is_kept_aside_not_a_replay_stuck(unreadable):
    """Before: `null` and `[1, 2]` raised AttributeError, money text such as "1.5 USD" decimal.InvalidOperation, out of
    `read_segment` (which caught ValueError, TypeError and KeyError only): the segment's replay failed on every try."""
    endpoint = EndpointFactory()
    good = encode(usage_report(endpoint, request_id="good"))
    if unreadable == "money":
        unreadable = json.dumps({**json.loads(good), "request_id": "bad", "max_cost": "1.5 USD"}).encode()
    handle = io.BytesIO(unreadable + b"\n" + good)
    handle.name = "gone-1-1.jsonl"
    segment = read_segment(handle)
    assert [report.request_id for report in segment.reports] == ["good"]
    assert segment.unreadable == [unreadable]


@pytest.mark.django_db(transaction=True)
def test_a_journal_line_postgresql_refuses_for_a_lone_surrogate_is_set_aside_and_the_next_segment_replayed(
        settings, tmp_path):
    """Before, msgspec raised UnicodeEncodeError on the line in Python, not the DataError the replay sets aside: the
    replay failed on every try, the journal grew until full, then the gateway refused calls."""
    endpoint = EndpointFactory()
    refused = dataclasses.replace(usage_report(endpoint, request_id="refused"), replica_id="r\ud800")
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    (journal_dir / "gone-1-1.jsonl").write_bytes(encode(refused))
    (journal_dir / "gone-1-2.jsonl").write_bytes(encode(usage_report(endpoint, request_id="next")))
    assert _replayed(settings, journal_dir) == 0  # none left
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == ["next"]
    assert sorted(path.name for path in journal_dir.iterdir()) == [REJECTED_NAME]
    assert [report.request_id for report in read_segment((journal_dir / REJECTED_NAME).open("rb")).reports] == ["refused"]


def _segment_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.glob("*.jsonl") if path.name != REJECTED_NAME)


def _report(number: int) -> UsageReport:
    now = datetime(2026, 12, 3, 18, 0, tzinfo=UTC)
    return UsageReport(request_id=f"req-{number:04d}", organization_id=7, api_key_id=3,
                       endpoint_id="6f0c3f5e-0000-4000-8000-000000000001", replica_id=None, prompt_tokens=12,
                       cached_tokens=0, completion_tokens=30, started_at=now, first_token_at=now, finished_at=now,
                       status="ok")


def test_the_journal_counts_its_folders_bytes_and_is_full_past_its_limit(tmp_path):
    """The count is the folder's: what a dead process left (listed once, at a replay), and what this one appends since
    (counted as it appends, no listing); a replayed segment leaves it."""
    row_bytes = len(encode(_report(0)))
    left = UsageJournal(tmp_path, max_bytes=10 * row_bytes)
    left.append([_report(number) for number in range(4)])
    left.seal()  # its process died
    journal = UsageJournal(tmp_path, max_bytes=10 * row_bytes)
    assert (journal.num_bytes, journal.full) == (0, False)  # nothing listed yet

    segments = journal.list_segments()
    assert journal.num_bytes == 4 * row_bytes == _segment_bytes(tmp_path)
    journal.append([_report(number) for number in range(4, 9)])
    assert (journal.num_bytes, journal.full) == (9 * row_bytes, False)
    journal.append([_report(9)])
    assert (journal.num_bytes, journal.full) == (10 * row_bytes, True) and journal.num_bytes == _segment_bytes(tmp_path)
    journal.append([_report(10)])  # a call admitted before: it still journals
    assert journal.num_bytes == 11 * row_bytes == _segment_bytes(tmp_path)

    journal.done(segments[0], [])  # the dead process's segment, replayed
    assert (journal.num_bytes, journal.full) == (7 * row_bytes, False)
    assert journal.num_bytes == _segment_bytes(tmp_path)
    assert UsageJournal(tmp_path).full is False  # no limit


@pytest.mark.django_db(transaction=True)
def test_a_full_journal_refuses_new_calls_and_readiness_until_it_is_replayed_losing_no_admitted_call(
        settings, tmp_path, monkeypatch, client):
    """PostgreSQL serves reads and refuses writes (a demoted primary): every row goes to the journal. Before, the
    journal grew without a bound until the pod's volume was full and the pod evicted, its journal deleted with it."""
    from billing import usage_writer

    endpoint = EndpointFactory()
    reports = [usage_report(endpoint, request_id=f"full-{number:03d}") for number in range(40)]
    row_bytes = max(len(encode(report)) for report in reports)
    journal_dir = tmp_path / "journal"
    settings.USAGE_JOURNAL_DIR = str(journal_dir)
    settings.USAGE_JOURNAL_MAX_BYTES = 10 * row_bytes
    usage_writer.journal.cache_clear()
    monkeypatch.setattr(usage_writer, "OUTAGE_PROBE_S", 0.05)
    monkeypatch.setattr(usage_writer, "REPLAY_RETRY_MAX_S", 0.1)
    writable = False
    insert = usage_writer.record_usage_batch_on

    async def insert_unless_read_only(connection, batch):
        if not writable:
            raise psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction")
        return await insert(connection, batch)

    monkeypatch.setattr(usage_writer, "record_usage_batch_on", insert_unless_read_only)

    async def calls_while_read_only():
        """Each call is admitted (as the gateway does) only while its usage can be recorded; the first three admitted
        are still streaming when the journal fills, and end after."""
        writer = usage_writer.writer_for_this_loop()
        admitted, streaming = [], []
        for report in reports:
            if not usage_writer.usage_recordable():
                continue
            admitted.append(report)
            if len(streaming) < 3:
                streaming.append(report)
            else:
                assert await writer.write(report) is usage_writer.Recorded.JOURNALED
        assert not usage_writer.usage_recordable()
        assert await asyncio.gather(*(writer.write(report) for report in streaming)) == [usage_writer.Recorded.JOURNALED] * 3
        return admitted

    async def replay_until_empty():
        await asyncio.wait_for(usage_writer.writer_for_this_loop().replay_soon(), 10)

    try:
        admitted = asyncio.run(calls_while_read_only())

        assert len(admitted) == 13  # 10 rows reach the limit, and the 3 admitted before them
        assert _segment_bytes(journal_dir) == usage_writer.journal().num_bytes <= 13 * row_bytes
        assert UsageRecord.objects.count() == 0
        response = client.get("/readyz")
        assert response.status_code == 503 and response.json()["checks"]["usage_journal"] == "full"

        writable = True
        asyncio.run(replay_until_empty())

        assert usage_writer.usage_recordable() and usage_writer.journal().num_bytes == 0
        assert _segment_bytes(journal_dir) == 0
        assert client.get("/readyz").status_code == 200
        assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == [r.request_id for r in admitted]
        asyncio.run(replay_until_empty())  # a second replay writes nothing twice
        assert UsageRecord.objects.count() == len(admitted)
    finally:
        usage_writer.journal.cache_clear()


def test_a_segment_claimed_between_its_creation_and_its_lock_loses_no_row(tmp_path, monkeypatch):
    # A replayer in another process lists the folder just as a writer creates its new segment: created under its
    # final name, the replayer locked it before the writer did, found it empty and deleted it; the writer's rows
    # then went into a deleted file, reported written.
    writer, replayer = UsageJournal(tmp_path), UsageJournal(tmp_path)
    real_flock, raced = fcntl.flock, []

    def flock(handle, operation):
        if not raced:
            raced.append(True)
            for path in replayer.list_segments():
                with replayer.claim(path) as claimed:
                    if claimed is not None:
                        replayer.done(path, [])
        return real_flock(handle, operation)

    monkeypatch.setattr(usage_journal.fcntl, "flock", flock)
    writer.append([_report(1)])
    monkeypatch.setattr(usage_journal.fcntl, "flock", real_flock)
    writer.seal()

    reports = []
    for path in UsageJournal(tmp_path).segments():
        with open(path, "rb") as handle:
            reports += read_segment(handle).reports
    assert raced and [report.request_id for report in reports] == ["req-0001"]


def test_a_new_segments_hidden_file_left_by_a_dead_process_is_cleared_and_a_live_ones_kept(tmp_path):
    writer = UsageJournal(tmp_path)
    writer.append([_report(1)])  # a live process's segment
    left = tmp_path / f".host-1-1{usage_journal.SEGMENT_SUFFIX}{usage_journal.NEW_SUFFIX}"
    left.touch()  # a process died creating its segment
    long_ago = time.time() - usage_journal.LEFT_NEW_AFTER_S - 1
    os.utime(left, (long_ago, long_ago))
    young = tmp_path / f".host-2-2{usage_journal.SEGMENT_SUFFIX}{usage_journal.NEW_SUFFIX}"
    young.touch()  # one being created now, not locked yet

    assert UsageJournal(tmp_path).list_segments() == writer.segments()

    assert not left.exists() and young.exists()
    assert [path.name.startswith(".") for path in writer.segments()] == [False]



@pytest.mark.django_db(transaction=True)
def test_a_shutdown_whose_cancellation_a_replays_redis_write_dropped_still_ends(settings, tmp_path, monkeypatch):
    """PostgreSQL refuses writes (a demoted primary) and the journal waits for it; the gateway shuts down and cancels
    the replay once its time is up (`replay_before_the_loop_ends`). Before, a cancellation that came as one of the
    replay's Redis writes (its registration) finished was dropped (Python 3.11's `asyncio.wait_for`, which redis-py
    writes through): the replay caught the outage and tried again for as long as the database stayed down, and the
    shutdown waited for it."""
    from billing import usage_writer
    from billing.quota import replayed

    endpoint = EndpointFactory()
    settings.USAGE_JOURNAL_DIR = str(tmp_path / "journal")
    settings.USAGE_JOURNAL_SHIP = False
    usage_writer.journal.cache_clear()
    monkeypatch.setattr(usage_writer, "OUTAGE_PROBE_S", 0.01)
    monkeypatch.setattr(usage_writer, "REPLAY_RETRY_MAX_S", 0.01)
    insert, register, database_back, dropped = usage_writer.record_usage_batch_on, replayed.register_replaying, [], []

    async def insert_unless_read_only(connection, batch):
        if not database_back:
            raise psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction")
        return await insert(connection, batch)

    async def register_dropping_a_cancellation(reports):
        registration = await register(reports)
        if not dropped:
            try:
                await asyncio.sleep(10)  # the write's answer on its way as the shutdown's time is up
            except asyncio.CancelledError:
                dropped.append(True)  # as 3.11's `wait_for` does when what it waits for is done: its result returned
        return registration

    monkeypatch.setattr(usage_writer, "record_usage_batch_on", insert_unless_read_only)
    monkeypatch.setattr(replayed, "register_replaying", register_dropping_a_cancellation)

    async def shutdown() -> bool:
        writer = usage_writer.writer_for_this_loop()
        assert await writer.write(usage_report(endpoint, request_id="down")) is usage_writer.Recorded.JOURNALED
        stopping = asyncio.ensure_future(usage_writer.replay_before_the_loop_ends(0.2))
        done, _ = await asyncio.wait({stopping}, timeout=5)
        database_back.append(True)  # the loop before ends once its journal is replayed: not left to the next test
        await stopping
        return bool(done)

    try:
        ended = asyncio.run(shutdown())
    finally:
        usage_writer.journal.cache_clear()
    assert dropped
    assert ended, "the shutdown waited for the replay for as long as the database refused writes"


def test_the_set_aside_is_handed_over_in_parts_of_whole_lines_and_a_longer_line_alone(tmp_path):
    # Lines of 3, 5, 12 (longer than a part), 2 and 4 bytes, the last one torn (no newline), parts of at most 8 bytes.
    lines = [b"aa\n", b"bbbb\n", b"c" * 11 + b"\n", b"d\n", b"eeee"]
    (tmp_path / REJECTED_NAME).write_bytes(b"".join(lines))
    parts = []
    assert UsageJournal(tmp_path).hand_over_set_aside(parts.append, max_part_bytes=8) == len(b"".join(lines))
    assert parts == [b"d\neeee", b"c" * 11 + b"\n", b"aa\nbbbb\n"]
    assert (tmp_path / REJECTED_NAME).read_bytes() == b""
