"""Invitations are made only in a signed-in session, never with an API key (`members.ensure_in_a_session`): a leaked
key's holder invited an address of their own, and the seat outlived the key's expiry and its revocation. Pending
invitations that a key made (their `invitation.create` event names one) are revoked here, each audited; an admin
sends any still wanted again from the console. Invitations already accepted are left as they are: the audit log
shows which were made with a key."""

from django.db import migrations
from django.utils import timezone


def revoke_invitations_made_with_keys(apps, schema_editor):
    AuditEvent = apps.get_model("controlplane", "AuditEvent")
    Invitation = apps.get_model("controlplane", "Invitation")
    made_with_keys = AuditEvent.objects.filter(action="invitation.create", target_type="Invitation",
                                               api_key__isnull=False).values_list("target_id", flat=True)
    now = timezone.now()
    pending = Invitation.objects.filter(pk__in=[int(pk) for pk in made_with_keys.iterator() if pk.isdigit()],
                                        accepted_at__isnull=True, revoked_at__isnull=True, expires_at__gt=now)
    for invitation in pending.select_related("organization").order_by("pk"):
        Invitation.objects.filter(pk=invitation.pk).update(revoked_at=now)
        AuditEvent.objects.create(
            organization_id=invitation.organization_id, action="invitation.revoke", target_type="Invitation",
            target_id=str(invitation.pk),
            target_repr=f"{invitation.email} to {invitation.organization.slug} as {invitation.role}",
            details={"email": invitation.email, "reason": "made with an API key"}, created_at=now)


class Migration(migrations.Migration):
    dependencies = [
        ("controlplane", "0009_api_key_minted_by"),
    ]

    operations = [
        migrations.RunPython(revoke_invitations_made_with_keys, migrations.RunPython.noop),
    ]
