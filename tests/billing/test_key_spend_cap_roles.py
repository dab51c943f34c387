"""A key's spend cap follows the rule for revoking it: an admin may not stop an owner's key through its cap (0 stops it
as revoking does), nor lift a cap an owner put on the admin's own key; a key with a cap sets no key's cap above it."""

from __future__ import annotations

from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from billing.models import ApiKeySpendCap
from controlplane.accounts.models import ApiKey, Role

pytestmark = pytest.mark.django_db


def _key_of(client) -> ApiKey:
    return ApiKey.objects.get(created_by=client.user)


def test_an_admin_cannot_cap_an_owners_key(owner_client, member_client_factory):
    """Before, an admin's `{"spend_cap": "0.00"}` on an owner's key stopped it, though revoking it was refused."""
    admin = member_client_factory(owner_client.organization, Role.ADMIN)
    owners_key = _key_of(owner_client)
    for cap in ("0.00", "5.00", None):
        refused = admin.patch(f"/api/v1/billing/keys/{owners_key.pk}/", {"spend_cap": cap}, format="json")
        assert refused.status_code == 403 and "owner's key" in refused.json()["detail"]
    assert not ApiKeySpendCap.objects.filter(api_key=owners_key).exists()
    # Another owner may; an admin still caps a member's key and their own.
    other_owner = member_client_factory(owner_client.organization, Role.OWNER)
    assert other_owner.patch(f"/api/v1/billing/keys/{owners_key.pk}/", {"spend_cap": "5.00"},
                             format="json").status_code == 200
    members_key = _key_of(member_client_factory(owner_client.organization, Role.MEMBER))
    assert admin.patch(f"/api/v1/billing/keys/{members_key.pk}/", {"spend_cap": "1.00"}, format="json").status_code == 200
    assert admin.patch(f"/api/v1/billing/keys/{_key_of(admin).pk}/", {"spend_cap": "2.00"},
                       format="json").status_code == 200


def test_an_admin_cannot_lift_a_cap_an_owner_put_on_their_key(owner_client, member_client_factory):
    """Before, an admin removed (or raised) the cap an owner had put on the admin's own key."""
    admin = member_client_factory(owner_client.organization, Role.ADMIN)
    admins_key = _key_of(admin)
    assert owner_client.patch(f"/api/v1/billing/keys/{admins_key.pk}/", {"spend_cap": "5.00"},
                              format="json").status_code == 200
    for cap in (None, "5.01", "100.00"):
        refused = admin.patch(f"/api/v1/billing/keys/{admins_key.pk}/", {"spend_cap": cap}, format="json")
        assert refused.status_code == 403 and "only owners may raise or remove" in refused.json()["detail"]
    assert ApiKeySpendCap.objects.get(api_key=admins_key).spend_cap == Decimal("5.00")
    # Lowering it is no escalation; the owner may lift it.
    assert admin.patch(f"/api/v1/billing/keys/{admins_key.pk}/", {"spend_cap": "3.00"}, format="json").status_code == 200
    assert owner_client.patch(f"/api/v1/billing/keys/{admins_key.pk}/", {"spend_cap": None},
                              format="json").status_code == 200
    assert not ApiKeySpendCap.objects.filter(api_key=admins_key).exists()


def test_a_capped_key_sets_no_cap_above_its_own(owner_client):
    own_key = _key_of(owner_client)
    assert owner_client.patch(f"/api/v1/billing/keys/{own_key.pk}/", {"spend_cap": "5.00"}, format="json").status_code == 200
    for cap in (None, "6.00"):
        refused = owner_client.patch(f"/api/v1/billing/keys/{own_key.pk}/", {"spend_cap": cap}, format="json")
        assert refused.status_code == 403 and "capped at 5.00" in refused.json()["detail"]
    assert ApiKeySpendCap.objects.get(api_key=own_key).spend_cap == Decimal("5.00")


def test_an_admin_who_lowers_an_owners_cap_still_cannot_lift_it(owner_client, member_client_factory):
    """Before, lowering made the admin the cap's setter (`set_by`): the admin lowered the owner's $5.00 to $4.99
    (200), then removed it (200)."""
    admin = member_client_factory(owner_client.organization, Role.ADMIN)
    admins_key = _key_of(admin)
    url = f"/api/v1/billing/keys/{admins_key.pk}/"
    assert owner_client.patch(url, {"spend_cap": "5.00"}, format="json").status_code == 200
    signed_in = APIClient()  # a session: no key's own cap stands in the way, only the owner's
    signed_in.force_login(admin.user)
    assert signed_in.patch(url, {"spend_cap": "4.99"}, format="json").status_code == 200
    for cap in (None, "5.00"):
        refused = signed_in.patch(url, {"spend_cap": cap}, format="json")
        assert refused.status_code == 403 and "only owners may raise or remove" in refused.json()["detail"]
    assert ApiKeySpendCap.objects.get(api_key=admins_key).spend_cap == Decimal("4.99")
    assert owner_client.patch(url, {"spend_cap": None}, format="json").status_code == 200
