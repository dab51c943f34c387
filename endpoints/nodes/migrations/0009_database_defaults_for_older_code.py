"""Database defaults for the NOT NULL columns earlier migrations added without one: each is what its migration gave the
rows before it. A rolling deploy runs the migrations while code from before them still writes rows with the columns
it knows (README, *A rolling deploy*); its INSERT was refused (NotNullViolation), and is now given the default. Only
`ALTER COLUMN ... SET DEFAULT`: no table is rewritten or locked for longer than the catalogue change
(`tests/test_rolling_deploy_schema.py`)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    # NOTE: each ALTER in its own transaction: a table's lock (ACCESS EXCLUSIVE, for the catalogue change alone) is not
    # held while the next table's is waited for. Run again after a failure part way, it sets the same defaults.
    atomic = False

    dependencies = [
        ('gpu_agent', '0008_node_heartbeat_sequence'),
    ]

    operations = [
        migrations.AlterField(
            model_name='node',
            name='engine_sandbox',
            field=models.CharField(blank=True, db_default='', default='', max_length=200),
        ),
        migrations.AlterField(
            model_name='node',
            name='gpus',
            field=models.JSONField(blank=True, db_default=[], default=list),
        ),
        migrations.AlterField(
            model_name='node',
            name='state_before_offline',
            field=models.CharField(blank=True, db_default='', default='', max_length=16),
        ),
    ]
