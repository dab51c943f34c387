"""`/v1/responses`, OpenAI's Responses API: what the gateway refuses because it keeps no state, and what the engine
gets instead.

vLLM keeps a stored response (and what `previous_response_id`, `background` and cancelling read) in the memory of
the one engine that answered it, and only when started with `VLLM_ENABLE_RESPONSES_API_STORE` (never here). The
next call may go to another replica, and an endpoint scales to zero, so none of it can work: each is a 400 naming
its field (the stored-response routes, `GET /v1/responses/{id}` and the rest, a 400 too). `store` is served with
storage off, as vLLM does by default: the openai client sends nothing for it (OpenAI's default is true), most
callers never read a response back, and refusing it would refuse every client written for OpenAI that sends it; one
that does read back gets the routes' 400, which says why. The engine is always told `store: false`, whatever an
engine's `VLLM_ENABLE_RESPONSES_API_STORE`.

Tools: function tools go to the engine (its tool parser, as chat's); OpenAI's built-in tools (web search, file
search, code interpreter, computer use, MCP, image generation, ...) run at OpenAI or on servers the engine would
call, and are a 400 naming the tool. The body's other fields are checked by `endpoints.gateway.request` (types and
ranges) and `endpoints.gateway.fields` (the allowlist); the reservation by `endpoints.gateway.estimate`.
"""

from __future__ import annotations

import json
import re

from endpoints.gateway import errors, fields

RESPONSES = "responses"  # the request kind (`endpoints.gateway.request.KINDS`)
PATH = "/v1/responses"
PROMPT_PARAM = "input"  # the field holding its prompt, which an engine's refusal of a prompt names
# Routes under it that read or change a stored response (retrieve, delete, cancel, input items, ...).
STORED_PREFIX = PATH + "/"

_NO_STATE = (
    "responses are not stored here (each call may go to another replica, and an endpoint scales to zero)"
)
# Fields that need a response kept between calls, refused when set: only absent, null or false changes nothing (any other
# value, `0` and `""` included, is refused).
STATEFUL: dict[str, str] = {
    "previous_response_id": f"is not supported: {_NO_STATE}; send the conversation so far as 'input' items",
    "background": f"is not supported: {_NO_STATE}; stream the response instead ('stream': true)",
    "conversation": f"is not supported: {_NO_STATE}; send the conversation so far as 'input' items",
    "prompt": "is not supported: prompt templates are stored at OpenAI; send the text as 'instructions' and 'input'",
    "previous_input_messages": f"is not supported: {_NO_STATE}; send the conversation so far as 'input' items",
}
FUNCTION_TOOL = "function"
# A Responses event's `sequence_number`, as vLLM writes it (compact JSON, an integer).
_SEQUENCE_NUMBER = re.compile(rb'"sequence_number":\s*(\d{1,18})')
TOOL_CHOICES = frozenset({"none", "auto", "required"})


def check_payload(payload: dict) -> None:
    """A 400 in OpenAI's shape for a field that needs stored state, or a tool other than a function."""
    for name, reason in STATEFUL.items():
        value = payload.get(name)
        # NOTE: by identity: `0 in (None, False)` and `0.0 == False` are true, so a number passed as "unset"
        if value is not None and value is not False:
            raise errors.invalid_request(f"'{name}' {reason}.", param=name, code="unsupported_parameter")
    tools = payload.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise errors.invalid_request(
                "Invalid type for 'tools': expected an array.", param="tools", code="invalid_type"
            )
        for index, tool in enumerate(tools):
            _check_tool(tool, f"tools[{index}]")
    _check_tool_choice(payload.get("tool_choice"))


def _check_tool(tool, param: str) -> None:
    if not isinstance(tool, dict):
        raise errors.invalid_request(
            f"Invalid type for '{param}': expected an object.", param=param, code="invalid_type"
        )
    kind = tool.get("type")
    if kind != FUNCTION_TOOL:
        shown = kind if isinstance(kind, str) and kind.isprintable() else "?"
        raise errors.invalid_request(
            f"Tools of type '{shown[:64]}' are not supported: built-in tools run at OpenAI; only 'function' tools are "
            "served here.",
            param=f"{param}.type",
            code="unsupported_value",
        )
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise errors.invalid_request(
            f"Invalid type for '{param}.name': expected a non-empty string.",
            param=f"{param}.name",
            code="invalid_type",
        )
    if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
        raise errors.invalid_request(
            f"Invalid type for '{param}.parameters': expected an object.",
            param=f"{param}.parameters",
            code="invalid_type",
        )


def _check_tool_choice(value) -> None:
    if value is None or (isinstance(value, str) and value in TOOL_CHOICES):
        return
    if isinstance(value, dict) and value.get("type") == FUNCTION_TOOL and isinstance(value.get("name"), str):
        return
    raise errors.invalid_request(
        "Invalid value for 'tool_choice': expected 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": "
        "...}; built-in tools are not served here.",
        param="tool_choice",
        code="unsupported_value",
    )


def engine_payload(payload: dict) -> dict:
    """The body the engine gets: never stored (see the module's docstring)."""
    return payload | {"store": False}


def refuse_stored(method: str, path: str) -> errors.OpenAIError:
    """The answer to a route that reads or changes a stored response: none is ever stored."""
    return errors.invalid_request(
        f"{method} {fields.printable(path)}: {_NO_STATE}, so they cannot be retrieved, cancelled or deleted; the response "
        "came whole with its call (or as its stream).",
        code="responses_not_stored",
    )


def error_event(error: errors.OpenAIError, sequence_number: int) -> bytes:
    """`error` as a Responses stream's failure ends it: an `error` event (OpenAI's `ResponseErrorEvent`: `type`,
    `code`, `message`, `param`, `sequence_number`), which the openai client parses as an event of the stream.

    NOTE: it was written as a chat stream's (`data: {"error": …}`, no event name, no sequence number): the openai
    client's Responses stream raised an `APIError` of no known type instead of yielding the event (the review of the
    HTTP edges)."""
    data = {"type": "error", "code": error.code or error.type, "message": error.message, "param": error.param,
            "sequence_number": sequence_number}
    return b"event: error\ndata: " + json.dumps(data).encode() + b"\n\n"


def next_sequence_number(event: bytes, default: int) -> int:
    """The `sequence_number` an event added after `event` takes: the one after `event`'s (`default` where it has none)."""
    found = _SEQUENCE_NUMBER.search(event)
    return int(found.group(1)) + 1 if found else default


def engine_error_event(event: bytes, sequence_number: int) -> bytes | None:
    """An engine's error `event` in a Responses stream, in the Responses API's shape (`error_event`), or None where it
    is in that shape already. vLLM writes its generation's failure in its chat streams' shape (`{"error": {…}}`, its
    own type name, the HTTP status as a numeric code), with or without the `error` event name."""
    start = event.find(b"data: ")
    try:
        data = json.loads(event[start + len(b"data: "):]) if start >= 0 else None
    except (ValueError, RecursionError):
        data = None
    if (isinstance(data, dict) and data.get("type") == "error" and isinstance(data.get("message"), str)
            and isinstance(data.get("sequence_number"), int) and not isinstance(data["sequence_number"], bool)):
        return None
    detail = json.dumps(data).encode() if isinstance(data, dict) else b""
    return error_event(errors.engine_stream_error(detail, prompt_param=PROMPT_PARAM), sequence_number)
