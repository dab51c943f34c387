"""The pool tick's rules (`endpoints.fleet.pools`) against a real database and Redis.

The provider here is a small in-test object implementing the `Provider` protocol that records what
it was asked: the policy's decisions are what is under test; the real `local` provider runs in
`test_pools_end_to_end.py`.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from django.db import connection, transaction
from django.utils import timezone

from controlplane import local_agents, tokens
from controlplane.accounts.models import AuditEvent, Plan
from controlplane.accounts.services import SYSTEM, save_plan, set_organization_plan
from controlplane.demo import host_engine_memory_mb, seed_local_pool
from endpoints.fleet import launches, pool_release, pools, services
from endpoints.fleet.pool_demand import PROVISIONING_MESSAGE
from endpoints.fleet.providers import get_provider, kubernetes
from endpoints.fleet.providers.base import LaunchResult, Machine, ProviderError, ProviderUnreachable
from endpoints.fleet.services import create_join_token
from endpoints.gateway import directory
from endpoints.models import EndpointEvent, EventKind, Replica
from endpoints.nodes.models import JoinToken, LaunchState, Node, NodeLaunch, NodePool
from endpoints.replicas import fail_replica, record_replica_failure
from endpoints.scheduler import reconcile_endpoint
from gpu_agent.protocol import NodeState, RegisterRequest, ReplicaState
from tests.factories import EndpointFactory
from tests.fleet.test_provider_kubernetes import _agent_pod, api_server  # noqa: F401 - the fixture
from tests.test_agent_api import beat

TINY = "hf:tiny/tiny-llama"  # no size in its name: placement assumes a small model (about 2.8 GB on CPU)


class RecordingProvider:
    """Machines in a dict; every call recorded. `fail_with` makes launches refused; `crash` raises mid-call."""

    name = "local"

    def __init__(self, zones=("",), *, delay_s: float = 0.0):
        self._zones = list(zones)
        self.machines: dict[str, Machine] = {}
        self.launched: list[tuple[str, str]] = []  # (launch id, zone) per call
        self.terminated: list[str] = []
        self.fail_with = ""
        self.crash = False
        self.answer_lost = False
        self.delay_s = delay_s
        self.lock = threading.Lock()

    def template_errors(self, template):
        return {}

    def zones(self, template):
        time.sleep(self.delay_s)  # called while the pool's row is locked (the launch's zone)
        return self._zones

    def launch(self, pool, specs):
        if self.crash:
            raise RuntimeError("the worker died here")
        results = []
        with self.lock:
            for spec in specs:
                self.launched.append((spec.launch_id, spec.zone))
                if self.answer_lost:  # the machine starts; its answer never comes back
                    self.machines.setdefault(spec.launch_id, Machine(f"m-{spec.launch_id[:8]}", spec.launch_id, "running", spec.name))
                    raise ProviderUnreachable("EC2 is unreachable: Read timeout on endpoint URL")
                if self.fail_with:
                    results.append(LaunchResult(spec.launch_id, error=self.fail_with))
                    continue
                self.machines.setdefault(spec.launch_id, Machine(f"m-{spec.launch_id[:8]}", spec.launch_id, "running", spec.name))
                results.append(LaunchResult(spec.launch_id, provider_id=self.machines[spec.launch_id].provider_id, zone=spec.zone))
        return results

    def terminate(self, pool, provider_id):
        self.terminated.append(provider_id)
        self.machines = {key: m for key, m in self.machines.items() if m.provider_id != provider_id}

    def list(self, pool):
        return list(self.machines.values())


def make_pool(**fields) -> NodePool:
    values = dict(name="cpu-pool", gpu_type="cpu", provider="local", gpus_per_node=0, gpu_memory_mb=8192,
                  min_nodes=0, max_nodes=3, warm_nodes=0, idle_timeout_s=60, join_deadline_s=120) | fields
    return NodePool.objects.create(**values)


def waiting_endpoint(**fields):
    endpoint = EndpointFactory(gpu_type="cpu", model_source=TINY, quantization="none", min_replicas=1, **fields)
    reconcile_endpoint(str(endpoint.pk))
    endpoint.refresh_from_db()
    return endpoint


def join(launch: NodeLaunch, *, memory_mb: int = 8192, host: str = "127.0.0.1") -> Node:
    """The launch's agent registers (as `register_node` would: with the launch's join token), advertising `host`."""
    issued = tokens.issue_token(Node.SECRET_KIND)
    return Node.objects.create(
        name=f"node-{str(launch.pk)[:8]}", gpu_type="cpu", num_gpus=0, gpu_memory_mb=memory_mb, quantizations=["none"],
        secret_lookup=issued.lookup, secret_digest=issued.digest, join_token=launch.join_token,
        last_heartbeat_at=timezone.now(), advertise_host=host,
    )


def tick(provider, now=None) -> int:
    return pools.provision_tick(now=now, provider_for=lambda name: provider)


@pytest.mark.django_db
def test_an_endpoint_with_no_room_records_its_unplaced_replicas_and_says_a_node_is_being_provisioned():
    endpoint = waiting_endpoint()
    assert endpoint.unplaced_replicas == 1
    assert endpoint.status_message.startswith("waiting for capacity") and endpoint.waiting_for_capacity
    make_pool()
    reconcile_endpoint(str(endpoint.pk))
    endpoint.refresh_from_db()
    assert (endpoint.unplaced_replicas, endpoint.status_message, endpoint.waiting_for_capacity) == (1, PROVISIONING_MESSAGE, False)
    assert EndpointEvent.objects.filter(endpoint=endpoint, kind=EventKind.CAPACITY, message__startswith="Provisioning a node (pool cpu-pool)").exists()
    # Held calls wait (no fast 503) and see it as their progress.
    assert directory._blocking_state(endpoint) == ""
    assert directory._load_progress(str(endpoint.pk)) == "provisioning a node"


@pytest.mark.django_db
def test_a_quota_refusal_is_not_demand_for_a_node():
    endpoint = EndpointFactory(gpu_type="cpu", model_source=TINY, quantization="none", min_replicas=1)
    plan = save_plan(SYSTEM, Plan(name="no-gpus", max_gpus_by_type={"cpu": 0}))
    set_organization_plan(SYSTEM, endpoint.organization, plan)
    reconcile_endpoint(str(endpoint.pk))
    endpoint.refresh_from_db()
    assert endpoint.status_message.startswith("waiting for quota") and endpoint.unplaced_replicas == 0


@pytest.mark.django_db
def test_two_endpoints_that_fit_one_machine_launch_one_node_and_it_joins():
    pool, provider = make_pool(), RecordingProvider()
    first, second = waiting_endpoint(), waiting_endpoint()
    assert tick(provider) == 1
    [launch] = NodeLaunch.objects.filter(pool=pool)
    assert launch.state == LaunchState.LAUNCHING and provider.launched == [(str(launch.pk), "")]
    assert "2 replicas of 2 endpoints fit on 1 new node" in launch.reason
    assert launch.join_token.max_uses == 1 and launch.join_token.expires_at == launch.deadline_at
    assert tick(provider) == 0  # the booting machine holds both: nothing more
    node = join(launch)
    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and launch.node == node
    for endpoint in (first, second):
        reconcile_endpoint(str(endpoint.pk))
        endpoint.refresh_from_db()
        assert endpoint.unplaced_replicas == 0 and endpoint.status_message == ""
    assert Replica.objects.filter(node=node).count() == 2


@pytest.mark.django_db
def test_a_node_that_just_joined_is_not_doubled_before_the_scheduler_places_on_it():
    pool, provider = make_pool(), RecordingProvider()
    waiting_endpoint()
    tick(provider)
    join(NodeLaunch.objects.get(pool=pool))
    assert tick(provider) == 0  # the endpoint still shows 1 unplaced: its reconcile has not run yet
    assert NodeLaunch.objects.filter(pool=pool).count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_ticks_never_launch_twice_for_the_same_demand():
    pool, provider = make_pool(), RecordingProvider(delay_s=0.5)
    endpoint = waiting_endpoint()
    needs = pools.assign_demand([pool])[pool.pk]
    results, errors = [], []

    def run():
        try:
            # NOTE: tick_pool, not provision_tick: the pool's row lock is what is under test, without the Redis lock.
            results.append(pools.tick_pool(NodePool.objects.get(pk=pool.pk), needs, provider))
        except Exception as error:  # noqa: BLE001
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and sorted(results) == [0, 1]
    assert NodeLaunch.objects.filter(pool=pool).count() == 1 and len(provider.launched) == 1
    assert endpoint.unplaced_replicas == 1


@pytest.mark.django_db(transaction=True)
def test_a_second_beat_while_a_tick_runs_does_nothing():
    pool, provider = make_pool(), RecordingProvider(delay_s=1.0)
    waiting_endpoint()
    results = []

    def run():
        try:
            results.append(tick(provider))
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [0, 1] and NodeLaunch.objects.filter(pool=pool).count() == 1


@pytest.mark.django_db
def test_a_launch_left_requested_by_a_crash_is_sent_again_once_by_the_next_tick():
    pool, provider = make_pool(), RecordingProvider()
    waiting_endpoint()
    provider.crash = True
    tick(provider)  # the tick dies between its decision (committed) and the provider's answer
    [launch] = NodeLaunch.objects.filter(pool=pool)
    assert launch.state == LaunchState.REQUESTED
    first_token = launch.join_token_id
    provider.crash = False
    assert tick(provider) == 0  # no new launch: the requested one is the capacity on its way
    launch.refresh_from_db()
    assert launch.state == LaunchState.LAUNCHING and launch.join_token_id != first_token
    assert provider.launched == [(str(launch.pk), "")]
    tick(provider)
    assert provider.launched == [(str(launch.pk), "")] and len(provider.machines) == 1


@pytest.mark.django_db
@pytest.mark.parametrize("answers_later", [True, False])
def test_a_launch_whose_answer_was_lost_is_sent_again_and_never_left_running_unseen(answers_later):
    # A launch whose call timed out after the provider started the machine was failed as refused: nothing looked for
    # its machine again, and it ran unseen and paid for, its agent turned away (the launch was no longer booting).
    pool, provider = make_pool(join_deadline_s=30), RecordingProvider()
    waiting_endpoint()
    provider.answer_lost = True
    tick(provider)
    [launch] = NodeLaunch.objects.filter(pool=pool)
    assert launch.state == LaunchState.REQUESTED and len(provider.machines) == 1

    provider.answer_lost = not answers_later
    tick(provider)
    launch.refresh_from_db()
    if answers_later:  # the same machine (idempotent on the launch id), now tracked
        assert launch.state == LaunchState.LAUNCHING and launch.provider_id == provider.machines[str(launch.pk)].provider_id
        assert len(provider.machines) == 1
    else:  # never answered: found by its launch id at the deadline and terminated
        tick(provider, now=timezone.now() + timedelta(seconds=31))
        launch.refresh_from_db()
        assert launch.state == LaunchState.FAILED and provider.terminated and str(launch.pk) not in provider.machines


@pytest.mark.django_db
def test_a_refused_launch_fails_with_the_providers_reason():
    pool, provider = make_pool(), RecordingProvider()
    waiting_endpoint()
    provider.fail_with = "InsufficientInstanceCapacity in zone a"
    tick(provider)
    launch = NodeLaunch.objects.get(pool=pool)
    assert launch.state == LaunchState.FAILED and "InsufficientInstanceCapacity" in launch.reason
    assert AuditEvent.objects.filter(action="node_launch.fail", target_id=str(launch.pk)).exists()
    provider.fail_with = ""
    assert tick(provider) == 0  # not again at once: the provider just said no in its only zone
    assert tick(provider, now=timezone.now() + timedelta(seconds=pools.REFUSAL_BACKOFF_S + 1)) == 1


@pytest.mark.django_db
def test_a_refusal_in_one_zone_is_retried_at_once_in_another():
    make_pool()
    provider = RecordingProvider(zones=["zone-a", "zone-b"])
    waiting_endpoint()
    provider.fail_with = "sold out"
    tick(provider)
    provider.fail_with = ""
    assert tick(provider) == 1
    assert [zone for _, zone in provider.launched] == ["zone-a", "zone-b"]


@pytest.mark.django_db
def test_min_and_warm_nodes_are_launched_without_demand_and_kept():
    pool, provider = make_pool(min_nodes=1, warm_nodes=1, idle_timeout_s=1), RecordingProvider()
    assert tick(provider) == 2
    for launch in NodeLaunch.objects.filter(pool=pool):
        join(launch)
    later = timezone.now() + timedelta(hours=1)
    assert tick(provider, now=later) == 0
    assert provider.terminated == []
    assert NodeLaunch.objects.filter(pool=pool, state=LaunchState.JOINED).count() == 2


@pytest.mark.django_db
def test_an_idle_node_whose_host_the_gateway_refuses_is_not_the_pools_warm_node(settings):
    pool, provider = make_pool(warm_nodes=1), RecordingProvider()
    assert tick(provider) == 1
    refused = join(NodeLaunch.objects.get(pool=pool))  # on loopback, the default host
    settings.ALLOW_LOOPBACK_NODES = False  # then the deployment refused it: placement never uses it
    assert tick(provider, now=timezone.now() + timedelta(seconds=10)) == 1
    assert NodeLaunch.objects.filter(pool=pool).exclude(node=refused).get().state == LaunchState.LAUNCHING


@pytest.mark.django_db
def test_a_pool_at_its_maximum_releases_an_idle_node_whose_host_the_gateway_refuses_and_launches_a_usable_one(settings):
    pool, provider = make_pool(max_nodes=1, warm_nodes=1, idle_timeout_s=60), RecordingProvider()
    tick(provider)
    launch = NodeLaunch.objects.get(pool=pool)
    join(launch)
    tick(provider)
    settings.ALLOW_LOOPBACK_NODES = False
    endpoint = waiting_endpoint()
    assert endpoint.unplaced_replicas == 1
    assert tick(provider, now=timezone.now() + timedelta(seconds=61)) == 0  # at its maximum until the release
    launch.refresh_from_db()
    assert launch.state == LaunchState.TERMINATED and "the gateway refuses its registered host" in launch.reason
    assert provider.terminated == [launch.provider_id]
    assert tick(provider, now=timezone.now() + timedelta(seconds=62)) == 1
    assert NodeLaunch.objects.exclude(pk=launch.pk).get(pool=pool).state == LaunchState.LAUNCHING


@pytest.mark.django_db
def test_a_node_whose_host_the_gateway_refuses_is_not_the_pools_minimum_and_is_replaced_at_once(settings):
    """Before, a refused node met `min_nodes` until its idle timeout released it: for that long the pool's minimum was
    a machine placement never uses, and no usable one was launched."""
    pool, provider = make_pool(min_nodes=1, idle_timeout_s=60), RecordingProvider()
    start = timezone.now()
    assert tick(provider, now=start) == 1
    refused = NodeLaunch.objects.get(pool=pool)
    join(refused)  # on loopback, the default host
    tick(provider, now=start)
    settings.ALLOW_LOOPBACK_NODES = False  # then the deployment refused it
    assert tick(provider, now=start + timedelta(seconds=10)) == 1  # at once, not at its idle timeout
    replacement = NodeLaunch.objects.exclude(pk=refused.pk).get(pool=pool)
    assert replacement.state == LaunchState.LAUNCHING
    join(replacement, host="10.0.0.7")
    assert tick(provider, now=start + timedelta(seconds=20)) == 0
    assert NodeLaunch.objects.get(pk=refused.pk).state == LaunchState.JOINED  # released per the pool's rules: idle 60 s
    assert tick(provider, now=start + timedelta(seconds=90)) == 0
    refused.refresh_from_db()
    replacement.refresh_from_db()
    assert refused.state == LaunchState.TERMINATED and "the gateway refuses its registered host" in refused.reason
    assert replacement.state == LaunchState.JOINED  # the minimum now, kept though idle as long
    assert provider.terminated == [refused.provider_id]


@pytest.mark.django_db
def test_a_launch_that_never_joins_is_terminated_at_its_deadline_and_replaced_in_another_zone():
    pool, provider = make_pool(join_deadline_s=30), RecordingProvider(zones=["zone-a", "zone-b"])
    endpoint = waiting_endpoint()
    tick(provider)
    first = NodeLaunch.objects.get(pool=pool)
    assert first.zone == "zone-a"
    tick(provider, now=timezone.now() + timedelta(seconds=31))
    first.refresh_from_db()
    assert first.state == LaunchState.FAILED and first.reason == "did not join within 30 s"
    assert provider.terminated == [first.provider_id]
    assert first.join_token.revoked_at is not None
    replacement = NodeLaunch.objects.exclude(pk=first.pk).get(pool=pool)
    assert replacement.zone == "zone-b" and replacement.state == LaunchState.LAUNCHING
    message = EndpointEvent.objects.filter(endpoint=endpoint, kind=EventKind.CAPACITY, message__contains="did not join").get().message
    assert "zone zone-a did not join within 30 s" in message and "replacement" in message


@pytest.mark.django_db
def test_an_idle_node_is_cordoned_terminated_and_its_agent_shut_out_after_the_idle_timeout():
    pool, provider = make_pool(idle_timeout_s=60), RecordingProvider()
    endpoint = waiting_endpoint()
    tick(provider)
    launch = NodeLaunch.objects.get(pool=pool)
    node = join(launch)
    tick(provider)
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(node=node)
    tick(provider)
    launch.refresh_from_db()
    assert launch.idle_since is None  # busy
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.STOPPED)
    tick(provider)
    launch.refresh_from_db()
    assert launch.idle_since is not None
    tick(provider, now=timezone.now() + timedelta(seconds=30))
    assert provider.terminated == []
    tick(provider, now=timezone.now() + timedelta(seconds=61))
    launch.refresh_from_db()
    node.refresh_from_db()
    assert launch.state == LaunchState.TERMINATED and "empty for 60 s" in launch.reason
    assert provider.terminated == [launch.provider_id]
    assert node.state == NodeState.OFFLINE and node.secret_digest == ""
    actions = set(AuditEvent.objects.values_list("action", flat=True))
    assert {"node.cordoned", "node_launch.release", "node.retire", "node_launch.terminate"} <= actions


@pytest.mark.django_db
def test_a_joined_node_that_died_is_terminated_and_its_launch_finished():
    pool, provider = make_pool(), RecordingProvider()
    waiting_endpoint()
    tick(provider)
    launch = NodeLaunch.objects.get(pool=pool)
    node = join(launch)
    tick(provider)
    Node.objects.filter(pk=node.pk).update(state=NodeState.OFFLINE, last_heartbeat_at=timezone.now() - timedelta(minutes=5))
    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.TERMINATED and "stopped sending heartbeats" in launch.reason
    assert provider.terminated == [launch.provider_id]


@pytest.mark.django_db
def test_a_joined_machine_whose_node_staff_removed_is_terminated_rather_than_paid_for_unseen():
    pool, provider = make_pool(), RecordingProvider()
    waiting_endpoint()
    tick(provider)
    launch = NodeLaunch.objects.get(pool=pool)
    join(launch)
    tick(provider)
    Node.objects.filter(pk=NodeLaunch.objects.get(pk=launch.pk).node_id).delete()
    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.TERMINATED and launch.reason == "its node was removed"
    assert provider.terminated == [launch.provider_id]


@pytest.mark.django_db
def test_a_replica_too_large_for_the_pools_machines_is_reported_and_launches_nothing():
    pool, provider = make_pool(gpu_memory_mb=1024), RecordingProvider()
    endpoint = waiting_endpoint()
    assert endpoint.status_message.startswith("waiting for capacity")  # no pool can bring room
    tick(provider)
    assert not NodeLaunch.objects.filter(pool=pool).exists()
    assert EndpointEvent.objects.filter(endpoint=endpoint, message__contains="no machine of this pool can hold a replica (1024 MB per machine)").exists()


@pytest.mark.django_db(transaction=True)
def test_a_placement_that_wins_the_race_keeps_the_node_from_being_released():
    pool, provider = make_pool(idle_timeout_s=0), RecordingProvider()
    endpoint = waiting_endpoint()
    tick(provider)
    launch = NodeLaunch.objects.get(pool=pool)
    node = join(launch)
    pools.link_joins(pool, provider, timezone.now())
    placed, released = threading.Event(), []

    def place_and_hold():
        try:
            with transaction.atomic():
                locked = Node.objects.select_for_update().get(pk=node.pk, state=NodeState.READY)  # as place_replica does
                Replica.objects.create(endpoint=endpoint, node=locked, reserved_memory_mb=100)
                placed.set()
                time.sleep(0.5)  # the release waits on the row meanwhile
        finally:
            connection.close()

    def release():
        try:
            placed.wait(5)
            released.append(pool_release.cordon_for_release(pool, str(launch.pk)))
        finally:
            connection.close()

    threads = [threading.Thread(target=place_and_hold), threading.Thread(target=release)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    node.refresh_from_db()
    launch.refresh_from_db()
    assert released == [False] and node.state == NodeState.READY and launch.state == LaunchState.JOINED


@pytest.mark.django_db
def test_a_provider_that_cannot_terminate_keeps_the_launch_releasing_until_it_can():
    pool, provider = make_pool(idle_timeout_s=0), RecordingProvider()
    tick(provider)  # no demand: nothing
    waiting_endpoint()
    tick(provider)
    launch = NodeLaunch.objects.get(pool=pool)
    join(launch)
    pools.link_joins(pool, provider, timezone.now())
    failing = RecordingProvider()

    def refuse(pool, provider_id):
        raise ProviderError("API throttled")

    failing.terminate = refuse
    assert pool_release.cordon_for_release(pool, str(launch.pk))
    pool_release.finish_releases(pool, failing, timezone.now())
    launch.refresh_from_db()
    assert launch.state == LaunchState.RELEASING
    pool_release.finish_releases(pool, provider, timezone.now())
    launch.refresh_from_db()
    assert launch.state == LaunchState.TERMINATED


@pytest.mark.django_db
def test_demand_goes_to_the_cheapest_pool_with_room():
    cheap = make_pool(name="cheap", hourly_price="0.10", max_nodes=1)
    dear = make_pool(name="dear", hourly_price="0.50", max_nodes=1)
    provider = RecordingProvider()
    waiting_endpoint()
    tick(provider)
    assert NodeLaunch.objects.filter(pool=cheap).count() == 1 and not NodeLaunch.objects.filter(pool=dear).exists()
    join(NodeLaunch.objects.get(pool=cheap), memory_mb=1024)  # joined, but too small for the second endpoint
    pools.link_joins(cheap, provider, timezone.now() - timedelta(minutes=1))
    waiting_endpoint()
    tick(provider)
    assert NodeLaunch.objects.filter(pool=dear).count() == 1  # the cheap pool is at its maximum


@pytest.mark.django_db
def test_a_machine_whose_agent_registered_without_the_launch_token_is_linked_by_the_name_the_provider_reports():
    pool, provider = make_pool(), RecordingProvider()
    waiting_endpoint()
    tick(provider)
    launch = NodeLaunch.objects.get(pool=pool)
    issued = tokens.issue_token(Node.SECRET_KIND)
    node = Node.objects.create(name=pools.node_name(pool, launch), gpu_type="cpu", gpu_memory_mb=8192,
                               secret_lookup=issued.lookup, secret_digest=issued.digest)  # a shared DaemonSet token, say
    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and launch.node == node


@pytest.mark.django_db
def test_make_runs_demo_pool_starts_the_local_agent_and_no_agent_turns_it_off():
    pool = seed_local_pool(enabled=True)
    assert (pool.provider, pool.gpu_type, pool.min_nodes, pool.max_nodes) == ("local", "cpu", 1, 2)
    assert pool.gpu_memory_mb == host_engine_memory_mb()
    assert (seed_local_pool(enabled=False).min_nodes, NodePool.objects.get(name="local").max_nodes) == (0, 0)
    assert seed_local_pool(enabled=True).max_nodes == 2
    provider = RecordingProvider()
    assert tick(provider) == 1  # its minimum: the agent `make run` no longer starts itself


def record_local_agent(directory, launch: NodeLaunch, process: subprocess.Popen, started: str) -> None:
    """The state file the local provider writes for a launch's agent (`controlplane.local_agents`)."""
    local_agents.LocalAgent(launch_id=str(launch.pk), pool_id=launch.pool_id, name=f"agent-{launch.pk}",
                            pid=process.pid, pgid=process.pid, started=started, engine_port_min=10000,
                            engine_port_max=10099).save(directory)


def joined_launch_with_a_ready_replica(pool: NodePool) -> tuple[NodeLaunch, Node, Replica]:
    launch = NodeLaunch.objects.create(pool=pool, state=LaunchState.JOINED, deadline_at=timezone.now(),
                                       joined_at=timezone.now() - timedelta(minutes=20))
    NodeLaunch.objects.filter(pk=launch.pk).update(provider_id=str(launch.pk))  # the local provider's id: the launch's
    node = join(launch)
    NodeLaunch.objects.filter(pk=launch.pk).update(node=node)
    endpoint = EndpointFactory(gpu_type="cpu", model_source=TINY, quantization="none", min_replicas=1)
    return launch, node, Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY)


@pytest.mark.django_db
def test_make_run_retires_the_local_agents_make_stop_stopped_and_replaces_their_replicas_at_once(settings, tmp_path):
    # Seen on `make stop` then `make run`: the stopped agent's node was still READY on record, and the printed curl
    # got 502 upstream_error for 2 min 24 s, until the sweeper judged it silent and the pool started a new agent.
    settings.LOCAL_POOL_DIR = str(tmp_path)
    pool = seed_local_pool(enabled=True)
    launch, node, replica = joined_launch_with_a_ready_replica(pool)
    agent = subprocess.Popen([sys.executable, "-c", "pass"])
    started = local_agents.process_start_time(agent.pid)
    agent.wait()  # `make stop` stopped it; its record stays
    record_local_agent(tmp_path, launch, agent, started)

    seed_local_pool(enabled=True)  # what `make run` does before it starts the control plane

    node.refresh_from_db()
    replica.refresh_from_db()
    launch.refresh_from_db()
    assert node.state == NodeState.OFFLINE and replica.state == ReplicaState.FAILED
    assert launch.state == LaunchState.TERMINATED and launch.reason == "its agent is not running (stopped by make stop?)"
    assert not local_agents.state_path(tmp_path, str(launch.pk)).exists()
    assert tick(RecordingProvider()) == 1  # a new agent for the endpoint's replica, at the first tick


@pytest.mark.django_db
def test_a_second_make_run_with_another_data_folder_on_the_same_database_keeps_the_firsts_live_agents(settings,
                                                                                                      tmp_path):
    """Its pool folder records none of the first run's agents: they were taken for stopped, their nodes retired and
    replicas failed, their processes left running unseen."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    settings.LOCAL_POOL_DIR = str(first)
    pool = seed_local_pool(enabled=True)
    launch, node, replica = joined_launch_with_a_ready_replica(pool)
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        record_local_agent(first, launch, agent, local_agents.process_start_time(agent.pid))
        seed_local_pool(enabled=True)  # the first `make run` again: its agent lives

        settings.LOCAL_POOL_DIR = str(second)
        seed_local_pool(enabled=True)  # the second, another data folder, the same DATABASE_URL

        node.refresh_from_db()
        replica.refresh_from_db()
        launch.refresh_from_db()
        assert (node.state, replica.state, launch.state) == (NodeState.READY, ReplicaState.READY, LaunchState.JOINED)
        assert agent.poll() is None
    finally:
        agent.kill()
        agent.wait()


@pytest.mark.django_db
def test_a_pool_machine_that_registers_another_gpu_type_is_held_to_its_pools_and_gets_none_of_that_types_replicas(
    client
):
    """A machine of the pool of one-L4 machines saying it is an H100 (the launch's token sits on it): before, its node
    was an H100 node, and H100 endpoints (billed and planned as H100s, another pool's to serve) were placed on it."""
    pool = make_pool(name="l4-pool", gpu_type="l4", gpus_per_node=1, gpu_memory_mb=23_034)
    launch = NodeLaunch.objects.create(pool=pool, state=LaunchState.LAUNCHING, deadline_at=timezone.now() + timedelta(minutes=10))
    answer = client.post("/agent/v1/register", {
        "join_token": pools.reissue_token(launch), "name": "m-1", "gpu_type": "h100-80gb", "num_gpus": 1,
        "gpu_memory_mb": 23_034, "num_cpus": 8, "memory_mb": 64_000, "agent_version": "0.1.0"},
        content_type="application/json")
    assert answer.status_code == 201, answer.content

    node = Node.objects.get(pk=answer.json()["node_id"])
    assert node.gpu_type == "l4"
    endpoint = EndpointFactory(gpu_type="h100-80gb", model_source=TINY, quantization="none", min_replicas=1)
    reconcile_endpoint(str(endpoint.pk))
    assert not Replica.objects.filter(endpoint=endpoint, node=node).exists()


@pytest.mark.django_db
def test_a_pool_machine_that_registers_more_than_its_pool_is_held_to_the_pools_shape(client):
    """The launch's join token sits on the machine: whatever its agent says of itself at registration (four GPUs of
    80 GB on a pool of one-L4 machines), placement sees what staff made the pool (before, what it registered stood
    until a heartbeat named its GPUs, and for ever when none did)."""
    pool = make_pool(name="l4-pool", gpu_type="l4", gpus_per_node=1, gpu_memory_mb=23_034)
    launch = NodeLaunch.objects.create(pool=pool, state=LaunchState.LAUNCHING, deadline_at=timezone.now() + timedelta(minutes=10))
    gpus = [{"index": index, "name": "NVIDIA A100", "utilization_percent": 0.0, "memory_used_mb": 0,
             "memory_total_mb": 81_920, "uuid": f"GPU-{index:04d}"} for index in range(4)]
    answer = client.post("/agent/v1/register", {
        "join_token": pools.reissue_token(launch), "name": "m-1", "gpu_type": "l4", "num_gpus": 4, "gpu_memory_mb": 81_920,
        "num_cpus": 8, "memory_mb": 64_000, "agent_version": "0.1.0", "gpus": gpus}, content_type="application/json")
    assert answer.status_code == 201, answer.content
    node = Node.objects.get(pk=answer.json()["node_id"])
    assert (node.num_gpus, node.gpu_memory_mb) == (1, 23_034)
    assert [(gpu["index"], gpu["memory_mb"]) for gpu in node.gpus] == [(0, 23_034)]
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and launch.node == node


def _register_claiming_eight_h100s(client, join_token: str):
    return client.post("/agent/v1/register", {
        "join_token": join_token, "name": "m-1", "gpu_type": "h100-80gb", "num_gpus": 8, "gpu_memory_mb": 81_920,
        "num_cpus": 8, "memory_mb": 64_000, "agent_version": "0.1.0"}, content_type="application/json")


@pytest.mark.django_db(transaction=True)
def test_a_reconcile_while_a_pool_machine_registers_never_sees_the_type_it_claimed(client, monkeypatch):
    """Before, the node was committed with the type and shape the machine claimed, and held to its pool's in a second
    transaction: a reconcile in another worker between the two placed an H100 endpoint on the L4 pool's machine, and
    nothing moved it after."""
    pool = make_pool(name="l4-pool", gpu_type="l4", gpus_per_node=1, gpu_memory_mb=23_034)
    launch = NodeLaunch.objects.create(pool=pool, state=LaunchState.LAUNCHING, deadline_at=timezone.now() + timedelta(minutes=10))
    endpoint = EndpointFactory(gpu_type="h100-80gb", model_source=TINY, quantization="none", min_replicas=1)
    link_joined_node, errors = services.link_joined_node, []

    def reconcile_in_another_worker():
        try:
            reconcile_endpoint(str(endpoint.pk))
        except Exception as error:  # noqa: BLE001
            errors.append(error)
        finally:
            connection.close()

    def link_after_a_reconcile(node, *args, **kwargs):
        worker = threading.Thread(target=reconcile_in_another_worker)
        worker.start()
        worker.join()
        return link_joined_node(node, *args, **kwargs)

    monkeypatch.setattr(services, "link_joined_node", link_after_a_reconcile)
    answer = _register_claiming_eight_h100s(client, pools.reissue_token(launch))
    assert answer.status_code == 201, answer.content
    assert not errors

    node = Node.objects.get(pk=answer.json()["node_id"])
    assert (node.gpu_type, node.num_gpus) == ("l4", 1)
    assert not Replica.objects.filter(endpoint=endpoint, node=node).exists()


@pytest.mark.django_db
def test_a_replica_placed_on_a_machine_before_it_is_linked_by_name_is_drained_when_held_to_its_pools_type(client):
    """A machine whose agent joined with a shared token is linked by the name the provider reports at the next tick;
    until then it is the type it claimed. Before, an H100 endpoint's replica placed then stayed on the L4 machine."""
    pool = make_pool(name="l4-pool", gpu_type="l4", gpus_per_node=1, gpu_memory_mb=23_034)
    launch = NodeLaunch.objects.create(pool=pool, state=LaunchState.LAUNCHING, deadline_at=timezone.now() + timedelta(minutes=10))
    answer = _register_claiming_eight_h100s(client, create_join_token(SYSTEM, name="daemonset").plain)
    assert answer.status_code == 201, answer.content
    node = Node.objects.get(pk=answer.json()["node_id"])
    endpoint = EndpointFactory(gpu_type="h100-80gb", model_source=TINY, quantization="none", min_replicas=1)
    reconcile_endpoint(str(endpoint.pk))
    assert Replica.objects.filter(endpoint=endpoint, node=node, state=ReplicaState.PENDING).exists()

    assert launches.link_joined_node(node, launch)

    assert node.gpu_type == "l4"
    assert not Replica.objects.filter(endpoint=endpoint, node=node, state__in=[ReplicaState.PENDING]).exists()


@pytest.mark.django_db
def test_an_endpoint_backing_off_after_a_replica_failure_launches_no_machine():
    """Before: the failure left the endpoint's other unplaced replica as demand until its next reconcile, and
    the pool tick launched a machine for an endpoint that waits out a backoff (1 launch)."""
    pool, provider = make_pool(), RecordingProvider()
    issued = tokens.issue_token(Node.SECRET_KIND)
    Node.objects.create(name="room-for-one", gpu_type="cpu", num_gpus=0, gpu_memory_mb=5000, quantizations=["none"],
                        secret_lookup=issued.lookup, secret_digest=issued.digest, last_heartbeat_at=timezone.now(),
                        advertise_host="127.0.0.1")
    endpoint = EndpointFactory(gpu_type="cpu", model_source=TINY, quantization="none", min_replicas=2, max_replicas=2)
    reconcile_endpoint(str(endpoint.pk))
    endpoint.refresh_from_db()
    [replica] = Replica.objects.filter(endpoint=endpoint)
    assert endpoint.unplaced_replicas == 1
    reason = "did not become READY within 600 s"  # as the stuck-replica sweep fails one
    fail_replica(replica, reason)
    record_replica_failure(endpoint.pk, reason)
    assert tick(provider) == 0 and not NodeLaunch.objects.filter(pool=pool).exists()
    reconcile_endpoint(str(endpoint.pk))  # still backing off: no demand either
    endpoint.refresh_from_db()
    assert endpoint.unplaced_replicas == 0 and endpoint.next_attempt_at is not None
    assert tick(provider) == 0


@pytest.mark.django_db
@pytest.mark.parametrize("ends", ["died", "idle"])
def test_a_machine_that_joined_while_its_launch_went_unanswered_is_terminated_when_released(ends):
    # The provider started the machine but its answer was lost (the launch left REQUESTED, no provider id); the
    # machine booted and its agent joined by the launch's token before a tick sent the launch again. Released (its
    # node dead, or idle), the launch was finished with no termination asked for (it knew no provider id), and the
    # stray sweep never looks at a machine whose launch record exists: the machine ran on, paid for, its agent retired.
    pool, provider = make_pool(idle_timeout_s=60), RecordingProvider()
    waiting_endpoint()
    provider.answer_lost = True
    tick(provider)
    [launch] = NodeLaunch.objects.filter(pool=pool)
    assert launch.state == LaunchState.REQUESTED and launch.provider_id == ""
    node = join(launch)
    provider.answer_lost = False
    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED
    if ends == "died":
        Node.objects.filter(pk=node.pk).update(state=NodeState.OFFLINE,
                                               last_heartbeat_at=timezone.now() - timedelta(minutes=5))
        tick(provider)
    else:
        tick(provider, now=timezone.now() + timedelta(seconds=61))
    launch.refresh_from_db()
    assert launch.state == LaunchState.TERMINATED
    assert provider.terminated == [f"m-{str(launch.pk)[:8]}"] and str(launch.pk) not in provider.machines


def _clock(offset: timedelta):
    """A pod's `django.utils.timezone`, its clock `offset` from the database's."""
    return type("Clock", (), {"now": staticmethod(lambda: timezone.now() + offset)})


@pytest.mark.django_db
def test_a_node_that_joins_through_a_web_pod_whose_clock_is_behind_is_not_released_before_it_gets_its_replica(
        monkeypatch):
    # Before: the join was stamped by the web pod's clock (`register_node` links the launch) and its idle spell judged
    # by the worker's: a web pod 15 minutes behind made every machine that joined through it idle for 15 minutes
    # already, released by the next tick before the scheduler placed the replica it came for, and launched again.
    pool, provider = make_pool(idle_timeout_s=300), RecordingProvider()
    endpoint = waiting_endpoint()
    tick(provider)
    launch = NodeLaunch.objects.get(pool=pool)
    node = join(launch)
    monkeypatch.setattr(launches, "timezone", _clock(timedelta(minutes=-15)), raising=False)  # the web pod's
    assert launches.link_joined_node(node) is not None
    monkeypatch.undo()
    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and provider.terminated == []
    reconcile_endpoint(str(endpoint.pk))
    assert Replica.objects.filter(endpoint=endpoint, node=node).exists()


@pytest.mark.django_db
def test_a_launch_requested_by_a_worker_whose_clock_is_behind_is_not_failed_early_by_another(monkeypatch):
    # Before: a launch's deadline was the requesting worker's clock plus the join deadline, judged by whichever worker
    # ran the next tick: one 15 minutes behind gave launches a deadline the others found passed 5 minutes ago, and each
    # machine was terminated as late before it could join (the endpoint waited for capacity for good).
    pool, provider = make_pool(join_deadline_s=600), RecordingProvider()
    waiting_endpoint()
    for module in (pools, launches):
        monkeypatch.setattr(module, "timezone", _clock(timedelta(minutes=-15)), raising=False)  # worker A
    tick(provider)
    monkeypatch.undo()
    [launch] = NodeLaunch.objects.filter(pool=pool)
    assert launch.state == LaunchState.LAUNCHING
    tick(provider)  # worker B, on time
    launch.refresh_from_db()
    assert launch.state == LaunchState.LAUNCHING and provider.terminated == []


class WorkerKilled(BaseException):
    """The tick task's hard time limit: the worker process ends inside a provider's call (no `except Exception`)."""


class HangingProvider(RecordingProvider):
    """A provider that answers slower than the tick's time limit: every call it gets is where the worker is killed."""

    name = "ec2"

    def list(self, pool):
        raise WorkerKilled

    def launch(self, pool, specs):
        raise WorkerKilled

    def terminate(self, pool, provider_id):
        raise WorkerKilled


def _a_slow_pool_booting_and_another_releasing():
    """Pool a-slow (provider ec2) with a machine booting, pool b-other with an idle machine due for release."""
    slow_pool = make_pool(name="a-slow", provider="ec2")
    other_pool = make_pool(name="b-other")
    now = timezone.now()
    NodeLaunch.objects.create(pool=slow_pool, state=LaunchState.LAUNCHING, provider_id="i-0slow", deadline_at=now + timedelta(hours=1))
    releasing = NodeLaunch.objects.create(pool=other_pool, state=LaunchState.RELEASING, provider_id="m-idle",
                                          deadline_at=now, reason="empty for 60 s (pool b-other)")
    return slow_pool, other_pool, releasing


@pytest.mark.django_db
def test_a_pool_whose_provider_outlasts_the_tick_does_not_keep_the_other_pools_from_their_turn():
    # NOTE: pools were ticked in the order of their ids, every tick: the first pool's provider answering slower than the
    # tick's time limit had the worker killed there each time, and the pools after it were never ticked (their demand
    # never launched, their idle machines never released, paid for).
    _, _, releasing = _a_slow_pool_booting_and_another_releasing()
    slow, fine = HangingProvider(), RecordingProvider()
    for _ in range(2):
        with pytest.raises(WorkerKilled):
            pools.provision_tick(provider_for=lambda name: slow if name == "ec2" else fine)
    releasing.refresh_from_db()
    assert fine.terminated == ["m-idle"] and releasing.state == LaunchState.TERMINATED


def _register_as(client, join_token: str, name: str, advertise_host: str = "127.0.0.1", pod_token: str = ""):
    return client.post("/agent/v1/register", {
        "join_token": join_token, "name": name, "gpu_type": "cpu", "num_gpus": 0, "gpu_memory_mb": 8192,
        "num_cpus": 8, "memory_mb": 64_000, "agent_version": "0.1.0", "advertise_host": advertise_host,
        **({"pod_token": pod_token} if pod_token else {})}, content_type="application/json")


def _a_booting_machine_and_a_shared_join_token():
    """A pool's machine launched for a waiting endpoint, its agent not yet registered, and a DaemonSet's shared token."""
    pool, provider = make_pool(), RecordingProvider()
    waiting_endpoint()
    tick(provider)
    launch = NodeLaunch.objects.get(pool=pool)
    return provider, launch, create_join_token(SYSTEM, name="daemonset").plain


@pytest.mark.django_db(transaction=True)
def test_another_holder_of_a_shared_join_token_registering_under_a_booting_machines_name_does_not_take_it_over(client):
    """A Kubernetes pool's machine is linked by the node name the provider reports, its agent holding the DaemonSet's
    shared join token. Before, the tick linked the newest node registered under that name since the launch: anyone else
    holding the token who registered under it after the machine's own agent became the pool's machine (its launch, its
    idle timeout, its release), and the machine's real node was left out of the pool."""
    provider, launch, shared = _a_booting_machine_and_a_shared_join_token()
    machine_name = provider.machines[str(launch.pk)].node_name

    own = _register_as(client, shared, machine_name)
    other = _register_as(client, shared, machine_name)  # the same token, the same name: a second machine claiming it
    assert own.status_code == other.status_code == 201

    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED
    assert str(launch.node_id) == own.json()["node_id"]
    assert not NodeLaunch.objects.filter(node_id=other.json()["node_id"]).exists()
    joined = AuditEvent.objects.get(action="node_launch.join", target_id=str(launch.pk))
    assert joined.details["also_claimed_by"] == [other.json()["node_id"]]  # staff see the second claim


@pytest.mark.django_db(transaction=True)
def test_a_booting_machines_name_claimed_first_by_a_node_staff_then_retire_goes_to_the_machines_own_agent(client):
    """Someone holding the shared token who registers under the machine's name before its agent does is linked first;
    staff retiring that node leave the machine to the next claimant, its own agent, at the next tick."""
    provider, launch, shared = _a_booting_machine_and_a_shared_join_token()
    machine_name = provider.machines[str(launch.pk)].node_name
    assert _register_as(client, shared, "a-machine-of-the-fleet").status_code == 201  # the token stays usable
    first = _register_as(client, shared, machine_name)
    services.retire_node(SYSTEM, Node.objects.get(pk=first.json()["node_id"]), reason="not our machine")
    own = _register_as(client, shared, machine_name)
    assert own.status_code == 201, own.content

    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and str(launch.node_id) == own.json()["node_id"]


@pytest.mark.django_db(transaction=True)
def test_a_node_registered_under_a_booting_machines_name_before_its_agent_at_another_host_does_not_take_it(client):
    """Where the provider knows the agent's host on the machine (Kubernetes: the agent pod's IP), a shared join token's
    holder who registers under the machine's node name before the machine's own agent is not linked; the agent is,
    once it registers. Before, the first registered under the name was linked, whatever host it advertised."""
    provider, launch, shared = _a_booting_machine_and_a_shared_join_token()
    machine = provider.machines[str(launch.pk)]
    provider.machines[str(launch.pk)] = dataclasses.replace(machine, agent_hosts=("127.0.0.2",))

    first = _register_as(client, shared, machine.node_name, advertise_host="127.0.0.3")
    assert first.status_code == 201 and beat(client, first.json()["node_secret"]).status_code == 200
    tick(provider)
    launch.refresh_from_db()
    assert launch.node_id is None and launch.state == LaunchState.LAUNCHING

    own = _register_as(client, shared, machine.node_name, advertise_host="127.0.0.2")
    assert beat(client, own.json()["node_secret"]).status_code == 200  # the agent heartbeats once registered
    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and str(launch.node_id) == own.json()["node_id"]
    joined = AuditEvent.objects.get(action="node_launch.join", target_id=str(launch.pk))
    assert joined.details["also_claimed_by"] == [first.json()["node_id"]]  # staff see who else claimed it


class SoftLimitProvider(HangingProvider):
    """The tick task's soft time limit (`SoftTimeLimitExceeded`, an `Exception`) raised inside a provider's call."""

    def list(self, pool):
        raise SoftTimeLimitExceeded

    def launch(self, pool, specs):
        raise SoftTimeLimitExceeded

    def terminate(self, pool, provider_id):
        raise SoftTimeLimitExceeded


@pytest.mark.django_db
def test_a_tick_whose_time_is_up_starts_no_other_pools_turn_and_that_pool_goes_first_next_time():
    # NOTE: the soft time limit is an Exception: taken for one pool's failure, the tick went on to the next pool's turn
    # with the 10 s left before the hard limit, which killed the worker in the middle of it (a machine asked for, its
    # launch never marked), and the pool so cut went last at the next tick.
    slow_pool, other_pool, releasing = _a_slow_pool_booting_and_another_releasing()
    slow, fine = SoftLimitProvider(), RecordingProvider()

    with pytest.raises(SoftTimeLimitExceeded):
        pools.provision_tick(provider_for=lambda name: slow if name == "ec2" else fine)

    assert fine.terminated == []
    assert [pool.name for pool in pools.turn_order([slow_pool, other_pool])] == ["b-other", "a-slow"]
    with pytest.raises(SoftTimeLimitExceeded):
        pools.provision_tick(provider_for=lambda name: slow if name == "ec2" else fine)
    releasing.refresh_from_db()
    assert fine.terminated == ["m-idle"] and releasing.state == LaunchState.TERMINATED


@pytest.mark.django_db(transaction=True)
def test_a_kubernetes_node_whose_agent_pod_has_no_ip_yet_goes_to_no_one_registered_under_its_name(client, api_server):  # noqa: F811
    """The placeholder is on its node and the agent DaemonSet's pod there is not up yet (the node not yet labelled for
    it, its sandbox not made, its image pulling): a holder of the shared join token who registers under the node's
    name meanwhile, from anywhere, must not become the machine; the machine's own agent, once its pod has an IP and it
    registers there, does. Before, an agent pod missing from the node was read as the provider telling nothing, and the
    tick linked the first node registered under the name, whatever its host: the takeover the agent's IP was to stop."""
    make_pool(name="k8s-pool", provider="kubernetes")
    provider = get_provider("kubernetes")
    waiting_endpoint()
    tick(provider)
    [launch] = NodeLaunch.objects.all()
    placeholder = api_server.pods[f"inferplane-capacity-{launch.pk}"]
    placeholder["spec"]["nodeName"], placeholder["status"]["phase"] = "ip-10-0-3-17.ec2.internal", "Running"
    shared = create_join_token(SYSTEM, name="daemonset").plain

    other = _register_as(client, shared, "ip-10-0-3-17.ec2.internal", advertise_host="127.0.0.3")
    assert other.status_code == 201 and beat(client, other.json()["node_secret"]).status_code == 200
    for step in ("no agent pod on the node", "its pod, pending, with no IP yet"):
        tick(provider)
        launch.refresh_from_db()
        assert launch.node_id is None and launch.state == LaunchState.LAUNCHING, step
        api_server.pods["inferplane-agent-x7k2p"] = _agent_pod("inferplane-agent-x7k2p", "ip-10-0-3-17.ec2.internal",
                                                               "127.0.0.2") | {"status": {"phase": "Pending"}}

    api_server.pods["inferplane-agent-x7k2p"]["status"] = {"phase": "Running", "podIP": "127.0.0.2",
                                                          "podIPs": [{"ip": "127.0.0.2"}]}
    own = _register_as(client, shared, "ip-10-0-3-17.ec2.internal", advertise_host="127.0.0.2",
                       pod_token=api_server.issue_pod_token("inferplane-agent-x7k2p"))
    assert beat(client, own.json()["node_secret"]).status_code == 200  # the agent heartbeats once registered
    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and str(launch.node_id) == own.json()["node_id"]


@pytest.mark.django_db(transaction=True)
def test_a_kubernetes_machines_agent_whose_registration_answer_was_lost_joins_as_the_node_it_registered_again(client):
    """The machine's agent registers; the answer is lost on the way back (an ingress's timeout after the commit), so it
    registers again, at its pod's IP under its node's name, and heartbeats as that second node. The first node is no
    one's: its secret never reached anybody. Before, the tick linked the first registered at the agent's host, that dead
    node: the launch JOINED a node that never heartbeats, and the live one ran outside its pool."""
    provider, launch, shared = _a_booting_machine_and_a_shared_join_token()
    machine = provider.machines[str(launch.pk)]
    provider.machines[str(launch.pk)] = dataclasses.replace(machine, agent_hosts=("127.0.0.2",))

    lost = _register_as(client, shared, machine.node_name, advertise_host="127.0.0.2")
    again = _register_as(client, shared, machine.node_name, advertise_host="127.0.0.2")
    assert lost.status_code == again.status_code == 201
    assert beat(client, again.json()["node_secret"]).status_code == 200

    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and str(launch.node_id) == again.json()["node_id"]


K8S_NODE = "ip-10-0-3-17.ec2.internal"


def _a_booting_kubernetes_machine_with_its_agent_pod(api_server, host: str = "127.0.0.2"):  # noqa: F811
    """A Kubernetes pool's placeholder running on its node, the agent DaemonSet's pod there at `host`, and the
    DaemonSet's shared join token; the agent has not registered yet."""
    make_pool(name="k8s-pool", provider="kubernetes")
    provider = get_provider("kubernetes")
    waiting_endpoint()
    tick(provider)
    [launch] = NodeLaunch.objects.all()
    placeholder = api_server.pods[f"inferplane-capacity-{launch.pk}"]
    placeholder["spec"]["nodeName"], placeholder["status"]["phase"] = K8S_NODE, "Running"
    api_server.pods["inferplane-agent-x7k2p"] = _agent_pod("inferplane-agent-x7k2p", K8S_NODE, host)
    return provider, launch, create_join_token(SYSTEM, name="daemonset").plain


@pytest.mark.django_db(transaction=True)
def test_a_shared_join_token_holder_who_knows_the_agent_pods_ip_cannot_take_the_booting_kubernetes_machine(
        client, api_server):  # noqa: F811
    """The agent pod's IP is no secret (any pod of the cluster may list or guess it; on the host's network it is the
    node's IP, which an EKS node's name spells): a holder of the shared join token who registers under the node's name
    at that IP before the agent does, and heartbeats, must not become the machine; the agent, whose registration
    carries its pod's projected service-account token (reviewed by the API server), does. Before, the first node
    registered at the pod's IP was linked: the thief got the launch, its endpoint's replicas and their prompts."""
    provider, launch, shared = _a_booting_kubernetes_machine_with_its_agent_pod(api_server)

    thief = _register_as(client, shared, K8S_NODE, advertise_host="127.0.0.2")
    assert thief.status_code == 201 and beat(client, thief.json()["node_secret"]).status_code == 200
    tick(provider)
    launch.refresh_from_db()
    assert launch.node_id is None and launch.state == LaunchState.LAUNCHING

    own = _register_as(client, shared, K8S_NODE, advertise_host="127.0.0.2",
                       pod_token=api_server.issue_pod_token("inferplane-agent-x7k2p"))
    assert own.status_code == 201, own.content
    assert beat(client, own.json()["node_secret"]).status_code == 200
    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and str(launch.node_id) == own.json()["node_id"]


@pytest.mark.django_db(transaction=True)
def test_a_registration_whose_pod_token_the_api_server_refuses_or_names_another_pod_is_refused_and_writes_nothing(
        client, api_server):  # noqa: F811
    """A token that is no pod's, one for another audience, another node's agent pod's, or a pod's of another service
    account: 401 naming why, no node written and the join token's use not spent; the API server not answering: a 503
    the agent retries. The machine's agent, registering after them all, is still the machine."""
    provider, launch, shared = _a_booting_kubernetes_machine_with_its_agent_pod(api_server)
    api_server.pods["inferplane-agent-q9v4m"] = _agent_pod("inferplane-agent-q9v4m", "ip-10-0-9-40.ec2.internal",
                                                           "127.0.0.4")
    api_server.pods["monitoring-x1"] = _agent_pod("monitoring-x1", K8S_NODE, "127.0.0.5")
    api_server.pods["monitoring-x1"]["spec"]["serviceAccountName"] = "default"
    # Another environment's agent in the same cluster (staging's namespace): its account has the agent's name.
    api_server.pods["inferplane-agent-s3t8w"] = _agent_pod("inferplane-agent-s3t8w", K8S_NODE, "127.0.0.6")
    api_server.pods["inferplane-agent-s3t8w"]["metadata"]["namespace"] = "inferplane-staging"
    refusals = {
        "eyJhbGciOiJSUzI1NiJ9.made-up.sig": "invalid bearer token",
        api_server.issue_pod_token("inferplane-agent-x7k2p", audience="https://kubernetes.default.svc"):
            "invalid bearer token",
        api_server.issue_pod_token("inferplane-agent-q9v4m"): "on node ip-10-0-9-40.ec2.internal, not of the agent",
        api_server.issue_pod_token("monitoring-x1"): "not the agent's service account",
        api_server.issue_pod_token("inferplane-agent-s3t8w"): "not the agent's service account",
    }
    for pod_token, reason in refusals.items():
        refused = _register_as(client, shared, K8S_NODE, advertise_host="127.0.0.2", pod_token=pod_token)
        assert refused.status_code == 401 and reason in refused.json()["error"]["message"], refused.content
    api_server.reviews_unreachable = True
    unanswered = _register_as(client, shared, K8S_NODE, advertise_host="127.0.0.2",
                              pod_token=api_server.issue_pod_token("inferplane-agent-x7k2p"))
    assert unanswered.status_code == 503 and unanswered["Retry-After"] == "1"
    assert not Node.objects.exists()
    assert JoinToken.objects.get(name="daemonset").num_uses == 0

    api_server.reviews_unreachable = False
    own = _register_as(client, shared, K8S_NODE, advertise_host="127.0.0.2",
                       pod_token=api_server.issue_pod_token("inferplane-agent-x7k2p"))
    assert own.status_code == 201 and beat(client, own.json()["node_secret"]).status_code == 200
    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and str(launch.node_id) == own.json()["node_id"]


@pytest.mark.django_db(transaction=True)
def test_while_the_agent_pods_cannot_be_listed_only_a_node_registered_by_a_reviewed_agent_pod_token_takes_the_machine(
        client, api_server, monkeypatch):  # noqa: F811
    """The worker cannot list the agent pods (then it knows neither their IPs nor uids): a node registered without a
    pod token (a shared join token's holder, or an agent of the release before) under the machine's name is still not
    the machine; one whose token the API server reviewed as the agent pod on that node is."""
    provider, launch, shared = _a_booting_kubernetes_machine_with_its_agent_pod(api_server)
    monkeypatch.setattr(kubernetes, "AGENT_SELECTOR", "app.kubernetes.io/component=agent,unreadable=x")
    monkeypatch.setattr(kubernetes.KubernetesApi, "list_pods", _refusing_agent_lists(kubernetes.KubernetesApi.list_pods))

    thief = _register_as(client, shared, K8S_NODE, advertise_host="127.0.0.9")
    assert thief.status_code == 201 and beat(client, thief.json()["node_secret"]).status_code == 200
    tick(provider)
    launch.refresh_from_db()
    assert launch.node_id is None and launch.state == LaunchState.LAUNCHING

    own = _register_as(client, shared, K8S_NODE, advertise_host="127.0.0.2",
                       pod_token=api_server.issue_pod_token("inferplane-agent-x7k2p"))
    assert own.status_code == 201 and beat(client, own.json()["node_secret"]).status_code == 200
    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and str(launch.node_id) == own.json()["node_id"]


def _refusing_agent_lists(list_pods):
    def listing(self, namespace, label_selector):
        if "unreadable" in label_selector:
            raise ProviderError("Kubernetes refused to list pods (403): forbidden")
        return list_pods(self, namespace, label_selector)
    return listing


@pytest.mark.django_db
def test_a_pod_token_sent_to_a_control_plane_outside_kubernetes_is_refused_with_the_reason(client, settings, monkeypatch):
    """A pooled agent pointed at a control plane that cannot ask any API server to review its token: a 401 saying so,
    not a node that no pool would ever link (nor a 500)."""
    settings.K8S_API_URL = ""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    shared = create_join_token(SYSTEM, name="daemonset").plain

    refused = _register_as(client, shared, K8S_NODE, pod_token="eyJhbGciOiJSUzI1NiJ9.pod.sig")

    assert refused.status_code == 401 and "not inside a Kubernetes cluster" in refused.json()["error"]["message"]
    assert not Node.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_while_the_agent_pods_cannot_be_listed_an_agent_whose_registration_answer_was_lost_joins_as_its_live_node(
        client, api_server, monkeypatch):  # noqa: F811
    """The worker cannot list the agent pods (a transient 403 or 5xx: no agent hosts known), and the machine's agent,
    its pod token reviewed, registers; the answer is lost on the way back, so it registers again with its pod's token
    and heartbeats as that second node. Both nodes are the agent pod's: only the one that heartbeats is the machine.
    Before, the first, whose secret nobody holds, was linked (the heartbeat was asked for only at a known host): the
    launch JOINED a node that never heartbeats, the live one ran outside its pool."""
    provider, launch, shared = _a_booting_kubernetes_machine_with_its_agent_pod(api_server)
    monkeypatch.setattr(kubernetes, "AGENT_SELECTOR", "app.kubernetes.io/component=agent,unreadable=x")
    monkeypatch.setattr(kubernetes.KubernetesApi, "list_pods", _refusing_agent_lists(kubernetes.KubernetesApi.list_pods))

    lost = _register_as(client, shared, K8S_NODE, advertise_host="127.0.0.2",
                        pod_token=api_server.issue_pod_token("inferplane-agent-x7k2p"))
    again = _register_as(client, shared, K8S_NODE, advertise_host="127.0.0.2",
                         pod_token=api_server.issue_pod_token("inferplane-agent-x7k2p"))
    assert lost.status_code == again.status_code == 201
    assert beat(client, again.json()["node_secret"]).status_code == 200
    tick(provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and str(launch.node_id) == again.json()["node_id"]


@pytest.mark.django_db(transaction=True)
def test_a_pod_token_review_the_api_server_throttles_is_a_503_the_agent_retries_not_a_refusal(
        client, api_server):  # noqa: F811
    """The API server's 429 (API Priority and Fairness: many machines registering at once) says nothing of the pod's
    token: the agent gets a 503 to retry, nothing is written and no use of the join token is spent. Before, it was a 401
    "the pod's service-account token was refused" (and the control plane logged the token refused)."""
    provider, launch, shared = _a_booting_kubernetes_machine_with_its_agent_pod(api_server)
    api_server.reviews_throttled = True
    throttled = _register_as(client, shared, K8S_NODE, advertise_host="127.0.0.2",
                             pod_token=api_server.issue_pod_token("inferplane-agent-x7k2p"))
    assert throttled.status_code == 503, throttled.content
    assert not Node.objects.exists() and JoinToken.objects.get(name="daemonset").num_uses == 0


def test_pod_token_reviews_run_a_few_at_a_time_per_process_while_the_api_server_is_slow(monkeypatch):
    """Any holder of the shared join token may send registrations with made-up pod tokens, each a TokenReview the web
    pod waits on (up to the client's timeouts while the API server is slow or queues the web pods' flow): at most
    `MAX_AGENT_LOOKUPS` run at once per process, the rest wait briefly (then a 503 the agent retries). Before, every
    one ran at once: a flood held a web thread each and queued the agents' own reviews behind it."""
    release, lock = threading.Event(), threading.Lock()
    running, peak = [0], [0]

    def slow_review(token, node_name):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        release.wait(5)
        with lock:
            running[0] -= 1
        return "a-pod-uid"

    monkeypatch.setattr(kubernetes, "reviewed_agent_pod", slow_review)
    request = RegisterRequest(join_token="inferplane_join_x", name=K8S_NODE, gpu_type="cpu", num_gpus=0,
                              gpu_memory_mb=0, num_cpus=8, memory_mb=64_000, agent_version="0.1.0",
                              pod_token="eyJhbGciOiJSUzI1NiJ9.made-up.sig")
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(services._reviewed_agent_pod(request)))
               for _ in range(3 * services.MAX_AGENT_LOOKUPS)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    release.set()
    for thread in threads:
        thread.join(10)
    assert peak[0] <= services.MAX_AGENT_LOOKUPS
    assert answers == ["a-pod-uid"] * len(threads)  # the waiting ones reviewed once a slot was free
