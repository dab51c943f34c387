"""What was done once with a void invoice (`billing.VoidedInvoiceMark`: written off, or held for an operator), a unique
row found by its index: before, every void's webhook scanned the audit log by a key of its JSON details. The marks of
before are taken from the audit log (`billing.voided_invoice_written_off`, `billing.usage_held_for_operator` naming
an invoice), so that a void told again holds or audits nothing more."""

import django.utils.timezone
from django.db import migrations, models

KINDS = {"billing.voided_invoice_written_off": "written_off", "billing.usage_held_for_operator": "held"}


def mark_from_the_audit_log(apps, schema_editor):
    AuditEvent = apps.get_model("controlplane", "AuditEvent")
    VoidedInvoiceMark = apps.get_model("billing", "VoidedInvoiceMark")
    for action, kind in KINDS.items():
        for audited in AuditEvent.objects.filter(action=action).order_by("created_at").iterator():
            invoice_id = (audited.details or {}).get("invoice")
            if invoice_id:
                VoidedInvoiceMark.objects.get_or_create(stripe_invoice_id=invoice_id, kind=kind,
                                                        defaults={"created_at": audited.created_at})


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0024_invoice_voided_at_deleted_customer_billed_periods'),
        ('controlplane', '0012_confirm_email_verifications_operators_made'),
    ]

    operations = [
        migrations.CreateModel(
            name='VoidedInvoiceMark',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('stripe_invoice_id', models.CharField(max_length=64)),
                ('kind', models.CharField(choices=[('written_off', 'Written Off'), ('held', 'Held')], max_length=16)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
            ],
            options={
                'constraints': [models.UniqueConstraint(fields=('stripe_invoice_id', 'kind'), name='voided_invoice_mark_unique')],
            },
        ),
        migrations.RunPython(mark_from_the_audit_log, migrations.RunPython.noop),
    ]
