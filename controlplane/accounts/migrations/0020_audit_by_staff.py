"""`AuditEvent.by_staff`: an event the platform's staff caused in an organisation, which its members read as done by
"Inferplane staff", with no address and no IP (`serializers.AuditEventSerializer`).

The column comes with its default (no rewrite of the table). The events recorded before are marked in 0021, a
migration of its own: marked here, the table's ACCESS EXCLUSIVE lock, taken to add the column, was held until the
marking's UPDATE committed, and every audited write and every read of an audit log waited behind it.
"""

from django.db import migrations, models


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
    ]
