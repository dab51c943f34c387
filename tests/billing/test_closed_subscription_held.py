"""A rollup held for an operator holds a closed organisation's subscription (its final invoice must bill it), and says
so: an ERROR line naming the organisation and an audit event, once per hold (`closed_subscriptions._tell_held`); the
subscription is never cancelled early for it.

Before: the held rollup's own ERROR line and gauge said nothing of the close, and each run of the cancellations passed
the organisation by without a word: its subscription stayed live, with its empty invoices and dunning mails, for as
long as nobody happened to look at the held rollups."""

from __future__ import annotations

import logging

import pytest

from billing import closed_subscriptions
from billing.models import UsageRollup
from controlplane.accounts.models import AuditEvent
from controlplane.clock import database_now
from endpoints import closing
from tests.billing.test_closed_subscription import _closed_with_usage_pushed, _meter_events_aggregated

pytestmark = pytest.mark.django_db


def _told(caplog, organization) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.levelno == logging.ERROR and organization.slug in record.getMessage()]


def test_a_held_rollup_holding_a_closed_organisations_subscription_is_told_once_per_hold(fake_stripe, caplog):
    organization, _, subscription = _closed_with_usage_pushed(fake_stripe)
    _meter_events_aggregated(organization)
    held = UsageRollup.objects.filter(organization=organization).first()
    UsageRollup.objects.filter(pk=held.pk).update(pushed_at=None, push_held_at=database_now(), push_error="held")

    with caplog.at_level(logging.ERROR, logger="billing.closed_subscriptions"):
        assert closing.end_closed_subscriptions() == 0
        assert closing.end_closed_subscriptions() == 0

    assert closed_subscriptions.unsettled_reason(organization.pk) == closed_subscriptions.HELD_FOR_AN_OPERATOR
    [told] = _told(caplog, organization)
    assert subscription in told and str(held.pk) in told
    [event] = AuditEvent.objects.filter(organization=organization, action=closed_subscriptions.HELD_AUDIT_ACTION)
    assert event.details == {"subscription": subscription, "rollups": [held.pk]}
    assert fake_stripe.subscriptions[subscription]["status"] == "active"  # never cancelled early

    # released, failed again and held anew: told again, once
    UsageRollup.objects.filter(pk=held.pk).update(push_held_at=database_now())
    with caplog.at_level(logging.ERROR, logger="billing.closed_subscriptions"):
        assert closing.end_closed_subscriptions() == 0
        assert closing.end_closed_subscriptions() == 0
    assert len(_told(caplog, organization)) == 2

    # decided by the operator (confirmed in Stripe): the cancellation follows
    UsageRollup.objects.filter(pk=held.pk).update(push_held_at=None, pushed_at=database_now())
    _meter_events_aggregated(organization)
    assert closing.end_closed_subscriptions() == 1
    assert fake_stripe.subscriptions[subscription]["status"] == "canceled"
