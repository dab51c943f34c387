"""`GET /v1/models/{id}` (`client.models.retrieve`) with the official `openai` client."""

import httpx
import openai
import pytest

from tests.factories import EndpointFactory
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


def test_retrieving_a_model_returns_the_organisations_endpoint_as_an_openai_model(gateway, tenant):
    endpoint = EndpointFactory(organization=tenant.org, name="support-chat")
    model = tenant.client(gateway).models.retrieve("support-chat")
    assert (model.id, model.object, model.owned_by) == ("support-chat", "model", "inferplane")
    assert model.created == int(endpoint.created_at.timestamp())


@pytest.mark.parametrize("name", ["no-such-model", "someone-elses"])
def test_retrieving_an_unknown_or_another_organisations_model_is_openais_model_not_found(gateway, tenant, name):
    EndpointFactory(name="someone-elses")
    with pytest.raises(openai.NotFoundError) as caught:
        tenant.client(gateway).models.retrieve(name)
    assert caught.value.code == "model_not_found"
    assert name in caught.value.message


def test_retrieving_a_model_needs_an_api_key(gateway, tenant):
    EndpointFactory(organization=tenant.org, name="support-chat")
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="sk-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.retrieve("support-chat")


@pytest.mark.parametrize("path", ["/v1/models/%00", "/v1/models/a%00b", "/v1/models/" + "a" * 300])
def test_retrieving_a_name_no_model_could_bear_is_openais_model_not_found(gateway, tenant, path):
    # `GET /v1/models/%00` was a 500 (PostgreSQL refuses a NUL), with a traceback in the log each time.
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=30) as client:
        answer = client.get(path)
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["code"] == "model_not_found"


def test_an_endpoints_name_with_a_colon_and_no_adapter_is_openais_model_not_found(gateway, tenant, start_mock_upstream):
    """`"<endpoint>:<adapter>"` names an adapter; `"support-chat:"` names none. Before, it was served as the endpoint
    (a 200 from `models.retrieve`, with another id; a call reached the engine, which knows no such name)."""
    upstream = start_mock_upstream()
    serve_endpoint(tenant.org, upstream, name="support-chat")
    client = tenant.client(gateway)
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("support-chat:")
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="support-chat:", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert caught.value.code == "model_not_found"
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 0  # nothing reached the engine
    assert client.models.retrieve("support-chat").id == "support-chat"
