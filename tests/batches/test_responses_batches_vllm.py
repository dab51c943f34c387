"""A `/v1/responses` batch with the official `openai` client on the package's real vLLM CPU engine (the shared tiny
chat model): each line runs as the gateway's Responses call, answers with the engine's response object in OpenAI's
batch output, and is one usage row at the endpoint's batch price; a hostile line fails alone (what the gateway refuses
of a Responses body, listed line by line as a chat batch's bad lines are; a line far past the context or asking more
output than it holds, in the error file, the other lines answered); a line run again is billed once.

Before, `batches.create(endpoint="/v1/responses")` was a 400 naming `endpoint`."""

from __future__ import annotations

import io
import json
from decimal import Decimal

import pytest

from billing.ledger import cost_of
from billing.models import UsageRecord
from endpoints.batches import services
from endpoints.batches.models import Batch, BatchStatus
from tests.batches.conftest import ended_batch, lose_a_result_once
from tests.gateway.conftest import ENGINE_CONTEXT, ENGINE_KEY, ENGINE_NAME, serve_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

RESPONSES = "/v1/responses"
PRICES = {
    "price_input_per_million": Decimal("100"),
    "price_cached_input_per_million": Decimal("10"),
    "price_output_per_million": Decimal("300"),
}


@pytest.fixture
def endpoint(tenant, vllm_engine):
    return serve_endpoint(
        tenant.org, vllm_engine, name=ENGINE_NAME, engine_key=ENGINE_KEY, target_concurrency=4, **PRICES
    )


def _line(custom_id: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": RESPONSES,
        "body": {"model": ENGINE_NAME, "input": "Say hello.", "max_output_tokens": 4} | body,
    }


def _create(client, rows: list[dict]):
    data = b"".join(json.dumps(row).encode() + b"\n" for row in rows)
    input_file = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=input_file.id, endpoint=RESPONSES, completion_window="24h")
    assert batch.endpoint == RESPONSES
    return batch


def _rows(client, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    return {
        row["custom_id"]: row for row in map(json.loads, client.files.content(file_id).read().splitlines())
    }


def _assert_billed_once_a_line_at_the_batch_price(endpoint, batch_id: str, output: dict[str, dict]) -> None:
    records = {record.request_id: record for record in UsageRecord.objects.filter(batch_id=batch_id)}
    assert set(records) == {row["response"]["request_id"] for row in output.values()}
    for row in output.values():
        usage, record = row["response"]["body"]["usage"], records[row["response"]["request_id"]]
        tokens = (record.prompt_tokens, record.cached_tokens, record.completion_tokens)
        assert (tokens[0], tokens[2]) == (usage["input_tokens"], usage["output_tokens"])
        assert record.cost == cost_of(endpoint, *tokens, fraction=Decimal("0.5")) > 0
    assert not UsageRecord.objects.exclude(batch_id=batch_id).exists()


def test_a_responses_batch_answers_every_line_with_the_engines_response_billed_once_a_line_at_the_batch_price(
    endpoint, gateway, tenant, batch_worker
):
    client = tenant.client(gateway, timeout=120)
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    rows = [
        _line("text"),
        _line(
            "instructions",
            instructions="Answer briefly.",
            input="Tell me a story.",
            max_output_tokens=6,
            ignore_eos=True,
        ),
        _line("items", input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi there."}]}]),
        _line("function-tool", input="What is the weather in Paris?", tools=[tool], tool_choice="auto"),
        _line("store", store=True, temperature=0, metadata={"run": "nightly"}),
        _line("stream-false", stream=False),
    ]
    batch = _create(client, rows)

    batch = ended_batch(client, batch.id)
    counts = batch.request_counts
    assert batch.status == "completed" and (counts.total, counts.completed, counts.failed) == (6, 6, 0), batch
    assert batch.error_file_id is None

    output = _rows(client, batch.output_file_id)
    assert set(output) == {row["custom_id"] for row in rows}
    for row in output.values():
        body = row["response"]["body"]
        assert row["error"] is None and row["response"]["status_code"] == 200, row
        assert row["id"].startswith("batch_req_") and row["response"]["request_id"].startswith(batch.id)
        assert body["object"] == "response" and body["model"] == ENGINE_NAME and body["output"], body
        assert body["usage"]["input_tokens"] > 0 and 1 <= body["usage"]["output_tokens"] <= 6, body
    # ignore_eos: every token it asked for
    assert output["instructions"]["response"]["body"]["usage"]["output_tokens"] == 6
    _assert_billed_once_a_line_at_the_batch_price(endpoint, batch.id, output)


# Each a field the gateway refuses on `/v1/responses`, with the `param` and `code` it names.
REFUSED = [
    ("previous_response_id", "resp_0123", "body.previous_response_id", "unsupported_parameter"),
    ("background", True, "body.background", "unsupported_parameter"),
    ("conversation", "conv_0123", "body.conversation", "unsupported_parameter"),
    ("prompt", {"id": "pmpt_0123"}, "body.prompt", "unsupported_parameter"),
    ("tools", [{"type": "web_search"}], "body.tools[0].type", "unsupported_value"),
    ("tool_choice", {"type": "web_search_preview"}, "body.tool_choice", "unsupported_value"),
    ("stream", True, "body.stream", "invalid_request"),
    ("max_output_tokens", 0, "body.max_output_tokens", "invalid_type"),
    ("max_tokens", 4, "body.max_tokens", "unsupported_parameter"),
]


def test_each_line_the_gateway_would_refuse_is_listed_on_its_own_line_and_nothing_runs(
    endpoint, gateway, tenant
):
    # As a chat batch's bad lines: the batch fails with one entry for each, and no line runs or is billed.
    client = tenant.client(gateway, timeout=120)
    rows = [
        _line("ok"),
        *(_line(f"hostile-{field}", **{field: value}) for field, value, _, _ in REFUSED),
        _line("ok-too"),
    ]
    batch = _create(client, rows)

    services.run_batch(batch.id)

    batch = client.batches.retrieve(batch.id)
    assert batch.status == "failed" and batch.request_counts.total == 0
    assert [(error.line, error.code, error.param) for error in batch.errors.data] == [
        (number, code, param) for number, (_, _, param, code) in enumerate(REFUSED, start=2)
    ]
    assert not UsageRecord.objects.exists()


def test_a_line_far_past_the_context_or_asking_more_output_than_it_holds_fails_alone(
    endpoint, gateway, tenant
):
    client = tenant.client(gateway, timeout=120)
    rows = [
        _line("first"),
        _line("past-context", input="hello world " * 20_000),
        _line("past-context-items", input=[{"role": "user", "content": "tell me a story " * 5_000}] * 4),
        _line("output-past-context", max_output_tokens=ENGINE_CONTEXT + 1),
        _line("output-huge", max_output_tokens=2**62),
        _line("last"),
    ]
    batch = _create(client, rows)

    services.run_batch(batch.id)

    batch = client.batches.retrieve(batch.id)
    counts = batch.request_counts
    assert batch.status == "completed" and (counts.total, counts.completed, counts.failed) == (6, 2, 4), batch
    output, refused = _rows(client, batch.output_file_id), _rows(client, batch.error_file_id)
    assert set(output) == {"first", "last"}
    assert all(row["response"]["status_code"] == 200 for row in output.values())
    assert set(refused) == {"past-context", "past-context-items", "output-past-context", "output-huge"}
    for custom_id, row in refused.items():
        assert row["response"]["status_code"] == 400, row
        error = row["response"]["body"]["error"]
        assert error["type"] == "invalid_request_error", row
        if custom_id.startswith("output"):
            assert error["param"] == "max_output_tokens" and str(ENGINE_CONTEXT) in error["message"], row
    # A refused line is billed nothing: the answered ones are, once each.
    _assert_billed_once_a_line_at_the_batch_price(endpoint, batch.id, output)


def test_a_line_run_again_after_its_result_was_lost_is_billed_once(endpoint, gateway, tenant, monkeypatch):
    # A run that died between a line's usage row and its result in S3 (a worker killed, S3 refusing the put): the next
    # run runs the line again under the same request id, and the ledger keeps its first row.
    client = tenant.client(gateway, timeout=120)
    # NOTE: the same answer on every try (greedy, every token asked for): the output holds the second try's
    batch = _create(client, [_line(f"r{i}", temperature=0, ignore_eos=True) for i in range(3)])
    lost = lose_a_result_once(monkeypatch, 1)
    with pytest.raises(RuntimeError):
        services.run_batch(batch.id)
    assert UsageRecord.objects.filter(request_id=f"{batch.id}-1").exists()  # billed, then its result lost
    services.run_batch(batch.id)

    assert lost == [1] and Batch.objects.get(pk=batch.id).status == BatchStatus.COMPLETED
    batch = client.batches.retrieve(batch.id)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 0)
    output = _rows(client, batch.output_file_id)
    assert sorted(UsageRecord.objects.filter(batch_id=batch.id).values_list("request_id", flat=True)) == [
        f"{batch.id}-{i}" for i in range(3)
    ]
    _assert_billed_once_a_line_at_the_batch_price(endpoint, batch.id, output)
