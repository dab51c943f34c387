"""A batch line is reserved against its organisation's cap and credit at the batch price it is billed at
(`Endpoint.batch_price_fraction`), as any call is reserved its true worst case: a line whose worst case at the batch
price fits what is left runs.

Before: a line was reserved its worst case at the endpoint's full price, twice what it could cost at the default
fraction (0.5): a line that fit the cap at the batch price was refused 402 `insufficient_quota` and failed for good
(never tried again), and the lines in flight held twice the cap they could spend. And a line refused 402 beside the
run's other lines in flight (their reservations, which their ends give back) failed for good at once."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal

import pytest
from django.db.models import Sum

from billing.models import UsageRecord
from billing.services import set_spend_cap
from controlplane.accounts.services import SYSTEM
from endpoints.batches import runner, services, storage
from endpoints.batches.models import Batch, BatchStatus
from endpoints.gateway import errors
from endpoints.gateway.estimate import worst_case
from tests.batches.conftest import new_batch
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

PRICE = Decimal("100")  # dollars per million tokens


def test_a_line_whose_worst_case_at_the_batch_price_fits_the_cap_runs_and_is_billed_within_it(
        files_bucket, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(), price_input_per_million=PRICE,
                              price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
    body = {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}
    full_worst_case = worst_case(body, "chat", endpoint.max_model_len).max_cost(endpoint)
    cap = (full_worst_case * Decimal("0.75")).quantize(Decimal("0.000001"))  # past the half, short of the whole
    set_spend_cap(SYSTEM, tenant.org, spend_cap=cap)
    line = {"custom_id": "only", "method": "POST", "url": "/v1/chat/completions", "body": body}
    batch = new_batch(endpoint, json.dumps(line).encode() + b"\n")

    services.run_batch(batch.pk)

    batch = Batch.objects.select_related("error_file").get(pk=batch.pk)
    errors = storage.read_bytes(batch.error_file.s3_key) if batch.error_file else b""
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 1, 0), errors
    spent = UsageRecord.objects.filter(batch_id=batch.pk).aggregate(total=Sum("cost"))["total"]
    assert Decimal(0) < spent <= cap


def test_lines_refused_only_for_the_reservations_of_the_runs_own_lines_in_flight_wait_for_them_and_run(
        files_bucket, tenant, start_mock_upstream):
    # Each line reserves its worst case (a long prompt) but costs little (the engine counts a short one): the cap fits
    # one line's reservation, and every line's cost many times over.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=150), price_input_per_million=PRICE,
                              price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
    bodies = [{"model": endpoint.name, "messages": [{"role": "user", "content": f"{i} " + "word " * 300}],
               "max_tokens": 8} for i in range(4)]
    one_reservation = worst_case(bodies[0], "chat", endpoint.max_model_len).max_cost(
        endpoint, fraction=endpoint.batch_price_fraction)
    cap = (one_reservation * Decimal("1.5")).quantize(Decimal("0.000001"))
    set_spend_cap(SYSTEM, tenant.org, spend_cap=cap)
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
             for i, body in enumerate(bodies)]
    batch = new_batch(endpoint, b"".join(json.dumps(line).encode() + b"\n" for line in lines))

    services.run_batch(batch.pk)

    batch = Batch.objects.select_related("error_file").get(pk=batch.pk)
    errors = storage.read_bytes(batch.error_file.s3_key) if batch.error_file else b""
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 4, 0), errors
    spent = UsageRecord.objects.filter(batch_id=batch.pk).aggregate(total=Sum("cost"))["total"]
    assert Decimal(0) < spent <= cap


def test_lines_the_cap_refuses_even_alone_fail_for_good_and_the_batch_ends(files_bucket, tenant, start_mock_upstream):
    upstream = start_mock_upstream(token_delay_ms=50)
    endpoint = serve_endpoint(tenant.org, upstream, price_input_per_million=PRICE,
                              price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
    bodies = [{"model": endpoint.name, "messages": [{"role": "user", "content": f"{i} " + "word " * 300}],
               "max_tokens": 8} for i in range(4)]
    one_reservation = worst_case(bodies[0], "chat", endpoint.max_model_len).max_cost(
        endpoint, fraction=endpoint.batch_price_fraction)
    set_spend_cap(SYSTEM, tenant.org, spend_cap=(one_reservation / 2).quantize(Decimal("0.000001")))
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
             for i, body in enumerate(bodies)]
    batch = new_batch(endpoint, b"".join(json.dumps(line).encode() + b"\n" for line in lines))

    services.run_batch(batch.pk)

    batch = Batch.objects.select_related("error_file").get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 0, 4)
    rows = [json.loads(row) for row in storage.read_bytes(batch.error_file.s3_key).splitlines()]
    assert {row["response"]["status_code"] for row in rows} == {402}
    assert not UsageRecord.objects.filter(batch_id=batch.pk).exists()


def test_a_line_whose_try_alone_met_a_503_is_not_failed_402_for_the_reservations_beside_it_later(
        files_bucket, tenant, start_mock_upstream, monkeypatch):
    """Its try alone met a transient refusal (a drained replica's 503), so it ran beside other lines again and was
    refused 402 for their reservations: that try alone was not spent, and it waits to run alone once more."""
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=150), price_input_per_million=PRICE,
                              price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
    bodies = [{"model": endpoint.name, "messages": [{"role": "user", "content": f"{i} " + "word " * 300}],
               "max_tokens": 8} for i in range(8)]
    one = worst_case(bodies[0], "chat", endpoint.max_model_len).max_cost(endpoint, fraction=endpoint.batch_price_fraction)
    set_spend_cap(SYSTEM, tenant.org, spend_cap=(one * Decimal("1.5")).quantize(Decimal("0.000001")))
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
             for i, body in enumerate(bodies)]
    batch = new_batch(endpoint, b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    real, num_calls, alone_503 = runner.run_line, {}, []

    async def run_line(work, endpoint, line, client, answer_deadline=None, answer=None):
        num_calls[line.index] = num_calls.get(line.index, 0) + 1
        if num_calls[line.index] == 2 and not alone_503:  # its try alone: a drained replica's 503
            alone_503.append(line.index)
            row = runner.answer_row(work.batch_id, line, 503, runner.line_request_id(work.batch_id, line.index),
                                    errors.service_unavailable().body())
            if answer is not None:
                answer.keep(len(row))
            return runner.LineOutcome(line, 503, row, retry=True)
        if alone_503 and line.index == alone_503[0] and num_calls[line.index] == 3:
            await asyncio.sleep(0.05)  # a line started beside it reserves first
        return await real(work, endpoint, line, client, answer_deadline, answer)

    monkeypatch.setattr(runner, "run_line", run_line)
    for _ in range(5):
        services.run_batch(batch.pk)
        if Batch.objects.get(pk=batch.pk).status == BatchStatus.COMPLETED:
            break

    batch = Batch.objects.select_related("error_file").get(pk=batch.pk)
    assert alone_503, "no line was refused 402 beside others and tried alone"
    assert (batch.num_completed, batch.num_failed) == (8, 0), (
        storage.read_bytes(batch.error_file.s3_key) if batch.error_file else b"")
