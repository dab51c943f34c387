"""Gateway fixtures: live ASGI servers, mock OpenAI upstreams, real CPU engines and endpoints wired to them.

`vllm_engine` (tests/conftest.py) is the one real vLLM engine the package's vLLM modules share
(test_vllm_gateway, test_reservation_vllm, test_tool_calling_vllm) with tests/batches: it starts once, on the
test process's engine node (`tests.engines`).
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
from concurrent.futures import Future

import httpx
import openai
import pytest
from django.utils import timezone

from controlplane import secrets as secrets_at_rest
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Role, Scope
from controlplane.accounts.services import Actor
from controlplane.redis_client import get_redis
from endpoints.gateway import presence, traffic
from endpoints.models import Replica
from endpoints.nodes.models import Node
from endpoints.nodes.notify import endpoint_ready_channel
from gpu_agent.protocol import NodeState, ReplicaState
from gpu_agent.runtime.engine_guard import ENGINE_API_KEY_ENV
from tests.conftest import ChildProcess, child_env, free_port, start_web_server, wait_until
from tests.engines import ENGINE_CONTEXT, ENGINE_KEY, ENGINE_NAME  # noqa: F401 - the package's modules import them here
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory, UserFactory


def wait_until_healthy(address: str, what: str) -> None:
    """Wait for a fake engine at `address` to answer its `/health`."""

    def healthy():
        try:
            return httpx.get(f"{address}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, 30, message=what)


@pytest.fixture
def scripted_responses_engine(tmp_path):
    """The address of the scripted `/v1/responses` engine (`tests.fakes.responses_engine`), running for the test."""
    port = free_port()
    child = ChildProcess([sys.executable, "-m", "tests.fakes.responses_engine", "--port", str(port)], child_env(),
                         tmp_path / "responses-engine.log")
    address = f"http://127.0.0.1:{port}"
    wait_until_healthy(address, "the scripted engine")
    yield address
    child.kill()  # a test double: nothing to finish
    child.stop()


@pytest.fixture
def start_mock_upstream(tmp_path):
    started: list[ChildProcess] = []

    def start(*, token_delay_ms: float = 0, fail_after_chunks: int | None = None, engine_key: str = "",
              one_write: bool = False, prefix_cache: bool = False, prefill_ms: float = 0,
              whole_answer_bytes: int = 0, prompt_tokens: int | None = None, cut_whole_answers: int = 0,
              logprob_token_bytes: int | None = None, hold_stream_ends: bool = False) -> str:
        port = free_port()
        args = [sys.executable, "-m", "tests.fakes.mock_openai", "--port", str(port), "--token-delay-ms", str(token_delay_ms)]
        if fail_after_chunks is not None:
            args += ["--fail-after-chunks", str(fail_after_chunks)]
        if one_write:
            args.append("--one-write")
        if prefix_cache:
            args.append("--prefix-cache")
        if prefill_ms:
            args += ["--prefill-ms", str(prefill_ms)]
        if whole_answer_bytes:
            args += ["--whole-answer-bytes", str(whole_answer_bytes)]
        if logprob_token_bytes is not None:
            args += ["--logprob-token-bytes", str(logprob_token_bytes)]
        if prompt_tokens is not None:
            args += ["--prompt-tokens", str(prompt_tokens)]
        if cut_whole_answers:
            args += ["--cut-whole-answers", str(cut_whole_answers)]
        if hold_stream_ends:
            args.append("--hold-stream-ends")
        env = child_env() | ({ENGINE_API_KEY_ENV: engine_key} if engine_key else {})
        child = ChildProcess(args, env, tmp_path / f"mock-{port}.log")
        started.append(child)
        address = f"http://127.0.0.1:{port}"
        wait_until_healthy(address, "mock upstream")
        return address

    def stop(address: str) -> None:
        """Stop the mock listening at `address` (an engine that died: its port refuses connections)."""
        port = int(address.rsplit(":", 1)[1])
        for child in started:
            if child.process.args[child.process.args.index("--port") + 1] == str(port):
                child.stop()

    start.stop = stop
    yield start
    for child in started:
        # NOTE: killed, not stopped: a test double has nothing to finish, and its graceful stop (uvicorn's shutdown, the
        # interpreter's exit; up to 1 s with a call still held) cost ~0.2 s a test or more
        child.kill()
        child.stop()


@pytest.fixture
def gateway(transactional_db, tmp_path, web_zygote):
    child, base_url = start_web_server(tmp_path, name="gateway", zygote=web_zygote)
    yield base_url
    child.stop()


# NOTE: a held call looks whether its endpoint was paused, deleted, out of capacity or out of starts at each re-wake,
# reading the endpoint through the gateway's cache (`ENDPOINT_CACHE_S`, 2 s, reloaded behind a stale read): at the
# production 5 s the call was told at the second re-wake, ~10 s in. A re-wake every 0.5 s tells it within ~3 s, and a
# call never told still waits its whole cold-start timeout.
REWAKE_EVERY_S = "0.5"


@pytest.fixture
def rewaking_gateway(transactional_db, tmp_path, web_zygote):
    """A gateway whose held calls re-wake (and look at their endpoint again) every `REWAKE_EVERY_S`."""
    child, base_url = start_web_server(tmp_path, name="gateway", zygote=web_zygote,
                                       extra_env={"INFERPLANE_GATEWAY_REWAKE_EVERY_S": REWAKE_EVERY_S})
    yield base_url
    child.stop()


@pytest.fixture
def tenant(transactional_db):
    """An organisation with an owner and an inference+manage key; `.client(base_url)` is an openai client."""
    return new_tenant()


def new_tenant():
    """What `tenant` gives: another organisation's each time."""
    organization = OrganizationFactory()
    user = UserFactory()
    MembershipFactory(organization=organization, user=user, role=Role.OWNER)
    created = create_api_key(Actor(user=user), organization, name="test", scopes=[Scope.INFERENCE, Scope.MANAGE])

    class Tenant:
        org = organization
        owner = user
        key = created.plain
        api_key = created.api_key

        @staticmethod
        def client(base_url: str, **kwargs) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{base_url}/v1", api_key=created.plain, max_retries=0, **kwargs)

        @staticmethod
        def async_client(base_url: str) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=created.plain, max_retries=0)

    return Tenant


def held_chat(gateway_url: str, key: str, endpoint) -> Future:
    """A chat call for `endpoint` made in a thread, returned once the gateway holds it (subscribed to the
    endpoint's READY channel): the future's result is the response."""
    answer: Future = Future()

    def call():
        try:
            answer.set_result(httpx.post(
                f"{gateway_url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                json={"model": endpoint.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}, timeout=60))
        except Exception as error:  # noqa: BLE001 - handed to the test through the future
            answer.set_exception(error)

    threading.Thread(target=call, daemon=True).start()
    wait_until(lambda: get_redis().pubsub_numsub(endpoint_ready_channel(endpoint.pk))[0][1] == 1 or answer.done(),
               30, message="the call to be held")
    assert not answer.done(), answer.result()  # held, not answered
    return answer


def counting_openai_client(base_url: str, key: str, monkeypatch) -> tuple[openai.OpenAI, list, list]:
    """The official client with its default retries: the requests it sent, and the waits it took between tries,
    recorded instead of slept (`SyncAPIClient._sleep_for_retry`, the client's own: patching `time.sleep` in its module
    patched it for the whole process, and a polling thread of the test's spun, appending, till memory ran out)."""
    sent, slept = [], []

    def record_wait(client, *, retries_taken, max_retries, options, response):
        slept.append(client._calculate_retry_timeout(max_retries - retries_taken, options,
                                                     response.headers if response is not None else None))

    monkeypatch.setattr(openai._base_client.SyncAPIClient, "_sleep_for_retry", record_wait)
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=2,
                           http_client=httpx.Client(event_hooks={"request": [sent.append]}))
    return client, sent, slept


def serve_endpoint(organization, *addresses: str, node_ports: tuple[int, int] = (1024, 65535), engine_key: str = "",
                   **spec):
    """An endpoint with one READY replica per upstream address, on a READY node (engine ports `node_ports`);
    `engine_key`: the key the replicas' engines were started with (a real engine answers no other)."""
    # NOTE: a random lookup, unique: two free ports asked for in turn may be the same port.
    lookup = secrets.token_hex(6)
    node = Node.objects.create(name=f"node-{lookup}", gpu_type="l4", num_gpus=1, gpu_memory_mb=24_000, memory_mb=64_000,
                               secret_lookup=lookup, secret_digest="x", state=NodeState.READY,
                               quantizations=["none"], last_heartbeat_at=timezone.now(),
                               # the mocks listen on ephemeral ports: the whole range is this node's
                               advertise_host="127.0.0.1", engine_port_min=node_ports[0], engine_port_max=node_ports[1])
    endpoint = EndpointFactory(organization=organization, max_model_len=2048, **spec)
    for address in addresses:
        replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY, address=address,
                                         ready_at=timezone.now())
        if engine_key:
            Replica.objects.filter(pk=replica.pk).update(encrypted_engine_key=secrets_at_rest.encrypt(engine_key))
    return endpoint


@pytest.fixture
def gateway_alone(monkeypatch):
    """This process's gateway, serving nothing yet, with no organisation of another test's."""
    monkeypatch.setattr(presence, "serving", {})
    monkeypatch.setattr(presence, "unfinished", {})
    monkeypatch.setattr(presence, "_repair", presence._Repair())
    monkeypatch.setattr(presence, "to_list", {})  # no organisation of another test's listed for the sweeper
    monkeypatch.setattr(traffic, "_registered", (os.getpid(), set()))
