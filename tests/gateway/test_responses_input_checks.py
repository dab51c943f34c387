"""What `/v1/responses` checks in a body before the engine sees it (no database, no engine): a tool call's `output`
parts are checked as a message's content parts are, and reserved as they are; a stateful field is refused for any
value but absent, null or false."""

from __future__ import annotations

import json

import pytest

from endpoints.gateway.errors import OpenAIError
from endpoints.gateway.estimate import worst_case
from endpoints.gateway.request import InferenceRequest

CONTEXT = 32768


def _parse(body: dict) -> InferenceRequest:
    return InferenceRequest.parse(json.dumps(body).encode(), kind="responses", path="/v1/responses")


def _refusal(body: dict) -> dict:
    with pytest.raises(OpenAIError) as refused:
        _parse(body)
    assert refused.value.status == 400
    return json.loads(refused.value.body())["error"]


def _tool_output(*parts: dict) -> list[dict]:
    return [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": list(parts)},
    ]


@pytest.mark.parametrize(
    ("part", "param"),
    [
        # Before: sent to the engine as it came, another key's cached media reachable by its uuid.
        ({"type": "input_image", "image_url": None, "uuid": "victim-uuid"}, "input[1].output[0].uuid"),
        (
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "uuid": "victim-uuid"},
            "input[1].output[0].uuid",
        ),
        # Before: an http URL for the engine to fetch (engines refuse to, but the caller was not told why).
        (
            {"type": "input_image", "image_url": "http://169.254.169.254/latest/meta-data"},
            "input[1].output[0].image_url",
        ),
        ({"type": "input_file", "file_id": "file-1"}, "input[1].output[0]"),
        ({"type": 3}, "input[1].output[0].type"),
    ],
)
def test_a_tool_outputs_parts_are_checked_as_a_messages_content_parts(part, param):
    assert _refusal({"model": "m", "input": _tool_output(part)})["param"] == param


@pytest.mark.parametrize(
    "items",
    [
        [{"role": "user", "content": [{"type": "input_image", "image_url": None, "uuid": "seen-before"}]}],
        [{"type": "message", "role": "user", "content": [{"type": "input_image", "uuid": "seen-before"}]}],
        _tool_output({"type": "input_image", "uuid": "seen-before"}),
    ],
)
def test_an_image_named_by_uuid_alone_never_reaches_an_engine_or_a_cut_streams_render(items):
    # vLLM's render (`/v1/responses/render`, which counts a cut stream's prompt) skips its processed-media cache, so an
    # image sent by `uuid` alone would fail there, the prompt unbilled: no such part gets that far (guards the refusal,
    # passes before and after).
    error = _refusal({"model": "m", "input": items, "stream": True})
    assert (error["param"].endswith(".uuid"), error["code"]) == (True, "unsupported_parameter")


def test_a_tool_output_as_text_or_text_parts_is_taken():
    _parse({"model": "m", "input": _tool_output({"type": "input_text", "text": "42"})})
    _parse({"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": "42"}]})


def test_an_image_in_a_tool_output_reserves_the_whole_context_as_one_in_a_message_does():
    # Before: reserved by its bytes (a 2048 x 2048 PNG of a few KiB reserved a few thousand tokens).
    part = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    for items in ([{"role": "user", "content": [part]}], _tool_output(part)):
        case = worst_case({"model": "m", "input": items, "max_output_tokens": 1}, "responses", CONTEXT)
        assert case.prompt_bounds == (CONTEXT,), items


@pytest.mark.parametrize(
    "field", ["previous_response_id", "conversation", "prompt", "previous_input_messages", "background"]
)
@pytest.mark.parametrize("value", [0, 0.0, "", [], {}, True, "resp_1"])
def test_a_stateful_field_is_refused_for_any_value_but_absent_null_or_false(field, value):
    # Before: 0 and 0.0 passed (`0 in (None, False)` is true) and reached the engine.
    error = _refusal({"model": "m", "input": "x", field: value})
    assert (error["param"], error["code"]) == (field, "unsupported_parameter")


@pytest.mark.parametrize("value", [None, False])
def test_a_stateful_field_absent_null_or_false_is_taken(value):
    _parse({"model": "m", "input": "x", "previous_response_id": value, "background": value})
