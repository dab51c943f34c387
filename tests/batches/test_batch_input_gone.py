"""A batch's input file, gone or unreadable: a file an open batch reads cannot be deleted; a running batch whose input
is gone all the same ends with the lines that ran; S3 failing for a moment fails nobody's batch.

Before: a deleted input left its batch `in_progress` for ever (each run failed reading it, its endpoint kept warm for
it), and any S3 error while checking a batch failed it as `file_not_found`."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from botocore.exceptions import EndpointConnectionError
from django.conf import settings
from django.utils import timezone

from billing.models import UsageRecord
from endpoints.batches import services, storage
from endpoints.batches.models import Batch, BatchStatus
from endpoints.batches.validation import Line
from tests.batches.conftest import lose_a_result_once, new_batch
from tests.factories import EndpointFactory
from tests.gateway.conftest import serve_endpoint

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


@pytest.mark.parametrize("ending", ["input gone", "expired"])
def test_a_line_billed_but_not_stored_whose_input_is_gone_has_its_row_in_the_error_file(
        files_bucket, tenant, start_mock_upstream, monkeypatch, ending):
    # Before: `request_counts.failed` counted the lost line, yet the error file had no row for it (nor, expired, for
    # the lines never run): the custom ids went with the input, and so did the rows.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    batch = new_batch(endpoint, _input(endpoint, num_lines=3))
    lost = lose_a_result_once(monkeypatch, 1)
    with pytest.raises(RuntimeError):
        services.run_batch(batch.pk)
    done = storage.result_indices(batch.organization_id, batch.pk)
    billed = {int(request_id.rsplit("-", 1)[1])
              for request_id in UsageRecord.objects.filter(batch_id=batch.pk).values_list("request_id", flat=True)}
    unstored = billed - set(done)
    assert lost == [1] and 1 in unstored and all(done.values())
    storage.delete(batch.input_file.s3_key)
    if ending == "expired":
        Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
        monkeypatch.setattr(services, "_run_lines", lambda *args, **kwargs: "full")  # its input not read by the run
        services.run_batch(batch.pk)
    else:
        assert services.run_batch(batch.pk) == "input gone"

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == (BatchStatus.FAILED if ending == "input gone" else BatchStatus.EXPIRED)
    rows = {int(row["id"].rsplit("_", 1)[1]): row for row in
            map(json.loads, storage.read_bytes(batch.error_file.s3_key).splitlines())}
    for index in unstored:
        assert rows[index]["custom_id"] is None and rows[index]["error"]["code"] == "result_not_stored"
        # Before (the message's last change): "request 2 of the input file.", without what the README says it counts
        assert f"request {index + 1} of the input file (blank lines not counted)" in rows[index]["error"]["message"]
    never_run = {0, 1, 2} - set(done) - unstored
    assert set(rows) == unstored | (never_run if ending == "expired" else set())
    # An expired batch counts its never-run lines failed as well (request_counts.failed = its error file's rows)
    assert (batch.num_completed, batch.num_failed) == (len(done), len(rows)), "one row for each failed line"
    assert all((rows[index]["custom_id"], rows[index]["error"]["code"]) == (None, "batch_expired")
               for index in never_run if ending == "expired")
    assert UsageRecord.objects.filter(batch_id=batch.pk).count() == len(billed)  # nothing billed twice


def test_an_input_gone_midway_through_the_rows_lists_the_lines_after_it_by_their_index(monkeypatch):
    batch = Batch(pk="batch_x", num_total=4)

    def read_then_gone(batch, *, skip):
        yield Line(0, "a", {})
        raise storage.ObjectGone("in")

    monkeypatch.setattr(services, "_input_lines", read_then_gone)
    rows = [json.loads(row) for row in services._unrun_rows(batch, {2: True}, {0, 3}, expired=True)]

    assert [(row["id"], row["custom_id"], row["error"]["code"]) for row in rows] == [
        ("batch_req_x_0", "a", "result_not_stored"), ("batch_req_x_1", None, "batch_expired"),
        ("batch_req_x_3", None, "result_not_stored")]


def _s3_refusing_reads(monkeypatch, code: str) -> None:
    """S3 answering every read with `code`: an operator's IAM policy, KMS key or bucket setting gone wrong (the fleet
    lists the bucket, so an object truly not there is `NoSuchKey`)."""
    from botocore.exceptions import ClientError

    def refused(**kwargs):
        raise ClientError({"Error": {"Code": code, "Message": "no"}}, "GetObject")

    monkeypatch.setattr(storage._client(), "get_object", refused)


@pytest.mark.parametrize("code", ["AccessDenied", "NoSuchBucket"])
def test_an_input_s3_will_not_let_the_fleet_read_while_a_batch_is_checked_fails_no_batch_however_long_it_lasts(
        files_bucket, monkeypatch, code):
    # Before: the first attempt failed the batch for good as `file_not_found` ("The input file could not be read."),
    # every validating batch of every tenant, though the operator's mistake mended, the batch would have run.
    endpoint = EndpointFactory(max_model_len=2048)
    batch = new_batch(endpoint, _input(endpoint))
    with monkeypatch.context() as refusing:
        _s3_refusing_reads(refusing, code)
        for _ in range(services.MAX_VALIDATION_ATTEMPTS + 2):  # longer than the attempts a dying worker is given
            with pytest.raises(storage.ObjectGone):
                services.run_batch(batch.pk)  # the task fails; the next tick runs the batch again
            batch = Batch.objects.get(pk=batch.pk)
            assert (batch.status, batch.errors) == (BatchStatus.VALIDATING, None)

    services.run_batch(batch.pk)
    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_total) == (BatchStatus.IN_PROGRESS, 3)


def test_an_input_s3_will_not_let_the_fleet_read_ends_a_validating_batch_once_its_window_has_passed(
        files_bucket, monkeypatch):
    endpoint = EndpointFactory(max_model_len=2048)
    batch = new_batch(endpoint, _input(endpoint))
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    _s3_refusing_reads(monkeypatch, "AccessDenied")

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.FAILED
    assert [(error["code"], error["message"]) for error in batch.errors] == [
        ("validation_failed", services.INPUT_UNREADABLE_MESSAGE)]


@pytest.mark.parametrize("code", ["AccessDenied", "NoSuchBucket"])
def test_an_input_s3_will_not_let_the_fleet_read_while_a_batch_runs_fails_that_run_alone(
        files_bucket, monkeypatch, code):
    # Before: "input gone": the batch failed for good as `file_not_found`, its lines not yet run listed nowhere,
    # though its input was still stored and the next run, the operator's mistake mended, would have run them.
    batch = _running_batch()
    with monkeypatch.context() as refusing:
        _s3_refusing_reads(refusing, code)
        with pytest.raises(storage.ObjectGone):
            services.run_batch(batch.pk)
    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.errors, batch.output_file_id) == (BatchStatus.IN_PROGRESS, None, None)
    assert Batch.objects.open().filter(pk=batch.pk).exists()


def test_an_input_s3_will_not_let_the_fleet_read_still_ends_a_running_batch_past_its_window(files_bucket, monkeypatch):
    batch = _running_batch()
    ran = {"id": "batch_req_x_0", "custom_id": "c0", "error": None,
           "response": {"status_code": 200, "request_id": "r0", "body": {"choices": [{"message": {"content": "hi"}}]}}}
    storage.put_result(batch.organization_id, batch.pk, 0, json.dumps(ran).encode(), ok=True)
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    get_object = storage._client().get_object

    def refusing_the_input(**kwargs):
        if kwargs["Key"] == batch.input_file.s3_key:
            from botocore.exceptions import ClientError
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "GetObject")
        return get_object(**kwargs)

    monkeypatch.setattr(storage._client(), "get_object", refusing_the_input)
    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.EXPIRED
    assert [json.loads(row)["custom_id"] for row in storage.read_bytes(batch.output_file.s3_key).splitlines()] == ["c0"]
    expired = [json.loads(row) for row in storage.read_bytes(batch.error_file.s3_key).splitlines()]
    assert [(row["custom_id"], row["error"]["code"]) for row in expired] == [(None, "batch_expired")] * 2


@pytest.mark.parametrize("running", [False, True])
def test_an_input_s3_will_not_let_the_fleet_read_is_tried_again_after_a_pause_not_at_every_tick(
        files_bucket, monkeypatch, running):
    # Before: each failed run released the batch with no pause, and the next tick (every `BATCH_TICK_S`, 2 s) queued it
    # again, for its whole window (a day): ~43,000 S3 reads refused, error logs and worker runs a batch.
    from controlplane.redis_client import get_redis
    from controlplane.redis_keys import batch_dispatch_key

    if running:
        batch = _running_batch()
    else:
        endpoint = EndpointFactory(max_model_len=2048)
        batch = new_batch(endpoint, _input(endpoint))
    _s3_refusing_reads(monkeypatch, "AccessDenied")
    with pytest.raises(storage.ObjectGone):
        services.run_batch(batch.pk)

    assert get_redis().ttl(batch_dispatch_key(batch.pk)) > 10 * settings.BATCH_TICK_S
    assert not services.dispatch(batch.pk)  # the tick queues it again only once the pause is over
