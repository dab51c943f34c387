"""Migration 0014 again: what web pods of the code before it still made while it rolled out is revoked now.

0014 revoked, once, the keys and pending invitations their creators' roles may not make. A rolling deploy runs it
first, while pods of the code before it serve for minutes: a demotion or removal on one of those revoked nothing, so
a member demoted (or removed) then kept their `manage`, priority and high-limit keys and their invitations for good,
0014 having run. The same rules (0014's, as they were: a migration never imports code that changes later) applied to
what exists now.

NOTE: this runs while pods of this release serve (a rolling deploy), which change roles, keys and invitations each
under its organisation's row lock (`accounts.models.lock_organizations`). So each organisation is judged in a
transaction of its own that holds its row (FOR NO KEY UPDATE, as they take it), its roles read then: never a role
read before a promotion that a key or invitation made after it is judged by (0014's function reads every role once,
first). Each revocation is conditional on the row being live then (a key not revoked; an invitation neither accepted
nor revoked), and audited only if it was: run twice, or beside a member's own revocation, nothing is revoked or audited
twice. Non-atomic: no organisation's row is held while the next is judged."""

import importlib

from django.db import migrations, transaction
from django.utils import timezone

_0014 = importlib.import_module("controlplane.accounts.migrations.0014_revoke_what_roles_may_not_hold")


def revoke_what_roles_may_not_hold(apps, schema_editor):
    ApiKey = apps.get_model("controlplane", "ApiKey")
    Invitation = apps.get_model("controlplane", "Invitation")
    organization_ids = set(
        ApiKey.objects.filter(revoked_at__isnull=True, created_by__isnull=False).values_list("organization_id", flat=True)
    ) | set(
        Invitation.objects.filter(invited_by__isnull=False, accepted_at__isnull=True, revoked_at__isnull=True)
        .values_list("organization_id", flat=True)
    )
    for organization_id in sorted(organization_ids):
        with transaction.atomic():
            _revoke_in_organization(apps, organization_id)


def _revoke_in_organization(apps, organization_id):
    ApiKey = apps.get_model("controlplane", "ApiKey")
    AuditEvent = apps.get_model("controlplane", "AuditEvent")
    Invitation = apps.get_model("controlplane", "Invitation")
    Membership = apps.get_model("controlplane", "Membership")
    Organization = apps.get_model("controlplane", "Organization")
    # NOTE: `lock_organizations` as it is at this migration: the row held until this organisation's transaction ends.
    list(Organization.objects.select_for_update(no_key=True).filter(pk=organization_id))
    roles = dict(Membership.objects.filter(organization_id=organization_id).values_list("user_id", "role"))
    now = timezone.now()

    def audit(action, target, target_repr, **details):
        AuditEvent.objects.create(organization_id=organization_id, action=action, target_type=type(target).__name__,
                                  target_id=str(target.pk), target_repr=target_repr[:200], details=details,
                                  created_at=now)

    def revoke_key(key, **details):
        if ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=now):
            audit("api_key.revoke", key, f"{key.name} (ip_{key.lookup})", **details)

    live = ApiKey.objects.filter(organization_id=organization_id, revoked_at__isnull=True, created_by__isnull=False)
    for key in live.order_by("pk"):
        role = roles.get(key.created_by_id)
        if _0014._role_may_make_key(role, key):
            continue
        revoke_key(key, reason="beyond its creator's role" if role is not None else "its creator is no longer a member")
        seen, generation = {key.pk}, [key.pk]
        while generation:
            children = list(ApiKey.objects.filter(minted_by_id__in=generation).exclude(pk__in=seen).order_by("pk"))
            for child in children:
                revoke_key(child, reason="minted by a revoked key", minted_by=child.minted_by_id)
            seen.update(child.pk for child in children)
            generation = [child.pk for child in children]

    pending = Invitation.objects.filter(
        organization_id=organization_id, invited_by__isnull=False, accepted_at__isnull=True, revoked_at__isnull=True,
        expires_at__gt=now,
    ).select_related("organization")
    for invitation in pending.order_by("pk"):
        role = roles.get(invitation.invited_by_id)
        if _0014._role_may_invite(role, invitation.role):
            continue
        if Invitation.objects.filter(pk=invitation.pk, accepted_at__isnull=True, revoked_at__isnull=True).update(
                revoked_at=now):
            audit("invitation.revoke", invitation,
                  f"{invitation.email} to {invitation.organization.slug} as {invitation.role}", email=invitation.email,
                  reason="beyond its sender's role" if role is not None else "its sender is no longer a member")


class Migration(migrations.Migration):
    atomic = False  # each organisation in a transaction of its own (above)

    dependencies = [("controlplane", "0015_database_defaults_for_older_code")]

    operations = [
        migrations.RunPython(revoke_what_roles_may_not_hold, migrations.RunPython.noop),
    ]
