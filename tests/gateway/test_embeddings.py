"""`/v1/embeddings` before the engine: OpenAI's shapes and limits, and which endpoints serve it.

Each refusal is a 400 in OpenAI's shape naming the parameter, and costs nothing: no usage row, no
upstream call. An embedding endpoint refuses chat and completions, a generating one embeddings.
The real engine's answers are `test_embeddings_vllm`.
"""

from __future__ import annotations

import sys

import httpx
import openai
import pytest

from billing.models import UsageRecord
from endpoints.models import ModelFacts
from tests.conftest import ChildProcess, child_env, free_port
from tests.gateway.conftest import serve_endpoint, wait_until_healthy

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def unreached_upstream(tmp_path_factory):
    """One mock engine for the module's refused calls: none reaches it (a call that did would be answered, not a 400),
    so each test finds it as the last left it. NOTE: one per test was ~0.5 s of each test's ~1 s."""
    port = free_port()
    child = ChildProcess([sys.executable, "-m", "tests.fakes.mock_openai", "--port", str(port)], child_env(),
                         tmp_path_factory.mktemp("unreached-upstream") / "mock.log")
    address = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(address, "mock upstream")
        yield address
    finally:
        child.stop()


def _raw(gateway, tenant) -> httpx.Client:
    return httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=30)


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": {"text": "a"}}, "input"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "a", "encoding_format": []}, "encoding_format"),  # a 500 (unhashable), found by the fuzz test
    ({"input": "a", "encoding_format": {"float": 1}}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": "64"}, "dimensions"),
    ({"input": "a", "user": 7}, "user"),
])
def test_a_malformed_embeddings_request_is_a_400_naming_the_parameter(gateway, tenant, unreached_upstream, body, param):
    endpoint = serve_endpoint(tenant.org, unreached_upstream, task="embed")
    with _raw(gateway, tenant) as client:
        response = client.post("/v1/embeddings", json={"model": endpoint.name} | body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert not UsageRecord.objects.exists()


def test_2048_inputs_are_within_openais_limit_and_2049_are_not(gateway, tenant):
    with _raw(gateway, tenant) as client:
        at_limit = client.post("/v1/embeddings", json={"model": "no-such-model", "input": ["a"] * 2048})
        past_limit = client.post("/v1/embeddings", json={"model": "no-such-model", "input": ["a"] * 2049})
    assert at_limit.status_code == 404  # its body passed; the model does not exist
    assert past_limit.status_code == 400 and "2048" in past_limit.json()["error"]["message"]


def test_one_input_of_more_than_2048_token_ids_is_one_input_and_2049_arrays_of_them_are_too_many(gateway, tenant):
    # A flat array of token ids was counted as 2049 inputs and refused; OpenAI takes up to 8191 tokens an input.
    with _raw(gateway, tenant) as client:
        one_input = client.post("/v1/embeddings", json={"model": "no-such-model", "input": list(range(5000))})
        past_limit = client.post("/v1/embeddings", json={"model": "no-such-model", "input": [[1, 2]] * 2049})
    assert one_input.status_code == 404  # its body passed; the model does not exist
    assert past_limit.status_code == 400 and "2048" in past_limit.json()["error"]["message"]


def test_chat_on_an_embedding_endpoint_is_a_clear_400(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(), task="embed")
    client = tenant.client(gateway)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=endpoint.name, messages=MESSAGES)
    assert chat.value.code == "model_is_embedding" and "/v1/embeddings" in chat.value.message
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model=endpoint.name, prompt="hi")
    assert completion.value.code == "model_is_embedding"
    assert not UsageRecord.objects.exists()


def test_embeddings_on_a_generating_endpoint_is_a_clear_400(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(), task="generate")
    with pytest.raises(openai.BadRequestError) as refused:
        tenant.client(gateway).embeddings.create(model=endpoint.name, input="hello")
    assert refused.value.code == "model_not_embedding" and refused.value.param == "model"
    assert not UsageRecord.objects.exists()


def test_an_auto_endpoint_takes_its_task_from_the_models_architecture(gateway, tenant, start_mock_upstream):
    upstream = start_mock_upstream()
    encoder = serve_endpoint(tenant.org, upstream, task="auto", model_source="hf:BAAI/bge-small-en-v1.5")
    ModelFacts.objects.create(source=encoder.model_source, architecture="BertModel", max_model_len=512)
    chat_model = serve_endpoint(tenant.org, upstream, task="auto", model_source="hf:org/chat")
    ModelFacts.objects.create(source=chat_model.model_source, architecture="LlamaForCausalLM", max_model_len=2048)
    client = tenant.client(gateway)

    with pytest.raises(openai.BadRequestError) as chat_on_encoder:
        client.chat.completions.create(model=encoder.name, messages=MESSAGES)
    assert chat_on_encoder.value.code == "model_is_embedding"
    with pytest.raises(openai.BadRequestError) as embed_on_chat_model:
        client.embeddings.create(model=chat_model.name, input="hello")
    assert embed_on_chat_model.value.code == "model_not_embedding"
    assert client.chat.completions.create(model=chat_model.name, messages=MESSAGES).choices
