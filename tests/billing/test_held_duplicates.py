"""A rollup held as a duplicate (`stripe_sync.hold_duplicate`: the database went back past its push) and what staff do
with it: send it as new only while Stripe can still cancel its events, else send the difference."""

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from billing import stripe_sync
from billing.ledger import record_usage
from billing.models import BillingAccount, MeterEventPush, UsageRollup
from billing.rollups import rollup_usage
from controlplane.accounts.models import AuditEvent
from controlplane.accounts.services import SYSTEM
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory, sign_in_staff

pytestmark = pytest.mark.django_db

CHANGELIST = "/django-admin/billing/usagerollup/"


def _held_with_more_than_stripe(fake_stripe) -> tuple[UsageRollup, dict[str, int]]:
    """A rollup pushed, rewound away with its pushes, made again with a late row more, and held as a duplicate; and
    what Stripe holds of each of its meters (what was pushed before the rewind)."""
    endpoint = EndpointFactory()
    finished_at = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    record_usage(usage_report(endpoint, finished_at=finished_at, prompt_tokens=120, cached_tokens=20,
                              completion_tokens=30))
    rollup_usage()
    first = UsageRollup.objects.get(endpoint=endpoint, sequence=0)
    assert stripe_sync.push_pending_rollups() == 1
    stripe_has = {meter.event_name: getattr(first, meter.rollup_field) for meter in stripe_sync.METERS}
    MeterEventPush.objects.filter(rollup=first).delete()
    UsageRollup.objects.filter(pk=first.pk).delete()
    record_usage(usage_report(endpoint, finished_at=first.hour_start + timedelta(minutes=10), prompt_tokens=1000,
                              cached_tokens=0, completion_tokens=500))
    rollup_usage(full=True)
    fake_stripe.forget_idempotency_keys()
    assert stripe_sync.push_pending_rollups() == 0
    again = UsageRollup.objects.get(endpoint=endpoint, sequence=0)
    assert again.push_held_at is not None and stripe_sync._DUPLICATE_HOLD in again.push_error
    return again, stripe_has


def _customer(rollup) -> str:
    """The organisation's Stripe customer, which Stripe's events of `rollup` are on."""
    return BillingAccount.objects.get(organization_id=rollup.organization_id).stripe_customer_id


def _send_difference(rollup, stripe_has: dict[str, int], **kwargs) -> int:
    return stripe_sync.send_held_difference(SYSTEM, rollup.pk, stripe_has, stripe_customer_id=_customer(rollup), **kwargs)


def _billed(fake_stripe, rollup, meter) -> int:
    return sum(int(event["payload"]["value"]) for identifier, event in fake_stripe.meter_events.items()
               if str(rollup.push_uid) in identifier and event["event_name"] == meter.event_name)


def _superuser_client(client):
    sign_in_staff(client, get_user_model().objects.create_superuser("ops@example.test", "ops@example.test",
                                                                    "a long passphrase"))
    return client


def test_a_rollup_held_longer_than_stripes_cancel_window_is_not_sent_as_new(fake_stripe, client):
    # Its events reached Stripe before the hold, so a day after the hold none of them can be cancelled (Stripe
    # cancels a meter event only within 24 h of receiving it). Before, "send as new" sent it whole under new
    # identifiers all the same (the test saw its push generation raised to 1): what Stripe had was billed twice.
    rollup, _ = _held_with_more_than_stripe(fake_stripe)
    UsageRollup.objects.filter(pk=rollup.pk).update(push_held_at=timezone.now() - timedelta(hours=24, minutes=1),
                                                    hour_start=timezone.now() - timedelta(hours=26))
    answer = _superuser_client(client).post(CHANGELIST, {"action": "send_held_as_new", "_selected_action": [rollup.pk]},
                                            follow=True)

    rollup.refresh_from_db()
    assert (rollup.push_generation, rollup.pushed_at) == (0, None) and rollup.push_held_at is not None
    assert stripe_sync.push_pending_rollups() == 0
    shown = [str(message) for message in answer.context["messages"]]
    assert any(f"Rollups [{rollup.pk}] were NOT sent" in message and "send the difference" in message
               for message in shown), shown


def test_a_rollup_held_within_the_window_is_still_sent_as_new(fake_stripe):
    rollup, _ = _held_with_more_than_stripe(fake_stripe)
    UsageRollup.objects.filter(pk=rollup.pk).update(push_held_at=timezone.now() - timedelta(hours=23))
    assert stripe_sync.send_held_as_new(UsageRollup.objects.filter(pk=rollup.pk)) == 1


def _post_difference(client, rollup, values: dict[str, object]):
    return client.post(CHANGELIST, {"action": "send_held_difference", "_selected_action": [rollup.pk], "apply": "1",
                                    "stripe_customer_id": _customer(rollup), **values})


def test_the_difference_is_sent_once_and_the_rollup_is_pushed_and_audited(fake_stripe, client):
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    UsageRollup.objects.filter(pk=rollup.pk).update(push_held_at=timezone.now() - timedelta(days=2))
    client = _superuser_client(client)
    shown = client.post(CHANGELIST, {"action": "send_held_difference", "_selected_action": [rollup.pk]})
    assert shown.status_code == 200 and b"Send the difference" in shown.content  # the intermediate form

    answer = _post_difference(client, rollup, stripe_has)
    assert answer.status_code == 302
    for meter in stripe_sync.METERS:  # Stripe now bills the rollup's whole value, once
        assert _billed(fake_stripe, rollup, meter) == getattr(rollup, meter.rollup_field), meter
    rollup.refresh_from_db()
    assert rollup.pushed_at is not None and rollup.push_held_at is None and rollup.push_error == ""
    assert sum(MeterEventPush.objects.filter(rollup=rollup, event_name=stripe_sync.COST_METER.event_name)
               .values_list("value", flat=True)) == rollup.cost_micro_dollars
    [audited] = AuditEvent.objects.filter(action=stripe_sync.DIFFERENCE_AUDIT_ACTION)
    assert audited.details["rollups"] == [rollup.pk] and audited.details["stripe_has"] == stripe_has
    assert audited.details["stripe_customer_id"] == _customer(rollup)
    assert audited.details["sent"]["inferplane_output_tokens"] == 500

    # Twice-run safe: the form again, the service again (and its Stripe call again, under the same identifiers).
    num_events = len(fake_stripe.meter_events)
    assert _post_difference(client, rollup, stripe_has).status_code == 302
    with pytest.raises(stripe_sync.DifferenceRefused):
        _send_difference(rollup, stripe_has)
    assert len(fake_stripe.meter_events) == num_events
    assert stripe_sync.push_pending_rollups() == 0


def _cut_short_after_one_event(rollup, stripe_has, monkeypatch):
    """Runs "send the difference" with Stripe lost at its second event (the first one sent); returns the real sender
    and the events it was asked to send."""
    original, sent = stripe_sync._send_difference, []

    def send_then_lose_stripe(*args):
        sent.append(args[1].event_name)
        if len(sent) == 2:
            raise stripe_sync.stripe.APIConnectionError("lost")
        return original(*args)

    monkeypatch.setattr(stripe_sync, "_send_difference", send_then_lose_stripe)
    with pytest.raises(stripe_sync.stripe.APIConnectionError):
        _send_difference(rollup, stripe_has)
    return original, sent


def test_a_difference_cut_short_by_stripe_sends_only_the_rest_when_run_again(fake_stripe, monkeypatch):
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    original, sent = _cut_short_after_one_event(rollup, stripe_has, monkeypatch)
    rollup.refresh_from_db()
    assert rollup.pushed_at is None and rollup.push_held_at is not None
    monkeypatch.setattr(stripe_sync, "_send_difference", original)
    assert _send_difference(rollup, stripe_has) == 1
    assert sent[0] == "inferplane_input_tokens"
    for meter in stripe_sync.METERS:  # the difference sent before the failure is not sent again
        assert _billed(fake_stripe, rollup, meter) == getattr(rollup, meter.rollup_field), meter


# NOTE: a negative value is no bad value (an adjustment's events are negative where it lowers a meter), nor is one
# above the ledger's (a negative difference): `test_held_negative_difference.py`.
@pytest.mark.parametrize("bad", [str(2**63), "-1.5", "many", ""])
def test_a_bad_value_is_a_form_error_and_sends_nothing(fake_stripe, client, bad):
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    num_events = len(fake_stripe.meter_events)
    answer = _post_difference(_superuser_client(client), rollup, {**stripe_has, "inferplane_usage_cost": bad})

    assert answer.status_code == 200
    assert answer.context["form"].errors["inferplane_usage_cost"]
    assert len(fake_stripe.meter_events) == num_events
    rollup.refresh_from_db()
    assert rollup.pushed_at is None


def _begun_with_a_typo(fake_stripe) -> tuple[UsageRollup, dict[str, int]]:
    """A rollup held as a duplicate whose "send the difference" was begun with input tokens entered wrong, which
    Stripe refused (400): nothing sent, the claim committed. And Stripe's true values."""
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    typo = {**stripe_has, "inferplane_input_tokens": min(stripe_has["inferplane_input_tokens"] * 10, rollup.input_tokens)}
    fake_stripe.fail_next("400", path="/v1/billing/meter_events", method="POST")  # not retried
    with pytest.raises(stripe_sync.stripe.InvalidRequestError):
        _send_difference(rollup, typo)
    rollup.refresh_from_db()
    assert rollup.difference_started_at is not None
    with pytest.raises(stripe_sync.DifferenceRefused, match="enter the same values"):
        _send_difference(rollup, stripe_has)
    return rollup, stripe_has


def test_a_difference_begun_with_a_wrong_value_that_sent_nothing_is_abandoned_by_staff_then_sent_right(
        fake_stripe, client):
    # Before, nothing cleared the claim but a finish: the right values were refused ("enter the same values"),
    # confirm, release and send-as-new all refused it, and the rollup stayed held until someone edited it in SQL.
    rollup, stripe_has = _begun_with_a_typo(fake_stripe)
    client = _superuser_client(client)
    abandon = {"action": "abandon_held_difference", "_selected_action": [rollup.pk]}
    shown = client.post(CHANGELIST, abandon)
    assert shown.status_code == 200 and b"Abandon the difference" in shown.content
    asked = client.post(CHANGELIST, {**abandon, "apply": "1"})  # its first event may be in Stripe: asked
    assert asked.status_code == 200 and b"look it up in Stripe" in asked.content
    assert client.post(CHANGELIST, {**abandon, "apply": "1", "difference_in_stripe": "yes"}).status_code == 200
    rollup.refresh_from_db()
    assert rollup.difference_started_at is not None  # nothing changed yet

    assert client.post(CHANGELIST, {**abandon, "apply": "1", "difference_in_stripe": "no"}).status_code == 302
    rollup.refresh_from_db()
    assert rollup.difference_started_at is None and rollup.difference_pending is None
    assert rollup.push_held_at is not None  # still held, for any held action
    [audited] = AuditEvent.objects.filter(action=stripe_sync.ABANDON_DIFFERENCE_AUDIT_ACTION)
    assert audited.details["rollups"] == [rollup.pk] and audited.details["difference_in_stripe"] is False
    assert _send_difference(rollup, stripe_has) == 1
    for meter in stripe_sync.METERS:  # the right difference, once
        assert _billed(fake_stripe, rollup, meter) == getattr(rollup, meter.rollup_field), meter


def test_a_difference_that_sent_an_event_cannot_be_abandoned(fake_stripe, monkeypatch):
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    _cut_short_after_one_event(rollup, stripe_has, monkeypatch)
    with pytest.raises(stripe_sync.DifferenceRefused, match="cannot be abandoned"):
        stripe_sync.abandon_held_difference(SYSTEM, rollup.pk, difference_in_stripe=False)
    rollup.refresh_from_db()
    assert rollup.difference_started_at is not None


def test_pushing_a_rollup_again_clears_a_difference_begun_on_its_old_generation(fake_stripe):
    # Before, `services.push_again` kept the claim: held as a duplicate again, the new generation was held to the old
    # one's values and customer, and its difference refused for good.
    from billing import services

    rollup, _ = _begun_with_a_typo(fake_stripe)
    assert services.push_again(UsageRollup.objects.filter(pk=rollup.pk)) == 1
    rollup.refresh_from_db()
    assert rollup.difference_started_at is None and rollup.difference_pending is None


def test_a_difference_begun_before_the_customer_changed_is_abandoned_then_the_rollup_confirmed(fake_stripe):
    # Before, the claim's customer was enforced for good ("settle it in Stripe by hand"), and no action could then
    # mark the rollup settled: it stayed held.
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    fake_stripe.fail_next("400", path="/v1/billing/meter_events", method="POST")
    with pytest.raises(stripe_sync.stripe.InvalidRequestError):
        _send_difference(rollup, stripe_has)
    BillingAccount.objects.filter(organization_id=rollup.organization_id).update(stripe_customer_id="cus_recreated")
    with pytest.raises(stripe_sync.DifferenceRefused):
        stripe_sync.send_held_difference(SYSTEM, rollup.pk, stripe_has, stripe_customer_id="cus_recreated")
    assert stripe_sync.abandon_held_difference(SYSTEM, rollup.pk, difference_in_stripe=False) == 1
    assert stripe_sync.abandon_held_difference(SYSTEM, rollup.pk, difference_in_stripe=False) == 0  # once
    assert stripe_sync.confirm_held(UsageRollup.objects.filter(pk=rollup.pk)) == 1  # settled by hand in Stripe
    rollup.refresh_from_db()
    assert rollup.push_held_at is None and rollup.difference_started_at is None
