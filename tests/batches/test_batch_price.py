"""The batch price: a fraction of the endpoint's prices (default half), set by staff in the admin, shown
by the API, applied alike by the ledger's SQL and `cost_of`, to batch rows only."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model

from billing.ledger import cost_of, record_usage_batch
from billing.models import UsageRecord
from endpoints.models import Endpoint
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory, sign_in_staff

pytestmark = pytest.mark.django_db


def test_a_batch_row_costs_the_batch_fraction_and_an_interactive_row_the_full_price():
    endpoint = EndpointFactory(price_input_per_million=Decimal("3"), price_cached_input_per_million=Decimal("1"),
                               price_output_per_million=Decimal("7"))
    interactive = usage_report(endpoint, prompt_tokens=1234, cached_tokens=200, completion_tokens=567)
    batch_line = replace(usage_report(endpoint, prompt_tokens=1234, cached_tokens=200, completion_tokens=567),
                         batch_id="batch_0123")
    record_usage_batch([interactive, batch_line])

    full = cost_of(endpoint, 1234, 200, 567)
    half = cost_of(endpoint, 1234, 200, 567, fraction=Decimal("0.5"))
    assert UsageRecord.objects.get(request_id=interactive.request_id).cost == full
    row = UsageRecord.objects.get(request_id=batch_line.request_id)
    assert row.batch_id == "batch_0123" and row.cost == half
    assert half == (Decimal(1034 * 3 + 200 * 1 + 567 * 7) / 2 / 1_000_000).quantize(Decimal("0.000000001"))


def test_staff_set_the_batch_fraction_in_the_admin_and_the_api_shows_it_read_only(owner_client, client):
    endpoint_id = owner_client.post("/api/v1/endpoints/", {"name": "priced", "model_source": "hf:org/model-8B",
                                                           "gpu_type": "h100-80gb"}, format="json").json()["id"]
    assert owner_client.get(f"/api/v1/endpoints/{endpoint_id}/").json()["batch_price_fraction"] == "0.500"
    refused = owner_client.patch(f"/api/v1/endpoints/{endpoint_id}/", {"batch_price_fraction": "0.01"}, format="json")
    assert refused.status_code == 400 and "read-only" in refused.json()["batch_price_fraction"][0]

    sign_in_staff(client, get_user_model().objects.create_superuser("ops@example.test", "ops@example.test", "a long passphrase"))
    form = {"price_input_per_million": "0.6", "price_cached_input_per_million": "0.3", "price_output_per_million": "1.8"}
    too_much = client.post(f"/django-admin/endpoints/endpoint/{endpoint_id}/change/", form | {"batch_price_fraction": "1.5"})
    assert too_much.status_code == 200  # the form again, with the error
    saved = client.post(f"/django-admin/endpoints/endpoint/{endpoint_id}/change/", form | {"batch_price_fraction": "0.25"})
    assert saved.status_code == 302
    assert Endpoint.objects.get(pk=endpoint_id).batch_price_fraction == Decimal("0.25")
    assert owner_client.get(f"/api/v1/endpoints/{endpoint_id}/").json()["batch_price_fraction"] == "0.250"
