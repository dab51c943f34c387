"""OpenAI's `x-ratelimit-*` headers on every `/v1` answer, through the real gateway, read with the
official `openai` client (`with_raw_response`) and with raw HTTP."""

import re
import time

import httpx
import openai
import pytest

from controlplane.accounts.models import ApiKey
from controlplane.redis_client import get_redis
from endpoints.gateway.ratelimit_headers import format_reset
from tests.conftest import start_web_server
from tests.gateway.conftest import serve_endpoint
from tests.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]
NAMES = ("limit-requests", "remaining-requests", "reset-requests", "limit-tokens", "remaining-tokens", "reset-tokens")
# Go's duration format, as OpenAI sends it: "20ms", "1s", "6.5s", "1m0s"
RESET = re.compile(r"^(\d+ms|\d+(\.\d+)?s|1m0s)$")


def ratelimit(headers) -> dict[str, str]:
    return {name: headers.get(f"x-ratelimit-{name}") for name in NAMES}


def reset_s(text: str) -> float:
    if text.endswith("ms"):
        return int(text[:-2]) / 1000
    if text == "1m0s":
        return 60.0
    return float(text[:-1])


@pytest.fixture
def limited_key(tenant):
    """The tenant's key, limited to 3 requests and 20,000 tokens a minute, with at least 10 s of this
    minute left (the counters are per minute: a test must not straddle two; each takes about a second)."""
    # NOTE: a wait for a minute's first 50 s, not its first 40: the test waited one time in six instead of one in three,
    # and 5 s on average instead of 10 (a suite's run waited 17.8 s here).
    ApiKey.objects.filter(pk=tenant.api_key.pk).update(requests_per_minute=3, tokens_per_minute=20_000)
    wait_until(lambda: 60 - time.time() % 60 > 10, 45, message="a fresh minute")
    return tenant


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (0.02, "20ms"), (0.999, "999ms"), (1, "1s"), (6.5, "6.5s"), (17.25, "17.25s"), (59.9996, "1m0s"),
    (360, "6m0s"), (3723, "1h2m3s"), (-3, "0s"),
])
def test_resets_are_written_as_openai_writes_them(seconds, text):
    assert format_reset(seconds) == text


def _clear_of_a_minutes_end() -> None:
    """Wait out the last seconds of this minute (Redis's clock): the windows are fixed minutes, and calls on both sides
    of a minute's end count in two windows (a fresh-clone run's three calls at 00:35:00 read 19,812 then 19,882 left)."""
    seconds, _ = get_redis().time()
    if 60 - seconds % 60 < 5:
        time.sleep(60 - seconds % 60 + 0.5)


def test_every_answer_says_the_keys_limits_and_what_is_left_until_the_429_says_none(gateway, limited_key,
                                                                                    start_mock_upstream):
    endpoint = serve_endpoint(limited_key.org, start_mock_upstream())
    client = limited_key.client(gateway)
    _clear_of_a_minutes_end()

    seen = []
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(model=endpoint.name, messages=MESSAGES, max_tokens=5)
        assert raw.parse().choices
        seen.append(ratelimit(raw.headers))

    assert [h["limit-requests"] for h in seen] == ["3", "3", "3"]
    assert [h["remaining-requests"] for h in seen] == ["2", "1", "0"]
    assert [h["limit-tokens"] for h in seen] == ["20000"] * 3
    remaining_tokens = [int(h["remaining-tokens"]) for h in seen]
    assert 20_000 > remaining_tokens[0] > remaining_tokens[1] > remaining_tokens[2] > 0
    for headers in seen:
        assert RESET.match(headers["reset-requests"]) and RESET.match(headers["reset-tokens"]), headers
        assert 0 < reset_s(headers["reset-requests"]) <= 60

    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=5)
    refused = ratelimit(limited.value.response.headers)
    assert refused["limit-requests"] == "3" and refused["remaining-requests"] == "0"
    assert RESET.match(refused["reset-requests"]) and 0 < reset_s(refused["reset-requests"]) <= 60
    # a refusal reserves nothing; the requests before it have given back what they did not use
    assert int(refused["remaining-tokens"]) >= remaining_tokens[2]


def test_a_stream_carries_the_headers_before_its_first_event(gateway, limited_key, start_mock_upstream):
    endpoint = serve_endpoint(limited_key.org, start_mock_upstream())
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {limited_key.key}"},
                      json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 5, "stream": True}) as response:
        assert response.status_code == 200
        headers = ratelimit(response.headers)
        assert b"[DONE]" in response.read()
    assert headers["limit-requests"] == "3" and headers["remaining-requests"] == "2"
    assert int(headers["remaining-tokens"]) < 20_000 and RESET.match(headers["reset-tokens"])


def test_errors_and_the_model_list_carry_the_headers_only_an_unknown_model_counting_a_request(gateway, limited_key,
                                                                                             start_mock_upstream):
    endpoint = serve_endpoint(limited_key.org, start_mock_upstream())
    client = limited_key.client(gateway)
    client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=5)  # one counted

    models = client.models.with_raw_response.list()
    assert ratelimit(models.headers)["remaining-requests"] == "2"
    assert RESET.match(ratelimit(models.headers)["reset-requests"])

    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=5)
    # counted as a call is: made-up names, each a lookup, are limited as calls are (`admission.refuse_unknown_model`)
    assert ratelimit(unknown.value.response.headers)["remaining-requests"] == "1"
    assert ratelimit(unknown.value.response.headers)["limit-tokens"] == "20000"

    bad_json = httpx.post(f"{gateway}/v1/chat/completions", content=b"{", timeout=30,
                          headers={"authorization": f"Bearer {limited_key.key}", "content-type": "application/json"})
    assert bad_json.status_code == 400 and ratelimit(bad_json.headers)["remaining-requests"] == "1"

    unknown_url = httpx.get(f"{gateway}/v1/nothing-here", timeout=30, headers={"authorization": f"Bearer {limited_key.key}"})
    assert unknown_url.status_code == 404 and ratelimit(unknown_url.headers)["limit-requests"] is not None


def test_an_answer_to_no_known_key_says_the_platforms_default_limits(gateway, settings):
    refused = httpx.post(f"{gateway}/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=30,
                         headers={"authorization": "Bearer ip_not_a_real_key"})
    assert refused.status_code == 401
    headers = ratelimit(refused.headers)
    assert headers["limit-requests"] == headers["remaining-requests"] == str(settings.DEFAULT_KEY_REQUESTS_PER_MINUTE)
    assert headers["limit-tokens"] == headers["remaining-tokens"] == str(settings.DEFAULT_KEY_TOKENS_PER_MINUTE)
    assert RESET.match(headers["reset-requests"])


@pytest.fixture
def gateway_without_a_default_request_limit(transactional_db, tmp_path):
    child, base_url = start_web_server(tmp_path, name="gateway", extra_env={"INFERPLANE_DEFAULT_KEY_RPM": "0"})
    yield base_url
    child.stop()


def test_a_dimension_without_a_limit_sends_no_headers_for_it(gateway_without_a_default_request_limit, tenant,
                                                             start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    raw = tenant.client(gateway_without_a_default_request_limit).chat.completions.with_raw_response.create(
        model=endpoint.name, messages=MESSAGES, max_tokens=5)
    headers = ratelimit(raw.headers)
    assert headers["limit-requests"] is headers["remaining-requests"] is headers["reset-requests"] is None
    assert headers["limit-tokens"] is not None and int(headers["remaining-tokens"]) < int(headers["limit-tokens"])
