"""Members of an organisation and their roles: who may do what (`actor_role`, `NotPermitted`, defined in
`services` and named here as before), the owner role's guard, the rule that only a signed-in person changes
who belongs (`ensure_in_a_session`), and adding, re-roling and removing members, always leaving an owner; a
removed member's keys and pending invitations are revoked with their membership (also when the platform removes one:
`remove_member_for_security`), and a demoted member's that their new role may not make."""

from __future__ import annotations

from django.db import transaction
from django.http import Http404
from django.utils import timezone

from controlplane.accounts import keys
from controlplane.accounts.models import (
    ROLE_RANK,
    Invitation,
    Membership,
    Organization,
    Role,
    lock_organizations,
)
from controlplane.accounts.services import Actor, NotPermitted, actor_role, record_audit


class LastOwnerError(ValueError):
    pass


class SessionRequired(NotPermitted):
    """Asked with an API key: members, roles and invitations change only in a signed-in session."""


def ensure_in_a_session(actor: Actor, field: str) -> None:
    """NOTE: who belongs to an organisation, and as what, changes only in a signed-in session (the console, or
    `/api/v1` with its session), never with an API key. A key is bounded (its expiry, scopes, limits, spend cap,
    its revocation) and a seat is not: a leaked key that expired, was capped or was revoked within the hour had
    invited an address its holder controlled, as admin or owner, and that person then held the organisation for
    good, and could remove its owners (a review's finding)."""
    if actor.api_key is not None:
        raise SessionRequired(field, "Members, roles and invitations change only when signed in, never with an API "
                                     "key: invite, change roles and remove members from the console.")


def ensure_admin(actor: Actor, organization: Organization, field: str, doing: str) -> None:
    """`NotPermitted` unless the acting user is an owner or admin of `organization` (the system always is).

    NOTE: read again under the organisation's row lock where a change of who belongs takes it (`_lock_membership`,
    `invitations.invite_member`): the views' own check comes before it, and an admin demoted or removed meanwhile (an
    owner acting on a hostile admin) then still promoted their second account, removed a colleague or invited
    someone once the demotion committed (a review's finding)."""
    if actor.user is None:
        return
    role = actor_role(actor, organization)
    if role is None or ROLE_RANK[Role(role)] < ROLE_RANK[Role.ADMIN]:
        raise NotPermitted(field, f"Only owners and admins may {doing}.")


def ensure_may_touch_owner_role(actor: Actor, organization: Organization, *roles: str) -> None:
    """NOTE: only owners grant, take away or remove the owner role."""
    if Role.OWNER not in roles:
        return
    role = actor_role(actor, organization)
    if actor.user is not None and role != Role.OWNER:
        raise NotPermitted("role", "Only owners may grant, take away or remove the owner role.")


@transaction.atomic
def add_member(actor: Actor, organization: Organization, *, user, role: str) -> Membership:
    ensure_in_a_session(actor, "role")
    existing = Membership.objects.filter(organization=organization, user=user).values_list("role", flat=True).first()
    ensure_may_touch_owner_role(actor, organization, role, existing or "")
    membership, created = Membership.objects.get_or_create(organization=organization, user=user, defaults={"role": role})
    if not created and membership.role != role:
        membership.role = role
        membership.save(update_fields=["role"])
    record_audit(actor, organization, "member.add" if created else "member.change_role", membership, role=role)
    if not created:
        _revoke_what_the_role_may_not_hold(actor, membership)
    return membership


@transaction.atomic
def change_member_role(actor: Actor, membership: Membership, *, role: str) -> Membership:
    ensure_in_a_session(actor, "role")
    membership = _lock_membership(membership)
    ensure_admin(actor, membership.organization, "role", "change members' roles")
    ensure_may_touch_owner_role(actor, membership.organization, role, membership.role)
    _ensure_an_owner_remains(membership, leaving=role != Role.OWNER)
    membership.role = role
    membership.save(update_fields=["role"])
    record_audit(actor, membership.organization, "member.change_role", membership, role=role)
    _revoke_what_the_role_may_not_hold(actor, membership)
    return membership


def _revoke_what_the_role_may_not_hold(actor: Actor, membership: Membership) -> None:
    """The member's keys and pending invitations that their role (just saved) may not make, revoked.

    NOTE: after the role is saved, with the organisation's row held (`_lock_membership`): a key being created meanwhile
    queues on the same row (`keys.create_api_key`), so either it committed first and is listed here, or it waits and
    then sees the new role."""
    keys.revoke_api_keys_beyond_role(actor, membership.user, organization=membership.organization,
                                     role=membership.role, reason="member.change_role")
    revoke_invitations_sent_by(actor, membership.user, organization=membership.organization, role=membership.role,
                               reason="member.change_role")


@transaction.atomic
def remove_member(actor: Actor, membership: Membership) -> None:
    """Ends the membership and revokes, audited, every key the member created in the organisation (and the keys
    those minted): a key acts with its creator's role, so without this the keys came back with a new invitation."""
    ensure_in_a_session(actor, "role")
    membership = _lock_membership(membership)
    ensure_admin(actor, membership.organization, "role", "remove members")
    ensure_may_touch_owner_role(actor, membership.organization, membership.role)
    _ensure_an_owner_remains(membership, leaving=True)
    _end(actor, membership, reason="member.remove")


@transaction.atomic
def leave_organization(actor: Actor, membership: Membership, *, reason: str) -> None:
    """The member's own departure (their account deleted: `endpoints.closing.delete_account`): their membership ends as
    `remove_member` ends one, their keys and pending invitations revoked with it. `LastOwnerError` where they are the
    last owner of an organisation that is still open; a closed one needs none."""
    membership = _lock_membership(membership)
    if membership.organization.closed_at is None:
        _ensure_an_owner_remains(membership, leaving=True)
    _end(actor, membership, reason=reason)


def remove_member_for_security(actor: Actor, membership: Membership, *, reason: str) -> bool:
    """Ends a membership the platform's own rule found was granted by someone who had no right to grant it (a
    forgotten password's reset of an address its owner never confirmed: `invitations.remove_members_invited_by`),
    whatever the actor's role, as `remove_member` does; False, and nothing changed, where it would leave the
    organisation with no owner."""
    membership = _lock_membership(membership)
    try:
        _ensure_an_owner_remains(membership, leaving=True)
    except LastOwnerError:
        return False
    _end(actor, membership, reason=reason)
    return True


def _end(actor: Actor, membership: Membership, *, reason: str) -> None:
    details = {"email": membership.user.email}
    if reason != "member.remove":
        details["reason"] = reason
    record_audit(actor, membership.organization, "member.remove", membership, **details)
    keys.revoke_api_keys_of(actor, membership.user, organization=membership.organization, reason=reason)
    revoke_invitations_sent_by(actor, membership.user, organization=membership.organization, reason=reason)
    membership.delete()


def may_invite(role: str | None, invited_role: str) -> bool:
    """Whether a member with `role` may invite someone as `invited_role`: owners and admins invite, only owners
    invite owners (`ensure_may_touch_owner_role`)."""
    needed = Role.OWNER if invited_role == Role.OWNER else Role.ADMIN
    return role is not None and ROLE_RANK[Role(role)] >= ROLE_RANK[needed]


@transaction.atomic
def revoke_invitations_sent_by(actor: Actor, user, *, reason: str, organization: Organization | None = None,
                               role: str | None = None) -> int:
    """Revokes the pending invitations `user` sent (in `organization`, or in every organisation), those a member
    with `role` may not send where it is given (`may_invite`), each audited with `reason`; the number revoked.

    NOTE: called where a seat ends or shrinks (`remove_member`, `change_member_role`), and by a forgotten password's
    reset of an address its owner never confirmed (`signup.secure_after_password_reset`: the invitations a
    stranger's session sent, to a second address of theirs, must end with it). An invitation is refused while its
    sender may not grant it (`invitations.invitation_refusal`), but was not ended: listed as pending, it was good
    again once the sender was invited back or promoted again (a review's finding)."""
    pending = Invitation.objects.pending().filter(invited_by=user)
    if organization is not None:
        pending = pending.filter(organization=organization)
    return revoke_pending_invitations(actor, pending, reason=reason,
                           keep=lambda invitation: role is not None and may_invite(role, invitation.role))


@transaction.atomic
def revoke_invitations_to(actor: Actor, address: str, *, reason: str) -> int:
    """Revokes every pending invitation to `address` (case-insensitive), in every organisation, each audited with
    `reason`; the number revoked.

    NOTE: called as an account is deleted (`erasure.erase_person`): an invitation left pending to the address of a
    person who has gone was accepted by whoever signed up with that address next, and granted its role (owner
    included) in an organisation that had invited someone else."""
    return revoke_pending_invitations(actor, Invitation.objects.pending().filter(email__iexact=address), reason=reason)


def revoke_pending_invitations(actor: Actor, pending, *, reason: str, keep=None) -> int:
    """Revokes the invitations of `pending` (but those `keep` says to keep), each audited with `reason`."""
    pending = pending.select_related("organization").order_by("pk")
    # NOTE: each organisation's row first (in one order), as accepting or revoking an invitation does: see
    # `invitations.revoke_invitation`.
    lock_organizations(pending.values("organization_id"))
    num_revoked, now = 0, timezone.now()
    for invitation in pending:
        if keep is not None and keep(invitation):
            continue
        if Invitation.objects.filter(pk=invitation.pk, accepted_at__isnull=True, revoked_at__isnull=True).update(
                revoked_at=now):
            num_revoked += 1
            record_audit(actor, invitation.organization, "invitation.revoke", invitation, email=invitation.email,
                         reason=reason)
    return num_revoked


def _lock_membership(membership: Membership) -> Membership:
    """The membership as it is now, with its organisation's row locked until the transaction ends; Http404 (a 404 on
    `/api/` and in the console, as for an unknown id) where it ended since the caller read it.

    NOTE: every change of roles in one organisation queues on its row, so the checks that
    follow (the actor is an owner, another owner remains) read what earlier changes committed:
    two owners demoting each other at once cannot both succeed. NO KEY UPDATE, as every lock of that row in
    accounts: they still queue on each other, and rows that only reference the organisation (a usage row's
    foreign-key check, FOR KEY SHARE) do not wait for a demotion's walk of its keys. A role change or a removal that
    lost the race to the member's removal by another admin read it again with `.get`: DoesNotExist, a 500.
    """
    lock_organizations([membership.organization_id])
    locked = Membership.objects.select_related("organization", "user").filter(pk=membership.pk).first()
    if locked is None:
        raise Http404("No such member.")
    return locked


def _ensure_an_owner_remains(membership: Membership, *, leaving: bool) -> None:
    if not leaving or membership.role != Role.OWNER:
        return
    if not Membership.objects.filter(organization=membership.organization_id).owners_besides(membership.user).exists():
        raise LastOwnerError("An organisation needs at least one owner who can sign in (a deactivated account's "
                             "owner role does not count): make another active member an owner first.")
