"""A batch whose completion window ends before its lines run expires: its error file lists every line
never run with `batch_expired`, and no line is billed. Also: batch lines ask the engine for their low priority."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import UsageRecord
from endpoints.batches import services, storage
from endpoints.batches.models import Batch, BatchStatus
from endpoints.batches.scheduling import BATCH_ENGINE_PRIORITY
from endpoints.gateway.request import InferenceRequest
from tests.batches.conftest import new_batch
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_batch_past_its_window_expires_with_every_unrun_line_in_the_error_file(files_bucket):
    endpoint = EndpointFactory(max_model_len=2048)  # scaled to zero: nothing runs
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}} for i in range(3)]
    batch = new_batch(endpoint, b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    services.run_batch(batch.pk)
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.IN_PROGRESS

    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.EXPIRED and batch.expired_at is not None and batch.output_file is None
    errors = [json.loads(row) for row in storage.read_bytes(batch.error_file.s3_key).splitlines()]
    assert [(row["custom_id"], row["error"]["code"], row["response"]) for row in errors] == [
        ("c0", "batch_expired", None), ("c1", "batch_expired", None), ("c2", "batch_expired", None)]
    assert not UsageRecord.objects.exists()
    # Before: `request_counts` said 0 completed and 0 failed of 3, while the error file listed the 3 lines never run;
    # OpenAI counts each line an expiry writes with `batch_expired` as failed.
    assert (batch.num_completed, batch.num_failed) == (0, 3)


def test_a_batch_line_asks_the_engine_for_its_low_priority_and_an_interactive_call_does_not():
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    interactive = InferenceRequest.parse(body, kind="chat", path="/v1/chat/completions")
    assert "priority" not in json.loads(interactive.upstream_body(media_scope="key:1"))
    batch_line = InferenceRequest(interactive.kind, interactive.path, body, interactive.payload, priority=BATCH_ENGINE_PRIORITY)
    assert json.loads(batch_line.upstream_body(media_scope="key:1"))["priority"] == BATCH_ENGINE_PRIORITY == 100


def test_a_cancel_arriving_while_an_expiry_is_written_ends_the_batch_cancelled(files_bucket, monkeypatch):
    # Before: the run decided "expired" from in_progress, a cancel landed while it wrote the files (in_progress to
    # cancelling), and the end was written regardless: status expired with `cancelling_at` set, its error file listing
    # every line as `batch_expired` though the user had cancelled it.
    endpoint = EndpointFactory(max_model_len=2048)  # scaled to zero: nothing runs
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}} for i in range(2)]
    batch = new_batch(endpoint, b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    services.run_batch(batch.pk)
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    result_keys = storage.result_keys

    def cancelled_while_finalizing(organization_id, batch_id):
        if Batch.objects.get(pk=batch_id).status == BatchStatus.IN_PROGRESS:
            services.cancel_batch(Batch.objects.get(pk=batch_id))  # the API's cancel, after "expired" was decided
        return result_keys(organization_id, batch_id)

    monkeypatch.setattr(storage, "result_keys", cancelled_while_finalizing)
    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.expired_at) == (BatchStatus.CANCELLED, None)
    assert batch.cancelling_at is not None and batch.cancelled_at is not None
    assert batch.error_file is None and batch.output_file is None  # nothing ran: no line is listed as expired


def test_a_batch_whose_last_line_finishes_after_its_window_ended_completes_with_every_answer(
        files_bucket, tenant, start_mock_upstream, monkeypatch):
    """Every line ran (the last one answered just past the deadline): the batch is `completed`, its output whole.
    Before, the run that wrote its files saw the clock past `expires_at` and ended it `expired`, every line answered."""
    from tests.batches.conftest import one_chat_line
    from tests.gateway.conftest import serve_endpoint

    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    batch = new_batch(endpoint, one_chat_line(endpoint))
    put_result = storage.put_result

    def answered_past_the_deadline(organization_id, batch_id, index, row, *, ok):
        stored = put_result(organization_id, batch_id, index, row, ok=ok)
        Batch.objects.filter(pk=batch_id).update(expires_at=timezone.now() - timedelta(seconds=1))
        return stored

    monkeypatch.setattr(storage, "put_result", answered_past_the_deadline)
    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.expired_at, batch.error_file) == (BatchStatus.COMPLETED, None, None)
    assert batch.completed_at is not None and (batch.num_completed, batch.num_failed) == (1, 0)
    output = [json.loads(row) for row in storage.read_bytes(batch.output_file.s3_key).splitlines()]
    assert [(row["custom_id"], row["response"]["status_code"]) for row in output] == [("only", 200)]


def test_a_cancel_arriving_while_a_batch_whose_every_line_ran_lists_its_results_is_refused_and_it_completes(
        files_bucket, tenant, start_mock_upstream, monkeypatch):
    """A batch whose lines have all run is `finalizing` before its results are listed (a few seconds for a large
    one): a cancel then is a 409, and it ends `completed`. The change that let an expiry end `completed` listed them
    first, and a cancel meanwhile was taken (200, `cancelling`) and ended the batch `cancelled`, every line answered."""
    from tests.batches.conftest import one_chat_line
    from tests.gateway.conftest import serve_endpoint

    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    batch = new_batch(endpoint, one_chat_line(endpoint))
    result_keys, cancels = storage.result_keys, []

    def cancelled_while_listed(organization_id, batch_id):
        try:
            cancels.append(services.cancel_batch(Batch.objects.get(pk=batch_id)).status)
        except services.Refused as refused:
            cancels.append((refused.status, refused.message))
        return result_keys(organization_id, batch_id)

    monkeypatch.setattr(storage, "result_keys", cancelled_while_listed)
    services.run_batch(batch.pk)

    assert cancels[:1] == [(409, "Cannot cancel a batch with status 'finalizing'.")]
    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.cancelling_at, batch.num_completed) == (BatchStatus.COMPLETED, None, 1)
