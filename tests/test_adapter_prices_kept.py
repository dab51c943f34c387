"""Staff's prices on an adapter name are the contract: a tenant deleting the adapter and creating it again (same name,
same source: all the API allows; an adapter has no rename) gets it at those prices, as does the same source under
another name. Before, the prices lived on the adapter's row alone, and a re-created adapter priced 40/80 per million
on an endpoint at 1/2 was billed at 1/2."""

from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model

from endpoints.models import Adapter
from tests.factories import sign_in_staff

pytestmark = pytest.mark.django_db

ENDPOINT = {
    "name": "priced",
    "model_source": "hf:org/model-8B",
    "gpu_type": "h100-80gb",
    "max_loras": 2,
    "max_lora_rank": 16,
}
FRENCH = {"name": "french", "source": "s3://tuned-adapters/french", "rank": 8}


@pytest.fixture
def priced_adapter(owner_client, client):
    """An endpoint and its adapter `french`, priced 40/80 per million by staff in the admin."""
    return _price_adapter(owner_client, client, FRENCH)


def _price_adapter(owner_client, client, spec: dict) -> tuple[str, str]:
    endpoint_id = owner_client.post("/api/v1/endpoints/", ENDPOINT, format="json").json()["id"]
    adapter = owner_client.post(f"/api/v1/endpoints/{endpoint_id}/adapters/", spec, format="json").json()
    sign_in_staff(
        client,
        get_user_model().objects.create_superuser(
            "ops@example.test", "ops@example.test", "a long passphrase"
        ),
    )
    saved = client.post(
        f"/django-admin/endpoints/adapter/{adapter['id']}/change/",
        {"price_input_per_million": "40", "price_output_per_million": "80"},
    )
    assert saved.status_code == 302, saved.content.decode()[:500]
    return endpoint_id, adapter["id"]


def _prices(body: dict) -> tuple[str | None, str | None]:
    return body["price_input_per_million"], body["price_output_per_million"]


def test_an_adapter_deleted_and_created_again_keeps_the_prices_staff_set(owner_client, priced_adapter):
    endpoint_id, adapter_id = priced_adapter
    adapters_url = f"/api/v1/endpoints/{endpoint_id}/adapters/"
    assert owner_client.delete(f"{adapters_url}{adapter_id}/").status_code == 204
    again = owner_client.post(adapters_url, FRENCH, format="json")
    assert again.status_code == 201, again.json()
    assert _prices(again.json()) == ("40.000000", "80.000000")
    adapter = Adapter.objects.get(pk=again.json()["id"])
    assert (adapter.price_input_per_million, adapter.price_output_per_million) == (
        Decimal("40"),
        Decimal("80"),
    )


def test_the_same_source_under_another_name_starts_at_the_prices_staff_set_and_a_new_one_at_the_endpoints(
    owner_client, priced_adapter
):
    endpoint_id, adapter_id = priced_adapter
    adapters_url = f"/api/v1/endpoints/{endpoint_id}/adapters/"
    assert owner_client.delete(f"{adapters_url}{adapter_id}/").status_code == 204
    renamed = owner_client.post(adapters_url, FRENCH | {"name": "francais"}, format="json").json()
    assert _prices(renamed) == ("40.000000", "80.000000")
    other = owner_client.post(
        adapters_url, {"name": "german", "source": "s3://tuned-adapters/german"}, format="json"
    ).json()
    assert _prices(other) == (None, None)


@pytest.mark.parametrize(("priced", "again"), [
    ("s3://tuned-adapters/french", "s3://tuned-adapters/french/"),
    ("s3://tuned-adapters/french/", " s3://tuned-adapters/french"),
    ("hf:Acme/French-LoRA", "hf:acme/french-lora@main"),
    ("hf:acme/french-lora@main", "hf:ACME/French-LoRA"),
])
def test_the_same_source_spelled_otherwise_under_another_name_starts_at_the_prices_staff_set(
    owner_client, client, priced, again
):
    # The sources were compared character by character: the same objects under a trailing slash, or the same Hub repo
    # in another case or at its default revision named explicitly, started at the endpoint's prices (1/2, not 40/80).
    endpoint_id, adapter_id = _price_adapter(owner_client, client, FRENCH | {"source": priced})
    adapters_url = f"/api/v1/endpoints/{endpoint_id}/adapters/"
    assert owner_client.delete(f"{adapters_url}{adapter_id}/").status_code == 204
    renamed = owner_client.post(adapters_url, FRENCH | {"name": "francais", "source": again}, format="json")
    assert renamed.status_code == 201, renamed.json()
    assert _prices(renamed.json()) == ("40.000000", "80.000000")


@pytest.mark.parametrize("other", [
    "s3://tuned-adapters/French", "s3://tuned-adapters/french-v2", "s3://tuned-adapters//french",
    "hf:tuned-adapters/french@v2",
])
def test_another_source_that_only_looks_alike_starts_at_the_endpoints_prices(owner_client, client, other):
    # S3 keys are case-sensitive, a longer prefix or a doubled slash lists other objects, a revision is another commit
    priced = "hf:tuned-adapters/french" if other.startswith("hf:") else FRENCH["source"]
    endpoint_id, _ = _price_adapter(owner_client, client, FRENCH | {"source": priced})
    created = owner_client.post(f"/api/v1/endpoints/{endpoint_id}/adapters/",
                                FRENCH | {"name": "francais", "source": other}, format="json")
    assert created.status_code == 201, created.json()
    assert _prices(created.json()) == (None, None)
