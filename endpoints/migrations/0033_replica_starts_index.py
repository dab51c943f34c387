"""An index of replicas by endpoint and creation time, for an organisation's replica starts in the last hour
(`endpoints.quota_room.replica_starts`, read at every placement and by the pools' demand).

NOTE: replica rows are kept when they stop, so an organisation's grow with every scale-up it ever had: by `(endpoint,
state)` alone the count read all of them. Built CONCURRENTLY (`controlplane.migration_indexes`), so replicas are placed
meanwhile; the release before does not read it. Each step may run again after a migration that was interrupted.
"""

from django.db import migrations, models

from controlplane.migration_indexes import built_concurrently

_TABLE = "endpoints_replica"
_INDEXES = {"replica_endpoint_created": """("endpoint_id", "created_at")"""}


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("endpoints", "0032_count_scale_up_failures"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="replica",
                    index=models.Index(fields=["endpoint", "created_at"], name="replica_endpoint_created"),
                ),
            ],
            database_operations=built_concurrently(_TABLE, _INDEXES),
        ),
    ]
