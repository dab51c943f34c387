"""A batch line whose answer takes longer than a run may wait (its engine still generating at the run task's
time limit) fails for good with `answer_wait_exceeded`. Before, it was given up on at the read timeout, unbilled,
and run again in every run until the batch expired: the engine computed it again and again, free."""

from __future__ import annotations

import json

import httpx
import pytest

from billing.models import UsageRecord
from endpoints.batches import runner, services, storage
from endpoints.batches.models import Batch, BatchStatus
from endpoints.models import Replica
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


def test_a_run_left_too_little_time_to_wait_a_line_out_starts_none_and_leaves_them_to_the_next(
        files_bucket, tenant, start_mock_upstream, monkeypatch):
    # A line that starts late in a run (after a long validation) would fail for good at the run's deadline
    # having been waited for far less than any other.
    monkeypatch.setattr(runner, "LINES_END_WITHIN_S", 1.5)
    monkeypatch.setattr(runner, "LINE_MIN_WAIT_S", 5.0)
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    line = {"custom_id": "late", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    batch = new_batch(endpoint, json.dumps(line).encode() + b"\n")

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.IN_PROGRESS and batch.num_pending == 1
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 0
