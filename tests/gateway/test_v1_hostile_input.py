"""Malformed `/v1` bodies are a 400 in OpenAI's shape, never a 500, and never reach the engine.

Each case here was a 500 (or garbage passed to the engine) before the gateway checked bodies in
`endpoints/gateway/request.py`.
"""

import json

import httpx
import pytest

from billing.models import UsageRecord
from endpoints.gateway.errors import OpenAIError
from endpoints.gateway.request import MAX_DEPTH, parse_payload
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = b'[{"role": "user", "content": "Hello"}]'


def _chat(model: str, rest: bytes = b"") -> bytes:
    return b'{"model": "' + model.encode() + b'", "messages": ' + HELLO + rest + b"}"


def _bodies(model: str) -> dict[str, tuple[str, bytes]]:
    """What a hostile client sends, by what the test calls it: (path, raw body)."""
    chat, completions = "/v1/chat/completions", "/v1/completions"
    return {
        "a content part whose text is a number": (chat, b'{"model": "' + model.encode() + b'", "messages": '
                                                  b'[{"role": "user", "content": [{"type": "text", "text": 5}]}]}'),
        "JSON nested a hundred thousand deep": (chat, _chat(model, b', "x": ' + b"[" * 100_000 + b"]" * 100_000)),
        "JSON nested past the limit": (chat, _chat(model, b', "x": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1))),
        "an integer of 5,000 digits": (chat, _chat(model, b', "max_tokens": ' + b"9" * 5000)),
        "an integer past 64 bits": (completions, b'{"model": "' + model.encode() + b'", "prompt": [18446744073709551616]}'),
        "NaN": (chat, _chat(model, b', "temperature": NaN')),
        "a float past double precision": (chat, _chat(model, b', "top_p": 1e999')),
        "a model name with a lone surrogate": (chat, _chat("\\ud800")),
        "a model name with a NUL": (chat, _chat("a\\u0000b")),
        "an array body": (chat, b"[1, 2, 3]"),
        "a string body": (chat, b'"hello"'),
        "a number body": (chat, b"42"),
        "null": (chat, b"null"),
        "bytes that are not UTF-8": (chat, b"\xff\xfe\x00"),
        "a message that is a string": (chat, b'{"model": "' + model.encode() + b'", "messages": ["hi"]}'),
        "a message without a role": (chat, b'{"model": "' + model.encode() + b'", "messages": [{"content": "hi"}]}'),
        "content that is an object": (chat, b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", "content": {"a": 1}}]}'),
        "a prompt of mixed tokens and text": (completions, b'{"model": "' + model.encode() + b'", "prompt": [1, "a"]}'),
        "a negative token id": (completions, b'{"model": "' + model.encode() + b'", "prompt": [-1]}'),
        "temperature as a string": (chat, _chat(model, b', "temperature": "hot"')),
        "temperature out of range": (chat, _chat(model, b', "temperature": 9')),
        "stream as a number": (chat, _chat(model, b', "stream": 1')),
        "stream_options.include_usage as a string": (chat, _chat(model, b', "stream": true, "stream_options": {"include_usage": "yes"}')),
        "tools that are not an array": (chat, _chat(model, b', "tools": {"type": "function"}')),
        "a tool without a name": (chat, _chat(model, b', "tools": [{"type": "function", "function": {}}]')),
        "a tool_choice that is a number": (chat, _chat(model, b', "tool_choice": 3')),
        "a response_format type that is a list": (chat, _chat(model, b', "response_format": {"type": []}')),
        "a stop that is a number": (chat, _chat(model, b', "stop": 7')),
        "n as a float": (chat, _chat(model, b', "n": 2.0')),
        "max_tokens as a boolean": (chat, _chat(model, b', "max_tokens": true')),
        "logit_bias out of range": (chat, _chat(model, b', "logit_bias": {"50256": 1000}')),
        "logprobs as a boolean on completions": (completions, b'{"model": "' + model.encode() + b'", "prompt": "x", "logprobs": true}'),
    }


def test_every_malformed_body_is_a_400_in_openais_shape_and_nothing_reaches_the_engine(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    answers = {}
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=30) as client:
        for name, (path, body) in _bodies(endpoint.name).items():
            response = client.post(path, content=body, headers={"content-type": "application/json"})
            answers[name] = (response.status_code, response.text)

    failures = {name: status for name, (status, _) in answers.items() if status != 400}
    assert failures == {}
    answers = {name: (status, json.loads(text)) for name, (status, text) in answers.items()}
    for name, (_, answer) in answers.items():
        assert set(answer["error"]) == {"message", "type", "param", "code"}, name
        assert answer["error"]["type"] == "invalid_request_error", name
    assert answers["a content part whose text is a number"][1]["error"]["param"] == "messages[0].content[0].text"
    assert answers["temperature as a string"][1]["error"]["param"] == "temperature"
    assert not UsageRecord.objects.exists()


def test_well_formed_bodies_with_every_known_field_still_pass_to_the_engine(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    headers = {"Authorization": f"Bearer {tenant.key}"}
    chat = httpx.post(f"{gateway}/v1/chat/completions", headers=headers, timeout=30, json={
        "model": endpoint.name, "max_tokens": 2, "temperature": 0.7, "top_p": 1, "n": 1, "stop": ["\n"], "seed": 7,
        "presence_penalty": -2, "frequency_penalty": 2.0, "logit_bias": {"1": -100}, "user": "u-1", "logprobs": True,
        "top_logprobs": 2, "tool_choice": "auto", "parallel_tool_calls": False, "response_format": {"type": "text"},
        "tools": [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}],
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                            "function": {"name": "now", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "noon"}],
        "top_k": 5,  # vLLM's own extension: the engine judges it
    })
    completion = httpx.post(f"{gateway}/v1/completions", headers=headers, timeout=30, json={
        "model": endpoint.name, "prompt": [[1, 2, 3], [4]], "max_tokens": 2, "logprobs": 1, "echo": False, "best_of": 1,
        "stream": True, "stream_options": {"include_usage": True},
    })

    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 2
    assert completion.status_code == 200 and "data: [DONE]" in completion.text


@pytest.mark.parametrize("body, kind, param", [
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 17}', "chat", "n"),
    (b'{"model": "", "prompt": "x"}', "completion", "model"),
    (b'{"model": "m", "prompt": []}', "completion", "prompt"),
])
def test_the_earlier_rules_still_hold(body, kind, param):
    with pytest.raises(OpenAIError) as refused:
        parse_payload(body, kind)

    assert (refused.value.status, refused.value.param) == (400, param)


def _peak_bytes_of(call) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        call()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def test_a_body_of_millions_of_tiny_elements_is_refused_before_it_is_decoded():
    # Decoding costs per element, before any limit of the key is counted: 8 MiB of `{},` took 2.5 s of the event
    # loop and ~390 MiB. Refused from the raw bytes, it costs a scan.
    body = b'{"model": "m", "prompt": "hi", "x": [' + b"{}," * 600_000 + b"{}]}"
    refused = []

    def parse():
        try:
            parse_payload(body, "completion")
        except OpenAIError as exc:
            refused.append(exc)

    assert _peak_bytes_of(parse) < 8 * 1024 * 1024
    [error] = refused
    assert error.status == 400 and "elements" in error.message


def test_a_completions_call_of_more_than_2048_prompts_is_refused():
    # 2.8 million empty prompts in 8 MiB took ~12 s of the event loop to bound and price before any refusal.
    with pytest.raises(OpenAIError) as refused:
        parse_payload(json.dumps({"model": "m", "prompt": [""] * 2049, "max_tokens": 1}).encode(), "completion")
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert parse_payload(json.dumps({"model": "m", "prompt": ["a"] * 2048}).encode(), "completion")["prompt"] == ["a"] * 2048
    assert parse_payload(json.dumps({"model": "m", "prompt": list(range(5000))}).encode(), "completion")  # one prompt of ids


def test_a_caller_without_a_valid_key_has_its_body_read_and_dropped_never_kept():
    # The body was read whole before the key was checked: anyone could make a gateway process hold 8 MiB (and as much
    # again at the join) per connection without any key. A refused caller's body is now read to its end and dropped.
    import asyncio

    from controlplane import access_log
    from endpoints.gateway.app import Gateway
    from endpoints.gateway.request import MAX_BODY_BYTES

    access_log.prepare()  # as a web process's startup does: its imports are not this request's
    chunk = b"x" * 65_536
    num_chunks = MAX_BODY_BYTES // len(chunk)
    received, sent = [], []

    async def receive():
        received.append(len(chunk))  # each chunk made when asked for: the test keeps none of them either
        return {"type": "http.request", "body": bytes(chunk), "more_body": len(received) < num_chunks}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST", "client": ("203.0.113.9", 4000),
             "headers": [(b"authorization", b"Basic bm90OmEta2V5"), (b"content-type", b"application/json")]}

    assert _peak_bytes_of(lambda: asyncio.run(Gateway(fallback=None)._handle(scope, receive, send))) < 2 * 1024 * 1024
    assert len(received) == num_chunks, "read to its end: the client reads the answer, not a reset connection"
    assert sent[0]["status"] == 401 and json.loads(sent[1]["body"])["error"]["code"] == "invalid_api_key"


def test_an_oversized_body_is_a_413_for_a_caller_and_a_401_without_a_valid_key(gateway, tenant):
    oversized = b'{"model": "m", "messages": [], "x": "' + b"y" * (8 * 1024 * 1024) + b'"}'
    for key, status, code in [("ip_000000000000_wrong", 401, "invalid_api_key"), (tenant.key, 413, None)]:
        answer = httpx.post(f"{gateway}/v1/chat/completions", content=oversized, timeout=60,
                            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        assert answer.status_code == status, (key, answer.text[:200])
        assert answer.json()["error"]["code"] == code and answer.json()["error"]["message"]


def test_an_upload_without_a_valid_key_or_past_the_size_limit_never_reaches_django(settings):
    # Django reads a whole body (to a temporary file past 2.5 MB) before any view runs: anyone without a key could
    # have a web pod write up to the upload limit to its disk per request.
    import asyncio

    from endpoints.gateway.app import Gateway

    handed_to_django = []

    async def django(scope, receive, send):
        handed_to_django.append(scope["path"])

    def upload(headers: list[tuple[bytes, bytes]]) -> list[dict]:
        sent, chunks = [], iter([b"x" * 65_536] * 64)

        async def receive():
            chunk = next(chunks, b"")
            return {"type": "http.request", "body": chunk, "more_body": bool(chunk)}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "path": "/v1/files", "method": "POST", "client": ("203.0.113.9", 4000),
                 "headers": [(b"content-type", b"multipart/form-data; boundary=x"), *headers]}
        asyncio.run(Gateway(fallback=django)(scope, receive, send))
        return sent

    for headers in ([], [(b"authorization", b"Basic bm90OmEta2V5")], [(b"authorization", b"Bearer ip_00000000_x")]):
        sent = upload(headers)
        assert sent[0]["status"] == 401 and json.loads(sent[1]["body"])["error"]["code"] == "invalid_api_key"
    assert handed_to_django == []
