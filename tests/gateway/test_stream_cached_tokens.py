"""A streamed call's prefix-cache hits are known only from its closing usage chunk: vLLM's per-chunk continuous usage
(`stream_options.continuous_usage_stats`, which the gateway asks for) carries no `prompt_tokens_details` (its
`chat_completion/serving.py`), and the fake engine writes its chunks the same way. So a stream cut before that chunk,
and a lost gateway's progress, bill a prefix-cached prompt at the full input price (README, the lost-gateway
paragraph). Before, the fake engine put `prompt_tokens_details` on every chunk, and the suite tested a gateway whose
progress knew the hits."""

import asyncio
import json

from endpoints.gateway.tally import UsageTally
from tests.fakes.mock_openai import PROMPT_TOKENS, MockOpenAI

CHAT = {"model": "m", "stream": True, "max_tokens": 3, "messages": [{"role": "system", "content": "a long policy"}],
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def _stream(engine: MockOpenAI) -> list[bytes]:
    """The data events of one streamed chat from `engine`, [DONE] left out."""
    body = json.dumps(CHAT).encode()
    sent: list[bytes] = []

    async def run():
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive():
            try:
                return next(messages)
            except StopIteration:
                await asyncio.Event().wait()  # the client stays connected

        async def send(message):
            sent.append(message.get("body", b""))

        await engine({"type": "http", "path": "/v1/chat/completions"}, receive, send)

    asyncio.run(run())
    return [event for event in b"".join(sent).split(b"\n\n") if event.startswith(b"data: {")]


def test_a_streams_per_chunk_usage_knows_no_prefix_cache_hits_until_its_closing_chunk():
    engine = MockOpenAI(prefix_cache=True)
    _stream(engine)  # the prompt's prefix, now cached
    *chunks, closing = _stream(engine)
    tally = UsageTally()
    for event in chunks:
        tally.take_chunk(json.loads(event[6:])["usage"], event)
    assert (tally.prompt_tokens, tally.cached_tokens, tally.completion_tokens) == (PROMPT_TOKENS, 0, 3)

    tally.take_totals(json.loads(closing[6:])["usage"])
    assert (tally.prompt_tokens, tally.cached_tokens, tally.completion_tokens) == (PROMPT_TOKENS, PROMPT_TOKENS - 1, 3)
