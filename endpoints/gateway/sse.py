"""The byte-level editing of an engine's responses: SSE events and `usage` objects.

The gateway always asks the engine for usage on every streamed chunk (so it knows the tokens
delivered if the client leaves mid-stream); `rewrite_event` gives the client usage only as it
asked. `find_usage` reads the `usage` object of a compact JSON response or chunk without parsing
the rest. A Responses stream (`/v1/responses`) names each event (`event: response.output_text.delta`, then its
`data:` line) and carries usage only in its last event (`response.completed`, or `.incomplete`/`.failed`):
relayed unchanged, its usage read by `responses_usage`. Pure functions over bytes: the call
(`endpoints.gateway.call`) does the I/O.
"""

from __future__ import annotations

import json
import re

import msgspec

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


def has_choices(event: bytes) -> bool:
    return event.startswith(b"data: ") and (b'"choices":[{' in event or b'"choices": [{' in event)


_RESPONSES_EVENT = b"event: response."
# The Responses events that carry the response object with its usage: the stream's last.
_RESPONSES_ENDS = (b"event: response.completed\n", b"event: response.incomplete\n", b"event: response.failed\n")


def carries_output(event: bytes) -> bool:
    """Whether the event carries generated tokens: a chat or completions chunk with a choice, or a Responses delta."""
    if event.startswith(_RESPONSES_EVENT):
        return _names_delta(event)
    return has_choices(event)


def _names_delta(event: bytes) -> bool:
    return event.find(b".delta\n", 0, 128) > 0


def is_responses_end(event: bytes) -> bool:
    """Whether the event is a Responses stream's last, the one carrying its usage."""
    return event.startswith(_RESPONSES_ENDS)


def is_responses_delta(event: bytes) -> bool:
    """Whether the event is a Responses `response.*.delta`: vLLM writes one an engine step, so their number is a floor
    of the output tokens the engine computed (`endpoints.gateway.tally.UsageTally.num_output_events`)."""
    return event.startswith(_RESPONSES_EVENT) and _names_delta(event)


def is_responses_output(event: bytes) -> bool:
    """Whether the event is one vLLM writes from the engine's output: its prompt was prefilled whole. Those name a part
    of the output and what happened to it (`response.output_item.added`, `response.output_text.delta`,
    `response.function_call_arguments.delta`, ...: three dotted parts; the announce of a function call comes once its
    parser has the name, before its arguments' first delta); the response's own lifecycle events name a state alone
    (`response.created`, `response.in_progress`, OpenAI's `response.queued`, and the last events, which carry the
    usage). An allow-list by that shape: an event a later vLLM writes before the engine's first step is a lifecycle one,
    not taken for output."""
    if not event.startswith(_RESPONSES_EVENT):
        return False
    name_end = event.find(b"\n", len(_RESPONSES_EVENT))
    return event.find(b".", len(_RESPONSES_EVENT), name_end if name_end != -1 else len(event)) != -1


def is_error_event(event: bytes) -> bool:
    """Whether the event is an engine's `event: error` (vLLM's Responses stream says a failure so, then ends)."""
    return event.startswith(b"event: error\n")


def is_engine_error(event: bytes) -> bool:
    """Whether the event is an engine's error in a chat or completions stream (`data: {"error": …}`, as vLLM writes it
    when a generation fails mid-stream)."""
    return event.startswith(b'data: {"error"')


def rewrite_event(event: bytes, wants_usage: bool, wants_continuous: bool) -> tuple[bytes | None, dict | None]:
    """An upstream SSE event as the client asked for it (None: drop it), and the usage it carried.

    The gateway always asks the engine for usage on every chunk; the client gets it only as it
    asked, as OpenAI sends it: nothing without `include_usage`, a closing usage-only chunk with
    it, and usage on every chunk only with `continuous_usage_stats` too.

    NOTE: byte-level, without re-serialising the chunk: vLLM writes compact JSON, and `,"usage":`
    with bare quotes can only be the chunk's own field (quotes inside strings are escaped).
    A Responses event is relayed as it is, with its usage if it is the stream's last.
    """
    if event.startswith(_RESPONSES_EVENT):
        if not event.startswith(_RESPONSES_ENDS):
            return event, None
        data = event.find(b"\ndata: ")
        return event, (responses_usage(event[data + 7:]) if data > 0 else None)
    if not event.startswith(b"data: ") or event == b"data: [DONE]":
        return event, None
    usage, start, end = find_usage(event)
    if start < 0:
        return (event, None) if b'"usage"' not in event else _rewrite_parsed(event, wants_usage, wants_continuous)
    if b'"choices":[]' in event:  # the closing usage-only chunk
        return (event if wants_usage else None), usage
    if wants_continuous:
        return event, usage
    if wants_usage:
        return event[:start] + b',"usage":null' + event[end:], usage
    return event[:start] + event[end:], usage


def _rewrite_parsed(event: bytes, wants_usage: bool, wants_continuous: bool) -> tuple[bytes | None, dict | None]:
    """`rewrite_event` for an upstream that does not write compact JSON: parse, edit, write."""
    try:
        chunk = json.loads(event[6:])
    except ValueError:
        return event, None
    if not isinstance(chunk, dict):
        return event, None
    usage = chunk.get("usage") if isinstance(chunk.get("usage"), dict) else None
    if not chunk.get("choices") and usage is not None:
        return (event if wants_usage else None), usage
    if wants_continuous or "usage" not in chunk:
        return event, usage
    if wants_usage:
        chunk["usage"] = None
    else:
        del chunk["usage"]
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode(), usage


_USAGE_FIELD = b',"usage":'
_FLAT_OBJECT = re.compile(rb"\{[^{}]*\}")


def find_usage(data: bytes) -> tuple[dict | None, int, int]:
    """The `usage` object of a compact JSON response or chunk, and where its `,"usage":…` field
    starts and ends in `data` ((None, -1, -1) when there is none; `"usage":null` has no object)."""
    start = data.rfind(_USAGE_FIELD)
    if start < 0:
        return None, -1, -1
    value = start + len(_USAGE_FIELD)
    if data.startswith(b"null", value):
        return None, start, value + 4
    end = _object_end(data, value)
    if end < 0:
        return None, -1, -1
    try:
        usage = _object_of(data[value:end])
    except ValueError:
        return None, -1, -1
    return (usage if isinstance(usage, dict) else None), start, end


_scan_object = json.JSONDecoder().raw_decode
_fast_decode = msgspec.json.Decoder().decode


def _object_of(text: bytes) -> object:
    """`json.loads(text)` for the bytes of one JSON object (from its `{` to its `}`, as `_object_end` bounds it), on the
    json module's C scanner directly: it runs on every streamed event, and `json.loads`'s own steps around the scan
    (the bytes' encoding guessed, the whitespace around the value matched) were a third of its time.

    NOTE: the same answer or the same refusal (a ValueError) as `json.loads`: an object ended before the last byte is
    extra data there; bytes that could be UTF-16 or UTF-32 to its guess (a NUL byte) go to it. msgspec's decoder goes
    first, faster still (round 25): what it decodes, `json.loads` decodes the same; what it refuses (NaN, a float past
    its range, a lone surrogate) goes on to the json module, whose answer stands."""
    # NOTE: bounded by braces, as `_object_end` bounds it: msgspec takes whitespace around an object, the scanner not
    if text.startswith(b"{") and text.endswith(b"}"):
        try:
            return _fast_decode(text)
        except (msgspec.DecodeError, RecursionError):
            pass
    if b"\x00" in text:
        return json.loads(text)
    decoded = text.decode("utf-8", "surrogatepass")
    value, end = _scan_object(decoded)
    if end != len(decoded):
        raise ValueError("extra data after the object")
    return value


def response_usage(body: bytes) -> dict | None:
    """The `usage` of a whole (not streamed) response: found at byte level, parsed when it must be."""
    usage, start, _ = find_usage(body)
    if start < 0 and b'"usage"' in body:
        return _parsed_usage(body)
    return usage


class _WithUsage(msgspec.Struct):
    usage: dict | None = None


class _ResponsesAnswer(msgspec.Struct):
    usage: dict | None = None  # a whole response object's
    response: _WithUsage | None = None  # a stream event's response object


_responses_answer_decoder = msgspec.json.Decoder(_ResponsesAnswer)


def responses_usage(data: bytes) -> dict | None:
    """The usage of a Responses answer: a whole response object, or the `data` of a stream's last event (the
    response object under `response`).

    NOTE: decoded for `usage` alone (msgspec skips every other field), never found by its bytes: a response echoes
    the caller's own JSON (`metadata`, tools' `parameters`, the `text` format's schema), where a `"usage":` of the
    caller's making could come after the real one."""
    try:
        answer = _responses_answer_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None
    return answer.response.usage if answer.response is not None else answer.usage


def _parsed_usage(body: bytes) -> dict | None:
    try:
        usage = json.loads(body).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


# The largest event a stream relays: an event is held whole until its end (the blank line), and one can be as large
# as a long prompt echoed with each token's logprobs (~600 bytes a token: 80 MB at 128k tokens). Past this, the stream
# ends with an error event, the event's tokens billed (`endpoints.gateway.call.InferenceCall._drop_large_event`); a
# Responses event other than the last (`response.content_part.done` with every token's logprobs: ~1,200 bytes a token
# at `top_logprobs` 20) is dropped unrelayed and the stream goes on to its last event, which carries its usage.
MAX_EVENT_BYTES = 8 * 1024 * 1024
EVENT_HEAD_BYTES = 4096  # an event's start, which names its choice


class UsageScanner:
    """The `usage` of a compact JSON answer too large to hold, found as its bytes go by (`feed`).

    Keeps a few KiB at most: the bytes from the last `,"usage":` field seen. vLLM writes `usage`
    after the choices and before its own fields (`prompt_logprobs` may follow it, larger than the
    choices), so the field is looked for in every piece, across the boundary with the one before.
    """

    __slots__ = ("_tail", "_capture")

    CAPTURE_BYTES = 4096  # a usage object with every detail vLLM writes is a few hundred bytes

    def __init__(self):
        self._tail = b""  # the end of the last piece, too short to hold the whole field
        self._capture = b""  # from the last `,"usage":` seen, up to CAPTURE_BYTES

    def feed(self, data: bytes) -> None:
        if self._capture and len(self._capture) < self.CAPTURE_BYTES:
            self._capture += data[:self.CAPTURE_BYTES - len(self._capture)]
        window = self._tail + data
        found = window.rfind(_USAGE_FIELD)
        if found >= 0:
            self._capture = window[found:found + self.CAPTURE_BYTES]
        self._tail = window[-(len(_USAGE_FIELD) - 1):]

    @property
    def usage(self) -> dict | None:
        return find_usage(self._capture)[0] if self._capture else None


def _object_end(data: bytes, start: int) -> int:
    """Index just past the JSON object that opens at `start`, or -1.

    NOTE: counts braces without reading strings: for `usage`, whose fields are numbers and objects.
    """
    flat = _FLAT_OBJECT.match(data, start)
    if flat is not None:  # no object inside (vLLM's usage without details): the first brace closes it
        return flat.end()
    if not data.startswith(b"{", start):
        return -1
    depth, position = 1, start + 1
    while depth:
        close = data.find(b"}", position)
        if close < 0:
            return -1
        depth += data.count(b"{", position, close) - 1
        position = close + 1
    return position
