"""This installation's random id (`FleetInstallation`), made once here: the stray sweep terminates only machines that
carry it, so deployments sharing an AWS account, a namespace or a local-pool folder never take each other's machines
for their own."""

import uuid

from django.db import migrations, models


def make_installation_id(apps, schema_editor):
    apps.get_model("gpu_agent", "FleetInstallation").objects.get_or_create(pk=1)


class Migration(migrations.Migration):

    dependencies = [
        ('gpu_agent', '0012_stray_terminate_sent_at'),
    ]

    operations = [
        migrations.CreateModel(
            name='FleetInstallation',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('installation_id', models.UUIDField(default=uuid.uuid4, unique=True)),
            ],
        ),
        migrations.RunPython(make_installation_id, migrations.RunPython.noop),
    ]
