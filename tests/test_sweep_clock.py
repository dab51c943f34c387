"""The sweeps judge a replica's start, drain and sleep by PostgreSQL's clock, never their worker's.

Before: a sweep compared a replica's `created_at`/`state_changed_at` with its own worker's clock: one 5 minutes ahead
stopped every draining replica at once as "its agent never confirmed the drain" (its GPU placeable while its engine
still ran), one 16 minutes ahead failed a replica loading its weights as "did not become READY within 900 s", and one
31 minutes ahead stopped a replica asleep a moment ago."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from endpoints import replicas, scheduler
from endpoints.models import Replica
from endpoints.nodes.models import Node
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory
from tests.test_placement import make_node
from tests.test_scheduler import load

pytestmark = pytest.mark.django_db

REAL_NOW = timezone.now


def _this_worker_clock(monkeypatch, offset: timedelta) -> None:
    monkeypatch.setattr(timezone, "now", lambda: REAL_NOW() + offset)


def _put_to_sleep_when_idle(replica: Replica, settings):
    """Sleep mode on, a sleeper stopped after 30 minutes, and the replica's endpoint sleeping (not stopping) when idle."""
    settings.SLEEP_MODE = True
    settings.SLEEP_STOP_AFTER_S = 1800
    endpoint = replica.endpoint
    endpoint.idle_action = "sleep"
    endpoint.save(update_fields=["idle_action"])
    return endpoint


@pytest.fixture
def replica(settings) -> Replica:
    settings.REPLICA_START_TIMEOUT_S = 900
    settings.REPLICA_DRAIN_TIMEOUT_S = 120
    settings.NODE_HEARTBEAT_GRACE_S = 30
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1)
    make_node(memory_mb=80_000)
    scheduler.reconcile_endpoint(str(endpoint.pk), load())
    return Replica.objects.get(endpoint=endpoint)


def test_a_sweep_on_a_worker_whose_clock_is_ahead_leaves_a_replica_that_just_began_draining(
        replica, monkeypatch, django_capture_on_commit_callbacks):
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.DRAINING, state_changed_at=REAL_NOW())
    _this_worker_clock(monkeypatch, timedelta(minutes=5))
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.DRAINING


def test_a_sweep_on_a_worker_whose_clock_is_ahead_leaves_a_replica_that_just_began_starting(
        replica, monkeypatch, django_capture_on_commit_callbacks):
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.STARTING, created_at=REAL_NOW())
    _this_worker_clock(monkeypatch, timedelta(minutes=16))
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    replica.refresh_from_db()
    assert (replica.state, replica.failure_reason) == (ReplicaState.STARTING, "")


def test_a_replica_starting_past_its_timeout_by_the_database_clock_still_fails(
        replica, django_capture_on_commit_callbacks):
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.STARTING,
                                                 created_at=REAL_NOW() - timedelta(seconds=901))
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    replica.refresh_from_db()
    assert (replica.state, replica.failure_reason) == (ReplicaState.FAILED, "did not become READY within 900 s")


def test_a_worker_whose_clock_is_ahead_leaves_a_replica_asleep_a_moment_ago(
        replica, monkeypatch, settings, django_capture_on_commit_callbacks):
    endpoint = _put_to_sleep_when_idle(replica, settings)
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.SLEEPING, state_changed_at=REAL_NOW())
    _this_worker_clock(monkeypatch, timedelta(minutes=31))
    with django_capture_on_commit_callbacks(execute=False):
        assert replicas.stop_long_sleepers(endpoint) == 0
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.SLEEPING


# The other side of each comparison: the stamp. A drain, a sleep, a placement and a wake are stamped by whichever
# process made them (a web pod, any worker); judged by PostgreSQL's clock, a stamp by a process whose clock was behind
# read as old at once. Before: a drain by a process 5 minutes behind was stopped by the next sweep as "its agent never
# confirmed the drain" (its GPU placeable while its engine still ran), a replica placed by one 16 minutes behind was
# failed while it loaded its weights, and a sleep begun by one 31 minutes behind was stopped a moment later.
def test_a_drain_begun_on_a_process_whose_clock_is_behind_is_not_stopped_at_the_next_sweep(
        replica, monkeypatch, django_capture_on_commit_callbacks):
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.READY)
    replica.refresh_from_db()
    with django_capture_on_commit_callbacks(execute=False):
        with monkeypatch.context() as patched:
            _this_worker_clock(patched, timedelta(minutes=-5))
            assert replicas.drain_replica(replica, reason="scaled down")
        scheduler.sweep_stuck()
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.DRAINING


def test_a_replica_placed_on_a_process_whose_clock_is_behind_is_not_failed_while_it_starts(
        settings, monkeypatch, django_capture_on_commit_callbacks):
    settings.REPLICA_START_TIMEOUT_S = 900
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1)
    make_node(memory_mb=80_000)
    with django_capture_on_commit_callbacks(execute=False):
        with monkeypatch.context() as patched:
            _this_worker_clock(patched, timedelta(minutes=-16))
            # a model field's default is the function it was given (`timezone.now` as it was at import)
            patched.setattr(Replica._meta.get_field("created_at"), "_get_default", timezone.now)
            scheduler.reconcile_endpoint(str(endpoint.pk), load())
        placed = Replica.objects.get(endpoint=endpoint)
        Replica.objects.filter(pk=placed.pk).update(state=ReplicaState.STARTING)
        scheduler.sweep_stuck()
    placed.refresh_from_db()
    assert (placed.state, placed.failure_reason) == (ReplicaState.STARTING, "")


def test_a_sleep_begun_on_a_process_whose_clock_is_behind_is_not_stopped_a_moment_later(
        replica, monkeypatch, settings, django_capture_on_commit_callbacks):
    endpoint = _put_to_sleep_when_idle(replica, settings)
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.READY)
    Node.objects.filter(pk=replica.node_id).update(memory_mb=512_000)  # host memory to sleep in
    replica = Replica.objects.select_related("endpoint").get(pk=replica.pk)
    with django_capture_on_commit_callbacks(execute=False):
        with monkeypatch.context() as patched:
            _this_worker_clock(patched, timedelta(minutes=-31))
            assert replicas.sleep_replica(replica, reason="idle")
        assert replicas.stop_long_sleepers(endpoint) == 0
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.SLEEPING
