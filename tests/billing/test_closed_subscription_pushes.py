"""A closed organisation's subscription is cancelled with pushes held back (`BillingAccount.subscription_ending_at`):
usage that reaches Stripe while it ends goes to one more subscription, with its own final invoice, never to the one
being cancelled (`billing.closed_subscriptions.end_subscription_after_close`, `stripe_sync.push_rollup`).

Before: the subscription was judged settled once, and pushes went on meanwhile. A rollup made between that judgement
and the cancellation (late rows of a closed hour: an adjustment, or a gateway's journal replayed) was pushed to the
subscription seconds before its final invoice (Stripe aggregates meter events asynchronously: billed by no invoice),
or after the cancellation and before the account forgot the subscription (billed by no invoice, and marked pushed, so
never sent again). The tests run a concurrent worker's rollup and push run at each of those two moments."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.db.models import F

from billing import closed_subscriptions, services, stripe_sync
from billing.ledger import record_usage
from billing.models import BillingAccount, UsageRollup
from billing.rollups import rollup_usage
from controlplane.clock import database_now
from endpoints import closing
from tests.billing.conftest import usage_report
from tests.billing.test_closed_subscription import (
    _cancels,
    _closed_with_usage_pushed,
    _cost_pushed,
    _hour,
    _meter_events_aggregated,
    late_usage_billed_by_a_new_subscription,
)

pytestmark = pytest.mark.django_db


def _late_rows_pushed_by_another_worker(organization) -> list[int]:
    """What a worker running beside the cancellation does: a late call of the closed hour reaches the ledger (a
    partitioned gateway's journal replayed), the rollups make its adjustment, and a push run pushes what it can.
    Returns [how many rollups that run pushed]."""
    endpoint = UsageRollup.objects.filter(organization=organization).first().endpoint
    # the closed hour the close's usage was in (`_closed_with_usage_pushed`: five hours back)
    record_usage(usage_report(endpoint, finished_at=_hour(5) + timedelta(minutes=30)))
    rollup_usage()
    return [stripe_sync.push_pending_rollups()]


def _meter_event_calls(fake_stripe, rollup) -> list[int]:
    """The places, among every call Stripe got, of the POSTs of `rollup`'s meter events."""
    prefix = f"rollup-{rollup.push_uid}-"
    return [index for index, call in enumerate(fake_stripe.calls)
            if call.path == "/v1/billing/meter_events" and str(call.params.get("identifier", "")).startswith(prefix)]


def _a_run_with_a_push_beside(monkeypatch, owner, name: str, organization, *, when=lambda *args, **kwargs: True
                              ) -> tuple[int, list[int]]:
    """One run of the cancellations, with another worker's late rows and push run just before `owner.name` is first
    called (where `when` says so): (how many subscriptions the run ended, [how many rollups the push run pushed])."""
    beside: list[int] = []
    real = getattr(owner, name)

    def with_a_push_beside(*args, **kwargs):
        if not beside and when(*args, **kwargs):
            beside.extend(_late_rows_pushed_by_another_worker(organization))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, with_a_push_beside)
    try:
        return closing.end_closed_subscriptions(), beside
    finally:
        monkeypatch.setattr(owner, name, real)


def test_a_rollup_made_as_the_subscription_is_cancelled_waits_for_the_next_subscription(fake_stripe, monkeypatch):
    organization, customer, first = _closed_with_usage_pushed(fake_stripe)
    _meter_events_aggregated(organization)

    # judged settled, about to be cancelled
    assert _a_run_with_a_push_beside(monkeypatch, stripe_sync, "call_stripe", organization,
                                     when=lambda *_, what, **__: what == "subscription cancel") == (1, [0])

    late = UsageRollup.objects.get(organization=organization, sequence=1)
    assert late.pushed_at is None  # it waited: the subscription was being cancelled
    [cancel] = _cancels(fake_stripe, first)
    late_usage_billed_by_a_new_subscription(fake_stripe, organization, first)
    # its events reached Stripe after the first subscription's final invoice, none seconds before it
    assert min(_meter_event_calls(fake_stripe, late)) > fake_stripe.calls.index(cancel)
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0


def test_a_rollup_made_as_the_subscription_is_judged_settled_is_on_its_final_invoice(fake_stripe, monkeypatch):
    organization, customer, subscription = _closed_with_usage_pushed(fake_stripe)
    _meter_events_aggregated(organization)

    # judged settled once, read in Stripe before it is cancelled: judged again, a rollup not in Stripe yet
    assert _a_run_with_a_push_beside(monkeypatch, closed_subscriptions, "_ended", organization) == (0, [0])
    assert fake_stripe.subscriptions[subscription]["status"] == "active"

    late = UsageRollup.objects.get(organization=organization, sequence=1)
    assert stripe_sync.push_pending_rollups() == 1
    assert closing.end_closed_subscriptions() == 0  # Stripe may not have aggregated its events yet
    _meter_events_aggregated(organization)
    assert closing.end_closed_subscriptions() == 1
    [cancel] = _cancels(fake_stripe, subscription)
    assert max(_meter_event_calls(fake_stripe, late)) < fake_stripe.calls.index(cancel)
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0


def test_a_push_between_the_cancellation_and_its_record_is_billed_on_one_more_final_invoice(fake_stripe, monkeypatch):
    organization, customer, first = _closed_with_usage_pushed(fake_stripe)
    _meter_events_aggregated(organization)

    # cancelled in Stripe, not yet forgotten here
    assert _a_run_with_a_push_beside(monkeypatch, services, "record_subscription_ended", organization) == (1, [0])

    assert fake_stripe.subscriptions[first]["status"] == "canceled"
    second = late_usage_billed_by_a_new_subscription(fake_stripe, organization, first)
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0
    assert len(_cancels(fake_stripe, first)) == 1 and len(_cancels(fake_stripe, second)) == 1
    assert BillingAccount.objects.get(organization=organization).subscription_ending_at is None


def test_a_cancellation_that_failed_holds_pushes_back_only_until_the_next_run(fake_stripe):
    organization, customer, subscription = _closed_with_usage_pushed(fake_stripe)
    _meter_events_aggregated(organization)
    fake_stripe.fail_next("500", times=stripe_sync.MAX_ATTEMPTS, path=f"/v1/subscriptions/{subscription}",
                          method="DELETE")
    assert closing.end_closed_subscriptions() == 0
    assert BillingAccount.objects.get(organization=organization).subscription_ending_at is not None

    # late rows meanwhile: their push waits for the run that stopped midway to be resolved
    assert _late_rows_pushed_by_another_worker(organization) == [0]
    # the next run finds the subscription live and usage not pushed: it takes the mark off, cancelling nothing
    assert closing.end_closed_subscriptions() == 0
    assert BillingAccount.objects.get(organization=organization).subscription_ending_at is None
    assert fake_stripe.subscriptions[subscription]["status"] == "active"

    assert stripe_sync.push_pending_rollups() == 1
    assert BillingAccount.objects.get(organization=organization).stripe_subscription_id == subscription
    _meter_events_aggregated(organization)
    assert closing.end_closed_subscriptions() == 1
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0


def test_a_mark_outliving_the_subscription_it_was_for_holds_no_push(fake_stripe, monkeypatch):
    # NOTE: a pod of the release before billing/0040 (a rolling deploy) forgets a subscription without its mark, from
    # the webhook of the very cancellation that set it. Before, the mark outlived it: the organisation was no longer
    # one "with a subscription" for the runs, and every push of its late usage waited for good, billed by nobody.
    organization, customer, first = _closed_with_usage_pushed(fake_stripe)
    _meter_events_aggregated(organization)
    real = services.record_subscription_ended

    def killed(subscription_id):
        raise RuntimeError("the worker died between the cancellation and its record")

    monkeypatch.setattr(services, "record_subscription_ended", killed)
    assert closing.end_closed_subscriptions() == 0
    monkeypatch.setattr(services, "record_subscription_ended", real)
    assert fake_stripe.subscriptions[first]["status"] == "canceled"
    # the cancellation's webhook, handled by a pod of the release before: the subscription forgotten, the mark not
    BillingAccount.objects.filter(organization=organization).update(stripe_subscription_id="",
                                                                    stripe_subscription_started_at=None)
    assert closing.end_closed_subscriptions() == 0  # nothing left for the runs to end

    endpoint = UsageRollup.objects.filter(organization=organization).first().endpoint
    record_usage(usage_report(endpoint, finished_at=_hour(5) + timedelta(minutes=30)))
    rollup_usage()

    second = late_usage_billed_by_a_new_subscription(fake_stripe, organization, first)
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0
    assert len(_cancels(fake_stripe, second)) == 1
    assert BillingAccount.objects.get(organization=organization).subscription_ending_at is None


def test_a_subscription_stored_anew_drops_a_mark_left_from_the_one_before(fake_stripe):
    organization, _, first = _closed_with_usage_pushed(fake_stripe)
    # marked by a run and cancelled, then forgotten by a pod of the release before billing/0040 (the mark kept)
    fake_stripe.subscriptions[first]["status"] = "canceled"
    BillingAccount.objects.filter(organization=organization).update(
        subscription_ending_at=database_now(), stripe_subscription_id="", stripe_subscription_started_at=None,
        stripe_key_generation=F("stripe_key_generation") + 1)

    second = stripe_sync.ensure_subscription(organization.pk)

    account = BillingAccount.objects.get(organization=organization)
    assert second != first and account.stripe_subscription_id == second
    assert account.subscription_ending_at is None  # no run is ending the new one


# The claim of a push by a worker of the release before billing/0040 (`stripe_sync.claim_rollup` then), as it reaches
# PostgreSQL: that release knows no mark, and this statement is all it asks before it pushes.
PREVIOUS_RELEASE_CLAIM = """
    UPDATE "billing_usagerollup" SET "push_claimed_at" = CLOCK_TIMESTAMP()
    WHERE ("billing_usagerollup"."closed_at" IS NOT NULL AND "billing_usagerollup"."pushed_at" IS NULL
           AND "billing_usagerollup"."billing_mode" = 'postpaid' AND "billing_usagerollup"."push_held_at" IS NULL
           AND ("billing_usagerollup"."push_claimed_at" IS NULL
                OR "billing_usagerollup"."push_claimed_at" < (CLOCK_TIMESTAMP() - %s::interval))
           AND "billing_usagerollup"."id" = %s)
"""


def _previous_release_claims(rollup_id: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(PREVIOUS_RELEASE_CLAIM, [f"{settings.BILLING_CLAIM_TIMEOUT_S} seconds", rollup_id])
        return cursor.rowcount == 1


def test_the_previous_releases_claim_takes_no_rollup_of_a_subscription_being_cancelled(fake_stripe):
    organization, _, _ = _closed_with_usage_pushed(fake_stripe)
    endpoint = UsageRollup.objects.filter(organization=organization).first().endpoint
    record_usage(usage_report(endpoint, finished_at=_hour(5) + timedelta(minutes=30)))
    rollup_usage()
    late = UsageRollup.objects.get(organization=organization, sequence=1)
    account = BillingAccount.objects.filter(organization=organization)
    account.update(subscription_ending_at=database_now())

    assert not _previous_release_claims(late.pk)
    assert UsageRollup.objects.get(pk=late.pk).push_claimed_at is None

    account.update(subscription_ending_at=None)  # the run took its mark off (or the subscription was forgotten)
    assert _previous_release_claims(late.pk)


def test_a_rollup_made_as_the_subscription_is_cancelled_waits_for_the_next_subscription_when_an_older_worker_pushes(
        fake_stripe, monkeypatch):
    # A rolling deploy: the worker pushing beside the run is of the release before billing/0040, whose push is this
    # one's without the read of the mark (`_subscription_ending`). Before, it pushed the late rollup to the subscription
    # being cancelled, seconds before its final invoice: billed by no invoice, and marked pushed.
    monkeypatch.setattr(stripe_sync, "_subscription_ending", lambda organization_id: False)
    organization, customer, first = _closed_with_usage_pushed(fake_stripe)
    _meter_events_aggregated(organization)

    assert _a_run_with_a_push_beside(monkeypatch, stripe_sync, "call_stripe", organization,
                                     when=lambda *_, what, **__: what == "subscription cancel") == (1, [0])

    late = UsageRollup.objects.get(organization=organization, sequence=1)
    assert late.pushed_at is None
    [cancel] = _cancels(fake_stripe, first)
    late_usage_billed_by_a_new_subscription(fake_stripe, organization, first)
    assert min(_meter_event_calls(fake_stripe, late)) > fake_stripe.calls.index(cancel)
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0


def test_a_push_by_an_older_worker_between_the_cancellation_and_its_record_is_billed_on_one_more_final_invoice(
        fake_stripe, monkeypatch):
    monkeypatch.setattr(stripe_sync, "_subscription_ending", lambda organization_id: False)
    organization, customer, first = _closed_with_usage_pushed(fake_stripe)
    _meter_events_aggregated(organization)

    assert _a_run_with_a_push_beside(monkeypatch, services, "record_subscription_ended", organization) == (1, [0])

    second = late_usage_billed_by_a_new_subscription(fake_stripe, organization, first)
    assert fake_stripe.invoiced_usage(customer) == _cost_pushed(fake_stripe, customer) > 0
    assert len(_cancels(fake_stripe, first)) == 1 and len(_cancels(fake_stripe, second)) == 1
