"""A key that sets no limits of its own gets the platform's, through the real gateway, and says so."""

import httpx
import openai
import pytest

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Scope
from controlplane.accounts.services import Actor
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



def test_keys_a_rate_limited_key_creates_share_its_window_and_never_multiply_its_limit(gateway, tenant, start_mock_upstream):
    # A member's key limited to 3 requests a minute, with the manage scope: it may create keys. Each key it
    # created had a window of its own, so two children (each given the parent's limit) made 9 calls a minute.
    limited = create_api_key(Actor(user=tenant.owner), tenant.org, name="limited", scopes=[Scope.INFERENCE, Scope.MANAGE],
                             requests_per_minute=3)
    children = [create_api_key(Actor(user=tenant.owner, api_key=limited.api_key), tenant.org, name=f"child {n}",
                               scopes=[Scope.INFERENCE]) for n in range(2)]
    grandchild = create_api_key(Actor(user=tenant.owner, api_key=children[0].api_key), tenant.org, name="grandchild",
                                scopes=[Scope.INFERENCE], requests_per_minute=2)
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    keys = [limited.plain, children[0].plain, children[1].plain, grandchild.plain]

    def call(key: str) -> int:
        return httpx.post(f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=30,
                          json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 5}).status_code

    assert [call(key) for key in keys[1:]] == [200, 200, 429]  # the grandchild's own 2 are already used by its family
    assert [call(key) for key in keys] == [200, 429, 429, 429]  # the window's 3 are spent, whichever key spends them
    # A key created by no key (the console, a session) keeps a window of its own.
    assert call(tenant.key) == 200
