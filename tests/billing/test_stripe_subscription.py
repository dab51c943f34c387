"""What Stripe bills: one subscription per organisation to one metered price on the cost meter,
whose events sum to the ledger's cost in micro-dollars. Created once each, through failures."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db.models import Sum
from django.utils import timezone

from billing import stripe_sync
from billing.ledger import record_usage
from billing.models import BillingAccount, StripeMeter, UsageRecord, UsageRollup
from billing.rollups import rollup_usage
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db


def _hours_ago(num_hours: int):
    return timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=num_hours)


def _closed_rollups(endpoint, *, num_hours_ago: int = 3, **tokens) -> None:
    record_usage(usage_report(endpoint, finished_at=_hours_ago(num_hours_ago) + timedelta(minutes=5), **tokens))
    rollup_usage()


def _cost_total(fake_stripe) -> int:
    return sum(value for (_, event_name), value in fake_stripe.meter_totals().items() if event_name == "inferplane_usage_cost")


def test_the_first_push_for_an_organisation_creates_its_customer_and_subscription_once(fake_stripe):
    endpoint = EndpointFactory()
    _closed_rollups(endpoint)
    assert stripe_sync.push_pending_rollups() == 1
    _closed_rollups(EndpointFactory(organization=endpoint.organization))
    assert stripe_sync.push_pending_rollups() == 1
    assert stripe_sync.push_pending_rollups() == 0

    account = BillingAccount.objects.get(organization=endpoint.organization)
    assert stripe_sync.ensure_subscription(endpoint.organization_id) == account.stripe_subscription_id
    assert len(fake_stripe.calls_to("/v1/customers")) == 1
    assert len(fake_stripe.calls_to("/v1/subscriptions")) == 1
    subscription = fake_stripe.subscriptions[account.stripe_subscription_id]
    assert subscription["customer"] == account.stripe_customer_id
    [item] = subscription["items"]["data"]
    assert item["price"]["id"] == StripeMeter.objects.get(event_name="inferplane_usage_cost").stripe_price_id
    # Backdated, so that the usage pushed with it falls inside its first period. NOTE: the events' dates, not their
    # hours': an event is dated at most `LATEST_PERIOD_GRACE` back, and an hour before midnight is dated after it.
    assert subscription["start_date"] <= min(event["timestamp"] for event in fake_stripe.meter_events.values())


def test_a_subscription_stored_by_nobody_is_found_again_not_made_twice(fake_stripe):
    organization_id = EndpointFactory().organization_id
    created = stripe_sync.ensure_subscription(organization_id)
    # As if the worker died after Stripe answered and before it stored the id.
    BillingAccount.objects.filter(organization_id=organization_id).update(stripe_subscription_id="")

    assert stripe_sync.ensure_subscription(organization_id) == created
    assert len(fake_stripe.subscriptions) == 1
    assert len(fake_stripe.calls_to("/v1/subscriptions")) == 1
    assert len(fake_stripe.calls_to("/v1/subscriptions", method="GET")) == 2  # each looks before it creates


def test_the_usage_price_is_created_once_and_found_by_its_lookup_key_afterwards(fake_stripe):
    first = EndpointFactory()
    _closed_rollups(first)
    stripe_sync.push_pending_rollups()

    [create] = fake_stripe.calls_to("/v1/prices")
    cost_meter = StripeMeter.objects.get(event_name="inferplane_usage_cost")
    assert create.params["currency"] == "usd"
    assert create.params["unit_amount_decimal"] == "0.0001"  # cents: $0.000001 per micro-dollar
    assert create.params["recurring"] == {"interval": "month", "usage_type": "metered", "meter": cost_meter.stripe_meter_id}
    assert create.params["lookup_key"] == stripe_sync.USAGE_PRICE_LOOKUP_KEY

    # A database that forgot the price (restored, or a second environment) finds it by lookup key.
    StripeMeter.objects.update(stripe_price_id="")
    second = EndpointFactory()
    _closed_rollups(second)
    stripe_sync.push_pending_rollups()

    assert len(fake_stripe.calls_to("/v1/prices")) == 1
    assert len(fake_stripe.calls_to("/v1/prices", method="GET")) == 2
    assert len(fake_stripe.prices) == 1
    [price_id] = fake_stripe.prices
    assert StripeMeter.objects.get(event_name="inferplane_usage_cost").stripe_price_id == price_id
    subscribed_to = {sub["items"]["data"][0]["price"]["id"] for sub in fake_stripe.subscriptions.values()}
    assert len(fake_stripe.subscriptions) == 2 and subscribed_to == {price_id}


@pytest.mark.parametrize(("cost", "micro_dollars"), [
    ("0.000001499", 1), ("0.000001500", 2), ("0.000002500", 2), ("0.000003500", 4), ("0.000003501", 4), ("12.345678900", 12345679),
])
def test_a_rollup_cost_is_counted_in_micro_dollars_rounded_half_to_even(cost, micro_dollars):
    assert UsageRollup(cost=Decimal(cost)).cost_micro_dollars == micro_dollars


def test_cost_meter_events_sum_to_the_ledger_cost_in_micro_dollars(fake_stripe):
    # Prices that leave fractions of a micro-dollar, so that rounding is exercised.
    prices = {"price_input_per_million": Decimal("0.15"), "price_cached_input_per_million": Decimal("0.075"),
              "price_output_per_million": Decimal("0.6")}
    cheap = EndpointFactory(**prices)
    dear = EndpointFactory(organization=cheap.organization, price_input_per_million=Decimal("3.333333"),
                           price_cached_input_per_million=Decimal("1.111111"), price_output_per_million=Decimal("15.7"))
    for num_hours_ago, endpoint, tokens in [
        (5, cheap, {"prompt_tokens": 7, "cached_tokens": 3, "completion_tokens": 11}),
        (5, dear, {"prompt_tokens": 1234, "cached_tokens": 100, "completion_tokens": 777}),
        (4, cheap, {"prompt_tokens": 99_999, "cached_tokens": 1, "completion_tokens": 3}),
        (4, dear, {"prompt_tokens": 13, "cached_tokens": 0, "completion_tokens": 1}),
        (3, dear, {"prompt_tokens": 50_001, "cached_tokens": 20_000, "completion_tokens": 4_321}),
        (3, dear, {"prompt_tokens": 17, "cached_tokens": 5, "completion_tokens": 9}),
    ]:
        record_usage(usage_report(endpoint, finished_at=_hours_ago(num_hours_ago) + timedelta(minutes=5), **tokens))
    rollup_usage()

    assert stripe_sync.push_pending_rollups() == 5

    rollups = list(UsageRollup.objects.filter(organization=cheap.organization))
    ledger_cost = UsageRecord.objects.filter(organization=cheap.organization).aggregate(total=Sum("cost"))["total"]
    assert sum(rollup.cost for rollup in rollups) == ledger_cost
    assert any((rollup.cost * 1_000_000) % 1 for rollup in rollups)  # the rounding below is not vacuous
    assert _cost_total(fake_stripe) == sum(rollup.cost_micro_dollars for rollup in rollups)
    assert abs(_cost_total(fake_stripe) - ledger_cost * 1_000_000) <= Decimal("0.5") * len(rollups)


@pytest.mark.parametrize(("failure", "num_creates", "num_keys"), [
    # A key that saved a server error (it comes back replayed) is given up for a new one; one that did not is kept.
    ("500", 3, 1), ("500_saved", 3, 2), ("429", 3, 1),
    # Stripe did the work: the next try finds the subscription and creates none.
    ("500_after_work", 1, 1), ("timeout", 1, 1),
])
def test_subscription_failures_are_retried_without_a_second_subscription(fake_stripe, failure, num_creates, num_keys):
    _closed_rollups(EndpointFactory())
    fake_stripe.fail_next(failure, times=2, path="/v1/subscriptions", method="POST")

    assert stripe_sync.push_pending_rollups() == 1

    assert len(fake_stripe.subscriptions) == 1
    creates = fake_stripe.calls_to("/v1/subscriptions")
    # Under the same key Stripe would replay a saved 500 for a day.
    assert len(creates) == num_creates and len({call.idempotency_key for call in creates}) == num_keys
    [subscription_id] = fake_stripe.subscriptions
    assert BillingAccount.objects.get().stripe_subscription_id == subscription_id


@pytest.mark.parametrize("failure", ["500", "429"])
def test_price_failures_are_retried_without_a_second_price(fake_stripe, failure):
    _closed_rollups(EndpointFactory())
    fake_stripe.fail_next(failure, times=2, path="/v1/prices", method="GET")
    fake_stripe.fail_next(failure, times=2, path="/v1/prices", method="POST")

    assert stripe_sync.push_pending_rollups() == 1

    assert len(fake_stripe.prices) == 1
    creates = fake_stripe.calls_to("/v1/prices")
    assert len(creates) == 3 and len({call.idempotency_key for call in creates}) == 1  # Stripe saved no failure
    assert len(fake_stripe.calls_to("/v1/prices", method="GET")) == 3


@pytest.mark.parametrize("failure", ["500", "500_saved"])
def test_a_push_whose_subscription_cannot_be_created_sends_no_usage_and_is_retried(fake_stripe, failure):
    _closed_rollups(EndpointFactory())
    fake_stripe.fail_next(failure, times=stripe_sync.MAX_ATTEMPTS, path="/v1/subscriptions", method="POST")

    assert stripe_sync.push_pending_rollups() == 0
    assert not fake_stripe.meter_events and not fake_stripe.subscriptions
    num_creates = len(fake_stripe.calls_to("/v1/subscriptions"))

    assert stripe_sync.push_pending_rollups() == 1
    assert len(fake_stripe.subscriptions) == 1
    assert "inferplane_usage_cost" in {event["event_name"] for event in fake_stripe.meter_events.values()}
    next_run = fake_stripe.calls_to("/v1/subscriptions")[num_creates:]
    if failure == "500_saved":  # the key of the last try comes back replayed, and is given up at once
        assert [call.replayed for call in next_run] == [True, False]
