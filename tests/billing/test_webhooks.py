"""Stripe webhooks: verified by signature, applied once per event id, mirroring invoices and their lines."""

import importlib
import json
import time
from datetime import timedelta

import pytest
from django.apps import apps
from django.utils import timezone
from rest_framework.test import APIClient

from billing import stripe_sync
from billing.models import BillingAccount, DeletedStripeCustomer, Invoice, InvoiceLine, StripeEvent
from controlplane.accounts.services import SYSTEM, record_audit
from tests.factories import OrganizationFactory
from tests.fakes.stripe_server import sign_webhook

pytestmark = pytest.mark.django_db

URL = "/api/v1/billing/stripe/webhook"
SECRET = "whsec_test_secret"


@pytest.fixture
def customer(settings):
    settings.STRIPE_WEBHOOK_SECRET = SECRET
    account = BillingAccount.objects.for_organization(OrganizationFactory().pk)
    account.stripe_customer_id = "cus_webhook"
    account.save()
    return account


def _event(event_id="evt_1", kind="invoice.finalized", status="open", created=None, amount_paid=0, lines=2):
    return {
        "id": event_id, "object": "event", "type": kind, "created": created or int(time.time()),
        "data": {"object": {
            "id": "in_1", "object": "invoice", "customer": "cus_webhook", "number": "INF-0001", "status": status,
            "currency": "usd", "amount_due": 1234, "amount_paid": amount_paid, "period_start": 1780000000,
            "period_end": 1782600000, "hosted_invoice_url": "https://invoice.stripe.test/in_1",
            "lines": {"object": "list", "data": [
                {"id": f"il_{n}", "description": f"Output tokens × {n}", "quantity": 1000 * n, "amount": 600 + n}
                for n in range(lines)
            ]},
        }},
    }


def _post(payload: dict, *, secret=SECRET, signature=None):
    body = json.dumps(payload).encode()
    return APIClient().post(URL, body, content_type="application/json",
                            HTTP_STRIPE_SIGNATURE=signature or sign_webhook(body, secret))


def test_a_signed_invoice_event_mirrors_the_invoice_with_its_lines(customer):
    response = _post(_event())

    assert response.status_code == 200
    invoice = Invoice.objects.get()
    assert (invoice.organization_id, invoice.number, invoice.status, invoice.amount_due) == (customer.organization_id, "INF-0001", "open", 1234)
    assert list(invoice.lines.values_list("description", "amount")) == [("Output tokens × 0", 600), ("Output tokens × 1", 601)]


def test_an_invoice_with_more_lines_than_its_webhook_shows_is_mirrored_with_all_of_them_once(fake_stripe):
    # Stripe's webhook shows an invoice's first 10 lines (`lines.has_more`): here 11 one-off invoice items pulled in
    # ahead of the usage line. Before, only those 10 were mirrored; the rest are read from Stripe now (a read that
    # fails is a 503, and Stripe sends the event again), and neither the same event delivered twice nor a later event
    # of the invoice writes a line twice.
    organization = OrganizationFactory()
    subscription_id = stripe_sync.ensure_subscription(organization.pk)
    customer_id = BillingAccount.objects.for_organization(organization.pk).stripe_customer_id
    for _ in range(11):
        fake_stripe.add_invoice_item(customer_id, amount=500)
    made = fake_stripe.end_period(subscription_id, at=int(time.time()))
    [invoice_id] = fake_stripe.invoices
    shown = json.loads(str(stripe_sync.stripe_client().v1.invoices.retrieve(invoice_id)))  # as Stripe sends it
    assert made["id"] == subscription_id and len(shown["lines"]["data"]) == 10 and shown["lines"]["has_more"]
    every_line = [line["id"] for line in fake_stripe.invoices[invoice_id]["lines"]["data"]]
    finalized = {"id": "evt_lines", "object": "event", "type": "invoice.finalized", "created": int(time.time()),
                 "data": {"object": shown}}

    fake_stripe.fail_next("500", path=f"/v1/invoices/{invoice_id}/lines", method="GET")  # one try: sent again
    assert _post(finalized).status_code == 503 and not Invoice.objects.exists()

    for event in (finalized, finalized, {**finalized, "id": "evt_lines_again", "type": "invoice.updated"}):
        assert _post(event).status_code == 200
        mirrored = Invoice.objects.get(stripe_invoice_id=invoice_id)
        assert list(mirrored.lines.values_list("stripe_line_id", flat=True)) == every_line
    assert len(every_line) == 12


def test_a_webhook_with_a_bad_signature_is_a_400_and_changes_nothing(customer):
    _post(_event(event_id="evt_ok"))
    forged = _event(event_id="evt_forged", kind="invoice.paid", status="paid", amount_paid=1234)

    assert _post(forged, secret="whsec_wrong").status_code == 400
    assert _post(forged, signature="t=1,v1=deadbeef").status_code == 400
    assert APIClient().post(URL, json.dumps(forged), content_type="application/json").status_code == 400

    assert Invoice.objects.get().status == "open"
    assert list(StripeEvent.objects.values_list("stripe_event_id", flat=True)) == ["evt_ok"]


def test_the_same_event_twice_is_applied_once(customer):
    event = _event(event_id="evt_same", kind="invoice.payment_failed")
    assert _post(event).json()["duplicate"] is False
    first_failure = Invoice.objects.get().payment_failed_at

    assert _post(event).json()["duplicate"] is True
    assert Invoice.objects.get().payment_failed_at == first_failure
    assert StripeEvent.objects.count() == 1 and InvoiceLine.objects.count() == 2


def test_an_older_event_arriving_late_never_overwrites_a_newer_invoice_state(customer):
    now = int(time.time())
    _post(_event(event_id="evt_paid", kind="invoice.paid", status="paid", amount_paid=1234, created=now))
    _post(_event(event_id="evt_old", kind="invoice.finalized", status="open", created=now - 60))

    assert Invoice.objects.get().status == "paid"


def test_without_a_webhook_secret_every_webhook_is_refused(settings):
    settings.STRIPE_WEBHOOK_SECRET = ""
    assert _post(_event(), secret="").status_code == 400
    assert not StripeEvent.objects.exists()


def test_an_invoice_already_mirrored_follows_its_events_after_its_customer_was_deleted(customer):
    # Its later events were dropped once the customer was deleted in Stripe (the account's customer id cleared): an
    # invoice left open with a failed payment held its organisation for ever.
    now = int(time.time())
    _post(_event(event_id="evt_failed", kind="invoice.payment_failed", created=now - 120))
    assert Invoice.objects.get().payment_failed_at is not None
    BillingAccount.objects.filter(pk=customer.pk).update(stripe_customer_id="")  # `customer.deleted`

    _post(_event(event_id="evt_voided", kind="invoice.voided", status="void", created=now))

    invoice = Invoice.objects.get()
    assert (invoice.organization_id, invoice.status) == (customer.organization_id, "void")
    assert _post(_event(event_id="evt_other", created=now) | {"data": {"object": {
        **_event()["data"]["object"], "id": "in_2"}}}).status_code == 200
    assert not Invoice.objects.filter(stripe_invoice_id="in_2").exists(), "a new invoice of no known customer is skipped"


def test_a_customer_deleted_before_its_organisation_was_kept_is_taken_from_the_audit_log(customer):
    """`billing/0019` records the customers deleted before it from their audit events: their late invoices too are
    mirrored to the organisation."""
    migration = importlib.import_module("billing.migrations.0019_deleted_stripe_customer")
    BillingAccount.objects.filter(pk=customer.pk).update(stripe_customer_id="")  # deleted before 0019
    record_audit(SYSTEM, customer.organization, "billing.customer_deleted", customer, customer="cus_webhook")
    record_audit(SYSTEM, None, "billing.customer_deleted", customer, customer="cus_of_no_organisation")

    migration.record_customers_deleted_before(apps, None)
    migration.record_customers_deleted_before(apps, None)  # a second run changes nothing

    [deleted] = DeletedStripeCustomer.objects.all()
    assert (deleted.stripe_customer_id, deleted.organization_id) == ("cus_webhook", customer.organization_id)
    assert _post(_event(event_id="evt_late", kind="invoice.paid", status="paid", amount_paid=1234)).status_code == 200
    assert Invoice.objects.get(stripe_invoice_id="in_1").organization_id == customer.organization_id


def test_invoices_marked_uncollectible_before_their_time_was_kept_are_dated_as_the_standing_dated_them(customer):
    """`billing/0021` dates the uncollectible invoices mirrored before it by their failure, or else their last change:
    one owed before its customer's deletion keeps holding (`billing.standing.past_due_since`)."""
    migration = importlib.import_module("billing.migrations.0021_invoice_uncollectible_at")
    failed_at = timezone.now() - timedelta(days=30)
    organization_id = customer.organization_id
    Invoice.objects.create(organization_id=organization_id, stripe_invoice_id="in_failed", status="uncollectible",
                           payment_failed_at=failed_at)
    written_off = Invoice.objects.create(organization_id=organization_id, stripe_invoice_id="in_written_off",
                                         status="uncollectible")
    Invoice.objects.create(organization_id=organization_id, stripe_invoice_id="in_open", status="open",
                           payment_failed_at=failed_at)

    migration.date_uncollectible_invoices(apps, None)

    assert dict(Invoice.objects.values_list("stripe_invoice_id", "uncollectible_at")) == {
        "in_failed": failed_at, "in_written_off": written_off.updated_at, "in_open": None}
