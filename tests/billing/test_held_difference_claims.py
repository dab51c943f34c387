"""A held duplicate's "send the difference" (`stripe_sync.send_held_difference`) claims its rollup before it calls
Stripe, fixes what it sends, refuses to guess past Stripe's duplicate window, and never sends to another customer than
the events it completes; "send as new" only while Stripe can certainly still cancel the events."""

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from billing import stripe_sync
from billing.models import BillingAccount, MeterEventPush, UsageRollup
from controlplane.accounts.models import AuditEvent
from tests.billing.test_held_duplicates import (
    CHANGELIST,
    _billed,
    _customer,
    _held_with_more_than_stripe,
    _post_difference,
    _send_difference,
    _superuser_client,
)

pytestmark = pytest.mark.django_db


def _billed_as_the_ledger(fake_stripe, rollup) -> dict:
    return {meter.event_name: (_billed(fake_stripe, rollup, meter), getattr(rollup, meter.rollup_field))
            for meter in stripe_sync.METERS
            if _billed(fake_stripe, rollup, meter) != getattr(rollup, meter.rollup_field)}


def _run_killed_before_recording(monkeypatch, rollup, stripe_has) -> None:
    """A run of the difference whose web process dies (a deploy, OOM) after Stripe took its first event."""
    def killed_before_recording(*args, **kwargs):
        raise SystemExit("pod killed")

    with monkeypatch.context() as patched:
        patched.setattr(stripe_sync, "_record_accepted", killed_before_recording)
        with pytest.raises(SystemExit):
            _send_difference(rollup, stripe_has)


def test_a_difference_run_again_a_day_after_one_that_died_asks_whether_stripe_has_its_event(fake_stripe, monkeypatch):
    # Before, the rerun a day later (Stripe's keys and duplicate window gone) sent the first event again: the test saw
    # input_tokens billed 2100 against a ledger of 1100.
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    UsageRollup.objects.filter(pk=rollup.pk).update(push_held_at=timezone.now() - timedelta(days=2))
    _run_killed_before_recording(monkeypatch, rollup, stripe_has)
    num_events = len(fake_stripe.meter_events)
    fake_stripe.age_meter_events(25 * 3600)
    fake_stripe.forget_idempotency_keys()
    UsageRollup.objects.filter(pk=rollup.pk).update(difference_started_at=timezone.now() - timedelta(hours=25))

    with pytest.raises(stripe_sync.DifferenceRefused, match="look it up in Stripe") as refused:
        _send_difference(rollup, stripe_has)
    assert stripe_sync.difference_identifier(rollup, "inferplane_input_tokens") in str(refused.value)
    assert len(fake_stripe.meter_events) == num_events
    # The operator finds it in Stripe: recorded as sent, the rest sent, the rollup pushed; billed once.
    assert _send_difference(rollup, stripe_has, pending_in_stripe=True) == 1
    assert _billed_as_the_ledger(fake_stripe, rollup) == {}
    rollup.refresh_from_db()
    assert rollup.pushed_at is not None and rollup.difference_started_at is None


def test_a_difference_whose_lost_event_stripe_lacks_sends_it_when_the_operator_says_so(fake_stripe, monkeypatch):
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    _run_killed_before_recording(monkeypatch, rollup, stripe_has)
    lost = stripe_sync.difference_identifier(rollup, "inferplane_input_tokens")
    del fake_stripe.meter_events[lost]  # the operator found no such event (cancelled, say)
    fake_stripe.forget_idempotency_keys()
    UsageRollup.objects.filter(pk=rollup.pk).update(difference_started_at=timezone.now() - timedelta(hours=24))

    assert _send_difference(rollup, stripe_has, pending_in_stripe=False) == 1
    assert _billed_as_the_ledger(fake_stripe, rollup) == {}


def test_a_difference_run_again_within_the_day_sends_nothing_twice(fake_stripe, monkeypatch):
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    _run_killed_before_recording(monkeypatch, rollup, stripe_has)
    fake_stripe.forget_idempotency_keys()
    assert _send_difference(rollup, stripe_has) == 1
    assert _billed_as_the_ledger(fake_stripe, rollup) == {}


def test_send_as_new_while_a_difference_is_being_sent_is_refused(fake_stripe, monkeypatch):
    # Before, a second superuser's "send as new" during the difference's Stripe calls went through: the push then sent
    # the whole value under new identifiers besides the difference (the test saw each meter billed over the ledger),
    # and the difference's run returned 0 with its records written all the same.
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    UsageRollup.objects.filter(pk=rollup.pk).update(push_held_at=timezone.now() - timedelta(hours=2))
    original, raced = stripe_sync._send_difference, []

    def other_staff_meanwhile(*args):
        if not raced:
            held = UsageRollup.objects.filter(pk=rollup.pk)
            raced.append((stripe_sync.send_held_as_new(held), stripe_sync.release_held(held),
                          stripe_sync.confirm_held(held)))
        return original(*args)

    monkeypatch.setattr(stripe_sync, "_send_difference", other_staff_meanwhile)
    assert _send_difference(rollup, stripe_has) == 1
    assert raced == [(0, 0, 0)]
    assert stripe_sync.push_pending_rollups() == 0
    assert _billed_as_the_ledger(fake_stripe, rollup) == {}


def test_the_admin_says_so_when_another_run_marked_the_rollup_first(fake_stripe, monkeypatch, client):
    # Before, the admin showed "Sent the difference …; it is pushed." for a run that marked nothing.
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    client = _superuser_client(client)
    original, nested = stripe_sync._send_difference, []

    def another_run_finishes_first(*args):
        if not nested:
            nested.append("running")
            # One run sends at a time: another takes over only from a run silent for the claim's timeout (stuck).
            UsageRollup.objects.filter(pk=rollup.pk).update(push_claimed_at=timezone.now() - timedelta(
                seconds=settings.BILLING_CLAIM_TIMEOUT_S + 1))
            nested[0] = _send_difference(rollup, stripe_has)
        return original(*args)

    monkeypatch.setattr(stripe_sync, "_send_difference", another_run_finishes_first)
    answer = _post_difference(client, rollup, stripe_has)
    monkeypatch.undo()

    assert nested == [1]
    shown = [(str(message), message.level_tag) for message in answer.wsgi_request._messages]
    assert any("was NOT marked by this run" in text and tag == "error" for text, tag in shown), shown
    assert not any(tag == "success" for _, tag in shown), shown
    assert AuditEvent.objects.filter(action=stripe_sync.DIFFERENCE_AUDIT_ACTION).count() == 1
    assert _billed_as_the_ledger(fake_stripe, rollup) == {}
    cost = stripe_sync.COST_METER.event_name
    assert sum(MeterEventPush.objects.filter(rollup=rollup, event_name=cost).values_list("value", flat=True)) == (
        rollup.cost_micro_dollars)


def test_a_difference_run_again_with_other_values_is_refused(fake_stripe):
    # Before, the rerun with other values than a failed run's sent (its key reused with other parameters, then the
    # identifier refused as a duplicate) and recorded the new value against the event Stripe has at the old one.
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    original = stripe_sync._send_difference

    def stripe_lost_after_the_first(*args):
        original(*args)
        raise stripe_sync.stripe.APIConnectionError("lost")

    stripe_sync._send_difference = stripe_lost_after_the_first
    try:
        with pytest.raises(stripe_sync.stripe.APIConnectionError):
            _send_difference(rollup, stripe_has)
    finally:
        stripe_sync._send_difference = original
    other = {**stripe_has, "inferplane_input_tokens": stripe_has["inferplane_input_tokens"] + 1}
    with pytest.raises(stripe_sync.DifferenceRefused, match="enter the same values"):
        _send_difference(rollup, other)
    [recorded] = MeterEventPush.objects.filter(identifier=stripe_sync.difference_identifier(rollup,
                                                                                            "inferplane_input_tokens"))
    assert recorded.value == rollup.input_tokens - stripe_has["inferplane_input_tokens"]
    assert _send_difference(rollup, stripe_has) == 1
    assert _billed_as_the_ledger(fake_stripe, rollup) == {}


def test_a_difference_for_events_on_another_customer_is_refused(fake_stripe, client):
    # Before, the difference went to the organisation's customer of now and Stripe's events were recorded against it,
    # whatever customer they sat on (the test saw the rollup pushed and the events recorded on the current customer).
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    num_events = len(fake_stripe.meter_events)
    answer = _post_difference(_superuser_client(client), rollup, {**stripe_has, "stripe_customer_id": "cus_deleted"})

    assert answer.status_code == 200 and b"settle it in Stripe by hand" in answer.content
    assert len(fake_stripe.meter_events) == num_events
    rollup.refresh_from_db()
    assert rollup.pushed_at is None and rollup.difference_started_at is None
    # Its events recorded as sent to a customer the organisation no longer has: refused whatever the operator enters.
    cost = stripe_sync.COST_METER
    MeterEventPush.objects.create(rollup=rollup, event_name=cost.event_name, value=stripe_has[cost.event_name],
                                  identifier=stripe_sync.meter_event_identifier(rollup, cost.event_name),
                                  stripe_customer_id=_customer(rollup))
    BillingAccount.objects.filter(organization_id=rollup.organization_id).update(stripe_customer_id="cus_new")
    with pytest.raises(stripe_sync.DifferenceRefused, match="not the organisation's now"):
        stripe_sync.send_held_difference(None, rollup.pk, stripe_has, stripe_customer_id="cus_new")
    assert len(fake_stripe.meter_events) == num_events


def test_a_rollup_held_lately_whose_hour_ended_over_a_day_ago_is_not_sent_as_new(fake_stripe, client):
    # Stripe received its events at the push before the rewind, no earlier than its hour's end: held an hour ago, its
    # events may have reached Stripe 25 hours ago. Before, it was sent whole as new (the test saw push_generation 1).
    rollup, _ = _held_with_more_than_stripe(fake_stripe)
    UsageRollup.objects.filter(pk=rollup.pk).update(push_held_at=timezone.now() - timedelta(hours=1),
                                                    hour_start=timezone.now() - timedelta(hours=25, minutes=1))
    answer = _superuser_client(client).post(CHANGELIST, {"action": "send_held_as_new", "_selected_action": [rollup.pk]},
                                            follow=True)

    rollup.refresh_from_db()
    assert rollup.push_generation == 0 and rollup.push_held_at is not None
    shown = [str(message) for message in answer.context["messages"]]
    assert any("their hour ended over 24 hours ago" in message and "send the difference" in message
               for message in shown), shown
    assert _customer(rollup)


@pytest.mark.parametrize("action", ["release_held", "confirm_held", "send_held_as_new"])
def test_the_admin_refuses_to_release_confirm_or_send_as_new_a_rollup_whose_difference_has_begun(fake_stripe,
                                                                                                  monkeypatch, client,
                                                                                                  action):
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    _run_killed_before_recording(monkeypatch, rollup, stripe_has)
    answer = _superuser_client(client).post(CHANGELIST, {"action": action, "_selected_action": [rollup.pk]},
                                            follow=True)

    rollup.refresh_from_db()
    assert rollup.push_held_at is not None and rollup.push_generation == 0 and rollup.difference_started_at
    shown = [str(message) for message in answer.context["messages"]]
    assert any(f"Rollups [{rollup.pk}] were NOT" in message and "send the difference" in message
               for message in shown), shown


def test_the_admin_asks_about_the_lost_difference_event_and_takes_the_answer(fake_stripe, monkeypatch, client):
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    _run_killed_before_recording(monkeypatch, rollup, stripe_has)
    fake_stripe.forget_idempotency_keys()
    UsageRollup.objects.filter(pk=rollup.pk).update(difference_started_at=timezone.now() - timedelta(hours=25))
    client = _superuser_client(client)

    asked = _post_difference(client, rollup, stripe_has)
    assert asked.status_code == 200 and b"look it up in Stripe" in asked.content
    answered = _post_difference(client, rollup, {**stripe_has, "pending_in_stripe": "yes"})
    assert answered.status_code == 302
    assert _billed_as_the_ledger(fake_stripe, rollup) == {}
    rollup.refresh_from_db()
    assert rollup.pushed_at is not None
