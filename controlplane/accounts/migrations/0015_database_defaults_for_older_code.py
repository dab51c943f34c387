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
        ('controlplane', '0014_revoke_what_roles_may_not_hold'),
    ]

    operations = [
        migrations.AlterField(
            model_name='emailverification',
            name='confirmed_by_owner',
            field=models.BooleanField(db_default=False, default=True, help_text="Proven by the address's owner: the link followed in the account's own session, a password reset, or an operator's word (False: followed signed out, before that was refused)."),
        ),
    ]
