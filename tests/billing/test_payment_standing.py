"""Payment standing (`billing.standing`): on an installation that bills through Stripe, a postpaid
organisation without a payment method spends at most a small limit a month, whatever cap it sets, and
an invoice left unpaid past its grace period stops every call until it is paid.

Before, an organisation could sign up, remove its cap (none by default) and run up any bill with no
way to collect it, and a failed payment changed nothing. Reserved as the gateway does, in its
admission script (`tests/billing/test_quota.py`); one call through a real gateway in
`tests/gateway/test_spend_caps.py`."""

import asyncio
import json
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.core import mail
from django.utils import timezone
from rest_framework.test import APIClient

from billing import services, stripe_sync, tasks
from billing.models import BillingAccount, Invoice
from billing.periods import period_containing
from billing.quota.counters import QuotaExceeded
from controlplane import redis_keys
from controlplane.accounts.models import AuditEvent, Role
from controlplane.accounts.services import SYSTEM
from controlplane.redis_client import get_redis
from tests.billing.test_quota import reserve
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory
from tests.fakes.stripe_server import sign_webhook

# NOTE: admission rebuilds counters in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = Decimal("1.00")
WEBHOOK = "/api/v1/billing/stripe/webhook"


@pytest.fixture
def billed(settings, fake_stripe):
    """Stripe configured (the fake), a limit of $1 without a payment method, and a postpaid organisation
    with an owner and a Stripe customer."""
    settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD = LIMIT
    settings.PAST_DUE_GRACE_DAYS = 7
    organization = OrganizationFactory()
    MembershipFactory(organization=organization, user=UserFactory(email="owner@example.com"), role=Role.OWNER)
    customer_id = stripe_sync.ensure_customer(organization.pk)

    class Billed:
        org = organization
        customer = customer_id
        stripe = fake_stripe

    return Billed


_request_ids = iter(range(10**9))


def _spend(organization, amount: str) -> None:
    """Reserve `amount` as a call would (held until settled: it counts against the limit)."""
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal(amount),
                        request_id=f"call-{next(_request_ids)}"))


def _refusal(organization, amount: str) -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as refused:
        _spend(organization, amount)
    return refused.value


def _webhook(kind: str, data: dict, *, created: int | None = None) -> None:
    event = {"id": f"evt_{time.time_ns()}", "object": "event", "type": kind, "created": created or int(time.time()),
             "data": {"object": data}}
    body = json.dumps(event).encode()
    response = APIClient().post(WEBHOOK, body, content_type="application/json",
                                HTTP_STRIPE_SIGNATURE=sign_webhook(body, "whsec_test_secret"))
    assert response.status_code == 200, response.content


def _customer_event(billed, payment_method: str | None) -> None:
    """What Stripe does when a card is added or removed: the customer changes, then its webhook comes."""
    _webhook("customer.updated", billed.stripe.set_default_payment_method(billed.customer, payment_method))


def _invoice_event(billed, kind: str, status: str, *, invoice_id: str = "in_unpaid", created: int | None = None) -> None:
    _webhook(kind, {"id": invoice_id, "object": "invoice", "customer": billed.customer, "status": status,
                    "currency": "usd", "amount_due": 4200, "amount_paid": 4200 if status == "paid" else 0,
                    "lines": {"object": "list", "data": []}}, created=created)


def test_without_a_payment_method_an_organisation_spends_at_most_the_limit_whatever_its_cap(billed):
    _spend(billed.org, "0.60")
    refused = _refusal(billed.org, "0.60")
    assert refused.reason == "payment_method" and "$1.00" in refused.message and "payment method" in refused.message

    services.set_spend_cap(SYSTEM, billed.org, spend_cap=Decimal("500.00"))  # its own cap does not lift the limit
    assert _refusal(billed.org, "0.60").reason == "payment_method"

    _customer_event(billed, "pm_card_visa")  # a card added in the Customer Portal
    _spend(billed.org, "0.60")
    assert BillingAccount.objects.get(organization=billed.org).payment_method_on_file

    _customer_event(billed, None)  # the card removed: the limit is back at once
    assert _refusal(billed.org, "0.10").reason == "payment_method"
    # An older event arriving late, saying a card is on file: the customer as Stripe has it now decides.
    _webhook("customer.updated", {"id": billed.customer, "object": "customer",
                                  "invoice_settings": {"default_payment_method": "pm_card_visa"}},
             created=int(time.time()) - 60)
    assert _refusal(billed.org, "0.10").reason == "payment_method"
    assert list(AuditEvent.objects.filter(action="billing.payment_method").order_by("pk")
                .values_list("details__on_file", flat=True)) == [True, False]  # what changed, not every reading


def test_a_customer_webhook_that_cannot_be_read_back_is_a_503_and_counts_when_stripe_sends_it_again(billed):
    billed.stripe.set_default_payment_method(billed.customer, "pm_card_visa")
    event = {"id": "evt_card", "object": "event", "type": "customer.updated", "created": int(time.time()),
             "data": {"object": {"id": billed.customer, "object": "customer"}}}
    body = json.dumps(event).encode()

    def post():
        return APIClient().post(WEBHOOK, body, content_type="application/json",
                                HTTP_STRIPE_SIGNATURE=sign_webhook(body, "whsec_test_secret"))

    billed.stripe.fail_next("500")  # one try: Stripe's own retries of the webhook are the retries
    refused = post()
    assert refused.status_code == 503 and refused["Retry-After"] == "60"
    assert _refusal(billed.org, "2.00").reason == "payment_method"
    assert post().status_code == 200  # Stripe's retry of the same event
    _spend(billed.org, "2.00")


def test_an_invoice_left_unpaid_past_its_grace_stops_every_call_until_it_is_paid(billed):
    _customer_event(billed, "pm_card_visa")
    _invoice_event(billed, "invoice.payment_failed", "open")
    _spend(billed.org, "0.01")  # Stripe retries during the grace period: calls go on

    assert services.review_all_payment_standing(now=timezone.now() + timedelta(days=6)) == 0
    _spend(billed.org, "0.01")
    assert services.review_all_payment_standing(now=timezone.now() + timedelta(days=8)) == 1
    refused = _refusal(billed.org, "0.01")
    assert refused.reason == "past_due" and "unpaid invoice" in refused.message
    assert AuditEvent.objects.filter(action="billing.past_due").count() == 1
    assert [message.to for message in mail.outbox] == [["owner@example.com"]]
    assert "unpaid" in mail.outbox[0].subject

    # Redis lost the counter: rebuilt from PostgreSQL, the hold stands.
    get_redis().delete(redis_keys.org_period_key(billed.org.pk, period_containing().key))
    assert _refusal(billed.org, "0.01").reason == "past_due"
    # Run again, the review changes nothing and emails nobody twice.
    services.review_all_payment_standing(now=timezone.now() + timedelta(days=9))
    assert len(mail.outbox) == 1

    _invoice_event(billed, "invoice.paid", "paid")
    _spend(billed.org, "0.01")
    assert BillingAccount.objects.get(organization=billed.org).past_due_since is None
    assert AuditEvent.objects.filter(action="billing.past_due_cleared").count() == 1


def _dispute_event(kind: str, dispute: dict, *, created: int | None = None) -> None:
    _webhook(kind, dispute, created=created)


def _billing_page(organization, user) -> str:
    from django.test import Client

    from controlplane.accounts.tenancy import SESSION_KEY

    console = Client()
    console.force_login(user)
    session = console.session
    session[SESSION_KEY] = organization.pk
    session.save()
    return console.get("/console/billing/").content.decode()


def _paid_by_card(billed) -> dict:
    """A card on file, and an invoice paid by it: the charge a cardholder may dispute."""
    _customer_event(billed, "pm_card_visa")
    _invoice_event(billed, "invoice.paid", "paid", invoice_id="in_paid")
    return billed.stripe.charge(billed.customer)


def test_a_disputed_payment_stops_every_call_at_once_and_a_won_dispute_releases_it(billed, member_client_factory):
    """Before, a dispute left its invoice paid and was ignored: a stolen card ran a month, was disputed, and ran the
    next."""
    charge = _paid_by_card(billed)
    _spend(billed.org, "0.01")

    dispute = billed.stripe.dispute(charge["id"])
    _dispute_event("charge.dispute.created", dispute)
    refused = _refusal(billed.org, "0.01")
    assert refused.reason == "disputed" and "disputed" in refused.message and "withdraw" in refused.message
    assert AuditEvent.objects.filter(action="billing.disputed").count() == 1
    assert [message.to for message in mail.outbox] == [["owner@example.com"]]
    assert "disputed" in mail.outbox[0].subject
    client = member_client_factory(billed.org, Role.ADMIN)
    shown = client.get("/api/v1/billing/").json()["standing"]
    assert shown["hold_reason"] == "disputed" and shown["past_due_since"] is not None
    assert 'data-testid="disputed"' in _billing_page(billed.org, client.user)

    _dispute_event("charge.dispute.funds_withdrawn", dispute)  # the same dispute: nothing changes, nobody emailed twice
    get_redis().delete(redis_keys.org_period_key(billed.org.pk, period_containing().key))  # Redis lost the counter
    services.review_all_payment_standing()
    assert _refusal(billed.org, "0.01").reason == "disputed"
    assert len(mail.outbox) == 1

    _dispute_event("charge.dispute.closed", billed.stripe.close_dispute(dispute["id"], "won"))
    _spend(billed.org, "0.01")
    assert BillingAccount.objects.get(organization=billed.org).past_due_since is None
    assert AuditEvent.objects.filter(action="billing.disputed_cleared").count() == 1
    assert client.get("/api/v1/billing/").json()["standing"]["hold_reason"] is None


def test_a_lost_dispute_holds_until_a_superuser_lifts_its_hold_in_the_admin_audited(billed, client):
    from django.contrib.auth import get_user_model

    from tests.factories import sign_in_staff

    dispute = billed.stripe.dispute(_paid_by_card(billed)["id"])
    _dispute_event("charge.dispute.created", dispute)
    _dispute_event("charge.dispute.closed", billed.stripe.close_dispute(dispute["id"], "lost"))
    _invoice_event(billed, "invoice.paid", "paid", invoice_id="in_next_month")  # a newer invoice paid lifts nothing
    assert _refusal(billed.org, "0.01").reason == "disputed"

    from billing.models import Dispute

    staff = get_user_model().objects.create_superuser("ops@example.test", "ops@example.test", "a long passphrase")
    sign_in_staff(client, staff)
    mirrored = Dispute.objects.get(stripe_dispute_id=dispute["id"])
    assert client.get("/django-admin/billing/dispute/").status_code == 200
    lifted = client.post("/django-admin/billing/dispute/", {"action": "lift_hold", "_selected_action": [mirrored.pk]})
    assert lifted.status_code == 302

    _spend(billed.org, "0.01")
    audit = AuditEvent.objects.get(action="billing.lift_dispute_hold")
    assert audit.actor == staff and audit.organization_id == billed.org.pk and audit.details["status"] == "lost"
    mirrored.refresh_from_db()
    assert mirrored.hold_lifted_by == staff and mirrored.hold_lifted_at is not None
    # Stripe's later events of the dispute (it stays lost) do not put the hold back.
    _dispute_event("charge.dispute.updated", billed.stripe.disputes[dispute["id"]])
    _spend(billed.org, "0.01")


def test_dispute_events_delivered_twice_or_out_of_order_change_nothing(billed):
    dispute = billed.stripe.dispute(_paid_by_card(billed)["id"])
    now = int(time.time())
    opened = {"id": "evt_dispute_opened", "object": "event", "type": "charge.dispute.created", "created": now - 60,
              "data": {"object": dict(dispute)}}
    body = json.dumps(opened).encode()

    def post_opened():
        return APIClient().post(WEBHOOK, body, content_type="application/json",
                                HTTP_STRIPE_SIGNATURE=sign_webhook(body, "whsec_test_secret"))

    assert post_opened().json()["duplicate"] is False
    assert _refusal(billed.org, "0.01").reason == "disputed"
    _dispute_event("charge.dispute.closed", billed.stripe.close_dispute(dispute["id"], "won"), created=now)
    _spend(billed.org, "0.01")

    assert post_opened().json()["duplicate"] is True  # Stripe sends an event again: applied once
    # An older event arriving late, and one of the same second as the close, say it is open: the won dispute stands.
    _dispute_event("charge.dispute.updated", {**dispute, "status": "under_review"}, created=now - 30)
    _dispute_event("charge.dispute.updated", {**dispute, "status": "under_review"}, created=now)
    _spend(billed.org, "0.01")
    assert len(billed.stripe.calls_to(f"/v1/charges/{dispute['charge']}", "GET")) == 1  # read for the new dispute only
    assert AuditEvent.objects.filter(action="billing.disputed").count() == 1


def test_a_dispute_of_a_charge_or_customer_not_ours_is_accepted_and_ignored(billed):
    from billing.models import Dispute

    _customer_event(billed, "pm_card_visa")
    another_product, no_customer = billed.stripe.charge("cus_another_product"), billed.stripe.charge(None)
    for charge_id in (another_product["id"], no_customer["id"], "ch_unknown"):
        _dispute_event("charge.dispute.created", {"id": f"dp_{charge_id}", "object": "dispute", "charge": charge_id,
                                                  "amount": 4200, "currency": "usd", "status": "needs_response",
                                                  "reason": "fraudulent", "created": int(time.time())})
    assert not Dispute.objects.exists()
    _spend(billed.org, "0.01")


def test_a_dispute_of_a_payment_by_a_customer_deleted_since_holds_its_organisation(billed):
    """Before, a new dispute's organisation was found only by the account's customer: a chargeback of a payment by a
    customer Stripe deleted since was dropped, no hold and no audit. The deleted customer keeps its organisation."""
    from billing.models import Dispute

    charge = _paid_by_card(billed)
    _webhook("customer.deleted", billed.stripe.delete_customer(billed.customer))
    _spend(billed.org, "0.01")
    dispute = billed.stripe.dispute(charge["id"])
    _dispute_event("charge.dispute.created", dispute)
    _dispute_event("charge.dispute.created", dispute)  # another delivery: mirrored once

    assert Dispute.objects.get(stripe_dispute_id=dispute["id"]).organization_id == billed.org.pk
    assert _refusal(billed.org, "0.01").reason == "disputed"
    assert AuditEvent.objects.filter(action="billing.disputed").count() == 1


def test_a_dispute_whose_charge_cannot_be_read_is_a_503_and_holds_when_stripe_sends_it_again(billed):
    dispute = billed.stripe.dispute(_paid_by_card(billed)["id"])
    event = {"id": "evt_dispute", "object": "event", "type": "charge.dispute.created", "created": int(time.time()),
             "data": {"object": dispute}}
    body = json.dumps(event).encode()

    def post():
        return APIClient().post(WEBHOOK, body, content_type="application/json",
                                HTTP_STRIPE_SIGNATURE=sign_webhook(body, "whsec_test_secret"))

    billed.stripe.fail_next("500", path=f"/v1/charges/{dispute['charge']}")
    refused = post()
    assert refused.status_code == 503 and refused["Retry-After"] == "60"
    _spend(billed.org, "0.01")
    assert post().status_code == 200
    assert _refusal(billed.org, "0.01").reason == "disputed"


def test_a_dispute_is_found_by_its_charge_invoice_when_the_charge_names_no_customer(billed):
    # Charges named their invoice before API version 2025-03-31: a guest charge of a mirrored invoice is ours.
    _paid_by_card(billed)
    dispute = billed.stripe.dispute(billed.stripe.charge(None, invoice="in_paid")["id"])
    _dispute_event("charge.dispute.created", dispute)
    assert _refusal(billed.org, "0.01").reason == "disputed"


def test_the_grace_period_runs_from_the_first_failure_whatever_fails_after(billed):
    """Before, each failed attempt restarted it: a held tenant paying with a declined card was released."""
    _customer_event(billed, "pm_card_visa")
    first = int(time.time()) - 8 * 86_400
    _invoice_event(billed, "invoice.payment_failed", "open", created=first)
    for days_ago in (6, 3, 0):  # Stripe's retries
        _invoice_event(billed, "invoice.payment_failed", "open", created=int(time.time()) - days_ago * 86_400)
    assert Invoice.objects.get().payment_failed_at.timestamp() == first
    assert _refusal(billed.org, "0.01").reason == "past_due"


def test_a_first_failure_reported_after_a_newer_invoice_event_still_dates_the_grace_period(billed):
    _customer_event(billed, "pm_card_visa")
    now = int(time.time())
    _invoice_event(billed, "invoice.updated", "open", created=now)
    _invoice_event(billed, "invoice.payment_failed", "open", created=now - 8 * 86_400)  # late
    assert Invoice.objects.get().payment_failed_at.timestamp() == now - 8 * 86_400
    assert _refusal(billed.org, "0.01").reason == "past_due"


def test_a_paid_invoice_stays_paid_when_an_open_event_of_the_same_second_and_a_late_failure_come_after_it(billed):
    """Before, Stripe's retry's invoice.updated (open) and invoice.paid shared a second, paid delivered first: the
    open one was applied too, then the first failure's late webhook dated a grace that held a paying customer."""
    _customer_event(billed, "pm_card_visa")
    now = int(time.time())
    _invoice_event(billed, "invoice.paid", "paid", created=now - 60)
    _invoice_event(billed, "invoice.updated", "open", created=now - 60)
    _invoice_event(billed, "invoice.payment_failed", "open", created=now - 8 * 86_400)  # the first attempt's, late

    invoice = Invoice.objects.get()
    assert (invoice.status, invoice.payment_failed_at) == ("paid", None)
    assert services.review_payment_standing(billed.org.pk).past_due_since is None
    _spend(billed.org, "0.01")


def test_a_paid_or_voided_invoice_is_not_made_uncollectible_by_an_event_of_the_same_second(billed):
    """Before, a marked_uncollectible of the same second as the invoice.paid (or invoice.voided) applied before it was
    applied too: a paid invoice was uncollectible, and its organisation was held at once."""
    _customer_event(billed, "pm_card_visa")
    now = int(time.time())
    _invoice_event(billed, "invoice.paid", "paid", invoice_id="in_paid", created=now - 60)
    _invoice_event(billed, "invoice.marked_uncollectible", "uncollectible", invoice_id="in_paid", created=now - 60)
    _invoice_event(billed, "invoice.voided", "void", invoice_id="in_void", created=now - 60)
    _invoice_event(billed, "invoice.marked_uncollectible", "uncollectible", invoice_id="in_void", created=now - 60)

    assert dict(Invoice.objects.values_list("stripe_invoice_id", "status")) == {"in_paid": "paid", "in_void": "void"}
    assert services.review_payment_standing(billed.org.pk).past_due_since is None
    _spend(billed.org, "0.01")


def test_an_uncollectible_invoice_paid_a_later_second_is_paid_and_an_older_uncollectible_event_changes_nothing(billed):
    _customer_event(billed, "pm_card_visa")
    now = int(time.time())
    _invoice_event(billed, "invoice.marked_uncollectible", "uncollectible", created=now - 60)
    assert _refusal(billed.org, "0.01").reason == "past_due"
    _invoice_event(billed, "invoice.paid", "paid", created=now - 59)
    _invoice_event(billed, "invoice.marked_uncollectible", "uncollectible", created=now - 60)  # delivered again, late
    _invoice_event(billed, "invoice.updated", "uncollectible", created=now - 59)  # the same second, ranked lower

    assert Invoice.objects.get().status == "paid"
    _spend(billed.org, "0.01")


def test_a_deleted_customers_unpaid_invoice_holds_its_organisation_only_while_it_has_no_card(
        billed, member_client_factory):
    """The deletion finalises the deleted customer's draft, which no card can pay: its payment fails. Before, that
    failure ran the grace period like any other, and a week on an organisation paying with its new customer's card
    was held. It holds only an organisation with no way to pay now; it stays owed, shown, and is never forgiven."""
    client = member_client_factory(billed.org, Role.ADMIN)
    _customer_event(billed, "pm_card_visa")
    old_customer = billed.customer
    _webhook("customer.deleted", billed.stripe.delete_customer(old_customer))
    _webhook("invoice.payment_failed", {"id": "in_final", "object": "invoice", "customer": old_customer,
                                        "status": "open", "currency": "usd", "amount_due": 4200, "amount_paid": 0,
                                        "lines": {"object": "list", "data": []}})
    billed.customer = stripe_sync.ensure_customer(billed.org.pk)  # the next push's, or the portal link's
    _customer_event(billed, "pm_card_visa")

    assert services.review_all_payment_standing(now=timezone.now() + timedelta(days=8)) == 0
    _spend(billed.org, "2.00")  # past the limit without a card: the new card counts
    assert client.get("/api/v1/billing/").json()["standing"]["num_unpaid_invoices_without_card"] == 1
    assert 'data-testid="unpaid-without-card"' in _billing_page(billed.org, client.user)

    _customer_event(billed, None)  # no card any more: the invoice owed holds, as any other
    assert services.review_all_payment_standing(now=timezone.now() + timedelta(days=8)) == 1
    assert _refusal(billed.org, "0.01").reason == "past_due"

    _webhook("invoice.paid", {"id": "in_final", "object": "invoice", "customer": old_customer, "status": "paid",
                              "currency": "usd", "amount_due": 4200, "amount_paid": 4200,
                              "lines": {"object": "list", "data": []}})
    assert BillingAccount.objects.get(organization=billed.org).past_due_since is None
    assert client.get("/api/v1/billing/").json()["standing"]["num_unpaid_invoices_without_card"] == 0


def test_an_invoice_past_due_or_uncollectible_before_its_customer_was_deleted_holds_whatever_card_comes_after(
        billed, member_client_factory):
    """Only the want of a card excuses a deleted customer's invoice. Before, every unpaid invoice of a deleted customer
    was left out while a card was on file: an organisation held for a $4,200 invoice its card had declined, whose
    customer was then deleted in Stripe's Dashboard and a new card added, was released, and the invoice never
    charged. One marked uncollectible before the deletion holds too."""
    client = member_client_factory(billed.org, Role.ADMIN)
    _customer_event(billed, "pm_card_visa")
    old_customer = billed.customer
    week_ago = int(time.time()) - 8 * 86400
    for invoice_id, kind, status, amount in (("in_declined", "invoice.payment_failed", "open", 420000),
                                             ("in_written_off", "invoice.marked_uncollectible", "uncollectible", 900)):
        _webhook(kind, {"id": invoice_id, "object": "invoice", "customer": old_customer, "status": status,
                        "currency": "usd", "amount_due": amount, "amount_paid": 0,
                        "lines": {"object": "list", "data": []}}, created=week_ago)
    assert services.review_all_payment_standing() == 1  # the declined card's grace ran out: held
    held_since = BillingAccount.objects.get(organization=billed.org).past_due_since

    _webhook("customer.deleted", billed.stripe.delete_customer(old_customer))  # support tidying up, say
    billed.customer = stripe_sync.ensure_customer(billed.org.pk)
    _customer_event(billed, "pm_card_visa")
    services.review_all_payment_standing()
    assert BillingAccount.objects.get(organization=billed.org).past_due_since == held_since, \
        "a debt past due before the deletion was released by a new card"
    assert _refusal(billed.org, "0.01").reason == "past_due"
    assert 'data-testid="past-due"' in _billing_page(billed.org, client.user)  # what is owed is shown
    assert client.get("/api/v1/billing/").json()["standing"]["num_unpaid_invoices_without_card"] == 2

    _webhook("invoice.paid", {"id": "in_declined", "object": "invoice", "customer": old_customer, "status": "paid",
                              "currency": "usd", "amount_due": 420000, "amount_paid": 420000,
                              "lines": {"object": "list", "data": []}})
    assert BillingAccount.objects.get(organization=billed.org).past_due_since is not None  # the uncollectible one
    _webhook("invoice.voided", {"id": "in_written_off", "object": "invoice", "customer": old_customer, "status": "void",
                                "currency": "usd", "amount_due": 900, "amount_paid": 0,
                                "lines": {"object": "list", "data": []}})
    assert BillingAccount.objects.get(organization=billed.org).past_due_since is None
    _spend(billed.org, "0.01")


def _held_for_an_invoice_its_deleted_customer_left(billed) -> None:
    """The organisation's customer deleted nine days ago left an invoice whose payment failed the day after, and it has
    no card: held (by the beat task's review)."""
    old_customer = billed.customer
    deleted_at = int(time.time()) - 9 * 86400
    _webhook("customer.deleted", billed.stripe.delete_customer(old_customer), created=deleted_at)
    _webhook("invoice.payment_failed", {"id": "in_final", "object": "invoice", "customer": old_customer,
                                        "status": "open", "currency": "usd", "amount_due": 4200, "amount_paid": 0,
                                        "lines": {"object": "list", "data": []}}, created=deleted_at + 86400)
    assert services.review_all_payment_standing() == 1  # no card, and the grace ran out: held
    assert _refusal(billed.org, "0.01").reason == "past_due"


def test_a_held_organisation_that_adds_a_card_is_served_at_once_without_waiting_for_the_review(billed):
    """A card lifts a hold that only the want of one made (`billing.standing.can_pay_now`). Before, the card was
    recorded and the hold stood until the beat task's next review, minutes later: the customer who had just added it
    was refused meanwhile. Its removal puts the hold back at once, and a late, older reading changes nothing."""
    _held_for_an_invoice_its_deleted_customer_left(billed)

    billed.customer = stripe_sync.ensure_customer(billed.org.pk)
    observed_before_card_ms = time.time_ns() // 1_000_000
    _customer_event(billed, "pm_card_visa")  # no review of the beat task's after this
    _spend(billed.org, "0.01")
    assert BillingAccount.objects.get(organization=billed.org).past_due_since is None

    # An older reading of no card, delivered late, changes nothing; the event again neither.
    services.record_payment_method(billed.customer, on_file=False, observed_ms=observed_before_card_ms)
    _customer_event(billed, "pm_card_visa")
    _spend(billed.org, "0.01")

    _customer_event(billed, None)  # the card removed: held again, at once
    assert _refusal(billed.org, "0.01").reason == "past_due"


def test_a_held_organisation_staff_mark_invoiced_without_card_is_served_at_once_and_held_again_when_unmarked(
        billed, client):
    """Staff's "invoiced without card" (the admin's field, `services.set_invoiced_without_card`) counts as a card does
    (`billing.standing.can_pay_now`), and at once as a card does. Before, the hold stood until the beat task's next
    review, minutes later: the organisation staff had just vouched for was refused meanwhile."""
    from django.contrib.auth import get_user_model

    from tests.factories import sign_in_staff

    _held_for_an_invoice_its_deleted_customer_left(billed)

    staff = get_user_model().objects.create_superuser("ops@example.test", "ops@example.test", "a long passphrase")
    sign_in_staff(client, staff)
    account = BillingAccount.objects.get(organization=billed.org)
    changed = client.post(f"/django-admin/billing/billingaccount/{account.pk}/change/",
                          {"mode": account.mode, "spend_cap": account.spend_cap or "", "invoiced_without_card": "on"})
    assert changed.status_code == 302  # in the admin's transaction; no review of the beat task's after this
    _spend(billed.org, "0.01")
    assert BillingAccount.objects.get(organization=billed.org).past_due_since is None

    services.set_invoiced_without_card(SYSTEM, billed.org, allowed=False)  # held again, at once
    assert _refusal(billed.org, "0.01").reason == "past_due"
    assert AuditEvent.objects.filter(action="billing.past_due").count() == 2


def test_a_draft_the_deletion_finalised_is_excused_when_its_failure_arrives_before_the_deletions_webhook(billed):
    """Stripe does not order webhooks, and the deletion's may come late (sent again after a 503): the deletion is
    dated by its event, on Stripe's clock, so the failure of a draft it finalised is after it, not before."""
    _customer_event(billed, "pm_card_visa")
    old_customer = billed.customer
    deleted = billed.stripe.delete_customer(old_customer)
    deleted_at = int(time.time()) - 120
    _webhook("invoice.payment_failed", {"id": "in_final", "object": "invoice", "customer": old_customer,
                                        "status": "open", "currency": "usd", "amount_due": 4200, "amount_paid": 0,
                                        "lines": {"object": "list", "data": []}}, created=deleted_at + 5)
    _webhook("customer.deleted", deleted, created=deleted_at)
    billed.customer = stripe_sync.ensure_customer(billed.org.pk)
    _customer_event(billed, "pm_card_visa")
    assert services.review_all_payment_standing(now=timezone.now() + timedelta(days=8)) == 0


def test_a_hold_that_did_not_reach_redis_is_written_by_the_next_review(billed, monkeypatch):
    from billing.quota import counters

    _customer_event(billed, "pm_card_visa")
    _spend(billed.org, "0.01")  # the gateway's counter is built

    def redis_down(*args, **kwargs):
        raise ConnectionError("Redis is restarting")

    monkeypatch.setattr(counters, "refresh_limits", redis_down)
    monkeypatch.setattr(services, "refresh_limits", redis_down)
    _invoice_event(billed, "invoice.marked_uncollectible", "uncollectible")  # the webhook still answers 200
    assert BillingAccount.objects.get(organization=billed.org).past_due_since is not None
    _spend(billed.org, "0.01")  # the gateway has not heard
    monkeypatch.undo()

    services.review_all_payment_standing()
    assert _refusal(billed.org, "0.01").reason == "past_due"

    # The release too: paid, but Redis did not hear; the next review (no longer held) still writes it.
    monkeypatch.setattr(counters, "_UPDATE_HASH", None)  # any refresh fails
    _invoice_event(billed, "invoice.paid", "paid")
    assert BillingAccount.objects.get(organization=billed.org).limits_stale
    assert _refusal(billed.org, "0.01").reason == "past_due"
    monkeypatch.undo()
    services.review_all_payment_standing()
    _spend(billed.org, "0.01")
    assert not BillingAccount.objects.get(organization=billed.org).limits_stale


def test_a_changed_limit_setting_reaches_counters_already_built(billed, settings):
    _spend(billed.org, "0.90")
    assert _refusal(billed.org, "0.20").reason == "payment_method"
    settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD = Decimal("2.00")
    _spend(billed.org, "0.20")


def test_an_uncollectible_invoice_stops_calls_at_once_and_voiding_it_lets_them_through(billed):
    _customer_event(billed, "pm_card_visa")
    _invoice_event(billed, "invoice.marked_uncollectible", "uncollectible")
    assert _refusal(billed.org, "0.01").reason == "past_due"

    _invoice_event(billed, "invoice.voided", "void")
    _spend(billed.org, "0.01")


def test_a_counter_written_before_payment_standing_gains_its_limits_and_keeps_its_spend(billed):
    from billing.quota.counters import limits_version

    key = redis_keys.org_period_key(billed.org.pk, period_containing().key)
    get_redis().hset(key, mapping={"spent": str(900_000_000), "cap": "-1", "prepaid": "0"})  # $0.90, no limit fields

    assert _refusal(billed.org, "0.20").reason == "payment_method"  # $0.90 counted, as Redis had it
    assert get_redis().hgetall(key) == {"spent": "900000000", "lv": limits_version(), "cap": "1000000000",
                                        "capr": "payment_method", "prepaid": "0", "hold": "",
                                        "reached": "1000000000"}  # the refused call marked it, at its cap (the 100 % spend alert's)
    _spend(billed.org, "0.10")


def test_staff_let_an_organisation_that_pays_by_bank_transfer_spend_without_a_card(billed):
    assert _refusal(billed.org, "2.00").reason == "payment_method"
    services.set_invoiced_without_card(SYSTEM, billed.org, allowed=True)
    _spend(billed.org, "2.00")
    assert AuditEvent.objects.filter(action="billing.set_invoiced_without_card").exists()


def test_prepaid_accounts_spend_their_credit_without_a_card(billed):
    from billing.credits import grant_credits

    services.set_billing_mode(SYSTEM, billed.org, mode="prepaid")
    grant_credits(SYSTEM, billed.org, amount=Decimal("3.00"))
    _spend(billed.org, "2.50")
    assert _refusal(billed.org, "1.00").reason == "credit"


def test_a_customer_made_before_payment_standing_is_asked_and_limited_only_without_a_card(billed):
    with_card, without = OrganizationFactory(), OrganizationFactory()
    for organization, payment_method in ((with_card, "pm_card_visa"), (without, None)):
        customer_id = stripe_sync.ensure_customer(organization.pk)
        billed.stripe.set_default_payment_method(customer_id, payment_method)
        BillingAccount.objects.filter(organization=organization).update(payment_method_observed_ms=0)
        _spend(organization, "1.50")  # never asked: not limited (it may have had a card for months)

    gone = OrganizationFactory()  # its customer was deleted in Stripe: it has no card
    BillingAccount.objects.for_organization(gone.pk)
    BillingAccount.objects.filter(organization=gone).update(stripe_customer_id="cus_deleted")

    tasks.review_payment_standing()

    _spend(with_card, "1.50")
    assert _refusal(without, "0.01").reason == "payment_method"
    assert _refusal(gone, "5.01").reason == "payment_method"


def test_without_stripe_nothing_is_invoiced_so_neither_rule_applies(settings):
    settings.STRIPE_SECRET_KEY = ""
    settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD = LIMIT
    organization = OrganizationFactory()
    Invoice.objects.create(organization=organization, stripe_invoice_id="in_old", status="uncollectible", amount_due=100,
                           payment_failed_at=timezone.now() - timedelta(days=30))

    services.review_all_payment_standing()
    _spend(organization, "5.00")
    assert BillingAccount.objects.get(organization=organization).past_due_since is None


def test_the_billing_api_and_page_show_the_standing_and_a_card_added_in_the_portal_counts_on_return(
        billed, member_client_factory):
    from django.test import Client

    client = member_client_factory(billed.org, Role.ADMIN)
    standing = client.get("/api/v1/billing/").json()["standing"]
    assert standing == {"payment_method_on_file": False, "limit_without_payment_method": "1.00",
                        "spend_ceiling": {"amount": "100.00", "source": "paid_history", "net_paid": "0.00",
                                          "next_paid": "50.00", "next_amount": "500.00",
                                          "shared_with_other_organizations": False},
                        "effective_spend_cap": "1.00", "limit_reason": "payment_method", "past_due_since": None,
                        "hold_reason": None, "num_unpaid_invoices_without_card": 0}

    console = Client()
    console.force_login(client.user)
    from controlplane.accounts.tenancy import SESSION_KEY
    session = console.session
    session[SESSION_KEY] = billed.org.pk
    session.save()
    assert 'data-testid="payment-method-limit"' in console.get("/console/billing/").content.decode()

    billed.stripe.set_default_payment_method(billed.customer, "pm_card_visa")  # added in the portal, webhook not yet here
    page = console.get("/console/billing/?from=portal").content.decode()
    assert 'data-testid="payment-method-limit"' not in page
    shown = client.get("/api/v1/billing/").json()["standing"]
    # the card lifts the limit without one; its spending ceiling for its payment history stays (test_spend_ceiling.py)
    assert (shown["limit_without_payment_method"], shown["effective_spend_cap"]) == (None, "100.00")
    _spend(billed.org, "2.00")
    # A loop on the return address asks Stripe once per 30 s, and only for owners and admins.
    reads = lambda: len(billed.stripe.calls_to(f"/v1/customers/{billed.customer}", "GET"))  # noqa: E731
    before = reads()
    for _ in range(5):
        assert console.get("/console/billing/?from=portal").status_code == 200
    assert reads() == before
    get_redis().delete(redis_keys.portal_return_key(billed.org.pk))
    viewer = Client()
    viewer_user = UserFactory()
    MembershipFactory(organization=billed.org, user=viewer_user, role=Role.VIEWER)
    viewer.force_login(viewer_user)
    viewer_session = viewer.session
    viewer_session[SESSION_KEY] = billed.org.pk
    viewer_session.save()
    assert viewer.get("/console/billing/?from=portal").status_code == 200
    assert reads() == before

    _invoice_event(billed, "invoice.marked_uncollectible", "uncollectible")
    assert 'data-testid="past-due"' in console.get("/console/billing/").content.decode()
    assert client.get("/api/v1/billing/").json()["standing"]["past_due_since"] is not None


def test_spend_alerts_warn_before_the_limit_without_a_payment_method(billed):
    from billing.alerts import check_all_spend_alerts
    from billing.ledger import record_usage
    from tests.billing.conftest import usage_report
    from tests.factories import EndpointFactory

    endpoint = EndpointFactory(organization=billed.org, price_input_per_million=Decimal("1"),
                               price_output_per_million=Decimal("0"))
    record_usage(usage_report(endpoint, prompt_tokens=600_000, completion_tokens=0))  # $0.60 of the $1 limit
    OrganizationFactory()  # an account without a card that spent nothing: not even looked at

    assert check_all_spend_alerts() == 1
    assert mail.outbox[0].subject.endswith("used 50% of the monthly limit of accounts without a payment method")
    assert "Add a payment method" in mail.outbox[0].body


def test_two_versions_of_the_limits_during_a_rolling_deploy_never_fail_a_call_and_rewrite_them_once(billed, monkeypatch):
    # Pods of two versions (a changed INFERPLANE_SPEND_LIMIT_WITHOUT_CARD, say) each found the other's `lv`
    # and rewrote the limits under the account's row lock; a call whose every attempt found the other's
    # failed ("billing counters kept vanishing", a 500).
    from billing.quota import rebuild

    key = redis_keys.org_period_key(billed.org.pk, period_containing().key)
    _spend(billed.org, "0.01")  # the counter exists, written by this version
    written = rebuild._limits_again
    rewrites = []

    def the_other_version_writes_right_after(organization_id):
        written(organization_id)
        rewrites.append(organization_id)
        get_redis().hset(key, "lv", "the other version")

    monkeypatch.setattr(rebuild, "_limits_again", the_other_version_writes_right_after)
    get_redis().hset(key, "lv", "the other version")

    for _ in range(5):
        _spend(billed.org, "0.01")

    assert rewrites == [billed.org.pk]  # once in LIMITS_REFRESH_INTERVAL_S, not on every call
    assert _refusal(billed.org, "2.00").reason == "payment_method"  # the limits as they stand still hold
