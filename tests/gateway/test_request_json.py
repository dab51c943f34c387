"""A `/v1` body's JSON reads as the json module read it before msgspec decoded it (round 25 of
`bench/results/gateway_profile.md`): the same value, or the same refusal with the same message.

msgspec takes integers past 64 bits and refuses NaN, floats past their range, lone surrogates and a
UTF-8 byte-order mark, each with a message of its own; the gateway must answer all of them as before, but a lone
surrogate (`"\\ud800"`, an escape JSON allows that is not text), a 400 `invalid_value` naming where it is: vLLM
generated a whole Responses answer for one in `metadata`, then could not write it (billed nothing).
"""

import json
import tracemalloc

import pytest

from controlplane import lone_surrogates
from endpoints.gateway import request
from endpoints.gateway.errors import OpenAIError
from endpoints.gateway.request import InferenceRequest, parse_payload

NOT_PARSED = "We could not parse the JSON body of your request."


def _chat(rest: bytes) -> bytes:
    return b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]' + rest + b"}"


def _refusal(body: bytes) -> str:
    with pytest.raises(OpenAIError) as refused:
        parse_payload(body, "chat")
    assert refused.value.status == 400 and refused.value.type == "invalid_request_error"
    return refused.value.message


@pytest.mark.parametrize(
    ("rest", "message"),
    [
        (b', "seed": 9223372036854775808', "an integer does not fit in 64 bits"),
        (b', "seed": -9223372036854775809', "an integer does not fit in 64 bits"),
        (b', "seed": 18446744073709551615', "an integer does not fit in 64 bits"),
        (b', "seed": 18446744073709551616', "an integer does not fit in 64 bits"),
        (b', "seed": 1' + b"0" * 400, "an integer does not fit in 64 bits"),
        (b', "x": [1, 123456789012345678901234]', "an integer does not fit in 64 bits"),
        (b', "temperature": NaN', "NaN is not JSON"),
        (b', "temperature": Infinity', "Infinity is not JSON"),
        (b', "temperature": -Infinity', "-Infinity is not JSON"),
        (b', "top_p": 1e999', "a number is too large"),
        (b', "top_p": -1.8e308', "a number is too large"),
    ],
    ids=lambda value: value.decode()[:40] if isinstance(value, bytes) else None,
)
def test_a_number_json_cannot_carry_exactly_is_refused_naming_why(rest, message):
    assert _refusal(_chat(rest)) == f"We could not parse the JSON body of your request: {message}."


@pytest.mark.parametrize(
    "body",
    [
        b"\xef\xbb\xbf" + _chat(b""),  # a UTF-8 byte-order mark
        _chat(b', "user": "\xff"'),  # not UTF-8
        _chat(b', "user": "\xed\xa0\x80"'),  # a surrogate written as UTF-8
        _chat(b', "user": "a\tb"'),  # a control character inside a string
        _chat(b', "user": "\\x"'),
        b"\x0c" + _chat(b""),  # whitespace JSON does not name
        _chat(b"") + b" x",
        _chat(b","),
        _chat(b', "x": ' + b"[" * 5000 + b"]" * 5000),
    ],
    ids=[
        "bom",
        "not utf-8",
        "utf-8 surrogate",
        "control character",
        "bad escape",
        "form feed",
        "extra data",
        "trailing comma",
        "nested 5000 deep",
    ],
)
def test_malformed_json_is_refused_with_the_same_message(body):
    assert _refusal(body) == NOT_PARSED


@pytest.mark.parametrize(
    ("rest", "name", "value"),
    [
        (b', "seed": 9223372036854775807', "seed", 2**63 - 1),
        (b', "seed": -9223372036854775808', "seed", -(2**63)),
        (b', "seed": 1234567890123456789', "seed", 1234567890123456789),
        (b', "user": "\\ud83d\\ude00 \xc3\xa9"', "user", "\U0001f600 \u00e9"),
        (b', "user": "a", "user": "b"', "user", "b"),  # a key named twice: the last one
        (b', "response_format": {"type": "json_schema", "json_schema": {"x": 1e-400}}', "x", 0.0),
        (b', "response_format": {"type": "json_schema", "json_schema": {"x": -0.0}}', "x", -0.0),
        (
            b', "response_format": {"type": "json_schema", "json_schema": {"x": 12345678901234567890.5}}',
            "x",
            12345678901234567890.5,
        ),
    ],
    ids=lambda value: value.decode()[:40] if isinstance(value, bytes) else None,
)
def test_a_body_json_can_carry_reads_as_the_json_module_reads_it(rest, name, value):
    payload = parse_payload(_chat(rest), "chat")
    payload = payload if name in payload else payload["response_format"]["json_schema"]
    assert repr(payload[name]) == repr(value) and type(payload[name]) is type(value)


def test_the_body_an_engine_gets_carries_what_the_client_sent_when_the_json_module_read_it():
    # the seed's 19 digits send the body to the json module alone; a surrogate pair's escapes are looked at, and kept
    body = _chat(
        b', "stream": true, "user": "\\ud83d\\ude00 \xc3\xa9 \\u2028", "temperature": 1e-07, "seed": -9223372036854775808'
    )
    sent = InferenceRequest.parse(body, kind="chat", path="/v1/chat/completions")
    forwarded = json.loads(sent.upstream_body("org:1"))
    assert forwarded == sent.payload | {
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}
    }
    assert forwarded["user"] == "\U0001f600 \u00e9 \u2028"


def _refusal_of(body: bytes, kind: str):
    with pytest.raises(OpenAIError) as refused:
        parse_payload(body, kind)
    error = json.loads(refused.value.body())["error"]
    assert (
        refused.value.status == 400
        and error["type"] == "invalid_request_error"
        and error["code"] == "invalid_value"
    )
    assert "lone surrogate" in error["message"]
    return error["param"]


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("chat", _chat(b', "user": "\\ud800"'), "user"),
        ("chat", _chat(b', "user": "a \\uDFFF b"'), "user"),  # an escape in capitals
        ("chat", _chat(b', "user": "\\udc00\\ud800"'), "user"),  # a pair the wrong way round
        ("chat", _chat(b', "user": "\\ud83d\\ude00\\ud83d"'), "user"),  # a pair, then half of one
        (
            "chat",
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}, '
            b'{"role": "user", "content": "\\ud800"}]}',
            "messages[1].content",
        ),
        (
            "chat",
            b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
            "messages[0].content[0].text",
        ),
        ("chat", _chat(b', "stop": ["a", "\\ud800"]'), "stop[1]"),
        ("chat", b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        ("completion", b'{"model": "m", "prompt": "\\ud800"}', "prompt"),
        ("embedding", b'{"model": "m", "input": ["a", "\\ud800"]}', "input[1]"),
        ("responses", b'{"model": "m", "input": "hi", "metadata": {"job": "\\ud800"}}', "metadata.job"),
        (
            "responses",
            b'{"model": "m", "input": "hi", "metadata": {"job \\ud800": "x"}}',
            "metadata",
        ),  # in a key
        (
            "responses",
            b'{"model": "m", "input": "hi", "metadata": {"a job": "\\ud800"}}',
            "metadata",
        ),  # free text
        ("responses", b'{"model": "m", "input": "hi", "user": "\\udbff"}', "user"),
        ("responses", b'{"model": "m", "input": "hi", "instructions": "\\ud800"}', "instructions"),
        ("responses", b'{"model": "m", "input": "hi", "\\ud800": 1}', None),  # a field's name: none to name
    ],
)
def test_a_lone_surrogate_anywhere_is_refused_as_an_invalid_value_naming_where_it_is(kind, body, param):
    assert _refusal_of(body, kind) == param


def test_a_lone_surrogate_is_refused_where_the_json_module_alone_reads_the_body():
    # an integer past 19 digits sends the body to the json module without msgspec
    assert _refusal_of(_chat(b', "x": 12345678901234567890.5, "user": "\\ud800"'), "chat") == "user"


def test_a_body_without_a_lone_surrogate_reaches_the_engine_as_utf_8():
    sent = InferenceRequest.parse(
        _chat(b', "stream": true, "user": "\xc3\xa9"'), kind="chat", path="/v1/chat/completions"
    )
    assert "\u00e9".encode() in sent.upstream_body("org:1")
    assert request.parse_payload(sent.upstream_body("org:1"), "chat")["user"] == "\u00e9"


def _nested_under_long_keys(depth: int, num_items: int, last: bytes) -> bytes:
    # `depth` objects each under a 64-character key (a name a param may carry), around `num_items` zeros and `last`
    key = b"k" * 64
    return (
        b'{"model": "m", "prompt": '
        + (b'{"' + key + b'": ') * depth
        + b"["
        + b"0, " * num_items
        + last
        + b"]"
        + b"}" * depth
        + b"}"
    )


def _peak_bytes(work) -> int:
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_body_nested_too_deep_is_refused_for_its_depth_before_it_is_looked_at_for_a_lone_surrogate():
    # the review's 115 KB body: 800 deep under 64-character keys over 30,000 items; its param built for each item as
    # it was stacked took 1.5 GB and 1.7 s of the event loop
    body = _nested_under_long_keys(800, 30_000, b'"\\ud800"')
    messages = []
    peak = _peak_bytes(lambda: messages.append(_refusal(body)))
    assert messages == [f"The JSON body of your request is nested more than {request.MAX_DEPTH} levels deep."]
    assert peak < 32 * 1024 * 1024


def test_a_lone_surrogate_under_long_keys_is_named_without_a_param_made_for_every_item():
    # as deep as a body may be: the body, 30 objects, the array
    body = _nested_under_long_keys(request.MAX_DEPTH - 2, 30_000, b'"\\ud800"')
    params = []
    peak = _peak_bytes(lambda: params.append(_refusal_of(body, "completion")))
    assert params == ["prompt" + ("." + "k" * 64) * (request.MAX_DEPTH - 2) + "[30000]"]
    assert peak < 16 * 1024 * 1024


def test_a_body_whose_bytes_only_look_like_a_lone_surrogate_is_not_walked(monkeypatch):
    # a 19-digit seed sends it to the json module; an escaped backslash before `ud800` is no surrogate. The walk of
    # 720 KB of `[]` took 1.3 s of the event loop for it.
    def walked(payload):
        raise AssertionError("walked a body that holds no lone surrogate")

    monkeypatch.setattr(lone_surrogates, "lone_surrogate_at", walked)
    payload = parse_payload(
        _chat(b', "seed": 1234567890123456789, "user": "\\\\ud800", "stop": [' + b'"a", ' * 50 + b'"b"]'),
        "chat",
    )
    assert payload["user"] == "\\ud800" and payload["seed"] == 1234567890123456789
