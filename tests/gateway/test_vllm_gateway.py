"""The gateway in front of a real vLLM engine (the tiny model on CPU): what only a real engine shows.

The package's shared engine (`vllm_engine`, slow to start on CPU) serves the module, with prefix
caching on as the agent starts it.
- The engine's own refusal (a 400 with its message) reaches the client in OpenAI's shape.
- A "text" part with a `uuid` and an `image_url` is an image to the engine; the gateway refuses it itself.
- A client that leaves mid-stream aborts the engine's request: the engine stops generating for it
  (its own metrics say so), long before the request's `max_tokens`.
- A prompt that shares a long prefix with an earlier one is a prefix-cache hit: the engine reports
  the cached tokens in `usage.prompt_tokens_details`, and the ledger bills them at the cached price.
"""

from __future__ import annotations

from decimal import Decimal

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from billing.models import UsageRecord
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Scope
from controlplane.accounts.services import Actor
from endpoints.models import Endpoint
from tests.conftest import wait_until
from tests.gateway.conftest import ENGINE_CONTEXT, ENGINE_KEY, ENGINE_NAME, serve_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

CONTEXT = ENGINE_CONTEXT  # the tiny model's own
NAME = ENGINE_NAME
PRICES = {"price_input_per_million": Decimal("100"), "price_cached_input_per_million": Decimal("10"),
          "price_output_per_million": Decimal("300")}
PER_MILLION = Decimal("0.000001")


@pytest.fixture
def engine(vllm_engine) -> str:
    return vllm_engine


@pytest.fixture
def endpoint(tenant, engine) -> Endpoint:
    endpoint = serve_endpoint(tenant.org, engine, name=NAME, engine_key=ENGINE_KEY, **PRICES)
    Endpoint.objects.filter(pk=endpoint.pk).update(max_model_len=CONTEXT)
    endpoint.refresh_from_db()
    return endpoint


def _client(base_url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def _engine_metrics(engine: str) -> dict[str, float]:
    """The engine's own Prometheus samples, summed over labels (one engine, one model)."""
    text = httpx.get(f"{engine}/metrics", headers={"Authorization": f"Bearer {ENGINE_KEY}"}, timeout=10).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


# --- the engine's refusal ----------------------------------------------------------------------------

def test_the_engines_own_refusal_reaches_the_client_in_openais_shape(engine, gateway, tenant, endpoint):
    # A prompt of token ids longer than the context: the gateway passes it on (its estimate caps a
    # prompt at the context), and the engine refuses it with its own message.
    payload = {"model": NAME, "prompt": [50] * (CONTEXT + 100), "max_tokens": 1}
    with _client(engine, ENGINE_KEY) as direct:
        refused_by_engine = direct.post("/v1/completions", json=payload)
    assert refused_by_engine.status_code == 400
    engine_message = refused_by_engine.json()["error"]["message"]

    with _client(gateway, tenant.key) as client:
        response = client.post("/v1/completions", json=payload)

    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"] == engine_message and str(CONTEXT) in error["message"]
    assert set(response.json()) == {"error"}


def test_a_prompt_too_long_for_the_context_is_openais_context_length_exceeded_naming_the_prompt(
        engine, gateway, tenant, endpoint):
    """OpenAI refuses a prompt past the model's context as code `context_length_exceeded`, param `messages` (or
    `prompt`): what LangChain's and LiteLLM's OpenAI clients tell a context overflow by, to trim or summarise the
    history or fall back to a longer-context model. Before, the engine's refusal came with no code and its own
    parameter (`input_text`, `input_tokens`: no field a client sent), as any other 400."""
    client = tenant.client(gateway, timeout=120)
    long_text = "hello " * (CONTEXT * 3)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": long_text}], max_tokens=1)
    with pytest.raises(openai.BadRequestError) as streamed:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": long_text}], max_tokens=1,
                                       stream=True)
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model=NAME, prompt=[50] * (CONTEXT + 100), max_tokens=1)
    for refused, param in ((chat, "messages"), (streamed, "messages"), (completion, "prompt")):
        assert (refused.value.code, refused.value.param) == ("context_length_exceeded", param)
        assert str(CONTEXT) in refused.value.message  # the engine's own words: the context and the prompt's length


def test_a_text_part_the_engine_reads_as_an_image_is_refused_before_the_engine_is_asked(engine, gateway, tenant,
                                                                                        endpoint):
    # With a `uuid`, vLLM reads a part by its keys, not its `type`: this "text" part is the caller's cached image to
    # the engine, which (the tiny model is text-only) refuses it as it refuses a genuine image part. The gateway took
    # it for one character of text and passed it on (a 200 from a vision model, its images billed as that character).
    disguised = {"type": "text", "text": "x", "uuid": "u1", "image_url": None}
    payload = {"model": NAME, "max_tokens": 1, "messages": [{"role": "user", "content": [disguised]}]}
    with _client(engine, ENGINE_KEY) as direct:
        as_text = direct.post("/v1/chat/completions", json=payload | {"messages": [
            {"role": "user", "content": [{"type": "text", "text": "x"}]}]})
        as_image = direct.post("/v1/chat/completions", json=payload)
        genuine = direct.post("/v1/chat/completions", json=payload | {"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": None, "uuid": "u1"}]}]})
    assert (as_text.status_code, as_image.status_code) == (200, 400)
    assert as_image.json()["error"]["message"] == genuine.json()["error"]["message"]
    assert "multimodal" in as_image.json()["error"]["message"]

    with _client(gateway, tenant.key) as client:
        response = client.post("/v1/chat/completions", json=payload)

    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == ("messages[0].content[0]", "invalid_value",
                                                              "invalid_request_error")
    # the gateway's own answer, before any reservation: the engine's would be passed on with its message
    assert "multimodal" not in error["message"] and "'image_url'" in error["message"]
    assert not UsageRecord.objects.filter(organization=tenant.org).exists()


# --- a client that leaves ----------------------------------------------------------------------------

def test_a_client_leaving_mid_stream_aborts_the_engines_request(engine, gateway, tenant, endpoint):
    max_tokens = CONTEXT - 64
    payload = {"model": NAME, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
               "stream": True, "temperature": 1.0}
    generated_before = _engine_metrics(engine).get("vllm:generation_tokens_total", 0.0)

    with _client(gateway, tenant.key) as client, client.stream("POST", "/v1/completions", json=payload) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        num_chunks = 0
        for line in response.iter_lines():
            num_chunks += line.startswith("data: {")
            if num_chunks == 3:
                break  # leave: the connection closes unread

    def engine_idle() -> bool:
        # A one-token request of our own makes the engine step, which refreshes its gauges.
        with _client(engine, ENGINE_KEY) as direct:
            direct.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 1})
        return _engine_metrics(engine)["vllm:num_requests_running"] == 0

    wait_until(engine_idle, 120, interval_s=0.5, message="the engine to run no request")
    generated = _engine_metrics(engine)["vllm:generation_tokens_total"] - generated_before
    # NOTE: had the engine carried on to the end, it would have generated all `max_tokens`.
    assert generated < max_tokens / 4, f"the engine generated {generated:.0f} of {max_tokens} tokens"
    row = wait_until(lambda: UsageRecord.objects.filter(request_id=request_id).first(), 30, message="the usage row")
    assert row.status == "client_aborted"
    assert 0 < row.completion_tokens < max_tokens / 4


def test_a_client_leaving_a_stream_of_four_choices_is_billed_what_it_was_sent_and_no_more_than_the_engine_made(
        engine, gateway, tenant, endpoint):
    # vLLM's running usage is per choice: each choice's tokens count once, the prompt once, and a client that leaves
    # has every event it was sent billed (at least one token each), never more than the engine generated.
    payload = {"model": NAME, "messages": [{"role": "user", "content": "Tell me a story"}], "n": 4,
               "max_tokens": CONTEXT - 64, "ignore_eos": True, "stream": True, "temperature": 1.0}
    generated_before = _engine_metrics(engine).get("vllm:generation_tokens_total", 0.0)
    sent_by_choice: dict[int, int] = {}

    with _client(gateway, tenant.key) as client, client.stream("POST", "/v1/chat/completions", json=payload) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            # NOTE: not each choice's first chunk (its role, `"content":""`, no token): counted, a gateway that had
            # written little more than the client read (a loaded machine) was billed fewer tokens than "sent" (39 < 40)
            if line.startswith("data: {") and '"content":' in line and '"content":""' not in line:
                index = int(line.split('"index":', 1)[1].split(",", 1)[0])
                sent_by_choice[index] = sent_by_choice.get(index, 0) + 1
            if sum(sent_by_choice.values()) >= 40:
                break  # leave: the connection closes unread

    row = wait_until(lambda: UsageRecord.objects.filter(request_id=request_id).first(), 60, message="the usage row")
    with _client(engine, ENGINE_KEY) as direct:
        prompt = direct.post("/tokenize", json={"model": NAME, "messages": payload["messages"]}).json()["count"]
    generated = _engine_metrics(engine)["vllm:generation_tokens_total"] - generated_before
    assert row.status == "client_aborted"
    assert row.prompt_tokens == prompt  # the prompt once, not once per choice
    assert sum(sent_by_choice.values()) <= row.completion_tokens <= generated


# --- a prefix-cache hit ------------------------------------------------------------------------------

# Token ids the tiny model's vocabulary holds (its special tokens come first): a long shared prefix,
# then a different ending for each request.
PREFIX = [50 + (index * 37) % 900 for index in range(600)]


def test_a_prefix_cache_hit_is_reported_and_billed_at_the_cached_price(engine, gateway, tenant, endpoint):
    rows, usages = [], []
    with _client(gateway, tenant.key) as client:
        for ending in ([11, 12, 13], [21, 22, 23]):
            response = client.post("/v1/completions", json={"model": NAME, "prompt": PREFIX + ending, "max_tokens": 4,
                                                            "ignore_eos": True})
            assert response.status_code == 200, response.text
            usages.append(response.json()["usage"])
            request_id = response.headers["x-request-id"]
            rows.append(wait_until(lambda request_id=request_id: UsageRecord.objects.filter(request_id=request_id).first(), 30,
                                   message="the usage row"))

    reported_cached = (usages[1].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert reported_cached >= len(PREFIX) // 2, usages[1]  # the engine's cache blocks cover most of the prefix
    second = rows[1]
    assert (second.prompt_tokens, second.cached_tokens, second.completion_tokens) == (
        len(PREFIX) + 3, reported_cached, 4)
    uncached = second.prompt_tokens - second.cached_tokens
    expected = (uncached * PRICES["price_input_per_million"] + second.cached_tokens * PRICES["price_cached_input_per_million"]
                + second.completion_tokens * PRICES["price_output_per_million"]) * PER_MILLION
    assert second.cost == expected
    assert second.cost < rows[0].cost  # same length, same output: the hit is cheaper


# --- logprobs --------------------------------------------------------------------------------------

def test_a_call_asking_for_logprobs_is_answered_with_them_and_the_engine_lives_on(engine, gateway, tenant, endpoint):
    """vLLM's sampler ranks each sampled token among the logprobs with a kernel torch compiles on its first use. In an
    engine forked from its node's zygote, torch's folder of precompiled C++ headers was the zygote's (under its /tmp,
    fixed when torch was imported), where a confined engine may not write: the first call asking for logprobs killed
    the EngineCore, and the engine with it (found by the review of `/v1` with OpenAI's clients)."""
    with _client(gateway, tenant.key) as client:
        chat = client.post("/v1/chat/completions", json={
            "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
            "top_logprobs": 2})
        assert chat.status_code == 200, chat.text
        tokens = chat.json()["choices"][0]["logprobs"]["content"]
        assert len(tokens) == 2 and all(len(token["top_logprobs"]) == 2 for token in tokens)
        completion = client.post("/v1/completions", json={"model": NAME, "prompt": "Once upon a time", "max_tokens": 1,
                                                          "echo": True, "logprobs": 1})
        assert completion.status_code == 200, completion.text
        assert len(completion.json()["choices"][0]["logprobs"]["tokens"]) > 1  # the prompt's, echoed, and the answer's
    with _client(engine, ENGINE_KEY) as direct:
        assert direct.get("/health").status_code == 200


# --- priorities ------------------------------------------------------------------------------------

def test_the_engine_runs_a_chat_call_at_the_priority_its_key_allows(engine, gateway, tenant, endpoint):
    # The engine schedules by priority (`--scheduling-policy priority`): without it vLLM refuses any
    # priority but 0. A key allowed ±5 moves its call ahead of interactive work, or behind it.
    key = create_api_key(Actor(user=tenant.owner), tenant.org, name="urgent", scopes=[Scope.INFERENCE],
                         max_priority_boost=5).plain
    with _client(gateway, key) as client:
        for priority in (-5, 5):
            response = client.post("/v1/chat/completions", json={
                "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "priority": priority})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] >= 1
    wait_until(lambda: UsageRecord.objects.filter(status="ok").count() == 2, 30, message="two usage rows")
