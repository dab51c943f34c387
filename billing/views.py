"""Console pages for usage and billing; they read the ledger and billing state, never write it directly."""

from __future__ import annotations

import logging
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

import stripe
from django.conf import settings
from django.contrib import messages
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from billing import services, standing, stripe_sync
from billing.ledger import GROUPINGS, period_spend, summarize_usage, tokens_by_day
from billing.models import BillingAccount, CreditGrant, Invoice
from billing.periods import period_containing
from billing.serializers import SpendCapSerializer, report_day_problem
from controlplane.accounts.console import member_required
from controlplane.accounts.models import Role
from controlplane.accounts.services import Actor
from controlplane.clock import database_now
from controlplane.redis_client import get_redis
from controlplane.redis_keys import portal_return_key

logger = logging.getLogger(__name__)

DEFAULT_RANGE_DAYS = 30
MAX_RANGE_DAYS = 366
NUM_CHART_SERIES = 8  # the biggest groups get a line each; the rest are summed as "other"


def _date_range(request) -> tuple[date, date, list[str]]:
    # NOTE: today by PostgreSQL's clock, which usage is stamped by (`database_now`), as the API's default period
    # (`DatePeriodSerializer`): by this pod's own, one a day behind showed a range that left out today's usage
    today = database_now().astimezone(UTC).date()
    errors = []
    try:
        end = date.fromisoformat(request.GET["end"]) if request.GET.get("end") else today
    except ValueError:
        end, errors = today, errors + ["The end date is not a date (YYYY-MM-DD)."]
    if problem := report_day_problem(end):
        end, errors = today, errors + [f"The end date was not taken: {problem}"]
    try:
        start = date.fromisoformat(request.GET["start"]) if request.GET.get("start") else end - timedelta(days=DEFAULT_RANGE_DAYS - 1)
    except ValueError:
        start, errors = end - timedelta(days=DEFAULT_RANGE_DAYS - 1), errors + ["The start date is not a date (YYYY-MM-DD)."]
    if request.GET.get("start") and (problem := report_day_problem(start)):
        start, errors = end - timedelta(days=DEFAULT_RANGE_DAYS - 1), errors + [f"The start date was not taken: {problem}"]
    if start > end:
        start, end, errors = end, start, errors + ["The start was after the end; they were swapped."]
    if (end - start).days >= MAX_RANGE_DAYS:
        start, errors = end - timedelta(days=MAX_RANGE_DAYS - 1), errors + [f"Ranges are at most {MAX_RANGE_DAYS} days."]
    return start, end, errors


def _daily_tokens(organization, *, by: str, start: date, end: date) -> dict:
    """Tokens per day and per endpoint (or key), shaped for the chart: days plus one series per group."""
    totals = tokens_by_day(organization, by=by, start=start, end=end)
    days = [start + timedelta(days=i) for i in range((end - start).days + 1)]
    index = {day: i for i, day in enumerate(days)}
    series: dict[str, list[int]] = {}
    for row in totals:
        name = row["group"] or ("(deleted key)" if by == "key" else "(unknown)")
        series.setdefault(name, [0] * len(days))[index[row["day"]]] += row["tokens"] or 0
    ranked = sorted(series, key=lambda name: -sum(series[name]))
    shown = {name: series[name] for name in ranked[:NUM_CHART_SERIES]}
    if len(ranked) > NUM_CHART_SERIES:
        shown["other"] = [sum(series[name][i] for name in ranked[NUM_CHART_SERIES:]) for i in range(len(days))]
    return {"t": [int(datetime.combine(day, time.min, tzinfo=UTC).timestamp()) for day in days],
            "series": shown}


@member_required()
def usage(request):
    start, end, errors = _date_range(request)
    group_by = request.GET.get("group_by", "endpoint")
    if group_by not in GROUPINGS:
        group_by = "endpoint"
    rows = summarize_usage(request.organization, group_by=group_by, start=start, end=end)
    chart_by = "key" if group_by == "key" else "endpoint"
    # NOTE: both links name the page's grouping: the CSV's named none, and exported by endpoint whatever the page showed.
    query = f"group_by={group_by}&start={start.isoformat()}&end={end.isoformat()}"
    return render(request, "billing/usage.html", {
        "start": start, "end": end, "group_by": group_by, "groupings": GROUPINGS, "errors": errors,
        "rows": rows,
        "totals": {
            name: sum(row[name] for row in rows)
            for name in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost")
        },
        "chart_by": chart_by,
        "chart": _daily_tokens(request.organization, by=chart_by, start=start, end=end),
        "csv_url": f"/api/v1/usage/export.csv?{query}",
        "api_url": f"/api/v1/usage/?{query}",
    })


def _billing_page(request, *, cap_errors=(), cap_value=None, status=200):
    organization = request.organization
    account = BillingAccount.objects.for_organization(organization)
    # NOTE: grants judged by PostgreSQL's clock, as they are stamped (`granted_at`) and spent, and as /api/v1/billing/
    # judges them: by this pod's own, one 10 minutes behind left a top-up made a moment ago out of the remaining credit.
    # One reading for the whole page: read again for the month (`current_period`), a page loaded across a month's edge
    # showed last month's period and spend beside the credit left as of the new month.
    now = database_now()
    period = period_containing(now)
    spend = period_spend(organization.pk, period)
    credits = list(CreditGrant.objects.for_org(organization).order_by("-granted_at"))
    return render(request, "billing/billing.html", {
        "account": account,
        "period": period,
        "period_last_day": period.end - timedelta(days=1),
        "spend": spend,
        "spend_cap": account.spend_cap,
        "cap_value": cap_value if cap_value is not None else ("" if account.spend_cap is None else f"{account.spend_cap:.2f}"),
        "cap_errors": cap_errors,
        "cap_percent": _cap_percent(spend, account.spend_cap),
        "credits": credits,
        "credit_remaining": sum((grant.remaining for grant in credits if grant.is_active(now)), start=Decimal(0)),
        "invoices": Invoice.objects.for_org(organization)[:24],
        "can_manage": request.membership.can(Role.ADMIN),
        "payments_configured": stripe_sync.is_configured(),
        "standing": standing.standing(account, period=period),
    }, status=status)


def _cap_percent(spend: Decimal, spend_cap: Decimal | None) -> float | None:
    """How much of the cap this period's spend is (None: no cap).

    NOTE: a cap of $0.00 is a cap (every call is refused, as at 100%): it was taken for none, and the page said "No
    spend cap" to an organisation whose calls all failed with `insufficient_quota`."""
    if spend_cap is None:
        return None
    return float(100 * spend / spend_cap) if spend_cap else 100.0


@member_required(write=Role.ADMIN)
def billing(request):
    if request.GET.get("from") == "portal":
        _observe_after_portal(request)
    return _billing_page(request)


PORTAL_RETURN_EVERY_S = 30


def _observe_after_portal(request) -> None:
    """Back from the Customer Portal: a card added there counts now, not when its webhook arrives. For
    owners and admins (who can open the portal), once per organisation every 30 s, one try: a loop on
    this address never spends the platform's Stripe rate limit."""
    account = BillingAccount.objects.for_organization(request.organization)
    if not (stripe_sync.is_configured() and account.stripe_customer_id and request.membership.can(Role.ADMIN)):
        return
    try:
        if get_redis().set(portal_return_key(request.organization.pk), "1", nx=True, ex=PORTAL_RETURN_EVERY_S):
            stripe_sync.observe_payment_method(account.stripe_customer_id, attempts=1)
    except Exception:  # the page shows what is known; the webhook follows
        logger.exception("could not read the Stripe customer of organisation %s", request.organization.pk)


@member_required(write=Role.ADMIN)
@require_POST
def billing_cap(request):
    """The cap form; `SpendCapSerializer` (the API's) validates it, `set_spend_cap` applies it."""
    raw = request.POST.get("spend_cap", "").strip()
    serializer = SpendCapSerializer(data={"spend_cap": raw or None})
    if not serializer.is_valid():
        return _billing_page(request, cap_errors=serializer.errors["spend_cap"], cap_value=raw, status=400)
    spend_cap = serializer.validated_data["spend_cap"]
    services.set_spend_cap(Actor.from_request(request), request.organization, spend_cap=spend_cap)
    messages.success(request, f"Monthly spend cap set to ${spend_cap:,.2f}." if spend_cap is not None else "Spend cap removed.")
    return redirect("console:billing")


@member_required(write=Role.ADMIN, open_when_closed=True)  # NOTE: a closed organisation still pays its invoices
@require_POST
def payment_method(request):
    """Off to Stripe's Customer Portal, where a card is added and invoices are paid."""
    if not stripe_sync.is_configured():
        messages.error(request, "Card payments are not set up on this installation; ask its operator.")
        return redirect("console:billing")
    try:
        url = stripe_sync.create_portal_link(
            request.organization.pk, return_url=f"{settings.PUBLIC_URL}{reverse('console:billing')}?from=portal"
        )
    except stripe.StripeError:  # Stripe is down or refused: the page says so rather than a 500
        logger.exception("could not create a Stripe portal link for organisation %s", request.organization.pk)
        messages.error(request, "Stripe could not be reached just now; please try again in a minute.")
        return redirect("console:billing")
    return redirect(url)
