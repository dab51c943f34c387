"""A batch's output and error files are written a result at a time: the results of a large batch never all sit in a
worker's memory.

Before: finalizing parsed every line's result into memory and built both files whole beside them; a large batch (many
lines, or long answers: `n`, logprobs, a large `max_tokens`) took its worker past its memory limit, with the other
tenants' runs in it, at every try: its lines billed, its files never written."""

from __future__ import annotations

import json

import pytest

from endpoints.batches import services, storage
from endpoints.batches.models import Batch, BatchStatus
from tests.batches.conftest import new_batch, peak_bytes_while
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
        storage.put_result(batch.organization_id, batch.pk, index, json.dumps(_result(index, index % 4 != 0)).encode(),
                           ok=index % 4 != 0)

    peak = peak_bytes_while(lambda: services.finalize_batch(Batch.objects.get(pk=batch.pk), BatchStatus.COMPLETED))

    assert peak < 64 * 1024 * 1024, f"{peak / 2**20:.0f} MiB held to write 80 MB of results"
    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 300, 100)
    for file, wanted in ((batch.output_file, [i for i in range(NUM_LINES) if i % 4]),
                         (batch.error_file, list(range(0, NUM_LINES, 4)))):
        data = storage.read_bytes(file.s3_key)
        assert file.bytes == len(data)
        assert [json.loads(row) for row in data.splitlines()] == [_result(i, i % 4 != 0) for i in wanted]
    assert storage.result_indices(batch.organization_id, batch.pk) == {}


def test_a_batchs_files_read_ahead_a_budget_of_bytes_not_a_number_of_results(files_bucket, monkeypatch):
    # It read 32 results ahead whatever their size: lines whose answers were 20–30 MB each (`n`, logprobs) held ~1 GB
    # in a worker of 1 GiB shared by four runs, killed at every try, the batch finalizing for ever. Here a budget of
    # 4 MiB (32 MiB in production) and results of 1.5 MiB: 48 MiB read ahead before, and one result past the budget.
    monkeypatch.setattr(storage, "RESULTS_READ_AHEAD_BYTES", 4 * 2**20, raising=False)
    endpoint = EndpointFactory(max_model_len=2048)
    num_lines = 40
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}} for i in range(num_lines)]
    batch = new_batch(endpoint, b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    services.run_batch(batch.pk)

    def result(index: int) -> dict:
        answer = "y" * (6 * 2**20 if index == 7 else 3 * 2**19)
        return {"id": f"batch_req_{index}", "custom_id": f"c{index}", "error": None,
                "response": {"status_code": 200, "request_id": f"r{index}", "body": {"text": answer}}}

    for index in range(num_lines):
        storage.put_result(batch.organization_id, batch.pk, index, json.dumps(result(index)).encode(), ok=True)

    peak = peak_bytes_while(lambda: services.finalize_batch(Batch.objects.get(pk=batch.pk), BatchStatus.COMPLETED))

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed) == (BatchStatus.COMPLETED, num_lines)
    data = storage.read_bytes(batch.output_file.s3_key)
    assert [json.loads(row) for row in data.splitlines()] == [result(i) for i in range(num_lines)]
    # NOTE: ~26 MiB of it is the file's upload (two 8 MiB parts and their reads), whatever the results
    assert peak < 48 * 2**20, f"{peak / 2**20:.0f} MiB held to write results read ahead within 4 MiB"


def test_a_result_larger_than_a_part_goes_into_its_file_a_part_at_a_time(files_bucket):
    """A line's answer may be 64 MiB (kept on disk while its line ran: `endpoints.batches.spool`). Before, each result
    was read whole into memory to be written, however large, beside the parts of the file's upload."""
    endpoint = EndpointFactory(max_model_len=2048)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}} for i in range(3)]
    batch = new_batch(endpoint, b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    services.run_batch(batch.pk)

    def result(index: int) -> bytes:
        answer = "z" * (40 * 2**20 if index != 1 else 1000)
        return json.dumps({"id": f"batch_req_{index}", "custom_id": f"c{index}", "error": None,
                           "response": {"status_code": 200, "request_id": f"r{index}", "body": {"text": answer}}}
                          ).encode()

    for index in range(3):
        storage.put_result(batch.organization_id, batch.pk, index, result(index), ok=True)

    peak = peak_bytes_while(lambda: services.finalize_batch(Batch.objects.get(pk=batch.pk), BatchStatus.COMPLETED))

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed) == (BatchStatus.COMPLETED, 3)
    data = storage.read_bytes(batch.output_file.s3_key)
    assert data.splitlines() == [result(index) for index in range(3)] and batch.output_file.bytes == len(data)
    # NOTE: ~26 MiB of it is the file's upload (two 8 MiB parts and their reads), and a part of the result read
    assert peak < 40 * 2**20, f"{peak / 2**20:.0f} MiB held to write results of 40 MiB"
