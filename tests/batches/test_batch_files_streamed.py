"""A batch's output and error files are written a result at a time: the results of a large batch never all sit in a
worker's memory.

Before: finalizing parsed every line's result into memory and built both files whole beside them; a large batch (many
lines, or long answers: `n`, logprobs, a large `max_tokens`) took its worker past its memory limit, with the other
tenants' runs in it, at every try: its lines billed, its files never written."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from endpoints.batches import services, storage
from endpoints.batches.models import Batch, BatchStatus
from tests.batches.conftest import new_batch
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db(transaction=True)

NUM_LINES = 400
ANSWER = "x" * 200_000  # 80 MB of results in all


def _result(index: int, ok: bool) -> dict:
    return {"id": f"batch_req_{index}", "custom_id": f"c{index}", "error": None,
            "response": {"status_code": 200 if ok else 500, "request_id": f"r{index}", "body": {"text": ANSWER}}}


def test_a_batchs_files_are_written_a_result_at_a_time(files_bucket):
    endpoint = EndpointFactory(max_model_len=2048)  # scaled to zero: nothing runs by itself
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}} for i in range(NUM_LINES)]
    batch = new_batch(endpoint, b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    services.run_batch(batch.pk)
    for index in range(NUM_LINES):
        storage.put_result(batch.organization_id, batch.pk, index, _result(index, index % 4 != 0), ok=index % 4 != 0)

    tracemalloc.start()
    try:
        services.finalize_batch(Batch.objects.get(pk=batch.pk), BatchStatus.COMPLETED)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak < 64 * 1024 * 1024, f"{peak / 2**20:.0f} MiB held to write 80 MB of results"
    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 300, 100)
    for file, wanted in ((batch.output_file, [i for i in range(NUM_LINES) if i % 4]),
                         (batch.error_file, list(range(0, NUM_LINES, 4)))):
        data = storage.read_bytes(file.s3_key)
        assert file.bytes == len(data)
        assert [json.loads(row) for row in data.splitlines()] == [_result(i, i % 4 != 0) for i in wanted]
    assert storage.result_indices(batch.organization_id, batch.pk) == {}
