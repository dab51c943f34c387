"""The console's Batches page: upload a file and start a batch, follow it, download its files, cancel it;
another organisation's batch or file is a 404."""

from __future__ import annotations

import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from controlplane.accounts.models import Role
from endpoints.batches.models import Batch, BatchStatus
from tests.batches.conftest import bucket_objects
from tests.factories import OrganizationFactory

pytestmark = pytest.mark.django_db(transaction=True)

LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}


def _start(client) -> Batch:
    upload = SimpleUploadedFile("requests.jsonl", json.dumps(LINE).encode() + b"\n", content_type="application/jsonl")
    response = client.post(reverse("console:batches"), {"file": upload, "endpoint": "/v1/chat/completions"})
    assert response.status_code == 302
    return Batch.objects.get(organization=client.organization)


def test_a_member_uploads_a_file_starts_a_batch_and_follows_it(console_client_factory, files_bucket, org):
    member = console_client_factory(org, Role.MEMBER)
    assert 'href="/console/batches/"' in member.get(reverse("console:dashboard")).content.decode()
    batch = _start(member)

    assert batch.status == BatchStatus.VALIDATING and batch.input_file.filename == "requests.jsonl"
    assert list(bucket_objects(files_bucket).values()) == [json.dumps(LINE).encode() + b"\n"]
    page = member.get(reverse("console:batch", args=[batch.pk])).content.decode()
    assert "validating" in page and "0 completed, 0 failed of 0 requests" in page
    assert batch.pk in member.get(reverse("console:batches")).content.decode()
    download = member.get(reverse("console:file-download", args=[batch.input_file_id]))
    assert b"".join(download.streaming_content) == json.dumps(LINE).encode() + b"\n"

    member.post(reverse("console:batch-cancel", args=[batch.pk]))
    batch.refresh_from_db()
    assert batch.status == BatchStatus.CANCELLING and batch.cancelling_at is not None
    assert "cancelling" in member.get(reverse("console:batch-live", args=[batch.pk])).content.decode()


def test_a_viewer_sees_batches_but_cannot_start_or_cancel_one(console_client_factory, files_bucket, org):
    batch = _start(console_client_factory(org, Role.MEMBER))
    viewer = console_client_factory(org, Role.VIEWER)
    assert viewer.get(reverse("console:batch", args=[batch.pk])).status_code == 200
    assert viewer.post(reverse("console:batch-cancel", args=[batch.pk])).status_code == 403
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.VALIDATING


def test_a_viewer_cannot_download_a_batchs_prompts_or_answers(console_client_factory, files_bucket, org):
    # /v1/files refuses a viewer (it may not call the API); the console handed them the same bytes.
    batch = _start(console_client_factory(org, Role.MEMBER))
    viewer = console_client_factory(org, Role.VIEWER)

    assert viewer.get(reverse("console:file-download", args=[batch.input_file_id])).status_code == 403
    page = viewer.get(reverse("console:batch", args=[batch.pk])).content.decode()
    assert reverse("console:file-download", args=[batch.input_file_id]) not in page


def test_another_organisations_batch_and_files_are_404s(console_client_factory, files_bucket, org):
    batch = _start(console_client_factory(org, Role.MEMBER))
    stranger = console_client_factory(OrganizationFactory(), Role.OWNER)
    for url in (reverse("console:batch", args=[batch.pk]), reverse("console:batch-live", args=[batch.pk]),
                reverse("console:file-download", args=[batch.input_file_id])):
        assert stranger.get(url).status_code == 404
    assert stranger.post(reverse("console:batch-cancel", args=[batch.pk])).status_code == 404
    assert batch.pk not in stranger.get(reverse("console:batches")).content.decode()
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.VALIDATING
