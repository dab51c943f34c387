"""A key records the key that minted it (`ApiKey.minted_by`), so revoking a key revokes the keys it minted: before,
revoking a leaked key left its holder's children of it working. Keys minted before this are linked from the audit
log, whose `api_key.create` events name the key a call was made with; keys whose event is gone stay unlinked."""

import django.db.models.deletion
from django.db import migrations, models


def link_minted_keys(apps, schema_editor):
    ApiKey = apps.get_model("controlplane", "ApiKey")
    AuditEvent = apps.get_model("controlplane", "AuditEvent")
    created_with_keys = AuditEvent.objects.filter(action="api_key.create", target_type="ApiKey", api_key__isnull=False)
    for target_id, minting_id, organization_id in created_with_keys.values_list(
            "target_id", "api_key_id", "organization_id").iterator():
        if target_id.isdigit() and int(target_id) != minting_id:
            ApiKey.objects.filter(pk=int(target_id), organization_id=organization_id, minted_by__isnull=True).update(
                minted_by_id=minting_id)


class Migration(migrations.Migration):
    dependencies = [
        ("controlplane", "0008_staff_enrolment_code_channels"),
    ]

    operations = [
        migrations.AddField(
            model_name="apikey",
            name="minted_by",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="minted_keys",
                to="controlplane.apikey",
            ),
        ),
        migrations.RunPython(link_minted_keys, migrations.RunPython.noop),
    ]
