"""Invitations the platform makes (no acting user) are marked `from_platform`; a null `invited_by` alone now means a
deleted sender, whose invitation grants nothing (`invitations.invitation_refusal`). Before, a null sender read as the
platform's own invitation, granted whatever its role, owner included.

NOTE: no existing row is provably the platform's: no command or page invites without a signed-in user (only code run
by hand in a shell did), and a deleted sender's `invitation.create` event lost its actor too (SET_NULL). So no row is
marked here, and every invitation still pending with a null sender is revoked, each audited (reason "sender
deleted"); an admin sends any still wanted again. Accepted ones are left as they are.

The column has a database default (false): during a rolling deploy the web pods still on the code before insert
invitations without it, which a NOT NULL column without a default refused (a 500 for every invite)."""

from django.db import migrations, models
from django.utils import timezone


def revoke_pending_invitations_of_deleted_senders(apps, schema_editor):
    AuditEvent = apps.get_model("controlplane", "AuditEvent")
    Invitation = apps.get_model("controlplane", "Invitation")
    now = timezone.now()
    pending = Invitation.objects.filter(
        invited_by__isnull=True,
        from_platform=False,
        accepted_at__isnull=True,
        revoked_at__isnull=True,
        expires_at__gt=now,
    )
    for invitation in pending.select_related("organization").order_by("pk"):
        Invitation.objects.filter(pk=invitation.pk).update(revoked_at=now)
        AuditEvent.objects.create(
            organization_id=invitation.organization_id,
            action="invitation.revoke",
            target_type="Invitation",
            target_id=str(invitation.pk),
            target_repr=f"{invitation.email} to {invitation.organization.slug} as {invitation.role}",
            details={"email": invitation.email, "reason": "sender deleted"},
            created_at=now,
        )


class Migration(migrations.Migration):
    dependencies = [
        ("controlplane", "0012_confirm_email_verifications_operators_made"),
    ]

    operations = [
        migrations.AddField(
            model_name="invitation",
            name="from_platform",
            field=models.BooleanField(default=False, db_default=False),
        ),
        migrations.RunPython(revoke_pending_invitations_of_deleted_senders, migrations.RunPython.noop),
    ]
