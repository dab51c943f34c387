"""Push runs an ended subscription's unplaceable invoice line failed (`UsageRollup.num_unknown_lines_failures`): held for an
operator at `stripe_sync.UNKNOWN_LINES_HOLD_AFTER`; before, the push failed every run for ever."""


from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0025_voided_invoice_mark'),
    ]

    operations = [
        migrations.AddField(
            model_name='usagerollup',
            name='num_unknown_lines_failures',
            field=models.PositiveIntegerField(db_default=0, default=0),
        ),
    ]
