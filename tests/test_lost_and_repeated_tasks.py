"""Every Celery task survives its message being lost or delivered twice (README "A lost or repeated task message").

A task message can be lost (kombu pops it before recording it as unacknowledged, and a Redis that stops or a worker
killed between the two loses it) or run twice (a hand-back after a restart, the visibility timeout). Each task a
process sends on an event is a hint: here its message is never consumed (no worker runs in these tests) and the
beat's periodic task that finds the unfinished work is run instead; or its body runs twice."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from controlplane import tasks as controlplane_tasks
from controlplane.accounts.services import Actor
from controlplane.celery_app import app
from controlplane.redis_client import get_redis, redis_time
from controlplane.redis_keys import (
    POOLS_TICK_LOCK_KEY,
    RECENT_ENDPOINTS_KEY,
    batch_dispatch_key,
    last_request_key,
    waiting_key,
)
from endpoints import scheduler, services
from endpoints import tasks as endpoint_tasks
from endpoints.batches import services as batch_services
from endpoints.batches import tasks as batch_tasks
from endpoints.batches.models import Batch
from endpoints.fleet import pools
from endpoints.models import Replica
from endpoints.replicas import fail_replica
from gpu_agent.protocol import ReplicaState
from tests.batches.test_batch_queueing_failures import _input_file
from tests.conftest import REPO_ROOT
from tests.factories import EndpointFactory
from tests.gateway.conftest import new_tenant
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db


def _recovered_by() -> dict[str, str]:
    """README "A lost or repeated task message": each row's task, with the beat's task that does its work when its
    message is lost (the first name in code in the row's second column)."""
    section = (REPO_ROOT / "README.md").read_text().split("#### A lost or repeated task message", 1)[1]
    rows = [line.split(" | ") for line in section.split("\n#", 1)[0].splitlines() if line.startswith("| `")]
    return {_first_code(row[0]): _first_code(row[1]) for row in rows}


def _first_code(cell: str) -> str:
    names = re.findall(r"`([^`]+)`", cell)
    assert names, f"a README row's cell names no task: {cell!r}"
    return names[0]


def _messages_sent(monkeypatch) -> list[tuple[str, list]]:
    """The task messages sent from now on, never delivered: lost."""
    sent = []
    monkeypatch.setattr(
        controlplane_tasks.current_app,
        "send_task",
        lambda name, **options: sent.append((name, options.get("args"))),
    )
    return sent


def _serving(endpoint) -> list[str]:
    return sorted(Replica.objects.filter(endpoint=endpoint).values_list("state", flat=True))


def test_every_task_is_either_on_the_beat_or_recovered_by_a_beat_task_named_in_the_readme_when_its_message_is_lost():
    """It checked a list of its own, which the README's table could leave behind."""
    app.loader.import_default_modules()
    ours = {name for name in app.tasks if not name.startswith("celery.")}
    on_the_beat = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    recovered_by = _recovered_by()
    assert sorted(ours - on_the_beat - recovered_by.keys()) == [], (
        "a new task: say in the README what recovers it"
    )
    assert sorted(recovered_by.keys() - ours) == [], "a README row for a task that does not exist"
    assert {task: beat for task, beat in recovered_by.items() if beat not in on_the_beat} == {}


def test_a_lost_reconcile_after_a_spec_change_is_done_by_the_next_autoscaler_tick(
    monkeypatch, django_capture_on_commit_callbacks
):
    make_node(memory_mb=80_000)
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=2)
    sent = _messages_sent(monkeypatch)
    with django_capture_on_commit_callbacks(execute=True):
        services.update_endpoint(Actor(), endpoint, min_replicas=1)
    assert sent == [("endpoints.reconcile_endpoint", [str(endpoint.pk)])] and _serving(endpoint) == []
    scheduler.autoscale_tick()
    assert _serving(endpoint) == [ReplicaState.PENDING]


def test_a_reconcile_delivered_twice_places_no_second_replica():
    make_node(memory_mb=80_000)
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1, max_replicas=2)
    endpoint_tasks.reconcile_endpoint(str(endpoint.pk))
    endpoint_tasks.reconcile_endpoint(str(endpoint.pk))
    endpoint_tasks.wake_endpoint(str(endpoint.pk))
    assert _serving(endpoint) == [ReplicaState.PENDING]


def test_a_lost_reconcile_after_a_replica_failed_is_replaced_by_the_next_autoscaler_tick(
    monkeypatch, django_capture_on_commit_callbacks
):
    node = make_node(memory_mb=80_000)
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1, max_replicas=1)
    replica = Replica.objects.create(
        endpoint=endpoint,
        node=node,
        state=ReplicaState.READY,
        address="http://127.0.0.1:9",
        ready_at=timezone.now(),
    )
    sent = _messages_sent(monkeypatch)
    with django_capture_on_commit_callbacks(execute=True):
        fail_replica(replica, "its engine crashed")
    assert sent == [("endpoints.reconcile_endpoint", [str(endpoint.pk)])]
    scheduler.autoscale_tick()
    assert _serving(endpoint) == [ReplicaState.FAILED, ReplicaState.PENDING]


def test_a_lost_wake_of_a_cold_endpoint_is_done_by_the_next_autoscaler_tick():
    # What a held cold call leaves in Redis (the gateway's admission and beat), its wake message lost.
    make_node(memory_mb=80_000)
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=1)
    endpoint_id, now, redis = str(endpoint.pk), redis_time(), get_redis()
    redis.zadd(waiting_key(endpoint.organization_id, endpoint_id), {"held-call": now})
    redis.set(last_request_key(endpoint.organization_id, endpoint_id), now)
    redis.zadd(RECENT_ENDPOINTS_KEY, {endpoint_id: now})
    scheduler.autoscale_tick()
    assert _serving(endpoint) == [ReplicaState.PENDING]


def test_a_lost_idle_deadline_reconcile_scales_the_endpoint_to_zero_at_the_next_tick():
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=1, idle_timeout_s=60)
    Replica.objects.create(
        endpoint=endpoint,
        node=make_node(memory_mb=80_000),
        state=ReplicaState.READY,
        address="http://127.0.0.1:9",
        ready_at=timezone.now(),
    )
    now = redis_time()
    get_redis().set(last_request_key(endpoint.organization_id, str(endpoint.pk)), now - 61)
    scheduler.autoscale_tick()
    assert _serving(endpoint) == [ReplicaState.DRAINING]


def _create_batch(tenant) -> Batch:
    return batch_services.create_batch(
        organization_id=tenant.org.pk,
        api_key_id=None,
        user_id=tenant.owner.pk,
        input_file_id=_input_file(tenant.org.pk).pk,
        request_path="/v1/chat/completions",
        completion_window="24h",
        metadata=None,
    )


def test_a_lost_batch_run_is_queued_again_by_the_batch_tick_once_its_dispatch_lapses(
    monkeypatch, django_capture_on_commit_callbacks
):
    tenant = new_tenant()
    sent = _messages_sent(monkeypatch)
    with django_capture_on_commit_callbacks(execute=True):
        batch = _create_batch(tenant)
    assert sent == [("batches.run_batch", [batch.pk])]
    batch_services.tick()
    assert (
        len(sent) == 1
    )  # the queued run stands for the batch for DISPATCH_HELD_S: a long queue is not refilled
    get_redis().delete(batch_dispatch_key(batch.pk))  # DISPATCH_HELD_S later
    batch_services.tick()
    assert sent == [("batches.run_batch", [batch.pk])] * 2


def test_a_batch_run_delivered_while_another_run_holds_the_batch_does_nothing(
    django_capture_on_commit_callbacks,
):
    tenant = new_tenant()
    with django_capture_on_commit_callbacks(execute=False):
        batch = _create_batch(tenant)
    Batch.objects.filter(pk=batch.pk).update(
        lease_until=timezone.now() + timedelta(seconds=60), lease_token="first-run"
    )
    assert batch_tasks.run_batch(batch.pk) == "busy"
    assert Batch.objects.get(pk=batch.pk).lease_token == "first-run"


def test_a_provisioning_delivered_while_another_runs_launches_nothing():
    get_redis().set(POOLS_TICK_LOCK_KEY, "another tick", ex=10)
    assert pools.provision_tick() == 0
