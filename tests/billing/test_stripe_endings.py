"""A subscription or a customer that Stripe ends (cancelled or deleted in the Dashboard, or a
subscription cancelled in the Customer Portal) is forgotten by its webhook: the next push subscribes
the organisation again, from where the ended subscription stopped, and an organisation whose customer
is gone has no payment method. Before, usage went on being pushed to a customer nothing billed, or
failed against a customer that no longer existed, and a card that went with it still lifted the limit."""

import asyncio
import json
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from billing import stripe_sync
from billing.ledger import record_usage
from billing.models import BillingAccount, StripeEvent
from billing.quota.counters import QuotaExceeded
from billing.rollups import rollup_usage
from controlplane.accounts.models import AuditEvent
from tests.billing.conftest import usage_report
from tests.billing.test_quota import reserve
from tests.factories import EndpointFactory
from tests.fakes.stripe_server import sign_webhook

# NOTE: admission rebuilds counters in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

WEBHOOK = "/api/v1/billing/stripe/webhook"


def _webhook(kind: str, data: dict, *, event_id: str | None = None) -> dict:
    body = json.dumps({"id": event_id or f"evt_{time.time_ns()}", "object": "event", "type": kind,
                       "created": int(time.time()), "data": {"object": data}}).encode()
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

    _webhook("customer.subscription.deleted",
             fake_stripe.cancel_subscription(first, at=int(_hour(4).timestamp())))

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
    _webhook("customer.subscription.deleted", fake_stripe.cancel_subscription(first, at=int(_hour(4).timestamp())))

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

    _use_and_push(endpoint, num_hours_ago=3)  # a new customer, subscribed, billed

    account.refresh_from_db()
    assert account.stripe_customer_id not in ("", old_customer)
    assert fake_stripe.subscriptions[account.stripe_subscription_id]["customer"] == account.stripe_customer_id
    new_events = [event for event in fake_stripe.meter_events.values()
                  if event["payload"]["stripe_customer_id"] == account.stripe_customer_id]
    assert new_events and all(len(_billed_by(fake_stripe, event)) == 1 for event in new_events)
    assert AuditEvent.objects.filter(action="billing.customer_deleted", details__customer=old_customer).count() == 1
