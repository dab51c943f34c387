"""Rollups reach Stripe as meter events: once each, through 500s, 429s and timeouts.

The subscription, its price and the cost meter have their own tests in test_stripe_subscription.py.
"""

import time
from datetime import timedelta

import pytest
from django.conf import settings
from django.db.models import F
from django.utils import timezone

from billing import stripe_sync
from billing.ledger import record_usage
from billing.models import BillingAccount, MeterEventPush, UsageRecord, UsageRollup
from billing.rollups import rollup_usage
from controlplane.accounts.models import AuditEvent
from controlplane.redis_client import get_redis
from controlplane.redis_keys import PUSH_RUN_LOCK_KEY
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory, sign_in_staff

pytestmark = pytest.mark.django_db


def _closed_rollup(endpoint, *, prompt_tokens=120, cached_tokens=20, completion_tokens=30):
    finished_at = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    record_usage(usage_report(endpoint, finished_at=finished_at, prompt_tokens=prompt_tokens,
                              cached_tokens=cached_tokens, completion_tokens=completion_tokens))
    rollup_usage()
    return UsageRollup.objects.get(endpoint=endpoint, sequence=0)


def _token_total(fake_stripe) -> int:
    return sum(value for (_, event_name), value in fake_stripe.meter_totals().items() if event_name.endswith("_tokens"))


def test_a_closed_rollup_becomes_meter_events_for_input_cached_and_output_tokens_and_cost(fake_stripe):
    endpoint = EndpointFactory()
    rollup = _closed_rollup(endpoint)

    assert stripe_sync.push_pending_rollups() == 1

    customer_id = BillingAccount.objects.get(organization=endpoint.organization).stripe_customer_id
    assert fake_stripe.meter_totals() == {
        (customer_id, "inferplane_input_tokens"): 100,
        (customer_id, "inferplane_cached_input_tokens"): 20,
        (customer_id, "inferplane_output_tokens"): 30,
        (customer_id, "inferplane_usage_cost"): rollup.cost_micro_dollars,
    }
    assert rollup.cost_micro_dollars > 0
    assert sorted(fake_stripe.meter_events) == sorted(
        f"rollup-{rollup.push_uid}-{name}"
        for name in ("input_tokens", "cached_input_tokens", "output_tokens", "usage_cost"))
    rollup.refresh_from_db()
    assert rollup.pushed_at is not None


def test_the_customer_and_meters_are_created_once_when_first_needed(fake_stripe):
    endpoint = EndpointFactory()
    _closed_rollup(endpoint)
    stripe_sync.push_pending_rollups()
    later = EndpointFactory(organization=endpoint.organization)
    _closed_rollup(later)
    stripe_sync.push_pending_rollups()

    assert len(fake_stripe.calls_to("/v1/customers")) == 1
    assert len(fake_stripe.calls_to("/v1/billing/meters")) == 4


def test_a_pushed_rollup_is_never_pushed_again(fake_stripe):
    rollup = _closed_rollup(EndpointFactory())
    stripe_sync.push_pending_rollups()
    num_calls = len(fake_stripe.calls)

    assert stripe_sync.push_pending_rollups() == 0
    assert stripe_sync.push_rollup(rollup.pk) is False
    assert len(fake_stripe.calls) == num_calls


@pytest.mark.parametrize("failure", ["500", "429", "timeout"])
def test_stripe_failures_are_retried_and_never_duplicated(fake_stripe, failure, settings):
    # an injected timeout costs `STRIPE_TIMEOUT_S`: 1 s here (3 s in the fixture), still past any answer of the fake's
    settings.STRIPE_TIMEOUT_S = 1.0
    rollup = _closed_rollup(EndpointFactory())
    fake_stripe.fail_next(failure, times=2, path="/v1/billing/meter_events")

    assert stripe_sync.push_pending_rollups() == 1

    assert len(fake_stripe.meter_events) == 4
    assert _token_total(fake_stripe) == rollup.prompt_tokens + rollup.completion_tokens
    assert fake_stripe.num_duplicate_identifiers == 0
    retried = fake_stripe.calls_to("/v1/billing/meter_events")
    assert len(retried) == 6 and all(call.idempotency_key for call in retried)
    if failure == "timeout":  # Stripe did the work; the retry got the stored answer
        assert sum(call.replayed for call in retried) == 2


def test_a_push_that_keeps_failing_is_left_for_the_next_run(fake_stripe):
    rollup = _closed_rollup(EndpointFactory())
    fake_stripe.fail_next("500", times=stripe_sync.MAX_ATTEMPTS, path="/v1/billing/meter_events")

    assert stripe_sync.push_pending_rollups() == 0
    rollup.refresh_from_db()
    assert rollup.pushed_at is None and rollup.push_claimed_at is None and "injected" in rollup.push_error

    assert stripe_sync.push_pending_rollups() == 1
    assert len(fake_stripe.meter_events) == 4


@pytest.mark.parametrize("path", [
    "/v1/billing/meter_events", "/v1/customers", "/v1/billing/meters", "/v1/prices", "/v1/subscriptions"])
@pytest.mark.parametrize("failure", ["500_saved", "500_after_work"])
def test_a_500_that_stripe_saved_under_its_key_holds_nothing_up_and_nothing_counts_twice(fake_stripe, failure, path):
    """Stripe replays a saved 500 to every retry with the same key for a day: before, such a rollup (or
    every rollup, for a meter or the price) stayed unpushed that long, and was sent again once the key
    was pruned, when Stripe might no longer refuse its identifier."""
    rollup = _closed_rollup(EndpointFactory())
    fake_stripe.fail_next(failure, times=stripe_sync.MAX_ATTEMPTS, path=path, method="POST")

    num_pushed = stripe_sync.push_pending_rollups()
    num_pushed += stripe_sync.push_pending_rollups()  # the next run, a minute later

    assert num_pushed == 1
    account = BillingAccount.objects.get(organization=rollup.organization)
    assert fake_stripe.meter_totals() == {
        (account.stripe_customer_id, "inferplane_input_tokens"): rollup.input_tokens,
        (account.stripe_customer_id, "inferplane_cached_input_tokens"): rollup.cached_tokens,
        (account.stripe_customer_id, "inferplane_output_tokens"): rollup.completion_tokens,
        (account.stripe_customer_id, "inferplane_usage_cost"): rollup.cost_micro_dollars,
    }
    assert len(fake_stripe.meters) == 4 and len(fake_stripe.prices) == 1
    [subscription] = fake_stripe.subscriptions.values()
    assert (subscription["id"], subscription["customer"]) == (account.stripe_subscription_id, account.stripe_customer_id)
    if failure == "500_after_work" and path == "/v1/billing/meter_events":
        assert fake_stripe.num_duplicate_identifiers >= 1  # recorded despite its 500, refused the second time


def test_a_push_that_died_after_stripe_accepted_is_finished_without_double_billing(fake_stripe, settings):
    settings.BILLING_CLAIM_TIMEOUT_S = 0.1
    rollup = _closed_rollup(EndpointFactory())
    stripe_sync.push_pending_rollups()
    # Forget locally that it was pushed, as if the worker died after Stripe answered its last event (events go one by
    # one, each recorded before the next is sent; its try's clock still running: without it, the duplicate would be of
    # a send this database does not remember, as after a rewind, and held).
    MeterEventPush.objects.filter(rollup=rollup, event_name=stripe_sync.COST_METER.event_name).delete()
    UsageRollup.objects.filter(pk=rollup.pk).update(pushed_at=None, push_claimed_at=timezone.now() - timedelta(seconds=1),
                                                    push_first_tried_at=timezone.now())

    assert stripe_sync.push_pending_rollups() == 1
    assert _token_total(fake_stripe) == rollup.prompt_tokens + rollup.completion_tokens
    assert sum(event["event_name"] == "inferplane_usage_cost" for event in fake_stripe.meter_events.values()) == 1


def test_a_meter_event_sent_again_with_another_date_under_its_earlier_key_is_not_held_up(fake_stripe, settings):
    # Usage older than Stripe's 35 days is dated the oldest time Stripe takes, which moves with the clock (and a
    # new subscription's start moves it too): sent again, under the key of the first try, with another
    # timestamp, Stripe refused the key for 24 h (`idempotency_error`) and the rollup was stuck that long.
    settings.BILLING_CLAIM_TIMEOUT_S = 0.1
    endpoint = EndpointFactory()
    record_usage(usage_report(endpoint, finished_at=timezone.now() - timedelta(days=36), prompt_tokens=120,
                              cached_tokens=20, completion_tokens=30))
    rollup_usage()
    rollup = UsageRollup.objects.get(endpoint=endpoint)
    assert stripe_sync.push_pending_rollups() == 1
    # Forget locally that it was pushed, as if the worker died after Stripe answered its last event (events go one by
    # one, each recorded before the next is sent; its try's clock still running: without it, the duplicate would be of
    # a send this database does not remember, as after a rewind, and held).
    MeterEventPush.objects.filter(rollup=rollup, event_name=stripe_sync.COST_METER.event_name).delete()
    UsageRollup.objects.filter(pk=rollup.pk).update(pushed_at=None, push_claimed_at=timezone.now() - timedelta(seconds=1),
                                                    push_first_tried_at=timezone.now())
    time.sleep(1.1)  # the oldest time Stripe takes is a second later

    assert stripe_sync.push_pending_rollups() == 1
    assert _token_total(fake_stripe) == rollup.prompt_tokens + rollup.completion_tokens  # once
    assert fake_stripe.num_duplicate_identifiers == 1  # found under the new key, not sent twice


def test_an_open_hour_is_not_pushed(fake_stripe):
    record_usage(usage_report(EndpointFactory(), finished_at=timezone.now()))
    rollup_usage()
    assert stripe_sync.push_pending_rollups() == 0
    assert not fake_stripe.meter_events


def test_without_a_stripe_key_billing_sync_is_off(settings):
    settings.STRIPE_SECRET_KEY = ""
    _closed_rollup(EndpointFactory())
    assert stripe_sync.push_pending_rollups() == 0


def test_rollups_that_failed_before_wait_behind_those_never_tried(fake_stripe):
    failed = _closed_rollup(EndpointFactory())  # the older hour
    UsageRollup.objects.filter(pk=failed.pk).update(push_error="No such customer: 'cus_gone'")
    fresh = _closed_rollup(EndpointFactory())
    UsageRollup.objects.filter(pk=fresh.pk).update(hour_start=failed.hour_start + timedelta(hours=1))

    assert stripe_sync.push_pending_rollups(limit=1) == 1

    assert list(UsageRollup.objects.filter(pushed_at__isnull=False).values_list("pk", flat=True)) == [fresh.pk]


def test_a_push_run_claims_no_more_rollups_once_its_time_is_up(fake_stripe):
    """A run that ran into its task's time limit was killed holding a claim; many rollups that each
    use up their retries (seconds) took every run's time, oldest first."""
    rollups = [_closed_rollup(EndpointFactory()) for _ in range(3)]
    fake_stripe.latency_s = 0.1  # the first push alone makes a dozen calls

    assert stripe_sync.push_pending_rollups(budget_s=0.5) == 1

    assert UsageRollup.objects.filter(pushed_at__isnull=True, push_claimed_at__isnull=True).count() == len(rollups) - 1
    fake_stripe.latency_s = 0.0
    assert stripe_sync.push_pending_rollups() == len(rollups) - 1


def _lose_the_answer_to_the_first_event_and_fail_on(fake_stripe) -> None:
    """Stripe records the first meter event and answers 500; every retry of the run fails before Stripe's work."""
    fake_stripe.fail_next("500_after_work", path="/v1/billing/meter_events")
    fake_stripe.fail_next("500", times=stripe_sync.MAX_ATTEMPTS - 1, path="/v1/billing/meter_events")


def _a_day_passes(fake_stripe, rollup) -> None:
    fake_stripe.age_meter_events(25 * 3600)
    UsageRollup.objects.filter(pk=rollup.pk, push_first_tried_at__isnull=False).update(
        push_first_tried_at=F("push_first_tried_at") - timedelta(hours=25))


def test_an_event_unanswered_past_stripes_duplicate_window_is_held_for_an_operator_not_sent_again(fake_stripe):
    # Stripe refuses a meter event's identifier again for 24 h only: an event it recorded whose answer was lost,
    # sent again a day later (Stripe unreachable meanwhile), counted twice on the customer's invoice.
    rollup = _closed_rollup(EndpointFactory())
    _lose_the_answer_to_the_first_event_and_fail_on(fake_stripe)
    assert stripe_sync.push_pending_rollups() == 0
    _a_day_passes(fake_stripe, rollup)
    sent_before = len(fake_stripe.calls_to("/v1/billing/meter_events"))

    assert stripe_sync.push_pending_rollups() == 0
    assert stripe_sync.push_pending_rollups() == 0  # and not claimed again while held

    rollup.refresh_from_db()
    assert len(fake_stripe.calls_to("/v1/billing/meter_events")) == sent_before
    assert rollup.push_held_at is not None and rollup.pushed_at is None
    assert rollup.push_error.startswith(f"held: is rollup-{rollup.push_uid}-input_tokens in Stripe?")
    assert _token_total(fake_stripe) == rollup.input_tokens  # once, as Stripe recorded it


def test_an_operator_who_finds_the_held_event_in_stripe_confirms_it_and_the_rest_is_pushed_once(fake_stripe):
    rollup = _closed_rollup(EndpointFactory())
    _lose_the_answer_to_the_first_event_and_fail_on(fake_stripe)
    stripe_sync.push_pending_rollups()
    _a_day_passes(fake_stripe, rollup)
    stripe_sync.push_pending_rollups()

    assert stripe_sync.confirm_held(UsageRollup.objects.filter(pk=rollup.pk)) == 1
    assert stripe_sync.push_pending_rollups() == 1

    account = BillingAccount.objects.get(organization=rollup.organization)
    assert fake_stripe.meter_totals() == {
        (account.stripe_customer_id, "inferplane_input_tokens"): rollup.input_tokens,
        (account.stripe_customer_id, "inferplane_cached_input_tokens"): rollup.cached_tokens,
        (account.stripe_customer_id, "inferplane_output_tokens"): rollup.completion_tokens,
        (account.stripe_customer_id, "inferplane_usage_cost"): rollup.cost_micro_dollars,
    }


def test_an_operator_who_finds_no_held_event_in_stripe_releases_it_and_it_is_sent(fake_stripe):
    rollup = _closed_rollup(EndpointFactory())
    fake_stripe.fail_next("500", times=stripe_sync.MAX_ATTEMPTS, path="/v1/billing/meter_events")  # nothing recorded
    stripe_sync.push_pending_rollups()
    _a_day_passes(fake_stripe, rollup)
    stripe_sync.push_pending_rollups()

    assert stripe_sync.release_held(UsageRollup.objects.filter(pk=rollup.pk)) == 1
    assert stripe_sync.push_pending_rollups() == 1
    assert _token_total(fake_stripe) == rollup.prompt_tokens + rollup.completion_tokens


def test_an_event_confirmed_starts_the_next_events_clock(fake_stripe):
    # A rollup whose first event went through a day ago and whose second keeps failing now is not held: the
    # second was first sent now.
    rollup = _closed_rollup(EndpointFactory())
    fake_stripe.fail_next("500", times=stripe_sync.MAX_ATTEMPTS, path="/v1/billing/meter_events")
    stripe_sync.push_pending_rollups()
    first = stripe_sync.METERS[0]
    MeterEventPush.objects.create(rollup=rollup, event_name=first.event_name, value=rollup.input_tokens,
                                  identifier=stripe_sync.meter_event_identifier(rollup, first.event_name))
    UsageRollup.objects.filter(pk=rollup.pk).update(push_first_tried_at=None)  # as its confirmation leaves it

    assert stripe_sync.push_pending_rollups() == 1
    rollup.refresh_from_db()
    assert rollup.push_held_at is None and rollup.push_first_tried_at is None


def test_a_superuser_releases_a_held_rollup_from_the_admin(fake_stripe, client):
    from django.contrib.auth import get_user_model

    rollup = _closed_rollup(EndpointFactory())
    fake_stripe.fail_next("500", times=stripe_sync.MAX_ATTEMPTS, path="/v1/billing/meter_events")
    stripe_sync.push_pending_rollups()
    _a_day_passes(fake_stripe, rollup)
    stripe_sync.push_pending_rollups()
    sign_in_staff(client, get_user_model().objects.create_superuser("ops@example.test", "ops@example.test", "a long passphrase"))

    listed = client.get("/django-admin/billing/usagerollup/", {"push_held_at__isnull": "False"})
    released = client.post("/django-admin/billing/usagerollup/", {"action": "release_held", "_selected_action": [rollup.pk]})

    assert listed.status_code == 200 and f"rollup-{rollup.push_uid}-input_tokens" in listed.content.decode()
    assert released.status_code == 302
    rollup.refresh_from_db()
    assert rollup.push_held_at is None and rollup.push_first_tried_at is None


def test_a_rollup_id_handed_out_again_after_the_database_went_back_in_time_is_billed_to_its_own_customer(fake_stripe):
    # PostgreSQL restored to a point in time, or failed over to a replica that was behind, hands out ids it had handed
    # out before. Identifiers made of the id (`rollup-{id}-…`) were ones Stripe had taken within the day: another
    # organisation's new rollup was refused as a duplicate, recorded as pushed, and never billed.
    first = _closed_rollup(EndpointFactory())
    assert stripe_sync.push_pending_rollups() == 1
    reused_id = first.pk
    # What the rewind lost: the rollup, its pushes and its usage.
    MeterEventPush.objects.filter(rollup=first).delete()
    UsageRollup.objects.filter(pk=reused_id).delete()
    UsageRecord.objects.filter(organization_id=first.organization_id).delete()
    second = _closed_rollup(EndpointFactory())  # another organisation's
    UsageRollup.objects.filter(pk=second.pk).update(id=reused_id)
    second = UsageRollup.objects.get(pk=reused_id)
    assert second.organization_id != first.organization_id

    assert stripe_sync.push_pending_rollups() == 1

    customer_id = BillingAccount.objects.get(organization=second.organization).stripe_customer_id
    billed = {event_name: value for (customer, event_name), value in fake_stripe.meter_totals().items()
              if customer == customer_id}
    assert billed == {
        "inferplane_input_tokens": second.input_tokens,
        "inferplane_cached_input_tokens": second.cached_tokens,
        "inferplane_output_tokens": second.completion_tokens,
        "inferplane_usage_cost": second.cost_micro_dollars,
    }
    assert fake_stripe.num_duplicate_identifiers == 0


@pytest.mark.parametrize("pushed_again", ["within the second", "a minute later"])
def test_a_rollup_made_again_after_the_database_went_back_in_time_is_not_billed_twice(fake_stripe, monkeypatch,
                                                                                      pushed_again):
    # The other side of a rewind: a rollup pushed after the point the database went back to is gone with its pushes,
    # but the usage it summed was recorded before that point and is still there, so the next run makes the rollup
    # again. With a random push_uid its events were new to Stripe, and the hour was billed twice (found by the review
    # of this change). Made of what the rollup is (its endpoint, hour, billing mode and sequence), the identifier is
    # the same, and Stripe refuses the events it has. Pushed again within the second, the requests are the same and
    # Stripe replays its answers; later, its events are dated otherwise (`stripe_sync.event_timestamp`: at most
    # `LATEST_PERIOD_GRACE` back, by PostgreSQL's clock as the push reads it), so Stripe refuses the first key as sent
    # with other parameters, and the identifier as a duplicate: held for an operator to confirm, though equal. NOTE:
    # the clocks are frozen: before, the test passed only while both pushes fell within the same second.
    frozen = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: frozen)
    monkeypatch.setattr(stripe_sync, "database_now", lambda: frozen)
    endpoint = EndpointFactory()
    first = _closed_rollup(endpoint)
    assert stripe_sync.push_pending_rollups() == 1
    MeterEventPush.objects.filter(rollup=first).delete()
    UsageRollup.objects.filter(pk=first.pk).delete()

    rollup_usage(full=True)
    again = UsageRollup.objects.get(endpoint=endpoint, sequence=0)
    assert again.pk != first.pk and again.push_uid == first.push_uid
    if pushed_again == "a minute later":
        monkeypatch.setattr(timezone, "now", lambda: frozen + timedelta(minutes=1))
        monkeypatch.setattr(stripe_sync, "database_now", lambda: frozen + timedelta(minutes=1))
    assert stripe_sync.push_pending_rollups() == (1 if pushed_again == "within the second" else 0)

    assert _token_total(fake_stripe) == first.prompt_tokens + first.completion_tokens  # once
    assert len(fake_stripe.meter_events) == 4  # Stripe took each event once (the same idempotency key, or identifier)
    again.refresh_from_db()
    if pushed_again == "a minute later":
        assert again.push_held_at is not None and stripe_sync._DUPLICATE_HOLD in again.push_error


@pytest.mark.parametrize("keys", ["kept", "forgotten"])
def test_a_rollup_made_again_with_more_usage_after_the_database_went_back_in_time_is_held_then_billed_whole(
        fake_stripe, keys, client):
    from django.contrib.auth import get_user_model

    # After a rewind past an hour's close (within a day of its push), rows of the hour that reach the ledger again
    # (a journal's late rows) make its rollup again larger than what Stripe holds under its identifiers. Before,
    # Stripe's `duplicate_meter_event` was recorded as our value accepted and the rollup marked pushed (the push
    # returned 1): Stripe had 150 tokens / 20 µ$ while the ledger and the rollup had 1650 / 270 µ$, billed by nobody.
    # Stripe refuses the first event's idempotency key as sent with other parameters while it keeps it (a day), and
    # its identifier as a duplicate after.
    endpoint = EndpointFactory()
    first = _closed_rollup(endpoint)
    assert stripe_sync.push_pending_rollups() == 1
    MeterEventPush.objects.filter(rollup=first).delete()  # the rewind: the rollup and its pushes are gone...
    UsageRollup.objects.filter(pk=first.pk).delete()
    record_usage(usage_report(endpoint, finished_at=first.hour_start + timedelta(minutes=10), prompt_tokens=1000,
                              cached_tokens=0, completion_tokens=500))  # ...and a late row of the hour is back
    rollup_usage(full=True)
    again = UsageRollup.objects.get(endpoint=endpoint, sequence=0)
    assert again.push_uid == first.push_uid and again.completion_tokens == 530
    if keys == "forgotten":
        fake_stripe.forget_idempotency_keys()

    assert stripe_sync.push_pending_rollups() == 0
    assert stripe_sync.push_pending_rollups() == 0  # and not claimed again while held
    again.refresh_from_db()
    assert again.pushed_at is None and again.push_held_at is not None
    assert again.push_error == (f"held: rollup-{again.push_uid}-* refused as a duplicate of a send this database does "
                                f"not remember: does Stripe have input_tokens {again.input_tokens}, cached_input_tokens "
                                f"20, output_tokens 530, usage_cost {again.cost_micro_dollars}?")
    assert _token_total(fake_stripe) == first.prompt_tokens + first.completion_tokens  # Stripe's, unchanged
    # Audited, as the unknown-lines hold is: before, only a log line and `push_held_at` told of it.
    [audited] = AuditEvent.objects.filter(action="billing.push_held_duplicate")
    assert audited.organization_id == again.organization_id and audited.details == {
        "rollups": [again.pk], "reason": again.push_error}

    # The operator finds less in Stripe, cancels the rollup's events there (a meter event adjustment), and sends it as new.
    for identifier in [identifier for identifier in fake_stripe.meter_events if str(again.push_uid) in identifier]:
        del fake_stripe.meter_events[identifier]
    sign_in_staff(client, get_user_model().objects.create_superuser("ops@example.test", "ops@example.test", "a long passphrase"))
    sent = client.post("/django-admin/billing/usagerollup/", {"action": "send_held_as_new", "_selected_action": [again.pk]})
    assert sent.status_code == 302
    again.refresh_from_db()
    assert (again.push_held_at, again.push_generation) == (None, 1)  # new identifiers: rollup-<uuid>-g1-…
    assert stripe_sync.push_pending_rollups() == 1

    billed_cost = sum(value for (_, name), value in fake_stripe.meter_totals().items()
                      if name == stripe_sync.COST_METER.event_name)
    assert (_token_total(fake_stripe), billed_cost) == (again.prompt_tokens + again.completion_tokens,
                                                       again.cost_micro_dollars)


def test_a_rollup_made_again_the_same_after_stripe_forgot_its_keys_is_held_and_confirmed_whole(fake_stripe):
    # Stripe keeps idempotency keys for a day and refuses identifiers for "at least" that long: the same rollup made
    # again after a rewind, once the keys are gone, is refused as a duplicate that this database never sent, whose
    # value it cannot read. Held; the operator finds the same values in Stripe and confirms every event named.
    endpoint = EndpointFactory()
    first = _closed_rollup(endpoint)
    assert stripe_sync.push_pending_rollups() == 1
    MeterEventPush.objects.filter(rollup=first).delete()
    UsageRollup.objects.filter(pk=first.pk).delete()
    rollup_usage(full=True)
    again = UsageRollup.objects.get(endpoint=endpoint, sequence=0)
    fake_stripe.forget_idempotency_keys()

    assert stripe_sync.push_pending_rollups() == 0
    assert stripe_sync.confirm_held(UsageRollup.objects.filter(pk=again.pk)) == 1
    assert stripe_sync.push_pending_rollups() == 1  # nothing left to send

    again.refresh_from_db()
    assert again.pushed_at is not None and again.push_held_at is None
    assert sorted(MeterEventPush.objects.filter(rollup=again).values_list("value", flat=True)) == sorted(
        [again.input_tokens, again.cached_tokens, again.completion_tokens, again.cost_micro_dollars])
    assert _token_total(fake_stripe) == first.prompt_tokens + first.completion_tokens  # once
    assert len(fake_stripe.meter_events) == 4


def test_a_rollup_made_before_push_uids_keeps_the_identifiers_made_of_its_id(fake_stripe):
    # Its events may be in Stripe already under those identifiers (sent by a push whose answer was lost): only the same
    # identifier keeps Stripe refusing one a second time (billing/0016 leaves such rows' push_uid null).
    rollup = _closed_rollup(EndpointFactory())
    UsageRollup.objects.filter(pk=rollup.pk).update(push_uid=None)
    fake_stripe.fail_next("500_after_work", path="/v1/billing/meter_events")  # the first event is in Stripe
    fake_stripe.fail_next("500", times=stripe_sync.MAX_ATTEMPTS - 1, path="/v1/billing/meter_events")
    assert stripe_sync.push_pending_rollups() == 0

    assert stripe_sync.push_pending_rollups() == 1

    assert sorted(fake_stripe.meter_events) == sorted(
        f"rollup-{rollup.pk}-{name}" for name in ("input_tokens", "cached_input_tokens", "output_tokens", "usage_cost"))
    assert _token_total(fake_stripe) == rollup.prompt_tokens + rollup.completion_tokens  # the first event once


def _a_rollup_of_an_organisation_in_stripe() -> UsageRollup:
    """A closed rollup of an organisation whose customer, subscription and meters are in Stripe already: the first
    call of its push is its first meter event."""
    endpoint = EndpointFactory()
    _closed_rollup(endpoint)
    assert stripe_sync.push_pending_rollups() == 1
    return _closed_rollup(EndpointFactory(organization=endpoint.organization))


def test_a_push_refused_for_a_revoked_key_is_sent_once_the_key_is_good_again_not_held(fake_stripe, settings):
    # A definite refusal ran the 23 h clock kept for answers that never came: after a weekend with a rolled or revoked
    # key, every rollup was held for an operator ("held: is rollup-… in Stripe?"), though Stripe had recorded nothing.
    rollup = _a_rollup_of_an_organisation_in_stripe()
    fake_stripe.revoke_key(settings.STRIPE_SECRET_KEY)

    assert stripe_sync.push_pending_rollups() == 0
    rollup.refresh_from_db()
    assert "Expired API Key provided" in rollup.push_error  # why it is not pushed, for whoever looks
    _a_day_passes(fake_stripe, rollup)
    fake_stripe.restore_key(settings.STRIPE_SECRET_KEY)

    assert stripe_sync.push_pending_rollups() == 1
    rollup.refresh_from_db()
    assert rollup.push_held_at is None and rollup.pushed_at is not None and rollup.push_error == ""
    assert _token_total(fake_stripe) == 2 * (rollup.prompt_tokens + rollup.completion_tokens)


@pytest.mark.parametrize("refusal", ["400", "401", "403", "429"])
def test_an_event_stripe_refused_outright_starts_no_unanswered_clock(fake_stripe, refusal):
    rollup = _a_rollup_of_an_organisation_in_stripe()
    tries = stripe_sync.MAX_ATTEMPTS if refusal == "429" else 1  # a 429 is retried, the rest are not
    fake_stripe.fail_next(refusal, times=tries, path="/v1/billing/meter_events")

    assert stripe_sync.push_pending_rollups() == 0
    rollup.refresh_from_db()
    assert rollup.push_first_tried_at is None and f"injected {refusal}" in rollup.push_error
    _a_day_passes(fake_stripe, rollup)

    assert stripe_sync.push_pending_rollups() == 1
    rollup.refresh_from_db()
    assert rollup.push_held_at is None and rollup.pushed_at is not None


@pytest.mark.parametrize("unanswered_try", ["this run", "an earlier run"])
def test_a_refusal_after_a_try_whose_answer_was_lost_leaves_that_trys_clock_running(fake_stripe, unanswered_try):
    # The lost answer's event may be in Stripe: a refusal of a later try (the key revoked meanwhile) says nothing of
    # it. Sent again past Stripe's duplicate window, it could bill twice: held, as before.
    rollup = _a_rollup_of_an_organisation_in_stripe()
    fake_stripe.fail_next("500_after_work", path="/v1/billing/meter_events")  # in Stripe, its answer a 500
    if unanswered_try == "an earlier run":
        fake_stripe.fail_next("500", times=stripe_sync.MAX_ATTEMPTS - 1, path="/v1/billing/meter_events")
        assert stripe_sync.push_pending_rollups() == 0
    fake_stripe.fail_next("401", path="/v1/billing/meter_events")

    assert stripe_sync.push_pending_rollups() == 0
    rollup.refresh_from_db()
    assert rollup.push_first_tried_at is not None and "injected 401" in rollup.push_error
    _a_day_passes(fake_stripe, rollup)

    assert stripe_sync.push_pending_rollups() == 0
    rollup.refresh_from_db()
    assert rollup.push_held_at is not None and rollup.push_error.startswith("held:")


def test_a_push_run_stops_at_the_first_refusal_of_its_key(fake_stripe, settings):
    # Every rollup would be refused the same way: a call each, every minute, for as long as the key stays bad.
    organization = _a_rollup_of_an_organisation_in_stripe().organization
    for _ in range(2):
        _closed_rollup(EndpointFactory(organization=organization))
    fake_stripe.revoke_key(settings.STRIPE_SECRET_KEY)
    num_calls = len(fake_stripe.calls)

    assert stripe_sync.push_pending_rollups() == 0

    assert len(fake_stripe.calls) == num_calls + 1
    fake_stripe.restore_key(settings.STRIPE_SECRET_KEY)
    assert stripe_sync.push_pending_rollups() == 3


def test_usage_pushed_late_is_dated_within_the_grace_stripe_gives_a_period_that_just_ended(fake_stripe):
    # Stripe bills an event in the period its timestamp falls in, and takes usage for a period that ended only during
    # its invoice's finalization grace (an hour by default). Dated at the start of its hour, the last hour of every
    # period reached Stripe ~70 minutes on, and any usage pushed late (Stripe down, a held rollup released) later
    # still: billed by no invoice.
    endpoint = EndpointFactory()
    rollup = _closed_rollup(endpoint)  # an hour that began 3 h ago: its pushes failed until now
    before = time.time()
    assert stripe_sync.push_pending_rollups() == 1
    stamps = {event["timestamp"] for event in fake_stripe.meter_events.values()}
    assert len(stamps) == 1 and before - stripe_sync.LATEST_PERIOD_GRACE.total_seconds() - 1 <= stamps.pop() <= time.time()
    assert rollup.hour_start.timestamp() < before - 2 * 3600


def test_one_push_run_at_a_time(fake_stripe):
    # With Stripe down each run spent its whole budget failing, a new one began every minute beside it, and together
    # they held every slot of the scheduler's workers: autoscaler ticks and sweeps expired behind them.
    endpoint = EndpointFactory()
    _closed_rollup(endpoint)
    running = get_redis().lock(PUSH_RUN_LOCK_KEY, timeout=60)
    assert running.acquire(blocking=False)

    assert stripe_sync.push_pending_rollups() == 0  # another run is going: this one leaves at once
    assert fake_stripe.meter_events == {}

    running.release()
    assert stripe_sync.push_pending_rollups() == 1
    assert get_redis().get(PUSH_RUN_LOCK_KEY) is None  # released when the run ends


def test_every_beat_is_dropped_once_its_next_is_due():
    # A backlog (a worker down or busy) ran all at once when it came back, each run beside the next.
    for name, entry in settings.CELERY_BEAT_SCHEDULE.items():
        assert 0 < entry.get("options", {}).get("expires", 0) <= max(entry["schedule"] * 2, 10), name


def test_a_push_runs_lock_outlives_its_timeout_while_it_runs_and_not_its_worker(
    fake_stripe, monkeypatch, settings
):
    # The lock was held for the task's whole time limit: a worker killed mid-run kept every push away for 10 minutes.
    settings.BILLING_PUSH_RUN_LOCK_S = 1.5
    endpoint = EndpointFactory()
    _closed_rollup(endpoint)
    push_rollup, ttls = stripe_sync.push_rollup, []

    def slow_push(rollup_id):
        time.sleep(2.5)  # past the lock's timeout: its renewals keep it
        ttls.append(get_redis().pttl(PUSH_RUN_LOCK_KEY))
        return push_rollup(rollup_id)

    monkeypatch.setattr(stripe_sync, "push_rollup", slow_push)
    assert stripe_sync.push_pending_rollups() == 1
    assert ttls and ttls[0] > 0
    assert get_redis().get(PUSH_RUN_LOCK_KEY) is None


def test_a_push_runs_lock_lasts_what_the_setting_says(fake_stripe, monkeypatch, settings):
    # INFERPLANE_BILLING_PUSH_RUN_LOCK_S: how long a killed worker's run holds off the next (30 s by default).
    settings.BILLING_PUSH_RUN_LOCK_S = 7
    _closed_rollup(EndpointFactory())
    push_rollup, ttls = stripe_sync.push_rollup, []

    def push_noting_the_lock(rollup_id):
        ttls.append(get_redis().pttl(PUSH_RUN_LOCK_KEY))
        return push_rollup(rollup_id)

    monkeypatch.setattr(stripe_sync, "push_rollup", push_noting_the_lock)
    assert stripe_sync.push_pending_rollups() == 1
    assert ttls and 0 < ttls[0] <= 7000


def test_a_meter_event_whose_key_is_in_flight_elsewhere_is_tried_again(fake_stripe):
    # Stripe answers a request whose idempotency key another request is still using (a second worker's push of the
    # same event) with a 409 `idempotency_error`, which the library raises as a plain APIError: the retry meant for it
    # never ran, and the push failed at once (found by the meter identifiers' helper).
    rollup = _closed_rollup(EndpointFactory())
    fake_stripe.fail_next("409_in_flight", path="/v1/billing/meter_events")

    assert stripe_sync.push_pending_rollups() == 1

    assert _token_total(fake_stripe) == rollup.prompt_tokens + rollup.completion_tokens
    assert [call.injected for call in fake_stripe.calls if call.injected] == ["409_in_flight"]
