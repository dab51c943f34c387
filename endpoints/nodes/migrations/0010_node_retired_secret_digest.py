"""A retired node keeps its secret's hash (`Node.retired_secret_digest`), so its agent is told it is retired
(`protocol.NODE_RETIRED`). With a database default: the previous release's pods insert nodes without the column during
a rolling deploy."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('gpu_agent', '0009_database_defaults_for_older_code'),
    ]

    operations = [
        migrations.AddField(
            model_name='node',
            name='retired_secret_digest',
            field=models.CharField(blank=True, db_default='', default='', max_length=64),
        ),
    ]
