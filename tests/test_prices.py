"""Prices: defaults by GPU type, money as Decimal, editable by staff only."""

from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model

from billing.ledger import cost_of
from endpoints.models import Endpoint, EventKind
from tests.factories import sign_in_staff

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
    sign_in_staff(client, get_user_model().objects.create_superuser("ops@example.test", "ops@example.test", "a long passphrase"))
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


def test_moving_an_endpoint_to_another_gpu_type_moves_it_to_that_types_prices(owner_client):
    """Prices come from the GPU type; a spec change that keeps the old type's prices let an endpoint
    created on a cheap GPU run on an H200 at the cheap GPU's prices."""
    endpoint_id = owner_client.post("/api/v1/endpoints/", VALID | {"gpu_type": "l4"}, format="json").json()["id"]
    moved = owner_client.patch(f"/api/v1/endpoints/{endpoint_id}/", {"gpu_type": "h200"}, format="json")
    assert moved.status_code == 200, moved.json()
    assert (moved.json()["price_input_per_million"], moved.json()["price_cached_input_per_million"],
            moved.json()["price_output_per_million"]) == ("0.700000", "0.350000", "2.100000")
    endpoint = Endpoint.objects.get(pk=endpoint_id)
    assert cost_of(endpoint, 0, 0, 1_000_000) == Decimal("2.1")
    event = endpoint.events.filter(kind=EventKind.CONFIG).order_by("-created_at").first()
    assert "price_output_per_million" in event.details["changes"]
    # Any other change keeps the prices staff may have set for this endpoint.
    Endpoint.objects.filter(pk=endpoint_id).update(price_output_per_million=Decimal("1.5"))
    assert owner_client.patch(f"/api/v1/endpoints/{endpoint_id}/", {"max_replicas": 3}, format="json").status_code == 200
    assert Endpoint.objects.get(pk=endpoint_id).price_output_per_million == Decimal("1.5")


def test_staff_price_an_adapter_in_the_admin(owner_client, client):
    from endpoints.models import Adapter

    endpoint_id = owner_client.post("/api/v1/endpoints/", VALID | {"max_loras": 2, "max_lora_rank": 16},
                                    format="json").json()["id"]
    adapter = owner_client.post(f"/api/v1/endpoints/{endpoint_id}/adapters/",
                                {"name": "legal", "source": "s3://tuned-adapters/legal", "rank": 8}, format="json").json()
    sign_in_staff(client, get_user_model().objects.create_superuser("ops@example.test", "ops@example.test", "a long passphrase"))
    assert client.get(f"/django-admin/endpoints/adapter/{adapter['id']}/change/").status_code == 200
    saved = client.post(f"/django-admin/endpoints/adapter/{adapter['id']}/change/",
                        {"price_input_per_million": "0.9", "price_output_per_million": "2.7"})
    assert saved.status_code == 302, saved.content.decode()[:500]
    assert (Adapter.objects.get(pk=adapter["id"]).price_output_per_million) == Decimal("2.7")
    listed = owner_client.get(f"/api/v1/endpoints/{endpoint_id}/adapters/{adapter['id']}/").json()
    assert (listed["price_input_per_million"], listed["price_output_per_million"]) == ("0.900000", "2.700000")
    # Audited, and on the endpoint's log for its owner (tests/test_admin_records.py for an endpoint's own prices).
    from controlplane.accounts.models import AuditEvent

    audit = AuditEvent.objects.get(action="adapter.prices", target_id=adapter["id"])
    assert audit.details["changes"]["price_output_per_million"] == {"from": None, "to": "2.700000"}
    assert Endpoint.objects.get(pk=endpoint_id).events.filter(message__startswith="Prices changed of adapter legal").exists()
