"""The credit left at a close, at its edges (`billing.credits`, `endpoints.closing.credit_refusal`), found by the
rvclosebill review:

- support's "End the selected grants" (`credits.end_refunded_grants`) stated, and audited, what a grant held as drawn
  so far: usage already in the ledger but not yet drawn (the draw runs each minute after the rollups, later with the
  worker behind) was then drawn from the grant just ended, as usage begun before its end is. Support refunded the whole
  figure in Stripe, and the customer had that usage for nothing. Now the grants' organisations are drawn first.
- a grant that starts later (`granted_at` ahead: the admin takes one) was no credit "left": a close went through with
  purchased credit still to come (the customer's money, kept by nobody), and a promotional one was not forfeited.
- a grant made to an organisation closed already, or while its close was running (the close's credit check holds the
  organisation's row, the grant took none), left purchased credit on a closed organisation that nothing refunds.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest

from billing import credits, ledger
from billing.admin import CreditGrantForm
from billing.models import BillingMode, CreditGrant, CreditKind
from billing.services import set_billing_mode
from controlplane.accounts.models import Organization, Role
from controlplane.accounts.services import SYSTEM, Actor, OrganizationClosed
from controlplane.clock import database_now
from endpoints import closing
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory, UserFactory

pytestmark = pytest.mark.django_db


def _owner(organization):
    owner = UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    return owner


def test_ending_refunded_grants_states_what_they_hold_after_the_usage_already_recorded():
    endpoint = EndpointFactory(price_input_per_million=Decimal("1"), price_output_per_million=Decimal("2"))
    organization = endpoint.organization
    set_billing_mode(SYSTEM, organization, mode=BillingMode.PREPAID)
    now = database_now()
    grant = credits.grant_credits(SYSTEM, organization, amount=Decimal("2.00"), granted_at=now - timedelta(hours=3))
    # $0.14 of usage in the ledger, not drawn yet (the draw runs after the rollups)
    ledger.record_usage(usage_report(endpoint, prompt_tokens=100_000, completion_tokens=20_000,
                                     finished_at=now - timedelta(minutes=5)))

    ended = credits.end_refunded_grants(SYSTEM, [grant])

    credits.draw_credits(organization.pk)  # what the next draw takes, of usage begun before the end
    grant.refresh_from_db()
    assert grant.consumed == Decimal("0.14")
    assert ended == grant.amount - grant.consumed == Decimal("1.86")  # refunded once: what the customer did not use


def test_a_purchased_grant_that_starts_later_holds_the_close():
    organization = OrganizationFactory()
    owner = _owner(organization)
    credits.grant_credits(SYSTEM, organization, amount=Decimal("30.00"), granted_at=database_now() + timedelta(days=1))

    assert credits.remaining_credit(organization.pk).purchased == Decimal("30.00")
    with pytest.raises(closing.Refused, match="30.00 USD of purchased credit"):
        closing.close_organization(Actor(user=owner), organization, confirm_name=organization.name,
                                   forfeit_promotional_credit=True)
    assert Organization.objects.get(pk=organization.pk).closed_at is None


def test_a_promotional_grant_that_starts_later_is_forfeited_with_the_rest():
    organization = OrganizationFactory()
    owner = _owner(organization)
    later = credits.grant_credits(SYSTEM, organization, amount=Decimal("9.00"), kind=CreditKind.PROMOTIONAL,
                                  granted_at=database_now() + timedelta(days=1))

    with pytest.raises(closing.Refused, match="9.00 USD of promotional credit"):
        closing.close_organization(Actor(user=owner), organization, confirm_name=organization.name)
    closing.close_organization(Actor(user=owner), organization, confirm_name=organization.name,
                               forfeit_promotional_credit=True)

    later.refresh_from_db()
    assert later.expires_at is not None
    assert not CreditGrant.objects.filter(pk=later.pk).active(database_now() + timedelta(days=2)).exists()
    assert credits.remaining_credit(organization.pk, now=database_now() + timedelta(days=2)).promotional == 0


def test_no_credit_is_granted_to_a_closed_organisation():
    organization = OrganizationFactory()
    owner = _owner(organization)
    closing.close_organization(Actor(user=owner), organization, confirm_name=organization.name)

    with pytest.raises(OrganizationClosed):
        credits.grant_credits(SYSTEM, organization, amount=Decimal("5.00"))
    assert not CreditGrant.objects.filter(organization=organization).exists()
    form = CreditGrantForm(data={"organization": organization.pk, "amount": "5.00", "kind": CreditKind.PURCHASED})
    assert not form.is_valid()
    assert "closed" in str(form.errors)
