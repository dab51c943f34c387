"""A key that sets no limits of its own gets the platform's, through the real gateway, and says so."""

import openai
import pytest

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


def test_the_api_shows_the_limits_a_key_gets(owner_client, settings):
    settings.DEFAULT_KEY_REQUESTS_PER_MINUTE = 600
    settings.DEFAULT_KEY_TOKENS_PER_MINUTE = 50_000
    own = owner_client.post("/api/v1/keys/", {"name": "own", "requests_per_minute": 10}, format="json")
    assert own.status_code == 201, own.content
    keys = {k["name"]: k for k in owner_client.get("/api/v1/keys/").json()["results"]}

    assert (keys["own"]["requests_per_minute"], keys["own"]["effective_requests_per_minute"]) == (10, 10)
    assert (keys["own"]["tokens_per_minute"], keys["own"]["effective_tokens_per_minute"]) == (None, 50_000)

