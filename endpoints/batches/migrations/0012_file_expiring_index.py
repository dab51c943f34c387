"""`file_expiring`: the files the expiry sweep deletes (`services.sweep_expired_files`), live files with an `expires_at`.

Built CONCURRENTLY: uploads, batch outputs and deletes write `batches_file` all the time, and 0011's plain CREATE INDEX
took a SHARE lock that held every one of those writes for as long as it scanned the table (and, queued behind a long
transaction, for as long as that lasted too). Each step may run again after a migration that was interrupted (as
billing/0033).
"""

from django.db import migrations, models

_TABLE = "batches_file"
_INDEX = "file_expiring"


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
                migrations.RunSQL(
                    f"""DO $$ BEGIN
                        IF EXISTS (SELECT 1 FROM pg_index WHERE indexrelid = to_regclass('"{_INDEX}"')
                                   AND NOT indisvalid) THEN
                            DROP INDEX "{_INDEX}";
                        END IF;
                    END $$""",
                    reverse_sql=migrations.RunSQL.noop,
                ),
                migrations.RunSQL(
                    f"""CREATE INDEX CONCURRENTLY IF NOT EXISTS "{_INDEX}" ON "{_TABLE}" ("expires_at")
                        WHERE ("deleted_at" IS NULL AND "expires_at" IS NOT NULL)""",
                    reverse_sql=f'DROP INDEX CONCURRENTLY IF EXISTS "{_INDEX}"',
                ),
            ],
        ),
    ]
