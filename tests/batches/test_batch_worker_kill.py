"""A worker SIGKILLed in the middle of a batch (mock engines, no vLLM): another worker takes the batch
over once its lease lapses, skips the lines already done and re-runs the rest under the same request
ids, so every line is answered once in the output file and billed once."""

from __future__ import annotations

import io
import json

import pytest

from billing.models import UsageRecord
from endpoints.batches.models import Batch
from tests.batches.conftest import start_batch_worker
from tests.batches.test_batch_vllm import _kill_whole_worker
from tests.conftest import wait_until
from tests.gateway.conftest import serve_endpoint

pytestmark = [pytest.mark.heavy, pytest.mark.django_db(transaction=True)]

NUM_LINES = 60


def test_a_batch_killed_mid_run_finishes_on_another_worker_with_each_line_billed_once(
        gateway, tenant, files_bucket, start_mock_upstream, tmp_path):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=30), target_concurrency=4)
    client = tenant.client(gateway)
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}
            for i in range(NUM_LINES)]
    input_file = client.files.create(file=("in.jsonl", io.BytesIO(b"".join(json.dumps(r).encode() + b"\n" for r in rows))),
                                     purpose="batch")
    worker = start_batch_worker(tmp_path, name="first")
    batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    try:
        wait_until(lambda: UsageRecord.objects.filter(batch_id=batch.id).count() >= NUM_LINES // 4, 120, interval_s=0.1,
                   message="a quarter of the lines to run")
        _kill_whole_worker(worker)
        assert UsageRecord.objects.filter(batch_id=batch.id).count() < NUM_LINES
        worker = start_batch_worker(tmp_path, name="second")
        wait_until(lambda: client.batches.retrieve(batch.id).status == "completed", 180, interval_s=0.1,
                   message=f"the batch to complete after the kill: {Batch.objects.filter(pk=batch.id).values().first()}")
    finally:
        worker.stop()

    batch = client.batches.retrieve(batch.id)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (NUM_LINES, 0)
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).read().splitlines()]
    assert sorted(row["custom_id"] for row in output) == sorted(r["custom_id"] for r in rows)
    assert UsageRecord.objects.filter(batch_id=batch.id).count() == NUM_LINES
