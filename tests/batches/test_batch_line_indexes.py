"""A batch's lines keep the indexes its check counted (each line's result key, its rows' `id`, its usage row's request
id) at every run, whichever release checked it and whichever runs it: a line answered is never run again under another
index, nor a line past its `num_total` run at all."""

from __future__ import annotations

import json

import pytest

from billing.models import UsageRecord
from endpoints.batches import runner, services, storage
from endpoints.batches.models import Batch, BatchStatus
from tests.batches.conftest import new_batch
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


def _line(endpoint, custom_id: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}}).encode() + b"\n"


def _checked_over(endpoint, checked: bytes, monkeypatch) -> Batch:
    """A batch checked over the input `checked`, its lines not run yet."""
    batch = new_batch(endpoint, checked)
    with monkeypatch.context() as patched:
        patched.setattr(services, "_run_lines", lambda *args, **kwargs: "full")
        services.run_batch(batch.pk)
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.IN_PROGRESS
    return batch


def _answered_before(batch: Batch, *indexes: int) -> None:
    """Results stored for `indexes` by a run of the release that checked the batch."""
    for index in indexes:
        row = {"id": f"batch_req_{index}", "custom_id": f"c{index}", "error": None,
               "response": {"status_code": 200, "request_id": f"before-{index}", "body": {}}}
        storage.put_result(batch.organization_id, batch.pk, index, json.dumps(row).encode(), ok=True)


def _ended(batch: Batch) -> tuple[Batch, list[str]]:
    for _ in range(3):
        services.run_batch(batch.pk)
    batch = Batch.objects.get(pk=batch.pk)
    return batch, [json.loads(row)["custom_id"] for row in storage.read_bytes(batch.output_file.s3_key).splitlines()]


def test_a_batch_checked_by_the_release_before_runs_its_lines_under_the_same_indexes_past_a_line_of_nbsp(
        files_bucket, tenant, start_mock_upstream, monkeypatch):
    # Before: a line of U+00A0 alone, skipped by the release that checked the batch (c0 c1 c2, num_total 3), was a
    # request (index 1) to the one that ran it: c1 (index 2 now) ran and was billed again, c2 too, and the batch ended
    # "completed" with 4 of its 3 lines, its output c0, c1, c1, c2.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    batch = _checked_over(endpoint, _line(endpoint, "c0") + _line(endpoint, "c1") + _line(endpoint, "c2"), monkeypatch)
    assert batch.num_total == 3
    # the input as the release before read it: its check skipped the line of NBSP alone, as `str.strip` found it
    storage.put_bytes(batch.input_file.s3_key, _line(endpoint, "c0") + "\xa0\n".encode() + _line(endpoint, "c1")
                      + _line(endpoint, "c2"))
    _answered_before(batch, 0, 1)

    batch, output = _ended(batch)

    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 3, 0)
    assert output == ["c0", "c1", "c2"]
    assert list(UsageRecord.objects.filter(batch_id=batch.pk).values_list("request_id", flat=True)) == [
        runner.line_request_id(batch.pk, 2)]


def test_a_run_never_runs_a_line_past_the_requests_its_check_counted(files_bucket, tenant, start_mock_upstream,
                                                                     monkeypatch):
    # Before: the run read every line its input gave, whatever `num_total`: a batch of 2 requests as checked ran 3,
    # billed 3, and ended "completed" with 3 of its 2 lines.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    batch = _checked_over(endpoint, _line(endpoint, "c0") + _line(endpoint, "c1"), monkeypatch)
    storage.put_bytes(batch.input_file.s3_key, _line(endpoint, "c0") + _line(endpoint, "c1") + _line(endpoint, "c2"))

    batch, output = _ended(batch)

    assert (batch.status, batch.num_total, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 2, 2, 0)
    assert output == ["c0", "c1"]
    assert UsageRecord.objects.filter(batch_id=batch.pk).count() == 2
