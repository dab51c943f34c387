"""GPU machines upgrade their agents on their own schedule, so agents older than the control plane keep heartbeating
for weeks. An agent refuses a whole heartbeat answer that holds a replica action it does not know (its protocol's
`ReplicaAction(value)`), and then starts, stops and drains none of its replicas while its heartbeats keep the node
READY: the control plane sends a node only the actions its agent says it knows (`protocol.understood_actions`)."""

import time

import pytest
from django.utils import timezone

from controlplane.accounts.services import SYSTEM
from endpoints import scheduler
from endpoints.autoscaler import Load
from endpoints.fleet.services import create_join_token
from endpoints.models import EndpointEvent, Replica
from endpoints.replicas import place_replica
from gpu_agent.protocol import ReplicaAction, ReplicaState
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db

# `gpu_agent/protocol.py`'s `ReplicaAction` before sleep mode (b216f16d^): an agent of then refused any other.
ACTIONS_AN_AGENT_BEFORE_SLEEP_KNEW = {"RUN", "DRAIN"}

REGISTRATION = {
    "name": "gpu-old", "gpu_type": "l4", "num_gpus": 1, "gpu_memory_mb": 24_000, "num_cpus": 8, "memory_mb": 64_000,
    "agent_version": "0.1.0", "engine_version": "0.6.4", "supported_quantizations": ["none"],
}


def heartbeat_of_an_agent_before_sleep_mode(replica: Replica, state: str) -> dict:
    """A heartbeat as that agent sent it (its `Heartbeat.to_dict()`, field for field)."""
    report = {"replica_id": str(replica.pk), "state": state, "address": "", "pid": None, "num_running": 0,
              "num_waiting": 0, "kv_cache_usage": 0.0, "tokens_per_s": 0.0, "num_prefix_cache_queries": 0,
              "num_prefix_cache_hits": 0, "num_restarts": 0, "failure_reason": "", "failure_permanent": False,
              "progress": "", "progress_percent": None, "engine_memory": None, "download_s": None,
              "engine_start_s": None, "adapters": [], "adapter_failures": {}}
    return {"agent_version": "0.1.0", "num_cpus": 8, "memory_mb": 64_000, "memory_used_mb": 1000, "cpu_percent": 0.0,
            "gpus": [], "replicas": [report], "weights": [], "disk_free_mb": None, "standby_ready": False}


@pytest.fixture
def sleep_mode(settings):
    settings.SLEEP_MODE = True
    settings.SLEEP_STOP_AFTER_S = 600
    return settings


@pytest.fixture
def node_secret(client):
    answer = client.post("/agent/v1/register", REGISTRATION | {"join_token": create_join_token(SYSTEM, name="t").plain},
                         content_type="application/json")
    assert answer.status_code == 201, answer.content
    return answer.json()["node_secret"]


def beat(client, secret, body) -> list[dict]:
    answer = client.post("/agent/v1/heartbeat", body, content_type="application/json",
                         HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert answer.status_code == 200, answer.content
    return answer.json()["desired"]


def ready_sleepy_replica() -> Replica:
    endpoint = EndpointFactory(gpu_type="l4", model_source="hf:org/model-1B", min_replicas=0, idle_timeout_s=60,
                               idle_action="sleep")
    replica, _ = place_replica(endpoint)
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.READY, ready_at=timezone.now())
    replica.refresh_from_db()
    return replica


def let_idle(replica: Replica) -> None:
    scheduler.reconcile_endpoint(str(replica.endpoint_id), Load(0, 0, time.time() - 3600, 0))


def test_an_idle_replica_on_an_agent_older_than_sleep_mode_drains_and_is_never_sent_a_sleep(client, sleep_mode,
                                                                                             node_secret):
    replica = ready_sleepy_replica()
    (spec,) = beat(client, node_secret, heartbeat_of_an_agent_before_sleep_mode(replica, "READY"))
    assert spec["action"] == "RUN"

    let_idle(replica)

    # Before: the replica went SLEEPING and the answer held "SLEEP", which that agent's parse refused (ValueError:
    # 'SLEEP' is not a valid ReplicaAction) on every heartbeat from then on.
    desired = beat(client, node_secret, heartbeat_of_an_agent_before_sleep_mode(replica, "READY"))
    assert {spec["action"] for spec in desired} <= ACTIONS_AN_AGENT_BEFORE_SLEEP_KNEW
    replica.refresh_from_db()
    assert replica.state == ReplicaState.DRAINING and [spec["action"] for spec in desired] == ["DRAIN"]
    assert any("its node's agent is older than sleep mode" in message for message in
               EndpointEvent.objects.filter(endpoint_id=replica.endpoint_id).values_list("message", flat=True))


def test_a_replica_put_to_sleep_before_its_agent_said_what_it_knows_is_told_to_drain(client, sleep_mode, node_secret):
    # A replica the control plane put to sleep before this check (or before the node's first heartbeat since it).
    replica = ready_sleepy_replica()
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.SLEEPING)
    # Before: "SLEEP" on every answer: the agent reconciled none of its replicas again.
    desired = beat(client, node_secret, heartbeat_of_an_agent_before_sleep_mode(replica, "READY"))
    assert [spec["action"] for spec in desired] == ["DRAIN"]
    # It drains and stops as any drained replica does.
    beat(client, node_secret, heartbeat_of_an_agent_before_sleep_mode(replica, "STOPPED"))
    replica.refresh_from_db()
    assert replica.state == ReplicaState.STOPPED


@pytest.mark.parametrize("said", [{"replica_actions": ["RUN", "DRAIN", "SLEEP"]},
                                  {"engine_sandbox": "landlock abi 6; own pid, mount and user namespaces"}],
                         ids=["lists its actions", "reports its sandbox (later than sleep mode)"])
def test_an_agent_that_knows_sleep_is_told_to_sleep(client, sleep_mode, node_secret, said):
    replica = ready_sleepy_replica()
    beat(client, node_secret, heartbeat_of_an_agent_before_sleep_mode(replica, "READY") | said)
    let_idle(replica)
    (spec,) = beat(client, node_secret, heartbeat_of_an_agent_before_sleep_mode(replica, "READY") | said)
    assert spec["action"] == ReplicaAction.SLEEP.value


def test_an_action_an_agent_does_not_know_is_never_sent_whatever_it_lists(client, sleep_mode, node_secret):
    replica = ready_sleepy_replica()
    body = heartbeat_of_an_agent_before_sleep_mode(replica, "READY") | {"replica_actions": ["RUN", "NAP"]}
    beat(client, node_secret, body)
    let_idle(replica)
    assert [spec["action"] for spec in beat(client, node_secret, body)] == ["DRAIN"]
    too_many = body | {"replica_actions": ["RUN"] * 17}
    refused = client.post("/agent/v1/heartbeat", too_many, content_type="application/json",
                          HTTP_AUTHORIZATION=f"Bearer {node_secret}")
    assert refused.status_code == 400
