"""Tool-call parsers: named per endpoint (the model family's by default), known to vLLM, on the engine's command line."""

import pytest

from endpoints.catalogue import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    default_reasoning_parser,
    default_tool_call_parser,
)
from gpu_agent.protocol import ReplicaSpec
from gpu_agent.runtime.engine import build_engine_command
from tests.factories import EndpointFactory

VALID = {"name": "agent", "model_source": "hf:meta-llama/Llama-3.1-8B-Instruct", "gpu_type": "l4"}


def test_the_catalogues_parser_names_are_the_ones_the_shipped_vllm_knows():
    tool_parsers = pytest.importorskip("vllm.tool_parsers")
    reasoning = pytest.importorskip("vllm.reasoning")
    assert set(TOOL_CALL_PARSERS) == set(tool_parsers.ToolParserManager.list_registered())
    manager = reasoning.ReasoningParserManager
    assert set(REASONING_PARSERS) == set(manager.reasoning_parsers) | set(manager.lazy_parsers)


@pytest.mark.parametrize("source, parser", [
    ("hf:meta-llama/Llama-3.1-8B-Instruct", "llama3_json"),
    ("hf:meta-llama/Llama-3.3-70B-Instruct@main", "llama3_json"),
    ("hf:meta-llama/Llama-4-Scout-17B-16E-Instruct", "llama4_pythonic"),
    ("hf:Qwen/Qwen2.5-7B-Instruct", "hermes"),
    ("hf:Qwen/Qwen3-Coder-30B-A3B-Instruct", "qwen3_coder"),
    ("hf:NousResearch/Hermes-3-Llama-3.1-8B", "hermes"),
    ("hf:mistralai/Mistral-7B-Instruct-v0.3", "mistral"),
    ("s3://models/tiny", ""),
])
def test_the_default_tool_call_parser_follows_the_model_family(source, parser):
    assert default_tool_call_parser(source) == parser
    assert parser == "" or parser in TOOL_CALL_PARSERS


def test_a_reasoning_model_gets_its_reasoning_parser_and_others_none():
    assert default_reasoning_parser("hf:deepseek-ai/DeepSeek-R1-Distill-Qwen-7B") == "deepseek_r1"
    assert default_reasoning_parser("hf:meta-llama/Llama-3.1-8B-Instruct") == ""


@pytest.mark.django_db
def test_an_endpoint_created_without_a_parser_gets_its_familys_and_may_name_one_or_none(owner_client):
    created = owner_client.post("/api/v1/endpoints/", VALID, format="json")
    assert created.status_code == 201 and created.json()["tool_call_parser"] == "llama3_json"
    url = f"/api/v1/endpoints/{created.json()['id']}/"
    assert owner_client.patch(url, {"max_replicas": 2}, format="json").json()["tool_call_parser"] == "llama3_json"
    assert owner_client.patch(url, {"tool_call_parser": "hermes"}, format="json").json()["tool_call_parser"] == "hermes"
    assert owner_client.patch(url, {"tool_call_parser": ""}, format="json").json()["tool_call_parser"] == ""
    assert owner_client.patch(url, {"tool_call_parser": "auto"}, format="json").json()["tool_call_parser"] == "llama3_json"


@pytest.mark.django_db
def test_an_unknown_parser_is_a_field_error(owner_client):
    response = owner_client.post("/api/v1/endpoints/", VALID | {"tool_call_parser": "--enable-everything"}, format="json")
    assert response.status_code == 400
    assert "tool_call_parser" in response.json()


@pytest.mark.django_db
def test_the_wizard_offers_the_familys_parser_and_saves_a_chosen_one(client, org):
    from controlplane.accounts.models import Membership
    from tests.factories import UserFactory

    user = UserFactory()
    Membership.objects.create(organization=org, user=user, role="owner")
    client.force_login(user)
    page = client.get("/console/endpoints/new/").content.decode()
    assert 'name="tool_call_parser"' in page and "Automatic (from the model" in page
    response = client.post("/console/endpoints/new/", VALID | {
        "name": "wizard-agent", "tool_call_parser": "hermes", "quantization": "none", "min_replicas": "0", "max_replicas": "1",
    })
    assert response.status_code == 302, response.content.decode()[:3000]
    from endpoints.models import Endpoint

    assert Endpoint.objects.get(name="wizard-agent").tool_call_parser == "hermes"


@pytest.mark.django_db
def test_the_replica_spec_carries_the_endpoints_parsers():
    from endpoints.fleet.services import replica_spec
    from endpoints.models import Replica

    endpoint = EndpointFactory(model_source="hf:deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", tool_call_parser="hermes")
    spec = replica_spec(Replica.objects.create(endpoint=endpoint))
    assert (spec.tool_call_parser, spec.reasoning_parser) == ("hermes", "deepseek_r1")


def _spec(**values) -> ReplicaSpec:
    return ReplicaSpec(replica_id="r-1", endpoint_id="e-1", served_model_name="m", model_source="/m", **values)


def test_the_engine_enables_auto_tool_choice_with_the_parser_and_the_reasoning_parser():
    argv = build_engine_command(_spec(tool_call_parser="hermes", reasoning_parser="qwen3"), "/m", port=1, device="cpu").argv
    assert "--enable-auto-tool-choice" in argv
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes"
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    plain = build_engine_command(_spec(), "/m", port=1, device="cpu").argv
    assert not {"--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser"} & set(plain)


@pytest.mark.parametrize("name", ["--api-key", "hermes --x", "Hermes"])
def test_a_replica_spec_refuses_a_parser_that_is_not_a_name(name):
    with pytest.raises(ValueError, match="parser"):
        _spec(tool_call_parser=name)
