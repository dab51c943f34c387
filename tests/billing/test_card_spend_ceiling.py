"""The spending ceiling is the card's, not the organisation's (`billing.standing.card_sharers`): organisations whose
card has one Stripe fingerprint share one ceiling, their paid history summed and their month's spend too.

Before, it was each organisation's: a thief with one stolen card signed up N organisations, attached the card to each,
and had N x $100 a month; paying each first invoice with it climbed them all. Reserved as the gateway does, in its
admission script, as `tests/billing/test_spend_ceiling.py` does."""

from decimal import Decimal

import pytest

from billing import services, standing, stripe_sync, tasks
from billing.models import BillingAccount
from controlplane.accounts.models import Role
from tests.billing.test_payment_standing import _refusal, _spend, _webhook
from tests.billing.test_spend_ceiling import DEFAULT, _ceilings, _usage
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory

# NOTE: admission rebuilds counters in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)


class _Org:
    def __init__(self, fake_stripe, name: str):
        self.stripe = fake_stripe
        self.org = OrganizationFactory(name=name)
        MembershipFactory(organization=self.org, user=UserFactory(), role=Role.OWNER)
        self.customer = stripe_sync.ensure_customer(self.org.pk)

    def add_card(self, fingerprint: str) -> None:
        """The card added in the Customer Portal, and its webhook."""
        method = self.stripe.add_card(fingerprint=fingerprint)
        _webhook("customer.updated", self.stripe.set_default_payment_method(self.customer, method))

    def pay(self, invoice_id: str, cents: int) -> None:
        _webhook("invoice.paid", {"id": invoice_id, "object": "invoice", "customer": self.customer, "status": "paid",
                                  "currency": "usd", "amount_due": cents, "amount_paid": cents,
                                  "lines": {"object": "list", "data": []}})

    def ceiling(self) -> standing.SpendCeiling:
        return standing.spend_ceiling(BillingAccount.objects.get(organization=self.org))


@pytest.fixture
def one_card(settings, fake_stripe, monkeypatch):
    """The documented default ceilings, and two postpaid organisations with the same card (one fingerprint)."""
    settings.SPEND_CEILINGS = _ceilings(DEFAULT, monkeypatch)
    first, second = _Org(fake_stripe, "First Sign-up Ltd"), _Org(fake_stripe, "Second Sign-up Ltd")
    first.add_card("fp_stolen")
    second.add_card("fp_stolen")
    return first, second


def test_two_organisations_on_one_card_share_one_ceiling_and_another_card_keeps_its_own(one_card, fake_stripe):
    first, second = one_card
    other = _Org(fake_stripe, "Other Card Ltd")
    other.add_card("fp_other")
    _spend(second.org, "1.00")  # its counter exists, with the ceiling as it was
    _usage(first.org, "100")  # the first spent the card's $100
    assert tasks.refresh_card_ceilings() == 2  # the beat task writes the shared limits again (not the other card)
    refused = _refusal(second.org, "1.00")
    assert refused.reason == "spend_ceiling"  # before: the second had $100 of its own
    shown = second.ceiling()
    assert (shown.amount, shown.room, shown.num_other_organizations_on_card) == (Decimal(100), Decimal(0), 1)
    _spend(other.org, "99.00")  # another card: its own $100
    assert other.ceiling().num_other_organizations_on_card == 0


def test_what_a_cards_organisations_paid_is_summed_and_raises_the_cards_ceiling_at_once(one_card):
    first, second = one_card
    _spend(second.org, "1.00")
    second.pay("in_second", 2000)  # $20: neither alone reaches the $50 step
    first.pay("in_first", 3000)  # $50 paid with the card: $500 a month for the card, written at once for both
    assert (first.ceiling().paid, first.ceiling().amount) == (Decimal(50), Decimal(500))
    _spend(second.org, "150.00")  # the first's payment wrote the second's limits too; before: refused at its $100
    _usage(first.org, "300")
    services.refresh_shared_card_ceilings()
    assert _refusal(second.org, "60.00").reason == "spend_ceiling"  # $300 + $151 + $60 is past the card's $500


def test_the_alerts_count_the_cards_spend_against_the_cards_ceiling_and_warn_once_as_the_others_spend(one_card):
    """Not the organisation's own room, which moves as the others spend: each value of it warned again."""
    from billing.alerts import check_spend_alerts

    first, second = one_card
    _usage(first.org, "60")
    assert check_spend_alerts(first.org.pk) == [50]
    _usage(second.org, "10")  # the card's $70 of $100; the first's room $90, of which it spent 67 %
    assert check_spend_alerts(first.org.pk) == []
    _usage(second.org, "15")  # $85
    assert check_spend_alerts(first.org.pk) == [80]


def test_an_organisation_whose_card_changes_leaves_the_old_cards_ceiling_and_removing_it_leaves_none(one_card):
    first, second = one_card
    _usage(first.org, "100")
    services.refresh_shared_card_ceilings()
    assert _refusal(second.org, "1.00").reason == "spend_ceiling"
    second.add_card("fp_own_card")  # a card of another number: its own ceiling, at once
    _spend(second.org, "50.00")
    assert first.ceiling().num_other_organizations_on_card == 0 == second.ceiling().num_other_organizations_on_card

    first.add_card("fp_own_card")  # the first joins it, then removes its card: it stays with the card it last had
    _webhook("customer.updated", first.stripe.set_default_payment_method(first.customer, None))
    account = BillingAccount.objects.get(organization=first.org)
    assert (account.payment_method_on_file, account.card_fingerprint) == (False, "fp_own_card")
    assert second.ceiling().num_other_organizations_on_card == 1 and second.ceiling().room == Decimal(0)
    assert _refusal(second.org, "1.00").reason == "spend_ceiling"  # the joining wrote the second's limits at once


def test_a_tenants_standing_counts_the_other_organisations_on_its_card_and_never_names_them(
        one_card, member_client_factory):
    first, second = one_card
    client = member_client_factory(second.org, Role.ADMIN)
    response = client.get("/api/v1/billing/")
    assert response.json()["standing"]["spend_ceiling"]["num_other_organizations_on_card"] == 1
    from django.test import Client

    from controlplane.accounts.tenancy import SESSION_KEY
    console = Client()
    console.force_login(client.user)
    session = console.session
    session[SESSION_KEY] = second.org.pk
    session.save()
    page = console.get("/console/billing/").content.decode()
    assert "Your card is on file for 1 other organisation too" in page
    for shown in (response.content.decode(), page):
        for name in (first.org.name, first.org.slug, first.customer):
            assert name not in shown

    # Staff see the card in the Django admin, and find its organisations by it.
    from django.contrib.auth import get_user_model

    from tests.factories import sign_in_staff
    staff = get_user_model().objects.create_superuser("ops@example.test", "ops@example.test", "a long passphrase")
    admin = Client()
    sign_in_staff(admin, staff)
    account = BillingAccount.objects.get(organization=second.org)
    shown = admin.get(f"/django-admin/billing/billingaccount/{account.pk}/change/").content.decode()
    assert "fp_stolen" in shown and "with the 1 other organisation(s) on its card" in shown
    found = admin.get("/django-admin/billing/billingaccount/", {"q": "fp_stolen"}).content.decode()
    assert first.org.slug in found and second.org.slug in found


def test_the_cards_fingerprint_is_read_from_a_payment_method_or_an_older_default_source():
    def customer(method=None, source=None):
        return {"object": "customer", "invoice_settings": {"default_payment_method": method}, "default_source": source}

    assert standing.card_fingerprint(customer({"type": "card", "card": {"fingerprint": "fp_pm"}})) == "fp_pm"
    assert standing.card_fingerprint(customer({"type": "sepa_debit", "sepa_debit": {"fingerprint": "x"}})) == ""
    assert standing.card_fingerprint(customer(source={"object": "card", "fingerprint": "fp_card"})) == "fp_card"
    assert standing.card_fingerprint(customer(source={"object": "source", "type": "card",
                                                      "card": {"fingerprint": "fp_src"}})) == "fp_src"
    assert standing.card_fingerprint(customer(source={"object": "bank_account", "fingerprint": "fp_bank"})) == ""
    assert standing.card_fingerprint(customer()) == ""


def test_the_backfill_reads_the_cards_of_customers_read_before_fingerprints_were_kept_past_one_that_fails(one_card):
    """Before `billing/0034` no fingerprint was kept: without the backfill, those organisations shared nothing until
    their card was read again."""
    from io import StringIO

    from django.core.management import CommandError, call_command

    first, second = one_card
    third = _Org(first.stripe, "Third Sign-up Ltd")
    third.add_card("fp_stolen")
    BillingAccount.objects.update(card_fingerprint="")  # as the upgrade leaves them
    first.stripe.fail_next("500", times=stripe_sync.MAX_ATTEMPTS, path=f"/v1/customers/{third.customer}", method="GET")
    with pytest.raises(CommandError, match=third.customer):
        call_command("backfill_card_fingerprints", stdout=StringIO())
    assert second.ceiling().num_other_organizations_on_card == 1  # the two it read share the card again
    call_command("backfill_card_fingerprints", stdout=StringIO())  # run again: the one that failed
    assert second.ceiling().num_other_organizations_on_card == 2
