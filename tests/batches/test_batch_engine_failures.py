"""A batch line whose engine fails it (an HTTP 500 of its own, before its answer, the replica still READY) fails for
good after `runner.MAX_ENGINE_FAILURES` tries, `upstream_error` in the error file; a line whose replica went away is
tried again as before.

Before, such a line (vLLM answered 500 for a lone surrogate in `stop`) was tried again every second for every run's
slice until the batch expired, a day."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from billing.models import UsageRecord
from controlplane.redis_client import get_redis
from endpoints.batches import runner, services, storage
from endpoints.batches.models import Batch, BatchStatus
from tests.batches.conftest import new_batch
from tests.fakes.mock_openai import ENGINE_FAILS_FOR
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
    files_bucket, tenant, start_mock_upstream, quick_retries
):
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
    files_bucket, tenant, start_mock_upstream, quick_retries, caplog
):
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
