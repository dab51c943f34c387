"""Scale to zero at the idle deadline, not up to a tick later: a tick that finds an endpoint about to
go idle reconciles it at that moment (a Celery task with that ETA, once per deadline), on a real worker."""

from __future__ import annotations

import time

import pytest
from django.utils import timezone

from controlplane import redis_keys
from controlplane.redis_client import get_redis
from endpoints import scheduler
from endpoints.models import EndpointEvent, Replica
from endpoints.replicas import RECONCILE_TASK
from gpu_agent.protocol import ReplicaState
from tests.conftest import wait_until
from tests.factories import EndpointFactory
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db(transaction=True)

IDLE_TIMEOUT_S = 3


def serving_endpoint(idle_timeout_s: int = IDLE_TIMEOUT_S):
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=1, idle_timeout_s=idle_timeout_s)
    replica = Replica.objects.create(endpoint=endpoint, node=make_node(memory_mb=80_000), state=ReplicaState.READY,
                                     address="http://127.0.0.1:9", ready_at=timezone.now())
    return endpoint, replica


def wait_for_worker(worker) -> None:
    wait_until(lambda: " ready." in worker.log_text(), 120, message="the worker to be ready")


def test_an_endpoint_going_idle_between_ticks_drains_at_its_idle_deadline_once(celery_worker, settings):
    settings.AUTOSCALER_TICK_S = 30  # the next tick is far away: only the scheduled reconcile can drain it in time
    wait_for_worker(celery_worker)
    endpoint, replica = serving_endpoint()
    last_request_at = time.time() - (IDLE_TIMEOUT_S - 2)
    get_redis().set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), last_request_at)
    deadline = last_request_at + IDLE_TIMEOUT_S

    scheduler.autoscale_tick()
    scheduler.autoscale_tick()  # a second tick before the deadline schedules nothing more
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.READY, "nothing drains before the deadline"

    drained = wait_until(lambda: (r := Replica.objects.get(pk=replica.pk)).state == ReplicaState.DRAINING and r,
                         60, message="the replica to drain")
    assert drained.state_changed_at.timestamp() >= deadline
    events = list(EndpointEvent.objects.filter(endpoint=endpoint, message__startswith="Scale down").values_list("message", flat=True))
    assert len(events) == 1 and "scale to zero: idle" in events[0], events


def test_a_request_after_the_tick_moves_the_deadline_and_the_scheduled_reconcile_keeps_the_replica(celery_worker, settings):
    settings.AUTOSCALER_TICK_S = 30
    wait_for_worker(celery_worker)
    endpoint, replica = serving_endpoint(idle_timeout_s=60)
    key = redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk))
    get_redis().set(key, time.time() - 59)
    scheduler.autoscale_tick()
    get_redis().set(key, time.time())  # a request came in after the tick

    # The reconcile scheduled for the first deadline runs, and finds the endpoint busy.
    wait_until(lambda: f"Task {RECONCILE_TASK}[" in celery_worker.log_text() and " succeeded in " in celery_worker.log_text(),
               60, message="the scheduled reconcile to run")
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.READY
    assert not EndpointEvent.objects.filter(endpoint=endpoint, message__startswith="Scale down").exists()


def test_an_endpoint_with_a_floor_is_not_scheduled():
    endpoint, _ = serving_endpoint()
    endpoint.min_replicas = 1
    endpoint.save(update_fields=["min_replicas"])
    get_redis().set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), time.time() - (IDLE_TIMEOUT_S - 1))
    deadlines: dict[str, float] = {}
    loads = scheduler.autoscaler.read_load([str(endpoint.pk)])
    scheduler.endpoints_to_reconcile([str(endpoint.pk)], loads, idle_deadlines=deadlines)
    assert deadlines == {}
