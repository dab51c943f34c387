"""vLLM sleep mode as a scale-to-zero level, on the control plane's side (real PostgreSQL and Redis):
the endpoint's `idle_action`, a replica that sleeps instead of draining, is billed as zero and holds no
placement capacity while asleep, wakes for a call (or is replaced when its GPU was given away), and stops
after a longer sleep. The agent's side is `tests/agent/test_sleep_mode.py`; a held call woken through the
gateway is `tests/gateway/test_wake_from_sleep.py`; the real engine on CUDA is `bench/gpu_check_sleep.py`.
"""

import time
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from billing import cost_truth
from endpoints import scheduler
from endpoints.autoscaler import Load
from endpoints.fleet.services import desired_replicas
from endpoints.models import EndpointEvent, EndpointState, Replica, ReplicaSleep
from endpoints.nodes.models import Node
from endpoints.replicas import apply_replica_report, place_replica
from gpu_agent.protocol import ReplicaAction, ReplicaState, ReplicaStatus
from tests.factories import EndpointFactory
from tests.test_gpu_placement import make_gpu_node
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db

VALID = {"name": "sleepy-chat", "model_source": "hf:meta-llama/Llama-3.1-8B-Instruct", "gpu_type": "l4"}


def idle() -> Load:
    return Load(0, 0, time.time() - 3600, 0)


def one_waiting() -> Load:
    return Load(0, 1, time.time(), 1)


@pytest.fixture
def sleep_mode(settings):
    settings.SLEEP_MODE = True
    settings.SLEEP_STOP_AFTER_S = 600
    return settings


def sleeping_endpoint(node_gpus=1, **spec):
    """An `idle_action: sleep` endpoint with one READY replica on a GPU node (per-GPU placement)."""
    node = make_gpu_node(node_gpus, memory_mb=24_000, gpu_type="l4")
    Node.objects.filter(pk=node.pk).update(memory_mb=64_000)  # host memory, as its agent registered it: room to sleep
    node.refresh_from_db()
    endpoint = EndpointFactory(gpu_type="l4", model_source="hf:org/model-1B", min_replicas=0, idle_timeout_s=60,
                               idle_action="sleep", **spec)
    replica, _ = place_replica(endpoint)
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.READY, ready_at=timezone.now(),
                                                 address=f"http://127.0.0.1:{node.engine_port_min}")
    replica.refresh_from_db()
    return endpoint, node, replica


def events(endpoint, kind=None):
    found = EndpointEvent.objects.filter(endpoint=endpoint)
    return list((found.filter(kind=kind) if kind else found).values_list("message", flat=True))


def test_sleep_is_refused_with_a_field_error_unless_the_platform_allows_it(owner_client, settings):
    settings.SLEEP_MODE = False
    refused = owner_client.post("/api/v1/endpoints/", VALID | {"idle_action": "sleep"}, format="json")
    assert refused.status_code == 400 and "INFERPLANE_SLEEP_MODE" in refused.json()["idle_action"][0]
    created = owner_client.post("/api/v1/endpoints/", VALID, format="json")
    assert created.status_code == 201 and created.json()["idle_action"] == "stop"
    settings.SLEEP_MODE = True
    changed = owner_client.patch(f"/api/v1/endpoints/{created.json()['id']}/", {"idle_action": "sleep"}, format="json")
    assert changed.status_code == 200 and changed.json()["idle_action"] == "sleep"
    assert owner_client.patch(f"/api/v1/endpoints/{created.json()['id']}/", {"idle_action": "nap"},
                              format="json").status_code == 400


def test_an_idle_replica_sleeps_keeps_its_process_frees_its_gpu_and_wakes_for_a_call(sleep_mode):
    endpoint, node, replica = sleeping_endpoint()
    (spec,) = desired_replicas(node)
    assert spec.sleep_mode and spec.action == ReplicaAction.RUN  # its engine starts able to sleep

    scheduler.reconcile_endpoint(str(endpoint.pk), idle())
    replica.refresh_from_db()
    assert replica.state == ReplicaState.SLEEPING
    (spec,) = desired_replicas(node)
    assert spec.action == ReplicaAction.SLEEP  # still desired: the agent keeps the process and calls /sleep
    assert ReplicaSleep.objects.get(replica=replica).ended_at is None
    assert any("sleeps: scale to zero" in message for message in events(endpoint, "scale"))
    assert endpoint.state == EndpointState.SLEEPING
    # Its agent says it sleeps: nothing changes; an agent still saying READY does not wake it either.
    for reported in (ReplicaState.READY, ReplicaState.SLEEPING):
        apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=reported))
        replica.refresh_from_db()
        assert replica.state == ReplicaState.SLEEPING

    # While it sleeps its GPU is placeable: another endpoint's replica may take it.
    other = EndpointFactory(gpu_type="l4", model_source="hf:org/model-1B")
    assert place_replica(other)[0] is not None
    Replica.objects.filter(endpoint=other).update(state=ReplicaState.STOPPED, stopped_at=timezone.now())

    # A call arrives: the wake (the gateway's wake task runs this reconcile) wakes the sleeper, places nothing.
    scheduler.reconcile_endpoint(str(endpoint.pk), one_waiting())
    assert list(Replica.objects.filter(endpoint=endpoint).values_list("state", flat=True)) == [ReplicaState.STARTING]
    replica.refresh_from_db()
    assert replica.woken_at is not None
    assert ReplicaSleep.objects.get(replica=replica).ended_at == replica.woken_at
    (spec,) = desired_replicas(node)
    assert spec.action == ReplicaAction.RUN  # desired state back to READY: the agent calls /wake_up
    apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.SLEEPING))  # not yet awake
    replica.refresh_from_db()
    assert replica.state == ReplicaState.STARTING
    apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY, address=replica.address))
    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY and replica.ready_at >= replica.woken_at
    woke = EndpointEvent.objects.get(endpoint=endpoint, kind="cold_start")
    assert woke.details["wake"] is True and "a wake, not a start" in woke.message


def test_a_sleeping_replica_is_billed_as_zero_gpu_seconds(sleep_mode):
    endpoint, node, replica = sleeping_endpoint()
    start = timezone.now() - timedelta(hours=1)
    # Placed an hour ago, asleep for the 30 minutes between 10 and 40 minutes in, now READY again.
    Replica.objects.filter(pk=replica.pk).update(created_at=start)
    ReplicaSleep.objects.create(replica=replica, started_at=start + timedelta(minutes=10),
                                ended_at=start + timedelta(minutes=40))
    today = timezone.now().date()
    used = sum(cost_truth._gpu_seconds_by_day(endpoint, *_days(start, today)).values())
    assert abs(used - 1800) < 5, used
    # Asleep now: the open sleep counts as zero until it ends.
    ReplicaSleep.objects.create(replica=replica, started_at=timezone.now() - timedelta(minutes=5))
    used = sum(cost_truth._gpu_seconds_by_day(endpoint, *_days(start, today)).values())
    assert abs(used - 1500) < 5, used


def _days(start, today):
    """From the start of `start`'s day to the end of `today` (UTC)."""
    return (datetime.combine(start.date(), datetime.min.time(), UTC),
            datetime.combine(today + timedelta(days=1), datetime.min.time(), UTC))


def test_a_cpu_replica_stops_instead_of_sleeping_with_the_reason_in_its_event_log(sleep_mode):
    make_node(gpu_type="cpu", memory_mb=16_000, quantizations=("none",))
    endpoint = EndpointFactory(gpu_type="cpu", model_source="hf:org/model-1B", idle_action="sleep")
    replica, _ = place_replica(endpoint)
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.READY)
    scheduler.reconcile_endpoint(str(endpoint.pk), idle())
    replica.refresh_from_db()
    assert replica.state == ReplicaState.DRAINING and not ReplicaSleep.objects.exists()
    assert any("stopped rather than asleep: CPU nodes never sleep" in m for m in events(endpoint, "scale"))


def test_with_the_platform_flag_off_a_sleep_endpoint_stops_its_replicas(settings):
    settings.SLEEP_MODE = False
    endpoint, node, replica = sleeping_endpoint()
    assert not desired_replicas(node)[0].sleep_mode
    scheduler.reconcile_endpoint(str(endpoint.pk), idle())
    replica.refresh_from_db()
    assert replica.state == ReplicaState.DRAINING
    assert any("sleep mode is off on this platform" in m for m in events(endpoint, "scale"))


def test_a_sleeper_whose_gpu_was_given_away_stops_and_a_new_replica_is_placed(sleep_mode):
    endpoint, node, replica = sleeping_endpoint(node_gpus=2)
    scheduler.reconcile_endpoint(str(endpoint.pk), idle())
    other = EndpointFactory(gpu_type="l4", model_source="hf:org/model-1B")
    taken, _ = place_replica(other)  # best fit: the sleeper's GPU, free while it sleeps
    replica.refresh_from_db()
    assert taken.gpu_indices == replica.gpu_indices

    scheduler.reconcile_endpoint(str(endpoint.pk), one_waiting())
    replica.refresh_from_db()
    assert replica.state == ReplicaState.STOPPED
    assert ReplicaSleep.objects.get(replica=replica).ended_at is not None
    (fresh,) = Replica.objects.filter(endpoint=endpoint, state=ReplicaState.PENDING)
    assert fresh.gpu_indices != replica.gpu_indices
    assert any("could not wake: its GPU" in m and "a new replica starts instead" in m for m in events(endpoint))


def test_a_replica_asleep_too_long_stops_for_real(sleep_mode):
    endpoint, node, replica = sleeping_endpoint()
    scheduler.reconcile_endpoint(str(endpoint.pk), idle())
    ids = [str(endpoint.pk)]
    assert scheduler.endpoints_to_reconcile(ids, {ids[0]: idle()}) == []  # asleep, nothing to do
    assert ids[0] in scheduler.active_endpoint_ids()  # still looked at each tick
    Replica.objects.filter(pk=replica.pk).update(state_changed_at=timezone.now() - timedelta(seconds=601))
    assert scheduler.endpoints_to_reconcile(ids, {ids[0]: idle()}) == ids
    scheduler.reconcile_endpoint(ids[0], idle())
    replica.refresh_from_db()
    assert replica.state == ReplicaState.DRAINING
    assert ReplicaSleep.objects.get(replica=replica).ended_at is not None
    assert any("INFERPLANE_SLEEP_STOP_AFTER_S" in m for m in events(endpoint, "scale"))


def test_a_woken_replica_is_not_failed_for_its_old_age_by_the_start_timeout(sleep_mode):
    endpoint, node, replica = sleeping_endpoint()
    scheduler.reconcile_endpoint(str(endpoint.pk), idle())
    Replica.objects.filter(pk=replica.pk).update(created_at=timezone.now() - timedelta(days=1))
    scheduler.reconcile_endpoint(str(endpoint.pk), one_waiting())
    scheduler.sweep_stuck()
    replica.refresh_from_db()
    assert replica.state == ReplicaState.STARTING



def test_an_engine_that_could_not_sleep_stops_with_its_agents_reason_and_is_billed_again(sleep_mode):
    endpoint, node, replica = sleeping_endpoint()
    scheduler.reconcile_endpoint(str(endpoint.pk), idle())
    why = "cannot sleep (its engine was started without sleep mode): stopped instead"
    apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.DRAINING, failure_reason=why))
    replica.refresh_from_db()
    assert replica.state == ReplicaState.DRAINING
    assert ReplicaSleep.objects.get(replica=replica).ended_at is not None
    event = EndpointEvent.objects.filter(endpoint=endpoint, kind="replica").latest("pk")
    assert "SLEEPING → DRAINING" in event.message and event.details["reason"] == why
