"""The usage ledger's single-column indexes on `organization_id` and `api_key_id` go: the composite indexes
`usage_org_finished` and `usage_key_finished` lead with the same columns and serve every look-up they served.

The foreign keys stay as they are. Django's own AlterField would drop each constraint and add it again, which
validates every ledger row under a lock that stops usage inserts; here only the indexes are dropped,
CONCURRENTLY (no lock on writers), so a deploy never holds up the gateway's usage rows.
"""

import django.db.models.deletion
from django.db import migrations, models

_INDEXES = {
    "billing_usagerecord_api_key_id_4ed5f4fb": "api_key_id",
    "billing_usagerecord_organization_id_135bd65d": "organization_id",
}


class Migration(migrations.Migration):
    atomic = False  # DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("billing", "0007_stripe_key_generations"),
        ("controlplane", "0006_plan_warm_quota_help"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="usagerecord",
                    name="api_key",
                    field=models.ForeignKey(blank=True, db_index=False, null=True,
                                            on_delete=django.db.models.deletion.SET_NULL, related_name="+",
                                            to="controlplane.apikey"),
                ),
                migrations.AlterField(
                    model_name="usagerecord",
                    name="organization",
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name="+",
                                            to="controlplane.organization"),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"',
                    reverse_sql=f'CREATE INDEX CONCURRENTLY IF NOT EXISTS "{name}" ON "billing_usagerecord" ("{column}")',
                )
                for name, column in _INDEXES.items()
            ],
        ),
    ]
