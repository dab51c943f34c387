"""Usage rows get a status for a call whose gateway was lost mid-call (killed, OOM): `gateway_lost`, written by the
reservation sweeper from the call's last recorded progress (`billing.quota.sweeper`). Choices only: no SQL."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0017_meter_event_customer'),
    ]

    operations = [
        migrations.AlterField(
            model_name='usagerecord',
            name='status',
            field=models.CharField(choices=[('ok', 'OK'), ('client_aborted', 'Client aborted'), ('upstream_error', 'Upstream error'), ('cut_off', 'Stopped at its reserved cost'), ('gateway_lost', 'Cut: its gateway was lost')], max_length=16),
        ),
    ]
