"""A batch's line results (`batches/<org>/<batch>/lines/`) and output files never outlive it in S3
unnamed: results a run left behind when it died (or S3 failed) after ending the batch are swept a while
later; output bytes written before a run was killed have a row the abandoned-upload sweep removes; and
a cancel that raced the endpoint's deletion keeps the results its files are written from."""

from __future__ import annotations

import asyncio
import itertools
import json
from datetime import timedelta

import pytest
from django.utils import timezone

from endpoints.batches import runner, services, storage
from endpoints.batches.models import Batch, BatchStatus, File
from tests.batches.conftest import bucket_objects, new_batch
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db(transaction=True)

NUM_LINES = 3


class Killed(BaseException):
    """The process dying here (a SIGKILL, an OOM kill): nothing after it runs."""


def _running_batch() -> Batch:
    """A batch validated and `in_progress` on an endpoint with no replica (no line runs by itself)."""
    endpoint = EndpointFactory(max_model_len=2048)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}} for i in range(NUM_LINES)]
    batch = new_batch(endpoint, b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    services.run_batch(batch.pk)
    batch = Batch.objects.select_related("input_file", "endpoint").get(pk=batch.pk)
    assert batch.status == BatchStatus.IN_PROGRESS
    return batch


def _finish_lines(batch: Batch, count: int) -> None:
    """The first `count` lines' results in S3, as a run writes them."""
    for line in itertools.islice(services._input_lines(batch), count):
        row = runner.answer_row(batch.pk, line, 200, f"{batch.pk}-{line.index}",
                                json.dumps({"choices": [{"text": line.custom_id}]}).encode())
        storage.put_result(batch.organization_id, batch.pk, line.index, row, ok=True)


def _results(bucket: str, batch: Batch) -> list[str]:
    return list(bucket_objects(bucket, f"batches/{batch.organization_id}/{batch.pk}/lines/"))


@pytest.mark.parametrize("failure", [RuntimeError("S3 answered 500"), Killed()], ids=["s3-error", "killed"])
def test_results_left_by_a_batch_that_ended_are_swept_a_while_later(files_bucket, monkeypatch, failure):
    """Before, results the finalize did not delete (its S3 error swallowed, or its process killed right
    after the commit) stayed in the bucket for ever: nothing looked at ended batches again."""
    batch = _running_batch()
    _finish_lines(batch, NUM_LINES)

    def fails(*args, **kwargs):
        raise failure

    with monkeypatch.context() as patched:
        patched.setattr(storage, "delete_results", fails)
        try:
            services.finalize_batch(batch, BatchStatus.COMPLETED)
        except Killed:
            pass

    batch.refresh_from_db()
    assert batch.status == BatchStatus.COMPLETED and batch.output_file is not None
    assert len(_results(files_bucket, batch)) == NUM_LINES and batch.results_deleted_at is None
    assert services.sweep_ended_results() == 0  # ended just now: a run could still be writing

    assert services.sweep_ended_results(timezone.now() + services.RESULTS_SWEPT_AFTER + timedelta(seconds=1)) == 1

    batch.refresh_from_db()
    assert _results(files_bucket, batch) == [] and batch.results_deleted_at is not None
    assert services.sweep_ended_results(timezone.now() + timedelta(days=1)) == 0  # swept once
    assert storage.read_bytes(batch.output_file.s3_key).count(b"\n") == NUM_LINES  # what it kept stays


def test_output_bytes_of_a_run_killed_before_it_ended_the_batch_are_swept_as_an_abandoned_upload(
        files_bucket, monkeypatch):
    """Before, the output file's bytes went to S3 before its row existed: a kill in between left bytes that
    no row named, never counted against the quota and never deleted."""
    batch = _running_batch()
    _finish_lines(batch, NUM_LINES)
    kept = set(bucket_objects(files_bucket, "files/"))  # the input file
    put_lines = storage.put_lines

    def killed_after_the_put(key, rows):
        put_lines(key, rows)
        raise Killed()

    with monkeypatch.context() as patched:
        patched.setattr(storage, "put_lines", killed_after_the_put)
        with pytest.raises(Killed):
            services.finalize_batch(batch, BatchStatus.COMPLETED)

    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.FINALIZING
    orphans = set(bucket_objects(files_bucket, "files/")) - kept
    assert len(orphans) == 1
    assert not File.objects.for_org(batch.organization_id).filter(s3_key__in=orphans).exists()  # never listed
    # its row kept, an upload in progress (of 0 bytes: the open batch's room counts its results, `num_result_bytes`)
    assert File.objects.filter(s3_key__in=orphans, stored_at__isnull=True, bytes=0).exists()

    assert services.sweep_abandoned_uploads(timezone.now() + services.UPLOAD_ABANDONED_AFTER + timedelta(seconds=1)) == 1

    assert set(bucket_objects(files_bucket, "files/")) == kept
    services.finalize_batch(batch, BatchStatus.COMPLETED)  # the next run writes the files again
    batch.refresh_from_db()
    assert batch.status == BatchStatus.COMPLETED and batch.output_file.stored_at is not None
    assert len(bucket_objects(files_bucket, "files/")) == len(kept) + 1


def test_a_run_that_loses_the_race_to_end_a_batch_leaves_no_output_behind(files_bucket):
    batch = _running_batch()
    _finish_lines(batch, NUM_LINES)
    services.finalize_batch(batch, BatchStatus.COMPLETED)
    stored = set(bucket_objects(files_bucket, "files/"))
    num_files = File.objects.count()
    Batch.objects.filter(pk=batch.pk).update(status=BatchStatus.IN_PROGRESS)  # as a slower run still saw it
    _finish_lines(batch, NUM_LINES)
    Batch.objects.filter(pk=batch.pk).update(status=BatchStatus.COMPLETED)  # ...before the other one ended it

    services.finalize_batch(batch, BatchStatus.COMPLETED)

    assert set(bucket_objects(files_bucket, "files/")) == stored and File.objects.count() == num_files


def test_a_cancel_that_raced_the_endpoints_deletion_keeps_the_results_its_files_are_written_from(
        files_bucket, monkeypatch):
    """Before, the run that found the endpoint gone deleted the results although its update to `failed`
    matched nothing (a cancel came first): the cancelled batch ended with no output, its lines billed."""
    batch = _running_batch()
    _finish_lines(batch, 2)

    async def endpoint_gone_after_a_cancel(work, todo, progress, **kwargs):
        await asyncio.to_thread(Batch.objects.filter(pk=work.batch_id).update, status=BatchStatus.CANCELLING,
                                cancelling_at=timezone.now())
        progress.stopped = "gone"
        return progress

    monkeypatch.setattr(runner, "run", endpoint_gone_after_a_cancel)

    assert services.run_batch(batch.pk) == "gone"

    batch.refresh_from_db()
    assert batch.status == BatchStatus.CANCELLED and batch.errors is None
    output = [json.loads(row) for row in storage.read_bytes(batch.output_file.s3_key).splitlines()]
    assert [row["custom_id"] for row in output] == ["c0", "c1"]
    assert _results(files_bucket, batch) == [] and batch.results_deleted_at is not None


def test_usage_a_worker_journaled_during_a_database_outage_reaches_the_ledger_with_its_next_run(
        files_bucket, settings, tmp_path):
    """Lines that finished while PostgreSQL was down had their usage rows journaled in the worker's own
    journal, and nothing in a worker replayed it (a writer's replay task ends with the run's event loop):
    served, billed never, and lost with the worker's pod."""
    from billing import usage_writer
    from billing.ledger import UsageReport
    from billing.models import UsageRecord

    batch = _running_batch()
    settings.USAGE_JOURNAL_DIR = str(tmp_path / "journal")
    usage_writer.journal.cache_clear()
    now = timezone.now()
    owed = UsageReport(request_id=f"{batch.pk}-0", organization_id=batch.organization_id, api_key_id=None,
                       endpoint_id=batch.endpoint_id, replica_id=None, prompt_tokens=7, cached_tokens=0,
                       completion_tokens=3, started_at=now, first_token_at=now, finished_at=now, status="ok",
                       cold_start_s=0.0, batch_id=batch.pk)
    try:
        usage_writer.journal().append([owed])  # as the writer journals a batch it could not commit

        assert services.run_batch(batch.pk) == "cold"  # the next run of any batch on this worker

        assert UsageRecord.objects.filter(request_id=owed.request_id, completion_tokens=3).count() == 1
        assert usage_writer.journal().backlog() == 0
    finally:
        usage_writer.journal.cache_clear()


def test_an_abandoned_upload_whose_bytes_s3_will_not_delete_is_swept_once_it_does(files_bucket, monkeypatch):
    # Before: its row went first and S3's refusal (down, or a policy without DeleteObject) was logged alone: its bytes
    # stayed in the bucket for good, named by no row, counted by no quota and swept by nothing.
    from botocore.exceptions import ClientError

    from endpoints.batches.models import FilePurpose, new_file_id
    from tests.factories import OrganizationFactory

    organization = OrganizationFactory()
    file_id = new_file_id()
    file = File.objects.create(id=file_id, organization=organization, purpose=FilePurpose.BATCH, filename="r.jsonl",
                               bytes=0, s3_key=storage.file_key(organization.pk, file_id), stored_at=None)
    storage.put_bytes(file.s3_key, b"a prompt\n")
    later = timezone.now() + services.UPLOAD_ABANDONED_AFTER + timedelta(seconds=1)
    with monkeypatch.context() as refusing:
        def refused(**kwargs):
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "DeleteObject")

        refusing.setattr(storage._client(), "delete_object", refused)
        assert services.sweep_abandoned_uploads(later) == 0
    assert File.objects.filter(pk=file.pk).exists(), "kept for the next sweep"
    from controlplane.redis_client import get_redis
    from controlplane.redis_keys import ABANDONED_SWEEP_PAUSED_KEY

    assert services.sweep_abandoned_uploads(later) == 0, "the sweep waits a while first"
    get_redis().delete(ABANDONED_SWEEP_PAUSED_KEY)  # its wait over

    assert services.sweep_abandoned_uploads(later) == 1
    assert not File.objects.filter(pk=file.pk).exists() and file.s3_key not in bucket_objects(files_bucket)


def test_abandoned_uploads_s3_will_not_delete_are_not_tried_again_at_every_tick(files_bucket, monkeypatch):
    # Before: S3 refusing (a policy without DeleteObject, for good) kept every row, and each tick (every 2 s) asked S3
    # again for all of them, up to 100, one error logged with its traceback each: ~50 a second, for as long as the
    # policy stood, every tick's dispatch of batches waiting behind them.
    from botocore.exceptions import ClientError

    from endpoints.batches.models import FilePurpose, new_file_id
    from tests.factories import OrganizationFactory

    organization = OrganizationFactory()
    for _ in range(3):
        file_id = new_file_id()
        File.objects.create(id=file_id, organization=organization, purpose=FilePurpose.BATCH, filename="r.jsonl",
                            bytes=0, s3_key=storage.file_key(organization.pk, file_id), stored_at=None)
    later = timezone.now() + services.UPLOAD_ABANDONED_AFTER + timedelta(seconds=1)
    asked = []

    def refused(**kwargs):
        asked.append(kwargs["Key"])
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "DeleteObject")

    monkeypatch.setattr(storage._client(), "delete_object", refused)
    for _ in range(3):  # three ticks in a row
        assert services.sweep_abandoned_uploads(later) == 0
    assert len(asked) == 1
    assert File.objects.filter(organization=organization).count() == 3
