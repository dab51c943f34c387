"""Batches for `/v1/embeddings`, as OpenAI's Batch API allows, against mock engines: each line checked as the gateway
checks an embeddings body (every bad one listed, nothing run), run as the gateway's embeddings call, billed once for its
prompt tokens at the endpoint's batch price, never twice when it is run again; a batch whose endpoint path asks what
its model does not serve is a 400 at its creation; a cancel counts exactly the lines that answered.

Before, `/v1/embeddings` was no batch endpoint: every create was a 400 naming `endpoint`."""

from __future__ import annotations

import io
import json
from decimal import Decimal

import httpx
import openai
import pytest

from billing.ledger import cost_of
from billing.models import UsageRecord
from endpoints.batches import services
from endpoints.batches.models import Batch, BatchStatus
from endpoints.gateway.embeddings import MAX_INPUTS
from tests.batches.conftest import bucket_objects, lose_a_result_once, new_batch, s3_stalled
from tests.conftest import wait_until
from tests.fakes.mock_openai import EMBEDDING_SIZE, PROMPT_TOKENS
from tests.gateway.conftest import new_tenant, serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

EMBEDDINGS = "/v1/embeddings"
PRICE_INPUT = Decimal("100")


def _line(custom_id: str, model: str, url: str = EMBEDDINGS, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": model, "input": "hello"} | body,
    }


def _jsonl(rows) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def _embedding_endpoint(organization, *addresses: str, **spec):
    return serve_endpoint(organization, *addresses, task="embed", price_input_per_million=PRICE_INPUT, **spec)


def test_an_embeddings_batch_runs_each_line_once_billed_for_its_prompt_tokens_at_the_batch_price(
    files_bucket, tenant, start_mock_upstream
):
    upstream = start_mock_upstream()
    endpoint = _embedding_endpoint(tenant.org, upstream)
    # NOTE: text only: the mock counts 7 tokens an input, more than a short list of token ids may cost (what the call
    # reserved bounds its cost); the real engine's token ids are `test_embedding_batches_vllm.py`'s.
    inputs = ["one text", ["two", "texts"], "three", ["four a", "four b", "four c"]]
    rows = [_line(f"e{i}", endpoint.name, input=value) for i, value in enumerate(inputs)]
    rows.append(_line("shorter", endpoint.name, dimensions=4, encoding_format="base64"))
    batch = new_batch(endpoint, _jsonl(rows), request_path=EMBEDDINGS)

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and (
        batch.num_total,
        batch.num_completed,
        batch.num_failed,
    ) == (5, 5, 0)
    stored = bucket_objects(files_bucket, batch.output_file.s3_key)[batch.output_file.s3_key]
    output = {row["custom_id"]: row for row in map(json.loads, stored.splitlines())}
    num_vectors = {"e0": 1, "e1": 2, "e2": 1, "e3": 3, "shorter": 1}
    for custom_id, row in output.items():
        body = row["response"]["body"]
        assert row["error"] is None and row["response"]["status_code"] == 200
        assert row["response"]["request_id"].startswith(batch.pk)
        assert body["object"] == "list" and len(body["data"]) == num_vectors[custom_id]
        assert all(len(item["embedding"]) == EMBEDDING_SIZE for item in body["data"])
        assert body["usage"]["prompt_tokens"] == PROMPT_TOKENS * num_vectors[custom_id]
    # The engine got what the line asked, at the batch's engine priority.
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 5

    # One usage row a line: its prompt tokens only, at the input price, times the batch price fraction.
    usage = {row.request_id: row for row in UsageRecord.objects.filter(batch_id=batch.pk)}
    assert set(usage) == {row["response"]["request_id"] for row in output.values()}
    for custom_id, row in output.items():
        record = usage[row["response"]["request_id"]]
        assert (record.prompt_tokens, record.completion_tokens) == (PROMPT_TOKENS * num_vectors[custom_id], 0)
        assert record.cost == cost_of(endpoint, record.prompt_tokens, 0, 0, fraction=Decimal("0.5")) > 0


def test_a_line_run_again_after_its_result_was_lost_is_billed_once(
    files_bucket, tenant, start_mock_upstream, monkeypatch
):
    # A run that died between a line's usage row and its result in S3 (a worker killed, S3 refusing the put): the next
    # run runs the line again under the same request id, and the ledger keeps its first row.
    upstream = start_mock_upstream()
    endpoint = _embedding_endpoint(tenant.org, upstream)
    batch = new_batch(
        endpoint, _jsonl([_line(f"e{i}", endpoint.name) for i in range(3)]), request_path=EMBEDDINGS
    )
    lost = lose_a_result_once(monkeypatch, 1)
    with pytest.raises(RuntimeError):
        services.run_batch(batch.pk)
    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (3, 0)
    assert lost == [1] and httpx.get(f"{upstream}/_stats").json()["num_requests"] >= 4  # line 1 ran twice
    records = UsageRecord.objects.filter(batch_id=batch.pk)
    assert sorted(records.values_list("request_id", flat=True)) == [f"{batch.pk}-{i}" for i in range(3)]
    assert {record.prompt_tokens for record in records} == {PROMPT_TOKENS}


def test_embeddings_lines_are_checked_as_the_gateway_checks_their_bodies_and_each_bad_one_is_listed(
    files_bucket, tenant, start_mock_upstream
):
    upstream = start_mock_upstream()
    endpoint = _embedding_endpoint(tenant.org, upstream)
    others = _embedding_endpoint(new_tenant().org, name="theirs")
    rows = [
        _line("ok", endpoint.name),
        _line("n", endpoint.name, n=2),
        _line("many", endpoint.name, input=["x"] * (MAX_INPUTS + 1)),
        _line("empty", endpoint.name, input=""),
        _line("format", endpoint.name, encoding_format="int8"),
        _line("dimensions", endpoint.name, dimensions=0),
        _line("mixed-url", endpoint.name, url="/v1/chat/completions"),
        _line("chat-body", endpoint.name, messages=[{"role": "user", "content": "hi"}]),
        _line("other-org", others.name),
        _line("no-input", endpoint.name, input=None),
    ]
    data = (
        _jsonl(rows)
        + json.dumps(_line("huge", endpoint.name, input="x" * (9 * 1024 * 1024))).encode()
        + b"\n"
    )
    batch = new_batch(endpoint, data, request_path=EMBEDDINGS)

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.FAILED and batch.num_total == 0
    assert [(error["line"], error["code"], error["param"]) for error in batch.errors] == [
        (2, "unknown_parameter", "body.n"),
        (3, "invalid_value", "body.input"),
        (4, "invalid_value", "body.input"),
        (5, "invalid_value", "body.encoding_format"),
        (6, "invalid_value", "body.dimensions"),
        (7, "invalid_url", "url"),
        (8, "unsupported_parameter", "body.messages"),
        (9, "model_not_found", "body.model"),
        (10, "invalid_request", "body.input"),
        (11, "line_too_large", None),
    ]
    assert "theirs" in batch.errors[7]["message"] and "does not exist" in batch.errors[7]["message"]
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 0 and not UsageRecord.objects.exists()


def test_a_batch_whose_endpoint_path_asks_what_its_model_does_not_serve_is_a_400_at_create(gateway, tenant):
    embedder = _embedding_endpoint(tenant.org)
    chatter = serve_endpoint(tenant.org, task="generate")
    client = tenant.client(gateway)
    chat_line = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": embedder.name, "messages": [{"role": "user", "content": "hi"}]},
    }
    chat_file = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl([chat_line]))), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(
            input_file_id=chat_file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert (refused.value.body["param"], refused.value.body["code"]) == ("endpoint", "model_is_embedding")
    assert "/v1/embeddings" in refused.value.message

    embed_file = client.files.create(
        file=("in.jsonl", io.BytesIO(_jsonl([_line("e", chatter.name)]))), purpose="batch"
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=embed_file.id, endpoint=EMBEDDINGS, completion_window="24h")
    assert (refused.value.body["param"], refused.value.body["code"]) == ("endpoint", "model_not_embedding")
    assert not Batch.objects.exists()

    # Each model with the path it serves is a batch.
    served = client.files.create(
        file=("in.jsonl", io.BytesIO(_jsonl([_line("e", embedder.name)]))), purpose="batch"
    )
    assert (
        client.batches.create(input_file_id=served.id, endpoint=EMBEDDINGS, completion_window="24h").status
        == "validating"
    )


def test_a_batch_created_while_s3_stalls_is_created_without_its_first_line_checked(gateway, tenant, s3_child):
    # Guard (passes before too, when a creation read nothing from S3): the first line's check gives up within seconds
    # (one try), and the validation checks every line once S3 answers. The run's own reads retry with 60 s timeouts: a
    # creation waiting on them held the client for minutes.
    embedder = _embedding_endpoint(tenant.org)
    client = tenant.client(gateway, timeout=30)
    input_file = client.files.create(
        file=("in.jsonl", io.BytesIO(_jsonl([_line("e", embedder.name)]))), purpose="batch"
    )
    with s3_stalled(s3_child):
        batch = client.batches.create(
            input_file_id=input_file.id, endpoint=EMBEDDINGS, completion_window="24h"
        )
    assert batch.status == "validating"


def test_an_embeddings_batch_cancelled_mid_run_counts_exactly_the_lines_it_answered(
    gateway, tenant, batch_worker, start_mock_upstream
):
    # One slot and a slow engine: lines finish one at a time.
    endpoint = _embedding_endpoint(tenant.org, start_mock_upstream(prefill_ms=100), target_concurrency=1)
    client = tenant.client(gateway)
    input_file = client.files.create(
        file=("in.jsonl", io.BytesIO(_jsonl([_line(f"l{i}", endpoint.name) for i in range(60)]))),
        purpose="batch",
    )
    batch = client.batches.create(input_file_id=input_file.id, endpoint=EMBEDDINGS, completion_window="24h")
    assert batch.endpoint == EMBEDDINGS
    wait_until(
        lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3,
        120,
        message="a few lines to finish",
    )

    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    wait_until(
        lambda: client.batches.retrieve(batch.id).status == "cancelled", 120, message="the batch to end"
    )
    batch = client.batches.retrieve(batch.id)
    output = client.files.content(batch.output_file_id).read().splitlines()
    assert 3 <= len(output) == batch.request_counts.completed < 60 and batch.request_counts.failed == 0
    # Billed exactly for the lines that answered, each once.
    records = UsageRecord.objects.filter(batch_id=batch.id)
    assert records.count() == len(output) == len(set(records.values_list("request_id", flat=True)))
    assert sorted(records.values_list("request_id", flat=True)) == sorted(
        json.loads(row)["response"]["request_id"] for row in output
    )
