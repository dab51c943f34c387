"""A batch whose endpoint is deleted while it runs: it ends `failed` at the next tick, its output and error files
holding the lines that ran (billed), and its lines never run on another endpoint that took the deleted one's name.

Before: the tick queued a running batch only while its endpoint had a READY replica, so one whose endpoint was deleted
(its replicas drained) stayed `in_progress` until its window ended, a day, holding one of the organisation's open
batches and its storage room; then its run found the endpoint gone, ended it `failed` and deleted the results of the
lines that ran, which were billed and never written to any file. A new endpoint of the deleted one's name (free again
once it is deleted) was taken for the batch's own: its lines ran there, on another model, at its prices."""

from __future__ import annotations

import json

import httpx
import pytest

from controlplane.accounts.services import SYSTEM
from endpoints import services as endpoint_services
from endpoints.batches import runner, services, storage
from endpoints.batches.models import Batch, BatchStatus
from endpoints.gateway import directory
from endpoints.models import Endpoint
from tests.batches.conftest import new_batch
from tests.factories import EndpointFactory
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

NUM_LINES = 3


@pytest.fixture
def dispatched(monkeypatch) -> list[str]:
    """The batches `tick` queues a run of (nothing reaches Celery)."""
    queued: list[str] = []
    monkeypatch.setattr(services, "dispatch", lambda batch_id: queued.append(batch_id) or True)
    return queued


def _running_batch() -> Batch:
    """A batch validated and `in_progress` on an endpoint with no replica (no line runs by itself)."""
    endpoint = EndpointFactory(max_model_len=2048)
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]},
        }
        for i in range(NUM_LINES)
    ]
    batch = new_batch(endpoint, b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    services.run_batch(batch.pk)
    batch = Batch.objects.select_related("input_file", "endpoint").get(pk=batch.pk)
    assert batch.status == BatchStatus.IN_PROGRESS
    return batch


def _run_lines(batch: Batch, count: int) -> None:
    """The first `count` lines' results in S3, as a run writes them once they ran (and were billed)."""
    for line in list(services._input_lines(batch))[:count]:
        row = runner.answer_row(
            batch.pk,
            line,
            200,
            runner.line_request_id(batch.pk, line.index),
            json.dumps({"choices": [{"message": {"content": line.custom_id}}]}).encode(),
        )
        storage.put_result(batch.organization_id, batch.pk, line.index, row, ok=True)


def test_a_batch_whose_endpoint_was_deleted_is_queued_by_the_next_tick(files_bucket, dispatched):
    batch = _running_batch()
    dispatched.clear()  # its creation's
    services.tick()
    assert dispatched == [], "asleep: its lines wait for a READY replica"

    endpoint_services.delete_endpoint(SYSTEM, batch.endpoint)

    services.tick()
    assert dispatched == [batch.pk], "not left in_progress until its window ends"


def test_a_batch_whose_endpoint_was_deleted_ends_failed_with_the_lines_that_ran_in_its_files(files_bucket):
    batch = _running_batch()
    _run_lines(batch, 2)
    endpoint_services.delete_endpoint(SYSTEM, batch.endpoint)
    directory._endpoints.clear()  # as a worker's cache is a few seconds on (`ENDPOINT_CACHE_S`)

    assert services.run_batch(batch.pk) == "gone"

    batch.refresh_from_db()
    assert batch.status == BatchStatus.FAILED and batch.failed_at is not None
    assert [error["code"] for error in batch.errors] == ["model_not_found"]
    output = [json.loads(row) for row in storage.read_bytes(batch.output_file.s3_key).splitlines()]
    assert [row["custom_id"] for row in output] == ["c0", "c1"], "the lines billed keep their answers"
    assert (batch.num_completed, batch.num_failed) == (2, 0)
    assert storage.result_indices(batch.organization_id, batch.pk) == {}
    assert not Batch.objects.open().filter(organization_id=batch.organization_id).exists()


def test_a_batch_never_runs_its_lines_on_a_new_endpoint_that_took_its_deleted_endpoints_name(files_bucket):
    batch = _running_batch()
    _run_lines(batch, 1)
    endpoint_services.delete_endpoint(SYSTEM, batch.endpoint)
    namesake = EndpointFactory(
        organization=batch.endpoint.organization,
        name=batch.endpoint.name,
        model_source="hf:Qwen/Qwen2.5-72B-Instruct",
        max_model_len=2048,
    )
    assert Endpoint.objects.live().get(organization=batch.organization, name=batch.endpoint.name) == namesake
    directory._endpoints.clear()  # as a worker's cache is a few seconds on (`ENDPOINT_CACHE_S`)

    assert services.run_batch(batch.pk) == "gone"

    batch.refresh_from_db()
    assert batch.status == BatchStatus.FAILED and batch.endpoint_id != namesake.pk
    output = [json.loads(row) for row in storage.read_bytes(batch.output_file.s3_key).splitlines()]
    assert [row["custom_id"] for row in output] == ["c0"]


def test_a_batch_whose_endpoint_was_renamed_is_not_ended(files_bucket):
    """A guard (passes before and after): a rename is no deletion, though the old name finds nothing."""
    batch = _running_batch()
    Endpoint.objects.filter(pk=batch.endpoint_id).update(name=f"{batch.endpoint.name}-renamed")
    directory._endpoints.clear()  # as a worker's cache is a few seconds on (`ENDPOINT_CACHE_S`)

    services.run_batch(batch.pk)

    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.IN_PROGRESS


def test_a_batch_whose_endpoint_was_renamed_runs_its_lines_on_it_under_its_new_name(
    files_bucket, tenant, start_mock_upstream
):
    """Before: a line was routed by its own `body.model`, the old name, which named no endpoint any more: every line
    not yet run failed `model_not_found`, for good."""
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": endpoint.name,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
        }
        for i in range(NUM_LINES)
    ]
    batch = new_batch(endpoint, b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    # checked, no line run yet
    services.validate_batch(Batch.objects.select_related("input_file").get(pk=batch.pk))
    Endpoint.objects.filter(pk=endpoint.pk).update(name=f"{endpoint.name}-renamed")
    directory._endpoints.clear()  # as a worker's cache is a few seconds on (`ENDPOINT_CACHE_S`)

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (NUM_LINES, 0)
    stats = httpx.get(f"{upstream}/_stats").json()
    assert stats["num_requests"] == NUM_LINES
    assert stats["last_payload"]["model"] == f"{endpoint.name}-renamed", "its engines serve the new name"
