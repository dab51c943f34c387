"""Batches for `/v1/responses`, as OpenAI's Batch API allows, against mock engines and without one: a batch whose first
line names an embedding model is a 400 at its creation, as a chat batch's is; lines naming one of the endpoint's LoRA
adapters (`"<endpoint>:<adapter>"`) run on it, billed at its prices times the batch price; the console's batch form
offers the path, and the API's schema names it. The real engine's answers, hostile lines and runs again: `test_responses_batches_vllm.py`.

Before, `/v1/responses` was no batch endpoint: every create was a 400 naming `endpoint`."""

from __future__ import annotations

import io
import json
from decimal import Decimal

import openai
import pytest
from django.test import Client
from django.urls import reverse

from billing.ledger import cost_of
from billing.models import UsageRecord
from controlplane.accounts.models import Role
from endpoints.batches import services
from endpoints.batches.models import Batch, BatchStatus
from endpoints.gateway import errors
from endpoints.models import Adapter, Replica
from tests.batches.conftest import bucket_objects, new_batch
from tests.fakes.mock_openai import PROMPT_TOKENS
from tests.gateway.conftest import serve_endpoint
from tests.test_api_schema import fresh_schema  # noqa: F401 - a fixture this module uses

pytestmark = pytest.mark.django_db(transaction=True)

RESPONSES = "/v1/responses"
MAX_OUTPUT_TOKENS = 3


def _line(custom_id: str, model: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": RESPONSES,
        "body": {"model": model, "input": f"say {custom_id}", "max_output_tokens": MAX_OUTPUT_TOKENS} | body,
    }


def _jsonl(rows) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def test_a_responses_batch_whose_first_line_names_an_embedding_model_is_a_400_at_create(gateway, tenant):
    embedder = serve_endpoint(tenant.org, name="embedder", task="embed")
    chatter = serve_endpoint(tenant.org, name="chatter", task="generate")
    client = tenant.client(gateway)

    embed_file = client.files.create(
        file=("in.jsonl", io.BytesIO(_jsonl([_line("e", embedder.name)]))), purpose="batch"
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=embed_file.id, endpoint=RESPONSES, completion_window="24h")
    assert (refused.value.body["param"], refused.value.body["code"]) == ("endpoint", "model_is_embedding")
    assert RESPONSES in refused.value.message and not Batch.objects.exists()

    served = client.files.create(
        file=("in.jsonl", io.BytesIO(_jsonl([_line("c", chatter.name)]))), purpose="batch"
    )
    batch = client.batches.create(input_file_id=served.id, endpoint=RESPONSES, completion_window="24h")
    assert (batch.status, batch.endpoint) == ("validating", RESPONSES)


def test_lines_naming_an_adapter_run_on_it_billed_at_its_prices_times_the_batch_price(
    files_bucket, tenant, start_mock_upstream
):
    endpoint = serve_endpoint(
        tenant.org,
        start_mock_upstream(),
        price_input_per_million=Decimal("100"),
        price_output_per_million=Decimal("300"),
    )
    adapter = Adapter.objects.create(
        endpoint=endpoint,
        name="french",
        source="hf:tuned/french",
        price_input_per_million=Decimal("40"),
        price_output_per_million=Decimal("80"),
    )
    Replica.objects.filter(endpoint=endpoint).update(adapters=[adapter.name])
    batch = new_batch(
        endpoint,
        _jsonl(
            [
                _line("base", endpoint.name),
                _line("tuned", f"{endpoint.name}:french"),
                _line("unknown", f"{endpoint.name}:german"),
            ]
        ),
        request_path=RESPONSES,
    )

    services.run_batch(batch.pk)

    # An adapter the endpoint does not have is its own line's error, as on every path; nothing ran.
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.FAILED
    assert [(error["line"], error["code"]) for error in batch.errors] == [(3, "model_not_found")]

    batch = new_batch(
        endpoint,
        _jsonl([_line("base", endpoint.name), _line("tuned", f"{endpoint.name}:french")]),
        request_path=RESPONSES,
    )
    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (2, 0), (
        batch.errors
    )
    stored = bucket_objects(files_bucket, batch.output_file.s3_key)[batch.output_file.s3_key]
    output = {row["custom_id"]: row for row in map(json.loads, stored.splitlines())}
    # The engine was asked for the adapter by its name (vLLM's `lora_name`), the base model by the endpoint's.
    assert output["base"]["response"]["body"]["model"] == endpoint.name
    assert output["tuned"]["response"]["body"]["model"] == "french"
    assert all(row["response"]["body"]["object"] == "response" for row in output.values())

    records = {record.request_id: record for record in UsageRecord.objects.filter(batch_id=batch.pk)}
    base, tuned = (records[output[name]["response"]["request_id"]] for name in ("base", "tuned"))
    assert (base.adapter, tuned.adapter) == ("", "french")
    assert (tuned.prompt_tokens, tuned.completion_tokens) == (PROMPT_TOKENS, MAX_OUTPUT_TOKENS)
    assert base.cost == cost_of(endpoint, PROMPT_TOKENS, 0, MAX_OUTPUT_TOKENS, fraction=Decimal("0.5"))
    tuned_cost = (
        (
            PROMPT_TOKENS * adapter.price_input_per_million
            + MAX_OUTPUT_TOKENS * adapter.price_output_per_million
        )
        / Decimal(1_000_000)
        / 2
    )
    assert tuned.cost == tuned_cost.quantize(Decimal("0.000000001")) < base.cost


def test_the_console_batch_form_offers_the_responses_path(console_client_factory, files_bucket, org):
    member = console_client_factory(org, Role.MEMBER)
    page = member.get(reverse("console:batches")).content.decode()
    assert f'<option value="{RESPONSES}">{RESPONSES}</option>' in page

    line = {"custom_id": "a", "method": "POST", "url": RESPONSES, "body": {"model": "m", "input": "hi"}}
    upload = io.BytesIO(json.dumps(line).encode() + b"\n")
    upload.name = "requests.jsonl"
    response = member.post(reverse("console:batches"), {"file": upload, "endpoint": RESPONSES})
    assert response.status_code == 302
    assert Batch.objects.get(organization=org).request_path == RESPONSES


@pytest.mark.usefixtures("fresh_schema")
def test_the_api_schema_names_the_responses_path_among_those_a_generating_endpoint_serves():
    schema = Client().get("/api/schema/", {"format": "json"}).content.decode()
    assert "/v1/chat/completions, /v1/completions and /v1/responses" in schema


@pytest.mark.parametrize(
    "refusal",
    [
        errors.batch_answer_too_large("responses", 2**20),
        errors.batch_answer_too_large("responses", 2**20, as_outside=False),
        errors.response_too_large("responses", 2**26),
    ],
    ids=["batch line", "batch line, in memory", "outside a batch"],
)
def test_a_responses_answer_too_large_is_told_to_ask_for_fewer_tokens_or_logprobs_not_choices(refusal):
    # Before: "ask for fewer choices, tokens or logprobs", and a Responses call has no `n`.
    assert "fewer tokens or logprobs" in refusal.message and "choices" not in refusal.message
    assert "fewer choices, tokens or logprobs" in errors.batch_answer_too_large("chat", 2**20).message
