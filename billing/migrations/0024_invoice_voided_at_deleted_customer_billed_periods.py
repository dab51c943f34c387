"""A void invoice's time (`Invoice.voided_at`, a write-off before its customer's deletion), and what a deleted
customer's invoices billed (`DeletedStripeCustomer.billed_periods`, for the events of the deletion's own second)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0023_usage_record_lost_cost'),
    ]

    operations = [
        migrations.AddField(
            model_name='deletedstripecustomer',
            name='billed_periods',
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.AddField(
            model_name='invoice',
            name='voided_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
