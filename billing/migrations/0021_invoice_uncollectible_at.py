"""An invoice keeps when Stripe marked it uncollectible (`billing.Invoice.uncollectible_at`): one owed before its
customer was deleted keeps holding its organisation (`billing.standing.past_due_since`). Those marked before are
dated as the standing dated them: by their failure, or else their last change."""

from django.db import migrations, models
from django.db.models.functions import Coalesce


def date_uncollectible_invoices(apps, schema_editor):
    Invoice = apps.get_model("billing", "Invoice")
    Invoice.objects.filter(status="uncollectible").update(
        uncollectible_at=Coalesce("payment_failed_at", "updated_at"))


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0020_invoice_stripe_customer'),
    ]

    operations = [
        migrations.AddField(
            model_name='invoice',
            name='uncollectible_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunPython(date_uncollectible_invoices, migrations.RunPython.noop),
    ]
