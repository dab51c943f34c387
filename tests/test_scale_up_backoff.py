"""Replicas added while another serves that keep failing back off the endpoint's scale-ups, and say so; they never
count toward failing it, nor hold a start from zero, and a Retry clears their backoff."""
import threading
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import OperationalError, connection
from django.db.models import Q
from django.test import override_settings
from django.utils import timezone

from controlplane import tasks as controlplane_tasks
from endpoints import replicas as replicas_module
from endpoints import scheduler
from endpoints.autoscaler import Load
from endpoints.gateway.directory import _endpoint_info
from endpoints.models import Endpoint, Replica
from endpoints.replicas import (
    RECONCILE_TASK,
    apply_replica_report,
    failure_signature,
    max_failures_since_ready,
    record_replica_failure,
)
from gpu_agent.protocol import ReplicaState, ReplicaStatus
from tests.factories import EndpointFactory
from tests.test_failed_endpoint_drains import VARIED_REASONS
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db


def busy() -> Load:
    """Calls enough for three replicas."""
    return Load(0, 24, timezone.now().timestamp(), 24)


def serving(organization=None):
    """An endpoint of up to 3 replicas with one READY, and room for more on other nodes."""
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=3, target_concurrency=8,
                               **({"organization": organization} if organization else {}))
    replica = Replica.objects.create(endpoint=endpoint, node=make_node(memory_mb=80_000), state=ReplicaState.READY,
                                     address="http://127.0.0.1:9", ready_at=timezone.now())
    make_node(memory_mb=80_000), make_node(memory_mb=80_000)
    return endpoint, replica


def fail_extra_replicas(endpoint, count):
    for n in range(count):
        record_replica_failure(endpoint.pk, VARIED_REASONS[n % 3])
    endpoint.refresh_from_db()


def num_starting(endpoint) -> int:
    return Replica.objects.filter(endpoint=endpoint, state__in=(ReplicaState.PENDING, ReplicaState.STARTING)).count()


@override_settings(REPLICA_RETRY_BASE_S=30)
def test_failed_scale_ups_while_a_replica_serves_back_off_and_say_why():
    # Before: "replica failed (weights download failed: 503); retrying in 120 s", as for an endpoint serving nothing.
    endpoint, _replica = serving()
    fail_extra_replicas(endpoint, 3)
    assert endpoint.failed_at is None and endpoint.state == "READY"
    assert endpoint.status_message == "scale-up backing off: weights download failed: 503; next try in 120 s"
    assert (endpoint.num_scale_up_failures, endpoint.num_failures_since_ready) == (3, 0)

    scheduler.reconcile_endpoint(str(endpoint.pk), busy())  # calls for three replicas: none added while it backs off
    assert num_starting(endpoint) == 0
    endpoint.refresh_from_db()
    assert endpoint.status_message.startswith("scale-up backing off: ") and endpoint.unplaced_replicas == 0

    Endpoint.objects.filter(pk=endpoint.pk).update(next_attempt_at=timezone.now() - timedelta(seconds=1))
    scheduler.reconcile_endpoint(str(endpoint.pk), busy())  # its backoff passed: the scale-up goes on
    assert num_starting(endpoint) == 2
    assert Endpoint.objects.get(pk=endpoint.pk).status_message == ""


def test_the_serving_replica_crashing_after_failed_scale_ups_does_not_fail_the_endpoint():
    # Before: its first crash, after 10 failed scale-ups, set the endpoint FAILED: "11 replicas in a row failed,
    # none served", though it had served all along.
    endpoint, replica = serving()
    fail_extra_replicas(endpoint, max_failures_since_ready() + 2)
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.FAILED)
    record_replica_failure(endpoint.pk, "engine exited with code -11")
    endpoint.refresh_from_db()
    assert endpoint.failed_at is None
    assert endpoint.num_failures_since_ready == 1  # the first with none serving: the crash-loop count starts here
    assert endpoint.status_message.startswith("replica failed (engine exited with code -11); retrying in ")


def test_a_start_from_zero_is_not_held_by_the_backoff_of_failed_scale_ups():
    # Before: idle, its READY replica drained; the next call's wake placed nothing for the hour the backoff had left,
    # and the gateway answered 503 endpoint_backing_off at once.
    endpoint, replica = serving()
    fail_extra_replicas(endpoint, max_failures_since_ready())
    assert (endpoint.next_attempt_at - timezone.now()).total_seconds() > 1800
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.STOPPED)  # scaled to zero

    info = _endpoint_info(Endpoint.objects.select_related("organization__plan").get(pk=endpoint.pk))
    assert info.backing_off_until == 0  # a call is held as in any cold start, and its wake starts a replica
    scheduler.reconcile_endpoint(str(endpoint.pk), busy())
    assert num_starting(endpoint) == 1  # one, as the backoff still holds the replicas beyond it
    scheduler.reconcile_endpoint(str(endpoint.pk), busy())
    assert num_starting(endpoint) == 1


def test_failures_with_none_serving_still_hold_a_start_from_zero():
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=3)
    make_node(memory_mb=80_000)
    record_replica_failure(endpoint.pk, "engine exited with code 1")
    scheduler.reconcile_endpoint(str(endpoint.pk), busy())
    assert num_starting(endpoint) == 0


def test_retry_clears_the_backoff_of_failed_scale_ups(org, owner_client):
    # Before: resume answered 200 and changed nothing (only a paused or failed endpoint resumed): the scale-up waited
    # up to an hour, or for a PATCH of some field.
    endpoint, _replica = serving(org)
    fail_extra_replicas(endpoint, max_failures_since_ready())
    answer = owner_client.post(f"/api/v1/endpoints/{endpoint.pk}/resume/")
    assert answer.status_code == 200 and answer.json()["status_message"] == ""
    endpoint.refresh_from_db()
    assert endpoint.next_attempt_at is None and endpoint.num_scale_up_failures == 0
    scheduler.reconcile_endpoint(str(endpoint.pk), busy())
    assert num_starting(endpoint) == 2



def test_the_serving_replicas_first_crash_after_identical_failed_scale_ups_does_not_fail_the_endpoint():
    # Before: three scale-ups killed by the kernel's OOM killer on crowded hosts (every exit code blanked to one
    # signature) and, 20 days later, the first crash of the replica that had served all along: "4 replicas in a row
    # failed with the same reason", FAILED. Their run of identical reasons carried over into the crash-loop count.
    endpoint, replica = serving()
    for _ in range(settings.REPLICA_MAX_IDENTICAL_FAILURES - 1):
        record_replica_failure(endpoint.pk, "engine exited with code -9")
    Endpoint.objects.filter(pk=endpoint.pk).update(next_attempt_at=timezone.now() - timedelta(days=20))
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.FAILED)
    record_replica_failure(endpoint.pk, "engine exited with code -9")
    endpoint.refresh_from_db()
    assert endpoint.failed_at is None, endpoint.status_message
    assert (endpoint.num_identical_failures, endpoint.num_failures_since_ready) == (1, 1)


def test_identical_failed_scale_ups_still_fail_the_endpoint():
    endpoint, _replica = serving()
    for _ in range(settings.REPLICA_MAX_IDENTICAL_FAILURES):
        record_replica_failure(endpoint.pk, "engine exited with code -9")
    endpoint.refresh_from_db()
    assert endpoint.failed_at is not None and endpoint.status_message == "failed: engine exited with code -9"


def _record_replica_ready_of_the_release_before_0032(endpoint_id):
    """`record_replica_ready` as a web pod of the release before migration 0032 runs it (95fa1ed4): it knows nothing
    of `num_scale_up_failures`."""
    Endpoint.objects.filter(pk=endpoint_id).filter(
        Q(num_identical_failures__gt=0) | Q(num_failures_since_ready__gt=0) | Q(next_attempt_at__isnull=False)
    ).update(num_identical_failures=0, num_failures_since_ready=0, last_failure_reason="", next_attempt_at=None,
             status_message="")


@override_settings(REPLICA_RETRY_BASE_S=30)
def test_a_ready_taken_by_a_web_pod_of_the_previous_release_ends_the_scale_up_backoff():
    # Before: the old pod cleared the backoff but not the scale-up count, and the next failed scale-up, the first
    # since a replica turned READY, held the scale-ups 3600 s instead of 30.
    endpoint, _replica = serving()
    fail_extra_replicas(endpoint, max_failures_since_ready())
    _record_replica_ready_of_the_release_before_0032(endpoint.pk)  # a rolling deploy
    record_replica_failure(endpoint.pk, "engine exited with code -9")
    endpoint.refresh_from_db()
    assert endpoint.num_scale_up_failures == 1
    assert endpoint.status_message == "scale-up backing off: engine exited with code -9; next try in 30 s"


@pytest.mark.django_db(transaction=True)
def test_a_start_from_zero_that_times_out_is_counted_before_its_reconcile_runs(monkeypatch):
    # Before: the sweep failed the replica, whose reconcile was sent at once (no transaction), and counted the failure
    # only then: a worker taking the reconcile at once read the endpoint as if nothing had failed and placed a new
    # replica with no backoff (1 starting after the sweep).
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)
    endpoint, replica = serving()
    fail_extra_replicas(endpoint, max_failures_since_ready())  # scale-ups back off an hour
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.STOPPED)  # scaled to zero
    scheduler.reconcile_endpoint(str(endpoint.pk), busy())  # a call's wake starts one
    Replica.objects.filter(endpoint=endpoint, state=ReplicaState.PENDING).update(
        created_at=timezone.now() - timedelta(seconds=settings.REPLICA_START_TIMEOUT_S + 60))  # it never comes up
    reconciled = []

    def a_worker_takes_it_at_once(name, **kwargs):
        if name == RECONCILE_TASK:
            reconciled.append(scheduler.reconcile_endpoint(*kwargs["args"], busy()))

    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", a_worker_takes_it_at_once)
    scheduler._sweep()
    assert reconciled and num_starting(endpoint) == 0
    endpoint.refresh_from_db()
    assert endpoint.num_failures_since_ready == 1 and endpoint.backing_off


def _record_replica_failure_of_the_release_before_0032(endpoint_id, reason):
    """33d666f5:endpoints/replicas.py:537-570 for a failure while a replica is READY (not stopped): it counts it in
    `num_failures_since_ready` (+1) and knows nothing of `num_scale_up_failures`."""
    endpoint = Endpoint.objects.get(pk=endpoint_id)
    signature = failure_signature(reason)
    repeats = endpoint.num_identical_failures + 1 if signature == endpoint.last_failure_reason else 1
    num_failures = endpoint.num_failures_since_ready + 1
    delay_s = min(settings.REPLICA_RETRY_BASE_S * 2 ** min(num_failures - 1, 20), 3600.0)
    Endpoint.objects.filter(pk=endpoint_id).update(
        num_identical_failures=repeats, num_failures_since_ready=num_failures, last_failure_reason=signature,
        unplaced_replicas=0, waiting_for_capacity=False, next_attempt_at=timezone.now() + timedelta(seconds=delay_s),
        status_message=f"replica failed ({reason}); retrying in {delay_s:.0f} s")


@override_settings(REPLICA_RETRY_BASE_S=30)
def test_a_start_from_zero_is_not_held_after_an_old_pod_counted_one_scale_up_failure():
    """Before: the old pod's +1 stood beside the READY replica, `scale_up_backing_off` read False, and the call was a
    503 `endpoint_backing_off` for the rest of the hour (a review of the release's rolling deploy)."""
    endpoint, replica = serving()
    _record_replica_failure_of_the_release_before_0032(endpoint.pk, "weights download failed: 503")  # rolling deploy
    for n in range(7):  # after the deploy, the new code's scale-ups keep failing: their backoff reaches an hour
        record_replica_failure(endpoint.pk, VARIED_REASONS[n % 3])
    endpoint.refresh_from_db()
    assert endpoint.num_failures_since_ready == 0 and endpoint.num_scale_up_failures == 7
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.STOPPED)  # idle: scaled to zero
    info = _endpoint_info(Endpoint.objects.select_related("organization__plan").get(pk=endpoint.pk))
    assert info.backing_off_until == 0, "a call gets 503 endpoint_backing_off for the rest of the hour"
    scheduler.reconcile_endpoint(str(endpoint.pk), busy())
    assert num_starting(endpoint) == 1


def test_the_serving_replicas_crash_after_identical_scale_ups_does_not_fail_it_after_an_old_pod_counted_one():
    """Before: the endpoint was set FAILED by the serving replica's first crash (identical reasons carried over)."""
    endpoint, replica = serving()
    _record_replica_failure_of_the_release_before_0032(endpoint.pk, "weights download failed: 503")  # rolling deploy
    for _ in range(settings.REPLICA_MAX_IDENTICAL_FAILURES - 1):  # OOM-killed scale-ups, serving all along
        record_replica_failure(endpoint.pk, "engine exited with code -9")
    Endpoint.objects.filter(pk=endpoint.pk).update(next_attempt_at=timezone.now() - timedelta(days=20))
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.FAILED)
    record_replica_failure(endpoint.pk, "engine exited with code -9")  # weeks later, the serving replica's first crash
    endpoint.refresh_from_db()
    assert endpoint.failed_at is None, endpoint.status_message


@pytest.mark.django_db(transaction=True)
def test_a_ready_committed_while_another_replicas_failure_is_being_counted_clears_that_count(monkeypatch):
    """A failure counted with no replica READY (read just before another's READY committed) is cleared by that READY.

    Before: `record_replica_ready` found no count to clear yet and took no lock, and the failure's count, written
    after, stood beside the READY replica: every rule reading "no failure since READY" went off for good."""
    endpoint, first = serving()
    second = Replica.objects.create(endpoint=endpoint, node=make_node(memory_mb=80_000), state=ReplicaState.STARTING)
    Replica.objects.filter(pk=first.pk).update(state=ReplicaState.FAILED)  # the one that served crashed
    counting, go, real_signature = threading.Event(), threading.Event(), replicas_module.failure_signature

    def failure_signature(reason):  # read after `serving`, inside the count's transaction
        counting.set()
        go.wait(10)
        return real_signature(reason)

    monkeypatch.setattr(replicas_module, "failure_signature", failure_signature)

    def count_the_crash():
        try:
            record_replica_failure(endpoint.pk, "engine exited with code 1")
        finally:
            connection.close()

    def second_ready():
        try:
            replicas_module.record_replica_ready(endpoint.pk)
        finally:
            connection.close()

    counter = threading.Thread(target=count_the_crash)
    counter.start()
    assert counting.wait(10)
    Replica.objects.filter(pk=second.pk).update(state=ReplicaState.READY)  # its heartbeat's READY commits
    ready = threading.Thread(target=second_ready)
    ready.start()
    ready.join(0.5)
    go.set()
    counter.join(10)
    ready.join(10)
    endpoint.refresh_from_db()
    assert (endpoint.num_failures_since_ready, endpoint.next_attempt_at) == (0, None)


ENGINE_ADDRESS = "http://127.0.0.1:20001"


@override_settings(REPLICA_RETRY_BASE_S=30)
def test_failed_scale_ups_keep_their_backoff_while_the_serving_engine_restarts_between_them():
    """A serving engine its agent restarts in place (READY, STARTING, READY) clears only "failures with none READY".
    Before: every READY cleared every count, so failed scale-ups between two restarts never backed off and never met
    the identical rule: replicas placed at every tick, for ever (a review's finding)."""
    endpoint, replica = serving()
    Replica.objects.filter(pk=replica.pk).update(address=ENGINE_ADDRESS)
    for round_ in range(settings.REPLICA_MAX_IDENTICAL_FAILURES - 1):
        record_replica_failure(endpoint.pk, "engine exited with code -9")  # a scale-up OOM-killed
        # the serving engine crashes and its agent restarts it (its own backoff, seconds): READY again
        apply_replica_report(replica.node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.STARTING,
                                                         num_restarts=round_ + 1, failure_reason="exit code -9"))
        apply_replica_report(replica.node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY,
                                                         address=ENGINE_ADDRESS, num_restarts=round_ + 1))
        endpoint.refresh_from_db()
        assert endpoint.num_scale_up_failures == round_ + 1 and endpoint.scale_up_backing_off
    scheduler.reconcile_endpoint(str(endpoint.pk), busy())
    assert num_starting(endpoint) == 0, "placed again at once though its scale-ups keep failing"
    record_replica_failure(endpoint.pk, "engine exited with code -9")  # the identical rule holds across restarts
    endpoint.refresh_from_db()
    assert endpoint.failed_at is not None


def test_a_ready_whose_clear_after_its_commit_was_lost_is_healed_by_the_next_ready_report(monkeypatch):
    """Before: a READY's clear, run after its commit, once lost (the pod killed, the database restarted) was never run
    again (later READY reports are no transition): "failures with none READY" stood beside a READY replica for good
    (a review's finding)."""
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=3, target_concurrency=8)
    node = make_node(memory_mb=80_000)
    make_node(memory_mb=80_000)
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING)
    for reason in ("weights download failed: 503", "engine exited with code 1", "CUDA error: out of memory"):
        record_replica_failure(endpoint.pk, reason)  # three starts from zero failed: backoff 120 s
    real = replicas_module.record_replica_ready

    def lost(endpoint_id, **kwargs):  # the READY committed; its second transaction never runs (pod killed while it waited, DB restart)
        raise OperationalError("terminating connection due to administrator command")

    monkeypatch.setattr(replicas_module, "record_replica_ready", lost)
    with pytest.raises(OperationalError):
        apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY, address=ENGINE_ADDRESS))
    monkeypatch.setattr(replicas_module, "record_replica_ready", real)
    for _ in range(3):  # the agent's next heartbeats: READY again, no transition, nothing clears
        apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY, address=ENGINE_ADDRESS))
    replica.refresh_from_db()
    endpoint.refresh_from_db()
    assert replica.state == ReplicaState.READY
    # what a READY replica means: "no failure since READY", and no back-off of a start from none
    assert (endpoint.num_failures_since_ready, endpoint.next_attempt_at) == (0, None)
