"""A fast, deterministic OpenAI-compatible upstream, standing in for a vLLM replica where the
engine itself is not under test (gateway error paths, faults, the overhead benchmark).

    python -m tests.fakes.mock_openai --port 9100 [--token-delay-ms 0] [--fail-after-chunks N]

It speaks what the gateway relies on from vLLM: `/health`, non-streaming answers with
`usage`, streaming SSE with `stream_options.include_usage` / `continuous_usage_stats`.
Each completion has `max_tokens` tokens (default 16), one per chunk. With INFERPLANE_ENGINE_API_KEY
set it runs behind the same `EngineKeyGuard` as a real engine; `GET /_stats` counts the requests
that reached it and gives the last one's body (`last_payload`). With `--prefix-cache`, a modelled prefix cache
reports `cached_tokens` for a prompt whose first message (or first 256 characters) it has seen before. With
`--hold-stream-ends`, a stream sends its tokens and then waits, before its end (its usage and `[DONE]`), until
`POST /_release`: calls kept in flight for as long as a test needs them, ended when it says.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from gpu_agent.runtime.engine_guard import ENGINE_API_KEY_ENV, EngineKeyGuard

PROMPT_TOKENS = 7
EMBEDDING_SIZE = 8  # `/v1/embeddings`: every input gets this many zeros, and PROMPT_TOKENS tokens
# A request whose `user` is this is answered with an HTTP 500, every time.
ENGINE_FAILS_FOR = "engine-fails-this"
# A streamed request whose `user` is this gets one chunk, then the error event vLLM writes when its generation fails
# mid-stream (`vllm.entrypoints.openai.chat_completion.serving`: its own type name, the HTTP status as the code), then
# `[DONE]`.
ENGINE_ERRORS_MID_STREAM = "engine-errors-mid-stream"
VLLM_STREAM_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                               "code": 500}}
# A request whose `user` is this and a unix time (`engine-fails-until:1765000000.5`) is answered with an HTTP 500 until
# then: an engine failing for a while, then well again.
ENGINE_FAILS_UNTIL = "engine-fails-until:"
# A request whose `user` is this is answered with an HTTP 500 once its answer's time has passed (`max_tokens` tokens at
# the token delay): an engine that fails late, after it generated.
ENGINE_FAILS_LATE = "engine-fails-late"
# A request whose `user` is this has the process exit once its answer's time has passed, answering nothing: an engine
# that died on it (its connection closed before the answer's first byte).
ENGINE_DIES_ON = "engine-dies-on-this"


def _dumps(data) -> bytes:
    """Compact JSON, as vLLM writes it (the gateway edits `usage` in place in such chunks)."""
    return json.dumps(data, separators=(",", ":")).encode()


def _usage(completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """A `usage` object; `prompt_tokens_details` only with `cached_tokens`. NOTE: as vLLM (`--enable-prompt-tokens-details`)
    writes them: a whole answer's and a stream's final usage chunk carry it; a stream's per-chunk continuous usage
    (`stream_options.continuous_usage_stats`) carries only the three counts (vLLM's `chat_completion/serving.py`).
    Before, every chunk carried it, and the suite tested a gateway whose progress knew prefix-cache hits."""
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": completion_tokens,
             "total_tokens": PROMPT_TOKENS + completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def _prefix(payload: dict) -> str:
    """What this mock's modelled prefix cache remembers of a prompt: its first message, or 256 characters."""
    messages = payload.get("messages")
    return json.dumps(messages[0], sort_keys=True) if messages else str(payload.get("prompt"))[:256]


class MockOpenAI:
    def __init__(self, token_delay_s: float = 0.0, fail_after_chunks: int | None = None, one_write: bool = False,
                 prefix_cache: bool = False, prefill_s: float = 0.0, whole_answer_bytes: int = 0,
                 cut_whole_answers: int = 0, logprob_token_bytes: int = 1000, hold_stream_ends: bool = False):
        self.token_delay_s = token_delay_s
        self.prefill_s = prefill_s  # before the first token (a stream's first event comes after it)
        self.whole_answer_bytes = whole_answer_bytes  # an answer (or a whole stream) padded to about this size (logprobs)
        # each padding logprob's token: long ones make few JSON objects, short ones (real tokens) many
        self.logprob_token_bytes = logprob_token_bytes
        self.fail_after_chunks = fail_after_chunks
        self.cut_whole_answers = cut_whole_answers  # the first this many non-streamed answers: headers, half a body, gone
        self.one_write = one_write  # a whole stream in one write: what a fast engine looks like to a busy gateway
        self.num_requests = 0
        self.last_payload: dict | None = None  # the body of the last request that reached it, as the engine read it
        self.num_streams_left = 0  # streams whose client (the gateway) closed the connection before their end
        self.prefix_cache = prefix_cache
        self.prefixes_seen: set[str] = set()  # a modelled prefix cache: a prefix seen before is reported cached
        # set by `POST /_release`: the streams' ends wait for it (`--hold-stream-ends`)
        self.released: asyncio.Event | None = asyncio.Event() if hold_stream_ends else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if path == "/health":
            return await self._json(send, 200, {})
        if path == "/_stats":
            return await self._json(send, 200, {"num_requests": self.num_requests, "num_streams_left": self.num_streams_left,
                                                "last_payload": self.last_payload})
        if path == "/_release":
            if self.released is not None:
                self.released.set()
            return await self._json(send, 200, {})
        self.num_requests += 1
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        payload = self.last_payload = json.loads(body or b"{}")
        if payload.get("max_tokens") == 999_999:
            return await self._json(send, 400, {"error": {"message": "max_tokens too large", "type": "BadRequestError",
                                                           "param": "max_tokens", "code": 400}})
        user = payload.get("user")
        if user == ENGINE_FAILS_FOR or (
            isinstance(user, str) and user.startswith(ENGINE_FAILS_UNTIL)
            and time.time() < float(user.removeprefix(ENGINE_FAILS_UNTIL))
        ):
            # vLLM's 500 before generating (a lone surrogate in `stop` was one): its engine up, this request failing
            return await self._json(send, 500, {"error": {"message": "", "type": "InternalServerError", "param": None,
                                                           "code": 500}})
        if user in (ENGINE_FAILS_LATE, ENGINE_DIES_ON):
            num_tokens = int(payload.get("max_tokens") or payload.get("max_completion_tokens") or 16)
            await asyncio.sleep(self.prefill_s + self.token_delay_s * num_tokens)
            if user == ENGINE_DIES_ON:
                os._exit(1)
            return await self._json(send, 500, {"error": {"message": "Internal server error",
                                                           "type": "InternalServerError", "param": None, "code": 500}})
        if path.endswith("/embeddings"):
            return await self._embeddings(send, payload)
        if path.endswith("/responses") and not payload.get("stream"):
            return await self._response(send, payload)
        num_tokens = int(payload.get("max_tokens") or payload.get("max_completion_tokens") or 16)
        chat = path.endswith("/chat/completions")
        cached = PROMPT_TOKENS - 1 if self.prefix_cache and _prefix(payload) in self.prefixes_seen else 0
        self.prefixes_seen.add(_prefix(payload))
        if payload.get("stream"):
            return await self._stream(send, payload, num_tokens, chat, cached, receive)
        await asyncio.sleep(self.prefill_s + self.token_delay_s * num_tokens)
        text = " ".join(["tok"] * num_tokens)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"} if chat
                  else {"index": 0, "text": text, "finish_reason": "length"})
        if self.whole_answer_bytes:
            entry = {"token": "x" * self.logprob_token_bytes, "logprob": -1.0}
            choice["logprobs"] = {"content": [entry] * (self.whole_answer_bytes // len(_dumps(entry)))}
        answer = {
            "id": "cmpl-mock", "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": payload.get("model"), "choices": [choice], "usage": _usage(num_tokens, cached),
        }
        if self.cut_whole_answers > 0:
            self.cut_whole_answers -= 1
            body = _dumps(answer)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
            raise RuntimeError("mock replica crashed mid-answer")  # uvicorn drops the connection
        return await self._json(send, 200, answer)

    async def _stream(self, send, payload, num_tokens, chat, cached=0, receive=None):
        options = payload.get("stream_options") or {}
        include_usage, continuous = bool(options.get("include_usage")), bool(options.get("continuous_usage_stats"))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        pending: list[bytes] = []

        async def emit(data: bytes, more: bool = True) -> None:
            if self.one_write and more:
                pending.append(data)
                return
            await send({"type": "http.response.body", "body": b"".join(pending) + data, "more_body": more})
            pending.clear()

        base = {"id": "cmpl-mock", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": payload.get("model")}
        left = asyncio.ensure_future(receive()) if receive is not None else None  # `http.disconnect` once it leaves
        await asyncio.sleep(self.prefill_s)
        for index in range(num_tokens):
            if left is not None and left.done():
                self.num_streams_left += 1
                return
            if self.fail_after_chunks is not None and index >= self.fail_after_chunks:
                raise RuntimeError("mock replica crashed mid-stream")  # uvicorn drops the connection
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            choice = {"index": 0, "delta": {"content": "tok "}, "finish_reason": None} if chat else \
                     {"index": 0, "text": "tok ", "finish_reason": None}
            if self.whole_answer_bytes:  # the whole stream padded to about this size
                choice["logprobs"] = {"content": [{"token": "x" * 1000, "logprob": -1.0}]
                                      * max(1, self.whole_answer_bytes // num_tokens // 1030)}
            chunk = base | {"choices": [choice]}
            if include_usage and continuous:
                chunk["usage"] = _usage(index + 1)
            await emit(b"data: " + _dumps(chunk) + b"\n\n")
            if payload.get("user") == ENGINE_ERRORS_MID_STREAM:
                # as vLLM writes it: `json.dumps`, its default separators
                await emit(b"data: " + json.dumps(VLLM_STREAM_ERROR).encode() + b"\n\ndata: [DONE]\n\n", more=False)
                return
        if self.released is not None:
            await self.released.wait()
        if include_usage:
            final = base | {"choices": [], "usage": _usage(num_tokens, cached)}
            await emit(b"data: " + _dumps(final) + b"\n\n")
        await emit(b"data: [DONE]\n\n", more=False)
        if left is not None:
            left.cancel()

    async def _embeddings(self, send, payload):
        await asyncio.sleep(self.prefill_s)
        inputs = payload.get("input")
        num_inputs = 1 if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)) \
            else len(inputs or [])
        data = [{"index": index, "object": "embedding", "embedding": [0.0] * EMBEDDING_SIZE} for index in range(num_inputs)]
        tokens = PROMPT_TOKENS * num_inputs
        return await self._json(send, 200, {"object": "list", "model": payload.get("model"), "data": data,
                                            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _response(self, send, payload):
        """A whole `/v1/responses` answer, as vLLM writes one: `max_output_tokens` tokens of text."""
        num_tokens = int(payload.get("max_output_tokens") or 16)
        await asyncio.sleep(self.prefill_s + self.token_delay_s * num_tokens)
        text = " ".join(["tok"] * num_tokens)
        output = [{"id": "msg-mock", "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": text, "annotations": []}]}]
        usage = {"input_tokens": PROMPT_TOKENS, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": num_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": PROMPT_TOKENS + num_tokens}
        return await self._json(send, 200, {"id": "resp-mock", "object": "response", "created_at": int(time.time()),
                                            "model": payload.get("model"), "status": "completed", "output": output,
                                            "usage": usage})

    async def _json(self, send, status, data):
        body = _dumps(data)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def main() -> None:
    import uvicorn

    global PROMPT_TOKENS

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument("--fail-after-chunks", type=int, default=None)
    parser.add_argument("--one-write", action="store_true", help="send each stream in one write")
    parser.add_argument("--prefix-cache", action="store_true", help="report cached tokens for a prefix seen before")
    parser.add_argument("--prefill-ms", type=float, default=0.0, help="time before the first token")
    parser.add_argument("--whole-answer-bytes", type=int, default=0, help="pad answers (and whole streams) to about this size")
    parser.add_argument("--logprob-token-bytes", type=int, default=1000, help="the length of each padding logprob's token")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="the prompt tokens every usage says")
    parser.add_argument("--hold-stream-ends", action="store_true",
                        help="each stream waits before its end (its usage and [DONE]) until POST /_release")
    parser.add_argument("--cut-whole-answers", type=int, default=0,
                        help="the first N non-streamed answers stop half-way (headers sent, the connection dropped)")
    args = parser.parse_args()
    PROMPT_TOKENS = args.prompt_tokens
    app = MockOpenAI(args.token_delay_ms / 1000, args.fail_after_chunks, args.one_write, args.prefix_cache,
                     args.prefill_ms / 1000, args.whole_answer_bytes, args.cut_whole_answers,
                     args.logprob_token_bytes, args.hold_stream_ends)
    if os.environ.get(ENGINE_API_KEY_ENV):
        app = EngineKeyGuard(app)
    # NOTE: a test double: on SIGTERM a call it still holds (a stream, an answer it never gives) is cut after 1 s, not
    # waited for until the test's stop gives up and kills it (10 s).
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, timeout_graceful_shutdown=1)


if __name__ == "__main__":
    main()
