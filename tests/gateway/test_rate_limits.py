"""A key that sets no limits of its own gets the platform's, through the real gateway, and says so."""

import httpx
import openai
import pytest

from controlplane.accounts.models import ApiKey
from tests.conftest import start_web_server
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def gateway_with_default_rpm_of_two(transactional_db, tmp_path):
    child, base_url = start_web_server(tmp_path, name="gateway", extra_env={"INFERPLANE_DEFAULT_KEY_RPM": "2"})
    yield base_url
    child.stop()


def test_a_key_with_no_limits_set_is_rate_limited_by_the_platform_default(gateway_with_default_rpm_of_two, tenant,
                                                                          start_mock_upstream):
    assert tenant.api_key.requests_per_minute is None and tenant.api_key.tokens_per_minute is None
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    client = tenant.client(gateway_with_default_rpm_of_two)

    for _ in range(2):
        client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=5)
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=5)

    assert limited.value.response.json()["error"]["code"] == "rate_limit_exceeded"
    assert "2 requests per minute" in limited.value.response.json()["error"]["message"]
    assert int(limited.value.response.headers["retry-after"]) >= 1


def test_a_request_larger_than_the_keys_tokens_per_minute_is_openais_429_for_tokens_never_worth_retrying(
        gateway_with_default_rpm_of_two, tenant, start_mock_upstream):
    """OpenAI answers a request past its whole tokens-per-minute limit with a 429 of type `tokens`; it was a 400
    `request_too_large` naming `max_tokens` here, and openai-python raised BadRequestError (a router falls back to
    another deployment on RateLimitError only)."""
    ApiKey.objects.filter(pk=tenant.api_key.pk).update(tokens_per_minute=100)
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)

    with pytest.raises(openai.RateLimitError) as limited:
        tenant.client(gateway_with_default_rpm_of_two).chat.completions.create(model=endpoint.name, messages=MESSAGES,
                                                                              max_tokens=1_000)

    response = limited.value.response
    assert response.status_code == 429
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("tokens", "rate_limit_exceeded", None)
    assert error["message"].startswith("Request too large for this API key on tokens per min (TPM): Limit 100, "
                                       "Requested "), error["message"]
    assert "retry-after" not in response.headers  # waiting admits it no sooner
    assert response.headers["x-should-retry"] == "false"  # nor does openai-python try it again
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 0


def test_the_api_shows_the_limits_a_key_gets(owner_client, settings):
    settings.DEFAULT_KEY_REQUESTS_PER_MINUTE = 600
    settings.DEFAULT_KEY_TOKENS_PER_MINUTE = 50_000
    own = owner_client.post("/api/v1/keys/", {"name": "own", "requests_per_minute": 10}, format="json")
    assert own.status_code == 201, own.content
    keys = {k["name"]: k for k in owner_client.get("/api/v1/keys/").json()["results"]}

    assert (keys["own"]["requests_per_minute"], keys["own"]["effective_requests_per_minute"]) == (10, 10)
    assert (keys["own"]["tokens_per_minute"], keys["own"]["effective_tokens_per_minute"]) == (None, 50_000)

