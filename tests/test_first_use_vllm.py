"""A new user's first endpoint, with nothing but the API's defaults, serves through the gateway (real agent, real vLLM)."""

from __future__ import annotations

import pytest

from endpoints.models import ModelFacts
from tests.conftest import wait_until
from tests.test_platform_vllm import MESSAGES, platform, wait_for_replica  # noqa: F401  (fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]


def test_an_endpoint_made_with_only_name_source_and_gpu_type_becomes_ready_and_serves(platform, tiny_model_dir):  # noqa: F811
    platform.add_agent("cpu-node-1")
    created = platform.api.post("/api/v1/endpoints/", json={
        "name": "first", "model_source": str(tiny_model_dir), "gpu_type": "cpu",
    })
    assert created.status_code == 201, created.text
    endpoint_id = created.json()["id"]
    assert created.json()["max_model_len"] is None

    # Scaled to zero: the first call wakes it and is held through the cold start.
    chat = platform.openai(timeout=600).chat.completions.create(model="first", messages=MESSAGES, max_tokens=4)
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens > 0
    replica = wait_for_replica(endpoint_id, "READY")
    assert replica.failure_reason == ""

    # The agent told the control plane what the model allows; the endpoint now serves exactly that.
    facts = wait_until(lambda: ModelFacts.objects.filter(source=str(tiny_model_dir)).first(), 30, message="model facts")
    assert facts.max_model_len == 2048 and facts.architecture == "LlamaForCausalLM" and facts.num_params > 0
    detail = platform.api.get(f"/api/v1/endpoints/{endpoint_id}/").json()
    assert detail["state"] == "READY" and detail["context_length"] == 2048 and detail["status_message"] == ""
    refused = platform.api.patch(f"/api/v1/endpoints/{endpoint_id}/", json={"max_model_len": 4096})
    assert refused.status_code == 400 and "2048" in refused.json()["max_model_len"][0]
