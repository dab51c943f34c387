"""A batch line whose answer takes longer than a run may wait (its engine still generating at the run task's
time limit) fails for good with `answer_wait_exceeded`. Before, it was given up on at the read timeout, unbilled,
and run again in every run until the batch expired: the engine computed it again and again, free."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from billing.models import UsageRecord
from endpoints.batches import runner, services, storage
from endpoints.batches.models import Batch, BatchStatus
from endpoints.models import EndpointEvent, EventKind, Replica
from tests.batches.conftest import new_batch
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_line_still_generating_at_the_runs_deadline_fails_once_and_is_not_run_again(
        files_bucket, tenant, start_mock_upstream, monkeypatch):
    monkeypatch.setattr(runner, "LINES_END_WITHIN_S", 1.5)
    monkeypatch.setattr(runner, "LINE_MIN_WAIT_S", 0.5)
    upstream = start_mock_upstream(token_delay_ms=20)  # 150 tokens: a 3 s answer
    endpoint = serve_endpoint(tenant.org, upstream)
    Replica.objects.filter(endpoint=endpoint).update(tokens_per_s=50.0)  # its engine generates all along
    line = {"custom_id": "long", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 150}}
    batch = new_batch(endpoint, json.dumps(line).encode() + b"\n")

    services.run_batch(batch.pk)
    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (0, 1)
    [error] = [json.loads(row) for row in storage.read_bytes(batch.error_file.s3_key).splitlines()]
    assert error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["code"] == "answer_wait_exceeded"
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 1  # sent once, never again
    assert not UsageRecord.objects.exists()


def _slow_reads(monkeypatch, delay_s: float) -> list[str]:
    """Every read of an input takes `delay_s` (a large input on a busy machine); returns the keys read."""
    read_parts, keys = storage.read_parts, []

    def slow(key: str, **kwargs):
        keys.append(key)
        time.sleep(delay_s)
        yield from read_parts(key, **kwargs)

    monkeypatch.setattr(storage, "read_parts", slow)
    return keys


def test_a_run_whose_input_read_took_long_still_has_its_lines_time(files_bucket, tenant, start_mock_upstream,
                                                                   monkeypatch):
    # The lines' time was counted from the task's start: a read of the input longer than the time left to start
    # a line left none, and every later run read as long: a stall until expiry. Counted from the first line's read,
    # after the check's read in a batch's first run.
    monkeypatch.setattr(runner, "LINES_END_WITHIN_S", 3.0)
    monkeypatch.setattr(runner, "LINE_MIN_WAIT_S", 2.0)
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    line = {"custom_id": "big-file", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    batch = new_batch(endpoint, json.dumps(line).encode() + b"\n")
    keys = _slow_reads(monkeypatch, 1.2)

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (1, 0)
    assert keys.count(batch.input_file.s3_key) == 2  # checked, then read as its lines start


def test_a_run_past_its_time_limit_after_the_read_starts_no_line_and_says_why(files_bucket, tenant, start_mock_upstream,
                                                                              monkeypatch):
    # A line started late in a run would fail for good at the run's deadline, waited for far less than any other.
    monkeypatch.setattr(runner, "LINES_END_WITHIN_S", 3.0)
    monkeypatch.setattr(runner, "LINE_MIN_WAIT_S", 2.0)
    monkeypatch.setattr(services, "RUN_FINISH_MARGIN_S", 0)
    monkeypatch.setattr(services, "RUN_TIME_LIMIT_S", 3)
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    line = {"custom_id": "late", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    batch = new_batch(endpoint, json.dumps(line).encode() + b"\n")
    _slow_reads(monkeypatch, 1.2)

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.IN_PROGRESS and batch.num_pending == 1
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 0
    assert EndpointEvent.objects.filter(endpoint=endpoint, kind=EventKind.BATCH,
                                        message__contains="too long for this run to start a line").exists()
