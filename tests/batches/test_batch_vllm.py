"""Done-when of #19's Batch API, on a real vLLM engine with the official `openai` client: a batch of 200
chat lines completes with a correct output file, billed at the batch price exactly once per line,
through a SIGKILL of the Celery worker running it in the middle."""

from __future__ import annotations

import io
import json
import signal
from decimal import Decimal

import psutil
import pytest

from billing.ledger import cost_of
from billing.models import UsageRecord
from tests.batches.conftest import start_batch_worker
from tests.conftest import wait_until
from tests.gateway.conftest import ENGINE_KEY, ENGINE_NAME, serve_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

NUM_LINES = 200


def _kill_whole_worker(worker) -> None:
    """SIGKILL the worker's master and every pool process: nothing gets to clean up."""
    master = psutil.Process(worker.pid)
    for process in [*master.children(recursive=True), master]:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    worker.stop()


def test_a_200_line_batch_survives_a_worker_kill_and_bills_each_line_once_at_the_batch_price(
        vllm_engine, gateway, tenant, files_bucket, tmp_path):
    endpoint = serve_endpoint(tenant.org, vllm_engine, name=ENGINE_NAME, engine_key=ENGINE_KEY, target_concurrency=8)
    client = tenant.client(gateway)
    rows = [{"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": ENGINE_NAME, "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 4}}
            for i in range(NUM_LINES)]
    input_file = client.files.create(file=("in.jsonl", io.BytesIO(b"".join(json.dumps(r).encode() + b"\n" for r in rows))),
                                     purpose="batch")
    worker = start_batch_worker(tmp_path, name="first")
    batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h")

    def billed() -> int:
        return UsageRecord.objects.filter(batch_id=batch.id).count()

    try:
        wait_until(lambda: billed() >= NUM_LINES // 4, 600, interval_s=0.2, message="a quarter of the lines to run")
        _kill_whole_worker(worker)
        at_kill = billed()
        assert at_kill < NUM_LINES, "the batch finished before the kill: nothing was tested"
        worker = start_batch_worker(tmp_path, name="second")

        def finished():
            return client.batches.retrieve(batch.id).status in ("completed", "failed", "expired", "cancelled")

        wait_until(finished, 900, interval_s=0.2, message="the batch to finish after the kill")
    finally:
        worker.stop()

    batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (NUM_LINES, NUM_LINES, 0)
    assert batch.error_file_id is None
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).read().splitlines()]
    assert sorted(row["custom_id"] for row in output) == sorted(r["custom_id"] for r in rows)
    for row in output:
        body = row["response"]["body"]
        assert row["response"]["status_code"] == 200 and row["error"] is None
        assert body["object"] == "chat.completion" and body["model"] == ENGINE_NAME
        assert 1 <= body["usage"]["completion_tokens"] <= 4

    # Exactly one usage row per line (a line re-run after the kill reuses its request id), each at half price.
    ledger = UsageRecord.objects.filter(batch_id=batch.id)
    assert ledger.count() == NUM_LINES
    assert set(ledger.values_list("request_id", flat=True)) == {row["response"]["request_id"] for row in output}
    for usage in ledger:
        full = cost_of(endpoint, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
        assert usage.cost == (full * Decimal("0.5")).quantize(Decimal("0.000000001")) > 0
    assert not UsageRecord.objects.exclude(batch_id=batch.id).filter(organization=tenant.org).exists()
