"""Closing an organisation (`endpoints.closing`) cancels its batches in progress, and the bytes of its files (inputs,
and the outputs its cancelled batches write after the close) leave S3 with the expired-file sweep."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.accounts.models import Organization, Role
from controlplane.accounts.services import Actor
from endpoints import closing
from endpoints.batches import runner, services, storage
from endpoints.batches.models import Batch, BatchStatus, File
from tests.batches.conftest import bucket_objects, new_batch
from tests.factories import EndpointFactory, MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_batch_in_progress_is_cancelled_and_its_files_bytes_are_gone_after_the_sweep(files_bucket):
    endpoint = EndpointFactory(max_model_len=2048)  # scaled to zero: no line runs by itself
    org = endpoint.organization
    owner = UserFactory()
    MembershipFactory(organization=org, user=owner, role=Role.OWNER)
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}}
    batch = new_batch(endpoint, json.dumps(line).encode() + b"\n")
    services.run_batch(batch.pk)
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.IN_PROGRESS
    kept = services.create_file(organization_id=org.pk, purpose="batch", filename="kept.jsonl",
                                stream=io.BytesIO(b"{}\n"), size=3)
    assert bucket_objects(files_bucket)

    closing.close_organization(Actor(user=owner), org, confirm_name=org.name)

    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.CANCELLING
    # its first line had run before the close (its result kept): the run that ends it writes its output file after
    line = next(services._input_lines(Batch.objects.get(pk=batch.pk)))
    row = runner.answer_row(batch.pk, line, 200, runner.line_request_id(batch.pk, line.index),
                            json.dumps({"choices": [{"message": {"content": "hi"}}]}).encode())
    storage.put_result(org.pk, batch.pk, line.index, row, ok=True)
    services.run_batch(batch.pk)
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.CANCELLED and batch.output_file_id is not None
    files = File.objects.filter(organization=org)
    assert {kept.pk, batch.input_file_id, batch.output_file_id} <= set(files.values_list("pk", flat=True))

    # the sweep's grace past: every file of the organisation expired at the close, or as it was written after it
    assert not files.filter(expires_at__isnull=True).exists()
    files.update(expires_at=timezone.now() - timedelta(hours=1))
    services.sweep_expired_files()

    assert not File.objects.filter(organization=org, deleted_at__isnull=True).exists()
    assert bucket_objects(files_bucket) == {}


def test_an_upload_in_flight_at_the_close_expires_with_the_others_and_none_starts_after_it(files_bucket):
    endpoint = EndpointFactory()
    org = endpoint.organization
    owner = UserFactory()
    MembershipFactory(organization=org, user=owner, role=Role.OWNER)
    started = services.start_upload(organization_id=org.pk, filename="late.jsonl", size=3)

    closing.close_organization(Actor(user=owner), org, confirm_name=org.name)
    storage.put_stream(started.s3_key, io.BytesIO(b"{}\n"))
    stored = services.finish_upload(started, size=3)  # its request was authenticated before the close

    assert File.objects.get(pk=stored.pk).expires_at is not None  # before: kept, and its bytes, for ever
    with pytest.raises(services.Refused) as refused:
        services.start_upload(organization_id=org.pk, filename="after.jsonl", size=3)
    assert refused.value.status == 403
    File.objects.filter(organization=org).update(expires_at=timezone.now() - timedelta(hours=1))
    services.sweep_expired_files()
    assert bucket_objects(files_bucket) == {}


def test_a_batch_created_by_a_request_that_found_its_file_before_the_close_is_refused(files_bucket, monkeypatch):
    # NOTE: `create_batch` finds its input file before it takes the organisation's row: a close committed between the
    # two (its files expired, its batches cancelled) left a batch `validating` in the closed organisation, run after it
    endpoint = EndpointFactory(max_model_len=2048)
    org = endpoint.organization
    owner = UserFactory()
    MembershipFactory(organization=org, user=owner, role=Role.OWNER)
    input_file = services.create_file(organization_id=org.pk, purpose="batch", filename="in.jsonl",
                                      stream=io.BytesIO(b"{}\n"), size=3)
    found = services._refuse_past_storage_quota

    def close_meanwhile(*args, **kwargs):  # the close commits while this request reads its file
        Organization.objects.filter(pk=org.pk).update(closed_at=timezone.now())
        return found(*args, **kwargs)

    monkeypatch.setattr(services, "_refuse_past_storage_quota", close_meanwhile)
    with pytest.raises(services.Refused) as refused:
        services.create_batch(organization_id=org.pk, api_key_id=None, user_id=owner.pk, input_file_id=input_file.pk,
                              request_path="/v1/chat/completions", completion_window="24h", metadata=None)
    assert (refused.value.status, refused.value.code) == (403, "organization_closed")
    assert "no more batches" in refused.value.message
    assert not Batch.objects.filter(organization=org).exists()
