"""An engine's 4xx as OpenAI's clients read it (`errors.engine_refused`), from the bodies vLLM writes.

The real engine's refusal of a prompt past its context is tested with the openai client in
tests/gateway/test_vllm_gateway.py; these are vLLM's other ways of saying it, and the refusals that stay as they were.
"""

import json

import pytest

from endpoints.gateway import embeddings
from endpoints.gateway.request import InferenceRequest


def _vllm_refusal(message: str, param: str | None = None) -> bytes:
    # vLLM's `ErrorResponse` (`vllm.entrypoints.serve.engine.protocol`): its own type name, the HTTP status as the code
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}).encode()


def _request(kind: str, body: dict) -> InferenceRequest:
    return InferenceRequest.parse(json.dumps({"model": "m"} | body).encode(), kind=kind, path=f"/v1/{kind}")


TOO_MANY_TOKENS = _vllm_refusal("This model's maximum context length is 2048 tokens. However, your prompt contains 2148 "
                                "input tokens, which exceeds this limit even without any output tokens. Please reduce "
                                "the length of the input prompt. (parameter=input_tokens, value=2148)", "input_tokens")
# vLLM's input processor says it without a parameter (a multimodal prompt, or one whose renderer checked nothing)
PAST_MODEL_LENGTH = _vllm_refusal("The decoder prompt (length 2100) is longer than the maximum model length of 2048. "
                                  "Make sure that `max_model_len` is no smaller than the number of text tokens.")


@pytest.mark.parametrize(("kind", "body", "param"), [
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("completion", {"prompt": "hi"}, "prompt"),
    ("embedding", {"input": "hi"}, "input"),
    ("responses", {"input": "hi"}, "input"),
])
@pytest.mark.parametrize("refusal", [TOO_MANY_TOKENS, PAST_MODEL_LENGTH])
def test_a_prompt_past_the_context_is_context_length_exceeded_naming_the_kinds_prompt(kind, body, param, refusal):
    error = _request(kind, body).engine_refusal(400, refusal)
    assert (error.status, error.type, error.code, error.param) == (400, "invalid_request_error",
                                                                   "context_length_exceeded", param)
    assert "2048" in error.message


def test_other_refusals_keep_the_engines_message_and_param_and_drop_its_numeric_code():
    error = _request("chat", {"messages": [{"role": "user", "content": "hi"}]}).engine_refusal(
        400, _vllm_refusal("top_k must be -1 (disable), or at least 1, got 0.", "top_k"))
    assert (error.code, error.param, error.type) == (None, "top_k", "invalid_request_error")


def test_a_refused_dimensions_still_names_dimensions():
    error = embeddings.engine_refusal(400, _vllm_refusal("Model does not support matryoshka representation, changing "
                                                         "output dimensions will lead to poor results."),
                                      {"model": "m", "input": "hi", "dimensions": 4})
    assert (error.code, error.param) == (None, "dimensions")


def test_an_engines_error_event_mid_stream_is_a_server_error_or_the_requests_refusal():
    request = _request("chat", {"messages": [{"role": "user", "content": "hi"}], "stream": True})
    failed = request.engine_stream_error(json.dumps({"error": {"message": "The engine is shutting down", "type":
                                                    "ServiceUnavailableError", "param": None, "code": 503}}).encode())
    assert (failed.status, failed.type, failed.code, failed.message) == (503, "server_error", None,
                                                                          "The engine is shutting down")
    refused = request.engine_stream_error(TOO_MANY_TOKENS)
    assert (refused.type, refused.code, refused.param) == ("invalid_request_error", "context_length_exceeded", "messages")
    unreadable = request.engine_stream_error(b'{"error": "boom"')
    assert (unreadable.status, unreadable.type) == (500, "server_error")


@pytest.mark.parametrize("refusal", [
    # vLLM quotes the caller's own grammar, regex or schema in its refusal of it (`Grammar error: {err}`,
    # `Error parsing regex: {e}`): a tenant's text holding the words was taken for a prompt past the context
    _vllm_refusal("Grammar error: at line 1: unexpected token in \"answer: maximum context length\""),
    _vllm_refusal("Error parsing regex: unbalanced parenthesis in '(longer than the maximum model length'"),
    _vllm_refusal("structured_outputs.regex is invalid: 'This model's maximum context length is 5 tokens'",
                  "structured_outputs.regex"),
])
def test_another_refusal_quoting_the_words_is_not_taken_for_a_prompt_past_the_context(refusal):
    error = _request("chat", {"messages": [{"role": "user", "content": "hi"}]}).engine_refusal(400, refusal)
    assert error.code != "context_length_exceeded"
    assert error.param != "messages"
