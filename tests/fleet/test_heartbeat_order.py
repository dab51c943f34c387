"""Heartbeats are numbered by their agent process (`Heartbeat.boot_id`, `Heartbeat.sequence`): one delayed in flight
(a retry, a slow proxy) that arrives after a newer one changes nothing; a restarted agent, and one older than the
numbering, are taken as before."""

import json
import uuid

import pytest

from controlplane.accounts.services import SYSTEM
from controlplane.clock import database_time_ago
from endpoints.fleet import services
from endpoints.fleet.services import create_join_token
from endpoints.models import ModelFacts, Replica
from endpoints.nodes.models import Node
from endpoints.replicas import apply_replica_report
from endpoints.scheduler import reconcile_endpoint
from gpu_agent.protocol import Heartbeat, ModelInfo, NodeState, ReplicaState, ReplicaStatus, WeightsStatus
from tests.factories import EndpointFactory
from tests.test_agent_api import register

pytestmark = pytest.mark.django_db


def numbered_beat(client, secret, boot_id, sequence, replicas=()):
    """A heartbeat as a numbering agent sends it (the numbers added by hand, so the body is the same on any code)."""
    body = Heartbeat(agent_version="0.1.0", num_cpus=2, memory_mb=24000, memory_used_mb=1000,
                     replicas=list(replicas)).to_dict()
    if sequence is not None:
        body |= {"boot_id": boot_id, "sequence": sequence}
    return client.post("/agent/v1/heartbeat", json.dumps(body), content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {secret}")


@pytest.fixture
def node_with_replica(client):
    answer = register(client, create_join_token(SYSTEM, name="rack").plain).json()
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)
    assert str(replica.node_id) == answer["node_id"]
    return answer["node_secret"], replica


def report(replica, state):
    return ReplicaStatus(str(replica.pk), state, address="http://127.0.0.1:20001")


def test_a_heartbeat_arriving_after_a_newer_one_does_not_take_a_ready_replica_back_to_starting(
    client, node_with_replica
):
    secret, replica = node_with_replica
    boot = uuid.uuid4().hex
    # The agent sent 1 (STARTING) then 2 (READY); 2 arrives first, 1 after it (a retry through a slow proxy).
    assert numbered_beat(client, secret, boot, 2, [report(replica, ReplicaState.READY)]).status_code == 200
    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY
    late = numbered_beat(client, secret, boot, 1, [report(replica, ReplicaState.STARTING)])
    assert late.status_code == 200
    assert [spec["replica_id"] for spec in late.json()["desired"]] == [str(replica.pk)]  # answered as any heartbeat
    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY  # before: STARTING, until the next heartbeat
    # A repeat of the newest is no newer either; the next one is taken.
    assert numbered_beat(client, secret, boot, 2, [report(replica, ReplicaState.STARTING)]).status_code == 200
    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY
    assert numbered_beat(client, secret, boot, 3, [report(replica, ReplicaState.STARTING)]).status_code == 200
    replica.refresh_from_db()
    assert replica.state == ReplicaState.STARTING  # the engine did restart: a newer word is taken


def test_a_late_heartbeat_does_not_bring_back_a_node_gone_offline_since(client, node_with_replica):
    secret, _replica = node_with_replica
    boot = uuid.uuid4().hex
    assert numbered_beat(client, secret, boot, 5, []).status_code == 200
    Node.objects.update(state=NodeState.OFFLINE, state_before_offline=NodeState.READY)  # the sweep, after silence
    assert numbered_beat(client, secret, boot, 4, []).json()["node_state"] == NodeState.OFFLINE
    assert Node.objects.get().state == NodeState.OFFLINE
    assert numbered_beat(client, secret, boot, 6, []).json()["node_state"] == NodeState.READY


def test_a_restarted_agent_counting_from_one_again_and_an_agent_older_than_the_numbers_are_taken(
    client, node_with_replica
):
    secret, replica = node_with_replica
    assert numbered_beat(client, secret, uuid.uuid4().hex, 40, [report(replica, ReplicaState.READY)]).status_code == 200
    # The agent restarted: a new boot id, its numbers from 1.
    assert numbered_beat(client, secret, uuid.uuid4().hex, 1, [report(replica, ReplicaState.STARTING)]).status_code == 200
    replica.refresh_from_db()
    assert replica.state == ReplicaState.STARTING
    # An agent of the previous release (no numbers) during a rolling deploy: taken, as before.
    assert numbered_beat(client, secret, "", None, [report(replica, ReplicaState.READY)]).status_code == 200
    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY


def test_a_report_of_a_heartbeat_overtaken_while_it_was_being_taken_is_not_applied(client, node_with_replica):
    """Two heartbeats of one agent in flight at once: the older passed the node's check first, and the newer was taken
    before the older's replica reports were: those are stale by then."""
    secret, replica = node_with_replica
    boot = uuid.uuid4().hex
    assert numbered_beat(client, secret, boot, 8, [report(replica, ReplicaState.READY)]).status_code == 200
    node = Node.objects.get()
    apply_replica_report(node, report(replica, ReplicaState.STARTING), heartbeat=(boot, 7))
    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY
    apply_replica_report(node, report(replica, ReplicaState.STARTING), heartbeat=(boot, 8))
    replica.refresh_from_db()
    assert replica.state == ReplicaState.STARTING


@pytest.mark.parametrize("changes, message", [
    ({"boot_id": "b" * 32}, "boot_id and sequence come together"),
    ({"sequence": 3}, "boot_id and sequence come together"),
    ({"boot_id": "b", "sequence": 0}, "sequence must be 1-"),
    ({"boot_id": "b", "sequence": 2**63}, "sequence must be 1-"),
    ({"boot_id": "b" * 65, "sequence": 1}, "boot_id must be at most 64"),
    ({"boot_id": "b\x00", "sequence": 1}, "boot_id must be at most 64 printable"),
    ({"boot_id": 5, "sequence": 1}, "boot_id: must be a string"),
    ({"boot_id": "b", "sequence": "1"}, "sequence: must be an integer"),
])
def test_a_malformed_heartbeat_number_is_a_400_naming_it(client, node_with_replica, changes, message):
    secret, _replica = node_with_replica
    body = {"agent_version": "0.1.0", "num_cpus": 2, "memory_mb": 24000, "memory_used_mb": 1} | changes
    response = client.post("/agent/v1/heartbeat", json.dumps(body), content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def beat_of(boot_id, sequence, replica, *, adapters=(), max_model_len=None):
    """A numbered heartbeat reporting `replica` READY with `adapters`, and its model read with `max_model_len`."""
    weights = [] if max_model_len is None else [WeightsStatus(
        source=replica.endpoint.model_source, cache_key="k", size_bytes=2 << 30, downloaded_bytes=2 << 30,
        complete=True, model_info=ModelInfo(max_model_len=max_model_len, architecture="LlamaForCausalLM"))]
    return Heartbeat(agent_version="0.1.0", num_cpus=2, memory_mb=24000, memory_used_mb=1000, boot_id=boot_id,
                     sequence=sequence, weights=weights,
                     replicas=[ReplicaStatus(str(replica.pk), ReplicaState.READY, address="http://127.0.0.1:20001",
                                             adapters=list(adapters))])


def test_adapters_and_model_facts_of_a_heartbeat_overtaken_while_it_was_being_taken_are_not_kept(
    node_with_replica, monkeypatch
):
    _secret, replica = node_with_replica
    boot = uuid.uuid4().hex
    services.record_heartbeat(Node.objects.get(), beat_of(boot, 6, replica, adapters=["a"]))
    take_node_report = services._take_node_report

    def newer_taken_meanwhile(node, heartbeat, status):
        taken = take_node_report(node, heartbeat, status)
        if heartbeat.sequence == 7:  # 7 passed the node's check; 8 is taken whole before 7's facts and reports
            services.record_heartbeat(Node.objects.get(), beat_of(boot, 8, replica, adapters=["a", "b"],
                                                                   max_model_len=8192))
        return taken

    monkeypatch.setattr(services, "_take_node_report", newer_taken_meanwhile)
    services.record_heartbeat(Node.objects.get(), beat_of(boot, 7, replica, adapters=["a"], max_model_len=4096))
    assert Node.objects.get().heartbeat_sequence == 8
    replica.refresh_from_db()
    # Before: ["a"] (what the gateway routes LoRA calls on: none of b's to this replica until the next heartbeat), and
    # the model's context as the older heartbeat read it (4096), learnt after the newer's.
    assert replica.adapters == ["a", "b"]
    facts = ModelFacts.objects.get(source=replica.endpoint.model_source)
    assert facts.max_model_len == 8192
    assert [claim["max_model_len"] for claim in facts.disputed.values()] == [8192]  # the node's claim, its newer


def test_an_agent_restored_from_a_snapshot_counting_below_the_stored_number_stays_online_and_is_taken_again(
    client, node_with_replica, settings
):
    """A VM or process snapshot restored resumes the agent with its boot id and an older count."""
    secret, replica = node_with_replica
    boot = uuid.uuid4().hex
    assert numbered_beat(client, secret, boot, 720, [report(replica, ReplicaState.READY)]).status_code == 200
    silent = Node.objects.filter(last_heartbeat_at__lt=database_time_ago(settings.NODE_HEARTBEAT_GRACE_S))
    # Restored 40 heartbeats back: within what a delay could be, so its reports are not taken; but it is alive.
    for sequence in range(680, 690):
        Node.objects.update(last_heartbeat_at=database_time_ago(600))  # the grace ran out between two
        assert numbered_beat(client, secret, boot, sequence, [report(replica, ReplicaState.STARTING)]).status_code == 200
        assert not silent.exists()  # before: its time never moved, and the sweep took the node OFFLINE
    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY and Node.objects.get().heartbeat_sequence == 720
    # Restored further back than any delay: its count is taken as the process's again, its reports too.
    assert numbered_beat(client, secret, boot, 12, [report(replica, ReplicaState.STARTING)]).status_code == 200
    replica.refresh_from_db()
    assert replica.state == ReplicaState.STARTING and Node.objects.get().heartbeat_sequence == 12
    assert numbered_beat(client, secret, boot, 13, [report(replica, ReplicaState.READY)]).status_code == 200
    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY
    # A late heartbeat never keeps a node the sweep took OFFLINE alive, nor brings it back.
    Node.objects.update(state=NodeState.OFFLINE, state_before_offline=NodeState.READY,
                        last_heartbeat_at=database_time_ago(600))
    assert numbered_beat(client, secret, boot, 11, []).json()["node_state"] == NodeState.OFFLINE
    assert silent.exists() and Node.objects.get().state == NodeState.OFFLINE  # its time did not move
