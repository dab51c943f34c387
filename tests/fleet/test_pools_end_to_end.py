"""Issue #22's "Done when", with the real `local` provider: machines are agent processes on this machine.

- a serverless endpoint with no node gets a node launched, its first call answered (the `openai`
  client through the gateway; a streaming client sees `: provisioning a node`), and after idling both
  the replica and the node are gone (real vLLM, a real Celery worker and beat);
- two endpoints needing capacity at once launch one node when one fits both;
- a node that never joins is terminated at its deadline and replaced, the reason in the event log;
- a machine whose launch's answer was lost but whose agent joined is stopped when its node is released.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import httpx
import openai
import pytest
from django.utils import timezone

from controlplane import local_agents
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Scope
from controlplane.accounts.services import SYSTEM, Actor
from endpoints.fleet import pools
from endpoints.fleet.pool_services import create_node_pool
from endpoints.fleet.providers.base import ProviderUnreachable
from endpoints.fleet.providers.local import LocalProvider
from endpoints.models import Endpoint, EndpointEvent, EventKind, Replica
from endpoints.nodes.models import LaunchState, Node, NodeLaunch
from endpoints.scheduler import reconcile_endpoint
from gpu_agent.protocol import NodeState
from tests.conftest import start_celery_beat, start_celery_worker, start_web_server, wait_until
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory, UserFactory
from tests.processes import free_port

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Say something"}]
# Agents that start no warm standby engine: these tests place replicas, they do not serve them.
NO_ENGINES = {"agent_args": ["--no-standby", "--no-zygote"]}


@pytest.fixture
def pool_dir(tmp_path, settings):
    """The local provider's folder for this test; every agent left in it is stopped afterwards.

    NOTE: given 1 s to exit before it is killed with all it started (`local_agents.stop_agent`), not make stop's 10:
    an agent caught in a heartbeat finishes it first (up to its 10 s request timeout), and a whole-suite run waited out
    the 10 s here; no test looks at how this cleanup's agents exit."""
    directory = tmp_path / "local-pool"
    settings.LOCAL_POOL_DIR = str(directory)
    yield directory
    local_agents.stop_all(directory, wait_s=1)


def live_agents(directory: Path) -> list[local_agents.LocalAgent]:
    return [agent for agent in local_agents.read_agents(directory) if local_agents.is_alive(agent)]


def waiting_endpoint(**fields) -> Endpoint:
    """An endpoint that wants one replica now (its model is never started: it fails at once if it is)."""
    endpoint = EndpointFactory(gpu_type="cpu", model_source="/nonexistent/tiny-model", min_replicas=1, **fields)
    reconcile_endpoint(str(endpoint.pk))
    endpoint.refresh_from_db()
    return endpoint


def test_two_endpoints_needing_capacity_at_once_launch_one_node_that_takes_both(live_server_url, pool_dir, settings):
    settings.AGENT_CONTROL_PLANE_URL = live_server_url
    pool = create_node_pool(SYSTEM, name="cpu-local", gpu_type="cpu", provider="local", template=NO_ENGINES,
                            gpu_memory_mb=8192, min_nodes=0, max_nodes=3, idle_timeout_s=600, join_deadline_s=120)
    first, second = waiting_endpoint(), waiting_endpoint()
    assert (first.unplaced_replicas, second.unplaced_replicas) == (1, 1)
    assert first.status_message == "provisioning a node"

    assert pools.provision_tick() == 1
    [launch] = NodeLaunch.objects.filter(pool=pool)
    assert launch.state == LaunchState.LAUNCHING and "2 replicas of 2 endpoints fit on 1 new node" in launch.reason
    assert [agent.launch_id for agent in live_agents(pool_dir)] == [str(launch.pk)]

    node = wait_until(lambda: Node.objects.filter(name=f"cpu-local-{str(launch.pk)[:8]}").first(), 90,
                      interval_s=0.5, message="the launched agent to register")
    assert pools.provision_tick() == 0  # it joined; nothing more for the same demand
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and launch.node_id == node.pk
    for endpoint in (first, second):
        reconcile_endpoint(str(endpoint.pk))
    assert set(Replica.objects.filter(endpoint__in=[first, second]).values_list("node_id", flat=True)) == {node.pk}
    assert pools.provision_tick() == 0
    assert NodeLaunch.objects.filter(pool=pool).count() == 1 and len(live_agents(pool_dir)) == 1


def test_a_node_that_never_joins_is_terminated_at_its_deadline_and_replaced_with_the_reason_in_the_log(pool_dir, settings):
    nobody = f"http://127.0.0.1:{free_port()}"  # the agent retries its registration there forever
    settings.AGENT_CONTROL_PLANE_URL = nobody
    pool = create_node_pool(SYSTEM, name="lost", gpu_type="cpu", provider="local",
                            template=NO_ENGINES | {"control_plane_url": nobody}, gpu_memory_mb=8192,
                            min_nodes=0, max_nodes=2, idle_timeout_s=600, join_deadline_s=20)
    endpoint = waiting_endpoint()
    assert pools.provision_tick() == 1
    first = NodeLaunch.objects.get(pool=pool)
    [agent] = live_agents(pool_dir)
    assert agent.launch_id == str(first.pk)

    assert pools.provision_tick(now=timezone.now() + timedelta(seconds=21)) == 1
    first.refresh_from_db()
    assert first.state == LaunchState.FAILED and first.reason == "did not join within 20 s"
    wait_until(lambda: not local_agents.is_alive(agent), 15, message="the late agent's process to exit")
    replacement = NodeLaunch.objects.exclude(pk=first.pk).get(pool=pool)
    assert replacement.state == LaunchState.LAUNCHING
    assert [a.launch_id for a in live_agents(pool_dir)] == [str(replacement.pk)]
    logged = EndpointEvent.objects.filter(endpoint=endpoint, kind=EventKind.CAPACITY, message__contains="did not join")
    assert [event.message for event in logged] == [
        f"Node {str(first.pk)[:8]} of pool lost did not join within 20 s: terminated, launching a replacement"]


class AnswerLostOnce(LocalProvider):
    """The real local provider, whose first launch's answer is lost after the agent process started (a timeout)."""

    def __init__(self):
        self.lose = True

    def launch(self, pool, specs):
        results = super().launch(pool, specs)
        if self.lose:
            self.lose = False
            raise ProviderUnreachable("the answer was lost: read timeout")
        return results


def test_a_machine_that_joined_while_its_launch_went_unanswered_is_stopped_when_its_node_is_released(
        live_server_url, pool_dir, settings):
    # Before: the launch, JOINED with no provider id (its answer lost, its agent registered by the launch's token
    # before a tick sent it again), was finished TERMINATED on release with no termination asked for: the agent
    # process (the machine) ran on, its node retired.
    settings.AGENT_CONTROL_PLANE_URL = live_server_url
    pool = create_node_pool(SYSTEM, name="cpu-local", gpu_type="cpu", provider="local", template=NO_ENGINES,
                            gpu_memory_mb=8192, min_nodes=0, max_nodes=1, idle_timeout_s=60, join_deadline_s=120)
    endpoint = waiting_endpoint()
    provider = AnswerLostOnce()
    pools.provision_tick(provider_for=lambda name: provider)
    [launch] = NodeLaunch.objects.filter(pool=pool)
    assert launch.state == LaunchState.REQUESTED and launch.provider_id == ""
    [agent] = live_agents(pool_dir)
    node = wait_until(lambda: Node.objects.filter(name=f"cpu-local-{str(launch.pk)[:8]}").first(), 90,
                      interval_s=0.5, message="the launched agent to register")
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and launch.node_id == node.pk and launch.provider_id == ""

    Endpoint.objects.filter(pk=endpoint.pk).update(paused_at=timezone.now())  # no demand left: the node idles
    pools.provision_tick(provider_for=lambda name: provider)
    pools.provision_tick(now=timezone.now() + timedelta(seconds=61), provider_for=lambda name: provider)
    launch.refresh_from_db()
    assert launch.state == LaunchState.TERMINATED
    wait_until(lambda: not local_agents.is_alive(agent), 15, message="the released machine's agent to stop")
    assert live_agents(pool_dir) == []


FAST = {
    "INFERPLANE_AGENT_HEARTBEAT_INTERVAL_S": "0.5", "INFERPLANE_AUTOSCALER_TICK_S": "1",
    "INFERPLANE_NODE_POOLS_TICK_S": "1",
}
# NOTE: nothing after the first calls' answers needs the replica, and the node is never empty between its join and
# the held call's replica (placed at the tick after the join): both idle timeouts are only waited out, one after the
# other (5 s and 10 s were 7 s more of waiting for nothing).
ENDPOINT_IDLE_S = 3
NODE_IDLE_S = 5


@pytest.mark.vllm
def test_a_serverless_endpoint_with_no_node_gets_one_answers_and_then_both_replica_and_node_go(tiny_model_dir, tmp_path, pool_dir):
    web, base_url = start_web_server(tmp_path, extra_env=FAST)
    env = FAST | {"INFERPLANE_AGENT_CONTROL_PLANE_URL": base_url, "INFERPLANE_LOCAL_POOL_DIR": str(pool_dir)}
    children = [web, start_celery_worker(tmp_path, extra_env=env), start_celery_beat(tmp_path, extra_env=env)]
    try:
        organization, user = OrganizationFactory(), UserFactory()
        MembershipFactory(organization=organization, user=user, role="owner")
        key = create_api_key(Actor(user=user), organization, name="e2e", scopes=[Scope.MANAGE, Scope.INFERENCE]).plain
        pool = create_node_pool(SYSTEM, name="local", gpu_type="cpu", provider="local", template={},
                                gpu_memory_mb=8192, min_nodes=0, max_nodes=1, idle_timeout_s=NODE_IDLE_S,
                                join_deadline_s=240)
        api = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        created = api.post("/api/v1/endpoints/", json={
            "name": "sleepy", "model_source": str(tiny_model_dir), "gpu_type": "cpu", "min_replicas": 0,
            "max_replicas": 1, "max_model_len": 512, "max_num_seqs": 8, "cold_start_timeout_s": 300,
        })
        assert created.status_code == 201, created.text
        endpoint_id = created.json()["id"]
        Endpoint.objects.filter(pk=endpoint_id).update(idle_timeout_s=ENDPOINT_IDLE_S)  # below the API's floor
        assert not Node.objects.exists() and not NodeLaunch.objects.exists()

        # Two first calls, held together: the official client's, and a streaming one that reads the progress.
        comments: list[str] = []

        def stream():
            with httpx.stream("POST", f"{base_url}/v1/chat/completions", timeout=330,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"model": "sleepy", "messages": MESSAGES, "max_tokens": 3, "stream": True}) as response:
                assert response.status_code == 200
                comments.extend(line[2:] for line in response.iter_lines() if line.startswith(": "))

        streaming = threading.Thread(target=stream)
        streaming.start()
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=330)
        answer = client.chat.completions.create(model="sleepy", messages=MESSAGES, max_tokens=4)
        streaming.join(330)
        assert answer.usage.completion_tokens >= 1
        assert "provisioning a node" in comments, comments

        [launch] = NodeLaunch.objects.filter(pool=pool)
        assert launch.state == LaunchState.JOINED
        replica = Replica.objects.get(endpoint_id=endpoint_id)
        assert replica.node_id == launch.node_id
        [agent] = live_agents(pool_dir)
        events = list(EndpointEvent.objects.filter(endpoint_id=endpoint_id, kind=EventKind.CAPACITY).values_list("message", flat=True))
        assert any(message.startswith("Provisioning a node (pool local)") for message in events), events

        # Idle: the replica goes after the endpoint's idle timeout, then the node after the pool's.
        wait_until(lambda: Replica.objects.get(pk=replica.pk).state in ("STOPPED", "FAILED"), ENDPOINT_IDLE_S + 60,
                   interval_s=0.5, message="the replica to stop")
        launch = wait_until(lambda: NodeLaunch.objects.filter(pk=launch.pk, state=LaunchState.TERMINATED).first(),
                            NODE_IDLE_S + 60, interval_s=0.5, message="the node's launch to be TERMINATED")
        assert f"empty for {NODE_IDLE_S} s" in launch.reason
        node = Node.objects.get(pk=launch.node_id)
        assert node.state == NodeState.OFFLINE and node.secret_digest == ""
        wait_until(lambda: not local_agents.is_alive(agent), 20, message="the agent's process to exit")
        assert not live_agents(pool_dir)
        total_s, idle_s = launch.node_seconds()
        assert 0 < idle_s < total_s
        assert json.loads(api.get(f"/api/v1/endpoints/{endpoint_id}/").text)["state"] == "SCALED_TO_ZERO"
    finally:
        for child in reversed(children):
            child.stop(timeout_s=60)
