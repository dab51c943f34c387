"""A NEGATIVE adjustment held as a duplicate after a database rewind, and Stripe holding more than the ledger: "send the
difference" takes signed values and sends any difference that is not 0, negative ones too, once
(`stripe_sync.send_held_difference`). Found by the rv2money review: before, a negative value was refused ("missing or
negative") and the admin form's fields had min_value=0, and Stripe holding more was refused with advice to issue a
credit note; past Stripe's cancel window "send as new" is refused too, so "confirm" (the ledger's value recorded as
Stripe's) was all that was left, and the late row's usage of the hour was billed by nobody."""

import dataclasses
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing import ledger, stripe_sync
from billing.models import MeterEventPush, RollupKind, UsageRollup
from billing.rollups import rollup_usage
from tests.billing.conftest import usage_report
from tests.billing.test_held_duplicates import (
    _billed,
    _held_with_more_than_stripe,
    _post_difference,
    _send_difference,
    _superuser_client,
)
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def closed_now(settings):
    settings.BILLING_ROLLUP_CLOSE_AFTER_S = 0


def _held_negative_adjustment(fake_stripe) -> tuple[UsageRollup, dict[str, int]]:
    """A cheaper supersede's (negative) adjustment pushed, rewound away with its pushes, made again with a late row of
    its hour in it and held as a duplicate, past Stripe's cancel window; and what Stripe has of each of its meters."""
    endpoint = EndpointFactory(price_input_per_million=Decimal("1"), price_cached_input_per_million=Decimal("0.1"),
                               price_output_per_million=Decimal("2"))
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    lost = usage_report(endpoint, request_id="x", prompt_tokens=100_000, completion_tokens=20_000,
                        status="gateway_lost", finished_at=hour + timedelta(minutes=10))
    ledger.record_usage(lost)
    rollup_usage()
    assert stripe_sync.push_pending_rollups() == 1
    ledger.supersede_lost_rows([dataclasses.replace(lost, status="ok", cached_tokens=100_000, completion_tokens=21_000)])
    rollup_usage()
    assert stripe_sync.push_pending_rollups() == 1
    adjustment = UsageRollup.objects.get(kind=RollupKind.ADJUSTMENT)
    stripe_has = {meter.event_name: getattr(adjustment, meter.rollup_field) for meter in stripe_sync.METERS}
    assert stripe_has["inferplane_usage_cost"] == -88_000
    # The database is rewound past the adjustment and its push; a late row of that hour arrived meanwhile.
    MeterEventPush.objects.filter(rollup=adjustment).delete()
    UsageRollup.objects.filter(pk=adjustment.pk).delete()
    ledger.record_usage(usage_report(endpoint, request_id="late", prompt_tokens=0, completion_tokens=30_000,
                                     finished_at=hour + timedelta(minutes=20)))
    rollup_usage(full=True)
    fake_stripe.forget_idempotency_keys()
    assert stripe_sync.push_pending_rollups() == 0
    again = UsageRollup.objects.get(kind=RollupKind.ADJUSTMENT)
    assert again.push_held_at is not None and stripe_sync._DUPLICATE_HOLD in again.push_error
    assert again.cost_micro_dollars == -28_000  # the ledger: Stripe lacks the late row's $0.06
    UsageRollup.objects.filter(pk=again.pk).update(hour_start=timezone.now() - timedelta(hours=26))
    again.refresh_from_db()
    assert stripe_sync.send_held_as_new(UsageRollup.objects.filter(pk=again.pk)) == 0  # past the cancel window
    return again, {meter.event_name: stripe_has[meter.event_name]
                   for meter in stripe_sync.held_difference_meters(again)}


def test_a_held_negative_adjustment_gets_its_difference_sent_from_stripes_negative_values_once(closed_now,
                                                                                                fake_stripe):
    rollup, stripe_has = _held_negative_adjustment(fake_stripe)
    assert _send_difference(rollup, stripe_has) == 1
    for meter in stripe_sync.METERS:  # Stripe now bills the rollup's whole (signed) value
        assert _billed(fake_stripe, rollup, meter) == getattr(rollup, meter.rollup_field), meter
    cost = stripe_sync.COST_METER
    assert _billed(fake_stripe, rollup, cost) == -28_000
    # Stripe's own (negative) events are recorded at Stripe's values, beside the difference sent.
    assert sum(MeterEventPush.objects.filter(rollup=rollup, event_name=cost.event_name)
               .values_list("value", flat=True)) == -28_000
    num_events = len(fake_stripe.meter_events)
    with pytest.raises(stripe_sync.DifferenceRefused, match="not held"):
        _send_difference(rollup, stripe_has)
    assert len(fake_stripe.meter_events) == num_events
    assert stripe_sync.push_pending_rollups() == 0


def test_stripe_holding_more_than_the_ledger_gets_a_negative_difference_not_a_credit_note(fake_stripe):
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    more = {name: value + getattr(rollup, meter.rollup_field) + 7 for meter in stripe_sync.METERS
            for name, value in stripe_has.items() if name == meter.event_name}
    assert _send_difference(rollup, more) == 1
    for meter in stripe_sync.METERS:
        sent = fake_stripe.meter_events[stripe_sync.difference_identifier(rollup, meter.event_name)]
        assert int(sent["payload"]["value"]) == getattr(rollup, meter.rollup_field) - more[meter.event_name] < 0
    rollup.refresh_from_db()
    assert rollup.pushed_at is not None and rollup.push_held_at is None


def test_the_admin_form_takes_stripes_negative_values(closed_now, fake_stripe, client):
    rollup, stripe_has = _held_negative_adjustment(fake_stripe)
    answer = _post_difference(_superuser_client(client), rollup, stripe_has)
    assert answer.status_code == 302, answer.context["form"].errors if answer.context else answer
    rollup.refresh_from_db()
    assert rollup.pushed_at is not None
    assert _billed(fake_stripe, rollup, stripe_sync.COST_METER) == -28_000
