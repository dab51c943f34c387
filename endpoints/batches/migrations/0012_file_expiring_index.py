"""`file_expiring`: the files the expiry sweep deletes (`services.sweep_expired_files`), live files with an `expires_at`.

Built CONCURRENTLY: uploads, batch outputs and deletes write `batches_file` all the time, and 0011's plain CREATE INDEX
took a SHARE lock that held every one of those writes for as long as it scanned the table (and, queued behind a long
transaction, for as long as that lasted too). Each step may run again after a migration that was interrupted (as
billing/0033).
"""

from django.db import migrations, models

_TABLE = "batches_file"
_INDEX = "file_expiring"


def _drop_an_invalid_index(apps, schema_editor) -> None:
    """The invalid index an interrupted build left, dropped CONCURRENTLY (outside a transaction: this migration is not
    atomic). NOTE: a plain DROP INDEX (in a DO block, which cannot drop CONCURRENTLY) took an ACCESS EXCLUSIVE lock:
    queued behind a transaction that writes files, it held every later read and write of `batches_file`."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_index WHERE indexrelid = to_regclass(%s) AND NOT indisvalid", [f'"{_INDEX}"'])
        if cursor.fetchone() is not None:
            cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{_INDEX}"')


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("batches", "0011_file_expires_at"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="file",
                    index=models.Index(condition=models.Q(("deleted_at__isnull", True), ("expires_at__isnull", False)),
                                       fields=["expires_at"], name=_INDEX),
                ),
            ],
            database_operations=[
                # NOTE: a build that was interrupted leaves an invalid index, which IF NOT EXISTS would keep.
                migrations.RunPython(_drop_an_invalid_index, migrations.RunPython.noop),
                migrations.RunSQL(
                    f"""CREATE INDEX CONCURRENTLY IF NOT EXISTS "{_INDEX}" ON "{_TABLE}" ("expires_at")
                        WHERE ("deleted_at" IS NULL AND "expires_at" IS NOT NULL)""",
                    reverse_sql=f'DROP INDEX CONCURRENTLY IF EXISTS "{_INDEX}"',
                ),
            ],
        ),
    ]
