"""An upload's start (`File.created_at`) is stamped by PostgreSQL's clock, and the abandoned-upload sweep judges its age
(`UPLOAD_ABANDONED_AFTER`, an hour) by it too, never by a web pod's or a worker's own.

Before: the web pod that took the upload stamped it by its clock and the worker that swept judged it by its own: a web
pod 55 minutes behind, or a worker 55 minutes ahead, swept an upload 10 minutes into its body (its row and bytes gone,
the tenant answered 408 "send it again" once it had sent the whole file); a web pod ahead kept a dead upload's row and
bytes that much past the hour."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from endpoints.batches import services, uploads
from endpoints.batches.models import File

pytestmark = pytest.mark.django_db(transaction=True)

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'
REAL_NOW = timezone.now


def _this_process_clock(monkeypatch, offset: timedelta) -> None:
    """This process (a web pod, then a worker) has a clock `offset` from PostgreSQL's, its rows' defaults too (a
    field keeps `timezone.now` itself, as its default first read: `Field._get_default`)."""
    monkeypatch.setattr(timezone, "now", lambda: REAL_NOW() + offset)
    monkeypatch.setattr(File._meta.get_field("created_at"), "_get_default", timezone.now)


def _upload_begun(organization_id: int) -> uploads.StreamToStorage:
    """An upload whose body is being read: its row written, its first bytes sent."""
    storing = uploads.StreamToStorage(None, organization_id=organization_id, reserved=len(LINES))
    storing.new_file(uploads.FILE_FIELD, "big.jsonl", "application/jsonl", len(LINES))
    storing.receive_data_chunk(LINES, 0)
    return storing


def _ten_minutes_on(storing: uploads.StreamToStorage) -> None:
    """Ten minutes into the upload by PostgreSQL's clock (the row's start moved back; its lease stays live)."""
    File.objects.filter(pk=storing.file.pk).update(created_at=storing.file.created_at - timedelta(minutes=10))


def test_an_upload_taken_by_a_web_pod_whose_clock_is_behind_is_not_swept_while_its_body_is_sent(
        files_bucket, tenant, monkeypatch):
    with monkeypatch.context() as web_pod:
        _this_process_clock(web_pod, timedelta(minutes=-55))
        storing = _upload_begun(tenant.org.pk)
    _ten_minutes_on(storing)

    assert services.sweep_abandoned_uploads() == 0  # a worker whose clock is right

    stored = storing.finish()
    assert list(File.objects.for_org(tenant.org.pk)) == [stored]


def test_a_worker_whose_clock_is_ahead_does_not_sweep_an_upload_whose_body_is_being_sent(
        files_bucket, tenant, monkeypatch):
    storing = _upload_begun(tenant.org.pk)
    _ten_minutes_on(storing)

    with monkeypatch.context() as worker:
        _this_process_clock(worker, timedelta(minutes=55))
        assert services.sweep_abandoned_uploads() == 0

    stored = storing.finish()
    assert list(File.objects.for_org(tenant.org.pk)) == [stored]


def test_a_worker_whose_clock_is_behind_sweeps_an_upload_dead_for_over_an_hour(files_bucket, tenant, monkeypatch):
    storing = _upload_begun(tenant.org.pk)
    File.objects.filter(pk=storing.file.pk).update(created_at=storing.file.created_at - timedelta(minutes=61))

    with monkeypatch.context() as worker:
        _this_process_clock(worker, timedelta(minutes=-50))
        assert services.sweep_abandoned_uploads() == 1

    assert not File.objects.filter(pk=storing.file.pk).exists()


def test_an_upload_finished_by_a_web_pod_whose_clock_is_behind_is_stored_after_it_began(files_bucket, tenant,
                                                                                         monkeypatch):
    # Before: `finish_upload` stamped `stored_at` by the web pod's clock, its start by PostgreSQL's: a web pod 10
    # minutes behind stored a file 10 minutes before it began.
    storing = _upload_begun(tenant.org.pk)
    with monkeypatch.context() as web_pod:
        _this_process_clock(web_pod, timedelta(minutes=-10))
        stored = storing.finish()

    row = File.objects.get(pk=stored.pk)
    assert row.created_at <= row.stored_at <= row.created_at + timedelta(minutes=1)
    assert stored.stored_at == row.stored_at  # what the upload answered is what the row holds
