"""Batch lines naming a LoRA adapter of the batch's endpoint (`"<endpoint>:<adapter>"`, the gateway's naming; OpenAI's
`body.model` is free per line), against mock engines: such a line runs on the adapter, billed at its prices as the
gateway bills a call to it; a line naming an adapter the endpoint does not have, or another organisation's endpoint or
adapter, fails the batch's check on its own line with `model_not_found`, and nothing runs.

Before, a file naming the endpoint and one of its adapters failed as `mismatched_model`, and one naming only adapters as
one unknown model (`model_not_found` on line 1, whatever line was wrong)."""

from __future__ import annotations

import json
import threading
import time
from decimal import Decimal

import httpx
import pytest
from django.db import connection

from billing.models import UsageRecord
from controlplane.accounts.services import SYSTEM
from controlplane.redis_client import get_redis
from controlplane.redis_keys import reservations_key
from endpoints.adapters import create_adapter, delete_adapter, record_replica_adapters
from endpoints.batches import services
from endpoints.batches.models import Batch, BatchStatus
from endpoints.models import Adapter, AdapterState, Endpoint, Replica
from endpoints.services import set_prices
from gpu_agent.protocol import ReplicaState, ReplicaStatus
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


def test_a_line_naming_an_adapter_created_just_before_the_batch_runs_on_it(
    files_bucket, tenant, start_mock_upstream
):
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    _with_adapter(endpoint, "german")
    warm = new_batch(endpoint, _jsonl([_line("warm", f"{endpoint.name}:german")]))
    services.run_batch(warm.pk)  # this process now has the endpoint's adapters cached: german alone
    Adapter.objects.create(endpoint=endpoint, name="french", source="hf:tuned/french")
    Replica.objects.filter(endpoint=endpoint).update(adapters=["german", "french"])
    batch = new_batch(endpoint, _jsonl([_line("tuned", f"{endpoint.name}:french")]))
    batch = services.validate_batch(Batch.objects.select_related("input_file").get(pk=batch.pk))
    assert batch.status == BatchStatus.IN_PROGRESS

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (1, 0)
    assert UsageRecord.objects.get(batch_id=batch.pk).adapter == "french"


def test_lines_naming_an_adapter_that_failed_to_load_fail_at_once_with_its_reason(
    files_bucket, tenant, start_mock_upstream
):
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    Endpoint.objects.filter(pk=endpoint.pk).update(cold_start_timeout_s=600)
    Adapter.objects.create(
        endpoint=endpoint,
        name="broken",
        source="hf:tuned/broken",
        state=AdapterState.FAILED,
        status_message="not a LoRA adapter",
    )
    batch = new_batch(endpoint, _jsonl([_line(f"l{i}", f"{endpoint.name}:broken") for i in range(3)]))
    batch = services.validate_batch(Batch.objects.select_related("input_file").get(pk=batch.pk))
    assert batch.status == BatchStatus.IN_PROGRESS

    services.run_batch(batch.pk)  # before: every line held 600 s, then tried again until the batch expired

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (0, 3)
    error = _rows(files_bucket, batch.error_file)["l0"]["response"]
    assert error["status_code"] == 400 and error["body"]["error"]["code"] == "adapter_failed"
    assert "not a LoRA adapter" in error["body"]["error"]["message"]
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 0 and not UsageRecord.objects.exists()


def test_lines_naming_an_adapter_whose_load_its_agent_tries_again_wait_and_run_once_it_loads(
    files_bucket, tenant, start_mock_upstream
):
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    adapter = Adapter.objects.create(
        endpoint=endpoint,
        name="tone",
        source="hf:tuned/tone",
        state=AdapterState.FAILED,
        status_message="cannot reach the Hub for hf:tuned/tone (it answered 503) (tried again in 60 s)",
        failure_retried=True,  # a passing failure: the agent tries it again
    )
    batch = new_batch(endpoint, _jsonl([_line(f"l{i}", f"{endpoint.name}:tone") for i in range(3)]))
    services.validate_batch(Batch.objects.select_related("input_file").get(pk=batch.pk))

    def run():
        services.run_batch(batch.pk)
        connection.close()

    runner = threading.Thread(target=run)
    runner.start()
    deadline = time.monotonic() + 30
    while runner.is_alive() and not Adapter.objects.filter(pk=adapter.pk, last_requested_at__isnull=False).exists():
        assert time.monotonic() < deadline, "no line asked for the adapter"
        time.sleep(0.1)  # a line asked for the adapter: the run waits for it
    # before: every line failed at once, 400 adapter_failed, and the batch completed so
    assert runner.is_alive(), Batch.objects.values_list("num_completed", "num_failed").get(pk=batch.pk)
    replica = Replica.objects.get(endpoint=endpoint)
    record_replica_adapters(replica.node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY,
                                                        adapters=["tone"]))  # the retry loaded it
    runner.join(60)
    assert not runner.is_alive()
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (3, 0)
    assert UsageRecord.objects.filter(batch_id=batch.pk, adapter="tone").count() == 3


def test_a_batch_waiting_for_an_adapter_to_load_is_cancelled_at_once_holding_nothing(
    files_bucket, tenant, start_mock_upstream
):
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    Endpoint.objects.filter(pk=endpoint.pk).update(cold_start_timeout_s=600)
    adapter = Adapter.objects.create(
        endpoint=endpoint, name="slow", source="hf:tuned/slow"
    )  # no replica loads it
    batch = new_batch(endpoint, _jsonl([_line(f"l{i}", f"{endpoint.name}:slow") for i in range(4)]))
    services.validate_batch(Batch.objects.select_related("input_file").get(pk=batch.pk))

    def run():
        services.run_batch(batch.pk)
        connection.close()

    runner = threading.Thread(target=run)
    runner.start()
    while not Adapter.objects.filter(pk=adapter.pk, last_requested_at__isnull=False).exists():
        time.sleep(0.1)  # a line asked for the adapter: the run is waiting for it
    assert (
        get_redis().hlen(reservations_key(tenant.org.pk)) == 0
    )  # before: each waiting line held a reservation
    services.cancel_batch(Batch.objects.get(pk=batch.pk))
    runner.join(60)  # before: each line held for the endpoint's 600 s cold start timeout
    assert not runner.is_alive()
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.CANCELLED and (batch.num_completed, batch.num_failed) == (0, 0)
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 0 and not UsageRecord.objects.exists()


def test_an_adapter_its_tenant_deletes_and_creates_again_is_billed_at_the_prices_staff_set(
    files_bucket, tenant, start_mock_upstream
):
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(
        tenant.org, upstream, price_input_per_million=Decimal("1"), price_output_per_million=Decimal("2")
    )
    adapter = Adapter.objects.create(endpoint=endpoint, name="french", source="hf:tuned/french")
    set_prices(
        SYSTEM,
        adapter,
        price_input_per_million=ADAPTER_PRICE_INPUT,
        price_output_per_million=ADAPTER_PRICE_OUTPUT,
    )  # the admin's path
    Replica.objects.filter(endpoint=endpoint).update(adapters=["french"])
    batch = new_batch(endpoint, _jsonl([_line("tuned", f"{endpoint.name}:french")]))
    batch = services.validate_batch(Batch.objects.select_related("input_file").get(pk=batch.pk))
    # the tenant, through the API's services: delete it, create it again (same name, same source)
    delete_adapter(SYSTEM, Adapter.objects.get(pk=adapter.pk))
    create_adapter(SYSTEM, Endpoint.objects.get(pk=endpoint.pk), name="french", source="hf:tuned/french")

    services.run_batch(batch.pk)

    row = UsageRecord.objects.get(batch_id=batch.pk)
    at_adapter_prices = (
        (row.prompt_tokens * ADAPTER_PRICE_INPUT + row.completion_tokens * ADAPTER_PRICE_OUTPUT)
        / Decimal(10**6)
        / 2
    )  # the batch price
    assert row.adapter == "french" and row.cost == at_adapter_prices.quantize(row.cost)
