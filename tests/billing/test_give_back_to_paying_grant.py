"""A cheaper supersede's overcharge, drawn from prepaid credit, goes back to the grant that paid for the superseded
row (`billing.models.credit_draw`, `billing.models.credit_returns`). Found by the rv2money review: before, it went to
the soonest-expiring active grant that had consumed anything, whoever paid: credit bought, never expiring, came back
as a promo grant's, which then expired unused (the customer lost the overcharge). The rv3 review: the draw netted a
cheaper supersede with new usage in one window (the give-back never ran), and gave back to a grant usage it had drawn
as nothing (credit from nothing)."""

import dataclasses
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing import credits, ledger
from billing.models import BillingAccount, BillingMode, CreditGrant
from billing.quota.rebuild import credit_available
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


def test_netted_window_gives_the_overcharge_to_the_promo_not_the_bought_grant():
    """A supersede cheaper and a new call in one draw window: the amount nets to > 0, the overcharge is never given
    back to the bought grant that paid it; the promo grant pays that much less and expires with it unused."""
    endpoint = _prepaid_endpoint()
    org = endpoint.organization
    now = timezone.now()
    credits.grant_credits(SYSTEM, org, amount=Decimal("2.00"), granted_at=now - timedelta(hours=3), note="bought")
    lost = _lost_row_drawn(endpoint, now - timedelta(hours=2))
    credits.grant_credits(SYSTEM, org, amount=Decimal("1.00"), granted_at=now - timedelta(hours=1),
                          expires_at=now + timedelta(days=1), note="promo")
    # Same as the merged test, but the new call and the supersede land before the same draw.
    ledger.record_usage(usage_report(endpoint, request_id="y", prompt_tokens=0, completion_tokens=100_000,
                                     finished_at=now - timedelta(minutes=5)))
    _superseded_cheaper(lost)
    credits.draw_credits(org.pk)
    # Drawn one by one (the merged test) this ends as bought 0.052, promo 0.2.
    assert _consumed() == {"bought": Decimal("0.052"), "promo": Decimal("0.2")}


def test_give_back_to_an_exhausted_grant_returns_credit_drawn_as_nothing():
    """The lost row ($0.14) drawn from a $0.10 grant: $0.04 drawn as nothing. Its call really cost $0.052: the grant
    should have paid $0.052 (consumed 0.052). The give-back returns the whole $0.088 to it: consumed 0.012, $0.04 of
    credit that nobody paid for."""
    endpoint = _prepaid_endpoint()
    org = endpoint.organization
    now = timezone.now()
    credits.grant_credits(SYSTEM, org, amount=Decimal("0.10"), granted_at=now - timedelta(hours=3), note="small")
    lost = _lost_row_drawn(endpoint, now - timedelta(hours=2))
    assert _consumed() == {"small": Decimal("0.10")}
    _superseded_cheaper(lost)
    credits.draw_credits(org.pk)
    assert _consumed() == {"small": Decimal("0.052")}


def test_netted_window_moves_an_expired_grants_overcharge_into_bought_credit():
    """The merged test's second case with the new call and the supersede before one draw: the overcharge the expired
    grant paid stays on it, and the bought grant pays $0.088 less for the new call: non-expiring credit made from
    credit that had expired."""
    endpoint = _prepaid_endpoint()
    org = endpoint.organization
    now = timezone.now()
    credits.grant_credits(SYSTEM, org, amount=Decimal("1.00"), granted_at=now - timedelta(hours=4),
                          expires_at=now - timedelta(hours=1), note="expired")
    lost = _lost_row_drawn(endpoint, now - timedelta(hours=2))
    credits.grant_credits(SYSTEM, org, amount=Decimal("2.00"), granted_at=now - timedelta(minutes=30), note="bought")
    ledger.record_usage(usage_report(endpoint, request_id="y", prompt_tokens=0, completion_tokens=100_000,
                                     finished_at=now - timedelta(minutes=5)))
    _superseded_cheaper(lost)
    before = credit_available(org.pk)[0]
    credits.draw_credits(org.pk)
    assert _consumed() == {"expired": Decimal("0.052"), "bought": Decimal("0.2")}
    # The credit left read before the draw counts it as the draw does: the expired grant's give-back is not credit.
    assert credit_available(org.pk)[0] == before == Decimal("1.8")


def test_a_netted_windows_draw_runs_once_and_the_credit_left_read_before_it_is_what_it_leaves():
    """The netted window's draw, run again, finds nothing; the credit left read before it (`quota.rebuild`) counts the
    overcharge given back to the bought grant and the new call drawn from the promo as the draw then does."""
    endpoint = _prepaid_endpoint()
    org = endpoint.organization
    now = timezone.now()
    credits.grant_credits(SYSTEM, org, amount=Decimal("2.00"), granted_at=now - timedelta(hours=3), note="bought")
    lost = _lost_row_drawn(endpoint, now - timedelta(hours=2))
    credits.grant_credits(SYSTEM, org, amount=Decimal("1.00"), granted_at=now - timedelta(hours=1),
                          expires_at=now + timedelta(days=1), note="promo")
    ledger.record_usage(usage_report(endpoint, request_id="y", prompt_tokens=0, completion_tokens=100_000,
                                     finished_at=now - timedelta(minutes=5)))
    _superseded_cheaper(lost)
    before = credit_available(org.pk)[0]

    assert credits.draw_credits(org.pk) == Decimal("0.2") - Decimal("0.088")
    assert credit_available(org.pk)[0] == before == Decimal("3.00") - Decimal("0.052") - Decimal("0.2")
    assert credits.draw_credits(org.pk) == 0
    assert _consumed() == {"bought": Decimal("0.052"), "promo": Decimal("0.2")}
    account = BillingAccount.objects.get(organization=org)
    assert (account.credit_drawn, account.credit_given_back, account.credit_unpaid) == (
        Decimal("0.252"), Decimal("0.088"), Decimal(0))


def test_usage_drawn_as_nothing_takes_the_overcharge_of_a_later_cheaper_supersede_first():
    """$0.04 of the lost row drawn as nothing is kept (`credit_unpaid`), and the supersede's $0.088 offsets it first:
    what goes back to the grant is $0.048, what it paid beyond the call's real cost; none is left unpaid after."""
    endpoint = _prepaid_endpoint()
    org = endpoint.organization
    now = timezone.now()
    credits.grant_credits(SYSTEM, org, amount=Decimal("0.10"), granted_at=now - timedelta(hours=3), note="small")
    lost = _lost_row_drawn(endpoint, now - timedelta(hours=2))
    assert BillingAccount.objects.get(organization=org).credit_unpaid == Decimal("0.04")
    _superseded_cheaper(lost)
    assert credits.draw_credits(org.pk) == Decimal("-0.048")
    assert credits.draw_credits(org.pk) == 0
    account = BillingAccount.objects.get(organization=org)
    assert (account.credit_drawn, account.credit_unpaid, account.credit_given_back) == (
        Decimal("0.052"), Decimal(0), Decimal("0.088"))
    assert _consumed() == {"small": Decimal("0.052")}


def test_an_account_drawn_before_the_overcharges_were_kept_apart_nets_them_once_as_before():
    """`credit_given_back` null (drawn by code from before billing/0037): the first draw gives back only what the ledger
    holds less than was drawn, then keeps the figure; an overcharge already netted is not given back again."""
    endpoint = _prepaid_endpoint()
    org = endpoint.organization
    now = timezone.now()
    credits.grant_credits(SYSTEM, org, amount=Decimal("2.00"), granted_at=now - timedelta(hours=3), note="bought")
    lost = _lost_row_drawn(endpoint, now - timedelta(hours=2))
    _superseded_cheaper(lost)
    BillingAccount.objects.filter(organization=org).update(credit_given_back=None, credit_drawn=Decimal("0.052"))
    CreditGrant.objects.update(consumed=Decimal("0.052"))  # the old draw netted the overcharge away

    assert credits.draw_credits(org.pk) == 0
    assert BillingAccount.objects.get(organization=org).credit_given_back == Decimal("0.088")
    _new_usage_drawn(endpoint, now - timedelta(minutes=1))
    assert _consumed() == {"bought": Decimal("0.252")}


def test_an_account_that_gave_back_more_than_the_ledger_holds_still_draws_new_usage_whole():
    """`credit_given_back` above the ledger's overcharges (a superseded row removed from the ledger by hand): nothing is
    given back, and new usage is drawn whole, not short by the difference."""
    endpoint = _prepaid_endpoint()
    org = endpoint.organization
    now = timezone.now()
    credits.grant_credits(SYSTEM, org, amount=Decimal("2.00"), granted_at=now - timedelta(hours=3), note="bought")
    credits.draw_credits(org.pk)
    BillingAccount.objects.filter(organization=org).update(credit_given_back=Decimal("0.5"))
    _new_usage_drawn(endpoint, now - timedelta(minutes=1))
    assert _consumed() == {"bought": Decimal("0.2")}


def test_lost_row_and_its_cheaper_supersede_in_one_draw_window_charge_the_real_cost():
    """The rv5 review: the draw gave back before it drew, within what each grant had consumed (nothing yet), then drew
    the lost row's full $0.14 and counted the $0.088 as given back: the grant kept $0.14 for $0.052 of usage."""
    endpoint = _prepaid_endpoint()
    org = endpoint.organization
    now = timezone.now()
    credits.grant_credits(SYSTEM, org, amount=Decimal("2.00"), granted_at=now - timedelta(hours=3), note="bought")
    credits.draw_credits(org.pk)  # an account drawn before, nothing consumed yet
    lost = usage_report(endpoint, request_id="x", prompt_tokens=100_000, completion_tokens=20_000,
                        status="gateway_lost", finished_at=now - timedelta(minutes=10))
    ledger.record_usage(lost)  # $0.14
    _superseded_cheaper(lost)  # really $0.052, before the next draw
    assert credit_available(org.pk)[0] == Decimal("1.948")
    assert credits.draw_credits(org.pk) == Decimal("0.052")
    assert _consumed() == {"bought": Decimal("0.052")}
    account = BillingAccount.objects.get(organization=org)
    assert ledger.undrawn_prepaid_spend(account) == 0
    assert account.credit_unpaid == 0
    assert credit_available(org.pk)[0] == Decimal("1.948")
    assert credits.draw_credits(org.pk) == 0  # once
    assert _consumed() == {"bought": Decimal("0.052")}


def test_lost_row_and_its_supersede_in_one_window_give_back_to_the_grant_that_took_it_not_the_promo():
    """Both grants already hold consumption; the lost row, drawn in the same window as its cheaper supersede, is taken
    by the promo (soonest expiry first), and its overcharge must go back to the promo, not to the bought grant."""
    endpoint = _prepaid_endpoint()
    org = endpoint.organization
    now = timezone.now()
    credits.grant_credits(SYSTEM, org, amount=Decimal("2.00"), granted_at=now - timedelta(hours=3), note="bought")
    _new_usage_drawn(endpoint, now - timedelta(hours=2))  # $0.20 from the bought grant
    credits.grant_credits(SYSTEM, org, amount=Decimal("1.00"), granted_at=now - timedelta(hours=1),
                          expires_at=now + timedelta(days=1), note="promo")
    ledger.record_usage(usage_report(endpoint, request_id="z", prompt_tokens=0, completion_tokens=50_000,
                                     finished_at=now - timedelta(minutes=30)))
    credits.draw_credits(org.pk)  # $0.10 from the promo
    assert _consumed() == {"bought": Decimal("0.2"), "promo": Decimal("0.1")}
    lost = usage_report(endpoint, request_id="x", prompt_tokens=100_000, completion_tokens=20_000,
                        status="gateway_lost", finished_at=now - timedelta(minutes=10))
    ledger.record_usage(lost)
    _superseded_cheaper(lost)
    assert credit_available(org.pk)[0] == Decimal("2.648")
    assert credits.draw_credits(org.pk) == Decimal("0.052")
    assert _consumed() == {"bought": Decimal("0.2"), "promo": Decimal("0.152")}
    assert credit_available(org.pk)[0] == Decimal("2.648")
    assert credits.draw_credits(org.pk) == 0
    assert _consumed() == {"bought": Decimal("0.2"), "promo": Decimal("0.152")}
