"""`usage_org_batch`: an organisation's usage rows by the batch they were lines of, batch rows only (`batch_id` not "").
An ended batch's billed but unstored lines are read through it (`endpoints.batches.services._billed_unstored`) with no
clock window: before, the read took the organisation's rows from an hour before the batch started, and missed a
billed line when the worker that started the batch had a clock more than an hour fast.

Built CONCURRENTLY: the ledger takes the gateway's usage rows all the time, and a plain CREATE INDEX would stop those
writes for as long as it builds. Each step may run again after a migration that was interrupted (as 0016).
"""

from django.db import migrations, models

_TABLE = "billing_usagerecord"
_INDEX = "usage_org_batch"


def _drop_an_invalid_index(apps, schema_editor) -> None:
    """The invalid index an interrupted build left, dropped CONCURRENTLY (outside a transaction: this migration is not
    atomic), as batches/0012. NOTE: a plain DROP INDEX (in a DO block, which cannot drop CONCURRENTLY) took an ACCESS
    EXCLUSIVE lock on the usage table: queued behind a transaction that writes usage, it held every later read and
    write of a usage row (the gateway's ledger) for the migration's lock timeout. Only a database where 0033 has not
    run to its end runs this: one that ran it has its index valid, and this changes nothing there."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_index WHERE indexrelid = to_regclass(%s) AND NOT indisvalid", [f'"{_INDEX}"'])
        if cursor.fetchone() is not None:
            cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{_INDEX}"')


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("billing", "0032_grandfather_spend_ceilings"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="usagerecord",
                    index=models.Index(condition=models.Q(("batch_id", ""), _negated=True),
                                       fields=["organization", "batch_id"], name=_INDEX),
                ),
            ],
            database_operations=[
                # NOTE: a build that was interrupted leaves an invalid index, which IF NOT EXISTS would keep.
                migrations.RunPython(_drop_an_invalid_index, migrations.RunPython.noop),
                migrations.RunSQL(
                    f"""CREATE INDEX CONCURRENTLY IF NOT EXISTS "{_INDEX}" ON "{_TABLE}" ("organization_id", "batch_id")
                        WHERE NOT ("batch_id" = '')""",
                    reverse_sql=f'DROP INDEX CONCURRENTLY IF EXISTS "{_INDEX}"',
                ),
            ],
        ),
    ]
