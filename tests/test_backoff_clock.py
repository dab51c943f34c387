"""An endpoint's backoff after a replica's failure (`Endpoint.next_attempt_at`) is stamped by PostgreSQL's clock and
judged by it: by the reconcile that places its next replica, and by the gateway that refuses calls while it lasts.

Before: the process that heard the failure (a web pod, from a heartbeat; a worker, from a sweep) stamped it by its
own clock, the reconcile judged it by its worker's and the gateway by its own: a web pod 10 minutes ahead made a 1 s
backoff 10 minutes long (no replica placed, the endpoint's calls answered 503 `endpoint_backing_off` "starts none for
601 s"); a worker ahead cut an hour's backoff short."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from endpoints import scheduler
from endpoints.autoscaler import Load
from endpoints.gateway import directory, errors, standing
from endpoints.models import Endpoint, Replica
from endpoints.replicas import record_replica_failure
from tests.factories import EndpointFactory
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db

REAL_NOW, REAL_TIME = timezone.now, time.time


@pytest.fixture
def failed_once_through_a_web_pod_ahead(settings, monkeypatch, django_capture_on_commit_callbacks):
    """An endpoint kept at one replica (room for it on a node) whose first replica failed, the failure heard by a web
    pod whose clock is 10 minutes ahead of PostgreSQL's: it backs off 1 s."""
    settings.REPLICA_RETRY_BASE_S = 1
    endpoint = EndpointFactory(min_replicas=1, max_replicas=1)
    make_node(memory_mb=80_000)
    with monkeypatch.context() as web_pod, django_capture_on_commit_callbacks(execute=False):
        web_pod.setattr(timezone, "now", lambda: REAL_NOW() + timedelta(minutes=10))
        record_replica_failure(endpoint.pk, "CUDA error: an illegal memory access was encountered")
    assert Endpoint.objects.get(pk=endpoint.pk).next_attempt_at is not None
    time.sleep(1.2)  # the backoff is over
    return endpoint


def test_a_failure_heard_by_a_web_pod_whose_clock_is_ahead_holds_the_next_replica_only_its_backoff(
        failed_once_through_a_web_pod_ahead, django_capture_on_commit_callbacks):
    endpoint = failed_once_through_a_web_pod_ahead

    with django_capture_on_commit_callbacks(execute=False):
        scheduler.reconcile_endpoint(str(endpoint.pk), Load(0, 0, None, 0))

    assert Replica.objects.filter(endpoint=endpoint).count() == 1, "no replica placed after a 1 s backoff"


def test_a_gateway_whose_clock_is_behind_does_not_refuse_calls_past_the_backoff(
        failed_once_through_a_web_pod_ahead, monkeypatch):
    endpoint = failed_once_through_a_web_pod_ahead
    monkeypatch.setattr(time, "time", lambda: REAL_TIME() - 600)  # this gateway's clock

    info = directory._endpoint_info(Endpoint.objects.select_related("organization__plan").get(pk=endpoint.pk))

    try:
        standing.refuse_unless_startable(info, wait_for_capacity=True)
    except errors.OpenAIError as refused:
        pytest.fail(f"refused after its 1 s backoff: {refused}")


def test_the_gateway_loads_an_endpoint_with_a_backoff_set_in_as_many_queries_as_one_without():
    """The gateway reloads each endpoint every `ENDPOINT_CACHE_S` (2 s) in each process; judging the backoff by
    PostgreSQL's clock cost a query of its own at every load while `next_attempt_at` was set: for as long as a
    serving endpoint's failed scale-up stands (a restart in place clears none), long after its backoff ended, and it
    is never a backoff the gateway refuses calls for. PostgreSQL's clock is read with the endpoint."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from endpoints.models import ReplicaState

    plain = EndpointFactory(min_replicas=1)
    scaled = EndpointFactory(min_replicas=1, num_scale_up_failures=1, num_failures_since_ready=0,
                             next_attempt_at=REAL_NOW() - timedelta(hours=1))
    backing_off = EndpointFactory(min_replicas=1, num_failures_since_ready=2,
                                  next_attempt_at=REAL_NOW() + timedelta(hours=1))
    node = make_node(memory_mb=80_000)
    Replica.objects.create(endpoint=scaled, node=node, state=ReplicaState.READY)
    counts = {}
    for name, endpoint in (("plain", plain), ("scaled", scaled), ("backing_off", backing_off)):
        with CaptureQueriesContext(connection) as queries:
            info = directory._load_endpoint(endpoint.organization_id, endpoint.name)
        counts[name] = len(queries)
        assert info is not None

    assert counts["scaled"] == counts["plain"], counts
    assert counts["backing_off"] <= counts["plain"] + 1, counts  # whether a replica starts meanwhile
    assert 3500 < info.backing_off_until - REAL_TIME() <= 3600
