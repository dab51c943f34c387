"""The billing month that money, limits and what a tenant is shown are read in is picked by PostgreSQL's clock
(`billing.periods.current_period`), never by a worker's or a web pod's own.

Before: `period_containing()` with no moment took this process's clock: near a month's edge a pod minutes behind read
last month's spend as this month's (its cap alerts, the billing overview, a card's others' spend behind the spending
ceiling's room), and one ahead read a new month with nothing spent in it. The tests set this process's clock back to
five minutes before this month began (by the database's clock), as a pod minutes behind reads the first minutes of a
month."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from django.core import mail
from django.core.management import call_command
from django.utils import timezone

from billing import periods
from billing.alerts import check_all_spend_alerts, check_spend_alerts
from billing.api import billing_overview
from billing.ledger import record_usage
from billing.services import set_spend_cap
from controlplane.accounts.models import Role
from controlplane.accounts.services import SYSTEM
from controlplane.clock import database_now
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory

pytestmark = pytest.mark.django_db

REAL_NOW = timezone.now


def _this_pod_clock_in_last_month(monkeypatch) -> None:
    """This process's clock stepped back to five minutes before this month began (PostgreSQL's clock)."""
    now = database_now()
    offset = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0) - timedelta(minutes=5) - now

    class _Behind(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.now(tz) + offset

    monkeypatch.setattr(timezone, "now", lambda: REAL_NOW() + offset)
    monkeypatch.setattr(periods, "datetime", _Behind)


def _spent_this_month(cap: str, cost_tokens: int):
    organization = OrganizationFactory()
    MembershipFactory(organization=organization, role=Role.OWNER)
    set_spend_cap(SYSTEM, organization, spend_cap=Decimal(cap))
    endpoint = EndpointFactory(organization=organization, price_input_per_million=Decimal("1"),
                               price_output_per_million=Decimal("0"))
    record_usage(usage_report(endpoint, prompt_tokens=cost_tokens, completion_tokens=0))
    return organization


def test_a_worker_whose_clock_is_in_last_month_still_mails_the_cap_alerts_this_months_spend_crossed(monkeypatch):
    organization = _spent_this_month("1.00", 900_000)  # $0.90 of a $1.00 cap, this month
    _this_pod_clock_in_last_month(monkeypatch)

    assert check_spend_alerts(organization.pk) == [50, 80]
    assert "Spend this month: $0.90 of a $1.00 cap." in mail.outbox[-1].body


def test_the_beat_task_on_a_worker_whose_clock_is_in_last_month_mails_this_months_alerts(monkeypatch, settings):
    organization = _spent_this_month("1.00", 600_000)
    _this_pod_clock_in_last_month(monkeypatch)

    assert check_all_spend_alerts() == 1
    assert mail.outbox[-1].subject == f"{organization.name} used 50% of its monthly spend cap"


def test_a_web_pod_whose_clock_is_in_last_month_shows_this_months_spend_in_the_billing_overview(monkeypatch):
    organization = _spent_this_month("10.00", 900_000)
    _this_pod_clock_in_last_month(monkeypatch)

    current = billing_overview(organization)["current_period"]
    assert current["spend"] == "0.90"
    assert current["start"] == database_now().replace(day=1, hour=0, minute=0, second=0, microsecond=0).isoformat()


def test_spend_over_ceiling_on_a_pod_whose_clock_is_in_last_month_names_this_month(monkeypatch, capsys):
    _this_pod_clock_in_last_month(monkeypatch)
    call_command("spend_over_ceiling")

    assert f"in {database_now():%Y%m}." in capsys.readouterr().out
