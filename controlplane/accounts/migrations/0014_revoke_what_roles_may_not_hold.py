"""Since the red-team's fixes, a demotion revokes the keys and pending invitations the new role may not make, and a
removal every key and pending invitation of the member (`members.change_member_role`, `members.remove_member`). Those
demoted or removed before kept them: a member with `manage`, priority or high-limit keys, an ex-admin's invitations
refused only while they were away (each good again once they were invited back or promoted). This applies the same
rules once to what exists: each key (and every key it minted) whose creator's role in its organisation may not make
it, or who is no longer a member, and each pending invitation its sender's role may not send, revoked and audited.

NOTE: the rules are copied as they are at this migration (a migration must not import code that changes later):
`keys._ensure_role_may_mint` and `members.may_invite`. Accounts staff deactivated are left as they are (staff may
reactivate them); deleted senders' invitations were handled by migration 0013."""

from django.conf import settings
from django.db import migrations
from django.utils import timezone

INVITING_ROLES = ("owner", "admin")


def _role_may_make_key(role, key) -> bool:
    if role in INVITING_ROLES:
        return True
    if role is None or "manage" in key.scopes or key.max_priority_boost is not None:
        return False
    for value, default in (
        (key.requests_per_minute, settings.DEFAULT_KEY_REQUESTS_PER_MINUTE),
        (key.tokens_per_minute, settings.DEFAULT_KEY_TOKENS_PER_MINUTE),
    ):
        if value is not None and default and value > default:
            return False
    return True


def _role_may_invite(role, invited_role) -> bool:
    return role == "owner" if invited_role == "owner" else role in INVITING_ROLES


def revoke_what_roles_may_not_hold(apps, schema_editor):
    ApiKey = apps.get_model("controlplane", "ApiKey")
    AuditEvent = apps.get_model("controlplane", "AuditEvent")
    Invitation = apps.get_model("controlplane", "Invitation")
    Membership = apps.get_model("controlplane", "Membership")
    roles = {
        (organization_id, user_id): role
        for organization_id, user_id, role in Membership.objects.values_list(
            "organization_id", "user_id", "role"
        )
    }
    now = timezone.now()

    def audit(organization_id, action, target, target_repr, **details):
        AuditEvent.objects.create(
            organization_id=organization_id,
            action=action,
            target_type=type(target).__name__,
            target_id=str(target.pk),
            target_repr=target_repr[:200],
            details=details,
            created_at=now,
        )

    def revoke_key(key, **details):
        if ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=now):
            audit(key.organization_id, "api_key.revoke", key, f"{key.name} (ip_{key.lookup})", **details)

    live = ApiKey.objects.filter(revoked_at__isnull=True, created_by__isnull=False).order_by("pk")
    for key in live.iterator():
        role = roles.get((key.organization_id, key.created_by_id))
        if _role_may_make_key(role, key):
            continue
        reason = "beyond its creator's role" if role is not None else "its creator is no longer a member"
        revoke_key(key, reason=reason)
        seen, generation = {key.pk}, [key.pk]
        while generation:
            children = list(
                ApiKey.objects.filter(minted_by_id__in=generation).exclude(pk__in=seen).order_by("pk")
            )
            for child in children:
                revoke_key(child, reason="minted by a revoked key", minted_by=child.minted_by_id)
            seen.update(child.pk for child in children)
            generation = [child.pk for child in children]

    pending = (
        Invitation.objects.filter(
            invited_by__isnull=False, accepted_at__isnull=True, revoked_at__isnull=True, expires_at__gt=now
        )
        .select_related("organization")
        .order_by("pk")
    )
    for invitation in pending:
        role = roles.get((invitation.organization_id, invitation.invited_by_id))
        if _role_may_invite(role, invitation.role):
            continue
        Invitation.objects.filter(pk=invitation.pk).update(revoked_at=now)
        audit(
            invitation.organization_id,
            "invitation.revoke",
            invitation,
            f"{invitation.email} to {invitation.organization.slug} as {invitation.role}",
            email=invitation.email,
            reason="beyond its sender's role" if role is not None else "its sender is no longer a member",
        )


class Migration(migrations.Migration):
    dependencies = [("controlplane", "0013_invitation_from_platform")]

    operations = [
        migrations.RunPython(revoke_what_roles_may_not_hold, migrations.RunPython.noop),
    ]
