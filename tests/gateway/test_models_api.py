"""`GET /v1/models/{id}` (`client.models.retrieve`) with the official `openai` client."""

import httpx
import openai
import pytest

from tests.factories import EndpointFactory

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
