"""Batch workers are shared by every tenant: one tenant's batches neither grow the run queue without end nor hold
workers doing nothing.

Before: a queued run stood for its batch for the lease's 30 s only, so a batch waiting in a long queue was queued
again every 30 s (hundreds of open batches grew the queue faster than the workers drained it), and a run whose
endpoint's slots were all taken by interactive calls held its worker for its whole slice, waiting."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane import tasks as controlplane_tasks
from controlplane.redis_client import get_redis
from controlplane.redis_keys import batch_dispatch_key, outstanding_key
from endpoints.batches import runner, services, storage
from endpoints.batches.models import Batch, BatchStatus
from endpoints.models import Replica
from tests.batches.conftest import new_batch
from tests.factories import EndpointFactory
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


def _input(model: str, num_lines: int = 2) -> bytes:
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}} for i in range(num_lines)]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


@pytest.fixture
def queued(monkeypatch):
    sent = []
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: sent.append(kwargs))
    return sent


def test_a_queued_run_stands_for_its_batch_until_it_runs_and_is_dropped_if_it_never_does(files_bucket, queued, settings):
    endpoint = EndpointFactory(max_model_len=2048)
    batch = new_batch(endpoint, _input(endpoint.name))
    get_redis().delete(batch_dispatch_key(batch.pk))
    assert services.dispatch(batch.pk)
    assert queued[-1]["args"] == [batch.pk] and queued[-1]["expires"] == services.DISPATCH_HELD_S
    assert get_redis().ttl(batch_dispatch_key(batch.pk)) > settings.BATCH_LEASE_S, "still queued after the lease's time"
    assert not services.dispatch(batch.pk)


def test_a_run_that_died_has_its_batch_queued_again_at_once(files_bucket, queued):
    endpoint = EndpointFactory(max_model_len=2048)
    batch = new_batch(endpoint, _input(endpoint.name))
    get_redis().set(batch_dispatch_key(batch.pk), "1", ex=services.DISPATCH_HELD_S)  # the run it stood for
    Batch.objects.filter(pk=batch.pk).update(lease_token="dead-run", lease_until=timezone.now() - timedelta(seconds=1))
    queued.clear()
    services.tick()
    assert [kwargs["args"] for kwargs in queued] == [[batch.pk]]


def test_a_run_that_died_has_its_batch_queued_again_once_not_at_every_tick(files_bucket, queued):
    # The dead run's token stayed: every tick read the batch as a dead run's, dropped its queued run and queued
    # another, every 2 s until a worker took it.
    endpoint = EndpointFactory(max_model_len=2048)
    batch = new_batch(endpoint, _input(endpoint.name))
    get_redis().set(batch_dispatch_key(batch.pk), "1", ex=services.DISPATCH_HELD_S)
    Batch.objects.filter(pk=batch.pk).update(lease_token="dead-run", lease_until=timezone.now() - timedelta(seconds=1))
    queued.clear()
    for _ in range(10):
        services.tick()
    assert [kwargs["args"] for kwargs in queued] == [[batch.pk]]


def test_a_batch_whose_endpoint_has_no_free_slot_gives_its_worker_back_without_reading_its_input_again(
        files_bucket, queued, tenant, start_mock_upstream, monkeypatch):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(), target_concurrency=2)
    [replica] = Replica.objects.filter(endpoint=endpoint)
    get_redis().set(outstanding_key(endpoint.organization_id, str(replica.pk)), 2)  # interactive calls take both slots
    batch = new_batch(endpoint, _input(endpoint.name))
    monkeypatch.setattr(runner, "NO_SLOT_GIVE_UP_S", 0.5)

    assert services.run_batch(batch.pk) == "full"  # its first run: checked, then no line could start
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.IN_PROGRESS
    assert 0 < get_redis().ttl(batch_dispatch_key(batch.pk)) <= services.FULL_RETRY_S, "queued again a little later"

    reads = []
    read_parts = storage.read_parts
    monkeypatch.setattr(storage, "read_parts", lambda key, **kwargs: reads.append(key) or read_parts(key, **kwargs))
    assert services.run_batch(batch.pk) == "full"
    assert reads == [], "a 200 MB input is not read again for a run that can start no line"

    get_redis().set(outstanding_key(endpoint.organization_id, str(replica.pk)), 0)
    for _ in range(3):
        services.run_batch(batch.pk)
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and batch.num_completed == 2


def test_an_organisation_keeps_at_most_its_cap_of_open_batches(files_bucket, queued, settings):
    # One tiny input reused kept almost no room against the storage quota: nothing bounded how many batches one
    # organisation kept open, each a queued run and a row every tick reads.
    settings.BATCH_MAX_OPEN_PER_ORG = 2
    endpoint = EndpointFactory(max_model_len=2048)
    first = new_batch(endpoint, _input(endpoint.name))
    second = services.create_batch(organization_id=endpoint.organization_id, api_key_id=None, user_id=None,
                                   input_file_id=first.input_file_id, request_path="/v1/chat/completions",
                                   completion_window="24h", metadata=None)
    with pytest.raises(services.Refused) as refused:
        services.create_batch(organization_id=endpoint.organization_id, api_key_id=None, user_id=None,
                              input_file_id=first.input_file_id, request_path="/v1/chat/completions",
                              completion_window="24h", metadata=None)
    assert (refused.value.status, refused.value.code) == (429, "batch_limit_reached")
    assert "2 batches" in refused.value.message
    other = EndpointFactory(max_model_len=2048)
    assert new_batch(other, _input(other.name)), "another organisation's batches are its own"

    services.cancel_batch(second)
    services.run_batch(second.pk)
    assert Batch.objects.get(pk=second.pk).status == BatchStatus.CANCELLED
    assert services.create_batch(organization_id=endpoint.organization_id, api_key_id=None, user_id=None,
                                 input_file_id=first.input_file_id, request_path="/v1/chat/completions",
                                 completion_window="24h", metadata=None)


def test_a_batch_starts_no_line_while_its_workers_usage_journal_is_full(files_bucket, queued, tenant,
                                                                         start_mock_upstream, monkeypatch, settings,
                                                                         tmp_path):
    # The gateway refuses new calls while the usage journal is past its limit (their rows could only go to a journal
    # already full); batch lines went on being run, each a usage row more in the batch worker's journal. And a worker
    # that found its journal full never replayed it nor counted it again (a review's finding): its batches waited for
    # ever, the journal's rows unwritten.
    from billing import usage_writer
    from billing.models import UsageRecord
    from tests.billing.conftest import usage_report

    endpoint = serve_endpoint(tenant.org, start_mock_upstream(), target_concurrency=2)
    batch = new_batch(endpoint, _input(endpoint.name))
    monkeypatch.setattr(runner, "NO_SLOT_GIVE_UP_S", 0.5)
    settings.USAGE_JOURNAL_DIR = str(tmp_path / "journal")
    settings.USAGE_JOURNAL_MAX_BYTES = 100
    usage_writer.journal.cache_clear()
    try:
        journaled = usage_report(endpoint, request_id="journaled-in-an-outage")
        usage_writer.journal().append([journaled])  # PostgreSQL took no writes meanwhile: the journal is full
        usage_writer.journal().seal()
        assert not usage_writer.usage_recordable()
        monkeypatch.setattr(usage_writer.UsageWriter, "replay", _refused_replay)
        monkeypatch.setattr(runner, "REPLAY_JOURNAL_FOR_S", 1.0)

        assert services.run_batch(batch.pk) == "full"
        assert Batch.objects.get(pk=batch.pk).num_completed == 0
        assert 0 < get_redis().ttl(batch_dispatch_key(batch.pk)) <= services.FULL_RETRY_S, "queued again a little later"

        monkeypatch.undo()  # PostgreSQL takes writes again
        monkeypatch.setattr(runner, "NO_SLOT_GIVE_UP_S", 0.5)
        for _ in range(3):
            services.run_batch(batch.pk)
        batch = Batch.objects.get(pk=batch.pk)
        assert batch.status == BatchStatus.COMPLETED and batch.num_completed == 2
        assert UsageRecord.objects.filter(request_id="journaled-in-an-outage").count() == 1
        assert usage_writer.usage_recordable()
    finally:
        usage_writer.journal.cache_clear()


async def _refused_replay(self) -> int:
    import psycopg

    raise psycopg.OperationalError("the database is down")
