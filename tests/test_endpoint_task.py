"""An endpoint's task (generate, embed, auto): set through the API with field errors, read from the
model's architecture when auto, and carried to the agent in the replica spec."""

import pytest

from endpoints.fleet.services import replica_spec
from endpoints.models import Endpoint, ModelFacts, Replica
from gpu_agent.protocol import ModelTask
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db

VALID = {"name": "docs-embed", "model_source": "hf:BAAI/bge-small-en-v1.5", "gpu_type": "l4"}


def test_the_api_sets_an_endpoints_task_and_refuses_an_unknown_one_with_a_field_error(owner_client):
    refused = owner_client.post("/api/v1/endpoints/", VALID | {"task": "rerank"}, format="json")
    assert refused.status_code == 400 and "task" in refused.json()

    created = owner_client.post("/api/v1/endpoints/", VALID | {"task": "embed"}, format="json")
    assert created.status_code == 201, created.json()
    assert (created.json()["task"], created.json()["serving_task"]) == ("embed", "embed")

    patched = owner_client.patch(f"/api/v1/endpoints/{created.json()['id']}/", {"task": "generate"}, format="json")
    assert patched.json()["serving_task"] == "generate"


def test_an_auto_endpoint_serves_what_its_models_architecture_says_once_an_agent_read_it(owner_client):
    created = owner_client.post("/api/v1/endpoints/", VALID, format="json").json()
    assert (created["task"], created["serving_task"]) == ("auto", "")  # not read yet: the engine decides
    ModelFacts.objects.create(source=VALID["model_source"], architecture="BertModel", max_model_len=512)
    assert owner_client.get(f"/api/v1/endpoints/{created['id']}/").json()["serving_task"] == "embed"
    ModelFacts.objects.filter(source=VALID["model_source"]).update(architecture="LlamaForCausalLM")
    assert Endpoint.objects.get(pk=created["id"]).serving_task == "generate"


def test_the_replica_spec_carries_the_endpoints_task():
    for task in ModelTask:
        spec = replica_spec(Replica.objects.create(endpoint=EndpointFactory(task=task.value)))
        assert spec.task == task and ModelTask(spec.to_dict()["task"]) == task
