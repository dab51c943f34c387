"""A batch's input file, gone or unreadable: a file an open batch reads cannot be deleted; a running batch whose input
is gone all the same ends with the lines that ran; S3 failing for a moment fails nobody's batch.

Before: a deleted input left its batch `in_progress` for ever (each run failed reading it, its endpoint kept warm for
it), and any S3 error while checking a batch failed it as `file_not_found`."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from botocore.exceptions import EndpointConnectionError
from django.utils import timezone

from endpoints.batches import services, storage
from endpoints.batches.models import Batch, BatchStatus
from tests.batches.conftest import new_batch
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _input(endpoint, num_lines: int = 3) -> bytes:
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}} for i in range(num_lines)]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _running_batch():
    endpoint = EndpointFactory(max_model_len=2048)  # scaled to zero: no line runs by itself
    batch = new_batch(endpoint, _input(endpoint))
    services.run_batch(batch.pk)
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.IN_PROGRESS
    return batch


def test_a_file_an_open_batch_reads_cannot_be_deleted_until_the_batch_ends(files_bucket):
    batch = _running_batch()
    with pytest.raises(services.Refused) as refused:
        services.delete_file(batch.input_file)
    assert refused.value.status == 409 and refused.value.code == "file_in_use" and batch.pk in refused.value.message
    assert storage.read_bytes(batch.input_file.s3_key)

    services.cancel_batch(batch)
    services.run_batch(batch.pk)
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.CANCELLED
    assert services.delete_file(batch.input_file)


def test_a_running_batch_whose_input_is_gone_ends_failed_with_the_lines_that_ran(files_bucket):
    batch = _running_batch()
    ran = {"id": "batch_req_x_0", "custom_id": "c0", "error": None,
           "response": {"status_code": 200, "request_id": "r0", "body": {"choices": [{"message": {"content": "hi"}}]}}}
    storage.put_result(batch.organization_id, batch.pk, 0, json.dumps(ran).encode(), ok=True)
    storage.delete(batch.input_file.s3_key)  # lost (a lifecycle rule, an operator), or deleted racing the batch's creation

    assert services.run_batch(batch.pk) == "input gone"

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.FAILED and batch.failed_at is not None
    assert batch.errors == [{"code": "file_not_found", "message": services.INPUT_GONE_MESSAGE, "param": None, "line": 1}]
    assert [json.loads(row)["custom_id"] for row in storage.read_bytes(batch.output_file.s3_key).splitlines()] == ["c0"]
    assert not Batch.objects.open().filter(pk=batch.pk).exists(), "nothing keeps its endpoint warm any more"
    assert storage.result_indices(batch.organization_id, batch.pk) == {}


def test_a_batch_past_its_window_whose_input_is_gone_still_ends(files_bucket):
    batch = _running_batch()
    storage.delete(batch.input_file.s3_key)
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    services.run_batch(batch.pk)
    assert Batch.objects.get(pk=batch.pk).status not in (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING)


def test_s3_failing_while_a_batch_is_checked_fails_that_attempt_alone(files_bucket, monkeypatch):
    endpoint = EndpointFactory(max_model_len=2048)
    batch = new_batch(endpoint, _input(endpoint))
    read_parts = storage.read_parts

    def unreachable(key, **kwargs):
        raise EndpointConnectionError(endpoint_url="http://s3.invalid")
        yield b""

    monkeypatch.setattr(storage, "read_parts", unreachable)
    with pytest.raises(EndpointConnectionError):
        services.run_batch(batch.pk)  # the task fails; the next tick runs the batch again
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.VALIDATING

    monkeypatch.setattr(storage, "read_parts", read_parts)
    services.run_batch(batch.pk)
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.IN_PROGRESS
