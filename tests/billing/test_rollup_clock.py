"""An hour's rollup closes by PostgreSQL's clock, never its worker's.

Before: `rollup_usage` closed every hour older than the close delay by its worker's clock (`timezone.now()`): a worker
an hour and a half ahead closed the hour whose calls were still arriving, and each later call of it went to Stripe as
an adjustment of its own; a worker behind held every hour's push back by as much."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models import Sum
from django.utils import timezone

from billing.ledger import record_usage
from billing.models import RollupKind, UsageRecord, UsageRollup
from billing.rollups import rollup_usage
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db

REAL_NOW = timezone.now


def _ledger_and_rollups() -> tuple[tuple, tuple]:
    fields = ("num_requests", "prompt_tokens", "completion_tokens", "cost")
    ledger = UsageRecord.objects.aggregate(*(Sum(name) for name in fields[1:]))
    rollups = UsageRollup.objects.aggregate(*(Sum(name) for name in fields))
    return (UsageRecord.objects.count(), *ledger.values()), tuple(rollups.values())


def test_a_worker_clock_ahead_leaves_the_hour_whose_calls_still_arrive_open_and_bills_each_call_once(monkeypatch,
                                                                                                      settings):
    settings.BILLING_ROLLUP_CLOSE_AFTER_S = 600
    endpoint, finished_at = EndpointFactory(), REAL_NOW()
    record_usage(usage_report(endpoint, finished_at=finished_at, prompt_tokens=100, completion_tokens=10))

    with monkeypatch.context() as worker:
        worker.setattr(timezone, "now", lambda: REAL_NOW() + timedelta(minutes=90))  # the rollup's worker
        rollup_usage()
    record_usage(usage_report(endpoint, finished_at=finished_at, prompt_tokens=40, completion_tokens=4))
    rollup_usage()

    rollup = UsageRollup.objects.get()  # one rollup of the hour, open: nothing of it pushed yet, no adjustment
    assert (rollup.kind, rollup.closed_at, rollup.num_requests, rollup.prompt_tokens) == (RollupKind.HOURLY, None, 2, 140)
    ledger, rollups = _ledger_and_rollups()
    assert ledger == rollups


def test_a_worker_clock_behind_closes_an_hour_past_its_close_delay_on_time(monkeypatch, settings):
    settings.BILLING_ROLLUP_CLOSE_AFTER_S = 600
    endpoint = EndpointFactory()
    hour = REAL_NOW().replace(minute=0, second=0, microsecond=0) - timedelta(hours=2)
    record_usage(usage_report(endpoint, finished_at=hour + timedelta(minutes=30)))

    monkeypatch.setattr(timezone, "now", lambda: REAL_NOW() - timedelta(hours=3))  # the rollup's worker
    rollup_usage()

    assert UsageRollup.objects.get().closed_at is not None  # pushed to Stripe by the next push, not three hours late
