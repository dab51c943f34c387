"""`file_org_expiring`: each organisation's expired files, oldest first, for the expiry sweep
(`services.sweep_expired_files`); `batch_output_expiring`: the batches of the last days whose output files it gives
their expiry (`services.backfill_output_expiry`).

NOTE: without them, each page of each sweep numbered and sorted every expired file of every organisation (one tenant's
backlog of tiny files made a page slow enough to spend the run's budget), and each run scanned every batch ever made.
Built CONCURRENTLY as batches/0012, so uploads, outputs and batches are written on meanwhile; the release before reads
neither index and writes its rows as before. Each step may run again after a migration that was interrupted.
"""

from django.db import migrations, models

_INDEXES = {
    # name: (table, the index's columns and condition)
    "file_org_expiring": ("batches_file", '("organization_id", "expires_at", "id") '
                                          'WHERE ("deleted_at" IS NULL AND "expires_at" IS NOT NULL)'),
    "batch_output_expiring": ("batches_batch", '("created_at") WHERE "output_expires_after_s" IS NOT NULL'),
}


def _drop_invalid_indexes(apps, schema_editor) -> None:
    """The invalid index an interrupted build left, dropped CONCURRENTLY (as batches/0012's `_drop_an_invalid_index`):
    CREATE INDEX IF NOT EXISTS would keep it."""
    with schema_editor.connection.cursor() as cursor:
        for name in _INDEXES:
            cursor.execute("SELECT 1 FROM pg_index WHERE indexrelid = to_regclass(%s) AND NOT indisvalid", [f'"{name}"'])
            if cursor.fetchone() is not None:
                cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("batches", "0012_file_expiring_index"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="file",
                    index=models.Index(condition=models.Q(("deleted_at__isnull", True), ("expires_at__isnull", False)),
                                       fields=["organization", "expires_at", "id"], name="file_org_expiring"),
                ),
                migrations.AddIndex(
                    model_name="batch",
                    index=models.Index(condition=models.Q(("output_expires_after_s__isnull", False)),
                                       fields=["created_at"], name="batch_output_expiring"),
                ),
            ],
            database_operations=[
                migrations.RunPython(_drop_invalid_indexes, migrations.RunPython.noop),
                *(migrations.RunSQL(f'CREATE INDEX CONCURRENTLY IF NOT EXISTS "{name}" ON "{table}" {definition}',
                                    reverse_sql=f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')
                  for name, (table, definition) in _INDEXES.items()),
            ],
        ),
    ]
