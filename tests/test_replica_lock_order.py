"""Lock order on an endpoint's row and its replicas' rows: a heartbeat's report of a replica, the start-timeout sweep
(`fail_replica_and_count`), a reconcile's scale-down and the silent-node sweep never deadlock.

Before: a heartbeat's report (`apply_replica_report`) took `SELECT ... FOR UPDATE` over replica JOIN endpoint, which
PostgreSQL locks row by row, the replica's first, while the sweep and a reconcile hold the endpoint's row and then
write the replica; and a plain `FOR UPDATE` on the endpoint blocked the `FOR KEY SHARE` an event's deferred foreign
key takes at commit. Each test saw `deadlock detected`: the heartbeat a 500, or the sweep's pass aborted (a silent node
not taken offline)."""
import threading
import time
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from controlplane import tasks as controlplane_tasks
from controlplane.accounts.services import Actor
from endpoints import autoscaler, scheduler, services
from endpoints import replicas as replicas_module
from endpoints.autoscaler import Load
from endpoints.models import Endpoint, Replica
from endpoints.replicas import apply_replica_report
from gpu_agent.protocol import ReplicaState, ReplicaStatus
from tests.factories import EndpointFactory
from tests.test_placement import make_node


def _race(holder, heartbeat):
    """`holder` calls `paused()` once it holds the endpoint's row: the heartbeat goes then."""
    go, errors = threading.Event(), {}

    def run(name, work):
        try:
            work()
        except Exception as exc:  # noqa: BLE001
            errors[name] = repr(exc)[:300]
        finally:
            connection.close()

    def late_heartbeat():
        go.wait(10)
        heartbeat()

    threads = [threading.Thread(target=run, args=("holder", holder)),
               threading.Thread(target=run, args=("heartbeat", late_heartbeat))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return go, errors


@pytest.mark.django_db(transaction=True)
def test_the_start_timeout_sweep_and_the_replicas_heartbeat_do_not_deadlock(monkeypatch):
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1, max_replicas=1)
    node = make_node(memory_mb=80_000)
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING)
    Replica.objects.filter(pk=replica.pk).update(
        created_at=timezone.now() - timedelta(seconds=settings.REPLICA_START_TIMEOUT_S + 60))
    real_fail_replica, state = replicas_module.fail_replica, {}

    def fail_replica(*args, **kwargs):  # runs with the endpoint's row locked (`fail_replica_and_count`)
        state["go"].set()
        time.sleep(0.5)  # the heartbeat's report arrives meanwhile
        return real_fail_replica(*args, **kwargs)

    monkeypatch.setattr(replicas_module, "fail_replica", fail_replica)
    go = threading.Event()
    state["go"] = go
    errors = {}

    def run(name, work):
        try:
            work()
        except Exception as exc:  # noqa: BLE001
            errors[name] = repr(exc)[:300]
        finally:
            connection.close()

    def heartbeat():
        go.wait(10)
        apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.STARTING,
                                                 progress="loading weights 99%"))

    threads = [threading.Thread(target=run, args=("sweep", scheduler._sweep)),
               threading.Thread(target=run, args=("heartbeat", heartbeat))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert go.is_set()
    assert errors == {}


@pytest.mark.django_db(transaction=True)
def test_a_reconciles_scale_down_and_the_replicas_heartbeat_do_not_deadlock(monkeypatch):
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=2)
    node = make_node(memory_mb=80_000)
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY,
                                     address="http://127.0.0.1:9", ready_at=timezone.now() - timedelta(hours=1))
    real_decide, go = autoscaler.decide, threading.Event()

    def decide(*args, **kwargs):  # runs with the endpoint's row locked (`reconcile_endpoint`)
        go.set()
        time.sleep(0.5)  # the heartbeat's report arrives meanwhile
        return real_decide(*args, **kwargs)

    monkeypatch.setattr(autoscaler, "decide", decide)
    errors = {}

    def run(name, work):
        try:
            work()
        except Exception as exc:  # noqa: BLE001
            errors[name] = repr(exc)[:300]
        finally:
            connection.close()

    def heartbeat():
        go.wait(10)
        apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY,
                                                 address="http://127.0.0.1:9", num_running=0))

    idle = Load(0, 0, timezone.now().timestamp() - 7200, 0)
    threads = [threading.Thread(target=run, args=("reconcile", lambda: scheduler.reconcile_endpoint(str(endpoint.pk), idle))),
               threading.Thread(target=run, args=("heartbeat", heartbeat))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert go.is_set()
    replica.refresh_from_db()
    print(replica.state, errors)
    assert errors == {}


@pytest.mark.django_db(transaction=True)
def test_a_reconciles_scale_down_and_the_sweep_taking_its_node_offline_do_not_deadlock(monkeypatch):
    # Preexisting, same root: the sweep's one transaction writes the replica, then its event's deferred foreign key
    # takes FOR KEY SHARE on the endpoint at commit, which the reconcile's FOR UPDATE blocks.
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=2)
    node = make_node(memory_mb=80_000)
    make_node(memory_mb=80_000)  # the fleet is not silent as a whole
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY,
                                     address="http://127.0.0.1:9", ready_at=timezone.now() - timedelta(hours=1))
    from endpoints.nodes.models import Node
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    real_decide, go = autoscaler.decide, threading.Event()

    def decide(*args, **kwargs):
        go.set()
        time.sleep(0.5)
        return real_decide(*args, **kwargs)

    monkeypatch.setattr(autoscaler, "decide", decide)
    errors = {}

    def run(name, work):
        try:
            work()
        except Exception as exc:  # noqa: BLE001
            errors[name] = repr(exc)[:300]
        finally:
            connection.close()

    def sweep():
        go.wait(10)
        scheduler._sweep()

    idle = Load(0, 0, timezone.now().timestamp() - 7200, 0)
    threads = [threading.Thread(target=run, args=("reconcile", lambda: scheduler.reconcile_endpoint(str(endpoint.pk), idle))),
               threading.Thread(target=run, args=("sweep", sweep))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert go.is_set()
    replica.refresh_from_db()
    print(replica.state, errors)
    assert errors == {}


@pytest.mark.django_db(transaction=True)
def test_an_engine_restarting_edit_and_a_heartbeat_reporting_a_restart_do_not_deadlock(monkeypatch):
    """Before: the edit (`services.update_endpoint`, a plain FOR UPDATE on the endpoint, then `drain_replicas`) was the
    deadlock's victim: a 500 to the user fixing a crash-looping engine, and the change not saved."""
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=2)
    node = make_node(memory_mb=80_000)
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY,
                                     address="http://127.0.0.1:20001", ready_at=timezone.now())
    real_record_event, go = replicas_module.record_event, threading.Event()

    def record_event(*args, **kwargs):  # the heartbeat's restart event: the replica's row is locked
        real_record_event(*args, **kwargs)
        go.set()
        time.sleep(1.0)  # the user's edit is saved meanwhile

    monkeypatch.setattr(replicas_module, "record_event", record_event)
    errors = {}

    def run(name, work):
        try:
            work()
        except Exception as exc:  # noqa: BLE001
            errors[name] = repr(exc)[:300]
        finally:
            connection.close()

    def heartbeat():
        apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY,
                                                 address="http://127.0.0.1:20001", num_restarts=1,
                                                 failure_reason="CUDA error: out of memory"))

    def edit():
        go.wait(10)
        services.update_endpoint(Actor(), Endpoint.objects.get(pk=endpoint.pk), max_num_seqs=32)

    threads = [threading.Thread(target=run, args=("heartbeat", heartbeat)),
               threading.Thread(target=run, args=("edit", edit))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert go.is_set()
    assert errors == {}


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_reported_failure_is_counted_before_any_reconcile_can_replace_it(monkeypatch):
    """Before: the report committed the replica FAILED and counted its failure only afterwards
    (`_announce_transition`): a worker's reconcile in between (the periodic pass, a waiting call's request) saw no
    replica and no backoff and placed a replacement at once (placed 1, `next_attempt_at` None). A review's finding."""
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1, max_replicas=1)
    node = make_node(memory_mb=80_000)
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING)
    real_record_event, seen = replicas_module.record_event, {}

    def a_workers_reconcile():  # its own connection, as a worker's
        try:
            scheduler.reconcile_endpoint(str(endpoint.pk), Load(0, 0, timezone.now().timestamp(), 0))
            seen["placed"] = Replica.objects.filter(endpoint=endpoint).exclude(pk=replica.pk).count()
        finally:
            connection.close()

    def record_event(endpoint_, kind, message, **kwargs):
        real_record_event(endpoint_, kind, message, **kwargs)
        if "failed:" in message and "placed" not in seen:  # the report's FAILED event: the replica written FAILED
            worker = threading.Thread(target=a_workers_reconcile)
            worker.start()
            worker.join(10)

    monkeypatch.setattr(replicas_module, "record_event", record_event)
    apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.FAILED,
                                             failure_reason="RuntimeError: CUDA error: out of memory"))
    endpoint.refresh_from_db()
    assert endpoint.next_attempt_at is not None and endpoint.num_failures_since_ready == 1
    assert seen == {"placed": 0}
    assert Replica.objects.filter(endpoint=endpoint).exclude(pk=replica.pk).count() == 0


@pytest.mark.parametrize("first", ["heartbeat", "reconcile", "edit"])
@pytest.mark.django_db(transaction=True)
def test_a_failed_report_a_reconcile_and_an_engine_restarting_edit_do_not_deadlock(monkeypatch, first):
    """A report that fails its replica locks its endpoint's row (FOR NO KEY UPDATE), then its replica's, and counts the
    failure in that transaction: whichever of the three holds the endpoint's row first, the others wait or skip it."""
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1, max_replicas=2)
    node = make_node(memory_mb=80_000)
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY,
                                     address="http://127.0.0.1:20001", ready_at=timezone.now())
    go = threading.Event()

    def pausing(real, who):
        def paused(*args, **kwargs):
            result = real(*args, **kwargs)
            if who == first and not go.is_set():  # it holds the endpoint's row (and, the heartbeat, its replica's)
                go.set()
                time.sleep(0.5)  # the other two arrive meanwhile
            return result
        return paused

    monkeypatch.setattr(replicas_module, "record_event", pausing(replicas_module.record_event, "heartbeat"))
    monkeypatch.setattr(autoscaler, "decide", pausing(autoscaler.decide, "reconcile"))
    monkeypatch.setattr(services, "drain_replicas", pausing(services.drain_replicas, "edit"))
    errors = {}

    def run(name, work):
        try:
            if name != first:
                go.wait(10)
            work()
        except Exception as exc:  # noqa: BLE001
            errors[name] = repr(exc)[:300]
        finally:
            connection.close()

    work = {
        "heartbeat": lambda: apply_replica_report(node, ReplicaStatus(
            replica_id=str(replica.pk), state=ReplicaState.FAILED, address="http://127.0.0.1:20001",
            failure_reason="RuntimeError: CUDA error: out of memory")),
        "reconcile": lambda: scheduler.reconcile_endpoint(str(endpoint.pk), Load(0, 8, timezone.now().timestamp(), 8)),
        "edit": lambda: services.update_endpoint(Actor(), Endpoint.objects.get(pk=endpoint.pk), max_num_seqs=32),
    }
    threads = [threading.Thread(target=run, args=(name, work[name])) for name in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert go.is_set()
    assert not any(thread.is_alive() for thread in threads)
    assert errors == {}
    replica.refresh_from_db()
    assert replica.state == ReplicaState.FAILED
