"""A cheaper supersede's overcharge, drawn from prepaid credit, goes back to the grant that paid for the superseded
row (`billing.credits._give_back`, `billing.models.credit_returns`). Found by the rv2money review: before, it went to
the soonest-expiring active grant that had consumed anything, whoever paid: credit bought, never expiring, came back
as a promo grant's, which then expired unused (the customer lost the overcharge)."""

import dataclasses
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing import credits, ledger
from billing.models import BillingAccount, BillingMode, CreditGrant
from billing.services import set_billing_mode
from controlplane.accounts.services import SYSTEM
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _prepaid_endpoint():
    endpoint = EndpointFactory(price_input_per_million=Decimal("1"), price_cached_input_per_million=Decimal("0.1"),
                               price_output_per_million=Decimal("2"))
    set_billing_mode(SYSTEM, endpoint.organization, mode=BillingMode.PREPAID)
    return endpoint


def _lost_row_drawn(endpoint, finished_at):
    """A lost row (its progress: 100k uncached prompt tokens, 20k out: $0.14), drawn."""
    lost = usage_report(endpoint, request_id="x", prompt_tokens=100_000, completion_tokens=20_000,
                        status="gateway_lost", finished_at=finished_at)
    ledger.record_usage(lost)
    credits.draw_credits(endpoint.organization_id)
    return lost


def _new_usage_drawn(endpoint, finished_at):
    """Another call ($0.20: 100k output tokens), drawn."""
    ledger.record_usage(usage_report(endpoint, request_id="y", prompt_tokens=0, completion_tokens=100_000,
                                     finished_at=finished_at))
    credits.draw_credits(endpoint.organization_id)


def _superseded_cheaper(lost):
    """The call's own row: the prompt all cache hits, $0.052, $0.088 less than the lost row."""
    ledger.supersede_lost_rows([dataclasses.replace(lost, status="ok", cached_tokens=100_000,
                                                    completion_tokens=21_000)])


def _consumed():
    return {grant.note: grant.consumed for grant in CreditGrant.objects.all()}


def test_the_overcharge_goes_back_to_the_bought_grant_that_paid_not_to_a_later_promo():
    endpoint = _prepaid_endpoint()
    org = endpoint.organization
    now = timezone.now()
    credits.grant_credits(SYSTEM, org, amount=Decimal("2.00"), granted_at=now - timedelta(hours=3), note="bought")
    lost = _lost_row_drawn(endpoint, now - timedelta(hours=2))
    assert _consumed() == {"bought": Decimal("0.14")}
    # A promo grant arrives later, expiring tomorrow; new usage ($0.20) is drawn from it (soonest expiry first).
    credits.grant_credits(SYSTEM, org, amount=Decimal("1.00"), granted_at=now - timedelta(hours=1),
                          expires_at=now + timedelta(days=1), note="promo")
    _new_usage_drawn(endpoint, now - timedelta(minutes=5))
    assert _consumed() == {"bought": Decimal("0.14"), "promo": Decimal("0.2")}

    _superseded_cheaper(lost)
    assert credits.draw_credits(org.pk) == Decimal("-0.088")
    assert _consumed() == {"bought": Decimal("0.052"), "promo": Decimal("0.2")}
    assert credits.draw_credits(org.pk) == 0  # once
    assert _consumed() == {"bought": Decimal("0.052"), "promo": Decimal("0.2")}
    assert ledger.undrawn_prepaid_spend(BillingAccount.objects.get(organization=org)) == 0


def test_an_overcharge_paid_by_a_grant_expired_since_goes_back_to_it_not_to_another_grant():
    endpoint = _prepaid_endpoint()
    org = endpoint.organization
    now = timezone.now()
    credits.grant_credits(SYSTEM, org, amount=Decimal("1.00"), granted_at=now - timedelta(hours=4),
                          expires_at=now - timedelta(hours=1), note="expired")
    lost = _lost_row_drawn(endpoint, now - timedelta(hours=2))
    credits.grant_credits(SYSTEM, org, amount=Decimal("2.00"), granted_at=now - timedelta(minutes=30), note="bought")
    _new_usage_drawn(endpoint, now - timedelta(minutes=5))
    assert _consumed() == {"expired": Decimal("0.14"), "bought": Decimal("0.2")}

    _superseded_cheaper(lost)
    assert credits.draw_credits(org.pk) == Decimal("-0.088")
    # Priced right from the start, the expired grant would have had $0.088 more left, which expired with it.
    assert _consumed() == {"expired": Decimal("0.052"), "bought": Decimal("0.2")}
    account = BillingAccount.objects.get(organization=org)
    assert ledger.undrawn_prepaid_spend(account) == 0
    assert credits.draw_credits(org.pk) == 0
