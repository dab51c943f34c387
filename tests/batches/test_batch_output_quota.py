"""A batch's outputs count against its organisation's storage quota (`max_file_bytes`) as its lines finish: a line
whose answer would take the organisation past it is not kept (an error row in the error file says so), and the batch
stops and fails, saying why, with the lines that ran in its files.

Before: an open batch kept room for its output equal to its input's size, and its outputs were stored unchecked: a
300-byte line's answer may be 64 MiB, and 50,000 such lines took an organisation's S3 use far past its quota."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest
from django.db.models import Sum
from django.utils import timezone

from billing.models import UsageRecord
from controlplane.accounts.models import Plan
from endpoints.batches import services, storage
from endpoints.batches.models import Batch, BatchStatus, File
from endpoints.batches.validation import read_lines
from tests.batches.conftest import lose_a_result_once, new_batch
from tests.factories import EndpointFactory
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


def _batch_of_short_lines(tenant, *, max_file_bytes_past_twice_the_input: int, num_lines: int = 200):
    """A batch of many short lines on an endpoint with no replica (no line runs by itself), its organisation's quota
    twice its input (the input, and the room a batch keeps for its output) and `max_file_bytes_past_twice_the_input`."""
    endpoint = EndpointFactory(organization=tenant.org, max_model_len=2048)
    data = b"".join(json.dumps({"custom_id": f"{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": endpoint.name, "input": "x"}}, separators=(",", ":")).encode() + b"\n"
                    for i in range(num_lines))
    quota = 2 * len(data) + max_file_bytes_past_twice_the_input
    _on_plan(tenant.org, max_file_bytes=quota)
    return new_batch(endpoint, data, request_path="/v1/embeddings"), quota


def _expire(batch) -> Batch:
    Batch.objects.filter(pk=batch.pk, status=BatchStatus.IN_PROGRESS).update(
        expires_at=timezone.now() - timedelta(seconds=1))
    services.run_batch(batch.pk)
    return Batch.objects.get(pk=batch.pk)


def test_a_batch_whose_expiry_rows_would_pass_the_quota_fails_its_check_and_nothing_runs(files_bucket, tenant):
    # Before: it ran, and expired with a row for each line never run (each longer than its line) written past the
    # quota: 200 lines, an input of 19,490 bytes and an error file of 41,780, 61,270 bytes kept for a quota of 39,980.
    batch, quota = _batch_of_short_lines(tenant, max_file_bytes_past_twice_the_input=1000)

    services.run_batch(batch.pk)
    batch = _expire(batch)

    assert batch.status == BatchStatus.FAILED and batch.error_file is None
    assert [error["code"] for error in batch.errors] == ["storage_quota_exceeded"]
    assert "max_file_bytes" in batch.errors[0]["message"] and "error file" in batch.errors[0]["message"]
    assert _stored_bytes(tenant.org.pk) <= quota


def test_an_open_batch_keeps_room_for_the_rows_of_its_lines_an_expiry_would_find_without_results(files_bucket, tenant):
    batch, quota = _batch_of_short_lines(tenant, max_file_bytes_past_twice_the_input=64 * 1024)
    services.run_batch(batch.pk)
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.IN_PROGRESS and batch.num_unrun_row_bytes > batch.input_file.bytes
    left = quota - _stored_bytes(tenant.org.pk) - batch.num_unrun_row_bytes
    with pytest.raises(services.Refused):  # its room is its rows', not its input's
        services.create_file(organization_id=tenant.org.pk, purpose="batch", filename="more.jsonl",
                             stream=io.BytesIO(b"x" * (left + 1)), size=left + 1)

    batch = _expire(batch)

    assert batch.status == BatchStatus.EXPIRED and batch.num_failed == 200  # each line never run (was 0)
    rows = storage.read_bytes(batch.error_file.s3_key).splitlines()
    assert len(rows) == 200 and json.loads(rows[0])["error"]["code"] == "batch_expired"
    assert batch.error_file.bytes <= batch.num_unrun_row_bytes
    assert _stored_bytes(tenant.org.pk) <= quota


def _short_chat_lines(endpoint, num_lines: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}},
                               separators=(",", ":")).encode() + b"\n" for i in range(num_lines))


def _set_quota(organization, max_file_bytes: int) -> None:
    Plan.objects.filter(pk=organization.plan_id).update(max_file_bytes=max_file_bytes)


def test_a_line_with_its_result_gives_back_the_room_its_error_row_kept_and_answers_that_fit_are_kept(
        files_bucket, tenant, start_mock_upstream):
    # Before: each line's error-row room (`num_unrun_row_bytes`) was kept beside its result to the end: 40 lines whose
    # answers fit the quota with 5% to spare failed at line 21 (`storage_quota_exceeded`), 8 billed answers dropped
    # with ~8 KB of the quota unused.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    data = _short_chat_lines(endpoint, 40)
    _on_plan(tenant.org, max_file_bytes=10**9)
    measured = new_batch(endpoint, data)
    services.run_batch(measured.pk)
    measured = Batch.objects.get(pk=measured.pk)
    assert measured.status == BatchStatus.COMPLETED
    num_output_bytes = measured.output_file.bytes
    # room for another batch of it and its output (5% to spare), not for its output and its rows' room beside it
    quota = _stored_bytes(tenant.org.pk) + len(data) + max(len(data), num_output_bytes) + num_output_bytes // 20
    _set_quota(tenant.org, quota)

    batch = new_batch(endpoint, data)
    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed, batch.errors) == (BatchStatus.COMPLETED, 40, 0, None)
    assert batch.num_unrun_row_bytes == 0, "each line's room given back as its result was counted"
    assert UsageRecord.objects.filter(batch_id=batch.pk).count() == 40
    assert _stored_bytes(tenant.org.pk) <= quota


def test_a_line_billed_whose_result_was_not_stored_keeps_the_room_of_its_row(files_bucket, tenant, start_mock_upstream,
                                                                             monkeypatch):
    # Before: no line gave its room back (all of `num_unrun_row_bytes` kept to the end, whatever was stored)
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    data = _short_chat_lines(endpoint, 3)
    batch = new_batch(endpoint, data)
    lost = lose_a_result_once(monkeypatch, 1)
    with pytest.raises(RuntimeError):
        services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    done = storage.result_indices(batch.organization_id, batch.pk)
    assert lost == [1] and 1 not in done
    assert batch.num_unrun_row_bytes == sum(services._unrun_row_room(batch.pk, line) for line in read_lines([data])
                                            if line.index not in done), "the room of the rows its end may write"

    services.run_batch(batch.pk)  # line 1 again: stored, billed once
    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_unrun_row_bytes) == (BatchStatus.COMPLETED, 3, 0)
    assert UsageRecord.objects.filter(batch_id=batch.pk).count() == 3


def test_an_organisation_past_its_quota_still_runs_a_batch_whose_rows_need_no_more_room_than_its_input(
        files_bucket, tenant):
    # Before: the check refused 0 bytes more past a quota already passed (a smaller plan since the batch's creation):
    # the batch failed `storage_quota_exceeded`, blaming "this batch's error file", which its input's room held.
    endpoint = EndpointFactory(organization=tenant.org, max_model_len=2048)  # no replica: no line runs by itself
    data = b"".join(json.dumps({"custom_id": f"{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": endpoint.name, "input": "x" * 1000}}).encode() + b"\n"
                    for i in range(20))
    _on_plan(tenant.org, max_file_bytes=10**9)
    batch = new_batch(endpoint, data, request_path="/v1/embeddings")
    _set_quota(tenant.org, len(data) // 2)

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.errors) == (BatchStatus.IN_PROGRESS, None)
    assert 0 < batch.num_unrun_row_bytes <= batch.input_file.bytes
