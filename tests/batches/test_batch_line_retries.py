"""A batch line runs under the same request id on every try (exactly-once usage): a try that recorded nothing
must leave nothing that stops the try that succeeds from being billed, in the ledger and in Redis (a try that
reached no engine: `tests/billing/test_quota.py`)."""

from __future__ import annotations

import json
from decimal import Decimal

import httpx
import pytest

from billing.models import UsageRecord
from billing.periods import period_containing
from billing.quota import counters
from controlplane.redis_client import get_redis
from controlplane.redis_keys import org_period_key
from endpoints.batches import runner, services, storage
from endpoints.batches.models import Batch, BatchStatus
from tests.batches.conftest import new_batch, one_chat_line
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


def _redis_spent(organization_id: int) -> Decimal:
    spent = get_redis().hget(org_period_key(organization_id, period_containing().key), "spent")
    return counters.from_units(int(spent or 0))


def test_a_line_whose_first_answer_was_cut_off_is_billed_for_the_retry_that_succeeded(
        files_bucket, tenant, start_mock_upstream, monkeypatch):
    # The cut try wrote an empty usage row under the line's id and left a day's settled marker: the retry's row
    # conflicted with it and its settlement added nothing. The answer the tenant got was never billed.
    monkeypatch.setattr(runner, "RETRY_PAUSE_S", 0.1)
    upstream = start_mock_upstream(cut_whole_answers=1)
    endpoint = serve_endpoint(tenant.org, upstream)
    batch = new_batch(endpoint, one_chat_line(endpoint))

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (1, 0)
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 2
    [row] = UsageRecord.objects.filter(batch_id=batch.pk)
    assert row.status == "ok" and row.completion_tokens == 8 and row.cost > 0
    assert _redis_spent(tenant.org.pk) == row.cost


def test_a_run_whose_endpoint_changed_configuration_meanwhile_goes_on_with_the_new_one(
        files_bucket, tenant, start_mock_upstream, monkeypatch, settings):
    # The run read its endpoint once: its replicas replaced by a change to what their engines start with, every line
    # was refused as checked by the old configuration (a 503, tried again) for the rest of its slice.
    import dataclasses

    from endpoints.gateway import directory
    from endpoints.models import Endpoint, Replica

    monkeypatch.setattr(runner, "RETRY_PAUSE_S", 0.1)
    settings.BATCH_RUN_SLICE_S = 8
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    batch = new_batch(endpoint, one_chat_line(endpoint))
    Endpoint.objects.filter(pk=endpoint.pk).update(engine_generation=1)  # replaced: the replica is of the new one
    Replica.objects.filter(endpoint=endpoint).update(engine_generation=1)
    real_find, reads = directory.find_endpoint, []

    async def read_before_the_change(organization_id, name):
        found = await real_find(organization_id, name)
        reads.append(found)
        return dataclasses.replace(found, engine_generation=0) if len(reads) == 1 else found

    monkeypatch.setattr(directory, "find_endpoint", read_before_the_change)
    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and (batch.num_completed, batch.num_failed) == (1, 0)


def test_a_line_larger_than_its_keys_whole_minute_of_tokens_fails_for_good_and_the_others_are_answered(
        files_bucket, tenant, start_mock_upstream, settings):
    # It was refused as a 429 `rate_limit_exceeded` (retry-after 60), which the runner tries again, pausing its starts
    # each time: two runs ended with the batch still in progress, 1 completed and 0 failed, until it expired. It is
    # OpenAI's 429 of type `tokens` again (no retry-after), which the runner knows by its class
    # (`errors.RequestTooLarge`), not its status: failed once, never tried again.
    settings.DEFAULT_KEY_TOKENS_PER_MINUTE = 300
    settings.BATCH_RUN_SLICE_S = 6
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    small, huge = (one_chat_line(endpoint, max_tokens=n).replace(b'"only"', name) for n, name in ((8, b'"small"'),
                                                                                                   (1000, b'"huge"')))
    batch = new_batch(endpoint, small + huge)

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 1, 1)
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 1
    [error_row] = [json.loads(row) for row in storage.read_bytes(batch.error_file.s3_key).splitlines()]
    assert error_row["custom_id"] == "huge" and error_row["response"]["status_code"] == 429
    error = error_row["response"]["body"]["error"]
    assert (error["type"], error["code"], error["param"]) == ("tokens", "rate_limit_exceeded", None)
    assert error["message"].startswith("Request too large")
