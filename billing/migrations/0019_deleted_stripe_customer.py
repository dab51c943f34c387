"""Stripe customers that Stripe deleted keep their organisation (`billing.DeletedStripeCustomer`): an invoice's webhook
that comes after its customer's deletion is mirrored, and a push that raced the deletion is billed once. The customers
deleted before are taken from the audit log (`billing.customer_deleted`), with no invoiced time."""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


def record_customers_deleted_before(apps, schema_editor):
    AuditEvent = apps.get_model("controlplane", "AuditEvent")
    DeletedStripeCustomer = apps.get_model("billing", "DeletedStripeCustomer")
    deletions = AuditEvent.objects.filter(action="billing.customer_deleted", organization__isnull=False).order_by("created_at")
    for deletion in deletions.iterator():
        customer_id = (deletion.details or {}).get("customer")
        if customer_id:
            DeletedStripeCustomer.objects.get_or_create(stripe_customer_id=customer_id, defaults={
                "organization_id": deletion.organization_id, "deleted_at": deletion.created_at})


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0018_usage_status_gateway_lost'),
        ('controlplane', '0012_confirm_email_verifications_operators_made'),
    ]

    operations = [
        migrations.CreateModel(
            name='DeletedStripeCustomer',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('stripe_customer_id', models.CharField(max_length=64, unique=True)),
                ('invoiced_until', models.DateTimeField(blank=True, null=True)),
                ('deleted_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('organization', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='controlplane.organization')),
            ],
        ),
        migrations.RunPython(record_customers_deleted_before, migrations.RunPython.noop),
    ]
