"""A batch's outputs count against its organisation's storage quota (`max_file_bytes`) as its lines finish: a line
whose answer would take the organisation past it is not kept (an error row in the error file says so), and the batch
stops and fails, saying why, with the lines that ran in its files.

Before: an open batch kept room for its output equal to its input's size, and its outputs were stored unchecked: a
300-byte line's answer may be 64 MiB, and 50,000 such lines took an organisation's S3 use far past its quota."""

from __future__ import annotations

import io
import json

import pytest
from django.db.models import Sum

from controlplane.accounts.models import Plan
from endpoints.batches import services, storage
from endpoints.batches.models import Batch, BatchStatus, File
from tests.batches.conftest import new_batch
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MiB = 2**20
NUM_LINES = 6


def _on_plan(organization, *, max_file_bytes: int) -> None:
    organization.plan = Plan.objects.create(name=f"files-{organization.pk}", max_file_bytes=max_file_bytes)
    organization.save(update_fields=["plan"])


def _stored_bytes(organization_id: int) -> int:
    return File.objects.held_by(organization_id).aggregate(total=Sum("bytes"))["total"] or 0


def _batch_of_long_answers(tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(whole_answer_bytes=MiB))  # ~1 MiB per line's answer
    data = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 4}}).encode() + b"\n" for i in range(NUM_LINES))
    return new_batch(endpoint, data)


def test_a_batch_whose_answers_would_pass_the_storage_quota_stops_and_fails_saying_why(
        files_bucket, tenant, start_mock_upstream):
    quota = 3 * MiB + MiB // 2  # the input and three answers
    _on_plan(tenant.org, max_file_bytes=quota)
    batch = _batch_of_long_answers(tenant, start_mock_upstream)

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.FAILED
    assert [error["code"] for error in batch.errors] == ["storage_quota_exceeded"]
    assert "max_file_bytes" in batch.errors[0]["message"]
    assert _stored_bytes(tenant.org.pk) <= quota
    output = [json.loads(row) for row in storage.read_bytes(batch.output_file.s3_key).splitlines()]
    refused = [json.loads(row) for row in storage.read_bytes(batch.error_file.s3_key).splitlines()]
    assert 1 <= len(output) <= 3 and refused and len(output) + len(refused) <= NUM_LINES
    assert (batch.num_completed, batch.num_failed) == (len(output), len(refused))
    assert all(row["response"] is None and row["error"]["code"] == "storage_quota_exceeded" for row in refused)
    assert "billed" in refused[0]["error"]["message"]
    assert batch.as_openai()["errors"]["data"][0]["line"] - 1 in {int(row["id"].rsplit("_", 1)[1]) for row in refused}


def test_a_batch_whose_answers_fit_the_quota_completes_and_counts_them_while_it_is_open(
        files_bucket, tenant, start_mock_upstream):
    quota = 8 * MiB
    _on_plan(tenant.org, max_file_bytes=quota)
    batch = _batch_of_long_answers(tenant, start_mock_upstream)

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.errors) == (BatchStatus.COMPLETED, NUM_LINES, None)
    assert batch.num_result_bytes == batch.output_file.bytes > NUM_LINES * MiB
    assert batch.input_file.bytes + batch.output_file.bytes == _stored_bytes(tenant.org.pk) <= quota
    # an open batch keeps room for its results so far: here, as it finalizes, an upload of what is left fits
    Batch.objects.filter(pk=batch.pk).update(status=BatchStatus.FINALIZING)
    File.objects.filter(pk=batch.output_file_id).update(deleted_at=batch.completed_at)
    left = quota - _stored_bytes(tenant.org.pk) - batch.num_result_bytes
    with pytest.raises(services.Refused):
        services.create_file(organization_id=tenant.org.pk, purpose="batch", filename="more.jsonl",
                             stream=io.BytesIO(b"x" * (left + 1)), size=left + 1)
