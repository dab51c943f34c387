"""The usage page (chart, table, date range, CSV link) and the billing page (spend, cap, credits, invoices)."""

import csv
import io
from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from billing.models import BillingAccount, CreditGrant, Invoice
from controlplane.accounts.models import Role
from tests.console.test_endpoint_pages import usage_row
from tests.factories import EndpointFactory, OrganizationFactory

pytestmark = pytest.mark.django_db


def test_usage_page_groups_tokens_by_endpoint_with_a_daily_chart(owner):
    alpha = EndpointFactory(organization=owner.organization, name="alpha")
    beta = EndpointFactory(organization=owner.organization, name="beta")
    now = timezone.now()
    usage_row(alpha, started_at=now - timedelta(minutes=5), prompt=100, completion=50)
    usage_row(alpha, started_at=now - timedelta(days=2), prompt=10, completion=5)
    usage_row(beta, started_at=now - timedelta(minutes=5), prompt=1, completion=2)
    response = owner.get(reverse("console:usage"))
    page = response.content.decode()
    assert [row["endpoint"] for row in response.context["rows"]] == ["alpha", "beta"]
    assert response.context["totals"]["completion_tokens"] == 57
    chart = response.context["chart"]
    assert sum(chart["series"]["alpha"]) == 165 and chart["series"]["beta"][-1] == 3
    assert "/api/v1/usage/export.csv?group_by=endpoint&amp;start=" in page
    assert '<label for="usage-start">' in page


def test_usage_date_range_and_grouping(owner):
    endpoint = EndpointFactory(organization=owner.organization)
    usage_row(endpoint, started_at=timezone.now() - timedelta(days=40), prompt=7, completion=7)
    assert owner.get(reverse("console:usage")).context["totals"]["requests"] == 0
    start = (timezone.now() - timedelta(days=45)).date().isoformat()
    response = owner.get(reverse("console:usage"), {"start": start, "group_by": "day"})
    assert response.context["totals"]["requests"] == 1 and response.context["group_by"] == "day"


def test_the_usage_pages_json_link_opened_in_the_browser_shows_the_numbers_not_a_500(owner, settings):
    """The page links its numbers as JSON (`/api/v1/usage/?…`); a browser asks for HTML, which the API's browsable
    renderer answers. It took the usage view for a list to filter, and asked it for a queryset it has not: a 500."""
    settings.DEBUG = False
    owner.raise_request_exception = False
    usage_row(EndpointFactory(organization=owner.organization, name="alpha"), started_at=timezone.now(),
              prompt=100, completion=50)
    api_url = owner.get(reverse("console:usage")).context["api_url"]

    followed = owner.get(api_url, HTTP_ACCEPT="text/html,application/xhtml+xml")

    assert followed.status_code == 200 and followed["Content-Type"].startswith("text/html")
    assert "alpha" in followed.content.decode()


@pytest.mark.parametrize("group_by", ["key", "day", "adapter"])
def test_the_csv_export_is_grouped_as_the_page_is(owner, group_by):
    """"Export CSV" on the page grouped by API key (day, adapter) exports by API key: its link named no grouping, so
    every export was by endpoint whatever the page showed."""
    usage_row(EndpointFactory(organization=owner.organization, name="alpha"), started_at=timezone.now())
    csv_url = owner.get(reverse("console:usage"), {"group_by": group_by}).context["csv_url"]

    exported = owner.get(csv_url)

    assert exported.status_code == 200
    assert next(csv.reader(io.StringIO(exported.content.decode())))[0] == group_by


def test_usage_page_reports_a_bad_date(owner):
    page = owner.get(reverse("console:usage"), {"start": "yesterday"}).content.decode()
    assert "The start date is not a date" in page


def test_usage_never_shows_another_organisations_tokens(owner):
    usage_row(EndpointFactory(organization=OrganizationFactory(), name="theirs"), started_at=timezone.now())
    response = owner.get(reverse("console:usage"))
    assert response.context["rows"] == [] and "theirs" not in response.content.decode()


def test_billing_page_shows_spend_against_the_cap_credits_and_invoices(owner):
    endpoint = EndpointFactory(organization=owner.organization)
    usage_row(endpoint, started_at=timezone.now() - timedelta(minutes=1), cost="4.00")
    BillingAccount.objects.create(organization=owner.organization, spend_cap=Decimal("10"))
    CreditGrant.objects.create(organization=owner.organization, amount=Decimal("25"), note="welcome credit")
    Invoice.objects.create(organization=owner.organization, stripe_invoice_id="in_1", number="INV-0001", status="paid",
                           amount_due=1234, amount_paid=1234, hosted_invoice_url="https://invoices.example/in_1")
    page = owner.get(reverse("console:billing")).content.decode()
    assert "$4.00" in page and "of $10.00 cap" in page and 'aria-valuenow="40"' in page
    assert "welcome credit" in page and "$25.00" in page
    assert "INV-0001" in page and "12.34" in page and "https://invoices.example/in_1" in page


def test_admin_sets_and_removes_the_cap(owner):
    response = owner.post(reverse("console:billing-cap"), {"spend_cap": "12.50"})
    assert response.status_code == 302
    assert BillingAccount.objects.get(organization=owner.organization).spend_cap == Decimal("12.50")
    owner.post(reverse("console:billing-cap"), {"spend_cap": ""})
    assert BillingAccount.objects.get(organization=owner.organization).spend_cap is None


def test_a_bad_cap_is_an_inline_error(owner):
    response = owner.post(reverse("console:billing-cap"), {"spend_cap": "-3"})
    assert response.status_code == 400
    assert "greater than or equal to 0" in response.content.decode()


@pytest.mark.parametrize("role", [Role.VIEWER, Role.MEMBER])
def test_only_admins_change_billing(console_client_factory, org, role):
    client = console_client_factory(org, role)
    assert client.post(reverse("console:billing-cap"), {"spend_cap": "1"}).status_code == 403
    assert client.post(reverse("console:billing-payment-method")).status_code == 403
    assert not BillingAccount.objects.filter(organization=org, spend_cap__isnull=False).exists()
    assert "Only owners and admins can change the cap" in client.get(reverse("console:billing")).content.decode()


def test_payment_method_without_stripe_explains_itself(owner, settings):
    settings.STRIPE_SECRET_KEY = ""
    response = owner.post(reverse("console:billing-payment-method"), follow=True)
    assert "not set up on this installation" in response.content.decode()


def test_a_cap_of_zero_is_shown_as_a_cap_that_stops_every_call(owner):
    """A cap of $0.00 (which the form and the API take) refuses every call; the page said "No spend cap"."""
    owner.post(reverse("console:billing-cap"), {"spend_cap": "0"})
    assert BillingAccount.objects.get(organization=owner.organization).spend_cap == Decimal("0")

    page = owner.get(reverse("console:billing")).content.decode()

    assert "No spend cap" not in page
    assert "of $0.00 cap" in page and 'aria-valuenow="100"' in page and "100% of the cap" in page


def test_a_web_pod_whose_clock_is_behind_counts_credit_granted_a_moment_ago_in_the_billing_pages_remaining(
        owner, monkeypatch):
    # Before: the console's billing page summed the grants active by the web pod's clock (`timezone.now()`): one
    # 10 minutes behind left a top-up made a moment ago out of "Credits remaining" for 10 minutes, though the gateway
    # spends it and /api/v1/billing/ counts it (PostgreSQL's clock).
    from billing.credits import grant_credits
    from controlplane.accounts.services import SYSTEM
    grant_credits(SYSTEM, owner.organization, amount=Decimal("5.00"), note="top-up")
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() - timedelta(minutes=10))

    response = owner.get(reverse("console:billing"))

    assert response.context["credit_remaining"] == Decimal("5.00")
