"""An upload in progress counts against its organisation's storage quota while its lease is live: renewed while its
process works on it (its body read, its parts and completion sent to S3), lapsed within `FILES_UPLOAD_LEASE_S` of its
process's death. Before, a dead upload's row counted its whole declared size until the hourly sweep removed it: a web
process killed mid-upload (a deploy, an OOM) kept the organisation's uploads refused for up to an hour. Then its lease
was renewed between its body's chunks only: a slow S3 completion outlasted it, and a second upload was stored beside
it past the quota (found by a review); one whose lease lapsed all the same is checked against the quota again as it
is stored."""

from __future__ import annotations

import io
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.accounts.models import Plan
from endpoints.batches import services, storage, uploads
from endpoints.batches.models import File
from tests.conftest import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'
LEASE_S = 1.0


@pytest.fixture
def short_lease(settings):
    settings.FILES_UPLOAD_LEASE_S = LEASE_S


def _on_plan(organization, *, max_file_bytes: int) -> None:
    organization.plan = Plan.objects.create(name=f"files-{organization.pk}", max_file_bytes=max_file_bytes)
    organization.save(update_fields=["plan"])


def test_a_dead_uploads_row_stops_counting_against_the_quota_once_its_lease_lapses(files_bucket, tenant,
                                                                                   short_lease):
    _on_plan(tenant.org, max_file_bytes=len(LINES))
    # what a web process killed mid-upload leaves: its row, never stored, its lease never renewed
    dead = services.start_upload(organization_id=tenant.org.pk, filename="dead.jsonl", size=len(LINES))
    with pytest.raises(services.Refused) as refused:
        services.refuse_upload_past_storage_quota(tenant.org.pk, len(LINES))
    assert refused.value.code == "storage_quota_exceeded"

    time.sleep(LEASE_S + 0.2)

    stored = services.create_file(organization_id=tenant.org.pk, purpose="batch", filename="r.jsonl",
                                  stream=io.BytesIO(LINES), size=len(LINES))
    assert list(File.objects.for_org(tenant.org.pk)) == [stored]
    assert File.objects.filter(pk=dead.pk, stored_at__isnull=True).exists()  # the sweep removes it later, as before


def test_a_live_upload_keeps_counting_while_its_body_is_read_past_its_lease(files_bucket, tenant, short_lease):
    _on_plan(tenant.org, max_file_bytes=len(LINES))
    storing = uploads.StreamToStorage(None, organization_id=tenant.org.pk, reserved=len(LINES))
    storing.new_file(uploads.FILE_FIELD, "slow.jsonl", "application/jsonl", len(LINES))
    deadline = time.monotonic() + 3 * LEASE_S
    start = 0
    while time.monotonic() < deadline:  # a body read slowly (S3 slow to take its parts), a byte at a time
        storing.receive_data_chunk(LINES[start % len(LINES):start % len(LINES) + 1], start)
        start += 1
        with pytest.raises(services.Refused):
            services.refuse_upload_past_storage_quota(tenant.org.pk, 1)
        time.sleep(LEASE_S / 10)
    storing.abandon()
    services.refuse_upload_past_storage_quota(tenant.org.pk, len(LINES))  # taken back: it counts no more


def test_a_live_upload_keeps_its_place_while_s3_completes_it_past_its_lease(files_bucket, tenant, short_lease,
                                                                           monkeypatch):
    _on_plan(tenant.org, max_file_bytes=len(LINES))
    storing = uploads.StreamToStorage(None, organization_id=tenant.org.pk, reserved=len(LINES))
    storing.new_file(uploads.FILE_FIELD, "a.jsonl", "application/jsonl", len(LINES))
    storing.receive_data_chunk(LINES, 0)  # the whole body parsed
    complete, refusals = storing.stream.complete, []

    def slow_complete():  # S3's last part and CompleteMultipartUpload (SlowDown retries) taking longer than the lease
        time.sleep(LEASE_S + 0.3)
        try:  # meanwhile another upload of the organisation
            services.create_file(organization_id=tenant.org.pk, purpose="batch", filename="b.jsonl",
                                 stream=io.BytesIO(LINES), size=len(LINES))
        except services.Refused as exc:
            refusals.append(exc.code)
        complete()

    monkeypatch.setattr(storing.stream, "complete", slow_complete)
    stored = storing.finish()
    assert refusals == ["storage_quota_exceeded"]
    assert list(File.objects.for_org(tenant.org.pk)) == [stored]
    assert storage.read_bytes(stored.s3_key) == LINES


def test_a_file_put_whole_keeps_its_place_while_s3_reads_it_past_its_lease(files_bucket, tenant, short_lease):
    _on_plan(tenant.org, max_file_bytes=len(LINES))
    refusals = []

    class SlowToRead(io.BytesIO):
        def read(self, *args):
            if not refusals:  # S3 slow to take its first part: another upload meanwhile
                time.sleep(LEASE_S + 0.3)
                try:
                    services.refuse_upload_past_storage_quota(tenant.org.pk, len(LINES))
                    refusals.append("let in")
                except services.Refused as exc:
                    refusals.append(exc.code)
            return super().read(*args)

    stored = services.create_file(organization_id=tenant.org.pk, purpose="batch", filename="a.jsonl",
                                  stream=SlowToRead(LINES), size=len(LINES))
    assert refusals == ["storage_quota_exceeded"]
    assert list(File.objects.for_org(tenant.org.pk)) == [stored]


def test_an_upload_whose_lease_lapsed_is_refused_as_it_is_stored_past_the_quota(files_bucket, tenant, short_lease):
    _on_plan(tenant.org, max_file_bytes=len(LINES))
    # a renewal late (its process stalled): the row stops counting, and another upload is let in and stored
    late = services.start_upload(organization_id=tenant.org.pk, filename="late.jsonl", size=len(LINES))
    storage.put_bytes(late.s3_key, LINES)
    time.sleep(LEASE_S + 0.2)
    other = services.create_file(organization_id=tenant.org.pk, purpose="batch", filename="other.jsonl",
                                 stream=io.BytesIO(LINES), size=len(LINES))

    with pytest.raises(services.Refused) as refused:
        services.finish_upload(late, size=len(LINES))
    assert refused.value.code == "storage_quota_exceeded"
    assert list(File.objects.filter(organization_id=tenant.org.pk)) == [other]  # its row taken back
    with pytest.raises(storage.ObjectGone):
        storage.read_bytes(late.s3_key)


def test_an_upload_whose_lease_lapsed_is_stored_while_the_quota_has_room(files_bucket, tenant, short_lease):
    _on_plan(tenant.org, max_file_bytes=2 * len(LINES))
    late = services.start_upload(organization_id=tenant.org.pk, filename="late.jsonl", size=len(LINES))
    storage.put_bytes(late.s3_key, LINES)
    time.sleep(LEASE_S + 0.2)
    other = services.create_file(organization_id=tenant.org.pk, purpose="batch", filename="other.jsonl",
                                 stream=io.BytesIO(LINES), size=len(LINES))

    stored = services.finish_upload(late, size=len(LINES))
    assert set(File.objects.for_org(tenant.org.pk)) == {stored, other}
    assert storage.read_bytes(stored.s3_key) == LINES


def test_an_upload_older_code_started_without_a_lease_counts_until_the_sweeps_age(files_bucket, tenant):
    """Before, the row of an upload started by code older than leases (a rolling deploy) counted only once stored: a
    second upload was let in beside it past the quota (older code stores without checking again). It counts as that
    code counted it, until the abandoned-upload sweep's age."""
    _on_plan(tenant.org, max_file_bytes=len(LINES))
    older = File.objects.create(organization=tenant.org, purpose="batch", filename="older.jsonl", bytes=len(LINES),
                                s3_key=f"files/{tenant.org.pk}/file-older", stored_at=None)  # no lease
    with pytest.raises(services.Refused) as refused:
        services.create_file(organization_id=tenant.org.pk, purpose="batch", filename="r.jsonl",
                             stream=io.BytesIO(LINES), size=len(LINES))
    assert refused.value.code == "storage_quota_exceeded"

    File.objects.filter(pk=older.pk).update(
        created_at=timezone.now() - services.UPLOAD_ABANDONED_AFTER - timedelta(seconds=1))
    stored = services.create_file(organization_id=tenant.org.pk, purpose="batch", filename="r.jsonl",
                                  stream=io.BytesIO(LINES), size=len(LINES))  # its process died long ago
    assert list(File.objects.for_org(tenant.org.pk)) == [stored]


def _num_connections() -> int:
    """The database's connections now (this test's own among them)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return cursor.fetchone()[0]


@pytest.mark.parametrize("ending", ["finish", "abandon"])
def test_the_renewal_threads_own_database_connection_is_closed_when_its_upload_ends(files_bucket, tenant, short_lease,
                                                                                     ending):
    """The thread renewing an upload's lease opens a database connection of its own (an upload longer than a third
    of the lease, 10 s): it must be closed with the thread, or every such upload leaves one behind."""
    _on_plan(tenant.org, max_file_bytes=len(LINES))
    before = _num_connections()
    storing = uploads.StreamToStorage(None, organization_id=tenant.org.pk, reserved=len(LINES))
    storing.new_file(uploads.FILE_FIELD, "slow.jsonl", "application/jsonl", len(LINES))
    storing.receive_data_chunk(LINES, 0)
    wait_until(lambda: _num_connections() == before + 1, 5, message="the renewal thread's connection")
    time.sleep(LEASE_S)  # renewed a few times on it
    assert _num_connections() == before + 1
    if ending == "finish":
        storing.finish()
    else:
        storing.abandon()
    wait_until(lambda: _num_connections() == before, 5, message="the renewal thread's connection closed")
