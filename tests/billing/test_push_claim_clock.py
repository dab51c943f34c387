"""A Stripe push's claim on a rollup is stamped and judged by PostgreSQL's clock, never a worker's.

Before: each worker stamped `push_claimed_at` and judged it stale (`BILLING_CLAIM_TIMEOUT_S`) by its own clock: a worker
10 minutes ahead took a rollup another worker had just claimed and was sending (its events sent by two workers at
once), and a claim made by a worker 10 minutes behind read as stale to every other at once."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from billing import stripe_sync
from billing.ledger import record_usage
from billing.models import UsageRollup
from billing.rollups import rollup_usage
from controlplane.clock import database_now
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db

REAL_NOW = timezone.now


def _this_worker_clock(monkeypatch, offset: timedelta) -> None:
    monkeypatch.setattr(timezone, "now", lambda: REAL_NOW() + offset)


def _closed_rollup() -> UsageRollup:
    finished_at = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    record_usage(usage_report(EndpointFactory(), finished_at=finished_at, prompt_tokens=120, completion_tokens=30))
    rollup_usage()
    return UsageRollup.objects.get()


def test_a_worker_whose_clock_is_ahead_never_pushes_a_rollup_another_worker_is_pushing(fake_stripe, monkeypatch):
    rollup = _closed_rollup()
    assert stripe_sync.claim_rollup(rollup.pk)  # a live worker, in the middle of its push

    _this_worker_clock(monkeypatch, timedelta(minutes=10))
    assert stripe_sync.push_pending_rollups() == 0
    assert fake_stripe.meter_events == {}


def test_a_claim_made_by_a_worker_whose_clock_is_behind_is_not_taken_by_another_at_once(fake_stripe, monkeypatch):
    rollup = _closed_rollup()
    _this_worker_clock(monkeypatch, timedelta(minutes=-10))
    assert stripe_sync.claim_rollup(rollup.pk)
    monkeypatch.undo()

    assert stripe_sync.push_pending_rollups() == 0
    assert fake_stripe.meter_events == {}


def test_a_claim_left_past_its_timeout_by_the_database_clock_is_taken_and_pushed_once(fake_stripe, settings):
    settings.BILLING_CLAIM_TIMEOUT_S = 0.1
    rollup = _closed_rollup()
    UsageRollup.objects.filter(pk=rollup.pk).update(push_claimed_at=timezone.now() - timedelta(seconds=1))

    assert stripe_sync.push_pending_rollups() == 1
    assert [event["event_name"] for event in fake_stripe.meter_events.values()].count("inferplane_usage_cost") == 1
    assert stripe_sync.push_pending_rollups() == 0


def test_a_worker_whose_clock_is_behind_holds_a_rollup_whose_unanswered_event_was_first_sent_over_a_day_ago(
        fake_stripe, monkeypatch):
    # Before: the first try's time was judged by the worker's clock against `IDENTIFIER_TRUSTED_FOR` (23 h): a worker 3 h
    # behind read a try 25 h old (Stripe no longer bound to refuse its identifier) as 22 h old and sent it again, where
    # the customer could be billed twice; it is held for an operator instead.
    rollup = _closed_rollup()
    UsageRollup.objects.filter(pk=rollup.pk).update(push_first_tried_at=database_now() - timedelta(hours=25))
    _this_worker_clock(monkeypatch, timedelta(hours=-3))

    assert stripe_sync.push_pending_rollups() == 0

    rollup.refresh_from_db()
    assert rollup.push_held_at is not None and rollup.pushed_at is None
    assert fake_stripe.meter_events == {}
    # the admin shows when it was held by PostgreSQL's clock, not 3 hours back by the worker's
    assert abs(rollup.push_held_at - database_now()) < timedelta(minutes=1)


def test_a_worker_whose_clock_is_40_minutes_ahead_pushes_a_late_rollup_stripe_takes(fake_stripe, monkeypatch):
    # Before: the earliest date of a meter event (`LATEST_PERIOD_GRACE` back) was taken by the worker's clock: 40
    # minutes ahead, it dated the event 10 minutes into Stripe's future, past the 5 minutes Stripe takes, and every
    # push this worker made was refused; by PostgreSQL's clock it is dated 30 minutes back, as Stripe takes it.
    rollup = _closed_rollup()
    _this_worker_clock(monkeypatch, timedelta(minutes=40))

    assert stripe_sync.push_pending_rollups() == 1

    rollup.refresh_from_db()
    assert rollup.pushed_at is not None and rollup.push_error == ""
    sent = [event["timestamp"] for event in fake_stripe.meter_events.values()]
    assert sent and all(timestamp <= database_now().timestamp() for timestamp in sent)


def test_the_admin_shows_a_rollup_pushed_by_a_worker_whose_clock_is_ahead_at_the_databases_time(
        fake_stripe, monkeypatch):
    rollup = _closed_rollup()
    _this_worker_clock(monkeypatch, timedelta(minutes=10))

    assert stripe_sync.push_pending_rollups() == 1

    rollup.refresh_from_db()
    assert abs(rollup.pushed_at - database_now()) < timedelta(minutes=1)
