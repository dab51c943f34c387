"""Quantization on the control plane: what each GPU type offers, the checkpoint a value needs (API and
console), the weight memory placement reserves, and the engine's own report checked against it."""

import re

import pytest

from controlplane.accounts.services import SYSTEM
from endpoints.catalogue import GPU_TYPES, QUANTIZATIONS
from endpoints.fleet.services import create_join_token
from endpoints.models import EndpointEvent, EventKind, ModelFacts, Replica
from endpoints.nodes.models import Node
from endpoints.placement import estimated_weights_mb, memory_needed_mb
from endpoints.replicas import memory_estimate_problem
from gpu_agent.protocol import (
    QUANTIZATION_FACTS,
    CheckpointQuantization,
    EngineMemory,
    Heartbeat,
    ModelInfo,
    ReplicaState,
    ReplicaStatus,
    WeightsStatus,
    quantizations_for,
)
from gpu_agent.runtime.engine import QUANTIZATION_PLANS, device_kind
from tests.conftest import REPO_ROOT
from tests.factories import EndpointFactory
from tests.test_agent_api import register

pytestmark = pytest.mark.django_db

LLAMA_8B = "hf:meta-llama/Llama-3.1-8B-Instruct"
LLAMA_8B_AWQ = "hf:hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4"
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128}
PLAIN_CONFIG = {"quant_method": "", "bits": None, "group_size": None}
GIB = 1024


def test_each_gpu_types_quantizations_follow_from_its_generation():
    for gpu in GPU_TYPES.values():
        assert gpu.quantizations == quantizations_for(gpu.compute_capability)
    assert GPU_TYPES["cpu"].quantizations == ("none", "fp8_per_channel")
    # FP8 on the Ampere cards is weight-only (Marlin); Ada and Hopper quantize activations too.
    assert GPU_TYPES["a10g"].quantization_mode("fp8") == GPU_TYPES["a100-80gb"].quantization_mode("fp8") == "weight-only"
    assert GPU_TYPES["l4"].quantization_mode("fp8") == GPU_TYPES["h100-80gb"].quantization_mode("fp8") == "weights and activations"
    # int8 is weight-only on every GPU (no online W8A8 int8 for dense layers in vLLM 0.32).
    assert {gpu.quantization_mode("int8") for gpu in GPU_TYPES.values() if gpu.name != "cpu"} == {"weight-only"}
    assert QUANTIZATIONS["int8"] == QUANTIZATION_FACTS["int8"].summary and "W8A8" not in QUANTIZATIONS["int8"]


# The engine each GPU type's agents are installed with (`make install`, the agent image): its lock.
ENGINE_LOCKS = {"cpu": ["cpu.txt"], "cuda": ["cuda.txt", "agent.txt"]}


def test_every_quantization_a_gpu_type_offers_runs_with_the_engine_its_agents_install():
    # An offered value whose engine module no agent of that type installs is accepted, then waits for capacity for
    # ever ("no cpu node supports quantization int8"), and a node pool launches machines that cannot take it either.
    for gpu in GPU_TYPES.values():
        device = device_kind(gpu.name)
        for quantization in gpu.quantizations:
            module = QUANTIZATION_PLANS[device][quantization].requires_module
            for lock in ENGINE_LOCKS[device] if module else ():
                pinned = (REPO_ROOT / "infra" / "python" / lock).read_text()
                # NOTE: the module's distribution has its name (torchao).
                assert re.search(rf"^{re.escape(module)}==", pinned, re.MULTILINE), (gpu.name, quantization, lock)


def test_int8_on_a_cpu_is_refused_with_a_field_error_since_no_cpu_agent_can_run_it(owner_client):
    spec = {"name": "tiny-int8", "model_source": "/models/tiny", "gpu_type": "cpu", "quantization": "int8"}
    refused = owner_client.post("/api/v1/endpoints/", spec, format="json")
    assert refused.status_code == 400
    assert refused.json()["quantization"] == ["'int8' is not available on cpu; choose one of: none, fp8_per_channel."]


def test_an_int8_cpu_endpoint_saved_before_cpu_dropped_int8_can_still_be_scaled_paused_and_moved_off_it(owner_client):
    """Every PATCH was judged by the pair as stored: `{"min_replicas": 0}` answered 400 on `quantization`."""
    endpoint = EndpointFactory(organization=owner_client.organization, gpu_type="cpu", quantization="int8",
                               model_source="hf:org/model-1B", min_replicas=1, max_replicas=2)
    url = f"/api/v1/endpoints/{endpoint.pk}/"

    scaled = owner_client.patch(url, {"min_replicas": 0}, format="json")
    windows = owner_client.patch(url, {"prewarm_windows": []}, format="json")
    same_pair = owner_client.patch(url, {"gpu_type": "cpu", "quantization": "int8", "max_replicas": 1}, format="json")
    moved = owner_client.patch(url, {"quantization": "none"}, format="json")

    assert (scaled.status_code, windows.status_code, same_pair.status_code) == (200, 200, 200), scaled.json()
    assert moved.status_code == 200 and moved.json()["quantization"] == "none"
    endpoint.refresh_from_db()
    assert (endpoint.min_replicas, endpoint.max_replicas, endpoint.quantization) == (0, 1, "none")
    back = owner_client.patch(url, {"quantization": "int8"}, format="json")
    assert back.status_code == 400 and "is not available on cpu" in back.json()["quantization"][0]


@pytest.fixture
def l4_node(client):
    token = create_join_token(SYSTEM, name="test").plain
    body = register(client, token, name="l4-1", gpu_type="l4", num_gpus=1, gpu_memory_mb=24_000,
                    supported_quantizations=list(GPU_TYPES["l4"].quantizations)).json()
    return Node.objects.get(pk=body["node_id"]), body["node_secret"]


def beat(client, secret, replicas=(), weights=()):
    body = Heartbeat(agent_version="0.1.0", num_cpus=2, memory_mb=24000, memory_used_mb=1000,
                     replicas=list(replicas), weights=list(weights)).to_dict()
    response = client.post("/agent/v1/heartbeat", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert response.status_code == 200, response.content
    return response.json()


# --- the checkpoint a value needs ----------------------------------------------------------------


def test_an_agents_reading_of_the_checkpoints_quantization_config_is_kept_for_the_model(client, l4_node):
    node, secret = l4_node
    endpoint = EndpointFactory(model_source=LLAMA_8B_AWQ, quantization="awq")
    Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING)
    info = ModelInfo(max_model_len=131072, architecture="LlamaForCausalLM", quantization=CheckpointQuantization(**AWQ_CONFIG))
    beat(client, secret, weights=[WeightsStatus(source=LLAMA_8B_AWQ, cache_key="k", size_bytes=5 << 30, complete=True, model_info=info)])
    assert ModelFacts.objects.get(source=LLAMA_8B_AWQ).checkpoint_quantization == AWQ_CONFIG
    assert ModelFacts.quantization_of(LLAMA_8B_AWQ, endpoint.weights_scope) == CheckpointQuantization(**AWQ_CONFIG)
    # An older agent that does not read it leaves what was known.
    beat(client, secret, weights=[WeightsStatus(source=LLAMA_8B_AWQ, cache_key="k", size_bytes=5 << 30, complete=True,
                                                model_info=ModelInfo(max_model_len=8192))])
    assert ModelFacts.objects.get(source=LLAMA_8B_AWQ).checkpoint_quantization == AWQ_CONFIG


def test_awq_on_a_checkpoint_that_is_not_awq_is_refused_with_a_field_error_at_create_and_update(owner_client):
    ModelFacts.objects.create(source=LLAMA_8B, checkpoint_quantization=PLAIN_CONFIG)
    spec = {"name": "llama", "model_source": LLAMA_8B, "gpu_type": "l4"}
    refused = owner_client.post("/api/v1/endpoints/", spec | {"quantization": "awq"}, format="json")
    assert refused.status_code == 400
    assert refused.json()["quantization"] == [
        "Quantization awq needs a checkpoint quantized with AWQ; this model's config.json declares no quantization_config."
    ]
    created = owner_client.post("/api/v1/endpoints/", spec | {"quantization": "fp8"}, format="json")
    assert created.status_code == 201, created.json()
    patched = owner_client.patch(f"/api/v1/endpoints/{created.json()['id']}/", {"quantization": "gptq"}, format="json")
    assert patched.status_code == 400 and "GPTQ" in patched.json()["quantization"][0]


def test_a_pre_quantized_checkpoint_must_be_served_with_its_own_method(owner_client):
    ModelFacts.objects.create(source=LLAMA_8B_AWQ, checkpoint_quantization=AWQ_CONFIG)
    spec = {"name": "llama-awq", "model_source": LLAMA_8B_AWQ, "gpu_type": "l4"}
    for wrong in ("none", "fp8", "gptq"):
        refused = owner_client.post("/api/v1/endpoints/", spec | {"quantization": wrong}, format="json")
        assert refused.status_code == 400 and "quantization" in refused.json(), wrong
    assert owner_client.post("/api/v1/endpoints/", spec | {"quantization": "none"}, format="json").json()["quantization"] == [
        "This model is a pre-quantized AWQ checkpoint (config.json); set quantization to awq."
    ]
    assert owner_client.post("/api/v1/endpoints/", spec | {"quantization": "awq"}, format="json").status_code == 201


def test_a_model_no_agent_has_read_yet_takes_any_quantization_its_gpu_offers(owner_client):
    response = owner_client.post("/api/v1/endpoints/", {"name": "fresh", "model_source": LLAMA_8B, "gpu_type": "l4",
                                                        "quantization": "awq"}, format="json")
    assert response.status_code == 201  # the agent refuses it after the download if the checkpoint is not AWQ
    # Learnt later: changing the quantization is checked, an unrelated edit is not blocked by it.
    ModelFacts.objects.create(source=LLAMA_8B, checkpoint_quantization=PLAIN_CONFIG)
    url = f"/api/v1/endpoints/{response.json()['id']}/"
    assert owner_client.patch(url, {"max_replicas": 2}, format="json").status_code == 200
    assert owner_client.patch(url, {"quantization": "gptq"}, format="json").status_code == 400
    changed = owner_client.patch(url, {"quantization": "int8", "gpus_per_replica": 2}, format="json")  # 8-bit needs two L4s
    assert changed.status_code == 200, changed.json()


@pytest.fixture
def console_client(client, org):
    from controlplane.accounts.models import Membership
    from tests.factories import UserFactory

    user = UserFactory()
    Membership.objects.create(organization=org, user=user, role="owner")
    client.force_login(user)
    return client


def test_the_wizard_says_what_each_quantization_means_on_the_chosen_gpu(console_client):
    ampere = console_client.get("/console/endpoints/quantizations/", {"gpu_type": "a100-80gb"}).content.decode()
    hopper = console_client.get("/console/endpoints/quantizations/", {"gpu_type": "h100-80gb"}).content.decode()
    assert "fp8 — weight-only here." in ampere and "fp8 — weights and activations here." in hopper
    cpu = console_client.get("/console/endpoints/quantizations/", {"gpu_type": "cpu"}).content.decode()
    assert 'value="awq"' not in cpu and 'value="int8"' not in cpu and 'value="fp8_per_channel"' in cpu


def test_the_console_form_shows_the_checkpoint_refusal_on_the_quantization_field(console_client):
    ModelFacts.objects.create(source=LLAMA_8B, checkpoint_quantization=PLAIN_CONFIG)
    response = console_client.post("/console/endpoints/new/", {
        "name": "wizard-awq", "model_source": LLAMA_8B, "gpu_type": "l4", "quantization": "gptq",
        "min_replicas": "0", "max_replicas": "1",
    })
    assert response.status_code == 400  # the form comes back with the field's error
    assert "needs a checkpoint quantized with GPTQ" in response.content.decode()


# --- weight memory -------------------------------------------------------------------------------


def test_placement_reserves_each_values_weight_factor_of_a_16_bit_checkpoint():
    eight_b = 8e9 * 2 / (1024 * 1024)
    for quantization in ("none", "fp8", "fp8_per_channel", "int8", "awq", "gptq"):
        endpoint = EndpointFactory(model_source=LLAMA_8B, gpu_type="h100-80gb", quantization=quantization)
        assert estimated_weights_mb(endpoint) == pytest.approx(eight_b * QUANTIZATION_FACTS[quantization].weight_factor, abs=1)


def test_a_reported_awq_checkpoint_is_counted_as_stored_and_its_kv_cache_as_the_full_models(client, l4_node):
    endpoint = EndpointFactory(model_source=LLAMA_8B_AWQ, quantization="awq")
    ModelFacts.objects.create(source=LLAMA_8B_AWQ, scope=endpoint.weights_scope, weights_bytes=5 << 30)
    assert estimated_weights_mb(endpoint) == 5 * GIB  # the files are already 4-bit: not 0.3 of them again
    plain = EndpointFactory(model_source="hf:some-org/llama-16-bit", quantization="none")
    ModelFacts.objects.create(source=plain.model_source, scope=plain.weights_scope, weights_bytes=int(5 / 0.3 * GIB) << 20)
    # Same model size: the same KV cache, whatever its weights' format.
    kv_awq = memory_needed_mb(endpoint) / 1.1 - 5 * GIB
    kv_plain = memory_needed_mb(plain) / 1.1 - 5 / 0.3 * GIB
    assert kv_awq == pytest.approx(kv_plain, rel=0.01)


def test_an_unquantized_model_on_a_cpu_engine_reserves_its_float32_weights():
    endpoint = EndpointFactory(model_source="hf:org/model-1B", gpu_type="cpu", quantization="none")
    fp8 = EndpointFactory(model_source="hf:org/model-1B", gpu_type="cpu", quantization="fp8_per_channel")
    assert estimated_weights_mb(endpoint) == pytest.approx(1e9 * 2 / 2**20 * 2, abs=1)
    assert estimated_weights_mb(fp8) == pytest.approx(1e9 * 2 / 2**20 * 0.5, abs=1)


# --- the engine's own report -----------------------------------------------------------------------


def ready(replica, memory):
    return ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY, engine_memory=memory)


def test_an_engine_holding_what_placement_estimated_is_recorded_without_an_event(client, l4_node):
    node, secret = l4_node
    endpoint = EndpointFactory(model_source=LLAMA_8B, quantization="fp8")
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING)
    beat(client, secret, replicas=[ready(replica, EngineMemory(weights_mb=8694, kv_cache_mb=10107))])
    replica.refresh_from_db()
    assert (replica.engine_weights_mb, replica.engine_kv_cache_mb) == (8694, 10107)
    assert not EndpointEvent.objects.filter(endpoint=endpoint, kind=EventKind.CAPACITY).exists()


def test_an_engine_holding_far_more_than_placement_estimated_makes_an_event_operators_see(client, l4_node):
    node, secret = l4_node
    # What the old int8 mapping did: vLLM's MoE-only int8 left a dense model's weights in 16-bit.
    endpoint = EndpointFactory(model_source=LLAMA_8B, quantization="int8")
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING)
    beat(client, secret, replicas=[ready(replica, EngineMemory(weights_mb=15667, kv_cache_mb=2048))])
    beat(client, secret, replicas=[ready(replica, EngineMemory(weights_mb=15667, kv_cache_mb=2048))])  # once, not per heartbeat
    [event] = EndpointEvent.objects.filter(endpoint=endpoint, kind=EventKind.CAPACITY)
    assert event.message == (
        f"Replica {str(replica.pk)[:8]}: the engine's weights take 15667 MB, placement estimated 7629 MB "
        "(quantization int8 on l4)"
    )
    assert event.details == {"weights_mb": 15667, "kv_cache_mb": 2048}


def test_a_cpu_engine_whose_kv_cache_is_smaller_than_reserved_makes_no_event():
    endpoint = EndpointFactory(model_source="hf:org/model-1B", gpu_type="cpu", quantization="none")
    # The agent sizes a CPU engine's KV cache to what its sequences can fill, under the 1 GiB reserved.
    assert memory_estimate_problem(endpoint, EngineMemory(kv_cache_mb=16)) == ""
    assert memory_estimate_problem(endpoint, EngineMemory(kv_cache_mb=4096)) == (
        "the engine's KV cache takes 4096 MB, placement reserved 1024 MB"
    )
