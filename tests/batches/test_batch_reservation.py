"""A batch line is reserved against its organisation's cap and credit at the batch price it is billed at
(`Endpoint.batch_price_fraction`), as any call is reserved its true worst case: a line whose worst case at the batch
price fits what is left runs.

Before: a line was reserved its worst case at the endpoint's full price, twice what it could cost at the default
fraction (0.5): a line that fit the cap at the batch price was refused 402 `insufficient_quota` and failed for good
(never tried again), and the lines in flight held twice the cap they could spend."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from django.db.models import Sum

from billing.models import UsageRecord
from billing.services import set_spend_cap
from controlplane.accounts.services import SYSTEM
from endpoints.batches import services, storage
from endpoints.batches.models import Batch, BatchStatus
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
