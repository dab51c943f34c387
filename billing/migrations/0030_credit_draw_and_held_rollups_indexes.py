"""Two indexes, both built CONCURRENTLY: the ledger takes the gateway's usage rows, and pushes and rollups write the
rollups, all the time, and a plain CREATE INDEX would stop those writes for as long as it builds.

- `usage_org_prepaid_recorded`, the credit draw's (`billing.ledger.undrawn_prepaid_usage`): an organisation's prepaid
  rows by when they reached the ledger, with their cost. Before it, the draw's sum of the organisation's prepaid cost
  was a sequential scan of the whole ledger, every organisation's rows, at every draw.
- `rollup_held`, the rollups held for an operator: the push task counts them every minute for the gauge
  `inferplane_usage_rollups_held` (`billing.held_rollups`), which read every rollup without it.

And the two columns of a held duplicate's "send the difference" (`UsageRollup.difference_started_at`,
`difference_pending`), null, added with no rewrite.

Each step may run again after a run that was interrupted (a pod killed in a rolling deploy), as `billing/0016`'s: the
columns IF NOT EXISTS, an index whose build was interrupted (left INVALID, which IF NOT EXISTS would keep) dropped,
then built IF NOT EXISTS. NOTE: before, with Django's AddIndexConcurrently, every retry after the first index was built
failed on it (DuplicateTable), and the migration never finished.
"""

from django.db import migrations, models

_ROLLUPS = "billing_usagerollup"
_INDEXES = (
    # (name, table, CREATE INDEX's body after ON, the model's index)
    ("usage_org_prepaid_recorded", "billing_usagerecord",
     '("organization_id", "recorded_at") INCLUDE ("cost") WHERE "billing_mode" = \'prepaid\'',
     ("usagerecord", models.Index(condition=models.Q(("billing_mode", "prepaid")), fields=["organization", "recorded_at"],
                                  include=("cost",), name="usage_org_prepaid_recorded"))),
    ("rollup_held", _ROLLUPS, '("push_held_at") WHERE "push_held_at" IS NOT NULL',
     ("usagerollup", models.Index(condition=models.Q(("push_held_at__isnull", False)), fields=["push_held_at"],
                                  name="rollup_held"))),
)
_COLUMNS = (("difference_started_at", "timestamp with time zone", models.DateTimeField(blank=True, null=True)),
            ("difference_pending", "jsonb", models.JSONField(blank=True, null=True)))


def _drop_an_invalid_index(name: str):
    """A RunPython that drops the invalid index `name` an interrupted build left, CONCURRENTLY (outside a transaction:
    this migration is not atomic), as 0033. NOTE: a plain DROP INDEX (in a DO block, which cannot drop CONCURRENTLY)
    took an ACCESS EXCLUSIVE lock on the index's table: queued behind a transaction that writes usage, it held every
    later read and write of a usage row (the gateway's ledger) for the migration's lock timeout (the ALTER TABLE before it locks
    `billing_usagerollup`, not the usage table). Only a database where this migration has not run to its end runs it: one
    that ran it has its indexes valid, and this changes nothing there."""

    def drop(apps, schema_editor) -> None:
        with schema_editor.connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_index WHERE indexrelid = to_regclass(%s) AND NOT indisvalid", [f'"{name}"'])
            if cursor.fetchone() is not None:
                cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')

    return migrations.RunPython(drop, migrations.RunPython.noop)


def _built_concurrently(name: str, table: str, body: str) -> list:
    return [
        _drop_an_invalid_index(name),
        migrations.RunSQL(f'CREATE INDEX CONCURRENTLY IF NOT EXISTS "{name}" ON "{table}" {body}',
                          reverse_sql=f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"'),
    ]


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("billing", "0029_spend_ceiling"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddField(model_name="usagerollup", name=column, field=field)
                              for column, _, field in _COLUMNS],
            database_operations=[
                migrations.RunSQL(f'ALTER TABLE "{_ROLLUPS}" ADD COLUMN IF NOT EXISTS "{column}" {sql_type} NULL',
                                  reverse_sql=f'ALTER TABLE "{_ROLLUPS}" DROP COLUMN IF EXISTS "{column}"')
                for column, sql_type, _ in _COLUMNS],
        ),
        *(migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name=model_name, index=index)],
            database_operations=_built_concurrently(name, table, body),
        ) for name, table, body, (model_name, index) in _INDEXES),
    ]
