"""Two partial indexes of the audit log, of organisations' creations (`organization.create`): by organisation (who
created it: `organizations.people_of`) and by actor (what a person created: `organizations.held_by_any`).

NOTE: what one person may have without paying is shared among the organisations they own or ever created, and who
created one is its creation event's actor. Those reads run on a card's first sighting (a Stripe webhook), a billing
mode's change and the shared allowances' beat: by `organization, -created_at` alone each read every event of a large
organisation to find its one creation. Built CONCURRENTLY (`controlplane.migration_indexes`), so the audit log is
written on meanwhile; the release before reads neither. Each step may run again after a migration that was
interrupted.
"""

from django.db import migrations, models

from controlplane.migration_indexes import built_concurrently

_TABLE = "controlplane_auditevent"
_INDEXES = {
    # name: the index's body after ON <table>
    "audit_org_creation_by_org": """("organization_id") WHERE "action" = 'organization.create'""",
    "audit_org_creation_by_actor": """("actor_id") WHERE "action" = 'organization.create'""",
}


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("controlplane", "0023_organization_over_quota_since"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="auditevent",
                    index=models.Index(condition=models.Q(action="organization.create"), fields=["organization"],
                                       name="audit_org_creation_by_org"),
                ),
                migrations.AddIndex(
                    model_name="auditevent",
                    index=models.Index(condition=models.Q(action="organization.create"), fields=["actor"],
                                       name="audit_org_creation_by_actor"),
                ),
            ],
            database_operations=built_concurrently(_TABLE, _INDEXES),
        ),
    ]
