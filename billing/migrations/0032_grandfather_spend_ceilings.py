"""Spending ceilings (`billing/0029`) came with no ceiling of staff's for anyone, so an organisation already spending
past the one its paid history gives (`INFERPLANE_SPEND_CEILINGS`) would be refused from the deploy on, and staff could
not set one first (the fields come with 0029). Each postpaid organisation held to a ceiling (not "invoiced without
card", no ceiling of staff's) that used the platform in the last three calendar months (this one too) gets a floor,
`grandfathered_spend_ceiling`: twice its highest month's spend of them, rounded up to whole dollars, where that is
above its paid history's ceiling; otherwise none. Its ceiling is the higher of the floor and its paid history's
(`billing.standing.spend_ceiling`), so paying raises it as anyone's; growth stays bounded, and nobody is refused at the
deploy. `manage.py spend_over_ceiling` lists who is still at or past theirs.

NOTE: spend is read from the hourly rollups (`UsageRollup`, sequences summed: the ledger's), one organisation at a
time through their `(organization, hour_start)` index, not from the usage ledger: no index of the ledger leads with
`finished_at`, so a query over every organisation's rows of three months read the whole biggest table inside the
migrate Job's transaction. Usage not rolled up yet (minutes) is not counted; the headroom covers it."""

from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal

from django.conf import settings
from django.db import migrations, models
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
    UsageRollup = apps.get_model("billing", "UsageRollup")
    Invoice = apps.get_model("billing", "Invoice")
    RefundedCharge = apps.get_model("billing", "RefundedCharge")
    Dispute = apps.get_model("billing", "Dispute")
    since = months_back(now or datetime.now(UTC), MONTHS - 1)
    accounts = BillingAccount.objects.filter(mode="postpaid", invoiced_without_card=False,
                                             staff_spend_ceiling__isnull=True, staff_lifted_spend_ceiling=False,
                                             grandfathered_spend_ceiling__isnull=True)
    for account in accounts.iterator():
        monthly = (UsageRollup.objects.filter(organization_id=account.organization_id, hour_start__gte=since)
                   .annotate(month=TruncMonth("hour_start", tzinfo=UTC)).values("month")
                   .annotate(spend=Sum("cost")).values_list("spend", flat=True))
        highest = max(monthly, default=Decimal(0))
        if highest <= 0:
            continue
        wanted = (highest * HEADROOM).to_integral_value(rounding=ROUND_CEILING)
        history = _history_ceiling(_net_paid(account.organization_id, Invoice, RefundedCharge, Dispute))
        if history is None or history >= wanted:
            continue
        account.grandfathered_spend_ceiling = wanted
        account.limits_stale = True
        account.save(update_fields=["grandfathered_spend_ceiling", "limits_stale"])


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
        migrations.AddField(
            model_name='billingaccount',
            name='grandfathered_spend_ceiling',
            field=models.DecimalField(blank=True, decimal_places=9, max_digits=20, null=True),
        ),
        migrations.RunPython(grandfather_spend_ceilings, migrations.RunPython.noop),
    ]
