"""Hourly rollups: idempotent, late rows adjust an open hour, a closed hour changes only by a visible adjustment."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db.models import Sum
from django.utils import timezone

from billing.ledger import record_usage
from billing.models import RollupKind, UsageRecord, UsageRollup
from billing.rollups import rollup_usage
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db


def _hour(hours_ago: int):
    return timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=hours_ago)


def _snapshot():
    return list(UsageRollup.objects.order_by("pk").values())


def _assert_rollups_equal_the_ledger():
    fields = ["prompt_tokens", "cached_tokens", "completion_tokens", "cost"]
    ledger = UsageRecord.objects.aggregate(*(Sum(f) for f in fields))
    rollups = UsageRollup.objects.aggregate(*(Sum(f) for f in fields))
    assert list(ledger.values()) == list(rollups.values())
    assert UsageRecord.objects.count() == UsageRollup.objects.aggregate(n=Sum("num_requests"))["n"]


def test_usage_is_rolled_up_per_organisation_endpoint_and_hour():
    first, second = EndpointFactory(), EndpointFactory()
    for minute in (1, 20, 59):
        record_usage(usage_report(first, finished_at=_hour(3) + timedelta(minutes=minute)))
    record_usage(usage_report(first, finished_at=_hour(2) + timedelta(minutes=5)))
    record_usage(usage_report(second, finished_at=_hour(3) + timedelta(minutes=5)))

    result = rollup_usage()

    assert result.num_groups == 3
    counts = {(r.endpoint_id, r.hour_start): r.num_requests for r in UsageRollup.objects.all()}
    assert counts == {(first.pk, _hour(3)): 3, (first.pk, _hour(2)): 1, (second.pk, _hour(3)): 1}
    _assert_rollups_equal_the_ledger()


def test_running_the_rollup_again_changes_nothing():
    endpoint = EndpointFactory()
    for hours_ago in (0, 1, 5):
        record_usage(usage_report(endpoint, finished_at=_hour(hours_ago) + timedelta(minutes=1)))
    rollup_usage()
    before = _snapshot()

    again = rollup_usage()
    full = rollup_usage(full=True)

    assert (again.num_created, again.num_updated, again.num_adjustments) == (0, 0, 0)
    assert (full.num_created, full.num_updated, full.num_adjustments) == (0, 0, 0)
    assert [{**r, "computed_at": None} for r in _snapshot()] == [{**r, "computed_at": None} for r in before]


def test_a_late_row_adjusts_an_open_hour_in_place():
    endpoint = EndpointFactory()
    record_usage(usage_report(endpoint, finished_at=timezone.now(), completion_tokens=10))
    rollup_usage()
    record_usage(usage_report(endpoint, finished_at=timezone.now(), completion_tokens=5))

    rollup_usage()

    rollup = UsageRollup.objects.get()
    assert (rollup.closed_at, rollup.sequence, rollup.num_requests, rollup.completion_tokens) == (None, 0, 2, 15)


def test_a_late_row_for_a_closed_hour_becomes_a_visible_adjustment_and_the_closed_hour_never_changes():
    endpoint = EndpointFactory()
    hour = _hour(5)
    record_usage(usage_report(endpoint, finished_at=hour + timedelta(minutes=10), prompt_tokens=100, completion_tokens=10))
    rollup_usage()
    closed = UsageRollup.objects.get()
    assert closed.closed_at is not None

    record_usage(usage_report(endpoint, finished_at=hour + timedelta(minutes=30), prompt_tokens=40, completion_tokens=4))
    result = rollup_usage()
    rollup_usage()  # and again: still one adjustment

    assert result.num_adjustments == 1
    primary, adjustment = UsageRollup.objects.order_by("sequence")
    assert (primary.num_requests, primary.prompt_tokens, primary.cost) == (1, 100, closed.cost)
    assert (adjustment.kind, adjustment.sequence, adjustment.num_requests, adjustment.prompt_tokens) == (RollupKind.ADJUSTMENT, 1, 1, 40)
    assert adjustment.closed_at is not None
    _assert_rollups_equal_the_ledger()


def test_hours_close_only_after_the_close_delay(settings):
    settings.BILLING_ROLLUP_CLOSE_AFTER_S = 600
    endpoint = EndpointFactory()
    hour = _hour(1)
    record_usage(usage_report(endpoint, finished_at=hour + timedelta(minutes=30)))

    rollup_usage(now=hour + timedelta(hours=1, minutes=5))
    assert UsageRollup.objects.get().closed_at is None
    rollup_usage(now=hour + timedelta(hours=1, minutes=11))
    assert UsageRollup.objects.get().closed_at is not None


def test_rollup_cost_is_the_exact_decimal_sum_of_request_costs():
    endpoint = EndpointFactory(price_input_per_million=Decimal("0.123457"), price_output_per_million=Decimal("3.333333"))
    for tokens in range(1, 30):
        record_usage(usage_report(endpoint, finished_at=_hour(2), prompt_tokens=tokens * 7, completion_tokens=tokens))
    rollup_usage()
    assert UsageRollup.objects.get().cost == UsageRecord.objects.aggregate(total=Sum("cost"))["total"]
