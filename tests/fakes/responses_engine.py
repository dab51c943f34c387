"""A scripted `/v1/responses` engine: named SSE events shaped as vLLM writes them, for the ends of a Responses
stream a real engine gives only rarely (an event past the gateway's size cap, an engine's error, a replica dying).

    python -m tests.fakes.responses_engine --port 9100

The body's `metadata.scenario` picks the script: `ok` (50 deltas, then `response.completed` with `USAGE`),
`large_part` (a `response.content_part.done` past 8 MiB before the end, as vLLM writes it with every token's
`top_logprobs`), `error` (vLLM's `event: error` after the deltas, then the stream ends), `dies` (the process exits
after the deltas: a replica lost mid-stream), `slow` (300 deltas, 50 ms apart), `large_last` (the `large_part` stream,
its `response.completed` carrying the same logprobs, as vLLM's does, and its first `metadata.split` bytes written
apart: a read boundary inside the event's name), `error_first` (vLLM's `event: error` before any delta),
`slow_dies` (150 deltas 50 ms apart, longer than the gateway trusts a replica list it read, then the process exits),
`paced` (the `ok` stream, its deltas 50 ms apart: a client has time to leave it mid-way),
`error_after_call` (a function call announced, `response.output_item.added` as vLLM writes it once its parser has the
name, then `event: error` before its arguments' first delta) and `render_hangs` (the `error` stream, its render never
answered), `vllm_error` (the deltas, then the error event in vLLM's chat streams' shape, `{"error": {…}}`, then the
stream ends). Every stream starts as vLLM's does, with `response.created` and `response.in_progress` (then, with
`metadata.prefill_ms`, that long a silence before the rest: a prompt's prefill, or an engine that never gets to it;
with `metadata.pause_ms`, that long a silence after the first delta: an engine silent mid-stream); with
`metadata.whole` its text comes as vLLM's does, whole enough for the openai client's stream helper
(`client.responses.stream`): a message item and its part announced, each delta naming them.

`POST /v1/responses/render` answers as vLLM's (`--enable-scale-out`) does: the prompt's token ids, as many as `USAGE`
says; `GET /renders` says how many it was asked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import uvicorn

NUM_DELTAS = 50
NUM_SLOW_DELTAS = 300
NUM_SLOW_DIES_DELTAS = 150
USAGE = {
    "input_tokens": 7,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": NUM_DELTAS,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 7 + NUM_DELTAS,
}
RENDER_PATH = "/v1/responses/render"
_num_renders = 0
LARGE_PART_TOKENS = 9000  # ~1 KB of logprobs each: ~9.4 MB, past `sse.MAX_EVENT_BYTES`


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _response(status: str, usage: dict | None) -> dict:
    return {
        "id": "resp_x",
        "object": "response",
        "metadata": {},
        "output": [],
        "status": status,
        "usage": usage,
    }


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    if scope["path"] == "/renders":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(_num_renders).encode()})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == RENDER_PATH:
        await _render(send, (json.loads(body).get("metadata") or {}).get("scenario"))
        return
    metadata = json.loads(body).get("metadata") or {}
    scenario = metadata.get("scenario", "ok")
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    )

    async def out(data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})

    await out(
        _event(
            "response.created",
            {"type": "response.created", "sequence_number": 0, "response": _response("in_progress", None)},
        )
    )
    await out(
        _event(
            "response.in_progress",
            {
                "type": "response.in_progress",
                "sequence_number": 1,
                "response": _response("in_progress", None),
            },
        )
    )
    # NOTE: vLLM writes its lifecycle events as it takes the request, its first output after the prompt's prefill
    await asyncio.sleep(float(metadata.get("prefill_ms", "0")) / 1000)
    if scenario == "error_after_call":
        item = {
            "type": "function_call",
            "id": "fc_x",
            "call_id": "call_x",
            "name": "f",
            "arguments": "",
            "status": "in_progress",
        }
        await out(
            _event(
                "response.output_item.added",
                {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0, "item": item},
            )
        )
    whole = bool(metadata.get("whole"))
    if whole:
        item = {"type": "message", "id": "msg_x", "role": "assistant", "status": "in_progress", "content": []}
        await out(
            _event(
                "response.output_item.added",
                {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0, "item": item},
            )
        )
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        await out(
            _event(
                "response.content_part.added",
                {
                    "type": "response.content_part.added",
                    "sequence_number": 3,
                    "item_id": "msg_x",
                    "output_index": 0,
                    "content_index": 0,
                    "part": part,
                },
            )
        )
    first_delta = 4 if whole else 1
    num_deltas = {
        "error_first": 0,
        "error_after_call": 0,
        "slow": NUM_SLOW_DELTAS,
        "slow_dies": NUM_SLOW_DIES_DELTAS,
    }.get(scenario, NUM_DELTAS)
    pause_s = float(metadata.get("pause_ms", "0")) / 1000
    for index in range(num_deltas):
        if scenario in ("slow", "slow_dies", "paced"):
            await asyncio.sleep(0.05)
        if index == 1 and pause_s:
            await asyncio.sleep(pause_s)
        await out(
            _event(
                "response.output_text.delta",
                {
                    "type": "response.output_text.delta",
                    "sequence_number": first_delta + index,
                    "delta": "tok ",
                    "logprobs": [],
                }
                | ({"item_id": "msg_x", "output_index": 0, "content_index": 0} if whole else {}),
            )
        )
    logprob = {"token": "x" * 1000, "logprob": -1.0, "top_logprobs": []}
    if scenario in ("large_part", "large_last"):
        await out(
            _event(
                "response.content_part.done",
                {
                    "type": "response.content_part.done",
                    "sequence_number": 60,
                    "part": {
                        "type": "output_text",
                        "text": "tok " * NUM_DELTAS,
                        "logprobs": [logprob] * LARGE_PART_TOKENS,
                    },
                },
            )
        )
        await out(
            _event("response.output_item.done", {"type": "response.output_item.done", "sequence_number": 61})
        )
    if scenario in ("error", "error_first", "error_after_call", "render_hangs"):
        await out(
            _event(
                "error",
                {
                    "type": "error",
                    "sequence_number": 61,
                    "code": "internal_error",
                    "message": "Internal server error",
                },
            )
        )
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if scenario == "vllm_error":
        error = {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
        await out(_event("error", {"error": error}))
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if scenario in ("dies", "slow_dies"):
        await asyncio.sleep(0.2)  # the deltas leave before the process does
        os._exit(1)
    last = _event(
        "response.completed",
        {"type": "response.completed", "sequence_number": 99, "response": _response("completed", USAGE)},
    )
    if scenario == "large_last":
        response = _response("completed", USAGE) | {
            "output": [
                {
                    "type": "message",
                    "content": [
                        {
                            "type": "output_text",
                            "text": "tok " * NUM_DELTAS,
                            "logprobs": [logprob] * LARGE_PART_TOKENS,
                        }
                    ],
                }
            ]
        }
        last = _event(
            "response.completed", {"type": "response.completed", "sequence_number": 99, "response": response}
        )
        split = int(metadata.get("split", "0"))
        await out(last[:split])
        await asyncio.sleep(0.3)  # read apart
        last = last[split:]
    await out(last)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _render(send, scenario: str | None) -> None:
    global _num_renders
    _num_renders += 1
    if scenario == "render_hangs":
        await asyncio.sleep(3600)
    answer = {"request_id": "resp_x", "token_ids": list(range(USAGE["input_tokens"])), "sampling_params": {}}
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    # NOTE: a test double: on SIGTERM a call it still holds (`render_hangs`, `slow`) is cut after 1 s, not waited for
    # until the test's stop gives up and kills it (10 s).
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="warning", timeout_graceful_shutdown=1)
