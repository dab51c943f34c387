"""Which fields of a `/v1` body may reach the engine: an allowlist per kind of call.

vLLM's request models accept far more than OpenAI's API, and take unknown fields silently
(`extra="allow"`). Some of what they accept lets a caller do work the reservation never counted, or
reach the engine's internals: `kv_transfer_params` replaces a chat prompt with token ids the
estimate never saw (`prompt_token_ids`) or claims a prefix-cache hit for every prompt token
(`remote_prefill_cached_tokens`, billed at the cached price); `messages` next to an embeddings
`input` embeds conversations while only `input` is counted; `use_beam_search` re-runs the prompt
for every beam at every step; `best_of` is ignored by vLLM's completions (so choices would be
counted against the wrong prompt). A new engine version may add more. So the gateway passes only
what it knows: OpenAI's fields, the metadata its SDKs send, and the vLLM sampling extensions whose
cost the estimate bounds (`endpoints.gateway.estimate`). Anything else is a 400 in OpenAI's shape,
as OpenAI answers an argument it does not recognise; the engine-only fields below name why.

`check(payload, kind)` is called by `request.parse_payload` for interactive calls and batch lines alike.
"""

from __future__ import annotations

from endpoints.gateway import errors

# OpenAI's own fields, and what its SDKs send that changes nothing here (the engine ignores it).
_OPENAI_COMMON = frozenset({
    "model", "max_tokens", "stream", "stream_options", "n", "temperature", "top_p", "presence_penalty",
    "frequency_penalty", "seed", "stop", "user", "logit_bias", "logprobs", "metadata", "store", "service_tier",
    "prompt_cache_key", "safety_identifier",
})
# NOTE: OpenAI's prompt-cache hints (its cache's key, retention and options) change nothing here: vLLM's prefix cache
# needs none. `prompt_cache_options` was an unrecognised argument on chat and Responses alike.
_OPENAI_CACHE_HINTS = frozenset({"prompt_cache_retention", "prompt_cache_options"})
_OPENAI_CHAT = _OPENAI_COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "response_format", "reasoning_effort", "verbosity", "modalities", "prediction",
} | _OPENAI_CACHE_HINTS
# NOTE: `max_completion_tokens` is chat's; vLLM's completions ignore it (and the estimate knows), so it is
# harmless here. vLLM's completions honour `response_format` (structured output), bounded by `max_tokens`.
_OPENAI_COMPLETION = _OPENAI_COMMON | {"prompt", "echo", "best_of", "suffix", "max_completion_tokens", "response_format"}
# vLLM's sampling and output extensions: each changes which tokens come, never how many are processed
# beyond what the estimate bounds (`max_tokens`, the context, `n`).
_VLLM_SAMPLING = frozenset({
    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "bad_words", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids",
    "logprob_token_ids", "prompt_logprobs", "add_special_tokens", "truncate_prompt_tokens", "truncation_side",
    "structured_outputs", "cache_salt", "priority", "return_token_ids", "return_tokens_as_token_ids",
})
_VLLM_CHAT = _VLLM_SAMPLING | {
    "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template_kwargs",
    "include_reasoning", "thinking_token_budget",
}
# NOTE: `background`, `previous_response_id`, `conversation` and `prompt` are OpenAI's, refused when set
# (`endpoints.gateway.responses.STATEFUL`); `store` is served off. vLLM's `text.format` is the structured output.
_OPENAI_RESPONSES = frozenset({
    "model", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "parallel_tool_calls",
    "reasoning", "service_tier", "store", "stream", "stream_options", "temperature", "text", "tool_choice", "tools",
    "top_logprobs", "top_p", "truncation", "user", "include", "prompt_cache_key", "safety_identifier", "background",
    "previous_response_id", "conversation", "prompt",
}) | _OPENAI_CACHE_HINTS
# vLLM's extensions that its Responses request reads (`vllm.entrypoints.openai.responses.protocol.ResponsesRequest`).
_VLLM_RESPONSES = frozenset({
    "top_k", "min_p", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens", "logit_bias", "presence_penalty", "frequency_penalty", "priority", "cache_salt",
    "structured_outputs", "chat_template_kwargs", "include_reasoning", "previous_input_messages",
})
_EMBEDDING = frozenset({
    "model", "input", "encoding_format", "dimensions", "user",
    "truncate_prompt_tokens", "truncation_side", "add_special_tokens", "priority", "embed_dtype", "endianness",
    "use_activation",
})

ACCEPTED: dict[str, frozenset[str]] = {
    "chat": _OPENAI_CHAT | _VLLM_CHAT,
    "completion": _OPENAI_COMPLETION | _VLLM_SAMPLING,
    "embedding": _EMBEDDING,
    "responses": _OPENAI_RESPONSES | _VLLM_RESPONSES,
}

# Fields the engine knows that are refused on purpose, with the reason the caller reads.
_ENGINE_INTERNAL = "is the engine's internal hand-off between servers and is not accepted from callers"
REFUSED_WITH_REASON: dict[str, str] = {
    "kv_transfer_params": _ENGINE_INTERNAL,
    "ec_transfer_params": _ENGINE_INTERNAL,
    "vllm_xargs": "passes arguments to the engine's plug-ins and is not accepted",
    "request_id": "is set by Inferplane (the answer's x-request-id)",
    "use_beam_search": "is not supported: beam search re-runs the prompt for every beam at every step",
    "length_penalty": "applies only to beam search, which is not supported",
    "chat_template": "is not supported: each model is served with its own chat template",
    "prompt_embeds": "is not supported: send text or token ids",
    "audio": "is not supported: models here answer in text",
    "web_search_options": "is not supported: models here do not search the web",
    # NOTE: newer fields of OpenAI's the openai client sends were each an "Unrecognized request argument", as if
    # misspelt: each is refused here with what it would need.
    "moderation": "is not supported: no moderation model runs here; moderate the input and output yourself",
    "context_management": "is not supported: the context is not compacted here; send a shorter 'input'",
    "background_options": "is not supported: responses are not run in the background here; stream the response "
                          "instead ('stream': true)",
    "access_programs": "is not supported: OpenAI's access programs do not apply to the models here",
    "image": "is not supported: images are passed to the model as sent, with no request-level image options",
    # NOTE: OpenAI's deprecated function calling, which the engine does not read: passed, the functions were dropped
    # and the model answered in text, with no `function_call` for the caller that asked for one (old LangChain and
    # LlamaIndex agents), a silently wrong answer. `tools` and `tool_choice` carry the same and are served.
    "functions": "is deprecated and not supported: send the functions as 'tools' ({\"type\": \"function\", "
                 "\"function\": {...}} each)",
    "function_call": "is deprecated and not supported: use 'tool_choice' with 'tools'",
}

# OpenAI's own fields refused above that OpenAI's API types as nullable: null there is "not set" (the openai client sends
# `audio=None` so), as it is for the stateful Responses fields refused only when set. NOTE: it was a 400 "not supported".
# The others (`web_search_options`, `background_options`, `access_programs`, `image`) are not nullable in OpenAI's types.
NULL_IS_UNSET = frozenset({"audio", "moderation", "context_management", "functions", "function_call"})
# Refused lists sent empty: no item, so nothing the engine drops (clients built on OpenAI's types send their default so).
# NOTE: `functions: []` was a 400, refused as deprecated function calling, though it asks for no function at all.
EMPTY_IS_UNSET = frozenset({"functions"})

# A prompt's field of one kind of call sent to another (kind, field): the reason says where it goes.
# NOTE: one reason for every kind told a completions call sending `messages` to send 'input' to /v1/embeddings.
REFUSED_ON_PATH: dict[tuple[str, str], str] = {
    ("embedding", "messages"): "is not supported by /v1/embeddings: send the text as 'input'",
    ("completion", "messages"): "is not supported by /v1/completions: send the text as 'prompt', or the messages to "
                                "/v1/chat/completions",
    ("responses", "messages"): "is not supported by /v1/responses: send the messages as 'input' items",
    ("responses", "max_tokens"): "is not supported by /v1/responses: use 'max_output_tokens'",
    ("responses", "max_completion_tokens"): "is not supported by /v1/responses: use 'max_output_tokens'",
    ("responses", "n"): "is not supported by /v1/responses: one response per call",
}


def check(payload: dict, kind: str) -> None:
    """A 400 in OpenAI's shape naming the first field of `payload` a call of `kind` may not send."""
    accepted = ACCEPTED[kind]
    for name in payload:
        if (name in accepted or (name in NULL_IS_UNSET and payload[name] is None)
                or (name in EMPTY_IS_UNSET and payload[name] == [])):
            continue
        reason = REFUSED_ON_PATH.get((kind, name)) or REFUSED_WITH_REASON.get(name)
        if reason is not None:
            raise errors.invalid_request(f"'{name}' {reason}.", param=name, code="unsupported_parameter")
        raise errors.invalid_request(f"Unrecognized request argument supplied: {printable(name)}", param=printable(name),
                                     code="unknown_parameter")


def refuse_best_of_past_n(payload: dict) -> None:
    """`best_of` above `n`: vLLM's completions ignore it and return `n` choices, not the best of more. Below `n`:
    OpenAI refuses it (the best 1 of 3 cannot be 3 choices); before, it passed and the engine returned `n`.

    NOTE: once both passed their own checks (`request.parse_payload`): before them, n=17 (past `MAX_N`) with best_of=1
    was told best_of was below n, naming the field that was right."""
    best_of, n = payload.get("best_of"), payload.get("n") or 1
    if best_of is None:
        return
    if best_of > n:
        raise errors.invalid_request(f"'best_of' ({best_of}) above 'n' ({n}) is not supported: the engine returns "
                                     "'n' choices; ask for more with 'n'.", param="best_of", code="unsupported_parameter")
    if best_of < n:
        raise errors.invalid_request(f"'best_of' must be greater than or equal to 'n': got best_of={best_of} and n={n}.",
                                     param="best_of", code="invalid_value")


def printable(name: str) -> str:
    """A field name (or a model's) as an error may quote it: at most 64 characters, nothing unprintable."""
    shown = name[:64]
    return shown if shown.isprintable() else ascii(shown)[1:-1]
