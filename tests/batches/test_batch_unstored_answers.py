"""A line's answer whose store met PostgreSQL away is stored again once it is back, in the same run: before, it was
dropped for the next run to run again, and a run that then ended the batch (its endpoint deleted, a cancel) lost the
line, billed and in no file."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from django.db import OperationalError

from billing.models import UsageRecord
from controlplane.accounts.services import SYSTEM
from endpoints import services as endpoint_services
from endpoints.batches import answer_bytes, services, storage
from endpoints.batches.models import Batch, BatchStatus
from tests.batches.conftest import lose_a_result_once, new_batch, one_chat_line, run_in_a_thread
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def first_store_meets_postgresql_away(monkeypatch):
    """The first count of a line's storage room fails as a connection PostgreSQL cut would (a blip of a second: a
    real outage cannot be timed to the one query)."""
    take_result_room = services._take_result_room
    num_calls = []

    def once_cut(*args, **kwargs):
        num_calls.append(1)
        if len(num_calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return take_result_room(*args, **kwargs)

    monkeypatch.setattr(services, "_take_result_room", once_cut)


def test_a_line_whose_store_met_an_outage_is_in_the_files_of_a_batch_whose_endpoint_was_deleted_meanwhile(
    files_bucket, tenant, start_mock_upstream, first_store_meets_postgresql_away
):
    upstream = start_mock_upstream(token_delay_ms=400)  # the line answers in ~3 s
    endpoint = serve_endpoint(tenant.org, upstream)
    batch = new_batch(endpoint, one_chat_line(endpoint))
    worker, runs = run_in_a_thread(batch.pk)
    deadline = time.monotonic() + 60
    while httpx.get(f"{upstream}/_stats").json()["num_requests"] < 1:
        assert time.monotonic() < deadline, "the line never started"
        time.sleep(0.05)
    endpoint_services.delete_endpoint(SYSTEM, endpoint)  # the line in flight
    worker.join(timeout=120)

    batch = Batch.objects.get(pk=batch.pk)
    assert UsageRecord.objects.filter(batch_id=batch.pk).count() == 1, "the line ran, billed"
    assert batch.status in (BatchStatus.FAILED, BatchStatus.COMPLETED), f"ended by the run ({runs})"
    assert batch.output_file is not None, "the billed line's answer is in the output file"
    [row] = [json.loads(text) for text in storage.read_bytes(batch.output_file.s3_key).splitlines()]
    assert row["custom_id"] == "only" and row["response"]["status_code"] == 200
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 1


def test_a_store_that_fails_otherwise_ends_the_run_and_gives_its_answers_bytes_back(
    files_bucket, tenant, start_mock_upstream, monkeypatch
):
    # A put S3 refused (or any error but PostgreSQL away) ends the run, as before; the answer it held was popped from
    # the stores in flight and never given back: the process's answer bytes stayed held, and a later run under a small
    # bound started no line and never ended (a fresh clone's run hung there).
    def refused(*args, **kwargs):
        raise RuntimeError("the store refused the put")

    monkeypatch.setattr(services, "_take_result_room", refused)
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    batch = new_batch(endpoint, one_chat_line(endpoint))

    with pytest.raises(RuntimeError):
        services.run_batch(batch.pk)

    assert answer_bytes.held_bytes() == 0


@pytest.mark.parametrize("then", ["cancel", "expire"])
def test_a_line_billed_whose_result_s3_refused_is_in_the_error_file_once_the_batch_ends_before_it_runs_again(
        files_bucket, tenant, start_mock_upstream, monkeypatch, then):
    # A put S3 refused ends the run (the next runs the line again), but the batch cancelled or expired first: the line,
    # billed, was in neither file (cancelled: 0 completed, 0 failed, no file), or said `batch_expired` (never run).
    from datetime import timedelta

    from django.utils import timezone

    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    batch = new_batch(endpoint, one_chat_line(endpoint))
    lost = lose_a_result_once(monkeypatch, 0)
    with pytest.raises(RuntimeError):
        services.run_batch(batch.pk)
    assert lost == [0]
    billed = UsageRecord.objects.get(batch_id=batch.pk)
    assert billed.cost > 0
    if then == "cancel":
        services.cancel_batch(Batch.objects.get(pk=batch.pk))
    else:
        Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == (BatchStatus.CANCELLED if then == "cancel" else BatchStatus.EXPIRED)
    assert batch.output_file is None and (batch.num_completed, batch.num_failed) == (0, 1)
    [row] = [json.loads(row) for row in storage.read_bytes(batch.error_file.s3_key).splitlines()]
    assert row["custom_id"] == "only" and row["response"] is None
    assert row["error"]["code"] == "result_not_stored" and "billed" in row["error"]["message"]
    assert UsageRecord.objects.filter(batch_id=batch.pk).count() == 1  # nothing billed twice
