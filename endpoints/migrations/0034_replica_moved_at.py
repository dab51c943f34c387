"""`Replica.moved_at`: when the platform took a replica off its node for a reason of its own, so that its replacement
is no start of its organisation's (`endpoints.quota_room.replica_starts`), and a partial index of those by endpoint
and time, read beside the hour's starts.

NOTE: a nullable column without a default (no table rewrite); the index built CONCURRENTLY
(`controlplane.migration_indexes`), so replicas are placed meanwhile. The release before neither writes nor reads it.
NOTE: the column IF NOT EXISTS, as `billing/0030`'s: not atomic, a run cut short after it (a pod killed during the
index's build, `migrate`'s own retry after a lock it gave up on) kept it, and Django's AddField failed every run after
on it (DuplicateColumn) until someone dropped it by hand (`tests/test_migration_replica_moved_at_rerun.py`).
"""

from django.db import migrations, models

from controlplane.migration_indexes import built_concurrently

_TABLE = "endpoints_replica"
_INDEXES = {"replica_endpoint_moved": """("endpoint_id", "moved_at") WHERE "moved_at" IS NOT NULL"""}


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("endpoints", "0033_replica_starts_index"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddField(
                    model_name="replica",
                    name="moved_at",
                    field=models.DateTimeField(blank=True, null=True),
                ),
            ],
            database_operations=[
                migrations.RunSQL(f'ALTER TABLE "{_TABLE}" ADD COLUMN IF NOT EXISTS "moved_at" timestamp with time zone NULL',
                                  reverse_sql=f'ALTER TABLE "{_TABLE}" DROP COLUMN IF EXISTS "moved_at"'),
            ],
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="replica",
                    index=models.Index(condition=models.Q(("moved_at__isnull", False)), fields=["endpoint", "moved_at"],
                                       name="replica_endpoint_moved"),
                ),
            ],
            database_operations=built_concurrently(_TABLE, _INDEXES),
        ),
    ]
