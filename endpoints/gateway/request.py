"""A `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings` or `/v1/responses` call, parsed and checked:
`InferenceRequest`.

Anything malformed is a 400 in OpenAI's shape here, before a key's limits are counted, an endpoint
is looked up or a byte reaches the engine: JSON the gateway could not re-encode (NaN, numbers past
64 bits or past a float, nesting deeper than `MAX_DEPTH`), a body that is not an object, and a
wrong type or range for any field OpenAI's API defines, and any field not on the allowlist of
`endpoints.gateway.fields`. vLLM's sampling extensions on it (`top_k`, `min_p`, …) pass through for
the engine to judge. An embeddings body is checked by `endpoints.gateway.embeddings`; a Responses body's
state and tools by `endpoints.gateway.responses`, its `input` here. Media (an image,
audio or a video in a message's content) comes inline, as a `data:` URL: engines never fetch it; a media part's
`uuid` (vLLM's cache key for it) and a body's `cache_salt` reach the engine scoped to the calling key
(`endpoints.gateway.media_uuids`).

`priority` is the engine's (vLLM's priority scheduling, lower runs sooner; interactive calls 0): a
client may pass one only within what its key allows (`ApiKey.max_priority_boost`), a 400 naming
`priority` otherwise.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from controlplane import lone_surrogates
from endpoints.gateway import content_parts, embeddings, errors, estimate, fields, media_uuids, responses, sse
from endpoints.gateway.token_ids import are_token_ids, is_int

MAX_BODY_BYTES = 8 * 1024 * 1024
# Objects, arrays and separators (`{`, `[`, `,`, counted in the raw bytes, strings included) a body may hold.
# NOTE: decoding costs CPU and memory per element, before any limit of the key is counted: 8 MiB of `{},` took
# 2.5 s of the event loop and ~390 MiB; at this cap ~0.4 s and ~70 MiB. A 128k-token prompt as token ids is ~128k.
MAX_JSON_ITEMS = 500_000
# Prompts in one /v1/completions call (as inputs of one /v1/embeddings call): 2.8 million empty prompts in 8 MiB
# took ~12 s of the event loop to bound and price, refused only after that.
MAX_PROMPTS = embeddings.MAX_INPUTS
MAX_DEPTH = 32  # objects and arrays nested in one another; real requests use a handful
MAX_MODEL_NAME = 256
MAX_N = 16
MAX_STOP_SEQUENCES = 64
# vLLM's sampling lists, which it bounds only deep in the engine, or not at all. NOTE: its V2 model runner (the default
# on CUDA) raises in the worker past 1,024 allowed token ids or logit_bias entries and past 128 stop token ids with
# min_tokens (eos included: `vllm/v1/worker/gpu/sample/logit_bias.py`), and every bad word is tokenized twice, then
# checked against the output at every step. Stop token ids and bad words are capped as stop sequences are.
MAX_STOP_TOKEN_IDS = MAX_STOP_SEQUENCES
MAX_BAD_WORDS = MAX_STOP_SEQUENCES
MAX_ALLOWED_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
INT64 = 2**63
TOOL_CHOICES = frozenset({"none", "auto", "required"})
RESPONSE_FORMATS = frozenset({"text", "json_object", "json_schema", "structural_tag"})
# Content-part fields that name media by URL, whatever the part's `type` (vLLM reads them from any part
# with a `uuid`): an object with a `url` or, in vLLM's shorthand and `input_image` parts, the URL itself.
# NOTE: `input_audio` carries its data inline; vLLM turns it into a `data:` URL itself.
MEDIA_URL_FIELDS = frozenset({"image_url", "audio_url", "video_url"})


class _Unparsable(ValueError):
    pass


def _parse_int(text: str) -> int:
    # NOTE: checked before `int()`, which refuses more than 4,300 digits and is slow near that
    if len(text) > 20 or not -INT64 <= (value := int(text)) < INT64:
        raise _Unparsable("an integer does not fit in 64 bits")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Unparsable("a number is too large")
    return value


def _refuse_constant(name: str):
    raise _Unparsable(f"{name} is not JSON")


_decoder = json.JSONDecoder(parse_int=_parse_int, parse_float=_parse_float, parse_constant=_refuse_constant)
_fast_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
_DIGITS_AS_ZEROS = bytes.maketrans(b"123456789", b"000000000")
_INT64_DIGITS = b"0" * 19  # 2**63 has 19 digits: an integer with fewer fits in 64 bits


# A `\uXXXX` escape of a surrogate (U+D800 to U+DFFF), in either case: the one way a JSON body (valid UTF-8) holds one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _decoded(body: bytes) -> tuple[object, bool]:
    """The body's JSON, exactly as `_decoder` decodes it: the same value or the same refusal; and whether it may hold a
    lone surrogate (`lone_surrogates.param_of_lone_surrogate` says where).

    NOTE: msgspec's C decoder first, a quarter of `_decoder`'s time with its Python hooks (round 25 of
    `bench/results/gateway_profile.md`). Where the two differ, msgspec refuses: NaN, Infinity, a float past
    its range, a lone surrogate, an invalid escape or UTF-8; `_decoder` then decodes the body again and its
    answer stands. The one thing msgspec takes that `_decoder` refuses, an integer past 64 bits, has 19
    digits in a row, and such a body goes to `_decoder` alone. So only a body decoded here by `_decoder` can hold a
    lone surrogate, and only one whose bytes hold a surrogate's escape (`\\ud800`): the warm path pays nothing."""
    if _INT64_DIGITS not in body.translate(_DIGITS_AS_ZEROS):
        try:
            return _fast_decoder.decode(body), False
        except (msgspec.DecodeError, RecursionError):
            pass
    payload = _decoder.decode(body.decode("utf-8"))
    return payload, _SURROGATE_ESCAPE.search(body) is not None


def _encoded(payload: dict) -> bytes:
    """`payload` as JSON for the engine (UTF-8, compact). NOTE: it holds no lone surrogate (`parse_payload` refuses
    one), so msgspec writes all of it."""
    return _encoder.encode(payload)


def has_too_many_json_items(text: bytes | str) -> bool:
    """Whether `text` (a body, or a batch line) holds more than `MAX_JSON_ITEMS` objects, arrays and separators,
    counted without decoding it; each takes a character, so a shorter text is never counted."""
    if len(text) <= MAX_JSON_ITEMS:
        return False
    marks = (b",", b"{", b"[") if isinstance(text, bytes) else (",", "{", "[")
    return sum(text.count(mark) for mark in marks) > MAX_JSON_ITEMS


def parse_payload(body: bytes, kind: str) -> dict:
    """The request body, checked for shapes, types and ranges; the engine checks meaning (a stop
    sequence it cannot use, a tool schema it cannot follow)."""
    if has_too_many_json_items(body):
        raise errors.invalid_request(f"The JSON body of your request has more than {MAX_JSON_ITEMS:,} elements.")
    try:
        payload, may_hold_lone_surrogate = _decoded(body)
    except _Unparsable as exc:
        raise errors.invalid_request(f"We could not parse the JSON body of your request: {exc}.") from None
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise errors.invalid_request("We could not parse the JSON body of your request.") from None
    if not isinstance(payload, dict):
        raise errors.invalid_request("The request body must be a JSON object.")
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and _depth(payload) > MAX_DEPTH:
        raise errors.invalid_request(f"The JSON body of your request is nested more than {MAX_DEPTH} levels deep.")
    # NOTE: after the depth's check, which bounds the walk's stack and each param's length
    if may_hold_lone_surrogate and (param := lone_surrogates.param_of_lone_surrogate(payload)) is not None:
        where = f"'{param}'" if param else "a field name of the body"
        raise errors.invalid_request(f"Invalid value for {where}: it holds a lone surrogate (an escape from \\ud800 to "
                                     "\\udfff without its pair), which is not text.", param=param or None,
                                     code="invalid_value")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise errors.invalid_request("You must provide a model parameter.", param="model")
    if not is_model_name(model):
        raise errors.invalid_request("'model' is not a model name.", param="model", code="invalid_value")
    fields.check(payload, kind)
    if kind == embeddings.EMBEDDING:
        embeddings.check_payload(payload)
        return payload
    if kind == responses.RESPONSES:
        responses.check_payload(payload)
        _check_input_items(payload.get("input"))
    elif kind == "chat":
        _check_messages(payload.get("messages"))
    else:
        _check_prompt(payload.get("prompt"))
    # NOTE: the fields the body sends, in its order (as `fields.check` names the first it refuses), each looked up in the
    # kind's checks: `fields.check` let only accepted names through, so this is a handful of lookups, where reading
    # every field a kind accepts from the body (~25) was a quarter of a request's `dict.get`s.
    checks = _FIELDS_OF_KIND[kind]
    for name, value in payload.items():
        if value is not None and (check := checks.get(name)) is not None:
            check(value, name)
    if kind == "completion":
        fields.refuse_best_of_past_n(payload)
    if payload.get("stream_options") and not payload.get("stream"):
        # NOTE: as OpenAI and vLLM (whose rule this is, to the letter) refuse it. The engine refused it only once the
        # call was admitted and counted; and a batch line with it passed validation, then every such line failed as
        # it ran.
        raise errors.invalid_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                                     param="stream_options", code="invalid_value")
    if kind == "chat" and payload.get("top_logprobs") and not payload.get("logprobs"):
        # NOTE: the same: vLLM refuses it (and OpenAI), once the call was admitted, counted and its endpoint woken.
        raise errors.invalid_request("Invalid value for 'top_logprobs': 'logprobs' must be set to true when "
                                     "'top_logprobs' is used.", param="top_logprobs", code="invalid_value")
    return payload


KINDS = frozenset({"chat", "completion", embeddings.EMBEDDING, responses.RESPONSES})
# The field holding a kind's prompt: what a refusal of a prompt too long for the context names, as OpenAI's does.
PROMPT_PARAMS = {"chat": "messages", "completion": "prompt", embeddings.EMBEDDING: "input", responses.RESPONSES: responses.PROMPT_PARAM}
INTERACTIVE_PRIORITY = 0  # vLLM's default: what a call without `priority` runs at


def client_priority(payload: dict, max_boost: int | None) -> int:
    """The engine priority a client asked for (`priority`), within its key's `max_boost` (-N … N);
    a 400 naming `priority` when the key allows none or the value lies outside."""
    value = payload.get("priority")
    if value is None:
        return INTERACTIVE_PRIORITY
    if not is_int(value):
        raise _wrong_type("priority", "an integer")
    if max_boost is None:
        raise errors.invalid_request(
            "This API key may not set 'priority'; an admin can allow it on the key (max_priority_boost).",
            param="priority", code="priority_not_allowed")
    if not -max_boost <= value <= max_boost:
        raise _out_of_range("priority", _range_text(-max_boost, max_boost, "an integer") + " (this key's limit)")
    return value

_ids: tuple[int, random.Random] = (0, random.Random())


def new_request_id() -> str:
    """A new request id, `req_` and 32 hex digits (the usage ledger's unique key).

    NOTE: from a generator seeded once per process by the OS, not `uuid4()`: that reads the OS's random
    source on every call, a system call that cost ~10 % of the gateway's CPU per request (see
    `bench/results/gateway_profile.md`). Ids need to be unique, not secret; a new process (a
    forked worker included) seeds its own.
    """
    global _ids
    pid, generator = _ids
    if pid != os.getpid():
        generator = random.Random(os.urandom(32))
        _ids = (os.getpid(), generator)
    return f"req_{generator.getrandbits(128):032x}"


@dataclass(slots=True, frozen=True)
class InferenceRequest:
    """One inference call as the client sent it, its body parsed and checked (`parse`); what it may
    cost at an endpoint is its `worst_case`."""

    # "chat" (/v1/chat/completions), "completion" (/v1/completions), "embedding" (/v1/embeddings) or "responses"
    kind: str
    path: str
    body: bytes  # as the client sent it: proxied unchanged when nothing needs rewriting
    payload: dict
    wait_for_capacity: bool = False  # the client sent X-Inferplane-Wait-For-Capacity (endpoints.gateway.standing)
    priority: int = INTERACTIVE_PRIORITY  # the engine's: lower runs sooner (batch work runs later)
    # A non-streaming client sent X-Inferplane-Progress: held, its answer starts at once and whitespace
    # keeps it alive until the JSON comes (`endpoints.gateway.anatomy`).
    progress: bool = False
    # A content part names a `uuid`: the engine gets it scoped to the caller (`endpoints.gateway.media_uuids`).
    names_media_uuids: bool = False
    # The body names a `cache_salt`: the engine gets it scoped to the caller, as a uuid.
    names_cache_salt: bool = False

    # The `model` the engine gets when it is not the caller's: a LoRA adapter's name (its `lora_name`).
    engine_model: str = ""
    # Whether its answer streams (`stream` in its body; an embedding's never does): read from the body once, here.
    # NOTE: a property read it from the payload each time, ~6 times a request (two calls each).
    stream: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}")
        object.__setattr__(self, "stream",
                           self.kind != embeddings.EMBEDDING and bool(self.payload.get("stream", False)))

    @classmethod
    def parse(cls, body: bytes, *, kind: str, path: str, wait_for_capacity: bool = False,
              max_priority_boost: int | None = None, progress: bool = False) -> InferenceRequest:
        """The request, or the 400 that refuses its body; `max_priority_boost` is the caller key's."""
        payload = parse_payload(body, kind)
        return cls(kind, path, body, payload, wait_for_capacity, client_priority(payload, max_priority_boost),
                   progress=progress and not payload.get("stream"),
                   names_media_uuids=kind == "chat" and media_uuids.named_in(payload),
                   names_cache_salt=kind != embeddings.EMBEDDING and media_uuids.check_cache_salt(payload))

    @property
    def model(self) -> str:
        return self.payload["model"]

    def worst_case(self, endpoint) -> estimate.WorstCase:
        """The most tokens, and so money, it can take at `endpoint`; a 400 when it asks for more
        output tokens than the endpoint's context, or calls an endpoint of the other task."""
        embeddings.refuse_wrong_task(self.kind, endpoint)
        # NOTE: the field the client set, as the engine reads it (chat's `max_completion_tokens` first): a client that
        # sent `max_completion_tokens` (the openai client's current name) was told `max_tokens`, a field it never sent.
        # vLLM's completions ignore it (`estimate`): read there, one past the context beside a `max_tokens` that fits
        # was a 400 naming a field the engine never reads.
        param = "max_output_tokens" if self.kind == responses.RESPONSES else "max_tokens"
        if self.kind == "chat" and self.payload.get("max_completion_tokens") is not None:
            param = "max_completion_tokens"
        max_tokens = self.payload.get(param)
        if max_tokens is not None and max_tokens > endpoint.max_model_len:
            raise errors.invalid_request(
                f"{param} is {max_tokens}, but this model's context is {endpoint.max_model_len} tokens.", param=param,
                code="invalid_value")
        case = estimate.worst_case(self.payload, self.kind, endpoint.max_model_len, endpoint.template_tokens,
                                   endpoint.template_flag_tokens, endpoint.prompt_normalizer)
        # NOTE: one attribute read for an endpoint without a learned factor (most): its bound is as estimated.
        return case if endpoint.prompt_factor is None else case.scaled(endpoint.prompt_factor)

    def upstream_body(self, media_scope: str) -> bytes:
        """The body the engine gets; `media_scope` is the caller's (`Caller.limit_subject`), which its media parts'
        uuids are scoped to (`endpoints.gateway.media_uuids`)."""
        reprioritised = self.priority != self.payload.get("priority", INTERACTIVE_PRIORITY)
        is_responses = self.kind == responses.RESPONSES
        if not (self.stream or is_responses or reprioritised or self.engine_model or self.names_media_uuids or self.names_cache_salt):
            return self.body  # `model` is already the endpoint's name, the engine's served name
        payload = self.payload | {"priority": self.priority} if reprioritised else self.payload
        if self.names_media_uuids:
            payload = media_uuids.scoped(payload, media_scope)
        if self.names_cache_salt:
            payload = media_uuids.scoped_cache_salt(payload, media_scope)
        if self.engine_model:
            payload = payload | {"model": self.engine_model}
        if is_responses:
            # NOTE: a Responses stream carries no running usage (only its `response.completed` event has it), so it
            # gets no `stream_options`; nothing is ever stored (`endpoints.gateway.responses`).
            payload = responses.engine_payload(payload)
        elif self.stream:
            # NOTE: usage on every chunk tells the gateway the tokens delivered if the client leaves
            # mid-stream; what the client asked for is restored by `endpoints.gateway.sse.rewrite_event`.
            payload = payload | {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        return _encoded(payload)

    def answer_usage(self, body: bytes) -> dict | None:
        """The `usage` of the engine's whole (not streamed) answer."""
        if self.kind == responses.RESPONSES:
            return sse.responses_usage(body)
        return sse.response_usage(body)

    def engine_refusal(self, status: int, body: bytes) -> errors.OpenAIError:
        """The engine's 4xx answer to this request, in OpenAI's shape."""
        if self.kind == embeddings.EMBEDDING:
            return embeddings.engine_refusal(status, body, self.payload)
        return errors.engine_refused(status, body, prompt_param=PROMPT_PARAMS[self.kind])

    def engine_stream_error(self, data: bytes) -> errors.OpenAIError:
        """The engine's error event in this request's stream (its `data`), in OpenAI's shape."""
        return errors.engine_stream_error(data, prompt_param=PROMPT_PARAMS[self.kind])


def _depth(value) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > MAX_DEPTH:
                break
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def is_model_name(name: str) -> bool:
    """Whether `name` may name a model (in a body's `model`, or `GET /v1/models/{id}`): at most `MAX_MODEL_NAME`
    characters, each printable. Checked before any lookup of it: PostgreSQL refuses a NUL or a lone surrogate."""
    return len(name) <= MAX_MODEL_NAME and name.isprintable() and _is_utf8(name)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")  # NOTE: JSON may carry lone surrogates (`"\ud800"`), which PostgreSQL refuses
    except UnicodeEncodeError:
        return False
    return True


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _wrong_type(param: str, expected: str):
    return errors.invalid_request(f"Invalid type for '{param}': expected {expected}.", param=param, code="invalid_type")


def _out_of_range(param: str, expected: str):
    return errors.invalid_request(f"Invalid value for '{param}': expected {expected}.", param=param, code="invalid_value")


# --- the prompt ---------------------------------------------------------------------------------
def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise errors.invalid_request("'messages' must be a non-empty array of message objects.", param="messages")
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _wrong_type(param, "an object")
        # NOTE: any role string: vLLM's chat templates take custom roles (`ipython`, …)
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise _wrong_type(f"{param}.role", "a non-empty string")
        content = message.get("content")
        if isinstance(content, list):
            _check_content_parts(content, f"{param}.content")
        elif content is not None and not isinstance(content, str):
            raise _wrong_type(f"{param}.content", "a string or an array of content parts")
        for name in ("name", "tool_call_id"):
            if message.get(name) is not None and not isinstance(message[name], str):
                raise _wrong_type(f"{param}.{name}", "a string")
        if message.get("tool_calls") is not None:
            _check_list_of_objects(message["tool_calls"], f"{param}.tool_calls")


def _check_input_items(value) -> None:
    """A Responses `input`: a string, or a non-empty array of items (messages, function calls and their outputs).

    NOTE: message contents and a tool output's parts (`estimate.RESPONSES_PART_FIELDS`) are checked as chat's content parts
    (media only as `data:` URLs); a part naming a media `uuid` is refused, as only chat's are scoped to the caller
    (`endpoints.gateway.media_uuids`)."""
    if isinstance(value, str):
        return
    if not isinstance(value, list) or not value:
        raise errors.invalid_request("'input' must be a string or a non-empty array of input items.", param="input")
    for index, item in enumerate(value):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise _wrong_type(param, "an object")
        if item.get("type") is not None and not isinstance(item["type"], str):
            raise _wrong_type(f"{param}.type", "a string")
        if item.get("role") is not None and (not isinstance(item["role"], str) or not item["role"]):
            raise _wrong_type(f"{param}.role", "a non-empty string")
        for field_name in estimate.RESPONSES_PART_FIELDS:
            if isinstance(item.get(field_name), list):
                _check_responses_parts(item[field_name], f"{param}.{field_name}")
        content = item.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise _wrong_type(f"{param}.content", "a string or an array of content parts")
        for name in ("name", "call_id", "arguments"):
            if item.get(name) is not None and not isinstance(item[name], str):
                raise _wrong_type(f"{param}.{name}", "a string")


def _check_responses_parts(parts: list, param: str) -> None:
    _check_content_parts(parts, param, may_name_media=False)
    for part_index, part in enumerate(parts):
        if "file_url" in part or "file_id" in part:
            raise errors.invalid_request(f"'{param}[{part_index}]': files are not fetched or stored here; send the text.",
                                         param=f"{param}[{part_index}]", code="unsupported_value")


def _check_content_parts(parts: list, param: str, *, may_name_media: bool = True) -> None:
    """Each part: an object of one kind of content, the one its `type` names as the engine reads it
    (`content_parts.mismatch`), with media only in `data:` URLs; a `uuid` naming media only where `may_name_media`
    (chat's, scoped to the caller: `endpoints.gateway.media_uuids`)."""
    for index, part in enumerate(parts):
        part_param = f"{param}[{index}]"
        if not isinstance(part, dict):
            raise _wrong_type(part_param, "an object")
        if not isinstance(part.get("type"), str):
            raise _wrong_type(f"{part_param}.type", "a string")
        if (part["type"] == "text" or "text" in part) and not isinstance(part.get("text"), str):
            raise _wrong_type(f"{part_param}.text", "a string")
        names_media = media_uuids.check_part(part, part_param)
        if not may_name_media and "uuid" in part:
            raise errors.invalid_request(f"'{part_param}.uuid' is not supported on /v1/responses.",
                                         param=f"{part_param}.uuid", code="unsupported_parameter")
        if names_media or not content_parts.MEDIA_KEYS.isdisjoint(part):  # one test in C for text (issue #20)
            for name in sorted(MEDIA_URL_FIELDS & part.keys()):
                _check_media_url(part[name], f"{part_param}.{name}")
            if (why := content_parts.mismatch(part)) is not None:
                # NOTE: never priced instead: a 'text' part with a 'uuid' and an image was reserved as its text
                # while the engine prefilled the image, unbilled past the reservation
                raise errors.invalid_request(
                    f"'{part_param}' is a {part['type']!r} part, but {why}: a content part carries the one kind of "
                    "content its 'type' names.",
                    param=part_param,
                    code="invalid_value",
                )


def _check_media_url(value, param: str) -> None:
    """A media URL must be a `data:` URL, told apart as vLLM does (its first five characters, any case).

    NOTE: engines never fetch media. vLLM loads an `http(s)://` URL a caller names from wherever it
    points (another tenant's engine on the node, the cloud's metadata service) and a `file:` URL from
    the node's disk; engines refuse both (`engine.MEDIA_URL_FLAGS`), and this tells the caller why.
    """
    if isinstance(value, dict):  # {"url": ...}; the bare string is vLLM's shorthand
        value, param = value.get("url"), f"{param}.url"
    if value is None:  # vLLM takes the item the part's `uuid` names from its cache, or refuses
        return
    if not isinstance(value, str):
        raise _wrong_type(param, "a string")
    if value[:5].lower() != "data:":
        raise errors.invalid_request(
            f"'{param}' must be a data: URL (for example 'data:image/png;base64,...'): media is not "
            "fetched from URLs here; send it inline, base64-encoded.",
            param=param,
            code="unsupported_value",
        )


def _check_prompt(prompt) -> None:
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise errors.invalid_request("'prompt' must be a string or a non-empty array.", param="prompt")
    if len(prompt) > MAX_PROMPTS and not are_token_ids(prompt):
        raise errors.invalid_request(f"'prompt' has {len(prompt)} prompts; at most {MAX_PROMPTS} may be completed in one "
                                     "request.", param="prompt")
    if all(isinstance(item, str) for item in prompt) or are_token_ids(prompt):
        return
    if all(isinstance(item, list) and item and are_token_ids(item) for item in prompt):
        return
    raise _wrong_type("prompt", "a string, an array of strings, an array of token ids or an array of arrays of token ids")


# --- the other fields ---------------------------------------------------------------------------
def _boolean(value, param: str) -> None:
    if not isinstance(value, bool):
        raise _wrong_type(param, "a boolean")


def _string(value, param: str) -> None:
    if not isinstance(value, str):
        raise _wrong_type(param, "a string")


def _object(value, param: str) -> None:
    if not isinstance(value, dict):
        raise _wrong_type(param, "an object")


def _integer(low: int | None = None, high: int | None = None) -> Callable:
    def check(value, param: str) -> None:
        if not is_int(value):
            raise _wrong_type(param, "an integer")
        if (low is not None and value < low) or (high is not None and value > high):
            raise _out_of_range(param, _range_text(low, high, "an integer"))

    return check


def _number(low: float, high: float) -> Callable:
    def check(value, param: str) -> None:
        if not _is_number(value):
            raise _wrong_type(param, "a number")
        if not low <= value <= high:
            raise _out_of_range(param, _range_text(low, high, "a number"))

    return check


def _range_text(low, high, what: str) -> str:
    if high is None:
        return f"{what} of at least {low}"
    if low is None:
        return f"{what} of at most {high}"
    return f"{what} from {low} to {high}"


def _positive_tokens(value, param: str) -> None:
    if not is_int(value) or value < 1:
        raise errors.invalid_request(f"'{param}' must be a positive integer.", param=param, code="invalid_type")


def _n(value, param: str) -> None:
    if not is_int(value) or not 1 <= value <= MAX_N:
        raise errors.invalid_request(f"'n' must be an integer from 1 to {MAX_N}.", param=param)


def _stop(value, param: str) -> None:
    if isinstance(value, str):
        return
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _wrong_type(param, "a string or an array of strings")
    if len(value) > MAX_STOP_SEQUENCES:
        raise _out_of_range(param, f"at most {MAX_STOP_SEQUENCES} sequences")


def _bad_words(value, param: str) -> None:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _wrong_type(param, "an array of strings")
    if len(value) > MAX_BAD_WORDS:
        raise _out_of_range(param, f"at most {MAX_BAD_WORDS} words")


def _token_id_list(max_items: int) -> Callable:
    def check(value, param: str) -> None:
        if not isinstance(value, list) or not are_token_ids(value):
            raise _wrong_type(param, "an array of token ids")
        if len(value) > max_items:
            raise _out_of_range(param, f"at most {max_items} token ids")

    return check


def _stream_options(value, param: str) -> None:
    if not isinstance(value, dict):
        raise errors.invalid_request("'stream_options' must be an object.", param=param, code="invalid_type")
    for name in ("include_usage", "continuous_usage_stats"):
        if value.get(name) is not None:
            _boolean(value[name], f"{param}.{name}")


def _logit_bias(value, param: str) -> None:
    _object(value, param)
    if len(value) > MAX_LOGIT_BIAS:
        raise _out_of_range(param, f"at most {MAX_LOGIT_BIAS} tokens")
    for token, bias in value.items():
        if not _is_number(bias) or not -100 <= bias <= 100:
            # NOTE: a key is the caller's text of any length: named as an unknown field is (cut, escaped), not whole.
            raise _out_of_range(f"{param}.{fields.printable(token)}", "a number from -100 to 100")


def _check_list_of_objects(value, param: str) -> None:
    if not isinstance(value, list):
        raise _wrong_type(param, "an array")
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise _wrong_type(f"{param}[{index}]", "an object")


def _tools(value, param: str) -> None:
    _check_list_of_objects(value, param)
    for index, tool in enumerate(value):
        if tool.get("type", "function") != "function":
            raise _out_of_range(f"{param}[{index}].type", "'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _wrong_type(f"{param}[{index}].function", "an object")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise _wrong_type(f"{param}[{index}].function.name", "a non-empty string")
        if function.get("description") is not None:
            _string(function["description"], f"{param}[{index}].function.description")
        if function.get("parameters") is not None:
            _object(function["parameters"], f"{param}[{index}].function.parameters")


def _tool_choice(value, param: str) -> None:
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise _out_of_range(param, f"one of {', '.join(sorted(TOOL_CHOICES))} or an object")
        return
    _object(value, param)
    function = value.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _wrong_type(f"{param}.function.name", "a string")


def _response_format(value, param: str) -> None:
    _object(value, param)
    if not isinstance(value.get("type"), str) or value["type"] not in RESPONSE_FORMATS:  # a list: unhashable
        raise _out_of_range(f"{param}.type", f"one of {', '.join(sorted(RESPONSE_FORMATS))}")
    if value.get("json_schema") is not None:
        _object(value["json_schema"], f"{param}.json_schema")


_COMMON_FIELDS: dict[str, Callable] = {
    "max_tokens": _positive_tokens,
    "max_completion_tokens": _positive_tokens,
    "stream": _boolean,
    "stream_options": _stream_options,
    "n": _n,
    "temperature": _number(0, 2),
    "top_p": _number(0, 1),
    "presence_penalty": _number(-2, 2),
    "frequency_penalty": _number(-2, 2),
    "seed": _integer(),
    "stop": _stop,
    "user": _string,
    "logit_bias": _logit_bias,
    "bad_words": _bad_words,
    "stop_token_ids": _token_id_list(MAX_STOP_TOKEN_IDS),
    "allowed_token_ids": _token_id_list(MAX_ALLOWED_TOKEN_IDS),
}
def _modalities(value, param: str) -> None:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _wrong_type(param, "an array of strings")
    if set(value) - {"text"}:
        raise errors.invalid_request("Only the 'text' modality is supported: models here answer in text.", param=param,
                                     code="unsupported_parameter")


_CHAT_FIELDS: dict[str, Callable] = _COMMON_FIELDS | {
    "modalities": _modalities,
    "logprobs": _boolean,
    "top_logprobs": _integer(0, 20),
    "tools": _tools,
    "tool_choice": _tool_choice,
    "parallel_tool_calls": _boolean,
    "response_format": _response_format,
}
_COMPLETION_FIELDS: dict[str, Callable] = _COMMON_FIELDS | {
    "logprobs": _integer(0, 20),
    "echo": _boolean,
    "best_of": _integer(1, MAX_N),
    "suffix": _string,
    "response_format": _response_format,
}


def _string_list(value, param: str) -> None:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _wrong_type(param, "an array of strings")


# NOTE: `tools` and `tool_choice` are `endpoints.gateway.responses`'s; the engine reads the shapes of `text`,
# `reasoning` and `include`.
_RESPONSES_FIELDS: dict[str, Callable] = {
    name: _COMMON_FIELDS[name] for name in (
        "stream", "stream_options", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop",
        "user", "logit_bias", "stop_token_ids")
} | {
    "max_output_tokens": _positive_tokens,
    "instructions": _string,
    "metadata": _object,
    "store": _boolean,
    "background": _boolean,
    "parallel_tool_calls": _boolean,
    "top_logprobs": _integer(0, 20),
    "max_tool_calls": _integer(0),
    "text": _object,
    "reasoning": _object,
    "include": _string_list,
}
_FIELDS_OF_KIND: dict[str, dict[str, Callable]] = {
    "chat": _CHAT_FIELDS, "completion": _COMPLETION_FIELDS, responses.RESPONSES: _RESPONSES_FIELDS,
}
