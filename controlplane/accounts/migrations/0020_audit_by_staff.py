"""`AuditEvent.by_staff`: an event the platform's staff caused in an organisation, which its members read as done by
"Inferplane staff", with no address and no IP (`serializers.AuditEventSerializer`).

The events recorded before are marked as `services.acts_as_staff` would have: by a staff account that is not a member
of the organisation, and not through an API key (a key acts for a member). NOTE: judged by staff and membership as they
are now: a staff account that has left an organisation it was a member of has its events there shown as staff's, its
address kept from the organisation (never the reverse). The column comes with its default (no rewrite of the table);
the update reads only staff accounts' events.
"""

from django.db import migrations, models

MARK_STAFF_EVENTS = """
UPDATE controlplane_auditevent AS event SET by_staff = true
FROM auth_user AS actor
WHERE event.actor_id = actor.id AND actor.is_staff AND event.organization_id IS NOT NULL AND event.api_key_id IS NULL
  AND NOT EXISTS (SELECT 1 FROM controlplane_membership AS membership
                  WHERE membership.organization_id = event.organization_id AND membership.user_id = event.actor_id)
"""


class Migration(migrations.Migration):

    dependencies = [
        ("controlplane", "0019_audit_erasure_indexes"),
    ]

    operations = [
        migrations.AddField(
            model_name="auditevent",
            name="by_staff",
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.RunSQL(MARK_STAFF_EVENTS, migrations.RunSQL.noop),
    ]
