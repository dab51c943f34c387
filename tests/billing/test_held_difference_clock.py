"""A held duplicate's "send the difference" claim (`push_claimed_at`, `difference_started_at`) is stamped and judged by
PostgreSQL's clock, as the ordinary push's claim is (`stripe_sync._claimable`), never the web pod's or worker's.

Before: `_claim_difference`, its per-event renewal and `abandon_held_difference` stamped and judged it by the process's
own clock: a staff run on a pod whose clock was `BILLING_CLAIM_TIMEOUT_S` ahead read a run sending at that moment as
dead and abandoned its difference (or took over its claim), and a run on a pod that far behind stamped a claim that
every other read as dead at once; a pod 3 h behind read a run begun 25 h before as 22 h old and sent its unanswered
event again, where Stripe was no longer bound to refuse it."""

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from billing import stripe_sync
from billing.models import UsageRollup
from controlplane.accounts.services import SYSTEM
from controlplane.clock import database_now
from tests.billing.test_held_difference_claims import _run_killed_before_recording
from tests.billing.test_held_duplicates import _held_with_more_than_stripe, _send_difference

pytestmark = pytest.mark.django_db

REAL_NOW = timezone.now
PAST_THE_CLAIM = timedelta(seconds=settings.BILLING_CLAIM_TIMEOUT_S + 60)


def _this_process_clock(patched, offset: timedelta) -> None:
    patched.setattr(timezone, "now", lambda: REAL_NOW() + offset)


def test_a_staff_process_whose_clock_is_ahead_cannot_abandon_a_difference_being_sent(fake_stripe, monkeypatch):
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    original, raced = stripe_sync._send_difference, []

    def abandoned_meanwhile_on_a_pod_ahead(*args):
        if not raced:
            with monkeypatch.context() as patched:
                _this_process_clock(patched, PAST_THE_CLAIM)
                try:
                    raced.append(stripe_sync.abandon_held_difference(SYSTEM, rollup.pk, difference_in_stripe=False))
                except stripe_sync.DifferenceRefused as refused:
                    raced.append(str(refused))
        return original(*args)

    monkeypatch.setattr(stripe_sync, "_send_difference", abandoned_meanwhile_on_a_pod_ahead)
    assert _send_difference(rollup, stripe_has) == 1
    assert len(raced) == 1 and "is sending it now" in str(raced[0]), raced


def test_a_run_on_a_process_whose_clock_is_behind_holds_its_claim_against_another(fake_stripe, monkeypatch):
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    original, raced = stripe_sync._send_difference, []

    def another_run_meanwhile_on_a_correct_clock(*args):
        if not raced:
            with monkeypatch.context() as patched:
                patched.setattr(timezone, "now", REAL_NOW)
                try:
                    raced.append(_send_difference(rollup, stripe_has))
                except stripe_sync.DifferenceRefused as refused:
                    raced.append(str(refused))
        return original(*args)

    monkeypatch.setattr(stripe_sync, "_send_difference", another_run_meanwhile_on_a_correct_clock)
    _this_process_clock(monkeypatch, -PAST_THE_CLAIM)
    assert _send_difference(rollup, stripe_has) == 1
    assert len(raced) == 1 and "is sending it now" in str(raced[0]), raced


def test_a_process_whose_clock_is_behind_asks_about_an_event_a_run_sent_over_a_day_ago(fake_stripe, monkeypatch):
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    _run_killed_before_recording(monkeypatch, rollup, stripe_has)
    num_events = len(fake_stripe.meter_events)
    fake_stripe.age_meter_events(25 * 3600)
    fake_stripe.forget_idempotency_keys()
    UsageRollup.objects.filter(pk=rollup.pk).update(difference_started_at=database_now() - timedelta(hours=25),
                                                    push_claimed_at=None)
    _this_process_clock(monkeypatch, timedelta(hours=-3))

    with pytest.raises(stripe_sync.DifferenceRefused, match="look it up in Stripe"):
        _send_difference(rollup, stripe_has)
    assert len(fake_stripe.meter_events) == num_events


def test_a_web_pod_whose_clock_is_behind_does_not_send_as_new_a_rollup_past_stripes_cancel_window(
        fake_stripe, monkeypatch):
    # Before: "send as new" judged the cancel window (`held_past_cancel_window`) by the web pod's clock: one 30 minutes
    # behind sent whole, under new identifiers, a rollup whose hour ended 25 h 10 min before (its events in Stripe no
    # longer cancellable): what Stripe had was billed twice.
    rollup, _ = _held_with_more_than_stripe(fake_stripe)
    UsageRollup.objects.filter(pk=rollup.pk).update(hour_start=database_now() - timedelta(hours=25, minutes=10))
    _this_process_clock(monkeypatch, timedelta(minutes=-30))

    assert stripe_sync.send_held_as_new(UsageRollup.objects.filter(pk=rollup.pk)) == 0
    assert list(stripe_sync.held_past_cancel_window(UsageRollup.objects.filter(pk=rollup.pk))) == [rollup]
