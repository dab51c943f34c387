"""Prices: defaults by GPU type, money as Decimal, editable by staff only."""

from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model

from billing.ledger import cost_of
from endpoints.models import Endpoint

pytestmark = pytest.mark.django_db

VALID = {"name": "priced", "model_source": "hf:org/model-8B", "gpu_type": "h100-80gb"}


def test_new_endpoints_get_their_gpu_types_default_prices(owner_client):
    body = owner_client.post("/api/v1/endpoints/", VALID, format="json").json()
    assert (body["price_input_per_million"], body["price_cached_input_per_million"], body["price_output_per_million"]) == (
        "0.600000", "0.300000", "1.800000")
    endpoint = Endpoint.objects.get(pk=body["id"])
    assert cost_of(endpoint, 1_000_000, 500_000, 1_000_000) == Decimal("0.6") / 2 + Decimal("0.3") / 2 + Decimal("1.8")


def test_staff_edit_prices_in_the_admin_and_customers_cannot(owner_client, client):
    endpoint_id = owner_client.post("/api/v1/endpoints/", VALID, format="json").json()["id"]
    refused = owner_client.patch(f"/api/v1/endpoints/{endpoint_id}/", {"price_output_per_million": "0.01"}, format="json")
    assert refused.status_code == 400 and "read-only" in refused.json()["price_output_per_million"][0]
    staff = get_user_model().objects.create_superuser("ops@example.test", "ops@example.test", "a long passphrase")
    client.force_login(staff)
    page = client.get(f"/django-admin/endpoints/endpoint/{endpoint_id}/change/")
    assert page.status_code == 200
    saved = client.post(f"/django-admin/endpoints/endpoint/{endpoint_id}/change/", {
        "price_input_per_million": "0.5", "price_cached_input_per_million": "0.25", "price_output_per_million": "1.5",
        "batch_price_fraction": "0.5",
    })
    assert saved.status_code == 302, saved.content.decode()[:500]
    endpoint = Endpoint.objects.get(pk=endpoint_id)
    assert (endpoint.price_input_per_million, endpoint.price_output_per_million) == (Decimal("0.5"), Decimal("1.5"))
    assert owner_client.get(f"/api/v1/endpoints/{endpoint_id}/").json()["price_output_per_million"] == "1.500000"
