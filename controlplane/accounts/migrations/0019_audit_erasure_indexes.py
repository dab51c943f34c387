"""Three indexes of the audit log, for an account's deletion (`erasure.erase_records_of`), which reads, under its
organisations' row locks and its own, the events naming its address and those about the account:

- `audit_target_repr_trgm` and `audit_details_trgm`: trigram indexes (PostgreSQL's `pg_trgm`, a contrib extension any
  database owner may create) of the two texts an address is copied into, as `icontains` reads them
  (`UPPER(<column>::text) LIKE '%…%'`);
- `audit_target`: the events about one object (`former_addresses_of`: staff's changes of the account's address).

NOTE: without them each deletion read every event since the account joined, every organisation's (a sequential scan
of the table, twice), while every change of its organisations' members, keys and invitations waited on it. Built
CONCURRENTLY (`controlplane.migration_indexes`), so the audit log is written on meanwhile (every change writes it); the
release before reads none of them. Each step may run again after a migration that was interrupted.
"""

from django.contrib.postgres.indexes import GinIndex, OpClass
from django.db import migrations, models
from django.db.models.functions import Cast, Upper

from controlplane.migration_indexes import built_concurrently

_TABLE = "controlplane_auditevent"
_INDEXES = {
    # name: the index's body after ON <table>
    "audit_target_repr_trgm": 'USING gin ((UPPER(("target_repr")::text)) gin_trgm_ops)',
    "audit_details_trgm": 'USING gin ((UPPER(("details")::text)) gin_trgm_ops)',
    "audit_target": '("target_type", "target_id")',
}


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("controlplane", "0018_audit_stamped_by_database_clock"),
    ]

    operations = [
        # NOTE: kept on the way back: another schema's index may use it
        migrations.RunSQL("CREATE EXTENSION IF NOT EXISTS pg_trgm", reverse_sql=migrations.RunSQL.noop),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="auditevent",
                    index=GinIndex(OpClass(Upper(Cast("target_repr", models.TextField())), name="gin_trgm_ops"),
                                   name="audit_target_repr_trgm"),
                ),
                migrations.AddIndex(
                    model_name="auditevent",
                    index=GinIndex(OpClass(Upper(Cast("details", models.TextField())), name="gin_trgm_ops"),
                                   name="audit_details_trgm"),
                ),
                migrations.AddIndex(
                    model_name="auditevent",
                    index=models.Index(fields=["target_type", "target_id"], name="audit_target"),
                ),
            ],
            database_operations=built_concurrently(_TABLE, _INDEXES),
        ),
    ]
