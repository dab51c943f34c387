"""A batch's lease is set and judged by PostgreSQL's clock, never a worker's.

Before: each worker wrote and compared `lease_until` by its own clock, so a worker 60 s ahead took over a batch whose
run was alive and renewing its lease (the new run started the old one's lines in flight again: GPU work twice, their
answers counted twice against the storage quota), and a tick on it queued the live run's batch again."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane import tasks as controlplane_tasks
from controlplane.redis_client import get_redis
from controlplane.redis_keys import batch_dispatch_key
from endpoints.batches import services
from endpoints.batches.models import Batch
from tests.batches.conftest import new_batch
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def batch(files_bucket, monkeypatch):
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)
    endpoint = EndpointFactory(max_model_len=2048)
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}}
    return new_batch(endpoint, json.dumps(line).encode() + b"\n")


REAL_NOW = timezone.now


def _clock_ahead(monkeypatch, seconds: float) -> None:
    monkeypatch.setattr(timezone, "now", lambda: REAL_NOW() + timedelta(seconds=seconds))


def test_a_worker_whose_clock_is_ahead_does_not_take_a_live_runs_batch(batch, monkeypatch, settings):
    settings.BATCH_LEASE_S = 30
    token = services._claim(batch.pk)
    assert token is not None
    assert services._claim(batch.pk) is None, "a live run's batch"

    _clock_ahead(monkeypatch, 60)
    assert services._claim(batch.pk) is None, "taken over by a worker 60 s ahead"
    assert Batch.objects.get(pk=batch.pk).lease_token == token


def test_a_tick_whose_clock_is_ahead_leaves_a_live_runs_batch_alone(batch, monkeypatch, settings):
    settings.BATCH_LEASE_S = 30
    token = services._claim(batch.pk)
    get_redis().set(batch_dispatch_key(batch.pk), "1", ex=services.DISPATCH_HELD_S)  # the run that holds it
    sent = []
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: sent.append(kwargs["args"]))

    _clock_ahead(monkeypatch, 60)
    services.tick()
    assert sent == [], "its live run's batch queued again"
    assert Batch.objects.get(pk=batch.pk).lease_token == token


def test_a_lease_taken_by_a_worker_whose_clock_is_behind_still_lasts_its_time(batch, monkeypatch, settings):
    settings.BATCH_LEASE_S = 30
    _clock_ahead(monkeypatch, -60)
    token = services._claim(batch.pk)
    assert token is not None
    monkeypatch.setattr(timezone, "now", REAL_NOW)
    assert services._claim(batch.pk) is None, "a lease set by a clock 60 s behind had lapsed at once"
