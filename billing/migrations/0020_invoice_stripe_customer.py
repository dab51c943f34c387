"""An invoice keeps the Stripe customer it bills (`billing.Invoice.stripe_customer_id`): an unpaid one of a customer
Stripe deleted since has no card to charge, and stops no organisation that can pay now (`billing.standing`). Invoices
mirrored before keep it empty (as of a customer not deleted) until their next webhook."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0019_deleted_stripe_customer'),
    ]

    operations = [
        migrations.AddField(
            model_name='invoice',
            name='stripe_customer_id',
            field=models.CharField(blank=True, db_index=True, max_length=64),
        ),
    ]
