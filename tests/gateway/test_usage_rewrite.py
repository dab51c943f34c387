"""The stream relay edits `usage` in each SSE event at byte level; the result must equal what
parsing, editing and re-serialising the chunk gives, for compact (vLLM) and spaced JSON alike."""

import json

import pytest

from endpoints.gateway import sse
from endpoints.gateway.sse import UsageScanner, find_usage, rewrite_event

USAGE = {"prompt_tokens": 7, "total_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
TOKEN_CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": {"content": 'say "usage":{} ,"usage": {'}, "finish_reason": None}],
               "usage": USAGE}
CLOSING_CHUNK = TOKEN_CHUNK | {"choices": []}


def _event(chunk: dict, compact: bool) -> bytes:
    separators = (",", ":") if compact else (", ", ": ")
    return b"data: " + json.dumps(chunk, separators=separators).encode()


def _parsed(event: bytes | None) -> dict | None:
    return None if event is None else json.loads(event.removeprefix(b"data: "))


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "spaced"])
@pytest.mark.parametrize(
    ("wants_usage", "wants_continuous", "token_usage", "closing_sent"),
    [(False, False, "absent", False), (True, False, None, True), (True, True, USAGE, True)],
    ids=["no-usage", "include-usage", "continuous"],
)
def test_usage_reaches_the_client_only_as_asked_and_is_always_read(compact, wants_usage, wants_continuous, token_usage,
                                                                 closing_sent):
    out, usage = rewrite_event(_event(TOKEN_CHUNK, compact), wants_usage, wants_continuous)

    assert usage == USAGE
    chunk = _parsed(out)
    assert chunk["choices"] == TOKEN_CHUNK["choices"]  # content that looks like a usage field is untouched
    if token_usage == "absent":
        assert "usage" not in chunk
    else:
        assert chunk["usage"] == token_usage

    closing, closing_usage = rewrite_event(_event(CLOSING_CHUNK, compact), wants_usage, wants_continuous)
    assert closing_usage == USAGE
    assert (closing is not None) == closing_sent
    if closing_sent:
        assert _parsed(closing) == CLOSING_CHUNK


def test_events_without_usage_comments_and_done_pass_through_unchanged():
    plain = _event({k: v for k, v in TOKEN_CHUNK.items() if k != "usage"}, compact=True)
    for event in (plain, b": starting engine", b"data: [DONE]", b"data: not json"):
        assert rewrite_event(event, False, False) == (event, None)


def test_a_null_usage_field_is_removed_or_kept_and_carries_nothing():
    event = _event(TOKEN_CHUNK | {"usage": None}, compact=True)

    assert _parsed(rewrite_event(event, False, False)[0]) == {k: v for k, v in TOKEN_CHUNK.items() if k != "usage"}
    assert rewrite_event(event, True, False) == (event, None)


def test_usage_of_a_whole_response_is_found_without_parsing_the_rest():
    body = json.dumps({"id": "x", "choices": [{"message": {"content": "}{"}}], "usage": USAGE}, separators=(",", ":")).encode()

    usage, start, end = find_usage(body)

    assert usage == USAGE
    assert json.loads(body[:start] + body[end:]) == {"id": "x", "choices": [{"message": {"content": "}{"}}]}
    assert find_usage(b'{"usage":{"prompt_tokens":1') == (None, -1, -1)  # truncated: not trusted


@pytest.mark.parametrize("piece", [1, 7, 8, 9, 100, 65536])
@pytest.mark.parametrize("after", [b"", b',"prompt_logprobs":[' + b'{"5":{"logprob":-1.0,"rank":1}},' * 5_000 + b'null]'],
                         ids=["usage-last", "prompt-logprobs-after-usage"])
def test_the_usage_of_an_answer_too_large_to_hold_is_found_in_its_pieces(piece, after):
    # A whole answer past the gateway's limit is read to its end without being held, for its usage (the engine
    # computed it all); `usage` comes after the choices, and vLLM's `prompt_logprobs` may follow it.
    # Text quotes are escaped; a completions `top_logprobs` key is a token's text and so can be a bare `"usage"`.
    choices = json.dumps([{"index": 0, "message": {"content": 'x ,"usage":{"prompt_tokens":999} ' * 3_000},
                           "logprobs": {"top_logprobs": [{"the": -0.1, "usage": -0.3}] * 2_000}}],
                         separators=(",", ":")).encode()
    assert b',"usage":-0.3' in choices
    body = (b'{"id":"chatcmpl-1","object":"chat.completion","choices":' + choices + b',"usage":'
            + json.dumps(USAGE, separators=(",", ":")).encode() + after + b',"kv_transfer_params":null}')
    scanner = UsageScanner()
    for start in range(0, len(body), piece):
        scanner.feed(body[start:start + piece])
    assert scanner.usage == USAGE
    assert len(scanner._capture) <= UsageScanner.CAPTURE_BYTES and len(scanner._tail) < 9


def test_an_answer_without_usage_scans_to_none():
    scanner = UsageScanner()
    for piece in (b'{"choices":[{"text":"a ,\\"usage\\":{\\"prompt_tokens\\":3}"}]', b',"usage":null}'):
        scanner.feed(piece)
    assert scanner.usage is None



@pytest.mark.parametrize("usage", [
    b'{"prompt_tokens":7,"completion_tokens":3}', b'{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":4}}',
    b'{}', b'{"a":"\xc3\xa9\\u00e9"}', b'{"a":1} }', b'{"a":1 }', b'{"a":"}"}', b'{"a":1,}', b'{"a":\xff}',
    b'{"a":"\xed\xa0\x80"}', b'{\x00"\x00a\x00"\x00:\x001\x00}', b'{"a":NaN}', b'{"a":1e400}', b'{"a":[1,{"b":2}]}',
    b'{"a":1}\n', b'{"a":{"b":1}} ', b'[1]', b'{"a":1', b'{"a":"{"}}',
], ids=lambda usage: usage.decode("latin-1"))
def test_a_usage_object_reads_as_json_loads_reads_it_or_not_at_all(usage, monkeypatch):
    """The usage is read on the json module's scanner directly (every streamed event has one): the same object, or
    none, and the same place as with `json.loads`, whatever the bytes."""
    for event in (b'data: {"choices":[{"index":0}],"usage":' + usage + b"}", b'{"usage":0,"usage":' + usage):
        found = find_usage(event)
        monkeypatch.setattr(sse, "_object_of", json.loads)
        assert found == find_usage(event)
        monkeypatch.undo()


@pytest.mark.parametrize(
    ("name", "from_output"),
    [
        ("response.created", False),
        ("response.in_progress", False),
        ("response.queued", False),
        # a lifecycle event a later vLLM might write before the engine's first step (before: taken for output, and
        # the prompt of a stream cut right after it billed though never prefilled)
        ("response.prefilling", False),
        ("response.completed", False),
        ("response.output_item.added", True),
        ("response.content_part.added", True),
        ("response.output_text.delta", True),
        ("response.function_call_arguments.delta", True),
        ("response.output_text.annotation.added", True),
    ],
)
def test_only_an_event_naming_a_part_of_the_output_says_the_prompt_was_prefilled(name, from_output):
    event = f'event: {name}\ndata: {{"type":"{name}","sequence_number":1}}'.encode()
    assert sse.is_responses_output(event) is from_output
    assert not sse.is_responses_output(b'data: {"type":"response.output_text.delta"}')
