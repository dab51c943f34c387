"""The credit draw's two figures and its index for overcharges (`billing.ledger.undrawn_prepaid_usage`,
`billing.models.credit_draw`):

- `BillingAccount.credit_given_back`: the prepaid ledger's overcharges (cheaper supersedes) given back so far, null
  until the account's next draw sets it (the draws before it netted them: nothing to fill in).
- `BillingAccount.credit_unpaid`: usage drawn as nothing not offset yet by an overcharge; 0 (what earlier draws drew as
  nothing was not kept).
- `usage_org_prepaid_overcharged`: the organisation's prepaid rows superseded by a cheaper one, with `cost` and
  `lost_cost`, for the draw's sum of overcharges from the index alone; built CONCURRENTLY (the ledger takes the
  gateway's rows all the time), as `billing/0030`: an interrupted build (left INVALID) is dropped, then built IF NOT
  EXISTS; the columns IF NOT EXISTS, so a run after an interrupted one finishes.
"""

from django.db import migrations, models

_ACCOUNTS = "billing_billingaccount"
_INDEX = "usage_org_prepaid_overcharged"


def _drop_an_invalid_index(name: str):
    """A RunPython that drops the invalid index `name` an interrupted build left, CONCURRENTLY (outside a transaction:
    this migration is not atomic), as 0033. NOTE: a plain DROP INDEX (in a DO block, which cannot drop CONCURRENTLY)
    took an ACCESS EXCLUSIVE lock on the index's table: queued behind a transaction that writes usage, it held every
    later read and write of a usage row (the gateway's ledger) for the migration's lock timeout (the ALTER TABLEs before it lock
    `billing_billingaccount`, not the usage table). Only a database where this migration has not run to its end runs it: one
    that ran it has its indexes valid, and this changes nothing there."""

    def drop(apps, schema_editor) -> None:
        with schema_editor.connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_index WHERE indexrelid = to_regclass(%s) AND NOT indisvalid", [f'"{name}"'])
            if cursor.fetchone() is not None:
                cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')

    return migrations.RunPython(drop, migrations.RunPython.noop)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("billing", "0036_signed_rollup_adjustments"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddField(model_name="billingaccount", name="credit_given_back",
                                    field=models.DecimalField(blank=True, decimal_places=9, max_digits=20, null=True)),
                migrations.AddField(model_name="billingaccount", name="credit_unpaid",
                                    field=models.DecimalField(db_default=0, decimal_places=9, default=0, max_digits=20)),
            ],
            database_operations=[
                migrations.RunSQL(f'ALTER TABLE "{_ACCOUNTS}" ADD COLUMN IF NOT EXISTS "credit_given_back" numeric(20, 9) NULL',
                                  reverse_sql=f'ALTER TABLE "{_ACCOUNTS}" DROP COLUMN IF EXISTS "credit_given_back"'),
                migrations.RunSQL(f'ALTER TABLE "{_ACCOUNTS}" ADD COLUMN IF NOT EXISTS "credit_unpaid" numeric(20, 9) '
                                  "DEFAULT 0 NOT NULL",
                                  reverse_sql=f'ALTER TABLE "{_ACCOUNTS}" DROP COLUMN IF EXISTS "credit_unpaid"'),
            ],
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="usagerecord", index=models.Index(
                condition=models.Q(("billing_mode", "prepaid"), ("lost_cost__gt", models.F("cost")),
                                   ("lost_recorded_at__isnull", False)),
                fields=["organization"], include=("cost", "lost_cost"), name=_INDEX))],
            database_operations=[
                _drop_an_invalid_index(_INDEX),
                migrations.RunSQL(
                    f'CREATE INDEX CONCURRENTLY IF NOT EXISTS "{_INDEX}" ON "billing_usagerecord" ("organization_id") '
                    "INCLUDE (\"cost\", \"lost_cost\") WHERE (\"billing_mode\" = 'prepaid' AND \"lost_cost\" > \"cost\" "
                    'AND "lost_recorded_at" IS NOT NULL)',
                    reverse_sql=f'DROP INDEX CONCURRENTLY IF EXISTS "{_INDEX}"'),
            ],
        ),
    ]
