"""A credit grant's start (`CreditGrant.granted_at`) is stamped by PostgreSQL's clock, and the credit figure the
gateway reserves against (`rebuild.credit_available`) judges it by the same clock.

Before: the web pod that made the grant (staff, a payment's webhook) stamped it by its own clock, and the process that
rebuilt the figure judged it by its own: a grant made through a web pod 10 minutes ahead was "not yet granted" for 10
minutes (a prepaid organisation that had just topped up was refused, 402, with the credit there); a rebuild on a
process 10 minutes behind did the same."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing.credits import grant_credits
from billing.quota.rebuild import credit_available
from controlplane.accounts.services import SYSTEM
from tests.factories import OrganizationFactory

pytestmark = pytest.mark.django_db

REAL_NOW = timezone.now


def _this_process_clock(monkeypatch, offset: timedelta) -> None:
    monkeypatch.setattr(timezone, "now", lambda: REAL_NOW() + offset)


def test_credit_granted_through_a_web_pod_whose_clock_is_ahead_is_available_at_once(monkeypatch):
    organization = OrganizationFactory()
    with monkeypatch.context() as web_pod:
        _this_process_clock(web_pod, timedelta(minutes=10))
        grant_credits(SYSTEM, organization, amount=Decimal("5.00"))

    assert credit_available(organization.pk)[0] == Decimal("5.00")


def test_credit_granted_is_available_at_once_to_a_process_whose_clock_is_behind(monkeypatch):
    organization = OrganizationFactory()
    grant_credits(SYSTEM, organization, amount=Decimal("5.00"))

    _this_process_clock(monkeypatch, timedelta(minutes=-10))

    assert credit_available(organization.pk)[0] == Decimal("5.00")


def test_a_web_pod_whose_clock_is_behind_shows_credit_granted_a_moment_ago_as_remaining(owner_client, monkeypatch):
    # Before: `/api/v1/billing/` judged each grant (remaining, expired) by the web pod's clock: one 10 minutes behind
    # showed a top-up made a moment ago as 0.00 remaining (not yet granted) for 10 minutes, though the gateway spends it.
    grant_credits(SYSTEM, owner_client.organization, amount=Decimal("5.00"), note="top-up")
    _this_process_clock(monkeypatch, timedelta(minutes=-10))

    body = owner_client.get("/api/v1/billing/").json()

    assert [(grant["remaining"], grant["expired"]) for grant in body["credits"]] == [("5.00", False)]
