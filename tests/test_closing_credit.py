"""A close and the credit left (`endpoints.closing.credit_refusal`, `billing.credits`): purchased credit is the
customer's money, so a close is refused while any remains, naming the amount and pointing at support, who refund it and
end its grants (`billing.credits.end_refunded_grants`, an admin action); promotional credit ends with the organisation,
but only once the owner acknowledges, with its amount stated, that it is forfeited.

Before: a close said nothing of credit, took none of it into account, and left every grant as it was: purchased credit
was silently kept by the platform, and nobody was told."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.test import Client

from billing import credits
from billing.models import CreditGrant, CreditKind
from controlplane.accounts.models import AuditEvent, Organization, Role
from controlplane.accounts.services import SYSTEM, Actor
from endpoints import closing
from tests.factories import OrganizationFactory
from tests.test_closing import CLOSE, DELETE_ACCOUNT, PASSWORD, _member, _signed_in

pytestmark = pytest.mark.django_db


def _closed(organization) -> bool:
    return Organization.objects.get(pk=organization.pk).closed_at is not None


def test_a_close_is_refused_while_purchased_credit_remains_until_support_refunds_it():
    org = OrganizationFactory(name="Acme")
    owner = _member(org, Role.OWNER)
    grant = credits.grant_credits(SYSTEM, org, amount=Decimal("40.00"), kind=CreditKind.PURCHASED)

    response = _signed_in(owner, org).post(CLOSE, {"confirm_name": "Acme", "forfeit_promotional_credit": True},
                                           format="json")

    assert response.status_code == 400
    assert "40.00 USD of purchased credit" in response.json()["non_field_errors"][0]
    assert "support" in response.json()["non_field_errors"][0]
    assert not _closed(org)

    assert credits.end_refunded_grants(SYSTEM, [grant]) == Decimal("40.00")
    assert AuditEvent.objects.filter(organization=org, action="billing.credit_refunded").exists()
    assert _signed_in(owner, org).post(CLOSE, {"confirm_name": "Acme"}, format="json").status_code == 200
    assert _closed(org)


def test_promotional_credit_is_forfeited_only_once_the_owner_acknowledges_its_amount():
    org = OrganizationFactory(name="Acme")
    owner = _member(org, Role.OWNER)
    grant = credits.grant_credits(SYSTEM, org, amount=Decimal("25.00"), kind=CreditKind.PROMOTIONAL)

    refused = _signed_in(owner, org).post(CLOSE, {"confirm_name": "Acme"}, format="json")

    assert refused.status_code == 400
    assert "25.00 USD of promotional credit" in refused.json()["forfeit_promotional_credit"][0]
    assert not _closed(org)

    closed = _signed_in(owner, org).post(CLOSE, {"confirm_name": "Acme", "forfeit_promotional_credit": True},
                                         format="json")

    assert closed.status_code == 200
    org.refresh_from_db()
    grant.refresh_from_db()
    assert grant.expires_at == org.closed_at
    assert credits.remaining_credit(org.pk).promotional == 0
    event = AuditEvent.objects.get(organization=org, action="organization.close")
    assert event.details["promotional_credit_forfeited"] == "25.00"


def test_the_close_page_states_the_credit_left_and_asks_to_forfeit_the_promotional_part():
    org = OrganizationFactory(name="Acme")
    owner = _member(org, Role.OWNER)
    credits.grant_credits(SYSTEM, org, amount=Decimal("12.50"), kind=CreditKind.PURCHASED)
    credits.grant_credits(SYSTEM, org, amount=Decimal("3.00"), kind=CreditKind.PROMOTIONAL)
    client = Client()
    client.force_login(owner)
    session = client.session
    session["organization_id"] = org.pk
    session.save()

    page = client.get("/console/organization/close/").content.decode()

    assert "12.50 USD of purchased credit remains" in page and "contact support" in page
    assert 'name="forfeit_promotional_credit"' in page and "3.00 USD of promotional credit" in page


def test_deleting_the_account_of_the_only_owner_is_refused_while_purchased_credit_remains():
    org = OrganizationFactory()
    owner = _member(org, Role.OWNER)
    credits.grant_credits(SYSTEM, org, amount=Decimal("5.00"))  # a grant's kind is purchased unless staff say not

    response = _signed_in(owner, org).post(DELETE_ACCOUNT, {"password": PASSWORD}, format="json")

    assert response.status_code == 400
    assert "5.00 USD of purchased credit" in response.json()["non_field_errors"][0]
    assert not _closed(org)
    owner.refresh_from_db()
    assert owner.is_active


def test_a_grant_made_before_kinds_were_kept_counts_as_purchased():
    org = OrganizationFactory()
    owner = _member(org, Role.OWNER)
    CreditGrant.objects.create(organization=org, amount=Decimal("7.00"))
    assert credits.remaining_credit(org.pk).purchased == Decimal("7.00")
    with pytest.raises(closing.Refused):
        closing.close_organization(Actor(user=owner), org, confirm_name=org.name)
