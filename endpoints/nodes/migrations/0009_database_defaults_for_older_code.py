"""Database defaults for the NOT NULL columns earlier migrations added without one: each is what its migration gave the
rows before it. A rolling deploy runs the migrations while code from before them still writes rows with the columns
it knows (README, *A rolling deploy*); its INSERT was refused (NotNullViolation), and is now given the default. Only
`ALTER COLUMN ... SET DEFAULT`: no table is rewritten (`tests/test_rolling_deploy_schema.py`). Each still takes its
table's ACCESS EXCLUSIVE lock, and waits for it behind any open transaction on the table, every later read of the
table waiting behind it: `manage.py migrate` waits at most its lock timeout (2 s) for a lock, then gives up and tries
again (`controlplane/management/commands/migrate.py`, `tests/test_migrate_lock_timeout.py`)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    # NOTE: each ALTER in its own transaction: a table's lock (ACCESS EXCLUSIVE, held for the catalogue change once
    # had) is not held while the next table's is waited for. Run again after a failure part way (a lock not had within
    # migrate's lock timeout), it sets the same defaults.
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
