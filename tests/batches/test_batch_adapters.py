"""Batch lines naming a LoRA adapter of the batch's endpoint (`"<endpoint>:<adapter>"`, the gateway's naming; OpenAI's
`body.model` is free per line), against mock engines: such a line runs on the adapter, billed at its prices as the
gateway bills a call to it; a line naming an adapter the endpoint does not have, or another organisation's endpoint or
adapter, fails the batch's check on its own line with `model_not_found`, and nothing runs.

Before, a file naming the endpoint and one of its adapters failed as `mismatched_model`, and one naming only adapters as
one unknown model (`model_not_found` on line 1, whatever line was wrong)."""

from __future__ import annotations

import json
from decimal import Decimal

import httpx
import pytest

from billing.models import UsageRecord
from endpoints.batches import services
from endpoints.batches.models import Batch, BatchStatus
from endpoints.models import Adapter, Replica
from tests.batches.conftest import bucket_objects, new_batch
from tests.fakes.mock_openai import PROMPT_TOKENS
from tests.gateway.conftest import new_tenant, serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

ADAPTER_PRICE_INPUT, ADAPTER_PRICE_OUTPUT = Decimal("40"), Decimal("80")
MAX_TOKENS = 3


def _line(custom_id: str, model: str) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": f"say {custom_id}"}],
            "max_tokens": MAX_TOKENS,
        },
    }


def _jsonl(rows) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def _with_adapter(endpoint, name: str = "french") -> Adapter:
    """An adapter of `endpoint`, with prices of its own, that its replicas hold (as their agents report)."""
    adapter = Adapter.objects.create(
        endpoint=endpoint,
        name=name,
        source=f"hf:tuned/{name}",
        price_input_per_million=ADAPTER_PRICE_INPUT,
        price_output_per_million=ADAPTER_PRICE_OUTPUT,
    )
    Replica.objects.filter(endpoint=endpoint).update(adapters=[name])
    return adapter


def _rows(files_bucket: str, file) -> dict[str, dict]:
    stored = bucket_objects(files_bucket, file.s3_key)[file.s3_key]
    return {row["custom_id"]: row for row in map(json.loads, stored.splitlines())}


def test_lines_naming_an_adapter_run_on_it_billed_at_its_prices_as_the_gateway_bills_a_call_to_it(
    files_bucket, tenant, start_mock_upstream
):
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    _with_adapter(endpoint)
    batch = new_batch(
        endpoint, _jsonl([_line("base", endpoint.name), _line("tuned", f"{endpoint.name}:french")])
    )

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (2, 0), (
        batch.errors
    )
    output = _rows(files_bucket, batch.output_file)
    # The engine was asked for the adapter by its name (vLLM's `lora_name`), the base model by the endpoint's.
    assert output["base"]["response"]["body"]["model"] == endpoint.name
    assert output["tuned"]["response"]["body"]["model"] == "french"

    records = {record.request_id: record for record in UsageRecord.objects.filter(batch_id=batch.pk)}
    base, tuned = (records[output[name]["response"]["request_id"]] for name in ("base", "tuned"))
    assert (base.adapter, tuned.adapter) == ("", "french")
    assert base.endpoint_id == tuned.endpoint_id == endpoint.pk and tuned.organization_id == tenant.org.pk
    expected = (
        (PROMPT_TOKENS * ADAPTER_PRICE_INPUT + MAX_TOKENS * ADAPTER_PRICE_OUTPUT) / Decimal(1_000_000) / 2
    )
    assert tuned.cost == expected.quantize(Decimal("0.000000001"))


def test_a_line_naming_an_unknown_adapter_or_another_organisations_fails_the_check_on_its_own_line(
    files_bucket, tenant, start_mock_upstream
):
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    _with_adapter(endpoint)
    theirs = serve_endpoint(new_tenant().org, name="theirs")
    _with_adapter(theirs, "secret")
    sibling = serve_endpoint(tenant.org, name="sibling")
    rows = [
        _line("ok", f"{endpoint.name}:french"),
        _line("unknown", f"{endpoint.name}:nope"),
        _line("their-adapter", "theirs:secret"),
        _line("their-endpoint", "theirs"),
        _line("no-adapter", f"{endpoint.name}:"),
        _line("sibling", sibling.name),
        _line("base", endpoint.name),
    ]
    batch = new_batch(endpoint, _jsonl(rows))

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.FAILED and batch.num_total == 0
    assert [(error["line"], error["code"], error["param"]) for error in batch.errors] == [
        (2, "model_not_found", "body.model"),
        (3, "model_not_found", "body.model"),
        (4, "model_not_found", "body.model"),
        (5, "model_not_found", "body.model"),
        (6, "mismatched_model", "body.model"),
    ]
    assert "theirs:secret" in batch.errors[1]["message"] and "does not exist" in batch.errors[1]["message"]
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 0 and not UsageRecord.objects.exists()


def test_a_line_whose_adapter_was_deleted_after_the_check_fails_alone_as_it_runs(
    files_bucket, tenant, start_mock_upstream
):
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    adapter = _with_adapter(endpoint)
    batch = new_batch(
        endpoint, _jsonl([_line("base", endpoint.name), _line("tuned", f"{endpoint.name}:french")])
    )
    batch = services.validate_batch(Batch.objects.select_related("input_file").get(pk=batch.pk))
    assert batch.status == BatchStatus.IN_PROGRESS
    adapter.delete()

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (1, 1)
    failed = _rows(files_bucket, batch.error_file)["tuned"]
    assert failed["response"]["status_code"] == 404
    assert failed["response"]["body"]["error"]["code"] == "model_not_found"
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 1
    assert UsageRecord.objects.filter(batch_id=batch.pk).count() == 1
