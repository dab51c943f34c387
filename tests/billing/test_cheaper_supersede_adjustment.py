"""A lost row superseded, after its hour closed and went to Stripe, by the call's own row that costs LESS: the lost
row's progress priced the prompt at the full input price (vLLM's per-chunk usage carries no `prompt_tokens_details`),
and the call's own row (its closing usage chunk, replayed from the journal) says the prompt was prefix-cache hits.

The hour's adjustment carries the whole difference, negative fields too (`billing.rollups`), and goes to Stripe as
negative meter events (Stripe takes them), once; a prepaid organisation's draw gives the overcharge back to its
grants, once. Found by the operator-faults review: before, `_apply` logged "ledger shrank" and skipped the group, so
Stripe kept the overcharge and later late rows of that hour were swallowed until they outweighed it."""

import asyncio
import dataclasses
import logging
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing import credits, ledger, stripe_sync, usage_writer
from billing.models import (
    BillingAccount,
    BillingMode,
    CreditGrant,
    MeterEventPush,
    RollupKind,
    UsageRecord,
    UsageRollup,
)
from billing.rollups import rollup_usage
from billing.services import set_billing_mode
from billing.usage_writer import Recorded
from controlplane.accounts.services import SYSTEM
from tests.billing.conftest import usage_report
from tests.billing.test_journaled_spend import _replay, journal_dir  # noqa: F401 - a fixture used here
from tests.billing.test_lost_row_superseded import (
    HELD,
    _assert_rollups_equal_the_ledger,
    _sweep_after_the_hold_lapsed,
)
from tests.billing.test_quota import _progress, reserve
from tests.factories import EndpointFactory
from tests.outages import database_refusing_connections

pytestmark = pytest.mark.django_db(transaction=True)

# The lost row: 100,000 prompt tokens priced as uncached, 20,000 out: $0.14. The call's own: all 100,000 cached,
# 21,000 out: $0.052.
LOST_COST, OWN_COST = Decimal("0.14"), Decimal("0.052")


def _cached_prompt_endpoint():
    return EndpointFactory(price_input_per_million=Decimal("1"), price_cached_input_per_million=Decimal("0.1"),
                           price_output_per_million=Decimal("2"))


def _closed_hour():
    return timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=2)


def _lost_then_closed(endpoint, lost_at, *, push: bool) -> None:
    """The call's gateway journaled its own row (PostgreSQL down) and was killed; the sweeper billed its last progress
    (`gateway_lost`), and the hour closed with it (pushed to Stripe when `push`)."""
    admitted = asyncio.run(reserve(organization_id=endpoint.organization_id, api_key_id=None, amount=HELD,
                                   request_id="streamed"))
    _progress(admitted, endpoint, prompt_tokens=100_000, completion_tokens=20_000, finished_at=lost_at)
    whole = dataclasses.replace(usage_report(endpoint, request_id="streamed", prompt_tokens=100_000,
                                             cached_tokens=100_000, completion_tokens=21_000,
                                             finished_at=lost_at + timedelta(seconds=1)),
                                max_cost=HELD, billing_mode=admitted.billing_mode)
    with database_refusing_connections():
        assert asyncio.run(usage_writer.arecord_usage(whole)) is Recorded.JOURNALED
    _sweep_after_the_hold_lapsed()
    rollup_usage()
    assert UsageRollup.objects.get().cost == LOST_COST
    if push:
        assert stripe_sync.push_pending_rollups() == 1


def _superseded() -> None:
    _replay()
    row = UsageRecord.objects.get()
    assert (row.status, row.cached_tokens, row.completion_tokens, row.cost) == ("ok", 100_000, 21_000, OWN_COST)


def _stripe_meters(fake_stripe, endpoint) -> dict[str, int]:
    customer_id = BillingAccount.objects.get(organization=endpoint.organization).stripe_customer_id
    return {name.removeprefix("inferplane_"): total for (customer, name), total in fake_stripe.meter_totals().items()
            if customer == customer_id}


@pytest.fixture
def closed_now(settings):
    settings.BILLING_RESERVATION_TTL_S = 600
    settings.BILLING_ROLLUP_CLOSE_AFTER_S = 0


def test_a_cheaper_superseding_row_of_a_closed_hour_becomes_a_negative_adjustment_that_stripe_receives_once(
        closed_now, fake_stripe, journal_dir, caplog):  # noqa: F811 - the fixture imported above
    endpoint = _cached_prompt_endpoint()
    _lost_then_closed(endpoint, _closed_hour() + timedelta(minutes=10), push=True)
    _superseded()
    with caplog.at_level(logging.ERROR, logger="billing.rollups"):
        assert rollup_usage().num_adjustments == 1
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]  # not taken for deleted usage

    adjustment = UsageRollup.objects.get(kind=RollupKind.ADJUSTMENT)
    assert (adjustment.num_requests, adjustment.prompt_tokens, adjustment.cached_tokens, adjustment.completion_tokens,
            adjustment.cost) == (0, 0, 100_000, 1_000, OWN_COST - LOST_COST)
    _assert_rollups_equal_the_ledger()
    # A Stripe server error after the work (the answer lost, as to a worker killed mid-call), then the retries.
    fake_stripe.fail_next("500_after_work", path="/v1/billing/meter_events")
    assert stripe_sync.push_pending_rollups() == 1
    assert stripe_sync.push_pending_rollups() == 0
    assert _stripe_meters(fake_stripe, endpoint) == {
        "input_tokens": 0, "cached_input_tokens": 100_000, "output_tokens": 21_000, "usage_cost": 52_000}
    assert sorted(MeterEventPush.objects.filter(rollup=adjustment).values_list("value", flat=True)) == [
        -100_000, -88_000, 1_000, 100_000]


def test_after_a_cheaper_supersede_a_later_row_of_that_closed_hour_reaches_stripe(closed_now, fake_stripe,
                                                                                    journal_dir):  # noqa: F811
    endpoint = _cached_prompt_endpoint()
    hour = _closed_hour()
    _lost_then_closed(endpoint, hour + timedelta(minutes=10), push=True)
    _superseded()
    rollup_usage()
    stripe_sync.push_pending_rollups()
    # Another call of that closed hour reaches the ledger late (its own journal replayed): 30,000 tokens out, $0.06.
    ledger.record_usage(usage_report(endpoint, request_id="late", prompt_tokens=0, completion_tokens=30_000,
                                     finished_at=hour + timedelta(minutes=20)))
    assert rollup_usage().num_adjustments == 1
    assert stripe_sync.push_pending_rollups() == 1
    _assert_rollups_equal_the_ledger()
    meters = _stripe_meters(fake_stripe, endpoint)
    assert (meters["output_tokens"], meters["usage_cost"]) == (51_000, 112_000), meters


def test_a_deleted_row_of_a_closed_hour_is_still_never_billed_backwards(closed_now, fake_stripe, caplog):
    endpoint = _cached_prompt_endpoint()
    finished_at = _closed_hour() + timedelta(minutes=5)
    for request_id in ("a", "b"):
        ledger.record_usage(usage_report(endpoint, request_id=request_id, finished_at=finished_at))
    rollup_usage()
    # Another row of the hour recorded (so that the run reads the hour again), and the two before it deleted.
    ledger.record_usage(usage_report(endpoint, request_id="c", prompt_tokens=10, completion_tokens=1,
                                     finished_at=finished_at))
    UsageRecord.objects.filter(request_id__in=["a", "b"]).delete()
    with caplog.at_level(logging.ERROR, logger="billing.rollups"):
        assert rollup_usage().num_adjustments == 0
    assert "ledger lost rows" in caplog.text


def test_a_prepaid_organisations_draw_gives_a_cheaper_supersedes_overcharge_back_once(closed_now, journal_dir):  # noqa: F811
    endpoint = _cached_prompt_endpoint()
    set_billing_mode(SYSTEM, endpoint.organization, mode=BillingMode.PREPAID)
    credits.grant_credits(SYSTEM, endpoint.organization, amount=Decimal("2.00"),
                          expires_at=timezone.now() + timedelta(days=30), granted_at=_closed_hour() - timedelta(hours=1))
    _lost_then_closed(endpoint, _closed_hour() + timedelta(minutes=10), push=False)
    credits.draw_due_credits()
    assert CreditGrant.objects.get().consumed == LOST_COST

    _superseded()
    rollup_usage()
    assert UsageRollup.objects.get(kind=RollupKind.ADJUSTMENT).cost == OWN_COST - LOST_COST
    assert credits.draw_due_credits() == 1
    assert credits.draw_credits(endpoint.organization_id) == 0  # given back once
    grant = CreditGrant.objects.get()
    account = BillingAccount.objects.get(organization=endpoint.organization)
    assert (grant.consumed, account.credit_drawn) == (OWN_COST, OWN_COST)
    assert ledger.undrawn_prepaid_spend(account) == 0
