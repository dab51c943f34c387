"""The autoscaler judges a batch's deadline by PostgreSQL's clock, the one its window is stamped by
(`Batch.expires_at`), never by Redis's, the one it reads the endpoints' load by.

Before: `autoscaler.decide` compared the deadline with the tick's `now` (Redis's clock): with Redis an hour behind
PostgreSQL, an endpoint scaled to zero was woken for a batch an hour late (a batch due in 10 minutes waited "50
minutes" and expired unserved); with Redis an hour ahead, it was woken (a GPU held) an hour early."""

from __future__ import annotations

from datetime import timedelta

import pytest

from controlplane.clock import database_now
from controlplane.redis_client import redis_time
from endpoints import autoscaler, scheduler
from endpoints.batches.models import Batch, BatchStatus, File
from endpoints.models import Replica
from endpoints.nodes.models import Node
from tests.factories import EndpointFactory
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db

HOUR = 3600.0


def _scaled_to_zero_with_a_batch_due_in(minutes: float):
    """An endpoint with no replica (a READY node with room for one) and a batch of 10 lines left whose window ends
    `minutes` from now by PostgreSQL's clock: woken once ~10 minutes (twice its 300 s cold start and work) are left."""
    endpoint = serve_endpoint(EndpointFactory().organization, cold_start_timeout_s=300)
    Node.objects.filter(replicas__isnull=True, gpu_type="l4").update(gpu_memory_mb=80_000)  # room for its model
    input_file = File.objects.create(organization=endpoint.organization, purpose="batch", filename="in.jsonl", bytes=1,
                                     s3_key="files/x")
    Batch.objects.create(organization=endpoint.organization, endpoint=endpoint, request_path="/v1/chat/completions",
                         input_file=input_file, status=BatchStatus.IN_PROGRESS, num_total=10,
                         expires_at=database_now() + timedelta(minutes=minutes))
    return endpoint


def _tick_with_redis_clock_off_by(endpoint, offset_s: float) -> None:
    """The tick's body (`scheduler._tick`) for `endpoint`, at `now` read from a Redis whose clock is `offset_s` from
    PostgreSQL's; nobody has called the endpoint yet."""
    now = redis_time() + offset_s
    loads = {str(endpoint.pk): autoscaler.Load(0, 0, None, 0)}
    for endpoint_id in scheduler.endpoints_to_reconcile([str(endpoint.pk)], loads, now=now):
        scheduler.reconcile_endpoint(endpoint_id, loads[endpoint_id], now=now, in_a_tick=True)


def test_a_redis_clock_behind_the_database_does_not_leave_a_batch_due_soon_unserved():
    endpoint = _scaled_to_zero_with_a_batch_due_in(minutes=8)

    _tick_with_redis_clock_off_by(endpoint, -HOUR)

    assert Replica.objects.filter(endpoint=endpoint).count() == 1, "not woken for a batch due in 8 minutes"


def test_a_redis_clock_ahead_of_the_database_does_not_wake_an_endpoint_for_a_batch_not_yet_due():
    endpoint = _scaled_to_zero_with_a_batch_due_in(minutes=40)

    _tick_with_redis_clock_off_by(endpoint, HOUR)

    assert not Replica.objects.filter(endpoint=endpoint).exists(), "woken 30 minutes before the deadline needed it"


def test_a_right_redis_clock_wakes_the_endpoint_only_once_the_deadline_needs_it():
    not_yet = _scaled_to_zero_with_a_batch_due_in(minutes=40)
    due = _scaled_to_zero_with_a_batch_due_in(minutes=8)

    _tick_with_redis_clock_off_by(not_yet, 0)
    _tick_with_redis_clock_off_by(due, 0)

    assert (Replica.objects.filter(endpoint=not_yet).count(), Replica.objects.filter(endpoint=due).count()) == (0, 1)
