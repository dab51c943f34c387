"""Stray machines (`StrayMachine`): a pool machine with this fleet's marking that no launch record knows, remembered
from when the stray sweep (`endpoints.fleet.pool_strays`) first saw it, so it is terminated only after a grace period."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('gpu_agent', '0010_node_retired_secret_digest'),
    ]

    operations = [
        migrations.CreateModel(
            name='StrayMachine',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('provider_id', models.CharField(max_length=255)),
                ('launch_id', models.CharField(max_length=255)),
                ('first_seen_at', models.DateTimeField()),
                ('claimed_at', models.DateTimeField(blank=True, null=True)),
                ('terminated_at', models.DateTimeField(blank=True, null=True)),
                ('pool', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='strays', to='gpu_agent.nodepool')),
            ],
            options={
                'constraints': [models.UniqueConstraint(fields=('pool', 'provider_id'), name='stray_machine_once_per_pool')],
            },
        ),
    ]
