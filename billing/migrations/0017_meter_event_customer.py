"""Meter events keep the customer they went to, the time they were dated at and their rollup's push generation, and
rollups get a push generation: usage pushed to a customer deleted before invoicing it goes again, to the next customer,
under new identifiers (`billing.services.record_customer_deleted`). Events recorded before keep a blank customer."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0016_rollup_push_uid'),
    ]

    operations = [
        migrations.AddField(
            model_name='metereventpush',
            name='event_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='metereventpush',
            name='push_generation',
            field=models.PositiveIntegerField(db_default=0, default=0),
        ),
        migrations.AddField(
            model_name='metereventpush',
            name='stripe_customer_id',
            field=models.CharField(blank=True, db_default='', default='', max_length=64),
        ),
        migrations.AddField(
            model_name='usagerollup',
            name='push_generation',
            field=models.PositiveIntegerField(db_default=0, default=0),
        ),
    ]
