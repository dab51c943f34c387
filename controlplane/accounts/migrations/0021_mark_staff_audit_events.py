"""The audit events recorded before `AuditEvent.by_staff` (0020) marked as `services.acts_as_staff` would have: by a
staff account that is not a member of the organisation, and not through an API key (a key acts for a member).

NOTE: judged by staff and membership as they are now: a staff account that has left an organisation it was a member of
has its events there shown as staff's, its address kept from the organisation. An account no longer staff has its
events as staff shown as a member's would be, its address included.
NOTE: a migration of its own, after 0020's column has committed: its UPDATE takes the rows of staff's events alone,
never the table's lock (which 0020 holds only while it adds the column), so the audit log is read and written while it
runs. It may run again (a release that repeats it, as the README's rolling-deploy rules ask of a repair of what the
older code wrote): it marks the same events.
"""

from django.db import migrations

MARK_STAFF_EVENTS = """
UPDATE controlplane_auditevent AS event SET by_staff = true
FROM auth_user AS actor
WHERE event.actor_id = actor.id AND actor.is_staff AND event.organization_id IS NOT NULL AND event.api_key_id IS NULL
  AND NOT event.by_staff
  AND NOT EXISTS (SELECT 1 FROM controlplane_membership AS membership
                  WHERE membership.organization_id = event.organization_id AND membership.user_id = event.actor_id)
"""


class Migration(migrations.Migration):

    dependencies = [
        ("controlplane", "0020_audit_by_staff"),
    ]

    operations = [
        migrations.RunSQL(MARK_STAFF_EVENTS, migrations.RunSQL.noop),
    ]
