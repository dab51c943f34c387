"""`GET/PATCH /api/v1/billing/`: the period's spend, cap, credits and invoices; caps set by owners and admins."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.core import mail
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from billing import alerts, standing
from billing.alerts import check_spend_alerts
from billing.credits import grant_credits
from billing.ledger import record_usage
from billing.models import ApiKeySpendCap, BillingAccount, Invoice, InvoiceLine, SpendAlert
from billing.services import set_spend_cap
from controlplane.accounts.models import ApiKey, AuditEvent, Role
from controlplane.accounts.services import SYSTEM, Actor
from endpoints import closing
from tests.billing.conftest import usage_report
from tests.factories import (
    EndpointFactory,
    MembershipFactory,
    OrganizationFactory,
    UserFactory,
    signed_in_api_client,
)

pytestmark = pytest.mark.django_db


def test_billing_shows_the_period_spend_as_tokens_times_prices(owner_client):
    endpoint = EndpointFactory(organization=owner_client.organization, price_input_per_million=Decimal("0.40"),
                               price_cached_input_per_million=Decimal("0.20"), price_output_per_million=Decimal("1.20"))
    record_usage(usage_report(endpoint, prompt_tokens=1_000_000, cached_tokens=250_000, completion_tokens=500_000))
    record_usage(usage_report(endpoint, finished_at=timezone.now() - timedelta(days=40)))  # last period

    body = owner_client.get("/api/v1/billing/").json()

    assert set(body) >= {"current_period", "spend_cap", "credits", "invoices"}
    # 750k × 0.40 + 250k × 0.20 + 500k × 1.20 per million
    assert body["current_period"]["spend"] == "0.95"
    start = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    assert body["current_period"]["start"] == start.isoformat()
    assert body["spend_cap"] is None


def test_billing_lists_credits_and_invoices_of_the_caller_only(owner_client):
    organization = owner_client.organization
    grant_credits(SYSTEM, organization, amount=Decimal("20"), expires_at=timezone.now() + timedelta(days=30), note="welcome")
    grant_credits(SYSTEM, OrganizationFactory(), amount=Decimal("99"))
    invoice = Invoice.objects.create(organization=organization, stripe_invoice_id="in_x", status="paid", amount_due=950)
    InvoiceLine.objects.create(invoice=invoice, stripe_line_id="il_1", description="Output tokens", quantity=500000, amount=950)

    body = owner_client.get("/api/v1/billing/").json()

    assert [(c["amount"], c["remaining"], c["note"], c["expired"]) for c in body["credits"]] == [("20.00", "20.00", "welcome", False)]
    assert [(i["status"], i["amount_due"], len(i["lines"])) for i in body["invoices"]] == [("paid", 950, 1)]


@pytest.mark.parametrize("role", [Role.OWNER, Role.ADMIN])
def test_owners_and_admins_set_the_spend_cap(owner_client, member_client_factory, role):
    client = member_client_factory(owner_client.organization, role)

    response = client.patch("/api/v1/billing/", {"spend_cap": "12.50"}, format="json")

    assert response.status_code == 200 and response.json()["spend_cap"] == "12.50"
    assert BillingAccount.objects.for_organization(owner_client.organization.pk).spend_cap == Decimal("12.50")
    assert AuditEvent.objects.filter(action="billing.set_spend_cap").exists()
    assert client.patch("/api/v1/billing/", {"spend_cap": None}, format="json").json()["spend_cap"] is None


@pytest.mark.parametrize("role", [Role.MEMBER, Role.VIEWER])
def test_members_and_viewers_may_read_billing_but_not_set_the_cap(owner_client, member_client_factory, role):
    client = member_client_factory(owner_client.organization, role)

    assert client.get("/api/v1/billing/").status_code == 200
    assert client.patch("/api/v1/billing/", {"spend_cap": "1.00"}, format="json").status_code == 403
    assert BillingAccount.objects.for_organization(owner_client.organization.pk).spend_cap is None


def test_a_key_with_a_cap_lowers_the_organisations_cap_but_never_raises_or_removes_it(owner_client):
    """Before, a key capped at $5.00 (refused when it raised its own cap) removed the organisation's $100.00 (200)."""
    own_key = ApiKey.objects.get(created_by=owner_client.user)
    assert owner_client.patch("/api/v1/billing/", {"spend_cap": "100.00"}, format="json").status_code == 200
    assert owner_client.patch(f"/api/v1/billing/keys/{own_key.pk}/", {"spend_cap": "5.00"},
                              format="json").status_code == 200
    for cap in (None, "100.01"):
        refused = owner_client.patch("/api/v1/billing/", {"spend_cap": cap}, format="json")
        assert refused.status_code == 403 and "capped at 5.00" in refused.json()["detail"]
    assert BillingAccount.objects.for_organization(owner_client.organization.pk).spend_cap == Decimal("100.00")
    assert owner_client.patch("/api/v1/billing/", {"spend_cap": "80.00"}, format="json").status_code == 200
    assert BillingAccount.objects.for_organization(owner_client.organization.pk).spend_cap == Decimal("80.00")
    # Signed in, the owner may lift it.
    assert _signed_in(owner_client).patch("/api/v1/billing/", {"spend_cap": None}, format="json").status_code == 200
    assert BillingAccount.objects.for_organization(owner_client.organization.pk).spend_cap is None


def _signed_in(client) -> APIClient:
    session = APIClient()
    session.force_login(client.user)
    return session


@pytest.mark.parametrize("body, field", [
    ({"spend_cap": "-1"}, "spend_cap"),
    ({"spend_cap": "abc"}, "spend_cap"),
    ({"spend_cap": "1.005"}, "spend_cap"),
    ({"spend_cap": "10000000"}, "spend_cap"),
    ({}, "spend_cap"),
    ({"spend_cap": "5", "credits": []}, "credits"),
])
def test_a_bad_cap_is_a_400_with_field_errors(owner_client, body, field):
    response = owner_client.patch("/api/v1/billing/", body, format="json")

    assert response.status_code == 400
    assert field in response.json()
    assert BillingAccount.objects.for_organization(owner_client.organization.pk).spend_cap is None


def test_an_admin_caps_one_key_and_another_organisations_key_is_a_404(owner_client, member_client_factory):
    key = ApiKey.objects.get(created_by=owner_client.user)
    stranger_key = ApiKey.objects.get(created_by=member_client_factory(OrganizationFactory(), Role.OWNER).user)

    response = owner_client.patch(f"/api/v1/billing/keys/{key.pk}/", {"spend_cap": "5.00"}, format="json")
    assert response.status_code == 200 and response.json()["spend_cap"] == "5.00"
    assert ApiKeySpendCap.objects.get(api_key=key).spend_cap == Decimal("5")
    assert owner_client.patch(f"/api/v1/billing/keys/{stranger_key.pk}/", {"spend_cap": "5"}, format="json").status_code == 404


def test_spend_alerts_go_out_at_50_80_and_100_percent_once_each_per_period(owner_client, member_client_factory):
    organization = owner_client.organization
    member_client_factory(organization, Role.MEMBER)
    set_spend_cap(SYSTEM, organization, spend_cap=Decimal("1.00"))
    endpoint = EndpointFactory(organization=organization, price_input_per_million=Decimal("1"), price_output_per_million=Decimal("0"))

    record_usage(usage_report(endpoint, prompt_tokens=600_000, completion_tokens=0))
    assert check_spend_alerts(organization.pk) == [50]
    assert check_spend_alerts(organization.pk) == []
    record_usage(usage_report(endpoint, prompt_tokens=500_000, completion_tokens=0))
    assert check_spend_alerts(organization.pk) == [80, 100]

    assert [m.subject.removeprefix(organization.name + " ") for m in mail.outbox] == [
        "used 50% of its monthly spend cap", "used 80% of its monthly spend cap", "reached its monthly spend cap",
    ]
    assert all(m.to == [owner_client.user.email] for m in mail.outbox)  # owners and admins, not members


def test_an_organisation_whose_name_holds_a_line_break_still_gets_its_spend_alerts(owner_client):
    """A name from before sign-up refused control characters may hold one; no mail header may (Django refuses the
    message), and every run failed at that alert: the owners never heard of their spend."""
    organization = owner_client.organization
    type(organization).objects.filter(pk=organization.pk).update(name="Acme\nCorp")
    set_spend_cap(SYSTEM, organization, spend_cap=Decimal("1.00"))
    endpoint = EndpointFactory(organization=organization, price_input_per_million=Decimal("1"), price_output_per_million=Decimal("0"))

    record_usage(usage_report(endpoint, prompt_tokens=600_000, completion_tokens=0))
    assert check_spend_alerts(organization.pk) == [50]
    assert [m.subject for m in mail.outbox] == ["Acme Corp used 50% of its monthly spend cap"]


@pytest.mark.parametrize("reason, subject", [
    (standing.PAST_DUE, "Acme Corp: inference is stopped until an unpaid invoice is paid"),
    (standing.DISPUTED, "Acme Corp: inference is stopped because a payment is disputed"),
])
def test_an_organisation_whose_name_holds_a_line_break_is_still_told_its_calls_are_stopped(owner_client, reason, subject):
    organization = owner_client.organization
    type(organization).objects.filter(pk=organization.pk).update(name="Acme\r\nCorp")
    BillingAccount.objects.for_organization(organization)
    BillingAccount.objects.filter(organization=organization).update(past_due_since=timezone.now(), hold_reason=reason)

    alerts.send_hold(BillingAccount.objects.select_related("organization").get(organization=organization))
    assert [m.subject for m in mail.outbox] == [subject]


def test_an_admin_changing_the_cap_again_and_again_past_its_spend_gets_each_alert_once(owner_client):
    """Alerts were claimed per distinct cap: each new value at or below the spend mailed every owner and admin 50, 80
    and 100 % again (the test saw 12 mails for four caps). A threshold alerts again in a period only once the spend
    has passed it at a cap since it last alerted: a cap raised, then reached, still warns."""
    organization = owner_client.organization
    endpoint = EndpointFactory(organization=organization, price_input_per_million=Decimal("1"), price_output_per_million=Decimal("0"))
    record_usage(usage_report(endpoint, prompt_tokens=2_000_000, completion_tokens=0))  # $2.00
    for cap in ("1.00", "1.50", "1.90", "1.20"):
        assert owner_client.patch("/api/v1/billing/", {"spend_cap": cap}, format="json").status_code == 200
        check_spend_alerts(organization.pk)
    assert [m.subject.removeprefix(organization.name + " ") for m in mail.outbox] == [
        "used 50% of its monthly spend cap", "used 80% of its monthly spend cap", "reached its monthly spend cap",
    ]

    set_spend_cap(SYSTEM, organization, spend_cap=Decimal("3.00"))  # raised past the spend: 80 % is $2.40
    assert check_spend_alerts(organization.pk) == []
    record_usage(usage_report(endpoint, prompt_tokens=500_000, completion_tokens=0))  # $2.50
    assert check_spend_alerts(organization.pk) == [80]
    record_usage(usage_report(endpoint, prompt_tokens=500_000, completion_tokens=0))  # $3.00
    assert check_spend_alerts(organization.pk) == [100]
    assert "Spend this month: $3.00 of a $3.00 cap" in mail.outbox[-1].body


class _WorkerKilled(BaseException):
    """The worker dies here (SIGKILL, OOM, the task's hard time limit): no except clause runs."""


def test_a_spend_alert_whose_worker_died_before_sending_it_is_sent_by_a_later_run(owner_client, monkeypatch):
    organization = owner_client.organization
    set_spend_cap(SYSTEM, organization, spend_cap=Decimal("1.00"))
    endpoint = EndpointFactory(organization=organization, price_input_per_million=Decimal("1"), price_output_per_million=Decimal("0"))
    record_usage(usage_report(endpoint, prompt_tokens=600_000, completion_tokens=0))
    send = alerts._send

    def killed(*args, **kwargs):
        raise _WorkerKilled()

    monkeypatch.setattr(alerts, "_send", killed)
    with pytest.raises(_WorkerKilled):
        check_spend_alerts(organization.pk)
    monkeypatch.setattr(alerts, "_send", send)
    assert check_spend_alerts(organization.pk) == []  # the claim may still be sending: not twice at once

    SpendAlert.objects.filter(organization=organization).update(created_at=timezone.now() - timedelta(hours=1))
    assert check_spend_alerts(organization.pk) == [50]
    assert check_spend_alerts(organization.pk) == []
    assert [m.subject.removeprefix(organization.name + " ") for m in mail.outbox] == ["used 50% of its monthly spend cap"]
    assert SpendAlert.objects.get(organization=organization).sent_at is not None


def test_a_run_on_a_worker_whose_clock_is_minutes_ahead_never_takes_a_spend_alert_another_run_is_sending(
        owner_client, monkeypatch):
    # Before: the claim's age was judged by each worker's own clock: a run on a worker 10 minutes ahead took a claim
    # made a moment before (by PostgreSQL's clock) as left by a dead worker, and the alert went twice.
    organization = owner_client.organization
    set_spend_cap(SYSTEM, organization, spend_cap=Decimal("1.00"))
    endpoint = EndpointFactory(organization=organization, price_input_per_million=Decimal("1"), price_output_per_million=Decimal("0"))
    record_usage(usage_report(endpoint, prompt_tokens=600_000, completion_tokens=0))
    send = alerts._send

    def still_sending(*args, **kwargs):
        raise _WorkerKilled()  # the first run is still in its mail server's call (here: never returns)

    monkeypatch.setattr(alerts, "_send", still_sending)
    with pytest.raises(_WorkerKilled):
        check_spend_alerts(organization.pk)
    monkeypatch.setattr(alerts, "_send", send)
    ahead = timedelta(minutes=10)  # this run's worker
    monkeypatch.setattr(alerts, "timezone", type("Clock", (), {"now": staticmethod(lambda: timezone.now() + ahead)}))
    assert check_spend_alerts(organization.pk) == []
    assert mail.outbox == []

    # Left unsent for longer than the claim's bound by PostgreSQL's clock, it is sent by a later run, once.
    SpendAlert.objects.filter(organization=organization).update(created_at=timezone.now() - timedelta(hours=1))
    assert check_spend_alerts(organization.pk) == [50]
    assert check_spend_alerts(organization.pk) == []
    assert len(mail.outbox) == 1


def test_the_portal_link_creates_the_customer_once(owner_client, fake_stripe):
    first = owner_client.post("/api/v1/billing/portal/")
    second = owner_client.post("/api/v1/billing/portal/")

    assert first.status_code == 200 and first.json()["url"].startswith("https://billing.stripe.test/")
    assert second.status_code == 200
    assert len(fake_stripe.calls_to("/v1/customers")) == 1


def test_a_closed_organisations_owner_still_gets_the_portal_to_pay_its_last_invoice(fake_stripe):
    organization, owner = OrganizationFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    closing.close_organization(Actor(user=owner), organization, confirm_name=organization.name)
    client = signed_in_api_client(owner)

    answer = client.post("/api/v1/billing/portal/")

    assert answer.status_code == 200 and answer.json()["url"].startswith("https://billing.stripe.test/")
    console = Client()
    console.force_login(owner)
    sent = console.post("/console/billing/payment-method/")
    assert sent.status_code == 302 and sent["Location"].startswith("https://billing.stripe.test/")
    assert client.patch("/api/v1/billing/", {"spend_cap": "5.00"}, format="json").status_code == 403  # the rest: no
