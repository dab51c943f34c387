"""A closed organisation's Stripe subscription ends once its last usage is billed (`billing.closed_subscriptions`,
run by `endpoints.end_closed_subscriptions`): cancelled at once with a final invoice (`invoice_now`) of the usage
recorded up to the close, once, and never again; usage recorded later still is billed on one more final invoice.

Before: nothing cancelled it. A closed customer kept a live subscription that Stripe invoiced every month for ever
(zero-amount invoices, dunning mails to people who left)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from billing import closed_subscriptions, stripe_sync
from billing.ledger import record_usage
from billing.models import BillingAccount, UsageRollup
from billing.rollups import rollup_usage
from controlplane.accounts.models import AuditEvent, Organization, Role
from controlplane.accounts.services import Actor
from controlplane.clock import database_now
from endpoints import closing
from endpoints.batches.models import Batch, BatchStatus, File
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory, MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db


def _hour(num_hours_ago: int):
    return database_now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=num_hours_ago)


def _closed_with_usage_pushed(fake_stripe, *, closed_hours_ago: int = 3):
    """A postpaid organisation that used its endpoint, was closed `closed_hours_ago` hours ago, and whose usage is
    rolled up and in Stripe; returns (organisation, customer id, subscription id)."""
    endpoint = EndpointFactory()
    organization = endpoint.organization
    owner = UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    # two hours back, not one: an hour's rollup closes (and is pushed) only 10 min after the hour ends, so usage of the
    # hour before failed to push when the test ran in an hour's first 10 minutes
    record_usage(usage_report(endpoint, finished_at=_hour(closed_hours_ago + 2) + timedelta(minutes=5)))
    closing.close_organization(Actor(user=owner), organization, confirm_name=organization.name)
    # the close happened that long ago, by the database's clock
    Organization.objects.filter(pk=organization.pk).update(closed_at=database_now() - timedelta(hours=closed_hours_ago))
    rollup_usage()
    assert stripe_sync.push_pending_rollups() == 1
    account = BillingAccount.objects.get(organization=organization)
    return organization, account.stripe_customer_id, account.stripe_subscription_id


def _meter_events_aggregated(organization) -> None:
    """Stripe has had the last meter events for longer than it takes to aggregate them."""
    UsageRollup.objects.filter(organization=organization).update(
        pushed_at=database_now() - closed_subscriptions.METER_EVENTS_SETTLE - timedelta(minutes=1))


def _cost_pushed(fake_stripe, customer_id: str) -> int:
    return sum(int(event["payload"]["value"]) for event in fake_stripe.meter_events.values()
               if event["payload"]["stripe_customer_id"] == customer_id and event["event_name"] == "inferplane_usage_cost")


def _cancels(fake_stripe, subscription_id: str):
    return fake_stripe.calls_to(f"/v1/subscriptions/{subscription_id}", method="DELETE")


def late_usage_billed_by_a_new_subscription(fake_stripe, organization, first: str) -> str:
    """Usage rolled up after `first` was cancelled: pushed to a new subscription, which ends too once settled, with its
    own final invoice; returns its id."""
    assert stripe_sync.push_pending_rollups() == 1
    second = BillingAccount.objects.get(organization=organization).stripe_subscription_id
    assert second and second != first
    _meter_events_aggregated(organization)
    fake_stripe.frozen_s = int(time.time()) + 60  # Stripe's clock a minute on: the new subscription's time is not empty

    assert closing.end_closed_subscriptions() == 1

    assert fake_stripe.subscriptions[second]["status"] == "canceled"
    return second


def test_a_closed_organisations_subscription_is_cancelled_with_a_final_invoice_of_its_last_usage_once(fake_stripe):
    organization, customer, subscription = _closed_with_usage_pushed(fake_stripe)
    assert closing.end_closed_subscriptions() == 0  # Stripe may not have aggregated the events just sent
    assert fake_stripe.subscriptions[subscription]["status"] == "active"
    _meter_events_aggregated(organization)

    assert closing.end_closed_subscriptions() == 1

    assert fake_stripe.subscriptions[subscription]["status"] == "canceled"
    [cancel] = _cancels(fake_stripe, subscription)
    assert cancel.params == {"invoice_now": "true", "prorate": "false"}
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0
    assert BillingAccount.objects.get(organization=organization).stripe_subscription_id == ""
    assert AuditEvent.objects.filter(organization=organization, action="billing.subscription_cancel_after_close").exists()
    # never again: a second run, or a repeated task, cancels nothing and invoices nothing more
    num_invoices = len(fake_stripe.invoices)
    assert closing.end_closed_subscriptions() == 0
    assert len(_cancels(fake_stripe, subscription)) == 1 and len(fake_stripe.invoices) == num_invoices


def test_the_subscription_waits_while_the_closes_last_usage_may_still_be_recorded_or_pushed(fake_stripe):
    organization, _, subscription = _closed_with_usage_pushed(fake_stripe, closed_hours_ago=0)
    _meter_events_aggregated(organization)
    assert "settle" in closed_subscriptions.unsettled_reason(organization.pk)
    assert closing.end_closed_subscriptions() == 0

    Organization.objects.filter(pk=organization.pk).update(closed_at=database_now() - timedelta(hours=3))
    late = UsageRollup.objects.filter(organization=organization).first()
    UsageRollup.objects.filter(pk=late.pk).update(pushed_at=None, push_held_at=database_now(), push_error="held")
    assert closing.end_closed_subscriptions() == 0  # a rollup held for an operator is not in Stripe yet
    UsageRollup.objects.filter(pk=late.pk).update(pushed_at=database_now() - timedelta(hours=1), push_held_at=None)

    input_file = File.objects.create(organization=organization, purpose="batch", filename="in.jsonl", bytes=1,
                                     s3_key="files/x")
    batch = Batch.objects.create(organization=organization, request_path="/v1/chat/completions", input_file=input_file,
                                 status=BatchStatus.CANCELLING, expires_at=database_now() + timedelta(hours=1))
    assert closing.end_closed_subscriptions() == 0  # a cancelled batch's lines still write usage
    Batch.objects.filter(pk=batch.pk).update(status=BatchStatus.CANCELLED)

    assert closing.end_closed_subscriptions() == 1
    assert fake_stripe.subscriptions[subscription]["status"] == "canceled"


def test_stripe_down_leaves_the_subscription_for_the_next_run(fake_stripe):
    organization, customer, subscription = _closed_with_usage_pushed(fake_stripe)
    _meter_events_aggregated(organization)
    fake_stripe.fail_next("500", times=stripe_sync.MAX_ATTEMPTS, path=f"/v1/subscriptions/{subscription}",
                          method="DELETE")

    assert closing.end_closed_subscriptions() == 0
    assert fake_stripe.subscriptions[subscription]["status"] == "active"
    assert BillingAccount.objects.get(organization=organization).stripe_subscription_id == subscription

    assert closing.end_closed_subscriptions() == 1
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0


def test_a_cancel_whose_answer_was_lost_is_not_sent_twice_nor_its_final_invoice_lost(fake_stripe):
    organization, customer, subscription = _closed_with_usage_pushed(fake_stripe)
    _meter_events_aggregated(organization)
    fake_stripe.fail_next("timeout", path=f"/v1/subscriptions/{subscription}", method="DELETE")

    assert closing.end_closed_subscriptions() == 1

    assert fake_stripe.subscriptions[subscription]["status"] == "canceled"
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0
    assert len([invoice for invoice in fake_stripe.invoices.values() if invoice["customer"] == customer]) == 1
    assert BillingAccount.objects.get(organization=organization).stripe_subscription_id == ""


def test_usage_recorded_after_the_cancel_is_billed_on_one_more_final_invoice_not_dropped(fake_stripe):
    organization, customer, first = _closed_with_usage_pushed(fake_stripe)
    _meter_events_aggregated(organization)
    assert closing.end_closed_subscriptions() == 1

    # a partitioned gateway's journal replayed hours late: a call of the hour before the close
    endpoint = UsageRollup.objects.filter(organization=organization).first().endpoint
    record_usage(usage_report(endpoint, finished_at=_hour(4) + timedelta(minutes=20)))
    rollup_usage()
    second = late_usage_billed_by_a_new_subscription(fake_stripe, organization, first)

    assert len(_cancels(fake_stripe, first)) == 1 and len(_cancels(fake_stripe, second)) == 1
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0


def test_the_tasks_time_running_out_ends_the_run_not_one_organisations_turn(fake_stripe, monkeypatch):
    """The soft time limit is an Exception: taken for one organisation's failure, the run went on to the next until the
    hard limit killed the worker in the middle of a Stripe call."""
    from celery.exceptions import SoftTimeLimitExceeded

    _closed_with_usage_pushed(fake_stripe)
    _closed_with_usage_pushed(fake_stripe)
    turns = []

    def out_of_time(organization_id):
        turns.append(organization_id)
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(closed_subscriptions, "end_subscription_after_close", out_of_time)
    with pytest.raises(SoftTimeLimitExceeded):
        closing.end_closed_subscriptions()
    assert len(turns) == 1
