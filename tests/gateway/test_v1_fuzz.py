"""Hypothesis fuzzes `/v1/chat/completions`, `/v1/completions` and `/v1/embeddings` bodies against the real gateway.

A uvicorn gateway on the test database, an endpoint with one READY replica on the mock upstream
(tests/fakes/mock_openai.py), so that nothing waits for a cold start: every known field gets either
a well-formed value or any JSON at all, and whole bodies are sometimes any JSON or any bytes. Every
answer must be a 2xx (a stream that ends with `[DONE]`) or a 4xx in OpenAI's shape; a 5xx, a
traceback or a reply the mock could not make (a 502, since its 500s are retried) is a failure.

Bounded and reproducible: `INFERPLANE_V1_FUZZ_EXAMPLES` bodies per route (default 100), derandomised.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from billing.models import UsageRecord
from endpoints.gateway.errors import OpenAIError
from endpoints.gateway.request import parse_payload
from tests.conftest import wait_until
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

NUM_EXAMPLES = int(os.environ.get("INFERPLANE_V1_FUZZ_EXAMPLES", "100"))
FUZZ_SETTINGS = settings(max_examples=NUM_EXAMPLES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                HealthCheck.data_too_large])

class Raw(str):
    """JSON text written into the body as it is: what `json.dumps` cannot or will not write."""


# JSON that parsers choke on: nesting thousands deep, integers of thousands of digits, NaN.
hostile_json = st.one_of(
    st.integers(min_value=1, max_value=5000).map(lambda depth: Raw("[" * depth + "]" * depth)),
    st.integers(min_value=1, max_value=3000).map(lambda depth: Raw('{"a":' * depth + "1" + "}" * depth)),
    st.integers(min_value=19, max_value=6000).map(lambda digits: Raw("9" * digits)),
    st.sampled_from([Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), Raw("-0"), Raw('"\\ud800"')]),
)
# Any JSON value, small: scalars in lists and objects a few levels deep, now and then a hostile one.
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=20), hostile_json)
any_json = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)


def encode(body) -> bytes:
    """`body` as JSON text, with each `Raw` value written verbatim."""
    raws: list[str] = []

    def placeholder(value):
        if isinstance(value, Raw):
            raws.append(value)
            return f"\u0000raw{len(raws) - 1}\u0000"
        if isinstance(value, dict):
            return {key: placeholder(item) for key, item in value.items()}
        if isinstance(value, list):
            return [placeholder(item) for item in value]
        return value

    text = json.dumps(placeholder(body))
    for index, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\u0000raw{index}\u0000"), raw, 1)
    return text.encode()


def mostly(usual: st.SearchStrategy, other: st.SearchStrategy, *, in_ten: int = 9) -> st.SearchStrategy:
    """`usual` `in_ten` times in ten, else `other`. (NOTE: `one_of` merges repeated strategies, so
    repeating one does not weigh it.)"""
    return st.integers(min_value=1, max_value=10).flatmap(lambda roll: usual if roll <= in_ten else other)


def maybe_valid(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a value the API accepts, else anything."""
    return mostly(valid, any_json)


text_part = st.fixed_dictionaries({"type": st.just("text"), "text": maybe_valid(st.text(max_size=30))})
content = st.one_of(st.text(max_size=40), st.lists(maybe_valid(text_part), max_size=3), st.none(), any_json)
message = st.fixed_dictionaries(
    {"role": maybe_valid(st.sampled_from(["system", "user", "assistant", "tool", "developer"])), "content": content},
    optional={"name": maybe_valid(st.text(max_size=10)), "tool_call_id": maybe_valid(st.text(max_size=10)),
              "tool_calls": maybe_valid(st.lists(st.fixed_dictionaries({"id": st.text(max_size=5)}), max_size=2))},
)
tool = st.fixed_dictionaries({"type": maybe_valid(st.just("function")), "function": maybe_valid(st.fixed_dictionaries(
    {"name": maybe_valid(st.text(min_size=1, max_size=10))}, optional={"parameters": any_json, "description": any_json}))})
token_ids = st.lists(st.integers(min_value=0, max_value=50_000), min_size=1, max_size=8)

COMMON_FIELDS = {
    "max_tokens": maybe_valid(st.integers(min_value=1, max_value=8)),
    "max_completion_tokens": maybe_valid(st.integers(min_value=1, max_value=8)),
    "stream": maybe_valid(st.booleans()),
    "stream_options": maybe_valid(st.fixed_dictionaries({}, optional={
        "include_usage": maybe_valid(st.booleans()), "continuous_usage_stats": maybe_valid(st.booleans())})),
    "n": maybe_valid(st.integers(min_value=1, max_value=4)),
    "temperature": maybe_valid(st.floats(min_value=0, max_value=2)),
    "top_p": maybe_valid(st.floats(min_value=0, max_value=1)),
    "presence_penalty": maybe_valid(st.floats(min_value=-2, max_value=2)),
    "frequency_penalty": maybe_valid(st.floats(min_value=-2, max_value=2)),
    "seed": maybe_valid(st.integers(min_value=-(2**63), max_value=2**63 - 1)),
    "stop": maybe_valid(st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=4))),
    "user": maybe_valid(st.text(max_size=10)),
    "logit_bias": maybe_valid(st.dictionaries(st.integers(0, 1000).map(str), st.integers(-100, 100), max_size=3)),
    "top_k": any_json,  # a vLLM extension the gateway passes through
}
CHAT_FIELDS = COMMON_FIELDS | {
    "logprobs": maybe_valid(st.booleans()),
    "top_logprobs": maybe_valid(st.integers(min_value=0, max_value=20)),
    "tools": maybe_valid(st.lists(tool, max_size=2)),
    "tool_choice": maybe_valid(st.sampled_from(["none", "auto", "required"])),
    "parallel_tool_calls": maybe_valid(st.booleans()),
    "response_format": maybe_valid(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})),
}
COMPLETION_FIELDS = COMMON_FIELDS | {
    "logprobs": maybe_valid(st.integers(min_value=0, max_value=5)),
    "echo": maybe_valid(st.booleans()),
    "best_of": maybe_valid(st.integers(min_value=1, max_value=2)),
    "suffix": maybe_valid(st.text(max_size=5)),
}


def bodies(model: str, prompt_field: str, prompt: st.SearchStrategy, fields: dict) -> st.SearchStrategy:
    shaped = st.fixed_dictionaries({"model": maybe_valid(st.just(model)), prompt_field: prompt}, optional=fields)
    as_json = mostly(shaped, any_json).map(encode)
    return mostly(as_json, st.binary(max_size=40))


def chat_bodies(model: str) -> st.SearchStrategy:
    return bodies(model, "messages", maybe_valid(st.lists(maybe_valid(message), min_size=1, max_size=3)), CHAT_FIELDS)


def completion_bodies(model: str) -> st.SearchStrategy:
    prompt = maybe_valid(st.one_of(st.text(max_size=40), st.lists(st.text(max_size=10), min_size=1, max_size=3),
                                   token_ids, st.lists(token_ids, min_size=1, max_size=2)))
    return bodies(model, "prompt", prompt, COMPLETION_FIELDS)


def embedding_bodies(model: str) -> st.SearchStrategy:
    inputs = maybe_valid(st.one_of(st.text(min_size=1, max_size=40), st.lists(st.text(min_size=1, max_size=10),
                                   min_size=1, max_size=3), token_ids, st.lists(token_ids, min_size=1, max_size=2)))
    fields = {"encoding_format": maybe_valid(st.sampled_from(["float", "base64"])),
              "dimensions": maybe_valid(st.integers(min_value=1, max_value=64)),
              "user": maybe_valid(st.text(max_size=10)), "priority": any_json}
    return bodies(model, "input", inputs, fields)


def assert_answered_properly(response: httpx.Response, body: bytes) -> None:
    status = response.status_code
    assert status < 500, f"{status} for {body[:300]!r}: {response.text[:500]}"
    if 200 <= status < 300:
        if response.headers["content-type"].startswith("text/event-stream"):
            last = response.text.rstrip().rsplit("\n", 1)[-1]
            if last != "data: [DONE]":
                # NOTE: the mock reports 7 prompt tokens whatever the prompt, past the bound of a one-token-id
                # prompt: the gateway stops such a stream at its reservation, with OpenAI's error object.
                assert json.loads(last.removeprefix("data: "))["error"]["code"] == "reservation_spent", last
        else:
            assert "choices" in response.json() or "data" in response.json()
        return
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, response.text
    assert isinstance(error["message"], str) and error["message"]


@pytest.fixture
def fuzz_target(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {tenant.key}",
                                                 "content-type": "application/json"}, timeout=60) as client:
        yield endpoint.name, client


def test_any_chat_body_is_answered_or_refused_in_openais_shape(fuzz_target):
    model, client = fuzz_target

    @FUZZ_SETTINGS
    @given(body=chat_bodies(model))
    def check(body):
        assert_answered_properly(client.post("/v1/chat/completions", content=body), body)

    check()


def test_any_completion_body_is_answered_or_refused_in_openais_shape(fuzz_target):
    model, client = fuzz_target

    @FUZZ_SETTINGS
    @given(body=completion_bodies(model))
    def check(body):
        assert_answered_properly(client.post("/v1/completions", content=body), body)

    check()


def test_the_fuzzer_sends_well_formed_bodies_as_well_as_garbage():
    """A fuzzer whose bodies were all refused would prove nothing about the engine path."""
    shaped = accepted = 0

    @settings(max_examples=200, derandomize=True, database=None)
    @given(body=chat_bodies("m"))
    def count(body):
        nonlocal shaped, accepted
        shaped += 1
        try:
            parse_payload(body, "chat")
        except OpenAIError:
            return
        accepted += 1

    count()
    assert shaped // 5 <= accepted < shaped


def test_any_embeddings_body_is_answered_or_refused_in_openais_shape(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(), task="embed")
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {tenant.key}",
                                                 "content-type": "application/json"}, timeout=60) as client:

        @FUZZ_SETTINGS
        @given(body=embedding_bodies(endpoint.name))
        def check(body):
            assert_answered_properly(client.post("/v1/embeddings", content=body), body)

        check()
    # Some bodies went all the way: served by the mock, each with its usage row.
    wait_until(lambda: UsageRecord.objects.filter(endpoint=endpoint, status="ok").exists(), 30, message="a usage row")
