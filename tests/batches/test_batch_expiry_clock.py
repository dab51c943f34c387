"""A batch's completion window is stamped and judged by PostgreSQL's clock, never a worker's or a web pod's.

Before: a run decided "expired" by its worker's clock (`run_batch`), a tick queued a cold batch past its window by its
own, and a batch's window began at the clock of the web pod that created it: a worker 10 minutes ahead expired a batch
with 5 minutes left (its lines never run, listed `batch_expired`), one 10 minutes behind kept a batch past its window
running, and a web pod 10 minutes ahead gave a batch 24 h 10 min."""

from __future__ import annotations

import io
import json
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane import tasks as controlplane_tasks
from controlplane.accounts.models import ApiKey
from controlplane.clock import database_now
from endpoints.batches import services
from endpoints.batches.models import Batch, BatchStatus
from tests.batches.conftest import new_batch
from tests.factories import EndpointFactory
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

REAL_NOW = timezone.now


def _this_process_clock(monkeypatch, offset: timedelta) -> None:
    """This process is a worker (or web pod) whose clock is `offset` from PostgreSQL's."""
    monkeypatch.setattr(timezone, "now", lambda: REAL_NOW() + offset)


@pytest.fixture
def cold_batch(files_bucket, monkeypatch):
    """A batch of one line, in progress on an endpoint scaled to zero (nothing runs its line)."""
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)
    endpoint = EndpointFactory(max_model_len=2048)
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}}
    batch = new_batch(endpoint, json.dumps(line).encode() + b"\n")
    services.run_batch(batch.pk)
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.IN_PROGRESS
    return batch


def test_a_run_on_a_worker_whose_clock_is_ahead_does_not_expire_a_batch_with_time_left(cold_batch, monkeypatch):
    Batch.objects.filter(pk=cold_batch.pk).update(expires_at=database_now() + timedelta(minutes=5))
    _this_process_clock(monkeypatch, timedelta(minutes=10))

    services.run_batch(cold_batch.pk)

    batch = Batch.objects.get(pk=cold_batch.pk)
    assert (batch.status, batch.expired_at, batch.error_file) == (BatchStatus.IN_PROGRESS, None, None)


def test_a_run_on_a_worker_whose_clock_is_behind_expires_a_batch_past_its_window(cold_batch, monkeypatch):
    Batch.objects.filter(pk=cold_batch.pk).update(expires_at=database_now() - timedelta(minutes=1))
    _this_process_clock(monkeypatch, timedelta(minutes=-10))

    services.run_batch(cold_batch.pk)

    assert Batch.objects.get(pk=cold_batch.pk).status == BatchStatus.EXPIRED


def test_a_tick_on_a_worker_whose_clock_is_behind_queues_a_cold_batch_past_its_window(cold_batch, monkeypatch):
    Batch.objects.filter(pk=cold_batch.pk).update(expires_at=database_now() - timedelta(minutes=1))
    sent = []
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: sent.append(kwargs["args"]))
    _this_process_clock(monkeypatch, timedelta(minutes=-10))

    services.tick()

    assert sent == [[cold_batch.pk]], "a batch past its window left waiting for its endpoint to wake"


def test_a_batch_created_through_a_web_pod_whose_clock_is_ahead_gets_its_window_by_the_database_clock(
        files_bucket, monkeypatch):
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)
    endpoint = EndpointFactory(max_model_len=2048)
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}}
    _this_process_clock(monkeypatch, timedelta(minutes=10))
    before = database_now()
    batch = new_batch(endpoint, json.dumps(line).encode() + b"\n")
    after = database_now()

    shown = batch.as_openai()
    assert before.timestamp() - 1 <= shown["created_at"] <= after.timestamp()
    assert shown["expires_at"] - shown["created_at"] == 24 * 3600


def test_a_worker_whose_clock_is_ahead_runs_the_lines_of_a_batch_with_time_left(files_bucket, tenant,
                                                                               start_mock_upstream, monkeypatch):
    # Before: the runner started no line once its worker's clock passed the window's end (`runner.Work.expires_at`),
    # so a worker 10 minutes ahead ran none in a batch's last 10 minutes: each run stopped "expired" at once.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}}
    batch = new_batch(endpoint, json.dumps(line).encode() + b"\n")
    Batch.objects.filter(pk=batch.pk).update(expires_at=database_now() + timedelta(minutes=5))
    ahead = timedelta(minutes=10)
    _this_process_clock(monkeypatch, ahead)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + ahead.total_seconds())

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 1, 0)


def test_a_batch_run_and_ended_by_a_worker_whose_clock_is_behind_shows_its_steps_in_order(files_bucket, monkeypatch):
    # Before: its steps were stamped by the clock of whichever process took them (`in_progress_at`, `cancelled_at` by
    # the worker's; `created_at` and the window by PostgreSQL's): a worker 10 minutes behind showed the tenant a batch
    # in progress and cancelled 10 minutes before it was created, and its results were swept 10 minutes late.
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)
    endpoint = EndpointFactory(max_model_len=2048)
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}}
    batch = new_batch(endpoint, json.dumps(line).encode() + b"\n")
    with monkeypatch.context() as worker:
        _this_process_clock(worker, timedelta(minutes=-10))
        services.run_batch(batch.pk)
    services.cancel_batch(Batch.objects.get(pk=batch.pk))  # by a web pod whose clock is right
    with monkeypatch.context() as worker:
        _this_process_clock(worker, timedelta(minutes=-10))
        services.run_batch(batch.pk)

    shown = Batch.objects.get(pk=batch.pk).as_openai()
    assert shown["status"] == "cancelled"
    steps = [shown[name] for name in ("created_at", "in_progress_at", "cancelling_at", "cancelled_at")]
    assert steps == sorted(steps), steps
    assert shown["cancelled_at"] - shown["created_at"] < 60


@pytest.mark.parametrize(("worker_off_by", "left", "runs"), [(timedelta(minutes=10), timedelta(minutes=5), True),
                                                           (timedelta(minutes=-10), timedelta(minutes=-1), False)],
                         ids=["worker-ahead-live-key", "worker-behind-expired-key"])
def test_a_batch_runs_while_its_key_lives_by_the_database_clock_not_the_workers(files_bucket, tenant, monkeypatch,
                                                                               worker_off_by, left, runs):
    # Before: `caller_of` judged the creating key's expiry by the worker's clock: one 10 minutes ahead stopped the
    # batch of a key with 5 minutes left, one 10 minutes behind ran the lines of an expired key 10 minutes more.
    endpoint = EndpointFactory(organization=tenant.org, max_model_len=2048)
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}}
    data = json.dumps(line).encode() + b"\n"
    input_file = services.create_file(organization_id=tenant.org.pk, purpose="batch", filename="in.jsonl",
                                      stream=io.BytesIO(data), size=len(data))
    batch = services.create_batch(organization_id=tenant.org.pk, api_key_id=tenant.api_key.pk, user_id=None,
                                  input_file_id=input_file.pk, request_path="/v1/chat/completions",
                                  completion_window="24h", metadata=None)
    ApiKey.objects.filter(pk=tenant.api_key.pk).update(expires_at=database_now() + left)
    _this_process_clock(monkeypatch, worker_off_by)

    assert (services.caller_of(batch) is not None) == runs


def test_judging_a_batchs_key_reads_the_database_clock_in_the_keys_own_query(tenant):
    # Before: `caller_of` (each lease renewal of each running batch, `keep_going`) read PostgreSQL's clock in a round
    # trip of its own (`database_now`) beside the key's query; the key's query reads it now, as `find_api_key` does.
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    batch = Batch(organization_id=tenant.org.pk, api_key_id=tenant.api_key.pk, created_by_id=tenant.owner.pk)
    with CaptureQueriesContext(connection) as queries:
        caller = services.caller_of(batch)
    assert caller is not None and caller.api_key_id == tenant.api_key.pk
    assert not [q["sql"] for q in queries.captured_queries if q["sql"].strip().upper() == "SELECT CLOCK_TIMESTAMP()"]

    ApiKey.objects.filter(pk=tenant.api_key.pk).update(expires_at=database_now() - timedelta(seconds=1))
    assert services.caller_of(batch) is None
