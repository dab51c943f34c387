"""The uid of the Kubernetes agent pod a node registered from (its pod token reviewed): a database default of '', so
pods of the release before, which do not write it, insert nodes bound to no pod."""
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('gpu_agent', '0013_fleet_installation'),
    ]

    operations = [
        migrations.AddField(
            model_name='node',
            name='agent_pod_uid',
            field=models.CharField(blank=True, db_default='', default='', max_length=64),
        ),
    ]
