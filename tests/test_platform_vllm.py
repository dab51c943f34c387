"""The platform end to end on this machine: a live control plane, a real Celery worker, a real agent
process running real vLLM on the tiny model, and the official `openai` client through the gateway."""

from __future__ import annotations

import asyncio
import signal

import httpx
import openai
import pytest

from billing.models import UsageRecord
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Scope
from controlplane.accounts.services import SYSTEM, Actor
from endpoints.fleet.services import create_join_token
from endpoints.models import EndpointEvent, Replica
from endpoints.nodes.models import Node
from tests.conftest import start_agent, start_celery_worker, start_web_server, vllm_processes_of, wait_until
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

FAST = {"INFERPLANE_AGENT_HEARTBEAT_INTERVAL_S": "0.5", "INFERPLANE_AUTOSCALER_TICK_S": "1"}
MESSAGES = [{"role": "user", "content": "Say something"}]


@pytest.fixture
def platform(tmp_path):
    children = []
    web, base_url = start_web_server(tmp_path, extra_env=FAST)
    children.append(web)
    children.append(start_celery_worker(tmp_path, extra_env=FAST))
    organization = OrganizationFactory()
    user = UserFactory()
    MembershipFactory(organization=organization, user=user, role="owner")
    key = create_api_key(Actor(user=user), organization, name="e2e", scopes=[Scope.MANAGE, Scope.INFERENCE]).plain

    class Platform:
        url = base_url
        org = organization
        api_key = key
        api = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        logs = tmp_path

        @staticmethod
        def add_agent(name: str):
            agent = start_agent(tmp_path, base_url, create_join_token(SYSTEM, name=name).plain, name=name)
            children.append(agent)
            wait_until(lambda: Node.objects.filter(name=name, state="READY").exists(), 60, message=f"{name} to register")
            return agent

        @staticmethod
        def openai(**kwargs):
            return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, **kwargs)

    yield Platform
    for child in reversed(children):
        child.stop(timeout_s=60)


def wait_for_replica(endpoint_id: str, state: str, timeout_s: float = 240) -> Replica:
    return wait_until(
        lambda: Replica.objects.filter(endpoint_id=endpoint_id, state=state).select_related("node").first(),
        timeout_s, interval_s=0.5, message=f"a {state} replica",
    )


def test_an_agent_serves_a_replica_that_the_gateway_routes_to_and_drains_it_without_orphans(platform, tiny_model_dir):
    agent = platform.add_agent("cpu-node-1")
    created = platform.api.post("/api/v1/endpoints/", json={
        "name": "tiny", "model_source": str(tiny_model_dir), "gpu_type": "cpu", "min_replicas": 1, "max_replicas": 1,
        "max_model_len": 512, "max_num_seqs": 8,
    })
    assert created.status_code == 201, created.text
    endpoint_id = created.json()["id"]
    replica = wait_for_replica(endpoint_id, "READY")
    assert replica.node.name == "cpu-node-1" and replica.address.startswith("http://127.0.0.1:")
    detail = platform.api.get(f"/api/v1/endpoints/{endpoint_id}/").json()
    assert detail["state"] == "READY"
    assert [(r["state"], r["node"]) for r in detail["replicas"]] == [("READY", "cpu-node-1")]

    # Straight to the engine: closed without the replica's key; with it, a real vLLM answer with usage.
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
    assert httpx.post(f"{replica.address}/v1/completions", json=body, timeout=60).status_code == 401
    direct = httpx.post(f"{replica.address}/v1/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {replica.engine_api_key}"})
    assert direct.json()["usage"]["completion_tokens"] == 4

    # Through the gateway with the official client: plain, streamed and async.
    client = platform.openai()
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8)
    assert chat.usage.completion_tokens >= 1 and chat.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed_usage = chunks[-1].usage
    assert streamed_usage.completion_tokens >= 1

    async def async_call():
        async_client = openai.AsyncOpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=0)
        return await async_client.completions.create(model="tiny", prompt="Once", max_tokens=5)

    completion = asyncio.run(async_call())
    assert completion.usage.completion_tokens >= 1
    rows = wait_until(lambda: list(UsageRecord.objects.order_by("started_at")) if UsageRecord.objects.count() == 3 else None,
                      15, message="three usage rows")
    assert [r.completion_tokens for r in rows] == [chat.usage.completion_tokens, streamed_usage.completion_tokens,
                                                   completion.usage.completion_tokens]
    assert [r.prompt_tokens for r in rows] == [chat.usage.prompt_tokens, streamed_usage.prompt_tokens,
                                               completion.usage.prompt_tokens]
    assert {r.replica_id for r in rows} == {str(replica.pk)}

    # Kill the engine: the agent restarts it and the event log shows it.
    engines = vllm_processes_of(str(replica.pk))
    assert engines, "the engine process should carry the replica's marker"
    for process in engines:
        process.send_signal(signal.SIGKILL)
    wait_until(lambda: EndpointEvent.objects.filter(endpoint_id=endpoint_id, message__contains="crashed and was restarted").exists(),
               120, interval_s=0.5, message="the restart event")
    wait_until(lambda: httpx.get(f"{Replica.objects.get(pk=replica.pk).address}/health", timeout=2).status_code == 200
               if Replica.objects.get(pk=replica.pk).state == "READY" else False, 240, interval_s=1, message="READY again")
    # The restarted engine listens on a new port while the gateway's cache may still name the old one: the
    # first call is served all the same (the gateway reloads and tries the replica at its new address).
    assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).usage.completion_tokens >= 1

    # Pause: the replica drains and stops, and no engine process is left behind.
    assert platform.api.post(f"/api/v1/endpoints/{endpoint_id}/pause/").status_code == 200
    wait_until(lambda: Replica.objects.get(pk=replica.pk).state == "STOPPED", 120, interval_s=0.5, message="STOPPED")
    wait_until(lambda: not vllm_processes_of(str(replica.pk)), 30, message="no engine process")
    agent.stop(timeout_s=60)
    assert agent.process.returncode is not None
