"""`/v1/responses` (OpenAI's Responses API) through the gateway, with the official `openai` client, in front of the
package's real vLLM engine (the tiny model on CPU): served and metered as chat is, and what needs stored state
refused with a 400 naming it.

- A response, whole or streamed (named SSE events), reaches the client as the engine wrote it, with `x-request-id`;
  its usage row is written once, equal to the engine's `usage` (in a stream, its `response.completed` event's).
- A client that leaves a stream mid-way: the stream carries no running usage, so the gateway reads on to its last
  event, relaying nothing, and bills the engine's figures (as a non-streamed call whose client left).
- `previous_response_id`, `background`, `conversation`, the stored-response routes and built-in tools are 400s naming
  the field; `store: true` is served (storage off); unknown fields are chat's 400.
- Another organisation's endpoint is a 404; a key over its spend cap gets chat's 402.
"""

from __future__ import annotations

import json
import socket
from decimal import Decimal

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from billing import services as billing_services
from billing.models import UsageRecord
from controlplane.accounts.services import SYSTEM
from endpoints.gateway import routing, sse
from endpoints.gateway.errors import OpenAIError
from endpoints.gateway.estimate import worst_case
from endpoints.gateway.request import InferenceRequest
from endpoints.gateway.tally import UsageTally
from tests.conftest import start_web_server, wait_until
from tests.gateway.conftest import ENGINE_CONTEXT, ENGINE_KEY, ENGINE_NAME, new_tenant, serve_endpoint
from tests.gateway.test_v1_fuzz import FUZZ_SETTINGS, any_json, encode, maybe_valid

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

NAME = ENGINE_NAME
PRICES = {
    "price_input_per_million": Decimal("100"),
    "price_cached_input_per_million": Decimal("10"),
    "price_output_per_million": Decimal("300"),
}


@pytest.fixture
def endpoint(tenant, vllm_engine):
    endpoint = serve_endpoint(tenant.org, vllm_engine, name=NAME, engine_key=ENGINE_KEY, **PRICES)
    return endpoint


def _row(request_id: str) -> UsageRecord:
    return wait_until(
        lambda: UsageRecord.objects.filter(request_id=request_id).first(), 30, message="the usage row"
    )


def _post(gateway: str, key: str, body: dict, path: str = "/v1/responses") -> httpx.Response:
    return httpx.post(f"{gateway}{path}", headers={"Authorization": f"Bearer {key}"}, json=body, timeout=120)


def _echoed_metadata(num_bytes: int) -> dict[str, str]:
    """`metadata` of about `num_bytes` (16 values): no prompt token, but every response object of a stream echoes it
    (`response.created`, `response.in_progress`, `response.completed`), so each of those events is that large."""
    return {f"pad{number}": "x" * (num_bytes // 16) for number in range(16)}


# --- served and metered -----------------------------------------------------------------------------


def test_a_response_is_created_and_its_usage_recorded_once_as_the_engine_reported_it(
    gateway, tenant, endpoint
):
    client = tenant.client(gateway)

    raw = client.responses.with_raw_response.create(
        model=NAME,
        instructions="Answer briefly.",
        input="Say hello.",
        max_output_tokens=8,
        extra_body={"ignore_eos": True},
    )
    response = raw.parse()

    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.usage.output_tokens == 8 and response.usage.input_tokens > 0
    request_id = raw.headers["x-request-id"]
    row = _row(request_id)
    assert (row.prompt_tokens, row.completion_tokens) == (
        response.usage.input_tokens,
        response.usage.output_tokens,
    )
    assert row.status == "ok" and row.cost > 0
    body = {"instructions": "Answer briefly.", "input": "Say hello.", "max_output_tokens": 8}
    assert (
        worst_case(body, "responses", ENGINE_CONTEXT).num_prompt_tokens >= row.prompt_tokens
    )  # reserved enough
    assert UsageRecord.objects.filter(request_id=request_id).count() == 1
    assert UsageRecord.objects.filter(organization=tenant.org).count() == 1


def test_input_items_with_a_function_tool_are_served(gateway, tenant, endpoint):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        }
    ]
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    ]

    raw = tenant.client(gateway).responses.with_raw_response.create(
        model=NAME, input=items, tools=tools, max_output_tokens=6
    )
    response = raw.parse()

    assert response.usage.input_tokens > 0 and 0 < response.usage.output_tokens <= 6
    row = _row(raw.headers["x-request-id"])
    assert (row.prompt_tokens, row.completion_tokens) == (
        response.usage.input_tokens,
        response.usage.output_tokens,
    )
    # NOTE: the reservation bounds the items' prompt as the engine rendered it (tools and the function call included)
    assert (
        worst_case({"input": items, "tools": tools}, "responses", ENGINE_CONTEXT).num_prompt_tokens
        >= row.prompt_tokens
    )


def test_a_streamed_response_relays_named_events_and_is_billed_from_response_completed(
    gateway, tenant, endpoint
):
    client = tenant.client(gateway)

    with client.responses.with_streaming_response.create(
        model=NAME,
        input="Tell me a story.",
        max_output_tokens=12,
        stream=True,
        extra_body={"ignore_eos": True},
    ) as raw:
        request_id = raw.headers["x-request-id"]
        events = list(raw.parse())

    types = [event.type for event in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert "response.output_text.delta" in types
    usage = events[-1].response.usage
    assert usage.output_tokens == 12
    row = _row(request_id)
    assert (row.prompt_tokens, row.completion_tokens) == (usage.input_tokens, usage.output_tokens)
    assert row.status == "ok" and row.first_token_at is not None
    assert UsageRecord.objects.filter(organization=tenant.org).count() == 1


def test_a_client_leaving_a_stream_midway_is_billed_the_engines_usage_once(gateway, tenant, endpoint):
    body = {
        "model": NAME,
        "input": "Once upon a time",
        # NOTE: long enough that the client leaves while the gateway still writes: at 40 tokens a loaded machine's run
        # had the whole stream written before the client read its second delta (an 'ok' stream, rightly billed whole).
        "max_output_tokens": 1000,
        "stream": True,
        "ignore_eos": True,
    }
    whole = _post(gateway, tenant.key, body | {"stream": False, "max_output_tokens": 1})
    assert whole.status_code == 200, whole.text

    with (
        httpx.Client(timeout=120) as client,
        client.stream(
            "POST", f"{gateway}/v1/responses", json=body, headers={"Authorization": f"Bearer {tenant.key}"}
        ) as response,
    ):
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        num_deltas = 0
        for line in response.iter_lines():
            num_deltas += line == "event: response.output_text.delta"
            if num_deltas == 2:
                break  # leave: the connection closes unread

    row = _row(request_id)
    assert row.status == "client_aborted"
    # NOTE: no running usage in a Responses stream: read on to its last event, billed exactly the engine's figures.
    assert (row.prompt_tokens, row.completion_tokens) == (whole.json()["usage"]["input_tokens"], 1000)
    assert UsageRecord.objects.filter(request_id=request_id).count() == 1


def test_a_streams_usage_is_read_from_its_last_event_never_from_the_callers_own_json():
    # NOTE: a response echoes the caller's JSON (`metadata`, tools' `parameters`): a `"usage"` there, even after the
    # real one, is never read.
    completed = (
        b'event: response.completed\ndata: {"response":{"id":"resp_1","metadata":{"a":"1","usage":'
        b'{"input_tokens":1,"output_tokens":1}},"usage":{"input_tokens":30,"input_tokens_details":'
        b'{"cached_tokens":16},"output_tokens":12},"tools":[{"type":"function","name":"f","parameters":'
        b'{"b":1,"usage":{"input_tokens":0,"output_tokens":0}}}]},"sequence_number":9,'
        b'"type":"response.completed"}'
    )
    delta = b'event: response.output_text.delta\ndata: {"delta":"Hi","usage":{"input_tokens":0},"type":"x"}'

    relayed, usage = sse.rewrite_event(completed, False, False)
    tally = UsageTally()
    tally.take_totals(usage)

    assert relayed == completed and (tally.prompt_tokens, tally.cached_tokens, tally.completion_tokens) == (
        30,
        16,
        12,
    )
    assert sse.rewrite_event(delta, False, False) == (delta, None) and sse.carries_output(delta)
    assert not sse.carries_output(completed)


# Responses bodies for the fuzz: each field well formed or any JSON at all (`test_v1_fuzz`'s strategies).
_part = st.fixed_dictionaries(
    {"type": maybe_valid(st.sampled_from(["input_text", "output_text", "input_image"]))},
    optional={
        "text": maybe_valid(st.text(max_size=20)),
        "image_url": maybe_valid(st.just("data:image/png;base64,AAAA")),
    },
)
_item = st.one_of(
    st.fixed_dictionaries(
        {
            "role": maybe_valid(st.sampled_from(["user", "assistant", "system", "developer"])),
            "content": st.one_of(st.text(max_size=30), st.lists(maybe_valid(_part), max_size=3), any_json),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": maybe_valid(st.text(max_size=8)),
            "name": maybe_valid(st.text(min_size=1, max_size=8)),
            "arguments": maybe_valid(st.sampled_from(['{"a": 1}', "[1, 2]", "not json"])),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": st.text(max_size=8),
            "output": maybe_valid(st.text(max_size=20)),
        }
    ),
)
_tool = st.fixed_dictionaries(
    {
        "type": maybe_valid(st.sampled_from(["function", "web_search", "mcp"])),
        "name": maybe_valid(st.text(min_size=1, max_size=8)),
        "parameters": maybe_valid(st.just({"type": "object", "properties": {}})),
    }
)
_FIELDS = {
    "instructions": maybe_valid(st.text(max_size=30)),
    "max_output_tokens": maybe_valid(st.integers(min_value=1, max_value=ENGINE_CONTEXT)),
    "tools": maybe_valid(st.lists(maybe_valid(_tool), max_size=2)),
    "tool_choice": maybe_valid(
        st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}])
    ),
    "text": maybe_valid(st.just({"format": {"type": "json_object"}})),
    "stream": maybe_valid(st.booleans()),
    "store": maybe_valid(st.booleans()),
    "background": maybe_valid(st.just(False)),
    "previous_response_id": maybe_valid(st.none()),
    "include": maybe_valid(st.just(["message.output_text.logprobs"])),
    "temperature": maybe_valid(st.floats(min_value=0, max_value=2)),
    "metadata": maybe_valid(st.just({"a": "b"})),
    "top_logprobs": maybe_valid(st.integers(min_value=0, max_value=20)),
    "priority": maybe_valid(st.just(0)),
}
_bodies = st.fixed_dictionaries(
    {
        "model": st.just(NAME),
        "input": maybe_valid(
            st.one_of(st.text(max_size=40), st.lists(maybe_valid(_item), min_size=1, max_size=4))
        ),
    },
    optional=_FIELDS,
)


class _Endpoint:  # what `InferenceRequest.worst_case` reads of an endpoint
    name, task, max_model_len, template_tokens, template_flag_tokens = NAME, "generate", ENGINE_CONTEXT, (0, 0), None
    prompt_normalizer = prompt_factor = None  # a model whose tokenizer adds nothing; no learned factor


@FUZZ_SETTINGS
@given(body=st.one_of(_bodies, any_json))
def test_any_responses_body_is_taken_or_refused_with_a_400_never_an_error(body):
    encoded = encode(body)
    try:
        request = InferenceRequest.parse(encoded, kind="responses", path="/v1/responses")
        request.worst_case(_Endpoint())
    except OpenAIError as refusal:
        assert (
            refusal.status == 400 and json.loads(refusal.body())["error"]["type"] == "invalid_request_error"
        )
        return
    sent = json.loads(request.upstream_body(media_scope="key"))
    assert (
        sent["store"] is False and "stream_options" not in sent
    )  # never stored; no running usage to ask for
    routing.prefix_key(request.kind, request.payload)


def test_a_stream_whose_client_stops_reading_is_cut_off_and_billed_the_engines_usage(
    tenant, endpoint, tmp_path, web_zygote
):
    # NOTE: `response.created`, `response.in_progress` and `response.completed` each echo ~2.4 MB of metadata, ~7.2 MB
    # in all, past what the loopback's socket buffers hold for a client reading nothing (the send buffer grows to 4 MiB,
    # `tcp_wmem`): the send waits, and the send deadline (2 s) cuts the call off. Before, 1,200 tokens with 20 top
    # logprobs each made the bytes (~5.4 MB): ~15 s of the engine, besides the first compile of its logprobs kernel.
    child, gateway = start_web_server(
        tmp_path, name="gateway", extra_env={"INFERPLANE_GATEWAY_SEND_TIMEOUT_S": "2"}, zygote=web_zygote
    )
    max_output_tokens = 40
    body = json.dumps(
        {
            "model": NAME,
            "input": "Hi",
            "max_output_tokens": max_output_tokens,
            "ignore_eos": True,
            "stream": True,
            "metadata": _echoed_metadata(2_400_000),
        }
    ).encode()
    host, port = gateway.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nauthorization: "
            b"Bearer "
            + tenant.key.encode()
            + b"\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        row = wait_until(
            lambda: UsageRecord.objects.filter(organization=tenant.org).first(), 300, message="the usage row"
        )
    finally:
        sock.close()
        child.stop()

    assert row.status == "client_aborted"
    # Read on to `response.completed`, relaying nothing: the engine's figures. Cancelled, it was billed nothing.
    assert row.completion_tokens == max_output_tokens and row.prompt_tokens > 0, (
        row.prompt_tokens,
        row.completion_tokens,
    )


# --- refused: state, built-in tools, unknown fields ---------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("previous_response_id", "resp_0123"),
        ("background", True),
        ("conversation", "conv_0123"),
        ("tools", [{"type": "web_search"}]),
        ("tools", [{"type": "file_search", "vector_store_ids": ["vs_1"]}]),
        ("tools", [{"type": "code_interpreter", "container": {"type": "auto"}}]),
        ("tools", [{"type": "mcp", "server_label": "x", "server_url": "https://example.com"}]),
        ("tool_choice", {"type": "web_search_preview"}),
    ],
)
def test_what_needs_stored_state_or_a_built_in_tool_is_a_400_naming_the_field(
    gateway, tenant, endpoint, field, value
):
    with pytest.raises(openai.BadRequestError) as refused:
        tenant.client(gateway).responses.create(
            model=NAME, input="Hi", max_output_tokens=4, extra_body={field: value}
        )

    error = refused.value.body
    assert error["param"].split("[")[0] == field and error["type"] == "invalid_request_error", error
    assert not UsageRecord.objects.exists()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/responses/resp_0123"),
        ("DELETE", "/v1/responses/resp_0123"),
        ("POST", "/v1/responses/resp_0123/cancel"),
        ("GET", "/v1/responses/resp_0123/input_items"),
    ],
)
def test_the_stored_response_routes_are_a_400_saying_nothing_is_stored(gateway, tenant, method, path):
    response = httpx.request(
        method, f"{gateway}{path}", headers={"Authorization": f"Bearer {tenant.key}"}, timeout=30
    )

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "responses_not_stored" and "not stored" in error["message"]


def test_the_openai_clients_retrieve_gets_the_400(gateway, tenant):
    with pytest.raises(openai.BadRequestError):
        tenant.client(gateway).responses.retrieve("resp_0123")


def test_store_true_is_served_with_storage_off(gateway, tenant, endpoint):
    response = _post(
        gateway, tenant.key, {"model": NAME, "input": "Hi", "max_output_tokens": 4, "store": True}
    )

    assert response.status_code == 200, response.text
    assert response.json()["usage"]["input_tokens"] > 0
    _row(response.headers["x-request-id"])


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ({"max_tokens": 4}, "max_tokens", "unsupported_parameter"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "messages", "unsupported_parameter"),
        ({"request_id": "mine"}, "request_id", "unsupported_parameter"),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "http://169.254.169.254/x"}],
                    }
                ]
            },
            "input[0].content[0].image_url",
            "unsupported_value",
        ),
        ({"input": 7}, "input", None),
        ({"max_output_tokens": ENGINE_CONTEXT + 1}, "max_output_tokens", "invalid_value"),
    ],
)
def test_bad_bodies_are_a_400_naming_the_field_as_chat_refuses_them(
    gateway, tenant, endpoint, body, param, code
):
    response = _post(gateway, tenant.key, {"model": NAME, "input": "Hi"} | body)

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert not UsageRecord.objects.exists()


# --- whose endpoint, and caps ----------------------------------------------------------------------


def test_another_organisations_endpoint_is_a_404(gateway, tenant, endpoint):
    other = new_tenant()

    with pytest.raises(openai.NotFoundError) as missing:
        other.client(gateway).responses.create(model=NAME, input="Hi", max_output_tokens=4)

    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        tenant.client(gateway).responses.create(
            model=f"{NAME}:no-such-adapter", input="Hi", max_output_tokens=4
        )


def test_a_key_over_its_spend_cap_is_refused_as_chat_is(gateway, tenant, endpoint):
    billing_services.set_key_spend_cap(SYSTEM, tenant.api_key, spend_cap=Decimal("0.000001"))

    chat = _post(
        gateway,
        tenant.key,
        {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        path="/v1/chat/completions",
    )
    response = _post(gateway, tenant.key, {"model": NAME, "input": "Hi", "max_output_tokens": 4})

    assert chat.status_code == response.status_code == 402, (chat.text, response.text)
    assert response.json()["error"]["code"] == chat.json()["error"]["code"] == "insufficient_quota"
    assert json.loads(response.text)["error"]["type"] == "insufficient_quota"
    assert not UsageRecord.objects.exists()
