"""An engine serves no more context than the control plane bills its calls by, whoever described the model first.

The gateway reserves, bounds and bills each call by `Endpoint.context_length`: the endpoint's `max_model_len`, else
its model's as kept (`ModelFacts`; a catalogue copy's is the first node's to describe it, a different reading from
another node held as its dispute), else 4,096. Each replica's spec carries that figure once known
(`ReplicaSpec.billed_context_tokens`), and its agent launches the engine with no more (`engine.engine_context_length`).
Before, a node that read a larger context for a catalogue model launched its engine with its own figure while the
gateway billed by the kept one.
"""

from __future__ import annotations

import json

import pytest

from controlplane.accounts.services import SYSTEM
from endpoints import scheduler
from endpoints.autoscaler import Load
from endpoints.fleet.services import create_join_token
from endpoints.models import AllowedSource, Endpoint, ModelFacts, Replica
from endpoints.replicas import place_replica
from gpu_agent.protocol import Heartbeat, ModelInfo, ReplicaSpec, ReplicaState, ReplicaStatus, WeightsStatus
from gpu_agent.runtime.engine import build_engine_command
from gpu_agent.runtime.model_info import read_config_info
from tests.factories import EndpointFactory
from tests.test_agent_api import register

CATALOGUE_MODEL = "hf:inferplane-tests/tiny-llama"
IDLE = Load(0, 0, None, 0)

pytestmark = pytest.mark.django_db


@pytest.fixture
def node_secret(client):
    token = create_join_token(SYSTEM, name="test").plain
    return register(client, token, gpu_memory_mb=16_000).json()["node_secret"]


@pytest.fixture
def long_model(tmp_path):
    """This node's copy of the model, whose config it reads as 16,384 tokens."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 16384,
        "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000,
    }))
    assert read_config_info(tmp_path).max_model_len == 16384
    return tmp_path


def beat(client, secret, replicas=(), weights=(), *, older_agent=False) -> list[ReplicaSpec]:
    """A heartbeat of this release's agent, or of one older than `billed_context_tokens` (`older_agent`)."""
    body = Heartbeat(agent_version="0.1.0", num_cpus=2, memory_mb=24000, memory_used_mb=1000,
                     replicas=list(replicas), weights=list(weights), launches_within_billed_context=True).to_dict()
    if older_agent:
        del body["launches_within_billed_context"]  # that agent's `Heartbeat.to_dict()` had no such key
    response = client.post("/agent/v1/heartbeat", body, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert response.status_code == 200, response.content
    return [ReplicaSpec.from_dict(spec) for spec in response.json()["desired"]]


def read_as(max_model_len: int, scope: str = "") -> WeightsStatus:
    return WeightsStatus(source=CATALOGUE_MODEL, cache_key="local-x", size_bytes=1_000_000, downloaded_bytes=1_000_000,
                         complete=True, scope=scope,
                         model_info=ModelInfo(max_model_len=max_model_len, architecture="LlamaForCausalLM",
                                              num_params=400_000))


def launched_context(spec: ReplicaSpec, model_dir) -> str:
    argv = build_engine_command(spec, model_dir, port=20001, device="cpu").argv
    return argv[argv.index("--max-model-len") + 1]


def test_a_catalogue_models_engine_is_launched_with_the_kept_context_not_the_larger_one_its_node_reads(
        client, node_secret, long_model):
    AllowedSource.objects.create(pattern=CATALOGUE_MODEL)
    endpoint = EndpointFactory(model_source=CATALOGUE_MODEL, gpu_type="cpu", min_replicas=1)
    assert endpoint.weights_scope == ""  # one copy, one set of facts, for every tenant
    assert not ModelFacts.learn(CATALOGUE_MODEL, "", "first-node", {"max_model_len": 2048})
    scheduler.reconcile_endpoint(str(endpoint.pk), IDLE)

    [spec] = beat(client, node_secret, weights=[read_as(16384)])  # this node reads more: held as its dispute

    assert Endpoint.objects.get(pk=endpoint.pk).context_length == 2048  # what the gateway bills by
    assert launched_context(spec, long_model) == "2048"  # was 16384, its own reading
    assert spec.max_model_len is None and spec.billed_context_tokens == 2048


def test_an_engine_is_launched_with_its_nodes_reading_where_that_is_less_than_the_billed_context(
        client, node_secret, long_model):
    """vLLM would refuse more than it derives: the engine serves less than its calls are reserved (an engine's 400
    past it), never more."""
    AllowedSource.objects.create(pattern=CATALOGUE_MODEL)
    endpoint = EndpointFactory(model_source=CATALOGUE_MODEL, gpu_type="cpu", min_replicas=1)
    assert not ModelFacts.learn(CATALOGUE_MODEL, "", "first-node", {"max_model_len": 32768})
    scheduler.reconcile_endpoint(str(endpoint.pk), IDLE)

    [spec] = beat(client, node_secret, weights=[read_as(16384)])

    assert spec.billed_context_tokens == 32768 and launched_context(spec, long_model) == "16384"


def test_the_endpoints_own_limit_is_the_billed_context_and_a_model_not_described_yet_carries_none(
        client, node_secret, long_model):
    limited = EndpointFactory(model_source=CATALOGUE_MODEL, gpu_type="cpu", min_replicas=1, max_model_len=1024)
    scheduler.reconcile_endpoint(str(limited.pk), IDLE)
    [spec] = beat(client, node_secret)
    assert (spec.max_model_len, spec.billed_context_tokens) == (1024, 1024)
    assert launched_context(spec, long_model) == "1024"

    Endpoint.objects.filter(pk=limited.pk).update(max_model_len=None)
    [spec] = beat(client, node_secret)
    assert spec.billed_context_tokens is None  # the gateway assumes 4,096; the engine takes its node's reading
    assert launched_context(spec, long_model) == "16384"


def test_a_new_models_first_reading_is_learnt_before_the_ready_it_comes_with(client, node_secret):
    """The agent reads a model before it starts its engine, so its first heartbeat that reports the replica (STARTING
    or already READY) carries the reading, which the control plane takes before the replica's report: by READY the
    gateway bills by the engine's figure (32,768 here), not its 4,096 default."""
    endpoint = EndpointFactory(model_source=CATALOGUE_MODEL, gpu_type="cpu", min_replicas=1)
    scheduler.reconcile_endpoint(str(endpoint.pk), IDLE)
    replica = Replica.objects.get(endpoint=endpoint)
    assert Endpoint.objects.get(pk=endpoint.pk).known_context_length() is None

    ready = ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY, address="http://127.0.0.1:20001")
    [spec] = beat(client, node_secret, replicas=[ready], weights=[read_as(32768, scope=endpoint.weights_scope)])

    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY
    assert Endpoint.objects.get(pk=endpoint.pk).context_length == 32768
    assert spec.billed_context_tokens == 32768


def test_a_catalogue_endpoint_goes_only_to_nodes_whose_agent_launches_within_its_billed_context(client, node_secret):
    """An agent older than `billed_context_tokens` ignores it (a message's unknown keys are) and launches a catalogue
    copy's engine with its own reading, 16,384 where calls are billed by 2,048. Before, placement gave it the replica
    as any other node; now such an endpoint waits for a node whose heartbeat says its agent launches within the figure,
    and an endpoint with its own `max_model_len` (any agent launches with it) or a context not known yet still goes
    to the older one."""
    AllowedSource.objects.create(pattern=CATALOGUE_MODEL)
    catalogue = EndpointFactory(model_source=CATALOGUE_MODEL, gpu_type="cpu", min_replicas=0)
    limited = EndpointFactory(model_source=CATALOGUE_MODEL, gpu_type="cpu", min_replicas=0, max_model_len=1024)
    beat(client, node_secret, older_agent=True)
    assert place_replica(catalogue)[0] is not None  # its context not known yet: the spec carries none
    Replica.objects.all().delete()

    assert not ModelFacts.learn(CATALOGUE_MODEL, "", "first-node", {"max_model_len": 2048})
    assert place_replica(catalogue) == (None, "no cpu node runs an agent that launches engines within the context "
                                              "its calls are billed by (their agents are older)")
    assert place_replica(limited)[0] is not None

    beat(client, node_secret)  # the node's agent upgraded
    assert place_replica(catalogue)[0] is not None
