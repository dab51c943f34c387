"""One billing path per organisation: prepaid usage draws credit and never reaches Stripe, postpaid
usage is metered, a switch of mode splits usage exactly, and staff edits in the Django admin go
through the same audited services as the API."""

import asyncio
from datetime import timedelta
from decimal import Decimal

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.utils import timezone

from billing import stripe_sync
from billing.credits import draw_credits, grant_credits
from billing.ledger import record_usage
from billing.models import BillingAccount, BillingMode, CreditGrant, Invoice, UsageRecord, UsageRollup
from billing.quota.counters import QuotaExceeded
from billing.quota.rebuild import credit_available
from billing.rollups import rollup_usage
from billing.services import set_billing_mode
from controlplane.accounts.models import AuditEvent
from controlplane.accounts.services import SYSTEM
from endpoints.gateway import admission
from endpoints.gateway.auth import Caller
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory

# NOTE: admission rebuilds the quota's counters in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)


def _hours_ago(hours: int):
    return timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=hours)


def _customer_usage_cost(fake_stripe, organization) -> int:
    customer_id = BillingAccount.objects.get(organization=organization).stripe_customer_id
    return fake_stripe.meter_totals().get((customer_id, "inferplane_usage_cost"), 0)


# NOTE: a grant pays only for usage begun once it was made (`billing.models.credit_shares`): those below are dated
# before the usage they pay for, made hours ago.
def test_a_prepaid_organisations_usage_draws_credit_and_is_never_pushed_to_stripe(fake_stripe):
    prepaid, postpaid = EndpointFactory(), EndpointFactory()
    set_billing_mode(SYSTEM, prepaid.organization, mode=BillingMode.PREPAID)
    grant_credits(SYSTEM, prepaid.organization, amount=Decimal("10"), granted_at=_hours_ago(4))
    for endpoint in (prepaid, postpaid):
        record_usage(usage_report(endpoint, finished_at=_hours_ago(3)))
    rollup_usage()

    assert stripe_sync.push_pending_rollups() == 1

    assert not BillingAccount.objects.get(organization=prepaid.organization).stripe_subscription_id
    assert all(event["payload"]["stripe_customer_id"] == BillingAccount.objects.for_organization(postpaid.organization_id).stripe_customer_id
               for event in fake_stripe.meter_events.values())
    assert _customer_usage_cost(fake_stripe, postpaid.organization) > 0
    spent = UsageRecord.objects.get(organization=prepaid.organization).cost
    assert draw_credits(prepaid.organization_id) == spent
    assert CreditGrant.objects.get(organization=prepaid.organization).consumed == spent


def test_switching_mode_mid_period_bills_usage_before_the_switch_one_way_and_after_it_the_other(fake_stripe):
    endpoint = EndpointFactory()
    organization = endpoint.organization
    grant_credits(SYSTEM, organization, amount=Decimal("10"), granted_at=_hours_ago(4))
    hour = _hours_ago(3)
    invoiced = [usage_report(endpoint, finished_at=hour + timedelta(minutes=5), prompt_tokens=1000) for _ in range(2)]
    for report in invoiced:
        record_usage(report)
    set_billing_mode(SYSTEM, organization, mode=BillingMode.PREPAID)
    prepaid = [usage_report(endpoint, finished_at=hour + timedelta(minutes=10), prompt_tokens=3000) for _ in range(3)]
    for report in prepaid:
        record_usage(report)
    set_billing_mode(SYSTEM, organization, mode=BillingMode.POSTPAID)
    record_usage(invoiced_later := usage_report(endpoint, finished_at=hour + timedelta(minutes=20), prompt_tokens=5000))
    rollup_usage()

    def cost_of(reports):
        return sum(UsageRecord.objects.get(request_id=r.request_id).cost for r in reports)

    postpaid_cost = cost_of(invoiced) + cost_of([invoiced_later])
    prepaid_cost = cost_of(prepaid)
    # The same hour has one rollup per mode, and only the postpaid one goes to Stripe.
    assert {(r.billing_mode, r.cost) for r in UsageRollup.objects.filter(organization=organization)} == {
        (BillingMode.POSTPAID, postpaid_cost), (BillingMode.PREPAID, prepaid_cost)}
    stripe_sync.push_pending_rollups()
    micro = Decimal(1_000_000)
    assert _customer_usage_cost(fake_stripe, organization) == int((postpaid_cost * micro).to_integral_value())
    assert draw_credits(organization.pk) == prepaid_cost
    assert CreditGrant.objects.get(organization=organization).remaining == Decimal("10") - prepaid_cost


def test_a_call_admitted_postpaid_and_ended_after_a_switch_to_prepaid_is_invoiced_and_draws_no_credit(fake_stripe):
    """Before, its row took the mode of its end: prepaid, so never metered, and the credit draw wrote off what no grant
    paid (none was bought yet): a long stream was billed by nobody; and its settlement drew the new credit. Its mode comes from its admission, through the
    usage journal too (a row replayed later, from a shipped journal)."""
    from billing.usage_journal import decode, encode
    from controlplane.redis_client import get_redis
    from controlplane.redis_keys import credit_key
    from tests.billing.test_quota import reserve, settle

    endpoint = EndpointFactory()
    organization = endpoint.organization
    admitted = asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("5.00"),
                                   request_id="long-stream"))
    set_billing_mode(SYSTEM, organization, mode=BillingMode.PREPAID)  # while it streams
    grant_credits(SYSTEM, organization, amount=Decimal("100"))
    prepaid_call = asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"),
                                       request_id="prepaid-call"))  # admitted on the credit, still running
    assert prepaid_call.billing_mode == BillingMode.PREPAID
    report = usage_report(endpoint, request_id="long-stream", prompt_tokens=1000, completion_tokens=100_000,
                          finished_at=_hours_ago(3))
    report.billing_mode = admitted.billing_mode  # as the gateway's call writes it
    record_usage(decode(encode(report)))
    row = UsageRecord.objects.get(request_id="long-stream")
    credit_before = get_redis().get(credit_key(organization.pk))
    assert credit_before is not None
    asyncio.run(settle(admitted, row.cost, fresh_id=True))

    assert (row.billing_mode, row.cost > 0) == (BillingMode.POSTPAID, True)
    assert get_redis().get(credit_key(organization.pk)) == credit_before, "the prepaid credit is not drawn for it"
    rollup_usage()
    assert stripe_sync.push_pending_rollups() == 1
    assert _customer_usage_cost(fake_stripe, organization) == int((row.cost * Decimal(1_000_000)).to_integral_value())
    assert draw_credits(organization.pk) == 0
    assert CreditGrant.objects.get(organization=organization).consumed == 0


def test_prepaid_usage_recorded_before_a_switch_to_postpaid_is_drawn_from_credit(fake_stripe):
    # A rollup run flagged for a draw only the organisations prepaid when it ran: usage recorded in prepaid mode and
    # rolled up after a switch to postpaid was never drawn, and never metered to Stripe either (free usage).
    from billing import tasks

    endpoint = EndpointFactory(price_input_per_million=Decimal("1"), price_output_per_million=Decimal("0"))
    organization = endpoint.organization
    set_billing_mode(SYSTEM, organization, mode=BillingMode.PREPAID)
    grant_credits(SYSTEM, organization, amount=Decimal("10"), granted_at=_hours_ago(4))
    record_usage(usage_report(endpoint, finished_at=_hours_ago(3), prompt_tokens=100_000, completion_tokens=0))
    set_billing_mode(SYSTEM, organization, mode=BillingMode.POSTPAID)

    tasks.rollup_usage()

    assert UsageRecord.objects.get(organization=organization).cost == Decimal("0.10")
    assert CreditGrant.objects.get(organization=organization).consumed == Decimal("0.10")
    assert BillingAccount.objects.get(organization=organization).credit_drawn == Decimal("0.10")
    assert stripe_sync.push_pending_rollups() == 0 and _customer_usage_cost(fake_stripe, organization) == 0


def test_the_migration_flags_for_a_draw_the_prepaid_usage_a_switch_to_postpaid_left_undrawn():
    import importlib

    from django.apps import apps

    from billing import tasks

    left, drawn = (EndpointFactory(price_input_per_million=Decimal("1"), price_output_per_million=Decimal("0"))
                   for _ in range(2))
    for endpoint in (left, drawn):
        set_billing_mode(SYSTEM, endpoint.organization, mode=BillingMode.PREPAID)
        grant_credits(SYSTEM, endpoint.organization, amount=Decimal("10"), granted_at=_hours_ago(4))
        record_usage(usage_report(endpoint, finished_at=_hours_ago(3), prompt_tokens=100_000, completion_tokens=0))
    draw_credits(drawn.organization_id)
    set_billing_mode(SYSTEM, left.organization, mode=BillingMode.POSTPAID)
    rollup_usage()
    BillingAccount.objects.update(credit_draw_due=False)  # as the rollups left it before this change

    migration = importlib.import_module("billing.migrations.0014_draw_prepaid_usage_left_by_a_switch")
    migration.flag_undrawn_prepaid_usage(apps, None)

    assert set(BillingAccount.objects.filter(credit_draw_due=True).values_list("organization_id", flat=True)) == {
        left.organization_id}
    tasks.rollup_usage()
    for endpoint in (left, drawn):
        assert CreditGrant.objects.get(organization=endpoint.organization).consumed == Decimal("0.10")


def test_the_credit_left_counts_prepaid_usage_only():
    endpoint = EndpointFactory()
    organization = endpoint.organization
    record_usage(usage_report(endpoint, prompt_tokens=10_000))  # invoiced, never drawn from credit
    set_billing_mode(SYSTEM, organization, mode=BillingMode.PREPAID)
    grant_credits(SYSTEM, organization, amount=Decimal("1"))
    record_usage(report := usage_report(endpoint, prompt_tokens=1000))
    assert credit_available(organization.pk)[0] == Decimal("1") - UsageRecord.objects.get(request_id=report.request_id).cost


def _account_form(account, **changes) -> dict:
    """Every field of the account's admin form (read-only ones are ignored), with `changes`."""
    return {"organization": account.organization_id, "mode": account.mode, "spend_cap": account.spend_cap or "",
            "stripe_customer_id": "", "stripe_subscription_id": "", "credit_drawn": "0",
            "created_at_0": account.created_at.strftime("%Y-%m-%d"), "created_at_1": account.created_at.strftime("%H:%M:%S"),
            **changes}


def _reserve(organization, request_id: str, amount: str = "1.00"):
    async def reserve():
        try:
            # NOTE: as the gateway reserves it: in its admission script, waiting for a cold start
            caller = Caller(organization_id=organization.pk, api_key_id=None, user_id=1, can_infer=True,
                            requests_per_minute=0, tokens_per_minute=0)
            return await admission.admit(caller=caller, endpoint_id=str(organization.pk), request_id=request_id,
                                         amount=Decimal(amount), num_tokens=0, candidates=[])
        finally:
            # NOTE: the counters were rebuilt in sync_to_async's thread; its connection must not outlive the test.
            await sync_to_async(connections.close_all)()

    return asyncio.run(reserve())


def test_a_cap_edited_in_the_django_admin_is_audited_and_the_gateway_enforces_it_at_once(staff_client):
    endpoint = EndpointFactory()
    organization = endpoint.organization
    account = BillingAccount.objects.for_organization(organization.pk)
    _reserve(organization, "before")  # the gateway's counters now hold the old (absent) cap

    response = staff_client.post(f"/django-admin/billing/billingaccount/{account.pk}/change/",
                                 _account_form(account, spend_cap="0.50"))
    assert response.status_code == 302, response.content[:2000]

    assert BillingAccount.objects.for_organization(organization.pk).spend_cap == Decimal("0.50")
    event = AuditEvent.objects.get(organization=organization, action="billing.set_spend_cap")
    assert event.actor == staff_client.staff and event.details["spend_cap"] == "0.50"
    with pytest.raises(QuotaExceeded):
        _reserve(organization, "after")


def test_a_billing_mode_edited_in_the_django_admin_is_audited_and_the_gateway_enforces_it_at_once(staff_client):
    endpoint = EndpointFactory()
    organization = endpoint.organization
    account = BillingAccount.objects.for_organization(organization.pk)
    _reserve(organization, "before")

    response = staff_client.post(f"/django-admin/billing/billingaccount/{account.pk}/change/",
                                 _account_form(account, mode=BillingMode.PREPAID))
    assert response.status_code == 302, response.content[:2000]

    assert AuditEvent.objects.filter(organization=organization, action="billing.set_mode", actor=staff_client.staff).exists()
    with pytest.raises(QuotaExceeded) as refused:
        _reserve(organization, "after")  # prepaid with no credit
    assert refused.value.reason == "credit"


def test_credit_granted_in_the_django_admin_is_audited_and_usable_at_once(staff_client):
    endpoint = EndpointFactory()
    organization = endpoint.organization
    set_billing_mode(SYSTEM, organization, mode=BillingMode.PREPAID)
    with pytest.raises(QuotaExceeded):
        _reserve(organization, "before")

    response = staff_client.post("/django-admin/billing/creditgrant/add/", {
        "organization": organization.pk, "amount": "5", "granted_at_0": timezone.now().strftime("%Y-%m-%d"),
        "granted_at_1": (timezone.now() - timedelta(minutes=1)).strftime("%H:%M:%S"), "note": "goodwill",
    })
    assert response.status_code == 302, response.content[:2000]

    assert AuditEvent.objects.filter(organization=organization, action="billing.grant_credits", actor=staff_client.staff).exists()
    _reserve(organization, "after")


def test_credit_granted_in_the_django_admin_through_a_web_pod_whose_clock_is_ahead_is_usable_at_once(
        staff_client, monkeypatch):
    """The grant's start is judged by PostgreSQL's clock (`rebuild.credit_available`); the admin's add form offered
    the web pod's own now as `granted_at` (the model's default), posted back as it was shown: a grant through a web
    pod 10 minutes ahead was "not yet granted" for 10 minutes, the topped-up prepaid organisation refused (402). Left
    blank (as the form now shows it), the grant starts at the database's now (`credits.grant_credits`)."""
    import re
    from html import unescape

    organization = EndpointFactory().organization
    set_billing_mode(SYSTEM, organization, mode=BillingMode.PREPAID)
    real_now = timezone.now
    with monkeypatch.context() as web_pod:
        web_pod.setattr(timezone, "now", lambda: real_now() + timedelta(minutes=10))
        # NOTE: the model's default is `timezone.now` as it was when the model was defined
        web_pod.setattr(CreditGrant._meta.get_field("granted_at"), "default", timezone.now)
        page = staff_client.get("/django-admin/billing/creditgrant/add/").content.decode()
        shown = {}
        for tag in re.findall(r"<input[^>]*>", page):
            attributes = dict(re.findall(r'(\w[\w-]*)="([^"]*)"', tag))
            if attributes.get("name", "").startswith(("granted_at", "initial-granted_at")):
                shown[attributes["name"]] = unescape(attributes.get("value", ""))
        assert "granted_at_0" in shown, page[:2000]
        response = staff_client.post("/django-admin/billing/creditgrant/add/", shown | {
            "organization": organization.pk, "amount": "5", "note": "top-up"})
    assert response.status_code == 302, response.content[:2000]

    grant = CreditGrant.objects.get(organization=organization)
    assert abs((grant.granted_at - real_now()).total_seconds()) < 60, grant.granted_at
    assert credit_available(organization.pk)[0] == Decimal("5")
    _reserve(organization, "after")


def test_stripes_invoices_are_read_only_in_the_django_admin(staff_client):
    # They decide an organisation's payment standing: marked paid in the admin, an unpaid invoice lifted a past-due
    # hold at the next review, and one marked uncollectible held an organisation, with no audit event.
    organization = EndpointFactory().organization
    failed_at = timezone.now() - timedelta(days=10)
    invoice = Invoice.objects.create(organization=organization, stripe_invoice_id="in_unpaid", number="INV-1",
                                     status="open", amount_due=5000, payment_failed_at=failed_at)
    url = f"/django-admin/billing/invoice/{invoice.pk}/change/"
    paid = {"organization": organization.pk, "stripe_invoice_id": "in_unpaid", "number": "INV-1", "status": "paid",
            "currency": "usd", "amount_due": "5000", "amount_paid": "5000", "period_start_0": "", "period_start_1": "",
            "period_end_0": "", "period_end_1": "", "hosted_invoice_url": "", "payment_failed_at_0": "",
            "payment_failed_at_1": "", "stripe_event_created": "0"}

    shown = staff_client.get(url)
    changed = staff_client.post(url, paid)
    added = staff_client.post("/django-admin/billing/invoice/add/", paid | {"stripe_invoice_id": "in_made_up"})
    deleted = staff_client.post(f"/django-admin/billing/invoice/{invoice.pk}/delete/", {"post": "yes"})

    assert shown.status_code == 200 and "INV-1" in shown.content.decode()
    assert (changed.status_code, added.status_code, deleted.status_code) == (403, 403, 403)
    invoice.refresh_from_db()
    assert (invoice.status, invoice.amount_paid, invoice.payment_failed_at) == ("open", 0, failed_at)
    assert list(Invoice.objects.values_list("stripe_invoice_id", flat=True)) == ["in_unpaid"]


def test_a_draw_that_failed_after_its_rollups_committed_is_made_by_the_next_run(monkeypatch):
    # The draw came after the rollups' commit, for the organisations whose rollups changed in that run: a worker
    # killed there, a draw failing (it also ended the loop for the organisations after it) or the time limit left
    # the spend undrawn until the organisation had new usage, maybe never; an expiring grant then took it with it.
    from billing import credits, tasks

    first, second = EndpointFactory(), EndpointFactory()
    for endpoint in (first, second):
        set_billing_mode(SYSTEM, endpoint.organization, mode=BillingMode.PREPAID)
        grant_credits(SYSTEM, endpoint.organization, amount=Decimal("10"), granted_at=_hours_ago(4))
        record_usage(usage_report(endpoint, finished_at=_hours_ago(3)))
    draw = credits.draw_credits
    failed = []

    def fails_once(organization_id, **kwargs):
        if not failed:
            failed.append(organization_id)
            raise ConnectionError("the database went away")
        return draw(organization_id, **kwargs)

    monkeypatch.setattr(credits, "draw_credits", fails_once)
    try:
        tasks.rollup_usage()
    except ConnectionError:
        pass  # the task failed where it stood, as a killed worker would
    monkeypatch.setattr(credits, "draw_credits", draw)
    tasks.rollup_usage()  # the next run: no rollup changes

    for endpoint in (first, second):
        spent = UsageRecord.objects.get(organization=endpoint.organization).cost
        assert BillingAccount.objects.get(organization=endpoint.organization).credit_drawn == spent
        assert CreditGrant.objects.get(organization=endpoint.organization).consumed == spent
    assert not BillingAccount.objects.filter(credit_draw_due=True).exists()
