"""A batch line whose engine fails it (an HTTP 500 of its own, before its answer, the replica still READY) fails for
good after `runner.MAX_ENGINE_FAILURES` tries, the first and the last `runner.ENGINE_FAILURES_MIN_SPAN_S` apart at
least, counted across runs, `upstream_error` in the error file; each such try waits longer than the last; a line whose
replica went away is tried again as before.

Before, such a line (vLLM answered 500 for a lone surrogate in `stop`) was tried again every second for every run's
slice until the batch expired, a day. Then, counted in one run alone, 500s for 6 s failed healthy lines for good, and a
line whose 500s were slow never failed."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from billing.models import UsageRecord
from controlplane.redis_client import get_redis
from controlplane.redis_keys import batch_engine_failures_key
from endpoints.batches import runner, services, storage
from endpoints.batches.models import Batch, BatchStatus
from tests.batches.conftest import new_batch
from tests.fakes.closing_engine import ClosingEngine
from tests.fakes.mock_openai import ENGINE_FAILS_FOR, ENGINE_FAILS_UNTIL
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


def _lines(endpoint, *users: str) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"line-{index}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": endpoint.name,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8,
                    "user": user,
                },
            }
        ).encode()
        + b"\n"
        for index, user in enumerate(users)
    )


def _num_requests(upstream: str) -> int:
    return httpx.get(f"{upstream}/_stats").json()["num_requests"]


@pytest.fixture
def quick_retries(monkeypatch, settings):
    monkeypatch.setattr(runner, "RETRY_PAUSE_S", 0.1)
    settings.BATCH_RUN_SLICE_S = 5  # ~50 tries of a line tried again for the whole of it


def test_a_line_its_engine_fails_every_time_fails_for_good_with_upstream_error_and_the_others_are_answered(
    files_bucket, tenant, start_mock_upstream, quick_retries, monkeypatch
):
    # its tries 0.1, 0.2, 0.4 and 0.8 s apart: the fifth is 1.5 s after the first
    monkeypatch.setattr(runner, "ENGINE_FAILURES_MIN_SPAN_S", 1.0, raising=False)
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    batch = new_batch(endpoint, _lines(endpoint, "someone", ENGINE_FAILS_FOR))

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 1, 1)
    assert _num_requests(upstream) == 1 + runner.MAX_ENGINE_FAILURES
    [error_row] = [json.loads(row) for row in storage.read_bytes(batch.error_file.s3_key).splitlines()]
    assert error_row["custom_id"] == "line-1" and error_row["response"]["status_code"] == 502
    assert error_row["response"]["body"]["error"]["code"] == "upstream_error"
    # billed for the line answered alone; nothing of the failed one held (a reservation, a slot) after the run
    assert list(UsageRecord.objects.filter(status="ok").values_list("request_id", flat=True)) == [
        f"{batch.pk}-0"
    ]
    assert not [key for key in get_redis().scan_iter("*outstanding*") if int(get_redis().get(key) or 0)]


def test_a_line_whose_replica_went_away_is_tried_again_not_failed(
    files_bucket, tenant, start_mock_upstream, quick_retries, caplog, settings
):
    # NOTE: a slice of 2.5 s (the fixture's 5 s ran ~50 tries, 2.5 s more of the suite): ~25 tries 0.1 s apart, still
    # five times the count that failed the line for good before
    settings.BATCH_RUN_SLICE_S = 2.5
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    batch = new_batch(endpoint, _lines(endpoint, "someone"))
    start_mock_upstream.stop(
        upstream
    )  # its engine gone: the port refuses connections, the replica still READY here

    with caplog.at_level(logging.WARNING, logger="inferplane.requests"):
        services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.IN_PROGRESS, 0, 0)
    assert batch.num_pending == 1
    tries = [record for record in caplog.records if "unavailable before first byte" in record.getMessage()]
    assert len(tries) > runner.MAX_ENGINE_FAILURES


def test_a_line_its_engine_fails_for_a_few_seconds_is_answered_once_the_engine_recovers(
    files_bucket, tenant, start_mock_upstream, quick_retries, monkeypatch, settings
):
    # the review's case, shorter: 500s for 6 s, tries a second apart, failed 2 of 3 lines for good (at 5 failures; 3
    # here, so that each line surely reaches the count before the engine recovers)
    monkeypatch.setattr(runner, "MAX_ENGINE_FAILURES", 3)
    settings.BATCH_RUN_SLICE_S = 30  # room for the tries after the fault, however slow this machine
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    fails_until = f"{ENGINE_FAILS_UNTIL}{time.time() + 3}"
    batch = new_batch(endpoint, _lines(endpoint, fails_until, fails_until, fails_until))

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 3, 0)
    # each failed the count's times or more (tries 0.1, 0.2, 0.4 … s apart), in less than the minimum span
    num_failures = [
        int(get_redis().hget(batch_engine_failures_key(batch.pk, index), "num") or 0) for index in range(3)
    ]
    assert min(num_failures) >= runner.MAX_ENGINE_FAILURES, num_failures


def test_each_try_of_a_line_its_engine_failed_waits_twice_as_long_as_the_last_up_to_a_cap(monkeypatch):
    monkeypatch.setattr(runner, "RETRY_PAUSE_S", 1.0)
    pauses = [runner.engine_failure_pause_s(num_failures) for num_failures in range(1, 8)]
    assert pauses == [
        1.0,
        2.0,
        4.0,
        8.0,
        16.0,
        runner.ENGINE_FAILURE_MAX_PAUSE_S,
        runner.ENGINE_FAILURE_MAX_PAUSE_S,
    ]
    assert runner.engine_failure_pause_s(10**6) == runner.ENGINE_FAILURE_MAX_PAUSE_S


def _run_until_done(batch, max_runs: int = 10) -> Batch:
    for _ in range(max_runs):
        services.run_batch(batch.pk)
        batch = Batch.objects.get(pk=batch.pk)
        if batch.status != BatchStatus.IN_PROGRESS:
            break
    return batch


@pytest.fixture
def short_runs(monkeypatch, settings):
    # a run tries a line its engine fails fewer than MAX_ENGINE_FAILURES times: a half second's slice, tries half a second
    # apart (a second each before: the same tries per run, each of the runs a line needs half as long)
    monkeypatch.setattr(runner, "RETRY_PAUSE_S", 0.5)
    monkeypatch.setattr(runner, "ENGINE_FAILURES_MIN_SPAN_S", 0.0, raising=False)
    settings.BATCH_RUN_SLICE_S = 0.5


def test_a_line_its_engine_fails_in_every_run_fails_once_its_failures_over_the_runs_reach_the_count(
    files_bucket, tenant, start_mock_upstream, short_runs
):
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    batch = new_batch(endpoint, _lines(endpoint, ENGINE_FAILS_FOR))

    batch = _run_until_done(batch)

    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 0, 1)
    assert _num_requests(upstream) == runner.MAX_ENGINE_FAILURES


def test_a_redis_that_lost_a_lines_count_starts_it_again(
    files_bucket, tenant, start_mock_upstream, short_runs
):
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    batch = new_batch(endpoint, _lines(endpoint, ENGINE_FAILS_FOR))
    services.run_batch(batch.pk)
    num_lost = _num_requests(upstream)
    assert 0 < num_lost < runner.MAX_ENGINE_FAILURES
    key = batch_engine_failures_key(batch.pk, 0)
    assert 0 < get_redis().ttl(key) <= 24 * 3600 + 1  # kept until the batch's window ends
    get_redis().delete(key)

    batch = _run_until_done(batch)

    assert (batch.status, batch.num_failed) == (BatchStatus.COMPLETED, 1)
    assert _num_requests(upstream) == num_lost + runner.MAX_ENGINE_FAILURES


def test_a_line_failed_by_a_run_on_another_worker_is_not_failed_for_good_by_a_worker_whose_clock_is_ahead(
    files_bucket, tenant, start_mock_upstream, quick_retries, monkeypatch
):
    # Before: a failure's first time was the counting worker's clock (`time.time()`) and its span judged by the next
    # worker's: a run on a worker 10 minutes ahead took the first failures, a moment before on another worker, as 10
    # minutes old, past `ENGINE_FAILURES_MIN_SPAN_S`, and failed the line for good at its next 500 (a blip of seconds).
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    fails_until = f"{ENGINE_FAILS_UNTIL}{time.time() + 3}"  # a blip of 3 s
    batch = services.validate_batch(new_batch(endpoint, _lines(endpoint, fails_until)))
    assert batch.status == BatchStatus.IN_PROGRESS
    # its engine failed it on another worker, whose clock is right, a moment ago
    get_redis().hset(batch_engine_failures_key(batch.pk, 0),
                     mapping={"first_at": repr(time.time()), "num": runner.MAX_ENGINE_FAILURES - 1})
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 600)  # the next run's worker

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 1, 0)


def test_a_line_that_kills_its_engine_every_time_fails_for_good_as_one_its_engine_answers_500(
    files_bucket, tenant, quick_retries, monkeypatch
):
    # Before: its engine's connection closed with no answer, its replica still READY, was `upstream_failed`, which a
    # batch tries again every `RETRY_PAUSE_S` until it expires: ~50 tries in this slice, each an engine killed.
    monkeypatch.setattr(runner, "ENGINE_FAILURES_MIN_SPAN_S", 1.0, raising=False)
    engine = ClosingEngine(lambda _, body: b"kills-its-engine" in body)
    endpoint = serve_endpoint(tenant.org, engine.address)
    batch = new_batch(endpoint, _lines(endpoint, "someone", "kills-its-engine"))

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 1, 1)
    assert engine.num_closed == runner.MAX_ENGINE_FAILURES
    [error_row] = [json.loads(row) for row in storage.read_bytes(batch.error_file.s3_key).splitlines()]
    assert error_row["custom_id"] == "line-1" and error_row["response"]["status_code"] == 502
    assert error_row["response"]["body"]["error"]["code"] == "upstream_error"
