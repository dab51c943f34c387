"""What the usage and billing pages call "today" and "this month" is PostgreSQL's clock (`database_now`), which usage
is stamped by, read once for one answer.

Before: the usage summary's default period (`DatePeriodSerializer`, `GET /api/v1/usage/`) and the console usage page's
default range ended on the web pod's own "today": a pod behind into last month answered last month's usage for this
month's, and one a day behind left today's out. The billing page read the database's clock twice, once for the month
(`current_period`) and once for the credit left: loaded across a month's edge, it showed last month's period and spend
beside the credit as of the new month. The tests set this pod's clock back to five minutes before this month began
(`test_period_clock`)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.test import Client

from billing import api, periods, serializers, views
from billing.credits import grant_credits
from billing.ledger import record_usage
from controlplane.accounts.models import Role
from controlplane.accounts.services import SYSTEM
from controlplane.accounts.tenancy import SESSION_KEY
from controlplane.clock import database_now
from tests.billing.conftest import usage_report
from tests.billing.test_period_clock import _this_pod_clock_in_last_month
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory, UserFactory

pytestmark = pytest.mark.django_db


def _console(organization) -> Client:
    user = UserFactory()
    MembershipFactory(organization=organization, user=user, role=Role.OWNER)
    console = Client()
    console.force_login(user)
    session = console.session
    session[SESSION_KEY] = organization.pk
    session.save()
    return console


def test_the_usage_summarys_default_period_is_this_month_by_the_databases_clock(owner_client, monkeypatch):
    endpoint = EndpointFactory(organization=owner_client.organization, name="chat")
    record_usage(usage_report(endpoint, finished_at=database_now()))
    _this_pod_clock_in_last_month(monkeypatch)

    response = owner_client.get("/api/v1/usage/")

    assert response.status_code == 200
    assert [row["endpoint"] for row in response.json()["results"]] == ["chat"]


def test_the_usage_pages_default_range_ends_today_by_the_databases_clock(monkeypatch):
    organization = OrganizationFactory()
    console = _console(organization)
    _this_pod_clock_in_last_month(monkeypatch)

    page = console.get("/console/usage/")

    assert page.status_code == 200
    assert page.context["end"] == database_now().date()


def _counting_into(reads: list):
    """A wrapper of a clock read that notes each read in `reads`."""
    def counted(real):
        def read():
            reads.append(1)
            return real()
        return read
    return counted


def test_the_billing_page_reads_the_databases_clock_once(monkeypatch):
    organization = OrganizationFactory()
    console = _console(organization)
    reads = []
    counted = _counting_into(reads)
    monkeypatch.setattr(views, "database_now", counted(views.database_now))
    monkeypatch.setattr(periods, "database_now", counted(periods.database_now))

    page = console.get("/console/billing/")

    assert page.status_code == 200
    assert len(reads) == 1
    assert page.context["period"] == periods.period_containing(database_now())


def test_the_billing_apis_overview_reads_the_databases_clock_once(owner_client, monkeypatch):
    # NOTE: the API's twin of the page (`billing.api.billing_overview`): it read the clock once for the month
    # (`current_period`) and again for the credit left (`CreditGrantSerializer`), so an answer across a month's edge
    # paired last month's period and spend with the credit as of the new month.
    grant_credits(SYSTEM, owner_client.organization, amount=Decimal("5.00"))
    reads = []
    counted = _counting_into(reads)
    monkeypatch.setattr(periods, "database_now", counted(periods.database_now))
    monkeypatch.setattr(serializers, "database_now", counted(serializers.database_now))
    monkeypatch.setattr(api, "database_now", counted(database_now), raising=False)

    response = owner_client.get("/api/v1/billing/")

    assert response.status_code == 200
    assert len(reads) == 1
    assert response.json()["credits"][0]["remaining"] == "5.00"
