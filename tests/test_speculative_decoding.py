"""Speculative decoding as an endpoint option: set through the API with field errors, documented in
the OpenAPI schema, carried to the agent in the replica spec (the draft read with the endpoint's
own credential), and turned into vLLM's `--speculative-config`."""

import json

import pytest

from endpoints.fleet.services import replica_spec
from endpoints.models import AllowedSource, Replica
from gpu_agent.protocol import ReplicaSpec, SpeculativeMethod, SpeculativeSpec
from gpu_agent.runtime.engine import build_engine_command
from gpu_agent.runtime.speculative import draft_problem
from gpu_agent.runtime.tiny_model import build_tiny_model
from tests.agent.conftest import make_spec
from tests.factories import EndpointFactory, make_credential

pytestmark = pytest.mark.django_db

VALID = {"name": "editor", "model_source": "hf:meta-llama/Llama-3.1-8B-Instruct", "gpu_type": "l4"}


def speculative_config(argv):
    return json.loads(argv[argv.index("--speculative-config") + 1])


def test_an_endpoint_is_created_with_ngram_speculation_and_shows_it_back(owner_client):
    created = owner_client.post("/api/v1/endpoints/", VALID | {
        "speculative_method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6, "prompt_lookup_min": 3,
    }, format="json")
    assert created.status_code == 201, created.json()
    body = created.json()
    assert (body["speculative_method"], body["num_speculative_tokens"]) == ("ngram", 5)
    assert (body["prompt_lookup_max"], body["prompt_lookup_min"], body["draft_model_source"]) == (6, 3, "")


def test_an_endpoint_without_the_option_does_no_speculation(owner_client):
    body = owner_client.post("/api/v1/endpoints/", VALID, format="json").json()
    assert body["speculative_method"] == "none"
    replica = Replica.objects.create(endpoint_id=body["id"])
    assert replica_spec(replica).speculative is None
    assert "--speculative-config" not in build_engine_command(replica_spec(replica), "/m", port=1, device="cuda").argv


@pytest.mark.parametrize(("changes", "field"), [
    ({"speculative_method": "medusa"}, "speculative_method"),
    ({"speculative_method": "draft"}, "draft_model_source"),  # a draft model without a source
    ({"speculative_method": "draft", "draft_model_source": "ftp://x/y"}, "draft_model_source"),
    ({"speculative_method": "draft", "draft_model_source": VALID["model_source"]}, "draft_model_source"),
    ({"speculative_method": "ngram", "draft_model_source": "hf:org/small"}, "draft_model_source"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"speculative_method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}, "prompt_lookup_min"),
    ({"speculative_method": "ngram", "prompt_lookup_max": 40}, "prompt_lookup_max"),
    ({"speculative_method": "ngram", "num_speculative_tokens": "many"}, "num_speculative_tokens"),
])
def test_bad_speculative_settings_are_400_with_field_errors(owner_client, changes, field):
    response = owner_client.post("/api/v1/endpoints/", VALID | changes, format="json")
    assert response.status_code == 400, response.json()
    assert field in response.json()


def test_a_draft_the_endpoints_credential_cannot_read_is_refused(owner_client):
    credential = make_credential(owner_client.organization, kind="hf")
    body = VALID | {"credential": str(credential.pk), "speculative_method": "draft"}
    refused = owner_client.post("/api/v1/endpoints/", body | {"draft_model_source": "s3://bucket/draft"}, format="json")
    assert refused.status_code == 400 and "draft_model_source" in refused.json()
    created = owner_client.post("/api/v1/endpoints/", body | {"draft_model_source": "hf:meta-llama/Llama-3.2-1B"}, format="json")
    assert created.status_code == 201, created.json()


def test_turning_speculation_off_needs_the_draft_source_cleared_too(owner_client):
    created = owner_client.post("/api/v1/endpoints/", VALID | {
        "speculative_method": "draft", "draft_model_source": "hf:meta-llama/Llama-3.2-1B"}, format="json").json()
    url = f"/api/v1/endpoints/{created['id']}/"
    assert owner_client.patch(url, {"speculative_method": "none"}, format="json").status_code == 400
    off = owner_client.patch(url, {"speculative_method": "none", "draft_model_source": ""}, format="json")
    assert off.status_code == 200 and off.json()["speculative_method"] == "none"


def test_the_draft_is_read_with_the_endpoints_own_credential_and_cached_for_its_organisation():
    credential = make_credential(EndpointFactory().organization, kind="hf")
    endpoint = EndpointFactory(organization=credential.organization, credential=credential,
                               speculative_method="draft", draft_model_source="hf:our-org/small-draft")
    spec = replica_spec(Replica.objects.create(endpoint=endpoint))
    assert spec.speculative.method == SpeculativeMethod.DRAFT
    assert spec.speculative.draft_source == "hf:our-org/small-draft"
    assert not spec.speculative.draft_use_fleet_credentials
    assert spec.speculative.draft_weights_scope == spec.weights_scope != ""
    # It travels to the agent and back intact.
    assert ReplicaSpec.from_dict(json.loads(json.dumps(spec.to_dict()))).speculative == spec.speculative


def test_a_catalogue_draft_without_a_credential_is_read_with_the_fleets_access_and_shared():
    AllowedSource.objects.create(pattern="hf:meta-llama/")
    endpoint = EndpointFactory(speculative_method="draft", draft_model_source="hf:meta-llama/Llama-3.2-1B")
    speculative = replica_spec(Replica.objects.create(endpoint=endpoint)).speculative
    assert speculative.draft_use_fleet_credentials and speculative.draft_weights_scope == ""


def test_the_engine_gets_ngram_prompt_lookup_as_vllms_speculative_config():
    spec = make_spec(speculative=SpeculativeSpec(
        method="ngram", num_speculative_tokens=5, prompt_lookup_max=6, prompt_lookup_min=3))
    for device in ("cpu", "cuda"):
        argv = build_engine_command(spec, "/m", port=1, device=device).argv
        assert speculative_config(argv) == {
            "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6, "prompt_lookup_min": 3,
        }


def test_the_engine_gets_the_local_copy_of_the_draft_model():
    spec = make_spec(speculative=SpeculativeSpec(method="draft", num_speculative_tokens=3, draft_source="/cache/draft"))
    argv = build_engine_command(spec, "/m", port=1, device="cuda").argv
    assert speculative_config(argv) == {"method": "draft_model", "model": "/cache/draft", "num_speculative_tokens": 3}


@pytest.mark.parametrize("bad", [
    {"method": "none"},
    {"method": "ngram", "num_speculative_tokens": 0},
    {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 4},
    {"method": "draft"},  # a draft without a source
    {"method": "ngram", "draft_source": "/cache/draft"},
])
def test_the_agent_refuses_a_speculative_spec_vllm_would_refuse(bad):
    with pytest.raises(ValueError):
        SpeculativeSpec.from_dict(bad)


def test_a_draft_with_another_vocabulary_is_refused_before_the_engine_starts(tmp_path):
    model, same, other = (build_tiny_model(tmp_path / name) for name in ("model", "same", "other"))
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"vocab_size": config["vocab_size"] * 2}))
    assert draft_problem(model, same) == ""
    assert "must share the model's tokenizer" in draft_problem(model, other)


def test_the_speculative_fields_are_in_the_openapi_schema(owner_client):
    schema = owner_client.get("/api/schema/", {"format": "json"}).json()
    properties = schema["components"]["schemas"]["Endpoint"]["properties"]
    assert {"speculative_method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"} <= properties.keys()
    assert "ngram" in properties["speculative_method"]["description"]
    assert "tokenizer" in properties["draft_model_source"]["description"]
