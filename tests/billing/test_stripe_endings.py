"""A subscription or a customer that Stripe ends (cancelled or deleted in the Dashboard, or a
subscription cancelled by Stripe after failed payments) is forgotten by its webhook: the next push subscribes
the organisation again, from where the ended subscription's invoices stopped, and an organisation whose customer
is gone has no payment method. Before, usage went on being pushed to a customer nothing billed, or
failed against a customer that no longer existed, and a card that went with it still lifted the limit; and a
subscription cancelled at once, which bills none of its unfinished period's usage unless told to (`invoice_now`),
was followed by one starting at its end: that usage was billed by no invoice."""

import asyncio
import importlib
import json
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.apps import apps
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from billing import services, stripe_sync, webhooks
from billing.ledger import record_usage
from billing.models import (
    BILLED_METER_EVENT_NAME,
    BillingAccount,
    DeletedStripeCustomer,
    Invoice,
    MeterEventPush,
    StripeEvent,
    StripeMeter,
    UsageRollup,
    VoidedInvoiceMark,
)
from billing.quota.counters import QuotaExceeded
from billing.rollups import rollup_usage
from controlplane.accounts.models import ORGANIZATION_CREATED_ACTION, AuditEvent
from controlplane.accounts.services import SYSTEM, Actor, record_audit
from tests.billing.conftest import usage_report
from tests.billing.test_quota import reserve
from tests.factories import EndpointFactory, sign_in_staff
from tests.fakes import stripe_server
from tests.fakes.stripe_server import sign_webhook

# NOTE: admission rebuilds counters in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

WEBHOOK = "/api/v1/billing/stripe/webhook"


def _webhook(kind: str, data: dict, *, event_id: str | None = None, created: int | None = None) -> dict:
    body = json.dumps({"id": event_id or f"evt_{time.time_ns()}", "object": "event", "type": kind,
                       "created": created or int(time.time()), "data": {"object": data}}).encode()
    response = APIClient().post(WEBHOOK, body, content_type="application/json",
                                HTTP_STRIPE_SIGNATURE=sign_webhook(body, "whsec_test_secret"))
    assert response.status_code == 200, response.content
    return response.json()


def _hour(num_hours_ago: int):
    return timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=num_hours_ago)


def _use_and_push(endpoint, *, num_hours_ago: int) -> None:
    record_usage(usage_report(endpoint, finished_at=_hour(num_hours_ago) + timedelta(minutes=5)))
    rollup_usage()
    assert stripe_sync.push_pending_rollups() == 1


def _billed_by(fake_stripe, event: dict) -> list[str]:
    """The subscriptions of the event's customer whose time covers the event: those that bill it."""
    return [subscription["id"] for subscription in fake_stripe.subscriptions.values()
            if subscription["customer"] == event["payload"]["stripe_customer_id"]
            and subscription["start_date"] <= event["timestamp"] < (subscription["ended_at"] or float("inf"))]


def test_a_subscription_cancelled_in_stripe_is_replaced_at_the_next_push_and_usage_is_billed_once(fake_stripe):
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=5)
    account = BillingAccount.objects.get(organization=endpoint.organization)
    first = account.stripe_subscription_id

    # Cancelled at once with its usage invoiced (`invoice_now`), as the Dashboard does when told to.
    _webhook("customer.subscription.deleted",
             fake_stripe.cancel_subscription(first, at=int(_hour(4).timestamp()), invoice_now=True))

    account.refresh_from_db()
    assert account.stripe_subscription_id == ""
    assert AuditEvent.objects.filter(action="billing.subscription_ended", details__subscription=first).exists()
    _use_and_push(endpoint, num_hours_ago=3)

    account.refresh_from_db()
    second = fake_stripe.subscriptions[account.stripe_subscription_id]
    assert second["id"] != first and second["status"] == "active" and second["customer"] == account.stripe_customer_id
    assert second["start_date"] == fake_stripe.subscriptions[first]["ended_at"]  # from where the first stopped
    # Every meter event falls in exactly one subscription's time: billed, and only once.
    assert fake_stripe.meter_events and all(len(_billed_by(fake_stripe, event)) == 1
                                            for event in fake_stripe.meter_events.values())


def test_usage_of_an_hour_before_a_cancellation_pushed_after_it_is_billed_by_the_next_subscription(fake_stripe):
    # The ended subscription's final invoice is made when it ends: usage of an hour before that, pushed only
    # after (its rollup closed late, its push failing until then), was dated that hour, before the next
    # subscription's start (the old one's end): billed by neither.
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=6)
    first = BillingAccount.objects.get(organization=endpoint.organization).stripe_subscription_id
    record_usage(usage_report(endpoint, finished_at=_hour(5) + timedelta(minutes=5)))
    rollup_usage()  # closed, not pushed yet
    billed_by_first = set(fake_stripe.meter_events)
    _webhook("customer.subscription.deleted",
             fake_stripe.cancel_subscription(first, at=int(_hour(4).timestamp()), invoice_now=True))

    record_usage(usage_report(endpoint, finished_at=_hour(3) + timedelta(minutes=5)))
    rollup_usage()
    assert stripe_sync.push_pending_rollups() == 2

    account = BillingAccount.objects.get(organization=endpoint.organization)
    second = fake_stripe.subscriptions[account.stripe_subscription_id]
    assert second["start_date"] == fake_stripe.subscriptions[first]["ended_at"]
    late = [event for identifier, event in fake_stripe.meter_events.items() if identifier not in billed_by_first]
    assert len(late) == 6 and all(second["start_date"] <= event["timestamp"] for event in late)
    assert account.stripe_subscription_started_at.timestamp() == second["start_date"]


def test_a_subscription_stored_before_its_start_was_kept_has_it_read_from_stripe_once(fake_stripe):
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=5)
    account = BillingAccount.objects.get(organization=endpoint.organization)
    BillingAccount.objects.filter(pk=account.pk).update(stripe_subscription_started_at=None)  # as stored by older code
    _use_and_push(endpoint, num_hours_ago=3)
    _use_and_push(endpoint, num_hours_ago=2)

    account.refresh_from_db()
    start = fake_stripe.subscriptions[account.stripe_subscription_id]["start_date"]
    assert account.stripe_subscription_started_at.timestamp() == start
    reads = [call for call in fake_stripe.calls if call.method == "GET" and call.path.startswith("/v1/subscriptions/")]
    assert len(reads) == 1


def test_a_cancellation_applies_once_whatever_the_order_and_only_to_the_subscription_it_names(fake_stripe):
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=5)
    account = BillingAccount.objects.get(organization=endpoint.organization)
    first = account.stripe_subscription_id
    updated = {**fake_stripe.subscriptions[first], "cancel_at_period_end": True}
    assert _webhook("customer.subscription.updated", updated)["duplicate"] is False  # still live: nothing changes
    assert BillingAccount.objects.get(pk=account.pk).stripe_subscription_id == first

    cancelled = fake_stripe.cancel_subscription(first, at=int(_hour(4).timestamp()))
    _webhook("customer.subscription.updated", cancelled, event_id="evt_cancelled")
    assert _webhook("customer.subscription.updated", cancelled, event_id="evt_cancelled")["duplicate"] is True
    _use_and_push(endpoint, num_hours_ago=3)
    second = BillingAccount.objects.get(pk=account.pk).stripe_subscription_id

    _webhook("customer.subscription.deleted", cancelled)  # the first's, arriving late

    assert second not in ("", first) and BillingAccount.objects.get(pk=account.pk).stripe_subscription_id == second
    assert AuditEvent.objects.filter(action="billing.subscription_ended").count() == 1
    assert StripeEvent.objects.filter(stripe_event_id="evt_cancelled").count() == 1


def test_a_customer_deleted_in_stripe_is_forgotten_and_its_organisation_held_to_the_limit_without_a_card(
        fake_stripe, settings):
    settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD = Decimal("1.00")
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=5)
    account = BillingAccount.objects.get(organization=endpoint.organization)
    old_customer, old_subscription = account.stripe_customer_id, account.stripe_subscription_id
    _webhook("customer.updated", fake_stripe.set_default_payment_method(old_customer, "pm_card_visa"))
    asyncio.run(reserve(organization_id=account.organization_id, api_key_id=None, amount=Decimal("2.00"),
                        request_id="call-with-a-card"))  # a card on file: no limit but its own cap

    deleted = fake_stripe.delete_customer(old_customer)
    _webhook("customer.deleted", deleted)
    # Stripe ends its subscriptions with it; their webhooks may come after the customer's.
    _webhook("customer.subscription.deleted", fake_stripe.subscriptions[old_subscription])

    account.refresh_from_db()
    assert (account.stripe_customer_id, account.stripe_subscription_id, account.payment_method_on_file) == ("", "", False)
    assert not account.limits_stale  # the gateway was told at once
    with pytest.raises(QuotaExceeded) as refused:
        asyncio.run(reserve(organization_id=account.organization_id, api_key_id=None, amount=Decimal("0.50"),
                            request_id="call-without-a-card"))
    assert refused.value.reason == "payment_method"
    # A late update of the deleted customer changes nothing.
    _webhook("customer.updated", {**deleted, "invoice_settings": {"default_payment_method": "pm_card_visa"}})
    assert not BillingAccount.objects.get(pk=account.pk).payment_method_on_file

    record_usage(usage_report(endpoint, finished_at=_hour(3) + timedelta(minutes=5)))
    rollup_usage()
    assert stripe_sync.push_pending_rollups() == 2  # a new customer, subscribed, billed (the 5th hour's again too)

    account.refresh_from_db()
    assert account.stripe_customer_id not in ("", old_customer)
    assert fake_stripe.subscriptions[account.stripe_subscription_id]["customer"] == account.stripe_customer_id
    new_events = [event for event in fake_stripe.meter_events.values()
                  if event["payload"]["stripe_customer_id"] == account.stripe_customer_id]
    assert new_events and all(len(_billed_by(fake_stripe, event)) == 1 for event in new_events)
    assert AuditEvent.objects.filter(action="billing.customer_deleted", details__customer=old_customer).count() == 1


def test_usage_pushed_to_a_customer_deleted_before_invoicing_it_is_billed_once_by_the_next(fake_stripe):
    """Before, Stripe cancelled the deleted customer's subscription with no final invoice, and the usage already pushed
    to it (and pushed to it until the webhook came: Stripe accepts those events and drops them) was billed by nobody.
    It goes again to the next customer under new identifiers, once; usage its invoices billed does not."""
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=7)
    account = BillingAccount.objects.get(organization=endpoint.organization)
    old_customer, old_subscription = account.stripe_customer_id, account.stripe_subscription_id
    invoiced = _end_period_after_what_was_pushed(fake_stripe, old_subscription)  # the 7th hour's invoice, finalised
    [invoice] = fake_stripe.invoices.values()
    _webhook("invoice.finalized", {**invoice, "status": "open"})
    _use_and_push(endpoint, num_hours_ago=5)

    deleted = fake_stripe.delete_customer(old_customer)
    _use_and_push(endpoint, num_hours_ago=4)  # pushed to the deleted customer before its webhook came
    _webhook("customer.deleted", deleted)
    _webhook("customer.deleted", deleted)  # delivered twice: pushed again once
    _webhook("customer.subscription.deleted", fake_stripe.subscriptions[old_subscription])
    record_usage(usage_report(endpoint, finished_at=_hour(3) + timedelta(minutes=5)))
    rollup_usage()
    assert stripe_sync.push_pending_rollups() == 3  # the 3rd hour's, and the 5th and 4th hours' again

    account.refresh_from_db()
    new_customer = account.stripe_customer_id
    fake_stripe.end_period(account.stripe_subscription_id)
    costs = [rollup.cost_micro_dollars for rollup in UsageRollup.objects.order_by("hour_start")]
    assert fake_stripe.invoiced_usage(old_customer) == costs[0] and invoiced
    assert fake_stripe.invoiced_usage(new_customer) == sum(costs[1:]) == _cost_pushed(fake_stripe, new_customer)
    assert stripe_sync.push_pending_rollups() == 0


def test_usage_a_deleted_customers_invoice_billed_is_not_pushed_again_when_the_invoice_webhook_comes_after(fake_stripe):
    """Before, the deletion knew only the invoices whose webhooks had come: the invoice Stripe finalised before the
    customer was deleted, its `invoice.finalized` late, billed the 7th hour, and the 7th hour went again to the next
    customer, billed twice. Stripe's own invoices of the deleted customer say what they billed."""
    endpoint = EndpointFactory()
    old_customer, old_subscription, invoice = _invoiced_the_7th_hour(fake_stripe, endpoint)
    finalized = fake_stripe.finalize_invoice(invoice["id"])  # its webhook not sent yet
    _use_and_push(endpoint, num_hours_ago=5)

    deleted = fake_stripe.delete_customer(old_customer)
    fake_stripe.fail_next("500", path="/v1/invoices", method="GET")  # one try: Stripe sends the event again
    body = json.dumps({"id": "evt_deleted", "object": "event", "type": "customer.deleted", "created": int(time.time()),
                       "data": {"object": deleted}}).encode()
    refused = APIClient().post(WEBHOOK, body, content_type="application/json",
                               HTTP_STRIPE_SIGNATURE=sign_webhook(body, "whsec_test_secret"))
    assert refused.status_code == 503 and BillingAccount.objects.get(stripe_customer_id=old_customer)
    _webhook("customer.deleted", deleted, event_id="evt_deleted")
    _webhook("customer.subscription.deleted", fake_stripe.subscriptions[old_subscription])
    _webhook("invoice.finalized", finalized)  # late
    assert stripe_sync.push_pending_rollups() == 1  # the 5th hour's again, not the 7th's

    new_customer, new_subscription = _subscribed(endpoint)
    _invoice_the_rest(fake_stripe, new_subscription)
    costs = [rollup.cost_micro_dollars for rollup in UsageRollup.objects.order_by("hour_start")]
    assert fake_stripe.invoiced_usage(old_customer) == costs[0]
    assert fake_stripe.invoiced_usage(new_customer) == costs[1] == _cost_pushed(fake_stripe, new_customer)


def test_usage_pushed_while_its_customers_deletion_is_recorded_goes_again_to_the_next(fake_stripe, monkeypatch):
    """A push that read the customer before its `customer.deleted` webhook was applied, and sent its events after:
    the deletion found none of them, and the rollup was marked pushed. It is pushed again instead."""
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=5)
    account = BillingAccount.objects.get(organization=endpoint.organization)
    old_customer = account.stripe_customer_id
    record_usage(usage_report(endpoint, finished_at=_hour(4) + timedelta(minutes=5)))
    rollup_usage()
    _deleted_once_read(monkeypatch, old_customer,
                       lambda: _webhook("customer.deleted", fake_stripe.delete_customer(old_customer)))
    assert stripe_sync.push_pending_rollups() == 0
    monkeypatch.undo()
    assert stripe_sync.push_pending_rollups() == 2  # the 4th hour's, and the 5th hour's found by the deletion

    account.refresh_from_db()
    fake_stripe.end_period(account.stripe_subscription_id)
    costs = sum(rollup.cost_micro_dollars for rollup in UsageRollup.objects.all())
    assert fake_stripe.invoiced_usage(account.stripe_customer_id) == costs


def test_usage_a_push_sends_after_its_customers_deletion_goes_again_though_dated_in_a_period_it_invoiced(
        fake_stripe, monkeypatch):
    """A push read the customer, the customer was deleted (its draft finalised by the webhook, its period ending after
    the 6th hour's events' date: they are dated up to `LATEST_PERIOD_GRACE` back), then the push sent the 6th hour's
    events, which Stripe dropped. Before, they counted as billed by that invoice, and no customer was billed them.
    Stripe's answer says when it received each (`created`), a later second than the deletion: they go again."""
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=7)
    old_customer, old_subscription = _subscribed(endpoint)
    record_usage(usage_report(endpoint, finished_at=_hour(6) + timedelta(minutes=5)))
    rollup_usage()
    fake_stripe.end_period(old_subscription, at=int(time.time()) + 60)  # its draft bills the 7th hour
    def deleted() -> None:
        _webhook("customer.deleted", fake_stripe.delete_customer(old_customer))
        time.sleep(1 - time.time() % 1 + 0.01)  # Stripe receives the events a second after the deletion

    _deleted_once_read(monkeypatch, old_customer, deleted)
    assert stripe_sync.push_pending_rollups() == 0  # sent to the deleted customer, and to go again
    monkeypatch.undo()
    assert DeletedStripeCustomer.objects.get(stripe_customer_id=old_customer).invoiced_until.timestamp() > max(
        event["timestamp"] for event in fake_stripe.meter_events.values())
    assert stripe_sync.push_pending_rollups() == 1

    new_customer, new_subscription = _subscribed(endpoint)
    _invoice_the_rest(fake_stripe, new_subscription)
    costs = [rollup.cost_micro_dollars for rollup in UsageRollup.objects.order_by("hour_start")]
    assert _billed_usage(fake_stripe, old_customer) == costs[0]
    assert _billed_usage(fake_stripe, new_customer) == costs[1] == _cost_pushed(fake_stripe, new_customer)


def test_usage_on_a_draft_invoice_at_its_customers_deletion_is_billed_once_by_that_invoice(fake_stripe):
    """Before, a draft invoice at the deletion counted as billing nothing, and the 7th hour on it went again to the
    next customer: Stripe keeps a deleted customer's invoices and finalises its subscription's drafts (it cannot
    delete them), so the 7th hour was billed twice. The deletion's webhook finalises the draft, which bills it."""
    endpoint = EndpointFactory()
    old_customer, old_subscription, draft = _invoiced_the_7th_hour(fake_stripe, endpoint)
    _use_and_push(endpoint, num_hours_ago=5)

    _webhook("customer.deleted", fake_stripe.delete_customer(old_customer))
    assert stripe_sync.push_pending_rollups() == 1  # the 5th hour's again, not the 7th's
    assert fake_stripe.invoices[draft["id"]]["status"] == "open"

    new_customer, new_subscription = _subscribed(endpoint)
    _invoice_the_rest(fake_stripe, new_subscription)
    costs = [rollup.cost_micro_dollars for rollup in UsageRollup.objects.order_by("hour_start")]
    assert fake_stripe.invoiced_usage(old_customer) == costs[0]
    assert fake_stripe.invoiced_usage(new_customer) == costs[1] == _cost_pushed(fake_stripe, new_customer)


@pytest.mark.parametrize("advanced_by_stripe", [True, False])
def test_a_draft_stripe_refuses_to_finalise_bills_its_usage_only_if_stripe_advances_it(fake_stripe, advanced_by_stripe):
    """A draft Stripe will finalise itself an hour after making it (`auto_advance`) bills its period; one it leaves
    for us to finalise, refused, bills nothing, and its usage goes again to the next customer."""
    endpoint = EndpointFactory()
    old_customer, old_subscription, draft = _invoiced_the_7th_hour(fake_stripe, endpoint)
    draft["auto_advance"] = advanced_by_stripe
    fake_stripe.fail_next("400", path=f"/v1/invoices/{draft['id']}/finalize")

    _webhook("customer.deleted", fake_stripe.delete_customer(old_customer))
    assert draft["status"] == "draft"
    assert stripe_sync.push_pending_rollups() == (0 if advanced_by_stripe else 1)


@pytest.mark.parametrize("mirrored", [True, False])
def test_a_live_customers_void_invoice_stays_written_off_once_the_customer_is_deleted(fake_stripe, mirrored):
    """A void invoice of a live customer is a staff write-off (`billing.models.WRITTEN_OFF_INVOICE_STATUS`). Before, once
    the customer was deleted, its 7th hour went again to the next customer, by the deletion (a void invoice counted as
    billing nothing) or by its void's webhook coming after the deletion: billed after staff forgave it. Stripe's
    `status_transitions.voided_at`, before the deletion, says it was written off; only the 5th hour goes again."""
    endpoint = EndpointFactory()
    old_customer, old_subscription, invoice = _invoiced_the_7th_hour(fake_stripe, endpoint)
    finalized = fake_stripe.finalize_invoice(invoice["id"])
    voided = fake_stripe.void_invoice(invoice["id"])  # in the Dashboard, the customer live
    if mirrored:
        _webhook("invoice.finalized", finalized)
        _webhook("invoice.voided", voided)
    _use_and_push(endpoint, num_hours_ago=5)
    time.sleep(1 - time.time() % 1 + 0.01)  # deleted a later second than the void

    _webhook("customer.deleted", fake_stripe.delete_customer(old_customer))
    if not mirrored:  # the void's webhooks come after the deletion's
        _webhook("invoice.finalized", finalized)
        _webhook("invoice.voided", voided)
    _webhook("invoice.updated", voided)  # Stripe tells it again
    assert stripe_sync.push_pending_rollups() == 1  # the 5th hour's again, not the 7th's

    new_customer, new_subscription = _subscribed(endpoint)
    _invoice_the_rest(fake_stripe, new_subscription)
    costs = [rollup.cost_micro_dollars for rollup in UsageRollup.objects.order_by("hour_start")]
    assert _billed_usage(fake_stripe, old_customer) == 0 and fake_stripe.invoiced_usage(old_customer) == costs[0]
    assert _billed_usage(fake_stripe, new_customer) == costs[1] == _cost_pushed(fake_stripe, new_customer)
    assert not AuditEvent.objects.filter(action="billing.voided_invoice_pushed_again").exists()
    [audited] = AuditEvent.objects.filter(action="billing.voided_invoice_written_off")
    assert audited.details == {"invoice": invoice["id"], "customer": old_customer}
    [deletion] = AuditEvent.objects.filter(action="billing.customer_deleted")
    assert deletion.details["invoices_written_off"] == [invoice["id"]]


def test_usage_of_a_deleted_customers_invoice_voided_after_its_deletion_goes_again_to_the_next_once(fake_stripe):
    """The deletion finalised the draft that billed the 7th hour, so that hour stayed with the deleted customer. Before,
    once that invoice was voided (in the Dashboard: no card charges it), nobody owed the 7th hour, and no customer was
    billed it. It goes again to the organisation's customer of now, once, however often the void is told; audited."""
    endpoint = EndpointFactory()
    old_customer, old_subscription, draft = _invoiced_the_7th_hour(fake_stripe, endpoint)
    _use_and_push(endpoint, num_hours_ago=5)
    _webhook("customer.deleted", fake_stripe.delete_customer(old_customer))
    assert stripe_sync.push_pending_rollups() == 1  # the 5th hour's again, not the 7th's: its invoice bills it

    time.sleep(1 - time.time() % 1 + 0.01)  # voided a later second than the deletion
    voided = fake_stripe.void_invoice(draft["id"])
    fake_stripe.fail_next("500", path="/v1/invoices", method="GET")  # one try: Stripe sends the event again
    body = json.dumps({"id": "evt_voided", "object": "event", "type": "invoice.voided", "created": int(time.time()),
                       "data": {"object": voided}}).encode()
    refused = APIClient().post(WEBHOOK, body, content_type="application/json",
                               HTTP_STRIPE_SIGNATURE=sign_webhook(body, "whsec_test_secret"))
    assert refused.status_code == 503
    _webhook("invoice.voided", voided, event_id="evt_voided")
    _webhook("invoice.updated", voided)  # Stripe tells it twice
    assert stripe_sync.push_pending_rollups() == 1  # the 7th hour's again
    assert stripe_sync.push_pending_rollups() == 0

    new_customer, new_subscription = _subscribed(endpoint)
    _invoice_the_rest(fake_stripe, new_subscription)
    costs = sum(rollup.cost_micro_dollars for rollup in UsageRollup.objects.all())
    assert _billed_usage(fake_stripe, old_customer) == 0
    assert _billed_usage(fake_stripe, new_customer) == costs == _cost_pushed(fake_stripe, new_customer)
    [audited] = AuditEvent.objects.filter(action="billing.voided_invoice_pushed_again")
    assert audited.details["invoice"] == draft["id"] and audited.details["num_rollups_pushed_again"] == 1


def _billed_usage(fake_stripe, customer_id: str) -> int:
    """What the customer's invoices that bill (not void ones) billed, in units of the billed meter."""
    return sum(line["quantity"] for invoice in fake_stripe.invoices.values()
               if invoice["customer"] == customer_id and invoice["status"] != "void" for line in invoice["lines"]["data"]
               if fake_stripe.meter_of(line) == BILLED_METER_EVENT_NAME)


def test_an_invoice_webhook_that_comes_after_its_customers_deletion_is_mirrored_to_its_organisation_once(fake_stripe):
    """Before, an invoice not mirrored yet was found by its customer's account, which the deletion had cleared: its
    late `invoice.finalized` or `invoice.paid` was dropped, and the organisation's invoices missed it. The deleted
    customer keeps its organisation (`DeletedStripeCustomer`)."""
    endpoint = EndpointFactory()
    old_customer, old_subscription, invoice = _invoiced_the_7th_hour(fake_stripe, endpoint)
    fake_stripe.finalize_invoice(invoice["id"])
    _webhook("customer.deleted", fake_stripe.delete_customer(old_customer))

    paid = {**invoice, "status": "paid", "amount_paid": invoice["amount_due"]}
    _webhook("invoice.paid", paid, event_id="evt_paid_late")
    _webhook("invoice.paid", paid, event_id="evt_paid_late")  # delivered twice: applied once
    _webhook("invoice.paid", {**paid, "id": "in_of_someone_else", "customer": "cus_unknown"})

    [mirrored] = Invoice.objects.all()
    assert (mirrored.organization_id, mirrored.stripe_invoice_id, mirrored.status, mirrored.amount_paid) == (
        endpoint.organization_id, invoice["id"], "paid", invoice["amount_due"])
    assert DeletedStripeCustomer.objects.get(stripe_customer_id=old_customer).organization_id == endpoint.organization_id


def test_a_push_that_raced_its_customers_deletion_is_not_billed_again_when_the_deleted_customers_invoice_bills_it(
        fake_stripe, monkeypatch):
    """A push sends the 6th hour's events; before it records them pushed, Stripe invoices them (finalised), the
    customer is deleted and its webhook applied, which finds them billed. Before, the push, seeing the customer gone,
    pushed them again whatever its invoices billed: to the next customer, billed twice. It decides by the deleted
    customer's invoices as the deletion does, under the same lock."""
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=7)
    old_customer, old_subscription = _subscribed(endpoint)
    record_usage(usage_report(endpoint, finished_at=_hour(6) + timedelta(minutes=5)))
    rollup_usage()
    send = stripe_sync._push_meter_event

    def sent_then_invoiced_and_deleted(rollup, meter, *args):
        generation = send(rollup, meter, *args)
        if meter is stripe_sync.COST_METER:  # the rollup's last event is in Stripe; the push is not done
            _end_period_after_what_was_pushed(fake_stripe, old_subscription)
            [invoice] = fake_stripe.invoices.values()
            fake_stripe.finalize_invoice(invoice["id"])
            _webhook("customer.deleted", fake_stripe.delete_customer(old_customer))
        return generation

    monkeypatch.setattr(stripe_sync, "_push_meter_event", sent_then_invoiced_and_deleted)
    assert stripe_sync.push_pending_rollups() == 1  # billed by the deleted customer's invoice
    monkeypatch.undo()
    assert stripe_sync.push_pending_rollups() == 0  # nothing goes again

    assert BillingAccount.objects.get(organization=endpoint.organization).stripe_customer_id == ""
    costs = sum(rollup.cost_micro_dollars for rollup in UsageRollup.objects.all())
    assert fake_stripe.invoiced_usage(old_customer) == costs
    assert list(fake_stripe.customers) == []  # no next customer, billed nothing


def _deleted_once_read(monkeypatch, customer_id: str, delete) -> None:
    """Stripe deletes `customer_id` (`delete()`) once a push has read it, before it sends its events."""
    read_customer = stripe_sync.ensure_customer

    def read_then_deleted(organization_id):
        read = read_customer(organization_id)
        if read == customer_id:
            delete()
        return read

    monkeypatch.setattr(stripe_sync, "ensure_customer", read_then_deleted)


def _cost_pushed(fake_stripe, customer_id: str) -> int:
    return sum(int(event["payload"]["value"]) for event in fake_stripe.meter_events.values()
               if event["payload"]["stripe_customer_id"] == customer_id and event["event_name"] == "inferplane_usage_cost")


@pytest.fixture(autouse=True)
def _period_grace_kept(monkeypatch):
    """`LATEST_PERIOD_GRACE` as it was before the test, whatever `_end_period_after_what_was_pushed` took off it."""
    monkeypatch.setattr(stripe_sync, "LATEST_PERIOD_GRACE", stripe_sync.LATEST_PERIOD_GRACE)


def _end_period_after_what_was_pushed(fake_stripe, subscription_id: str) -> int:
    """End the subscription's period (its invoice made) just after the meter events sent so far, so that an event
    sent now is dated after it (events are dated up to `LATEST_PERIOD_GRACE` back). Returns the period's end.

    NOTE: the grace is shortened by the whole seconds an event sent now would still be dated before the end, as the
    passing of those seconds would date it (waited for, they cost ~1.5 s a call, 14 s of this module)."""
    end = max(event["timestamp"] for event in fake_stripe.meter_events.values()) + 1
    fake_stripe.end_period(subscription_id, at=end)
    short_by_s = end - int(time.time() - stripe_sync.LATEST_PERIOD_GRACE.total_seconds())
    if short_by_s > 0:
        stripe_sync.LATEST_PERIOD_GRACE -= timedelta(seconds=short_by_s)
    return end


def _invoiced_the_7th_hour(fake_stripe, endpoint) -> tuple[str, str, dict]:
    """The 7th hour pushed, and its subscription's period ended just after it: its customer, its subscription and the
    invoice of that period (a draft)."""
    _use_and_push(endpoint, num_hours_ago=7)
    customer, subscription = _subscribed(endpoint)
    _end_period_after_what_was_pushed(fake_stripe, subscription)
    [invoice] = fake_stripe.invoices.values()
    return customer, subscription, invoice


def _subscribed(endpoint) -> tuple[str, str]:
    account = BillingAccount.objects.get(organization=endpoint.organization)
    return account.stripe_customer_id, account.stripe_subscription_id


def _invoice_the_rest(fake_stripe, subscription_id: str) -> None:
    fake_stripe.end_period(subscription_id, at=int(time.time()) + 1)


def test_usage_of_a_period_cancelled_at_once_without_an_invoice_is_billed_by_the_next_subscription(fake_stripe):
    # Cancelled at once (by Stripe after failed payments, in the Dashboard, or in a Customer Portal configured so),
    # a subscription bills none of its unfinished period's usage (`invoice_now` defaults to false). The next one
    # started at its end: that usage, pushed already or pushed after, was billed by no invoice.
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=6)
    customer, first = _subscribed(endpoint)
    invoiced_until = _end_period_after_what_was_pushed(fake_stripe, first)
    _use_and_push(endpoint, num_hours_ago=5)  # in the period the cancellation cuts short

    _webhook("customer.subscription.deleted", fake_stripe.cancel_subscription(first))
    _use_and_push(endpoint, num_hours_ago=4)

    _, second = _subscribed(endpoint)
    assert second != first and fake_stripe.subscriptions[second]["start_date"] == invoiced_until
    _invoice_the_rest(fake_stripe, second)
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0


@pytest.mark.parametrize("num_invoice_items", [1, 10])
def test_a_subscription_cancelled_at_once_is_followed_from_its_usage_line_whatever_its_invoice_items(
        fake_stripe, num_invoice_items):
    # One-off invoice items made after the period's usage (now, hours after it) are pulled into its invoice, ahead of
    # the usage price's line: each line's period is its item's creation. Before, every line shown counted, so the next
    # subscription started at the items' creation (or, with ten of them, the usage line 11th and not shown, at nothing
    # of the usage at all): the usage between the period's end and then was billed by no invoice. Only the usage
    # price's lines count now, all of them read.
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=6)
    customer, first = _subscribed(endpoint)
    for _ in range(num_invoice_items):
        fake_stripe.add_invoice_item(customer, amount=500)
    invoiced_until = _end_period_after_what_was_pushed(fake_stripe, first)
    [invoice] = fake_stripe.invoices.values()
    assert len(invoice["lines"]["data"]) == num_invoice_items + 1
    assert all(line["period"]["end"] > invoiced_until for line in invoice["lines"]["data"][:-1])
    _use_and_push(endpoint, num_hours_ago=5)  # in the period the cancellation cuts short

    _webhook("customer.subscription.deleted", fake_stripe.cancel_subscription(first))
    _use_and_push(endpoint, num_hours_ago=4)

    _, second = _subscribed(endpoint)
    assert second != first and fake_stripe.subscriptions[second]["start_date"] == invoiced_until
    _invoice_the_rest(fake_stripe, second)
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0


def test_a_subscription_cancelled_at_once_is_followed_from_its_usage_line_when_its_lines_state_no_price(fake_stripe):
    """Stripe's invoice line may state no price (its `pricing` is null; pricing of other kinds, rate cards, comes as
    another `pricing.type`): its `parent` names the subscription item or invoice item that made it. Before, such a line
    was skipped: the ended subscription counted as having invoiced nothing, the next one began at its start, and the
    6th hour, billed by the first's invoice, was billed again by the next. The usage line is placed by its subscription
    item now, and a one-off invoice item's line (made after the period, pulled in ahead of it) counts for nothing."""
    endpoint = EndpointFactory()
    fake_stripe.line_prices_shown = False
    _use_and_push(endpoint, num_hours_ago=6)
    customer, first = _subscribed(endpoint)
    fake_stripe.add_invoice_item(customer, amount=500)
    invoiced_until = _end_period_after_what_was_pushed(fake_stripe, first)
    [invoice] = fake_stripe.invoices.values()
    assert [line["pricing"] is None for line in invoice["lines"]["data"]] == [False, True]
    _use_and_push(endpoint, num_hours_ago=5)  # in the period the cancellation cuts short

    _webhook("customer.subscription.deleted", fake_stripe.cancel_subscription(first))
    _use_and_push(endpoint, num_hours_ago=4)

    _, second = _subscribed(endpoint)
    _invoice_the_rest(fake_stripe, second)
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0
    assert second != first and fake_stripe.subscriptions[second]["start_date"] == invoiced_until


def test_a_line_whose_price_nothing_tells_holds_back_the_next_subscription_and_no_other_organisations_push(
        fake_stripe):
    # A guard: a line of the ended subscription's invoice that states no price and no parent cannot be placed: a guess
    # bills its usage twice or never, so the next subscription is not made, the push fails visibly and is retried,
    # and the run goes on with other organisations' rollups.
    endpoint, other = EndpointFactory(), EndpointFactory()
    fake_stripe.line_prices_shown = False
    _use_and_push(endpoint, num_hours_ago=6)
    customer, first = _subscribed(endpoint)
    _end_period_after_what_was_pushed(fake_stripe, first)
    [invoice] = fake_stripe.invoices.values()
    invoice["lines"]["data"][0]["parent"] = None
    _webhook("customer.subscription.deleted", fake_stripe.cancel_subscription(first))
    record_usage(usage_report(endpoint, finished_at=_hour(5) + timedelta(minutes=5)))
    record_usage(usage_report(other, finished_at=_hour(5) + timedelta(minutes=5)))
    rollup_usage()

    assert stripe_sync.push_pending_rollups() == 1  # the other organisation's
    stuck = UsageRollup.objects.get(organization=endpoint.organization, hour_start=_hour(5))
    assert stuck.pushed_at is None and invoice["id"] in stuck.push_error
    assert _subscribed(endpoint) == (customer, "")


def test_a_subscription_cancelled_at_once_is_followed_from_its_usage_line_past_its_first_ten_items(fake_stripe):
    """The ended subscription has 11 items (staff added metered prices) and its invoice's lines state no price: each is
    placed by its subscription item's price. Stripe's subscription shows its first 10 items (`items.has_more`). Before,
    only those were read: the 11th item's line could not be placed, and the next subscription was never made, the
    push failing every run. The items are listed page by page now."""
    endpoint = EndpointFactory()
    fake_stripe.line_prices_shown = False
    _use_and_push(endpoint, num_hours_ago=6)
    customer, first = _subscribed(endpoint)
    for _ in range(10):
        fake_stripe.add_subscription_item(first, meter="inferplane_input_tokens")
    invoiced_until = _end_period_after_what_was_pushed(fake_stripe, first)
    _use_and_push(endpoint, num_hours_ago=5)  # in the period the cancellation cuts short

    _webhook("customer.subscription.deleted", fake_stripe.cancel_subscription(first))
    _use_and_push(endpoint, num_hours_ago=4)

    _, second = _subscribed(endpoint)
    _invoice_the_rest(fake_stripe, second)
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0
    assert second != first and fake_stripe.subscriptions[second]["start_date"] == invoiced_until
    assert fake_stripe.calls_to("/v1/subscription_items", method="GET")


def test_a_line_of_an_item_deleted_since_is_held_for_an_operator_after_some_runs_not_retried_for_ever(
        fake_stripe, client):
    """The ended subscription's invoice has a line that states no price, of an item staff deleted since (a price
    swapped): Stripe answers 404 for it, and no list has it, so where its invoices stopped cannot be told. Before, the
    push failed every run for ever (an ERROR line each). After `UNKNOWN_LINES_HOLD_AFTER` runs the rollup is held for an
    operator: audited, listed in the admin, and tried no more until sent again from there."""
    endpoint = EndpointFactory()
    fake_stripe.line_prices_shown = False
    _use_and_push(endpoint, num_hours_ago=6)
    customer, first = _subscribed(endpoint)
    swapped = fake_stripe.add_subscription_item(first, meter="inferplane_input_tokens")
    _end_period_after_what_was_pushed(fake_stripe, first)
    fake_stripe.remove_subscription_item(first, swapped["id"])
    _webhook("customer.subscription.deleted", fake_stripe.cancel_subscription(first))
    record_usage(usage_report(endpoint, finished_at=_hour(5) + timedelta(minutes=5)))
    rollup_usage()

    for _ in range(stripe_sync.UNKNOWN_LINES_HOLD_AFTER):
        assert stripe_sync.push_pending_rollups() == 0
    stuck = UsageRollup.objects.get(hour_start=_hour(5))
    assert stuck.pushed_at is None and stuck.push_held_at is not None and "held for an operator" in stuck.push_error
    [audited] = AuditEvent.objects.filter(action="billing.push_held_unknown_invoice_lines")
    assert audited.details["rollups"] == [stuck.pk]
    num_calls = len(fake_stripe.calls)
    assert stripe_sync.push_pending_rollups() == 0
    assert len(fake_stripe.calls) == num_calls  # held: not tried again

    sign_in_staff(client, get_user_model().objects.create_superuser("ops@example.test", "ops@example.test",
                                                                    "a long passphrase"))
    listed = client.get("/django-admin/billing/usagerollup/", {"push_held_at__isnull": "False"})
    assert listed.status_code == 200 and "held for an operator" in listed.content.decode()


def _held_for_unknown_invoice_lines(fake_stripe, endpoint, *, num_runs: int) -> tuple[UsageRollup, dict]:
    """The 5th hour's rollup after `num_runs` push runs that failed for a line of the ended subscription's invoice
    whose price cannot be told (an item deleted since), and that item."""
    fake_stripe.line_prices_shown = False
    _use_and_push(endpoint, num_hours_ago=6)
    customer, first = _subscribed(endpoint)
    swapped = fake_stripe.add_subscription_item(first, meter="inferplane_input_tokens")
    _end_period_after_what_was_pushed(fake_stripe, first)
    fake_stripe.remove_subscription_item(first, swapped["id"])
    _webhook("customer.subscription.deleted", fake_stripe.cancel_subscription(first))
    record_usage(usage_report(endpoint, finished_at=_hour(5) + timedelta(minutes=5)))
    rollup_usage()
    for _ in range(num_runs):
        assert stripe_sync.push_pending_rollups() == 0
    return UsageRollup.objects.get(hour_start=_hour(5)), swapped


def _lines_state_their_prices(fake_stripe, deleted_item: dict) -> None:
    """Every invoice line states its price again (Stripe tells what it could not)."""
    prices = {deleted_item["id"]: deleted_item["price"]} | {
        item["id"]: item["price"] for subscription in fake_stripe.subscriptions.values()
        for item in subscription["items"]["data"]}
    for invoice in fake_stripe.invoices.values():
        for line in invoice["lines"]["data"]:
            if line["pricing"] is None:
                item_id = line["parent"]["subscription_item_details"]["subscription_item"]
                line["pricing"] = stripe_server._pricing(prices[item_id])


def test_a_rollup_held_for_unknown_invoice_lines_cannot_be_confirmed_as_in_stripe(fake_stripe, client):
    """Held for an invoice line whose price cannot be told, a rollup sent Stripe nothing. Before, the admin's "Stripe
    HAS the meter event" confirmed it: an event Stripe never received was recorded as accepted (usage billed by
    nobody), and its failure count, kept, held it again after one more run. Now it is skipped, with a message."""
    endpoint = EndpointFactory()
    stuck, _ = _held_for_unknown_invoice_lines(fake_stripe, endpoint, num_runs=stripe_sync.UNKNOWN_LINES_HOLD_AFTER)
    assert stuck.push_held_at is not None

    sign_in_staff(client, get_user_model().objects.create_superuser("ops@example.test", "ops@example.test",
                                                                    "a long passphrase"))
    confirmed = client.post("/django-admin/billing/usagerollup/", {"action": "confirm_held",
                                                                    "_selected_action": [stuck.pk]}, follow=True)
    assert not MeterEventPush.objects.filter(rollup=stuck).exists()  # nothing recorded as in Stripe
    assert UsageRollup.objects.get(pk=stuck.pk).push_held_at is not None
    assert confirmed.status_code == 200 and "were not confirmed" in confirmed.content.decode()


def test_failures_for_unknown_invoice_lines_count_in_a_row(fake_stripe):
    """A rollup is held for an operator after `UNKNOWN_LINES_HOLD_AFTER` runs in a row that failed for an invoice
    line whose price cannot be told. Before, the count never started again: a rollup sent again (`push_again`)
    after some such failures was held at its first failure since."""
    endpoint = EndpointFactory()
    rollup, deleted_item = _held_for_unknown_invoice_lines(fake_stripe, endpoint,
                                                           num_runs=stripe_sync.UNKNOWN_LINES_HOLD_AFTER - 1)
    assert rollup.push_held_at is None
    services.push_again(UsageRollup.objects.filter(pk=rollup.pk))
    assert stripe_sync.push_pending_rollups() == 0
    assert UsageRollup.objects.get(pk=rollup.pk).push_held_at is None  # one failure since: not held

    _lines_state_their_prices(fake_stripe, deleted_item)
    assert stripe_sync.push_pending_rollups() == 1
    assert UsageRollup.objects.get(pk=rollup.pk).num_unknown_lines_failures == 0


def _written_off_once(fake_stripe, customer_id: str) -> None:
    """Every unit of usage pushed to the customer is on one of its invoices, once; a void one's (some) are forgiven."""
    assert fake_stripe.invoiced_usage(customer_id) == _cost_pushed(fake_stripe, customer_id)
    assert 0 < _billed_usage(fake_stripe, customer_id) < _cost_pushed(fake_stripe, customer_id)


def test_usage_of_a_void_invoice_of_a_subscription_cancelled_at_once_is_written_off_not_billed_by_the_next(
        fake_stripe):
    # A live customer's void invoice is a staff write-off (`billing.models.WRITTEN_OFF_INVOICE_STATUS`): its lines count
    # where the ended subscription's invoices stopped. Before, the next subscription started at its period's start,
    # and billed again the usage staff had forgiven.
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=6)
    customer, first = _subscribed(endpoint)
    invoiced_until = _end_period_after_what_was_pushed(fake_stripe, first)
    [invoice] = [invoice for invoice in fake_stripe.invoices.values() if invoice["customer"] == customer]
    fake_stripe.finalize_invoice(invoice["id"])
    fake_stripe.void_invoice(invoice["id"])  # in the Dashboard
    _use_and_push(endpoint, num_hours_ago=5)

    _webhook("customer.subscription.deleted", fake_stripe.cancel_subscription(first))
    _use_and_push(endpoint, num_hours_ago=4)

    _, second = _subscribed(endpoint)
    assert second != first and fake_stripe.subscriptions[second]["start_date"] == invoiced_until
    _invoice_the_rest(fake_stripe, second)
    _written_off_once(fake_stripe, customer)


def test_a_subscription_cancelled_before_its_first_invoice_is_followed_by_one_from_its_start(fake_stripe):
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=6)
    customer, first = _subscribed(endpoint)

    _webhook("customer.subscription.deleted", fake_stripe.cancel_subscription(first))
    _use_and_push(endpoint, num_hours_ago=5)

    _, second = _subscribed(endpoint)
    assert fake_stripe.subscriptions[second]["start_date"] == fake_stripe.subscriptions[first]["start_date"]
    _invoice_the_rest(fake_stripe, second)
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0


def test_a_subscription_cancelled_at_once_with_its_usage_invoiced_is_not_billed_again(fake_stripe):
    # A guard: what the cancellation invoiced (`invoice_now`) the next subscription does not bill again.
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=6)
    customer, first = _subscribed(endpoint)
    _end_period_after_what_was_pushed(fake_stripe, first)
    _use_and_push(endpoint, num_hours_ago=5)

    cancelled = fake_stripe.cancel_subscription(first, invoice_now=True)
    _webhook("customer.subscription.deleted", cancelled)
    _use_and_push(endpoint, num_hours_ago=4)

    _, second = _subscribed(endpoint)
    assert fake_stripe.subscriptions[second]["start_date"] == cancelled["ended_at"]
    _invoice_the_rest(fake_stripe, second)
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0


@pytest.mark.parametrize("final_invoice_made", [True, False])
def test_a_subscription_cancelled_at_its_period_end_is_followed_by_one_from_that_end_and_usage_is_billed_once(
        fake_stripe, final_invoice_made):
    # A guard: cancelled at the period's end, a subscription bills that period's usage in a final invoice then; the
    # next one starts there, whether that invoice is made already when the ended one's invoices are read or not yet.
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=6)
    customer, first = _subscribed(endpoint)
    _webhook("customer.subscription.updated", fake_stripe.cancel_at_period_end(first))  # still live: nothing changes
    assert _subscribed(endpoint)[1] == first
    _use_and_push(endpoint, num_hours_ago=5)

    ended_at = _end_period_after_what_was_pushed(fake_stripe, first)
    _webhook("customer.subscription.deleted", fake_stripe.subscriptions[first])
    [final] = fake_stripe.invoices.values()
    if not final_invoice_made:
        del fake_stripe.invoices[final["id"]]
    _use_and_push(endpoint, num_hours_ago=4)
    fake_stripe.invoices[final["id"]] = final

    _, second = _subscribed(endpoint)
    assert fake_stripe.subscriptions[first]["ended_at"] == ended_at == fake_stripe.subscriptions[second]["start_date"]
    _invoice_the_rest(fake_stripe, second)
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0


def test_usage_of_a_void_final_invoice_of_a_subscription_cancelled_at_its_period_end_is_written_off(fake_stripe):
    # A live customer's void final invoice is a staff write-off: the next subscription starts at the ended one's end.
    # Before (fix-stripe6), it started at the void invoice's start, and billed again the usage staff had forgiven.
    endpoint = EndpointFactory()
    customer, first, ended_at, final = _cancelled_at_its_period_end(fake_stripe, endpoint)
    fake_stripe.finalize_invoice(final["id"])
    fake_stripe.void_invoice(final["id"])  # in the Dashboard; its webhook not sent yet

    _webhook("customer.subscription.deleted", fake_stripe.subscriptions[first])
    _use_and_push(endpoint, num_hours_ago=4)

    _, second = _subscribed(endpoint)
    assert fake_stripe.subscriptions[second]["start_date"] == ended_at
    _invoice_the_rest(fake_stripe, second)
    _written_off_once(fake_stripe, customer)


def test_a_final_invoice_voided_after_the_next_subscription_began_is_written_off_once(fake_stripe):
    # A live customer's void invoice, of an earlier subscription too, is a staff write-off: forgiven, audited once
    # however often Stripe tells the void, nothing pushed again. Before (fix-stripe6), its usage went again to the next
    # subscription, which billed what staff had forgiven.
    endpoint = EndpointFactory()
    customer, first, ended_at, final = _cancelled_at_its_period_end(fake_stripe, endpoint)
    _webhook("invoice.finalized", fake_stripe.finalize_invoice(final["id"]))
    _webhook("customer.subscription.deleted", fake_stripe.subscriptions[first])
    _use_and_push(endpoint, num_hours_ago=4)
    _, second = _subscribed(endpoint)
    assert fake_stripe.subscriptions[second]["start_date"] == ended_at

    voided = fake_stripe.void_invoice(final["id"])
    _webhook("invoice.voided", voided)
    _webhook("invoice.updated", voided)  # Stripe tells it twice
    assert stripe_sync.push_pending_rollups() == 0

    _invoice_the_rest(fake_stripe, second)
    _written_off_once(fake_stripe, customer)
    assert not AuditEvent.objects.filter(action="billing.voided_invoice_pushed_again").exists()
    [audited] = AuditEvent.objects.filter(action="billing.voided_invoice_written_off")
    assert audited.details == {"invoice": final["id"], "customer": customer}


def _cancelled_at_its_period_end(fake_stripe, endpoint) -> tuple[str, str, int, dict]:
    """The 6th and 5th hours pushed to a subscription cancelled at its period's end, which then ends, its final invoice
    made (a draft): its customer, its id, its end and that invoice."""
    _use_and_push(endpoint, num_hours_ago=6)
    customer, subscription = _subscribed(endpoint)
    _webhook("customer.subscription.updated", fake_stripe.cancel_at_period_end(subscription))
    _use_and_push(endpoint, num_hours_ago=5)
    ended_at = _end_period_after_what_was_pushed(fake_stripe, subscription)
    [final] = fake_stripe.invoices.values()
    return customer, subscription, ended_at, final


def test_a_void_invoice_of_a_subscription_still_billing_sends_nothing_again(fake_stripe):
    # A guard: an invoice of the subscription that bills now, voided (forgiven in the Dashboard), is left to Stripe.
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=6)
    _, first = _subscribed(endpoint)
    _end_period_after_what_was_pushed(fake_stripe, first)
    [invoice] = fake_stripe.invoices.values()
    fake_stripe.finalize_invoice(invoice["id"])
    _webhook("invoice.voided", fake_stripe.void_invoice(invoice["id"]))
    assert stripe_sync.push_pending_rollups() == 0
    assert not AuditEvent.objects.filter(action="billing.voided_invoice_pushed_again").exists()
    assert AuditEvent.objects.filter(action="billing.voided_invoice_written_off").count() == 1


@pytest.mark.parametrize(("received", "deletion_applied"), [("before_the_deletion", "after_the_push"),
                                                             ("after_the_deletion", "after_the_push"),
                                                             ("after_the_deletion", "during_the_push")])
def test_usage_stripe_received_in_its_customers_deletions_own_second_is_billed_once(
        fake_stripe, monkeypatch, received, deletion_applied):
    """Stripe's clock says only the second: the 6th hour's events and the customer's deletion share one, and the events
    are dated within the period of the draft that the deletion finalises. Received before the deletion, that invoice
    bills them; after it, Stripe dropped them. Before, they counted as received before whatever: after the deletion,
    billed by no customer. The deleted customer's invoices, as Stripe finalised them, say which (`quantity`): they go
    again only if dropped, so neither billed twice nor lost."""
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=7)
    old_customer, old_subscription = _subscribed(endpoint)
    record_usage(usage_report(endpoint, finished_at=_hour(6) + timedelta(minutes=5)))
    rollup_usage()
    fake_stripe.end_period(old_subscription, at=int(time.time()) + 60)  # its draft bills the 7th hour, and the 6th's date
    second = int(time.time()) + 2
    fake_stripe.frozen_s = second  # the deletion and the 6th hour's events in one second of Stripe's clock

    def deleted() -> None:
        _webhook("customer.deleted", fake_stripe.delete_customer(old_customer), created=second)

    if deletion_applied == "during_the_push":
        _deleted_once_read(monkeypatch, old_customer, deleted)
        assert stripe_sync.push_pending_rollups() == 0  # sent to the deleted customer, and to go again
        monkeypatch.undo()
    else:
        if received == "after_the_deletion":
            gone = fake_stripe.delete_customer(old_customer)
            assert stripe_sync.push_pending_rollups() == 1  # its webhook not come yet
            _webhook("customer.deleted", gone, created=second)
        else:
            assert stripe_sync.push_pending_rollups() == 1
            deleted()
    fake_stripe.frozen_s = None
    assert {push.stripe_created_at.timestamp() for push in MeterEventPush.objects.filter(
        rollup__hour_start=_hour(6))} == {second}
    assert DeletedStripeCustomer.objects.get(stripe_customer_id=old_customer).invoiced_until.timestamp() > max(
        event["timestamp"] for event in fake_stripe.meter_events.values())

    _billed_once(fake_stripe, endpoint, old_customer, dropped=received == "after_the_deletion")
    [deletion] = AuditEvent.objects.filter(action="billing.customer_deleted")
    placed_by_the_push = AuditEvent.objects.filter(action="billing.pushed_to_deleted_customer")
    if deletion_applied == "during_the_push":
        assert [audited.details["num_events_dropped_in_its_second"] for audited in placed_by_the_push] == [1]
    else:
        assert deletion.details["num_events_dropped_in_its_second"] == (1 if received == "after_the_deletion" else 0)
        assert not placed_by_the_push.exists()
    assert deletion.details["num_events_undecided_in_its_second"] == 0


def _billed_once(fake_stripe, endpoint, old_customer: str, *, dropped: bool) -> None:
    """The 7th and 6th hours billed once: by the deleted customer's invoice, or the 6th, `dropped` by Stripe in the
    deletion's second, sent again and billed by the next customer."""
    assert stripe_sync.push_pending_rollups() == (1 if dropped else 0)
    assert stripe_sync.push_pending_rollups() == 0
    costs = [rollup.cost_micro_dollars for rollup in UsageRollup.objects.order_by("hour_start")]
    new_customer, new_subscription = _subscribed(endpoint)
    if dropped:
        _invoice_the_rest(fake_stripe, new_subscription)
        assert _billed_usage(fake_stripe, old_customer) == costs[0]
        assert _billed_usage(fake_stripe, new_customer) == costs[1] == _cost_pushed(fake_stripe, new_customer)
    else:
        assert _billed_usage(fake_stripe, old_customer) == sum(costs) and new_customer == ""


def test_usage_of_an_invoice_voided_after_its_customers_deletion_goes_again_though_the_void_was_told_first(
        fake_stripe):
    """Stripe deleted the customer, then its invoice of the 7th hour was voided, and the void's webhook came before the
    deletion's: taken then for a live customer's write-off. Before, the deletion counted the 7th hour billed, as the
    later invoice of the 5th hour ends after it: billed by no customer. Stripe's clock dates the void after the
    deletion (`voided_at`): the deletion sends the 7th hour again, once."""
    endpoint = EndpointFactory()
    old_customer, old_subscription, first = _invoiced_the_7th_hour(fake_stripe, endpoint)
    _webhook("invoice.finalized", fake_stripe.finalize_invoice(first["id"]))
    _use_and_push(endpoint, num_hours_ago=5)
    _end_period_after_what_was_pushed(fake_stripe, old_subscription)
    [second] = [invoice for invoice in fake_stripe.invoices.values() if invoice["id"] != first["id"]]
    _webhook("invoice.finalized", fake_stripe.finalize_invoice(second["id"]))  # it bills the 5th hour

    deleted_at = fake_stripe.frozen_s = int(time.time())
    gone = fake_stripe.delete_customer(old_customer)
    fake_stripe.frozen_s = None
    while int(time.time()) <= deleted_at:  # voided a later second
        time.sleep(0.05)
    _webhook("invoice.voided", fake_stripe.void_invoice(first["id"]))
    _webhook("customer.deleted", gone, created=deleted_at)
    assert stripe_sync.push_pending_rollups() == 1  # the 7th hour's again
    assert stripe_sync.push_pending_rollups() == 0

    new_customer, new_subscription = _subscribed(endpoint)
    _invoice_the_rest(fake_stripe, new_subscription)
    costs = [rollup.cost_micro_dollars for rollup in UsageRollup.objects.order_by("hour_start")]
    assert _billed_usage(fake_stripe, old_customer) == costs[1]
    assert _billed_usage(fake_stripe, new_customer) == costs[0] == _cost_pushed(fake_stripe, new_customer)
    [audited] = AuditEvent.objects.filter(action="billing.voided_invoice_pushed_again")
    assert audited.details["invoice"] == first["id"] and audited.details["num_rollups_pushed_again"] == 1


def test_an_invoice_voided_in_its_customers_deletions_second_that_the_deletion_saw_billing_goes_again(fake_stripe):
    """Stripe deleted the customer, then its invoice of the 7th hour was voided in the same second of Stripe's clock.
    Before, a void in the deletion's own second was a write-off by rule: the 7th hour, voided after the deletion, was
    billed by no customer. The deletion's webhook read that invoice after the deletion and saw it open: it was voided
    after, whatever the second; its usage goes again, once, to the next customer."""
    endpoint = EndpointFactory()
    old_customer, old_subscription, invoice = _invoiced_the_7th_hour(fake_stripe, endpoint)
    _webhook("invoice.finalized", fake_stripe.finalize_invoice(invoice["id"]))
    _use_and_push(endpoint, num_hours_ago=5)  # after the invoice: goes again by the deletion

    deleted_at = fake_stripe.frozen_s = int(time.time())
    _webhook("customer.deleted", fake_stripe.delete_customer(old_customer), created=deleted_at)
    voided = fake_stripe.void_invoice(invoice["id"])
    fake_stripe.frozen_s = None
    assert voided["status_transitions"]["voided_at"] == deleted_at
    _webhook("invoice.voided", voided)
    _webhook("invoice.updated", voided)  # told twice
    assert stripe_sync.push_pending_rollups() == 2  # the 5th hour's and the 7th's again
    assert stripe_sync.push_pending_rollups() == 0

    new_customer, new_subscription = _subscribed(endpoint)
    _invoice_the_rest(fake_stripe, new_subscription)
    costs = sum(rollup.cost_micro_dollars for rollup in UsageRollup.objects.all())
    assert _billed_usage(fake_stripe, new_customer) == costs == _cost_pushed(fake_stripe, new_customer)
    assert _billed_usage(fake_stripe, old_customer) == 0
    assert not AuditEvent.objects.filter(action=services.HELD_AUDIT_ACTION).exists()
    [audited] = AuditEvent.objects.filter(action="billing.voided_invoice_pushed_again")
    assert audited.details["invoice"] == invoice["id"]


@pytest.mark.parametrize("void_told", ["before_the_deletion", "after_the_deletion"])
@pytest.mark.parametrize("decided", ["written_off", "voided_after"])
def test_an_invoice_voided_in_its_customers_deletions_second_that_nothing_orders_is_held_for_an_operator(
        fake_stripe, void_told, decided):
    """The invoice of the 7th hour was voided and its customer deleted in one second of Stripe's clock, and the
    deletion's read saw it void: nothing Stripe keeps orders the two. Before, it was a write-off by rule, silently: had
    the void come after the deletion, the 7th hour was billed by no customer. Its usage is held for an operator now
    (audited, listed in the admin), who decides: written off (nothing billed) or voided after (billed once, by the
    next customer). Told again, the void holds nothing more."""
    endpoint = EndpointFactory()
    old_customer, old_subscription, invoice = _invoiced_the_7th_hour(fake_stripe, endpoint)
    _webhook("invoice.finalized", fake_stripe.finalize_invoice(invoice["id"]))

    deleted_at = fake_stripe.frozen_s = int(time.time())
    voided = fake_stripe.void_invoice(invoice["id"])
    gone = fake_stripe.delete_customer(old_customer)
    fake_stripe.frozen_s = None
    if void_told == "before_the_deletion":
        _webhook("invoice.voided", voided)
    _webhook("customer.deleted", gone, created=deleted_at)
    _webhook("invoice.updated" if void_told == "before_the_deletion" else "invoice.voided", voided)
    assert stripe_sync.push_pending_rollups() == 0

    [held] = UsageRollup.objects.filter(push_held_at__isnull=False)
    assert held.hour_start == _hour(7) and invoice["id"] in held.push_error
    [audited] = AuditEvent.objects.filter(action=services.HELD_AUDIT_ACTION)
    assert audited.details["invoice"] == invoice["id"] and audited.details["rollups"] == [held.pk]
    [deletion] = AuditEvent.objects.filter(action="billing.customer_deleted")
    assert deletion.details["invoices_held"] == [invoice["id"]] and deletion.details["invoices_written_off"] == []

    operator = Actor(user=get_user_model().objects.create_superuser("ops@example.test", "ops@example.test",
                                                                    "a long passphrase"))
    if decided == "written_off":
        assert services.keep_held(operator, UsageRollup.objects.all()) == 1
    else:
        assert services.send_held_again(operator, UsageRollup.objects.all()) == 1
    _webhook("invoice.updated", voided)  # told again: the decision stands
    assert stripe_sync.push_pending_rollups() == (1 if decided == "voided_after" else 0)
    assert not UsageRollup.objects.filter(push_held_at__isnull=False).exists()
    new_customer, new_subscription = _subscribed(endpoint)
    [cost] = [rollup.cost_micro_dollars for rollup in UsageRollup.objects.all()]
    assert _billed_usage(fake_stripe, old_customer) == 0
    if decided == "voided_after":
        _invoice_the_rest(fake_stripe, new_subscription)
        assert _billed_usage(fake_stripe, new_customer) == cost == _cost_pushed(fake_stripe, new_customer)
    else:
        assert new_customer == ""


@pytest.mark.parametrize("voided", ["in_the_deletions_second", "a_later_second"])
def test_an_invoice_voided_between_the_deletions_read_and_its_record_goes_again_once(fake_stripe, monkeypatch, voided):
    """The deletion's webhook read the customer's invoices (after the deletion: the 7th hour's open), then staff voided
    that invoice, and the void's webhook was applied before the deletion's transaction: taken then for a live
    customer's write-off (no deletion recorded yet). Before, the deletion counted the 7th hour billed by that invoice,
    as read, so neither its "voided after" nor its "voided in its second" path sent it: billed by no customer (a
    review's proof). Voided after the deletion's read, it was voided after the deletion: the 7th hour goes again once,
    to the next customer, and the write-off is overruled, audited."""
    endpoint = EndpointFactory()
    old_customer, old_subscription, invoice = _invoiced_the_7th_hour(fake_stripe, endpoint)
    _webhook("invoice.finalized", fake_stripe.finalize_invoice(invoice["id"]))

    deleted_at = fake_stripe.frozen_s = int(time.time())
    gone = fake_stripe.delete_customer(old_customer)
    read = stripe_sync.deleted_customer_invoices

    def read_then_voided(customer_id, **kwargs):
        found = read(customer_id, **kwargs)  # the invoice open, after the deletion
        if voided == "a_later_second":
            fake_stripe.frozen_s = deleted_at + 1
        voided_invoice = fake_stripe.void_invoice(invoice["id"])
        _webhook("invoice.voided", voided_invoice)  # applied before the deletion's transaction
        return found

    monkeypatch.setattr(stripe_sync, "deleted_customer_invoices", read_then_voided)
    _webhook("customer.deleted", gone, created=deleted_at)
    monkeypatch.undo()
    fake_stripe.frozen_s = None
    assert stripe_sync.push_pending_rollups() == 1  # the 7th hour's again, by the deletion
    _webhook("invoice.updated", fake_stripe.invoices[invoice["id"]])  # the void told again: nothing more
    assert stripe_sync.push_pending_rollups() == 0
    assert not UsageRollup.objects.filter(push_held_at__isnull=False).exists()

    new_customer, new_subscription = _subscribed(endpoint)
    _invoice_the_rest(fake_stripe, new_subscription)
    [cost] = [rollup.cost_micro_dollars for rollup in UsageRollup.objects.all()]
    assert _billed_usage(fake_stripe, old_customer) == 0
    assert _billed_usage(fake_stripe, new_customer) == cost == _cost_pushed(fake_stripe, new_customer)
    [audited] = AuditEvent.objects.filter(action="billing.voided_invoice_pushed_again")
    assert audited.details["invoice"] == invoice["id"] and audited.details["write_off_overruled"] is True


def _the_6th_hour_in_the_deletions_second(fake_stripe, endpoint, *, received: str) -> tuple[str, dict, dict, int]:
    """The 7th hour pushed and on a draft whose period the 6th hour's date is in too; the 6th hour pushed in the second
    its customer is deleted in Stripe, `received` before or after the deletion; Stripe's clock held at that second.
    The customer, the draft, the deletion's webhook object and its second."""
    _use_and_push(endpoint, num_hours_ago=7)
    old_customer, old_subscription = _subscribed(endpoint)
    record_usage(usage_report(endpoint, finished_at=_hour(6) + timedelta(minutes=5)))
    rollup_usage()
    fake_stripe.end_period(old_subscription, at=int(time.time()) + 60)
    [draft] = fake_stripe.invoices.values()
    second = fake_stripe.frozen_s = int(time.time()) + 2
    if received == "after_the_deletion":
        gone = fake_stripe.delete_customer(old_customer)
        assert stripe_sync.push_pending_rollups() == 1  # accepted, and dropped
    else:
        assert stripe_sync.push_pending_rollups() == 1
        gone = fake_stripe.delete_customer(old_customer)
    return old_customer, draft, gone, second


@pytest.mark.parametrize("cannot_place", ["a_draft_stripe_still_advances", "the_usage_price_not_known"])
def test_events_of_the_deletions_second_that_its_invoices_cannot_place_are_held_for_an_operator(
        fake_stripe, client, cannot_place):
    """The draft whose period the 6th hour's events are dated in cannot be finalised (Stripe refuses, and still
    advances it itself): what it bills is not final, so the events Stripe received in the deletion's second cannot be
    placed; nor where the usage price is not known here (its id not kept: which lines bill the usage cannot be told).
    Stripe received them after the deletion and dropped them. Before, they counted as received before it, silently:
    the 6th hour was billed by no customer. They are held for an operator now (audited, listed in the admin), neither
    sent again by rule (billed twice, had Stripe billed them) nor lost: sent again from the admin, billed once; or, for
    the draft, decided by it once Stripe finalises it (the admin refuses to send them before)."""
    endpoint = EndpointFactory()
    old_customer, draft, gone, second = _the_6th_hour_in_the_deletions_second(
        fake_stripe, endpoint, received="after_the_deletion")
    if cannot_place == "a_draft_stripe_still_advances":
        fake_stripe.fail_next("400", path=f"/v1/invoices/{draft['id']}/finalize")
    else:
        StripeMeter.objects.filter(event_name=BILLED_METER_EVENT_NAME).update(stripe_price_id="")
    _webhook("customer.deleted", gone, created=second)
    fake_stripe.frozen_s = None

    assert draft["status"] == ("draft" if cannot_place == "a_draft_stripe_still_advances" else "open")
    assert stripe_sync.push_pending_rollups() == 0
    held = UsageRollup.objects.get(hour_start=_hour(6))
    assert held.push_held_at is not None and "deletion's second" in held.push_error
    [deletion] = AuditEvent.objects.filter(action="billing.customer_deleted")
    assert (deletion.details["num_events_dropped_in_its_second"],
            deletion.details["num_events_undecided_in_its_second"], deletion.details["num_rollups_held"]) == (0, 1, 1)
    [audited] = AuditEvent.objects.filter(action=services.HELD_AUDIT_ACTION)
    assert audited.details["rollups"] == [held.pk] and audited.details["customer"] == old_customer

    # A superuser finds in Stripe that no invoice of the deleted customer billed it, and sends it again.
    sign_in_staff(client, get_user_model().objects.create_superuser("ops@example.test", "ops@example.test",
                                                                    "a long passphrase"))
    listed = client.get("/django-admin/billing/usagerollup/", {"push_held_at__isnull": "False"})
    assert listed.status_code == 200 and "held for an operator" in listed.content.decode()
    sent = client.post("/django-admin/billing/usagerollup/", {"action": "send_held_again",
                                                               "_selected_action": [held.pk]}, follow=True)
    if cannot_place == "a_draft_stripe_still_advances":
        # Refused while the draft is not final (it may bill them); Stripe's own record decides them once it is.
        assert "has not finalised yet" in sent.content.decode()
        _webhook("invoice.finalized", fake_stripe.finalize_invoice(draft["id"]))
        assert AuditEvent.objects.filter(action="billing.held_usage_decided").exists()
    else:
        assert AuditEvent.objects.filter(action="billing.held_usage_pushed_again", details__rollups=[held.pk]).exists()
    _billed_once(fake_stripe, endpoint, old_customer, dropped=True)


def test_events_a_push_sent_in_its_customers_deletions_second_that_nothing_places_are_held_by_the_push(
        fake_stripe, monkeypatch):
    """The customer is deleted (its webhook applied) once a push has read it, and the push sends the 6th hour's events
    in the deletion's second; the draft of their period cannot be finalised (Stripe advances it itself). Before, the
    push's end counted them as received before the deletion: dropped, billed by no customer. It holds them for an
    operator, audited."""
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=7)
    old_customer, old_subscription = _subscribed(endpoint)
    record_usage(usage_report(endpoint, finished_at=_hour(6) + timedelta(minutes=5)))
    rollup_usage()
    fake_stripe.end_period(old_subscription, at=int(time.time()) + 60)
    [draft] = fake_stripe.invoices.values()
    second = fake_stripe.frozen_s = int(time.time()) + 2
    fake_stripe.fail_next("400", path=f"/v1/invoices/{draft['id']}/finalize")
    _deleted_once_read(monkeypatch, old_customer,
                       lambda: _webhook("customer.deleted", fake_stripe.delete_customer(old_customer), created=second))
    assert stripe_sync.push_pending_rollups() == 0
    monkeypatch.undo()
    fake_stripe.frozen_s = None

    held = UsageRollup.objects.get(hour_start=_hour(6))
    assert held.push_held_at is not None and held.pushed_at is not None
    assert stripe_sync.push_pending_rollups() == 0
    [by_the_push] = AuditEvent.objects.filter(action="billing.pushed_to_deleted_customer")
    assert (by_the_push.details["num_events_undecided_in_its_second"], by_the_push.details["num_rollups_held"]) == (1, 1)
    [audited] = AuditEvent.objects.filter(action=services.HELD_AUDIT_ACTION)
    assert audited.details["rollups"] == [held.pk]


@pytest.mark.parametrize("received", ["before_the_deletion", "after_the_deletion"])
def test_events_of_the_deletions_second_held_for_a_draft_are_decided_once_stripe_finalises_it(fake_stripe, received):
    """The draft whose period the 6th hour's events are dated in could not be finalised by the deletion (Stripe
    refused, and advances it itself): its events of the deletion's second were held for want of its final quantity.
    Before, they stayed undecided for good (counted as received before the deletion: dropped, billed by no customer).
    Stripe's own record decides them once it finalises that draft (`invoice.finalized`, its usage line's quantity):
    dropped, they go again, billed once by the next customer; billed by it, their hold is lifted, nothing sent."""
    endpoint = EndpointFactory()
    old_customer, draft, gone, second = _the_6th_hour_in_the_deletions_second(fake_stripe, endpoint, received=received)
    fake_stripe.fail_next("400", path=f"/v1/invoices/{draft['id']}/finalize")
    _webhook("customer.deleted", gone, created=second)
    fake_stripe.frozen_s = None
    assert draft["status"] == "draft" and UsageRollup.objects.get(hour_start=_hour(6)).push_held_at is not None

    finalized = fake_stripe.finalize_invoice(draft["id"])  # an hour on, by Stripe
    _webhook("invoice.finalized", finalized)
    _webhook("invoice.finalized", finalized)  # delivered twice
    assert not UsageRollup.objects.filter(push_held_at__isnull=False).exists()
    [decided] = AuditEvent.objects.filter(action="billing.held_usage_decided")
    held_pk = UsageRollup.objects.get(hour_start=_hour(6)).pk
    assert (decided.details["rollups_pushed_again"], decided.details["rollups_kept"]) == (
        ([held_pk], []) if received == "after_the_deletion" else ([], [held_pk]))
    _billed_once(fake_stripe, endpoint, old_customer, dropped=received == "after_the_deletion")


def test_usage_held_for_a_draft_stripe_has_not_finalised_cannot_be_sent_again_from_the_admin(fake_stripe, client):
    """The 6th hour's events, received in the deletion's second before the deletion, were held for want of the final
    quantity of the draft their period is in (Stripe refused to finalise it, and advances it itself). Before, a
    superuser's "send it again" sent them to the next customer at once, and the draft, once Stripe finalised it, billed
    them too: billed twice. The admin refuses it, with a message, while that draft is not final; Stripe's own record
    decides them once it finalises it."""
    endpoint = EndpointFactory()
    old_customer, draft, gone, second = _the_6th_hour_in_the_deletions_second(
        fake_stripe, endpoint, received="before_the_deletion")
    fake_stripe.fail_next("400", path=f"/v1/invoices/{draft['id']}/finalize")
    _webhook("customer.deleted", gone, created=second)
    fake_stripe.frozen_s = None
    held = UsageRollup.objects.get(hour_start=_hour(6))
    assert held.push_held_at is not None

    sign_in_staff(client, get_user_model().objects.create_superuser("ops@example.test", "ops@example.test",
                                                                    "a long passphrase"))
    sent = client.post("/django-admin/billing/usagerollup/", {"action": "send_held_again",
                                                               "_selected_action": [held.pk]}, follow=True)
    assert sent.status_code == 200 and "has not finalised yet" in sent.content.decode()
    assert UsageRollup.objects.get(pk=held.pk).push_held_at is not None
    assert not AuditEvent.objects.filter(action="billing.held_usage_pushed_again").exists()
    assert stripe_sync.push_pending_rollups() == 0

    _webhook("invoice.finalized", fake_stripe.finalize_invoice(draft["id"]))  # an hour on, by Stripe: it billed them
    assert not UsageRollup.objects.filter(push_held_at__isnull=False).exists()
    _billed_once(fake_stripe, endpoint, old_customer, dropped=False)


def test_usage_held_for_a_draft_finalised_with_a_quantity_nothing_tells_is_left_to_the_operator(fake_stripe):
    """Stripe finalised the draft the 6th hour's held events are dated in, but what it billed of the usage price
    cannot be told (the price not kept, or a line whose price nothing says). Before, the draft's entry stayed "not
    final", and "send it again" was refused for ever: held usage billed by nobody. Now the draft is final, its
    quantity unknown, and the operator decides: send it again goes."""
    endpoint = EndpointFactory()
    _, draft, gone, second = _the_6th_hour_in_the_deletions_second(fake_stripe, endpoint, received="before_the_deletion")
    fake_stripe.fail_next("400", path=f"/v1/invoices/{draft['id']}/finalize")
    _webhook("customer.deleted", gone, created=second)
    fake_stripe.frozen_s = None
    held = UsageRollup.objects.get(hour_start=_hour(6))
    StripeMeter.objects.filter(event_name=BILLED_METER_EVENT_NAME).update(stripe_price_id="")

    _webhook("invoice.finalized", fake_stripe.finalize_invoice(draft["id"]))
    assert UsageRollup.objects.get(pk=held.pk).push_held_at is not None  # nothing decided it: still held
    assert DeletedStripeCustomer.objects.get().billed_periods[0][2:] == [None, draft["id"], True]
    assert services.send_held_again(SYSTEM, UsageRollup.objects.filter(pk=held.pk)) == 1
    assert UsageRollup.objects.get(pk=held.pk).push_held_at is None


def test_usage_held_for_a_draft_finalised_before_the_deletion_was_recorded_can_be_sent_again(fake_stripe, monkeypatch):
    """Stripe finalised the draft, and its `invoice.finalized` was handled, between the deletion's read of its
    invoices and its record: the deletion's entry says "draft, not final", the mirrored invoice says open. Before,
    "send it again" waited on that entry for ever; a draft mirrored past draft is final, and the operator decides."""
    endpoint = EndpointFactory()
    _, draft, gone, second = _the_6th_hour_in_the_deletions_second(fake_stripe, endpoint, received="before_the_deletion")
    fake_stripe.fail_next("400", path=f"/v1/invoices/{draft['id']}/finalize")
    read_invoices = webhooks._deleted_customer_invoices

    def read_then_stripe_finalises(event):
        found = read_invoices(event)
        fake_stripe.frozen_s = None
        _webhook("invoice.finalized", fake_stripe.finalize_invoice(draft["id"]))
        return found

    monkeypatch.setattr(webhooks, "_deleted_customer_invoices", read_then_stripe_finalises)
    _webhook("customer.deleted", gone, created=second)
    held = UsageRollup.objects.get(hour_start=_hour(6))
    assert held.push_held_at is not None
    assert Invoice.objects.get(stripe_invoice_id=draft["id"]).status == "open"
    assert services.send_held_again(SYSTEM, UsageRollup.objects.filter(pk=held.pk)) == 1
    assert UsageRollup.objects.get(pk=held.pk).push_held_at is None


def test_usage_held_for_a_draft_recorded_before_drafts_were_told_apart_waits_for_it_too(fake_stripe):
    """A deletion recorded before drafts were told apart keeps four elements a period, no "final": one with no
    quantity may be a draft Stripe still advances. Before, "send it again" sent its held usage at once, and the
    draft, once final, billed it too. Now it waits, as for a draft, until that invoice is final."""
    endpoint = EndpointFactory()
    _, draft, gone, second = _the_6th_hour_in_the_deletions_second(fake_stripe, endpoint, received="before_the_deletion")
    fake_stripe.fail_next("400", path=f"/v1/invoices/{draft['id']}/finalize")
    _webhook("customer.deleted", gone, created=second)
    fake_stripe.frozen_s = None
    held = UsageRollup.objects.get(hour_start=_hour(6))
    deleted = DeletedStripeCustomer.objects.get()
    deleted.billed_periods = [period[:4] for period in deleted.billed_periods]  # as kept before the deploy
    deleted.save(update_fields=["billed_periods"])

    with pytest.raises(services.WaitingForFinalInvoice):
        services.send_held_again(SYSTEM, UsageRollup.objects.filter(pk=held.pk))
    _webhook("invoice.finalized", fake_stripe.finalize_invoice(draft["id"]))  # it billed them
    assert not UsageRollup.objects.filter(push_held_at__isnull=False).exists()


def test_a_void_told_again_finds_what_was_done_with_it_without_scanning_the_audit_log(fake_stripe):
    """A live customer's void invoice is written off once, however often its void is told. Before, every void's
    webhook looked for an audit event by a key of its JSON details (`details__invoice`): a scan of the whole audit log,
    on every `invoice.voided` and `invoice.updated`. It finds a unique mark by its index now."""
    endpoint = EndpointFactory()
    old_customer, old_subscription, invoice = _invoiced_the_7th_hour(fake_stripe, endpoint)
    _webhook("invoice.finalized", fake_stripe.finalize_invoice(invoice["id"]))
    voided = fake_stripe.void_invoice(invoice["id"])
    with CaptureQueriesContext(connection) as queries:
        _webhook("invoice.voided", voided)
        _webhook("invoice.updated", voided)
    audit_table = AuditEvent._meta.db_table
    # NOTE: a card's first sighting reads who created the organisation (what a person has without paying), through
    # that event's own partial index (`test_person_allowance.py` checks the plan): no other read of the audit log.
    assert [query["sql"] for query in queries.captured_queries
            if audit_table in query["sql"] and query["sql"].lstrip().upper().startswith("SELECT")
            and f"'{ORGANIZATION_CREATED_ACTION}'" not in query["sql"]] == []
    [written_off] = AuditEvent.objects.filter(action=services.WRITTEN_OFF_AUDIT_ACTION)
    assert written_off.details["invoice"] == invoice["id"]


def test_voids_written_off_or_held_before_their_marks_were_kept_are_marked_from_the_audit_log(fake_stripe):
    """`billing/0025` takes the marks of the voids written off or held before it from their audit events, so that a
    void told again after it is neither audited nor held a second time."""
    migration = importlib.import_module("billing.migrations.0025_voided_invoice_mark")
    endpoint = EndpointFactory()
    old_customer, old_subscription, invoice = _invoiced_the_7th_hour(fake_stripe, endpoint)
    _webhook("invoice.finalized", fake_stripe.finalize_invoice(invoice["id"]))
    voided = fake_stripe.void_invoice(invoice["id"])
    _webhook("invoice.voided", voided)
    VoidedInvoiceMark.objects.all().delete()  # as before billing/0025: its audit event alone
    record_audit(SYSTEM, endpoint.organization, services.HELD_AUDIT_ACTION, None, invoice="in_held", rollups=[1])
    record_audit(SYSTEM, endpoint.organization, services.HELD_AUDIT_ACTION, None, invoice="", rollups=[2])

    migration.mark_from_the_audit_log(apps, None)
    migration.mark_from_the_audit_log(apps, None)  # a second run changes nothing

    assert set(VoidedInvoiceMark.objects.values_list("stripe_invoice_id", "kind")) == {
        (invoice["id"], VoidedInvoiceMark.Kind.WRITTEN_OFF), ("in_held", VoidedInvoiceMark.Kind.HELD)}
    _webhook("invoice.updated", voided)
    assert AuditEvent.objects.filter(action=services.WRITTEN_OFF_AUDIT_ACTION).count() == 1


@pytest.mark.parametrize("received", ["before_the_deletion", "after_the_deletion"])
@pytest.mark.parametrize("other_lines", ["a_second_price", "ten_invoice_items_ahead", "none_but_no_price_stated"])
def test_events_of_the_deletions_second_are_placed_by_the_usage_prices_lines_alone_and_all_of_them(
        fake_stripe, received, other_lines):
    """The draft the deletion finalises has other lines than the usage price's: a second price staff put on the
    subscription ($0, on the input-tokens meter, to show tokens on the invoice), or ten one-off invoice items pulled in
    ahead of it, which puts the usage price's line 11th, past the 10 an invoice shows. Before, its quantity was every
    line's, of those it shows: too much (its tokens too) or too little (ten items, and no usage), so the 6th hour's
    events, received in the deletion's second, could not be placed: dropped by Stripe, they were billed by no customer.
    Only the usage price's lines count now, all of them read; and one that states no price (`pricing` null), whose
    quantity was not known before (the 6th hour, dropped, billed by no customer), is placed by its subscription item."""
    endpoint = EndpointFactory()
    _use_and_push(endpoint, num_hours_ago=7)
    old_customer, old_subscription = _subscribed(endpoint)
    record_usage(usage_report(endpoint, finished_at=_hour(6) + timedelta(minutes=5)))
    rollup_usage()
    if other_lines == "a_second_price":
        fake_stripe.add_subscription_item(old_subscription, meter="inferplane_input_tokens")
    elif other_lines == "none_but_no_price_stated":  # its usage line's `pricing` null: placed by its subscription item
        fake_stripe.line_prices_shown = False
    else:
        for _ in range(10):
            fake_stripe.add_invoice_item(old_customer, amount=500)
    fake_stripe.end_period(old_subscription, at=int(time.time()) + 60)  # its draft bills the 7th hour, and the 6th's date
    [draft] = fake_stripe.invoices.values()
    second = fake_stripe.frozen_s = int(time.time()) + 2
    if received == "after_the_deletion":
        gone = fake_stripe.delete_customer(old_customer)
        assert stripe_sync.push_pending_rollups() == 1  # dropped: its webhook not come yet
    else:
        assert stripe_sync.push_pending_rollups() == 1
        gone = fake_stripe.delete_customer(old_customer)
    _webhook("customer.deleted", gone, created=second)
    fake_stripe.frozen_s = None
    usage_lines = [line for line in draft["lines"]["data"] if fake_stripe.meter_of(line) == BILLED_METER_EVENT_NAME]
    assert draft["status"] == "open" and len(draft["lines"]["data"]) == {
        "a_second_price": 2, "ten_invoice_items_ahead": 11, "none_but_no_price_stated": 1}[other_lines]
    assert usage_lines == draft["lines"]["data"][-1:]  # Stripe orders invoice items and newer items first

    _billed_once(fake_stripe, endpoint, old_customer, dropped=received == "after_the_deletion")
    [deletion] = AuditEvent.objects.filter(action="billing.customer_deleted")
    assert (deletion.details["num_events_dropped_in_its_second"],
            deletion.details["num_events_undecided_in_its_second"]) == (1 if received == "after_the_deletion" else 0, 0)
    if other_lines == "ten_invoice_items_ahead":
        assert fake_stripe.calls_to(f"/v1/invoices/{draft['id']}/lines", method="GET")  # read past the first 10
