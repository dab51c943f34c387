"""A batch run through a PostgreSQL outage (a restart, a failover): the lines it has in flight finish and are kept, run
once and billed once."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from django.db import ProgrammingError, connection

from billing.models import UsageRecord
from endpoints.batches import runner, services
from endpoints.batches.models import Batch, BatchStatus
from endpoints.gateway import memo
from tests.batches.conftest import new_batch, one_chat_line, run_in_a_thread
from tests.gateway.conftest import serve_endpoint
from tests.outages import database_refusing_connections

pytestmark = pytest.mark.django_db(transaction=True)

NUM_TOKENS = 8


def _wait_for(condition, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.05)


def _run_through_an_outage(
    tenant, start_mock_upstream, *, token_delay_ms: int, num_tokens: int, outage_s: float, num_lines: int = 1
):
    """A batch of `num_lines` lines run one at a time whose run meets a PostgreSQL outage of `outage_s` while its first
    line is in flight, then the runs that finish it: the batch, the first run's outcome and the number of engine
    requests made."""
    upstream = start_mock_upstream(token_delay_ms=token_delay_ms)
    endpoint = serve_endpoint(tenant.org, upstream, target_concurrency=1)
    batch = new_batch(
        endpoint,
        b"".join(
            one_chat_line(endpoint, num_tokens).replace(b'"only"', f'"c{i}"'.encode())
            for i in range(num_lines)
        ),
    )

    def num_engine_requests() -> int:
        return httpx.get(f"{upstream}/_stats").json()["num_requests"]

    worker, runs = run_in_a_thread(batch.pk)
    _wait_for(lambda: num_engine_requests() == 1)  # the line is in flight
    with database_refusing_connections():
        time.sleep(outage_s)
    worker.join(timeout=120)

    for _ in range(2):  # whatever the first run left, the next runs finish
        if Batch.objects.get(pk=batch.pk).status != BatchStatus.COMPLETED:
            Batch.objects.filter(pk=batch.pk).update(lease_until=None, lease_token="")
            services.run_batch(batch.pk)
    return Batch.objects.get(pk=batch.pk), runs, num_engine_requests()


def test_a_line_in_flight_through_a_database_outage_finishes_and_is_kept_run_once_and_billed_once(
    files_bucket, tenant, start_mock_upstream, settings
):
    # an outage past the run's retries: no line starts for the rest of its slice
    settings.BATCH_OUTAGE_RETRY_S = 0
    # the line answers in ~4 s; the run renews its lease every second: it meets the outage at least once
    batch, runs, num_engine_requests = _run_through_an_outage(
        tenant, start_mock_upstream, token_delay_ms=500, num_tokens=NUM_TOKENS, outage_s=1.5
    )
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (1, 0)
    assert num_engine_requests == 1, "the line ran once: its first answer was kept"
    assert runs == ["outage"], "the run went through the outage, starting no line meanwhile"
    [row] = UsageRecord.objects.filter(batch_id=batch.pk)
    assert row.completion_tokens == NUM_TOKENS


def test_a_line_in_flight_through_an_outage_longer_than_the_endpoint_cache_is_run_once(
    files_bucket, tenant, start_mock_upstream, settings, monkeypatch
):
    settings.BATCH_OUTAGE_RETRY_S = 2  # past it the run starts no line for the rest of its slice
    # The directory's stale grace shortened to 1 s (5 s in production): its cached endpoint is given up 3 s after its
    # load, not 7 s, and the outage past it lasts 5 s, not 10 (the same 2 s past it, 5 s less of the suite)
    monkeypatch.setattr(memo, "STALE_FOR_S", 1.0)
    # NOTE: 5 s, past the directory's cached endpoint and its stale grace (3 s here): its once-a-second read of the
    # endpoint raised, the run ended with its line cut mid-answer, and the next run ran it again
    num_tokens = 7  # the line answers in ~7 s: in flight through the whole outage
    batch, runs, num_engine_requests = _run_through_an_outage(
        tenant, start_mock_upstream, token_delay_ms=1000, num_tokens=num_tokens, outage_s=5
    )
    assert runs == ["outage"], "the run went through the outage"
    assert num_engine_requests == 1, "the line ran once: its first answer was kept"
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (1, 0)
    [row] = UsageRecord.objects.filter(batch_id=batch.pk)
    assert row.completion_tokens == num_tokens


@pytest.mark.parametrize("outage_s", [1.0, 6.0], ids=["a-blip", "past-the-retries"])
def test_a_run_goes_on_starting_lines_after_a_brief_outage_and_stops_after_a_long_one(
    files_bucket, tenant, start_mock_upstream, settings, outage_s
):
    # NOTE: a blip of a second ended the run's starts for the rest of its slice: the batch's next line waited for the
    # next tick and a free worker. Retried for `BATCH_OUTAGE_RETRY_S`, the same run starts it; a longer outage
    # still ends the slice's starts, its line in flight kept.
    # 3 s (8 by default): the run gives up at most 3.75 s after its first check that met the outage (checks 0.25 s,
    # then twice as long, at most `CHECK_EVERY_S`, apart), within the 6 s outage; the blip's check at 2.75 s finds
    # PostgreSQL back
    settings.BATCH_OUTAGE_RETRY_S = 3
    # each line answers in ~2.8 s: the first still in flight as the blip ends
    batch, runs, num_engine_requests = _run_through_an_outage(
        tenant, start_mock_upstream, token_delay_ms=350, num_tokens=NUM_TOKENS, outage_s=outage_s, num_lines=2
    )
    assert runs == (["ran"] if outage_s < settings.BATCH_OUTAGE_RETRY_S else ["outage"])
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (2, 0)
    assert num_engine_requests == 2, "each line ran once"
    assert UsageRecord.objects.filter(batch_id=batch.pk).count() == 2


def test_a_lease_check_that_fails_for_another_reason_than_an_outage_is_raised_not_taken_for_an_outage():
    # NOTE: every database error was taken for an outage: a check that always failed (a bad query) ended every run
    # quietly as "outage", no line started, and the batch was queued again at every tick until it expired
    def keep_going(progress: runner.Progress) -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT no_such_column FROM no_such_table")
        return ""

    check = runner._through_outages(keep_going)
    with pytest.raises(ProgrammingError):
        asyncio.run(check(runner.Progress(num_completed=0, num_failed=0)))


def test_a_lease_check_that_meets_postgresql_away_is_an_outage():
    def keep_going(progress: runner.Progress) -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return ""

    check = runner._through_outages(keep_going)
    connection.ensure_connection()  # this test's own session, kept through the outage
    with database_refusing_connections():
        assert asyncio.run(check(runner.Progress(num_completed=0, num_failed=0))) == "outage"


def test_a_run_whose_lease_lapsed_in_an_outage_stores_nothing_once_another_run_holds_the_batch(
    files_bucket, tenant, start_mock_upstream, settings
):
    # NOTE: an outage longer than the lease: as PostgreSQL came back, the next run claimed the lapsed lease and ran the
    # line again, and both runs counted its answer against the storage quota (num_result_bytes twice the file's)
    settings.BATCH_LEASE_S = 2.0
    upstream = start_mock_upstream(token_delay_ms=700)  # the line answers in ~7 s: after the next run claimed it
    endpoint = serve_endpoint(tenant.org, upstream)
    batch = new_batch(endpoint, one_chat_line(endpoint, 10))
    worker, runs = run_in_a_thread(batch.pk)
    _wait_for(lambda: httpx.get(f"{upstream}/_stats").json()["num_requests"] == 1)  # the line is in flight
    with database_refusing_connections():
        time.sleep(4)
    assert (
        services.run_batch(batch.pk) == "ran"
    )  # the tick's next run, taken by a worker as PostgreSQL is back
    worker.join(timeout=120)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.num_result_bytes == batch.output_file.bytes, (
        "its answer counted once against the storage quota"
    )
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (1, 0)
    assert runs == ["lease"], "the first run knew its lease lapsed"
    assert UsageRecord.objects.filter(batch_id=batch.pk).count() == 1


def test_no_line_starts_while_a_finished_lines_store_keeps_failing_though_the_lease_checks_succeed(
    files_bucket, tenant, start_mock_upstream, monkeypatch
):
    # A store that fails with PostgreSQL up (a statement timeout, a lock on one row) while the lease checks succeed.
    # Before: each successful check let lines start again, whose answers then met the same failing store: GPU work
    # for answers that could not be kept, for the whole slice.
    import threading

    from django.db import OperationalError

    num_lines = 8
    upstream = start_mock_upstream(token_delay_ms=50)
    endpoint = serve_endpoint(tenant.org, upstream, target_concurrency=1)
    batch = new_batch(
        endpoint,
        b"".join(
            one_chat_line(endpoint, NUM_TOKENS).replace(b'"only"', f'"c{i}"'.encode()) for i in range(num_lines)
        ),
    )
    engine_requests_at_failures: list[int] = []
    failing = threading.Lock()
    take_result_room = services._take_result_room

    def failing_for_a_while(*args, **kwargs):
        with failing:
            if len(engine_requests_at_failures) < 6:
                engine_requests_at_failures.append(httpx.get(f"{upstream}/_stats").json()["num_requests"])
                raise OperationalError("canceling statement due to statement timeout")
        return take_result_room(*args, **kwargs)

    monkeypatch.setattr(services, "_take_result_room", failing_for_a_while)
    services.run_batch(batch.pk)
    for _ in range(2):  # whatever the run left, the next runs finish
        if Batch.objects.get(pk=batch.pk).status != BatchStatus.COMPLETED:
            Batch.objects.filter(pk=batch.pk).update(lease_until=None, lease_token="")
            services.run_batch(batch.pk)

    assert len(engine_requests_at_failures) == 6
    assert len(set(engine_requests_at_failures)) == 1, engine_requests_at_failures  # no start while they failed
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (num_lines, 0)
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == num_lines
