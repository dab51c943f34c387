"""A postpaid organisation's spending ceiling (`billing.standing.spend_ceiling`): what it may spend a month is bounded
by what it has paid (`INFERPLANE_SPEND_CEILINGS`), whatever its own cap, and staff may set its own.

Before, an organisation with a card on file had no limit at all until 7 days after an invoice failed: a stolen or
empty card added, the cap removed, ran our GPUs for a month and the grace period. Reserved as the gateway does, in
its admission script (`tests/billing/test_quota.py`); through a real gateway in `tests/gateway/test_spend_caps.py`."""

import os
import subprocess
import sys
import time
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model

from billing import services, standing, stripe_sync
from billing.models import BillingAccount, BillingMode, Dispute
from controlplane.accounts.models import AuditEvent, Role
from controlplane.accounts.services import SYSTEM
from controlplane.env import ImproperlyConfiguredEnv, env_spend_ceilings
from tests.billing.test_payment_standing import _refusal, _spend, _webhook
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, sign_in_staff

# NOTE: admission rebuilds counters in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

DEFAULT = "0:100,50:500,500:5000,5000:none"


def _ceilings(value: str, monkeypatch) -> tuple:
    """`value` read as the setting is at startup (its variable unset, so the value is the default)."""
    monkeypatch.delenv("INFERPLANE_SPEND_CEILINGS", raising=False)
    return env_spend_ceilings("INFERPLANE_SPEND_CEILINGS", value)


@pytest.fixture
def carded(settings, fake_stripe, monkeypatch):
    """Stripe configured (the fake), the documented default ceilings, and a postpaid organisation with an owner, a
    Stripe customer, a card on file and no cap of its own."""
    settings.SPEND_CEILINGS = _ceilings(DEFAULT, monkeypatch)
    organization = OrganizationFactory()
    MembershipFactory(organization=organization, user=UserFactory(email="owner@example.com"), role=Role.OWNER)
    customer_id = stripe_sync.ensure_customer(organization.pk)
    _webhook("customer.updated", fake_stripe.set_default_payment_method(customer_id, "pm_card_visa"))
    assert BillingAccount.objects.get(organization=organization).spend_cap is None

    class Carded:
        org = organization
        customer = customer_id
        stripe = fake_stripe

    return Carded


def _paid(carded, invoice_id: str, cents: int) -> None:
    _webhook("invoice.paid", {"id": invoice_id, "object": "invoice", "customer": carded.customer, "status": "paid",
                              "currency": "usd", "amount_due": cents, "amount_paid": cents,
                              "lines": {"object": "list", "data": []}})


def test_an_organisation_with_a_card_and_no_cap_is_refused_past_100_and_each_paid_invoice_raises_it_at_once(carded):
    _spend(carded.org, "99.00")
    refused = _refusal(carded.org, "2.00")
    assert refused.reason == "spend_ceiling"
    assert "spending ceiling for its payment history" in refused.message and "contact support" in refused.message

    _paid(carded, "in_1", 3000)  # $30 paid: not yet $50
    assert _refusal(carded.org, "2.00").reason == "spend_ceiling"
    _paid(carded, "in_2", 2000)  # $50 in all: $500 a month, the webhook's review writes it to Redis at once
    _spend(carded.org, "400.00")
    assert _refusal(carded.org, "2.00").reason == "spend_ceiling"

    _paid(carded, "in_3", 500_000)  # $5,050 paid: no ceiling
    _spend(carded.org, "100000.00")
    assert standing.spend_ceiling(BillingAccount.objects.get(organization=carded.org)) == standing.SpendCeiling(
        None, standing.PAID_HISTORY, Decimal("5050"))


def test_its_own_lower_cap_still_names_the_refusal_and_the_ceiling_holds_over_a_higher_one(carded):
    services.set_spend_cap(SYSTEM, carded.org, spend_cap=Decimal("10.00"))
    _spend(carded.org, "9.00")
    assert _refusal(carded.org, "2.00").reason == "org_cap"
    services.set_spend_cap(SYSTEM, carded.org, spend_cap=Decimal("100000.00"))  # the owner raises its own cap
    _spend(carded.org, "90.00")
    assert _refusal(carded.org, "2.00").reason == "spend_ceiling"


def test_a_refund_or_a_payment_disputed_lowers_the_ceiling_the_money_had_raised(carded, monkeypatch):
    _paid(carded, "in_1", 5000)
    _spend(carded.org, "450.00")
    _webhook("charge.refunded", {"id": "ch_1", "object": "charge", "customer": carded.customer, "currency": "usd",
                                 "amount": 5000, "amount_refunded": 2000})
    assert standing.net_paid(carded.org.pk) == Decimal(30)  # $100 again
    assert _refusal(carded.org, "1.00").reason == "spend_ceiling"
    # An older event of the same charge, arriving late, changes nothing.
    _webhook("charge.refunded", {"id": "ch_1", "object": "charge", "customer": carded.customer, "currency": "usd",
                                 "amount": 5000, "amount_refunded": 1000}, created=int(time.time()) - 60)
    assert standing.net_paid(carded.org.pk) == Decimal(30)

    # A second payment, then a dispute of it lost and settled by staff: the bank took the money back.
    _paid(carded, "in_2", 4000)  # $70 net
    assert standing.spend_ceiling(BillingAccount.objects.get(organization=carded.org)).amount == Decimal(500)
    monkeypatch.setattr(stripe_sync, "charge_payer", lambda charge_id, attempts: (carded.customer, "in_2"))
    _webhook("charge.dispute.closed", {"id": "dp_1", "object": "dispute", "charge": "ch_2", "status": "lost",
                                       "amount": 4000, "currency": "usd", "reason": "fraudulent"})
    services.lift_dispute_hold(SYSTEM, Dispute.objects.get(stripe_dispute_id="dp_1"))
    assert standing.net_paid(carded.org.pk) == Decimal(30)  # $50 + $40 paid, $20 refunded, $40 taken back
    assert _refusal(carded.org, "1.00").reason == "spend_ceiling"


def test_staff_set_an_organisations_ceiling_in_the_admin_either_way_audited_and_seen_at_once(carded, client):
    staff = get_user_model().objects.create_superuser("ops@example.test", "ops@example.test", "a long passphrase")
    sign_in_staff(client, staff)
    account = BillingAccount.objects.get(organization=carded.org)
    url = f"/django-admin/billing/billingaccount/{account.pk}/change/"

    def change(ceiling: str):
        return client.post(url, {"mode": account.mode, "spend_cap": "", "spend_ceiling": ceiling})

    _spend(carded.org, "95.00")
    assert change("none").status_code == 302  # in the admin's transaction: the refresh runs once it commits
    _spend(carded.org, "10000.00")
    assert change("20").status_code == 302  # lowered below what it spent: refused at once
    assert _refusal(carded.org, "0.01").reason == "spend_ceiling_staff"
    shown = standing.spend_ceiling(BillingAccount.objects.get(organization=carded.org))
    assert (shown.amount, shown.source) == (Decimal(20), standing.STAFF)
    assert change("").status_code == 302  # its paid history's again
    assert standing.spend_ceiling(BillingAccount.objects.get(organization=carded.org)).source == standing.PAID_HISTORY

    refused = change("-5")
    assert refused.status_code == 200 and b"Enter an amount from 0" in refused.content
    assert list(AuditEvent.objects.filter(action="billing.set_spend_ceiling").order_by("pk")
                .values_list("details__spend_ceiling", "details__previous")) == [
        ("none", None), ("20.00", "none"), (None, "20.00")]


def test_an_invoice_paid_whose_review_was_lost_raises_the_ceiling_at_the_beat_tasks_review(carded, monkeypatch):
    """The webhook marks the account `limits_stale` in its own transaction: a process killed before its review leaves
    the raise to the beat task, not to the next month."""
    _spend(carded.org, "99.00")
    monkeypatch.setattr(services, "review_payment_standing", lambda *args, **kwargs: None)  # killed after the commit
    _paid(carded, "in_1", 5000)
    assert _refusal(carded.org, "2.00").reason == "spend_ceiling"
    monkeypatch.undo()
    services.review_all_payment_standing()
    _spend(carded.org, "2.00")


def test_prepaid_and_invoiced_without_card_accounts_are_not_held_to_a_ceiling(carded, settings):
    services.set_invoiced_without_card(SYSTEM, carded.org, allowed=True)
    _spend(carded.org, "1000.00")
    assert standing.spend_ceiling(BillingAccount.objects.get(organization=carded.org)) is None

    other = OrganizationFactory()
    services.set_billing_mode(SYSTEM, other, mode=BillingMode.PREPAID)
    assert standing.spend_ceiling(BillingAccount.objects.get(organization=other)) is None
    assert standing.spend_limit(BillingAccount.objects.get(organization=other)).cap is None


def test_the_billing_api_shows_the_ceiling_what_it_is_from_and_the_next_step(carded, member_client_factory):
    client = member_client_factory(carded.org, Role.ADMIN)
    shown = client.get("/api/v1/billing/").json()["standing"]
    assert shown["spend_ceiling"] == {"amount": "100.00", "source": "paid_history", "net_paid": "0.00",
                                      "next_paid": "50.00", "next_amount": "500.00",
                                      "shared_with_other_organizations": False}
    assert (shown["effective_spend_cap"], shown["limit_reason"]) == ("100.00", "spend_ceiling")

    from django.test import Client

    from controlplane.accounts.tenancy import SESSION_KEY
    console = Client()
    console.force_login(client.user)
    session = console.session
    session[SESSION_KEY] = carded.org.pk
    session.save()
    page = console.get("/console/billing/").content.decode()
    assert 'data-testid="spend-ceiling"' in page and "$500.00 a month once $50.00 of invoices are paid" in page


@pytest.mark.parametrize("value", [
    "100",  # no paid total
    "10:100,50:500",  # not starting at 0
    "0:100,50:50",  # a ceiling lowered as the paid total rises
    "0:100,0:500",  # paid totals not rising
    "0:none,50:500",  # none before the last
    "0:abc", "0:-1", "0:nan", "0:100,,50:500",
])
def test_a_bad_spend_ceilings_value_is_refused_at_startup(value, monkeypatch):
    with pytest.raises(ImproperlyConfiguredEnv, match="INFERPLANE_SPEND_CEILINGS"):
        _ceilings(value, monkeypatch)


def test_the_default_spend_ceilings_are_the_documented_ones_and_a_bad_one_stops_django_from_starting(monkeypatch):
    from django.conf import settings

    assert settings.SPEND_CEILINGS == _ceilings(DEFAULT, monkeypatch) == (
        (Decimal(0), Decimal(100)), (Decimal(50), Decimal(500)), (Decimal(500), Decimal(5000)), (Decimal(5000), None))
    started = subprocess.run([sys.executable, "-c", "import django; django.setup()"], capture_output=True, text=True,
                             env=os.environ | {"INFERPLANE_SPEND_CEILINGS": "0:100,50:20"}, timeout=60)
    assert started.returncode != 0 and "INFERPLANE_SPEND_CEILINGS must not lower a ceiling" in started.stderr


def test_spend_alerts_warn_before_the_spending_ceiling_of_an_organisation_with_a_card(carded):
    """Before, an organisation with a card and no cap was looked at by no alert: it had nothing to reach."""
    from django.core import mail

    from billing.alerts import check_all_spend_alerts
    from billing.ledger import record_usage
    from tests.billing.conftest import usage_report
    from tests.factories import EndpointFactory

    endpoint = EndpointFactory(organization=carded.org, price_input_per_million=Decimal("100"),
                               price_output_per_million=Decimal("0"))
    record_usage(usage_report(endpoint, prompt_tokens=850_000, completion_tokens=0))  # $85 of the $100 ceiling

    assert check_all_spend_alerts() == 2  # 50 % and 80 %
    assert mail.outbox[-1].subject.endswith("used 80% of its monthly spending ceiling for its payment history")
    assert "rises as invoices are paid" in mail.outbox[-1].body and "$100.00 ceiling" in mail.outbox[-1].body


def test_the_alerts_beat_reads_postgresqls_clock_once_not_once_or_twice_per_organisation(carded):
    """The beat over every capped organisation picks "this month" once (`current_period`, a query to PostgreSQL's
    clock), and each organisation's spend, alerts and card's holders are read in that one month.

    Before: each organisation read the clock again (`check_spend_alerts` with no moment), and one with a card once
    more (`spend_ceiling`'s `card_spend` with no period): a query or two per organisation over thousands, and at a
    month's edge the card's holders of one month judged beside the spend of the next."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from billing.alerts import check_all_spend_alerts

    _usage(carded.org, "60.00")  # 60 % of the $100 ceiling
    for _ in range(3):
        organization = OrganizationFactory()
        MembershipFactory(organization=organization, role=Role.OWNER)
        services.set_spend_cap(SYSTEM, organization, spend_cap=Decimal("1"))
        _usage(organization, "0.60")

    with CaptureQueriesContext(connection) as queries:
        assert check_all_spend_alerts() == 4  # the 50 % alert of each
    assert sum("clock_timestamp()" in query["sql"] for query in queries.captured_queries) == 1


def test_spend_over_ceiling_reads_postgresqls_clock_once_and_the_cards_others_in_that_month(carded, capsys):
    """Before, each organisation with a card read the clock again (`card_spend` with no period): a query per
    organisation, and at a month's edge the room its card's others leave was of another month than its spend."""
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    _usage(carded.org, "100.00")  # at the $100 ceiling

    with CaptureQueriesContext(connection) as queries:
        call_command("spend_over_ceiling")
    assert "1 organisation(s) at or past their spending ceiling" in capsys.readouterr().out
    assert sum("clock_timestamp()" in query["sql"] for query in queries.captured_queries) == 1


def _usage(organization, dollars: str, *, finished_at=None) -> None:
    """A call of `dollars` recorded in the ledger (finished now, or at `finished_at`)."""
    from billing.ledger import record_usage
    from tests.billing.conftest import usage_report
    from tests.factories import EndpointFactory

    endpoint = EndpointFactory(organization=organization, price_input_per_million=Decimal("1"),
                               price_output_per_million=Decimal("0"))
    record_usage(usage_report(endpoint, prompt_tokens=int(Decimal(dollars) * 1_000_000), completion_tokens=0,
                              finished_at=finished_at))


def test_a_ceiling_staff_set_is_named_as_staffs_in_the_402_the_alerts_and_the_api(carded, member_client_factory):
    """Before, a staff ceiling's 402 (reason `spend_ceiling`) and email said it rises as invoices are paid: it never
    does, and a ceiling of 0 staff set to stop an organisation told it to pay its invoices."""
    from django.core import mail

    from billing.alerts import check_spend_alerts

    services.set_spend_ceiling(SYSTEM, carded.org, ceiling=Decimal("20"))
    _spend(carded.org, "19.00")
    refused = _refusal(carded.org, "2.00")
    assert refused.reason == "spend_ceiling_staff"
    assert "set for it by Inferplane staff" in refused.message and "Contact support" in refused.message
    assert "invoices are paid" not in refused.message and "payment history" not in refused.message

    _usage(carded.org, "17")  # 85 % of $20, and a call refused at it: reached (`billing.alerts`)
    assert check_spend_alerts(carded.org.pk) == [50, 80, 100]
    assert mail.outbox[-2].subject.endswith("used 80% of the monthly spending ceiling Inferplane staff set for it")
    assert "invoices are paid" not in mail.outbox[-2].body and "contact support" in mail.outbox[-2].body
    assert mail.outbox[-1].subject.endswith("reached the monthly spending ceiling Inferplane staff set for it")
    assert "invoices are paid" not in mail.outbox[-1].body and "support changes it" in mail.outbox[-1].body
    shown = member_client_factory(carded.org, Role.OWNER).get("/api/v1/billing/").json()["standing"]
    assert (shown["effective_spend_cap"], shown["limit_reason"]) == ("20.00", "spend_ceiling_staff")


def test_a_ceiling_raised_in_the_month_warns_again_at_50_80_and_100_percent_of_the_new_one(carded):
    """Before, the claims of the first ceiling's alerts stood for the month: at $500 of a $500 ceiling (raised by a
    paid invoice from $100) no alert went, and the organisation was refused unwarned."""
    from billing.alerts import check_spend_alerts
    from billing.models import SpendAlert

    _usage(carded.org, "100")
    assert check_spend_alerts(carded.org.pk) == [50, 80, 100]
    _paid(carded, "in_x", 5000)  # $50 paid: $500 a month
    assert standing.spend_limit(BillingAccount.objects.get(organization=carded.org)).cap == Decimal("500")
    assert check_spend_alerts(carded.org.pk) == []  # 20 % of the new one
    _usage(carded.org, "160")  # $260: 52 %
    assert check_spend_alerts(carded.org.pk) == [50]
    _usage(carded.org, "240")  # $500
    assert check_spend_alerts(carded.org.pk) == [80, 100]
    assert check_spend_alerts(carded.org.pk) == []  # once each
    assert sorted(SpendAlert.objects.filter(organization=carded.org).values_list("spend_cap", "threshold_percent")) == [
        (Decimal(100), 50), (Decimal(100), 80), (Decimal(100), 100),
        (Decimal(500), 50), (Decimal(500), 80), (Decimal(500), 100)]


def test_refunds_stripe_made_before_charge_refunded_reached_us_are_read_back_once_and_lower_the_ceiling(carded):
    """Before, a payment refunded before the deploy (or before the endpoint sent `charge.refunded`, or its event
    dropped by an older pod) was never counted: $50 paid and all refunded kept a $500 ceiling for good."""
    from django.core.management import call_command

    from billing.models import DeletedStripeCustomer, RefundedCharge

    _paid(carded, "in_1", 5000)
    refunded = carded.stripe.charge(carded.customer, amount=5000)
    carded.stripe.refund(refunded["id"], amount=3000)  # no webhook: before the deploy
    kept = carded.stripe.charge(carded.customer, amount=1000)
    gone = DeletedStripeCustomer.objects.create(stripe_customer_id="cus_deleted_before", organization=carded.org)
    carded.stripe.refund(carded.stripe.charge(gone.stripe_customer_id, amount=700)["id"])  # a deleted customer's
    _spend(carded.org, "150.00")
    assert standing.net_paid(carded.org.pk) == Decimal(50)

    call_command("backfill_refunds")
    assert standing.net_paid(carded.org.pk) == Decimal(13)  # $50 less $30 and $7 refunded
    assert _refusal(carded.org, "1.00").reason == "spend_ceiling"  # $100 again, written to Redis at once
    assert not RefundedCharge.objects.filter(stripe_charge_id=kept["id"]).exists()

    # A later refund's webhook still applies; a second run changes nothing, and never lowers what a webhook recorded.
    _webhook("charge.refunded", {**carded.stripe.refund(refunded["id"], amount=1000), "object": "charge"})
    assert standing.net_paid(carded.org.pk) == Decimal(3)
    RefundedCharge.objects.filter(stripe_charge_id=refunded["id"]).update(amount_refunded=4500)  # newer than Stripe's
    call_command("backfill_refunds")
    assert RefundedCharge.objects.get(stripe_charge_id=refunded["id"]).amount_refunded == 4500
    assert RefundedCharge.objects.count() == 2


def test_a_late_older_refund_event_never_lowers_what_the_backfill_read_from_stripe(carded):
    """Refunds only add up. Before, a `charge.refunded` that Stripe retried after `backfill_refunds` read the charge's
    newer total overwrote it (the backfill left the event time at 0): $10 then $40 refunded of $50 counted $10, net
    paid $40 again and the $500 ceiling back."""
    from django.core.management import call_command

    from billing.models import RefundedCharge

    _paid(carded, "in_1", 5000)
    charge = carded.stripe.charge(carded.customer, amount=5000)
    first = {**carded.stripe.refund(charge["id"], amount=1000), "object": "charge"}  # its event failed: retried later
    carded.stripe.refund(charge["id"], amount=4000)  # its event dropped by an older pod
    call_command("backfill_refunds")
    assert standing.net_paid(carded.org.pk) == Decimal(0)
    _webhook("charge.refunded", first, created=int(time.time()) - 3600)  # Stripe's retry of the first refund's
    assert RefundedCharge.objects.get(stripe_charge_id=charge["id"]).amount_refunded == 5000
    assert standing.net_paid(carded.org.pk) == Decimal(0)


def test_the_refund_backfill_reads_every_other_customer_past_one_that_fails_and_retries_each_page(
        carded, monkeypatch):
    """Before, the first customer whose charges failed (a deleted one Stripe no longer knows, a 5xx past the retries)
    stopped the run, leaving every customer after it unread; and a page after the first was read without retries."""
    from django.core.management import CommandError, call_command

    from billing import refund_backfill
    from billing.models import DeletedStripeCustomer

    _paid(carded, "in_1", 9000)
    gone = DeletedStripeCustomer.objects.create(stripe_customer_id="cus_deleted_before", organization=carded.org)
    carded.stripe.refund(carded.stripe.charge(gone.stripe_customer_id, amount=700)["id"])
    carded.stripe.fail_next("400", path="/v1/charges", method="GET")  # the account's customer, read first
    with pytest.raises(CommandError, match=f"1 customer\\(s\\) could not be read.*{carded.customer}"):
        call_command("backfill_refunds")
    assert standing.net_paid(carded.org.pk) == Decimal(83)  # the deleted customer's $7 read all the same

    for cents in (1000, 2000):  # two pages of one
        carded.stripe.refund(carded.stripe.charge(carded.customer, amount=cents)["id"])
    monkeypatch.setattr(refund_backfill, "PAGE_SIZE", 1)
    record = refund_backfill.record_refunded_charge

    def failing_the_next_page(organization_id, charge):  # a transient 5xx on the second page
        carded.stripe.fail_next("500", path="/v1/charges", method="GET")
        monkeypatch.setattr(refund_backfill, "record_refunded_charge", record)
        return record(organization_id, charge)

    monkeypatch.setattr(refund_backfill, "record_refunded_charge", failing_the_next_page)
    call_command("backfill_refunds")
    assert standing.net_paid(carded.org.pk) == Decimal(53)  # $90 less $7, $10 and $20


def test_the_upgrade_grandfathers_organisations_already_past_their_history_ceiling_and_lists_who_is_over(
        carded, settings):
    """`billing/0032`. Before, an organisation spending $150 this month with nothing paid was refused from the deploy
    on (its $100 ceiling), and staff could not set one first; nothing listed who was over. And the ceiling it gave was
    staff's, which paying never raised: $600 paid still met a 402 at twice its highest month for good."""
    import importlib
    from datetime import UTC, datetime
    from io import StringIO

    from django.apps import apps
    from django.core.management import call_command

    from billing.models import BillingMode
    from billing.rollups import rollup_usage

    migration = importlib.import_module("billing.migrations.0032_grandfather_spend_ceilings")
    now = datetime.now(UTC)
    _usage(carded.org, "150.10")  # this month: $150.10
    _usage(carded.org, "200.20", finished_at=migration.months_back(now, 1).replace(day=5))  # last month: the highest
    _usage(carded.org, "900", finished_at=migration.months_back(now, 3).replace(day=5))  # before the three months
    paid = OrganizationFactory()  # $50 paid: $500 a month, above twice its highest month ($200)
    BillingAccount.objects.for_organization(paid)
    _paid_by(paid, "in_p", 5000)
    _usage(paid, "100")
    prepaid = OrganizationFactory()
    BillingAccount.objects.for_organization(prepaid)
    BillingAccount.objects.filter(organization=prepaid).update(mode=BillingMode.PREPAID)
    _usage(prepaid, "300")
    rollup_usage()
    services.review_all_payment_standing()
    assert _refusal(carded.org, "1.00").reason == "spend_ceiling"
    listed = StringIO()
    call_command("spend_over_ceiling", stdout=listed)
    assert f"{carded.org.pk}\t{carded.org.slug}\tspent $150.10\tceiling $100.00 (paid_history)" in listed.getvalue()
    assert "1 organisation(s) at or past" in listed.getvalue()

    migration.grandfather_spend_ceilings(apps, None)
    migration.grandfather_spend_ceilings(apps, None)  # a second run changes nothing
    services.review_all_payment_standing()  # marked stale: the gateway sees it (a deploy rebuilds every counter too)
    accounts = BillingAccount.objects.filter(organization__in=[carded.org, paid, prepaid]).order_by("organization_id")
    assert list(accounts.values_list("grandfathered_spend_ceiling", "staff_spend_ceiling")) == [
        (Decimal(401), None), (None, None), (None, None)]  # $400.40 rounded up, a floor, not staff's
    ceiling = standing.spend_ceiling(BillingAccount.objects.get(organization=carded.org))
    assert (ceiling.amount, ceiling.source, ceiling.next_paid, ceiling.next_amount) == (
        Decimal(401), standing.GRANDFATHERED, Decimal(50), Decimal(500))
    _spend(carded.org, "240.00")  # $390.10 of $401
    assert _refusal(carded.org, "11.00").reason == "spend_ceiling"
    listed = StringIO()
    call_command("spend_over_ceiling", stdout=listed)
    assert "0 organisation(s) at or past" in listed.getvalue()

    _paid(carded, "in_big", 60_000)  # $600 paid: its history's $5,000 passes the floor, as for anyone
    assert standing.spend_limit(BillingAccount.objects.get(organization=carded.org)).cap == Decimal(5000)


def test_the_upgrade_and_the_over_ceiling_list_read_no_organisations_usage_but_by_an_index_that_leads_with_it(carded):
    """Before, `billing/0032` and `spend_over_ceiling` filtered the whole usage ledger on `finished_at` (no index
    leads with it: a sequential scan of the biggest table, inside the migrate Job's transaction)."""
    import importlib
    from io import StringIO

    from django.apps import apps
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    migration = importlib.import_module("billing.migrations.0032_grandfather_spend_ceilings")
    _usage(carded.org, "150")
    with CaptureQueriesContext(connection) as queries:
        migration.grandfather_spend_ceilings(apps, None)
        call_command("spend_over_ceiling", stdout=StringIO())
    read = [query["sql"] for query in queries if "billing_usagerecord" in query["sql"]
            or "billing_usagerollup" in query["sql"]]
    assert read
    for sql in read:
        assert '"organization_id" = ' in sql, sql


def _paid_by(organization, invoice_id: str, cents: int) -> None:
    from billing.models import Invoice

    Invoice.objects.create(organization=organization, stripe_invoice_id=invoice_id, status="paid", currency="usd",
                           amount_due=cents, amount_paid=cents)


def test_a_staff_ceiling_set_under_a_spend_already_alerted_at_the_own_cap_still_says_calls_stop_and_why(carded):
    """A threshold alerted at the organisation's own cap stood for every limit since whose share the spend had already
    passed (`alerts._alerted_at_this_spend`), whatever its kind: an organisation that had reached its own cap, raised
    it, then was held by staff to a ceiling under its spend had its calls refused with no mail saying so, nor to
    contact support (the test saw no mail). A cap the organisation itself sets again under its spend still mails
    nothing new."""
    from django.core import mail

    from billing.alerts import check_spend_alerts

    services.set_spend_cap(SYSTEM, carded.org, spend_cap=Decimal("10"))
    _usage(carded.org, "10")
    assert check_spend_alerts(carded.org.pk) == [50, 80, 100]
    assert mail.outbox[-1].subject.endswith("reached its monthly spend cap")

    services.set_spend_cap(SYSTEM, carded.org, spend_cap=Decimal("50"))  # raised: calls go on
    services.set_spend_ceiling(SYSTEM, carded.org, ceiling=Decimal("8"))  # staff's, under the spend: calls stop
    assert 100 in check_spend_alerts(carded.org.pk)
    assert mail.outbox[-1].subject.endswith("reached the monthly spending ceiling Inferplane staff set for it")
    assert "until support changes it" in mail.outbox[-1].body

    num_mails = len(mail.outbox)
    services.set_spend_ceiling(SYSTEM, carded.org, ceiling=None)  # the history's again ($100): its own cap, $50
    for cap in ("9", "7", "9.50"):  # the organisation's own, set again and again under its spend
        services.set_spend_cap(SYSTEM, carded.org, spend_cap=Decimal(cap))
        assert check_spend_alerts(carded.org.pk) == []
    assert len(mail.outbox) == num_mails


def test_an_own_cap_under_a_spend_already_alerted_at_a_staff_ceiling_still_says_calls_stop_at_the_cap(carded):
    """The other way round: a staff ceiling reached, then lifted, left the organisation's own cap, set under the spend
    before, stopping its calls, and the staff ceiling's alert stood for it (`alerts._alerted_at_this_spend`): no mail
    said the organisation's own cap now stops them."""
    from django.core import mail

    from billing.alerts import check_spend_alerts
    from billing.models import SpendAlert

    services.set_spend_cap(SYSTEM, carded.org, spend_cap=Decimal("9"))
    services.set_spend_ceiling(SYSTEM, carded.org, ceiling=Decimal("8"))
    _usage(carded.org, "10")
    assert check_spend_alerts(carded.org.pk) == [50, 80, 100]
    assert mail.outbox[-1].subject.endswith("reached the monthly spending ceiling Inferplane staff set for it")

    services.set_spend_ceiling(SYSTEM, carded.org, ceiling=None)  # the history's again ($100): its own cap, $9
    assert 100 in check_spend_alerts(carded.org.pk)
    assert mail.outbox[-1].subject.endswith("reached its monthly spend cap")
    assert set(SpendAlert.objects.filter(organization=carded.org).values_list("limit_reason", flat=True)) == {
        standing.SPEND_CEILING_STAFF, standing.ORG_CAP}


def test_an_own_cap_of_the_same_amount_as_a_staff_ceiling_reached_before_still_says_calls_stop_at_the_cap(carded):
    """The alert's claim was unique per threshold and amount whatever the limit's kind: an organisation held by staff
    to $8 and mailed that, then lifted and stopping at its own $8 cap, had its 50, 80 and 100 % claims refused by the
    staff ceiling's rows (`IntegrityError`), and no mail said its own cap now stops its calls. Each kind is mailed once."""
    from django.core import mail

    from billing.alerts import check_spend_alerts
    from billing.models import SpendAlert

    services.set_spend_ceiling(SYSTEM, carded.org, ceiling=Decimal("8"))
    _usage(carded.org, "10")
    assert check_spend_alerts(carded.org.pk) == [50, 80, 100]
    assert mail.outbox[-1].subject.endswith("reached the monthly spending ceiling Inferplane staff set for it")

    services.set_spend_ceiling(SYSTEM, carded.org, ceiling=None)  # the history's again ($100)
    services.set_spend_cap(SYSTEM, carded.org, spend_cap=Decimal("8"))  # its own, the same amount: calls still stop
    assert check_spend_alerts(carded.org.pk) == [50, 80, 100]
    assert mail.outbox[-1].subject.endswith("reached its monthly spend cap")
    num_mails = len(mail.outbox)
    assert check_spend_alerts(carded.org.pk) == []  # each once
    assert len(mail.outbox) == num_mails
    assert sorted(SpendAlert.objects.filter(organization=carded.org, threshold_percent=100)
                  .values_list("limit_reason", "spend_cap")) == [
        (standing.ORG_CAP, Decimal("8")), (standing.SPEND_CEILING_STAFF, Decimal("8"))]
