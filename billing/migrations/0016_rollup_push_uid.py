"""Usage rollups get `push_uid`, a random value their meter events' `identifier`s are made of instead of the row's id.

Rollups made from now on get one when they are made (the model's default). Rows already there keep it null, and with
it the identifiers made of their id (`rollup-{id}-…`, `stripe_sync.meter_event_identifier`): an event of theirs may
be in Stripe already, sent by a push that failed or a worker that died before its answer, and only the identifier it
was sent with keeps Stripe refusing it a second time. Nothing is written to those rows, so no data migration runs over
the table: the column is added null (no rewrite), and its unique index is built CONCURRENTLY, then taken as the
constraint Django's `unique=True` makes (no lock on writers while it is built). Each step may run again after a
migration that was interrupted.

Django's own AddField would have filled every existing row with one value (a callable default is called once), which
the unique constraint refuses.

NOTE: the invalid index is dropped with a plain DROP INDEX (ACCESS EXCLUSIVE on `billing_usagerollup`), not
CONCURRENTLY as billing/0033 drops its own: run again, this migration's `ADD COLUMN IF NOT EXISTS` just before it takes
that same lock on that same table whether or not the column is there (PostgreSQL locks before it looks: queued behind a
transaction writing rollups, it holds every later rollup read just as long). Dropping it CONCURRENTLY would spare
nothing. The usage table (`billing_usagerecord`) is not touched here.
"""

import uuid

from django.db import migrations, models

_TABLE = "billing_usagerollup"
_CONSTRAINT = "billing_usagerollup_push_uid_key"  # the name PostgreSQL gives a column's inline UNIQUE, as Django's


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("billing", "0015_dispute"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddField(
                    model_name="usagerollup",
                    name="push_uid",
                    field=models.UUIDField(blank=True, default=uuid.uuid4, editable=False, null=True, unique=True),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    f'ALTER TABLE "{_TABLE}" ADD COLUMN IF NOT EXISTS "push_uid" uuid NULL',
                    reverse_sql=f'ALTER TABLE "{_TABLE}" DROP COLUMN IF EXISTS "push_uid"',
                ),
                # NOTE: a build that was interrupted leaves an invalid index, which IF NOT EXISTS would keep.
                migrations.RunSQL(
                    f"""DO $$ BEGIN
                        IF EXISTS (SELECT 1 FROM pg_index WHERE indexrelid = to_regclass('"{_CONSTRAINT}"')
                                   AND NOT indisvalid) THEN
                            DROP INDEX "{_CONSTRAINT}";
                        END IF;
                    END $$""",
                    reverse_sql=migrations.RunSQL.noop,
                ),
                migrations.RunSQL(
                    f'CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS "{_CONSTRAINT}" ON "{_TABLE}" ("push_uid")',
                    reverse_sql=f'DROP INDEX CONCURRENTLY IF EXISTS "{_CONSTRAINT}"',
                ),
                migrations.RunSQL(
                    f"""DO $$ BEGIN
                        IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = '{_CONSTRAINT}'
                                       AND conrelid = '"{_TABLE}"'::regclass) THEN
                            ALTER TABLE "{_TABLE}" ADD CONSTRAINT "{_CONSTRAINT}" UNIQUE USING INDEX "{_CONSTRAINT}";
                        END IF;
                    END $$""",
                    reverse_sql=f'ALTER TABLE "{_TABLE}" DROP CONSTRAINT IF EXISTS "{_CONSTRAINT}"',
                ),
            ],
        ),
    ]
