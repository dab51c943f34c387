"""Sleeping replicas hold their weights in their node's host memory (vLLM's level-1 sleep): a replica sleeps only while
its node's sleepers, it with them, fit in their share of the node's memory (`placement.room_to_sleep`); past it, it
stops instead, saying why. Before, nothing counted it: sleepers of many endpoints on one node (GPU sharing, successive
sleeps) added up past the agent container's limit, and the kubelet killed the container, every tenant's engine of the
node with it."""
import functools
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from endpoints import replicas as replicas_module
from endpoints import scheduler
from endpoints.models import Endpoint, EndpointEvent, ModelFacts, Replica, ReplicaSleep
from endpoints.nodes.models import Node
from endpoints.placement import reported_weights_size_mb, reported_weights_sizes_mb
from endpoints.replicas import drain_replica, place_replica, sleep_replica
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory
from tests.processes import wait_until
from tests.test_gpu_placement import make_gpu_node
from tests.test_placement import make_node
from tests.test_replica_lock_order import _no_task_messages, _num_waiting_on_locks, _paused, _together  # noqa: F401
from tests.test_sleep_mode import idle, one_waiting

GIB_MB = 1024
FULL = "stopped rather than asleep: its node's host memory for sleeping replicas is full"


@pytest.fixture
def sleep_mode(settings):
    settings.SLEEP_MODE = True
    settings.SLEEP_STOP_AFTER_S = 600
    return settings


def gpu_node(num_gpus=4, host_memory_mb=70_000):
    """A node of `num_gpus` H100s whose agent registered `host_memory_mb` of memory (sleepers may hold half)."""
    node = make_gpu_node(num_gpus)
    Node.objects.filter(pk=node.pk).update(memory_mb=host_memory_mb)
    node.refresh_from_db()
    return node


def ready_replica(node, *, engine_weights_mb=None, model="hf:org/model-1B"):
    """A READY replica of a new `idle_action: sleep` endpoint on `node`, its engine's weights as it reported them."""
    endpoint = EndpointFactory(gpu_type="h100-80gb", model_source=model, min_replicas=0, idle_timeout_s=60,
                               idle_action="sleep")
    replica, _ = place_replica(endpoint)
    assert replica.node_id == node.pk
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.READY, ready_at=timezone.now(),
                                                 engine_weights_mb=engine_weights_mb)
    replica.refresh_from_db()
    return replica


def state_of(replica):
    replica.refresh_from_db()
    return replica.state


def scale_events(replica):
    return list(EndpointEvent.objects.filter(endpoint=replica.endpoint_id, kind="scale").values_list("message", flat=True))


@pytest.mark.django_db
def test_a_replica_stops_rather_than_sleeps_once_its_nodes_sleepers_would_pass_their_share_of_host_memory(sleep_mode):
    node = gpu_node(num_gpus=4, host_memory_mb=70_000)  # sleepers may hold 35,000 MB
    replicas = [ready_replica(node, engine_weights_mb=10 * GIB_MB) for _ in range(4)]
    for replica in replicas:
        scheduler.reconcile_endpoint(str(replica.endpoint_id), idle())

    assert [state_of(replica) for replica in replicas] == [ReplicaState.SLEEPING] * 3 + [ReplicaState.DRAINING]
    assert any(FULL in message for message in scale_events(replicas[3]))
    assert not ReplicaSleep.objects.filter(replica=replicas[3]).exists()
    # The sleepers' own endpoints read that they sleep; nothing names another tenant's figures.
    assert any("sleeps: scale to zero" in message for message in scale_events(replicas[0]))
    assert not any("MB" in message for message in scale_events(replicas[3]))

    # Once a sleeper has stopped for real, another replica may sleep in its room.
    Replica.objects.filter(pk=replicas[0].pk).update(state=ReplicaState.STOPPED, stopped_at=timezone.now())
    fifth = ready_replica(node, engine_weights_mb=10 * GIB_MB)
    scheduler.reconcile_endpoint(str(fifth.endpoint_id), idle())
    assert state_of(fifth) == ReplicaState.SLEEPING


@pytest.mark.django_db
def test_an_engine_log_claiming_tiny_weights_counts_as_the_checkpoint_the_node_measured(sleep_mode):
    node = gpu_node(num_gpus=2, host_memory_mb=70_000)
    big = "hf:org/big-model"  # 30 GB of files as a node measured them; the engine's log (a tenant's text) says 1 MB
    ModelFacts.objects.create(source=big, scope="", weights_bytes=30 * 1024**3)
    liar = ready_replica(node, engine_weights_mb=1, model=big)
    other = ready_replica(node, engine_weights_mb=10 * GIB_MB)

    assert sleep_replica(liar, reason="scale to zero") and state_of(liar) == ReplicaState.SLEEPING
    assert sleep_replica(other, reason="scale to zero") and state_of(other) == ReplicaState.DRAINING
    assert any(FULL in message for message in scale_events(other))


@pytest.mark.django_db
def test_a_sleeper_told_to_drain_holds_its_host_memory_until_it_stops(sleep_mode):
    node = gpu_node(num_gpus=2, host_memory_mb=50_000)  # room for one sleeper of 20 GB
    first = ready_replica(node, engine_weights_mb=20 * GIB_MB)
    second = ready_replica(node, engine_weights_mb=20 * GIB_MB)
    assert sleep_replica(first, reason="scale to zero") and state_of(first) == ReplicaState.SLEEPING
    drain_replica(first, reason="asleep for 600 s")  # its engine, asleep, keeps the weights until its agent stops it

    sleep_replica(second, reason="scale to zero")
    assert state_of(second) == ReplicaState.DRAINING
    assert any(FULL in message for message in scale_events(second))


@pytest.mark.django_db
def test_a_node_registered_with_its_hosts_memory_whose_heartbeat_says_its_containers_limit_counts_the_limit(sleep_mode):
    node = gpu_node(num_gpus=2, host_memory_mb=2_000_000)  # registered by an agent that read the host's 2 TB
    Node.objects.filter(pk=node.pk).update(last_status={"memory_mb": 50_000})  # upgraded: its pod's limit
    first = ready_replica(node, engine_weights_mb=20 * GIB_MB)
    second = ready_replica(node, engine_weights_mb=20 * GIB_MB)
    assert sleep_replica(first, reason="scale to zero") and state_of(first) == ReplicaState.SLEEPING
    sleep_replica(second, reason="scale to zero")
    assert state_of(second) == ReplicaState.DRAINING
    assert any(FULL in message for message in scale_events(second))


@pytest.mark.django_db
def test_a_node_that_did_not_report_its_memory_has_no_sleepers(sleep_mode):
    node = gpu_node(num_gpus=1, host_memory_mb=0)
    replica = ready_replica(node, engine_weights_mb=GIB_MB)
    sleep_replica(replica, reason="scale to zero")
    assert state_of(replica) == ReplicaState.DRAINING
    assert any("stopped rather than asleep: its node did not report its memory" in m for m in scale_events(replica))


@pytest.mark.django_db(transaction=True)
def test_two_replicas_falling_asleep_at_once_on_one_node_cannot_both_take_its_last_room(sleep_mode, monkeypatch):
    node = gpu_node(num_gpus=2, host_memory_mb=50_000)  # room for one sleeper of 20 GB
    first = ready_replica(node, engine_weights_mb=20 * GIB_MB)
    second = ready_replica(node, engine_weights_mb=20 * GIB_MB)
    go = threading.Event()
    # The first pauses once its room is counted, before its replica is marked asleep.
    monkeypatch.setattr(replicas_module, "room_to_sleep", _paused(replicas_module.room_to_sleep, go, before=False))

    errors = _together({
        "first": lambda: sleep_replica(first, reason="scale to zero"),
        "second": lambda: sleep_replica(second, reason="scale to zero"),
    }, first="first", go=go)

    assert errors == {}
    assert sorted([state_of(first), state_of(second)]) == [ReplicaState.DRAINING, ReplicaState.SLEEPING]



def _two_nodes_in_lock_order() -> list[Node]:
    """Two 2-GPU nodes with host memory to sleep in, in the order their row locks are taken (the primary key's)."""
    return sorted((gpu_node(num_gpus=2, host_memory_mb=200_000) for _ in range(2)), key=lambda node: node.pk)


def _sleeping_when_idle() -> Endpoint:
    return EndpointFactory(gpu_type="h100-80gb", min_replicas=0, idle_timeout_s=60, idle_action="sleep")


def _first_pauses_in(monkeypatch, step: str) -> threading.Event:
    """The first call of `replicas.<step>` sets the event it returns once it has run, then pauses 1.5 s, locks held."""
    go = threading.Event()
    monkeypatch.setattr(replicas_module, step, _paused(getattr(replicas_module, step), go, before=False, seconds=1.5))
    return go


def _ready_on(endpoint, node, *, age_s: int, gpu: int = 0) -> Replica:
    """A READY replica of `endpoint` on GPU `gpu` of `node`, created `age_s` ago (a scale-down lets the newest go
    first)."""
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY, gpu_indices=[gpu],
                                     reserved_memory_mb=GIB_MB, engine_weights_mb=GIB_MB, ready_at=timezone.now())
    Replica.objects.filter(pk=replica.pk).update(created_at=timezone.now() - timedelta(seconds=age_s))
    return replica


@pytest.mark.django_db(transaction=True)
def test_two_endpoints_scaling_down_onto_sleep_on_the_same_two_nodes_in_opposite_orders_do_not_deadlock(
        sleep_mode, monkeypatch):
    """Each sleep takes its node's row lock, held until the reconcile commits: one endpoint letting go a replica on
    node B then one on node A, another one on A then one on B, each waited for the other's node (a deadlock: one
    reconcile rolled back, its replicas left serving; a tick's pass raised). Nodes are locked in one order, the
    primary key's, as placement takes them."""
    first_node, second_node = _two_nodes_in_lock_order()
    one = _sleeping_when_idle()
    other = _sleeping_when_idle()
    ones = [_ready_on(one, first_node, age_s=600), _ready_on(one, second_node, age_s=60)]  # second_node's first
    others = [_ready_on(other, second_node, age_s=600), _ready_on(other, first_node, age_s=60)]  # first_node's first
    # The first reconcile pauses holding its first node, once its room there is counted.
    go = _first_pauses_in(monkeypatch, "room_to_sleep")

    errors = _together({
        "one": lambda: scheduler.reconcile_endpoint(str(one.pk), idle()),
        "other": lambda: scheduler.reconcile_endpoint(str(other.pk), idle()),
    }, first="one", go=go)

    assert errors == {}
    assert [state_of(replica) for replica in ones + others] == [ReplicaState.SLEEPING] * 4


@pytest.mark.django_db(transaction=True)
def test_a_scale_down_onto_sleep_and_another_endpoints_placement_on_the_same_nodes_do_not_deadlock(
        sleep_mode, monkeypatch):
    """Placement locks a GPU type's READY nodes in their primary key's order; a scale-down letting go a replica on the
    later node, then one on the earlier, waited for the earlier while the placement held it and waited for the later."""
    first_node, second_node = _two_nodes_in_lock_order()
    sleepy = _sleeping_when_idle()
    let_go = [_ready_on(sleepy, first_node, age_s=600), _ready_on(sleepy, second_node, age_s=60)]  # second_node's first
    placing = EndpointFactory(gpu_type="h100-80gb", model_source="hf:org/model-1B", min_replicas=1)
    go = _first_pauses_in(monkeypatch, "room_to_sleep")

    errors = _together({
        "scale-down": lambda: scheduler.reconcile_endpoint(str(sleepy.pk), idle()),
        "placement": lambda: scheduler.reconcile_endpoint(str(placing.pk), one_waiting()),
    }, first="scale-down", go=go)

    assert errors == {}
    assert [state_of(replica) for replica in let_go] == [ReplicaState.SLEEPING] * 2
    assert Replica.objects.filter(endpoint=placing).count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_wake_that_fails_on_one_node_then_wakes_on_another_and_a_scale_down_onto_sleep_do_not_deadlock(
        sleep_mode, monkeypatch):
    """A scale-up wakes its sleepers newest first, each under its node's row lock, held until the reconcile commits: one
    that cannot wake on the later node (its GPU given away meanwhile), then one on the earlier, waited for the earlier
    while a scale-down onto sleep (or a placement) held it and waited for the later."""
    first_node, second_node = _two_nodes_in_lock_order()
    sleepy = _sleeping_when_idle()
    let_go = [_ready_on(sleepy, first_node, age_s=60), _ready_on(sleepy, second_node, age_s=600)]  # the earlier's first
    waking = _sleeping_when_idle()
    filler = EndpointFactory(gpu_type="h100-80gb", min_replicas=1)
    Replica.objects.create(endpoint=filler, node=second_node, state=ReplicaState.READY, gpu_indices=[1],
                           reserved_memory_mb=70_000)  # the later node's GPU, given away while its sleeper slept
    older, newer = (_ready_on(waking, node, age_s=600, gpu=1) for node in (first_node, second_node))
    for replica, asleep_s in ((older, 300), (newer, 100)):
        Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.SLEEPING,
                                                     state_changed_at=timezone.now() - timedelta(seconds=asleep_s))
    # The scale-up pauses once the newer sleeper's room is counted (none), holding the later node.
    go = _first_pauses_in(monkeypatch, "room_to_wake")

    errors = _together({
        "wake": lambda: scheduler.reconcile_endpoint(str(waking.pk), one_waiting()),
        "scale-down": lambda: scheduler.reconcile_endpoint(str(sleepy.pk), idle()),
    }, first="wake", go=go)

    assert errors == {}
    assert [state_of(replica) for replica in let_go] == [ReplicaState.SLEEPING] * 2
    assert (state_of(newer), state_of(older)) == (ReplicaState.STOPPED, ReplicaState.STARTING)


def _asleep_on(endpoint, node) -> Replica:
    """A replica of `endpoint` asleep on GPU 0 of `node` these five minutes."""
    replica = _ready_on(endpoint, node, age_s=600)
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.SLEEPING,
                                                 state_changed_at=timezone.now() - timedelta(seconds=300))
    return replica


@pytest.mark.django_db(transaction=True)
def test_endpoints_waking_on_distinct_nodes_of_one_gpu_type_wake_together_not_one_after_another(
        sleep_mode, monkeypatch):
    """A scale-up that wakes a sleeper locked every READY node of its GPU type (placement's lock, should a wake fail)
    until it committed: three tenants' endpoints waking at once, each on a node of its own, woke one after another, each
    waiting for the one before (a Monday morning's first calls). One whose sleepers all wake locks their nodes alone."""
    nodes = _two_nodes_in_lock_order() + _two_nodes_in_lock_order()[:1]
    waking = [_sleeping_when_idle() for _ in nodes]  # each of an organisation of its own
    sleepers = [_asleep_on(endpoint, node) for endpoint, node in zip(waking, nodes, strict=True)]
    # The first scale-up pauses 1.5 s once its sleeper's room is counted, its locks held.
    go = _first_pauses_in(monkeypatch, "room_to_wake")
    done_at = {}

    def wake(endpoint):
        scheduler.reconcile_endpoint(str(endpoint.pk), one_waiting())
        done_at[endpoint.pk] = time.monotonic()

    errors = _together({f"wake {i}": functools.partial(wake, endpoint) for i, endpoint in enumerate(waking)},
                       first="wake 0", go=go)

    assert errors == {}
    assert [state_of(replica) for replica in sleepers] == [ReplicaState.STARTING] * 3
    # the two others woke while the first still held its locks
    assert max(done_at[endpoint.pk] for endpoint in waking[1:]) < done_at[waking[0].pk]


@pytest.mark.django_db(transaction=True)
def test_a_scale_down_whose_replica_stops_rather_than_sleeps_does_not_wait_for_its_nodes_lock(sleep_mode):
    """With sleep mode on, a scale-down locked the nodes of every READY replica it let go, also one that stops rather
    than sleeps (a CPU node's, an agent older than sleep mode): it waited behind whatever held the node (a placement,
    a heartbeat), its endpoint's row held meanwhile, for nothing it counts there."""
    node = make_node(gpu_type="cpu", memory_mb=16_000, quantizations=("none",))
    endpoint = EndpointFactory(gpu_type="cpu", model_source="hf:org/model-1B", min_replicas=0, idle_timeout_s=60,
                               idle_action="sleep")
    let_go = _ready_on(endpoint, node, age_s=600)
    go = threading.Event()
    done_at = {}

    def hold_the_node():  # another write holding the node's row 1.5 s
        with transaction.atomic():
            Node.objects.select_for_update().filter(pk=node.pk).first()
            go.set()
            time.sleep(1.5)
        done_at["hold"] = time.monotonic()

    def scale_down():
        scheduler.reconcile_endpoint(str(endpoint.pk), idle())
        done_at["scale-down"] = time.monotonic()

    errors = _together({"hold": hold_the_node, "scale-down": scale_down}, first="hold", go=go)

    assert errors == {}
    assert state_of(let_go) == ReplicaState.DRAINING
    assert any("stopped rather than asleep: CPU nodes never sleep" in m for m in scale_events(let_go))
    assert done_at["scale-down"] < done_at["hold"]  # drained while the node's row was held


@pytest.mark.django_db
def test_the_room_a_sleep_counts_under_its_nodes_lock_takes_the_same_queries_however_many_sleepers_the_node_has(
        sleep_mode):
    """Each sleeper's checkpoint size was read apart, twice: 2 queries a sleeper under the node's row lock, which its
    heartbeat waits for."""
    node = gpu_node(num_gpus=2, host_memory_mb=2_000_000)

    def queries_with(num_sleepers: int) -> int:
        Replica.objects.filter(node=node).delete()
        source = "hf:org/popular-model"  # many tenants' copies of one model
        ModelFacts.objects.get_or_create(source=source, scope="", defaults={"weights_bytes": 1024**3})
        for _ in range(num_sleepers):
            sleeper = _ready_on(EndpointFactory(gpu_type="h100-80gb", model_source=source), node, age_s=60)
            Replica.objects.filter(pk=sleeper.pk).update(state=ReplicaState.SLEEPING)
        replica = _ready_on(EndpointFactory(gpu_type="h100-80gb", idle_action="sleep"), node, age_s=60)
        replica = Replica.objects.select_related("endpoint").get(pk=replica.pk)
        with CaptureQueriesContext(connection) as queries:
            assert replicas_module._room_to_sleep_here(node, replica) == ""
        return len(queries)

    assert queries_with(2) == queries_with(12) <= 4


@pytest.mark.django_db
def test_the_sizes_read_together_are_those_read_one_by_one():
    shared, own, none = "hf:org/shared-model", "hf:org/own-model", "hf:org/unmeasured-model"
    endpoints = [EndpointFactory(model_source=source) for source in (shared, own, own, none)]
    ModelFacts.objects.create(source=shared, scope="", weights_bytes=3 * 1024**3)
    ModelFacts.objects.create(source=own, scope="", weights_bytes=5 * 1024**3)
    ModelFacts.objects.create(source=own, scope=endpoints[1].weights_scope, weights_bytes=7 * 1024**3)  # its own copy
    sizes = reported_weights_sizes_mb(endpoints)
    assert [sizes[endpoint.pk] for endpoint in endpoints] == [reported_weights_size_mb(e) for e in endpoints] == [
        3 * 1024, 7 * 1024, 5 * 1024, None]


@pytest.mark.django_db
def test_the_room_a_sleep_counts_takes_the_same_queries_however_many_models_the_nodes_sleepers_run(sleep_mode):
    """Each distinct model source read the catalogue apart (`is_catalogue_source`, a query each): a node whose sleepers
    run 12 tenants' own models took 12 queries more under its row lock, which its heartbeat waits for, than one whose
    sleepers run one model (a review's finding: the test above gives every sleeper one source)."""
    node = gpu_node(num_gpus=2, host_memory_mb=2_000_000)

    def queries_with(num_sleepers: int) -> int:
        Replica.objects.filter(node=node).delete()
        for number in range(num_sleepers):
            source = f"hf:tenant-{num_sleepers}-{number}/own-model"  # each tenant's own model
            sleeper = _ready_on(EndpointFactory(gpu_type="h100-80gb", model_source=source), node, age_s=60)
            ModelFacts.objects.get_or_create(source=source, scope=sleeper.endpoint.weights_scope,
                                             defaults={"weights_bytes": 1024**3})
            Replica.objects.filter(pk=sleeper.pk).update(state=ReplicaState.SLEEPING)
        replica = _ready_on(EndpointFactory(gpu_type="h100-80gb", idle_action="sleep"), node, age_s=60)
        replica = Replica.objects.select_related("endpoint").get(pk=replica.pk)
        with CaptureQueriesContext(connection) as queries:
            assert replicas_module._room_to_sleep_here(node, replica) == ""
        return len(queries)

    assert queries_with(2) == queries_with(12) <= 4


@pytest.mark.django_db(transaction=True)
def test_a_scale_down_whose_nodes_agent_is_upgraded_while_it_waits_for_its_locks_does_not_deadlock_with_a_placement(
        sleep_mode):
    """A scale-down judged which of the replicas it lets go may sleep (their nodes' agents as they last said) to lock
    those nodes alone, waited for the locks, then judged each again as it put it to sleep: a node whose agent was
    upgraded meanwhile was locked then, on its own, out of the primary key's order. A placement holding that node and
    waiting for one the scale-down held deadlocked with it (PostgreSQL rolled one back). Each replica is judged once."""
    low, high = _two_nodes_in_lock_order()
    endpoint = _sleeping_when_idle()
    on_high, on_low = _ready_on(endpoint, high, age_s=600), _ready_on(endpoint, low, age_s=600)
    Node.objects.filter(pk=low.pk).update(last_status={"replica_actions": ["RUN", "DRAIN"]})  # older than sleep mode
    go = threading.Event()

    def hold_high():  # another write holding the node the scale-down locks first (a heartbeat)
        with transaction.atomic():
            Node.objects.select_for_update().filter(pk=high.pk).first()
            go.set()
            wait_until(lambda: _num_waiting_on_locks() >= 2, 10, message="the scale-down and the placement to wait")

    def scale_down():
        let_go = list(Replica.objects.filter(pk__in=[on_high.pk, on_low.pk]).select_related("endpoint")
                      .order_by("-node_id"))  # the high node's replica first
        replicas_module.sleep_replicas(let_go, reason="scale to zero")

    def upgrade_then_place():  # the low node's agent upgraded (its heartbeat), then a placement of another endpoint
        wait_until(lambda: _num_waiting_on_locks() >= 1, 10, message="the scale-down to wait")  # it has judged
        Node.objects.filter(pk=low.pk).update(last_status={"replica_actions": ["RUN", "DRAIN", "SLEEP"]})
        place_replica(_sleeping_when_idle())  # locks the low node, then waits for the high one

    errors = _together({"hold": hold_high, "scale-down": scale_down, "placement": upgrade_then_place},
                       first="hold", go=go)

    assert errors == {}
    assert (state_of(on_high), state_of(on_low)) == (ReplicaState.SLEEPING, ReplicaState.DRAINING)
    assert any("stopped rather than asleep: its node's agent is older than sleep mode" in m for m in scale_events(on_low))
