"""An upload's unfinished S3 multipart upload never stays in the bucket: every way an upload fails aborts it, and those
of a killed process are aborted by a sweep (`services.sweep_incomplete_uploads`, hourly in the beat)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import OperationalError
from django.test import Client

from endpoints.batches import services, storage, tasks
from endpoints.batches.models import File
from tests.batches.conftest import bucket_objects

pytestmark = pytest.mark.django_db(transaction=True)

MiB = 1024 * 1024
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'
# S3's time for every upload moto lists (it records none of its own).
MOTO_INITIATED_AT = datetime(2010, 11, 10, 20, 48, 33, tzinfo=UTC)


def _unfinished(bucket: str) -> list[str]:
    return [upload["Key"] for upload in storage._client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def _left_by_a_killed_process(key: str) -> None:
    """An upload of more than one part begun, and never completed nor aborted (its process was killed)."""
    storage.StreamedUpload(key).write(b"x" * (storage.UPLOAD_PART_BYTES + 1))


def test_unfinished_uploads_of_files_are_aborted_by_the_sweep_once_old(files_bucket):
    """Before, a process killed mid-upload left its parts in the bucket for ever, stored and paid for, named by no
    object or row and counted by no quota."""
    _left_by_a_killed_process("files/1/file-killed")
    _left_by_a_killed_process("elsewhere/not-ours")
    assert sorted(_unfinished(files_bucket)) == ["elsewhere/not-ours", "files/1/file-killed"]

    young = MOTO_INITIATED_AT + services.INCOMPLETE_UPLOADS_ABORTED_AFTER - timedelta(minutes=1)
    assert services.sweep_incomplete_uploads(young) == 0  # one that may still be going on is left to go on
    assert len(_unfinished(files_bucket)) == 2

    assert tasks.sweep_incomplete_uploads() == 1
    assert _unfinished(files_bucket) == ["elsewhere/not-ours"]  # outside the platform's files, not its to abort
    assert bucket_objects(files_bucket) == {}
    assert any(entry["task"] == "batches.sweep_incomplete_uploads" for entry in settings.CELERY_BEAT_SCHEDULE.values())


def _post_file(tenant, data: bytes, **fields) -> object:
    return Client().post("/v1/files", {"file": SimpleUploadedFile("r.jsonl", data), "purpose": "batch", **fields},
                         HTTP_AUTHORIZATION=f"Bearer {tenant.key}")


def test_a_refused_upload_aborts_its_parts_even_when_its_row_cannot_be_taken_back(tenant, files_bucket, monkeypatch):
    """Before, the row was taken back first: PostgreSQL failing there left the parts in S3 for ever."""
    def database_gone(file):
        raise OperationalError("the database went away")

    monkeypatch.setattr(services, "abandon_upload", database_gone)
    answer = _post_file(tenant, LINE * (9 * MiB // len(LINE)), purpose="fine-tune")
    assert answer.status_code == 503, answer.content
    assert _unfinished(files_bucket) == []
    assert bucket_objects(files_bucket) == {}


def test_an_upload_swept_while_it_was_stored_is_a_408_and_leaves_nothing(tenant, files_bucket, monkeypatch):
    """Before, the upload's completed multipart upload was aborted again as it was abandoned: S3's NoSuchUpload made
    the 408 a 503."""
    finish_upload = services.finish_upload

    def swept_meanwhile(file, *, size, **kwargs):
        File.objects.filter(pk=file.pk).delete()  # what `sweep_abandoned_uploads` does to an upload of over an hour
        return finish_upload(file, size=size, **kwargs)

    monkeypatch.setattr(services, "finish_upload", swept_meanwhile)
    answer = _post_file(tenant, LINE * (9 * MiB // len(LINE)))
    assert answer.status_code == 408, answer.content
    assert answer.json()["error"]["param"] == "file" and "took too long" in answer.json()["error"]["message"]
    assert _unfinished(files_bucket) == []
    assert bucket_objects(files_bucket) == {}
    assert not File.objects.exists()
