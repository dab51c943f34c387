"""Until now a rollup run flagged for a credit draw only the accounts prepaid when it ran: the prepaid usage of an
account switched to postpaid before its next draw was never drawn (nor metered to Stripe: it was free). Every account
whose prepaid usage exceeds what it has drawn is flagged; the next run draws it (`billing.credits.draw_due_credits`)."""

from decimal import Decimal

from django.db import migrations
from django.db.models import F, OuterRef, Subquery, Sum, Value
from django.db.models.functions import Coalesce


def flag_undrawn_prepaid_usage(apps, schema_editor):
    BillingAccount = apps.get_model("billing", "BillingAccount")
    UsageRecord = apps.get_model("billing", "UsageRecord")
    prepaid_spend = (UsageRecord.objects.filter(organization_id=OuterRef("organization_id"), billing_mode="prepaid")
                     .order_by().values("organization_id").annotate(total=Sum("cost")).values("total"))
    (BillingAccount.objects.filter(credit_draw_due=False)
     .annotate(prepaid_spend=Coalesce(Subquery(prepaid_spend), Value(Decimal(0))))
     .filter(prepaid_spend__gt=F("credit_drawn"))
     .update(credit_draw_due=True))


class Migration(migrations.Migration):
    dependencies = [("billing", "0013_key_spend_cap_set_by")]

    operations = [migrations.RunPython(flag_undrawn_prepaid_usage, migrations.RunPython.noop)]
