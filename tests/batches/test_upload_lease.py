"""An upload in progress counts against its organisation's storage quota while its lease is live: renewed as its body
is read, lapsed within `FILES_UPLOAD_LEASE_S` of its process's death. Before, a dead upload's row counted its whole
declared size until the hourly sweep removed it: a web process killed mid-upload (a deploy, an OOM) kept the
organisation's uploads refused for up to an hour."""

from __future__ import annotations

import io
import time

import pytest

from controlplane.accounts.models import Plan
from endpoints.batches import services, uploads
from endpoints.batches.models import File

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
