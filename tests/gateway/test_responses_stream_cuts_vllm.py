"""A cut `/v1/responses` stream's prompt, counted by a real vLLM engine (the package's shared engine, the tiny model on
CPU, started as the agent starts every engine): `POST /v1/responses/render` of the body the gateway sends it counts
exactly the `input_tokens` its `response.completed` says, so a stream cut before that event is billed no more prompt
than its engine computed (`endpoints.gateway.rendered_prompt`; the cuts themselves: `test_responses_stream_cuts.py`).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from endpoints.gateway import rendered_prompt, responses, upstream
from endpoints.gateway.directory import ReplicaInfo
from endpoints.gateway.request import InferenceRequest
from tests.gateway.conftest import ENGINE_CONTEXT, ENGINE_KEY, ENGINE_NAME

pytestmark = [pytest.mark.vllm]

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
BODIES = {
    "a string": {"input": "Say hello in three words."},
    "instructions and messages": {
        "instructions": "Answer briefly, in French.",
        "input": [
            {"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "Four."},
            {"role": "user", "content": [{"type": "input_text", "text": "And three plus three? " * 40}]},
        ],
    },
    "a function tool and its call": {
        "tools": [TOOL],
        "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C."},
        ],
    },
}


def _engine_body(body: dict) -> bytes:
    payload = {"model": ENGINE_NAME, "stream": True, "max_output_tokens": 4} | body
    request = InferenceRequest.parse(
        json.dumps(payload).encode(), kind=responses.RESPONSES, path=responses.PATH
    )
    return request.upstream_body(media_scope="org")


def _streamed_input_tokens(address: str, body: bytes) -> int:
    last = b""
    with httpx.stream(
        "POST",
        f"{address}/v1/responses",
        content=body,
        timeout=120,
        headers={"authorization": f"Bearer {ENGINE_KEY}", "content-type": "application/json"},
    ) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: "):
                last = line.encode()
    completed = json.loads(last[6:])
    assert completed["type"] == "response.completed"
    return completed["response"]["usage"]["input_tokens"]


async def _rendered(address: str, body: bytes) -> int | None:
    client = upstream.UpstreamClient()
    try:
        replica = ReplicaInfo(id="r", address=address, authorization=f"Bearer {ENGINE_KEY}")
        return await rendered_prompt.count_prompt_tokens(
            client, [replica], body, "req-render", max_model_len=ENGINE_CONTEXT
        )
    finally:
        await client.close()


@pytest.mark.parametrize("shape", list(BODIES))
def test_an_engines_render_counts_the_prompt_its_stream_says_in_its_last_event(vllm_engine, shape):
    body = _engine_body(BODIES[shape])
    assert asyncio.run(_rendered(vllm_engine, body)) == _streamed_input_tokens(vllm_engine, body)


def test_an_engine_asked_without_its_key_counts_nothing(vllm_engine):
    async def rendered_without_key() -> int | None:
        client = upstream.UpstreamClient()
        try:
            replica = ReplicaInfo(id="r", address=vllm_engine)
            return await rendered_prompt.count_prompt_tokens(
                client, [replica], _engine_body(BODIES["a string"]), "x", max_model_len=ENGINE_CONTEXT
            )
        finally:
            await client.close()

    assert asyncio.run(rendered_without_key()) is None
