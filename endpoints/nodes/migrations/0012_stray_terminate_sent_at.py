"""`StrayMachine.terminate_sent_at`: a stray's termination whose answer was lost is audited when its machine goes."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('gpu_agent', '0011_stray_machine'),
    ]

    operations = [
        migrations.AddField(
            model_name='straymachine',
            name='terminate_sent_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
