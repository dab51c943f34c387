"""Spending ceilings (`billing/0029`) came with no ceiling of staff's for anyone, so an organisation already spending
past the one its paid history gives (`INFERPLANE_SPEND_CEILINGS`) would be refused from the deploy on, and staff could
not set one first (the fields come with 0029). Each postpaid organisation held to a ceiling (not "invoiced without
card") that used the platform in the last three calendar months (this one too) gets a ceiling of staff's: twice its
highest month's spend of them, rounded up to whole dollars, where that is above its paid history's; otherwise none
(its history's stands). Growth stays bounded, and nobody is refused at the deploy. Staff see and change it in the
admin ("Spending ceiling (staff)"); `manage.py spend_over_ceiling` lists who is still at or past theirs."""

from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal

from django.conf import settings
from django.db import migrations
from django.db.models import Sum
from django.db.models.functions import TruncMonth

# As `billing.standing` has them when this was written (a migration keeps its own copy).
HOLDING_DISPUTE_STATUSES = ("warning_needs_response", "warning_under_review", "needs_response", "under_review", "lost")
MONTHS = 3
HEADROOM = 2


def months_back(now: datetime, months: int) -> datetime:
    """The first instant of the calendar month `months` before `now`'s (UTC)."""
    index = now.year * 12 + now.month - 1 - months
    return datetime(index // 12, index % 12 + 1, 1, tzinfo=UTC)


def grandfather_spend_ceilings(apps, schema_editor, *, now: datetime | None = None):
    BillingAccount = apps.get_model("billing", "BillingAccount")
    UsageRecord = apps.get_model("billing", "UsageRecord")
    Invoice = apps.get_model("billing", "Invoice")
    RefundedCharge = apps.get_model("billing", "RefundedCharge")
    Dispute = apps.get_model("billing", "Dispute")
    now = now or datetime.now(UTC)
    monthly = (UsageRecord.objects.filter(finished_at__gte=months_back(now, MONTHS - 1))
               .annotate(month=TruncMonth("finished_at", tzinfo=UTC)).values("organization_id", "month")
               .annotate(spend=Sum("cost")).values("organization_id", "spend"))
    highest = {}
    for row in monthly:
        highest[row["organization_id"]] = max(highest.get(row["organization_id"], Decimal(0)), row["spend"])
    accounts = BillingAccount.objects.filter(organization_id__in=[org for org, spend in highest.items() if spend > 0],
                                             mode="postpaid", invoiced_without_card=False,
                                             staff_spend_ceiling__isnull=True, staff_lifted_spend_ceiling=False)
    for account in accounts:
        wanted = (highest[account.organization_id] * HEADROOM).to_integral_value(rounding=ROUND_CEILING)
        history = _history_ceiling(_net_paid(account.organization_id, Invoice, RefundedCharge, Dispute))
        if history is None or history >= wanted:
            continue
        account.staff_spend_ceiling = wanted
        account.limits_stale = True
        account.save(update_fields=["staff_spend_ceiling", "limits_stale"])


def _net_paid(organization_id, Invoice, RefundedCharge, Dispute) -> Decimal:
    """`billing.standing.net_paid` as it is when this was written."""
    def cents(queryset, field):
        return queryset.filter(organization_id=organization_id, currency="usd").aggregate(total=Sum(field))["total"] or 0
    total = (cents(Invoice.objects.filter(status="paid"), "amount_paid") - cents(RefundedCharge.objects, "amount_refunded")
             - cents(Dispute.objects.filter(status__in=HOLDING_DISPUTE_STATUSES), "amount"))
    return Decimal(max(total, 0)) / 100


def _history_ceiling(paid: Decimal) -> Decimal | None:
    """The ceiling `settings.SPEND_CEILINGS` gives at `paid` (None: none); its first step is at 0."""
    return [ceiling for step, ceiling in settings.SPEND_CEILINGS if step <= paid][-1]


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0031_spend_alert_per_limit'),
    ]

    operations = [
        migrations.RunPython(grandfather_spend_ceilings, migrations.RunPython.noop),
    ]
