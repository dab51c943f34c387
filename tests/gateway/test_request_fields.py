"""Only fields on the gateway's allowlist reach the engine (`endpoints.gateway.fields`).

Each refused field below passed to vLLM before, where it made the engine do work the reservation never
counted or bill less than the work done: `kv_transfer_params.prompt_token_ids` replaced a chat prompt with
ids the estimate never saw, `remote_prefill_cached_tokens` billed every prompt token at the cached price,
`messages` beside an embeddings `input` embedded conversations while `input` was counted, beam search
re-ran the prompt for every beam at every step, and `best_of` (ignored by vLLM's completions) made the
gateway count choices against the wrong prompt.
"""

import json

import httpx
import pytest

from billing.models import UsageRecord
from endpoints.gateway.errors import OpenAIError
from endpoints.gateway.fields import ACCEPTED
from endpoints.gateway.request import parse_payload
from tests.gateway.conftest import serve_endpoint

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
EMBEDDING = {"model": "m", "input": "hi"}


def _refusal(payload: dict, kind: str) -> OpenAIError:
    with pytest.raises(OpenAIError) as refused:
        parse_payload(json.dumps(payload).encode(), kind)
    return refused.value


@pytest.mark.parametrize("kind, body, field", [
    ("chat", CHAT | {"kv_transfer_params": {"prompt_token_ids": list(range(32_000))}}, "kv_transfer_params"),
    ("chat", CHAT | {"kv_transfer_params": {"do_remote_prefill": True, "remote_prefill_cached_tokens": 10**9}},
     "kv_transfer_params"),
    ("completion", COMPLETION | {"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
    ("chat", CHAT | {"ec_transfer_params": {}}, "ec_transfer_params"),
    ("chat", CHAT | {"vllm_xargs": {"a": 1}}, "vllm_xargs"),
    ("chat", CHAT | {"use_beam_search": True, "n": 16}, "use_beam_search"),
    ("completion", COMPLETION | {"use_beam_search": True}, "use_beam_search"),
    ("chat", CHAT | {"request_id": "someone-elses"}, "request_id"),
    ("chat", CHAT | {"chat_template": "{{ 'x' * 100000 }}"}, "chat_template"),
    ("completion", COMPLETION | {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("embedding", EMBEDDING | {"messages": [[{"role": "user", "content": "a whole corpus"}]]}, "messages"),
    ("embedding", EMBEDDING | {"chat_template_kwargs": {}}, "chat_template_kwargs"),
    ("completion", COMPLETION | {"best_of": 16}, "best_of"),
    ("completion", COMPLETION | {"n": 2, "best_of": 3}, "best_of"),
    ("chat", CHAT | {"best_of": 2}, "best_of"),
    ("chat", CHAT | {"mm_processor_kwargs": {"max_pixels": 10**9}}, "mm_processor_kwargs"),
    ("chat", CHAT | {"guided_json": {"type": "object"}}, "guided_json"),  # gone from vLLM: silently ignored there
    ("chat", CHAT | {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", CHAT | {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", CHAT | {"web_search_options": {}}, "web_search_options"),
])
def test_a_field_the_engine_would_take_but_the_reservation_cannot_bound_is_a_400_naming_it(kind, body, field):
    refusal = _refusal(body, kind)

    assert (refusal.status, refusal.param) == (400, field)
    assert refusal.code in {"unsupported_parameter", "unknown_parameter"}


def test_messages_sent_to_completions_are_refused_saying_where_the_text_goes():
    """Before, the refusal told a completions call to send its text as 'input' to /v1/embeddings."""
    refusal = _refusal(COMPLETION | {"messages": CHAT["messages"]}, "completion")

    assert (refusal.status, refusal.param, refusal.code) == (400, "messages", "unsupported_parameter")
    assert "/v1/completions" in refusal.message and "'prompt'" in refusal.message
    assert "embeddings" not in refusal.message and "'input'" not in refusal.message
    assert "/v1/embeddings" in _refusal(EMBEDDING | {"messages": CHAT["messages"]}, "embedding").message


def test_an_unknown_field_is_refused_as_openai_refuses_an_unrecognised_argument():
    refusal = _refusal(CHAT | {"temprature": 0.5}, "chat")

    assert refusal.message == "Unrecognized request argument supplied: temprature"
    assert (refusal.param, refusal.code) == ("temprature", "unknown_parameter")


def test_an_unprintable_field_name_is_quoted_escaped_in_the_refusal():
    refusal = _refusal(CHAT | {"a\u0000b" + "x" * 100: 1}, "chat")

    assert refusal.param == "a\\x00b" + "x" * 61
    assert refusal.message.isprintable()


def test_a_logit_bias_key_is_named_cut_and_escaped_as_an_unknown_field_is():
    refusal = _refusal(CHAT | {"logit_bias": {"\u0000" + "9" * 100_000: 1000}}, "chat")

    assert refusal.param == "logit_bias.\\x00" + "9" * 63
    assert len(refusal.message) < 200 and refusal.message.isprintable()


@pytest.mark.parametrize("kind, body", [
    ("chat", CHAT | {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 1,
                     "stop_token_ids": [2], "skip_special_tokens": False, "cache_salt": "s", "documents": [],
                     "chat_template_kwargs": {"enable_thinking": False}, "structured_outputs": {"json": {}},
                     "metadata": {"run": "1"}, "store": False, "service_tier": "auto", "reasoning_effort": "low",
                     "max_completion_tokens": 4, "truncate_prompt_tokens": 8, "prompt_logprobs": 1}),
    ("completion", COMPLETION | {"n": 2, "best_of": 2, "echo": True, "suffix": "", "top_k": 1, "min_tokens": 1,
                                 "allowed_token_ids": [1, 2], "bad_words": ["x"], "return_token_ids": True,
                                 "max_completion_tokens": 4, "response_format": {"type": "json_object"}}),
    ("chat", CHAT | {"modalities": ["text"], "prediction": {"type": "content", "content": "hi"},
                     "prompt_cache_key": "k", "prompt_cache_retention": "24h", "safety_identifier": "u1"}),
    ("embedding", EMBEDDING | {"dimensions": 8, "encoding_format": "base64", "truncate_prompt_tokens": 4,
                               "add_special_tokens": True, "user": "u"}),
])
def test_what_openais_sdks_and_vllms_sampling_extensions_send_still_passes(kind, body):
    assert parse_payload(json.dumps(body).encode(), kind) == body


@pytest.mark.parametrize("kind, body", [
    ("responses", {"model": "m", "input": "hi", "prompt_cache_key": "k", "prompt_cache_retention": "24h"}),
    ("responses", {"model": "m", "input": "hi", "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}}),
    ("chat", CHAT | {"prompt_cache_options": {"mode": "explicit"}}),
])
def test_openais_prompt_cache_hints_pass_on_chat_and_responses_alike(kind, body):
    """Fields of OpenAI's the openai client sends that change nothing here: `prompt_cache_retention` passed on chat but
    was a 400 'Unrecognized request argument' on Responses, and `prompt_cache_options` was one on both."""
    assert parse_payload(json.dumps(body).encode(), kind) == body


def test_audio_sent_as_null_is_not_set_but_asked_for_is_refused():
    """OpenAI's API types `audio` as nullable, and the openai client sends `audio=None` as null: a 400 "not supported"
    before. Asked for (an object), it is still refused with its reason."""
    assert parse_payload(json.dumps(CHAT | {"audio": None}).encode(), "chat") == CHAT | {"audio": None}
    refused = _refusal(CHAT | {"audio": {"voice": "alloy", "format": "wav"}}, "chat")
    assert (refused.param, refused.code) == ("audio", "unsupported_parameter")


@pytest.mark.parametrize("kind, field, value, why", [
    ("chat", "moderation", {"model": "omni-moderation-latest"}, "no moderation model runs here"),
    ("responses", "moderation", {"model": "omni-moderation-latest"}, "no moderation model runs here"),
    ("responses", "context_management", [{"type": "compaction"}], "not compacted here"),
    ("responses", "background_options", {"completion_window": "2h"}, "not run in the background"),
    ("responses", "access_programs", {"cyber": "standard"}, "access programs"),
    ("responses", "image", {"context_compression": "enabled"}, "image options"),
])
def test_a_newer_openai_field_set_is_refused_with_its_reason_not_as_an_unrecognised_argument(kind, field, value, why):
    """Fields the installed openai client sends (`moderation` on chat and Responses; Responses' `context_management`,
    `background_options`, `access_programs`, `image`) were each an "Unrecognized request argument", as a typo is."""
    body = (CHAT if kind == "chat" else {"model": "m", "input": "hi"}) | {field: value}
    refused = _refusal(body, kind)
    assert (refused.status, refused.param, refused.code) == (400, field, "unsupported_parameter")
    assert why in refused.message


@pytest.mark.parametrize("kind, field", [
    ("chat", "moderation"), ("responses", "moderation"), ("responses", "context_management"),
])
def test_a_newer_nullable_openai_field_sent_as_null_is_not_set(kind, field):
    """OpenAI's types have these nullable: null is "not set", as `audio`'s is."""
    body = (CHAT if kind == "chat" else {"model": "m", "input": "hi"}) | {field: None}
    assert parse_payload(json.dumps(body).encode(), kind) == body


def test_every_kind_has_an_allowlist_with_its_model_and_prompt():
    assert {"model", "messages"} <= ACCEPTED["chat"]
    assert {"model", "prompt"} <= ACCEPTED["completion"]
    assert {"model", "input"} <= ACCEPTED["embedding"] and "messages" not in ACCEPTED["embedding"]


def test_top_logprobs_without_logprobs_is_a_400_naming_top_logprobs_as_the_engine_would_answer_later():
    """vLLM refuses `top_logprobs` above 0 without `logprobs: true` (so does OpenAI); before, the gateway passed it:
    the call was admitted, counted and its endpoint woken to be refused, and a batch line so made failed as it ran."""
    refusal = _refusal(CHAT | {"top_logprobs": 2}, "chat")

    assert (refusal.status, refusal.param, refusal.code) == (400, "top_logprobs", "invalid_value")
    assert "'logprobs' must be set to true" in refusal.message
    assert parse_payload(json.dumps(CHAT | {"top_logprobs": 2, "logprobs": True}).encode(), "chat")
    assert parse_payload(json.dumps(CHAT | {"top_logprobs": 0}).encode(), "chat")


def test_an_n_or_best_of_out_of_range_is_refused_as_such_not_as_best_of_below_n():
    # The best_of-below-n check ran before the fields' own ranges: n=17 (MAX_N is 16) with best_of=1 was told
    # "'best_of' must be greater than or equal to 'n'" and named best_of, the field that was right.
    past_n = _refusal(COMPLETION | {"n": 17, "best_of": 1}, "completion")
    assert (past_n.param, past_n.message) == ("n", "'n' must be an integer from 1 to 16.")
    zero = _refusal(COMPLETION | {"n": 2, "best_of": 0}, "completion")
    assert zero.param == "best_of" and "greater than or equal to 'n'" not in zero.message
    below = _refusal(COMPLETION | {"n": 3, "best_of": 2}, "completion")
    assert (below.param, below.code) == ("best_of", "invalid_value")


@pytest.mark.django_db(transaction=True)
def test_best_of_below_n_is_a_400_naming_best_of_before_anything_is_reserved(gateway, tenant, start_mock_upstream):
    """OpenAI and vLLM require best_of >= n; before, n=3 with best_of=1 passed and the engine was asked for it."""
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    body = {"model": endpoint.name, "prompt": "x", "max_tokens": 2, "n": 3, "best_of": 1}

    response = httpx.post(f"{gateway}/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {tenant.key}"})

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "best_of", "invalid_value")
    assert "greater than or equal to 'n'" in error["message"]
    assert not UsageRecord.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_refused_field_never_reaches_the_engine_and_costs_nothing(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    body = {"model": endpoint.name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_prefill_cached_tokens": 10**9}}

    response = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {tenant.key}"})

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "kv_transfer_params"
    assert not UsageRecord.objects.exists()


def test_deprecated_functions_sent_empty_are_not_set():
    """`functions: []` asks for no function (clients built on OpenAI's types send their default so): nothing the engine
    drops, so nothing to refuse; before, a 400 `unsupported_parameter`. Set, it is still refused."""
    assert parse_payload(json.dumps(CHAT | {"functions": []}).encode(), "chat") == CHAT | {"functions": []}
    refused = _refusal(CHAT | {"functions": [{"name": "get_weather"}]}, "chat")
    assert (refused.param, refused.code) == ("functions", "unsupported_parameter")


def test_a_completions_output_cap_is_max_tokens_alone_as_the_engine_reads_it():
    """vLLM's completions ignore `max_completion_tokens` (`endpoints.gateway.estimate`): one past the context beside a
    `max_tokens` that fits was a 400 naming a field the engine never reads."""
    from endpoints.gateway.request import InferenceRequest

    class _Endpoint:  # what `InferenceRequest.worst_case` reads of an endpoint
        name, task, max_model_len, template_tokens, template_flag_tokens = "m", "generate", 2048, (0, 0), None
        prompt_normalizer = prompt_factor = None

    body = COMPLETION | {"max_tokens": 4, "max_completion_tokens": 10_000_000}
    request = InferenceRequest.parse(json.dumps(body).encode(), kind="completion", path="/v1/completions")
    assert request.worst_case(_Endpoint()).max_output_tokens == 4
    with pytest.raises(OpenAIError) as refused:
        InferenceRequest.parse(json.dumps(COMPLETION | {"max_tokens": 10_000_000}).encode(), kind="completion",
                               path="/v1/completions").worst_case(_Endpoint())
    assert (refused.value.param, refused.value.code) == ("max_tokens", "invalid_value")
