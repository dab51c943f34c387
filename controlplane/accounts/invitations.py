"""Invitations to join an organisation: inviting by email (the signed link mailed), revoking, and
accepting, which only the verified owner of the invited address may do."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core import signing
from django.core.mail import EmailMessage
from django.db import transaction
from django.db.models import Q
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts import throttle
from controlplane.accounts.backends import normalize_email, same_address
from controlplane.accounts.mail_sender import send_later
from controlplane.accounts.members import (
    NotPermitted,
    ensure_admin,
    ensure_in_a_session,
    ensure_may_touch_owner_role,
    may_invite,
    remove_member_for_security,
    revoke_pending_invitations,
)
from controlplane.accounts.models import (
    Invitation,
    Membership,
    Organization,
    Role,
    email_is_verified,
    lock_organizations,
    lock_person,
)
from controlplane.accounts.services import Actor, ensure_open, record_audit
from controlplane.text import one_line, shown_name

INVITATION_SALT = "inferplane.invitation"
INVITATION_TTL = timedelta(days=7)


class InvitationRefused(ValueError):
    """The invitation cannot be accepted by this user now; the message says why, to that user."""


class AlreadyInvited(ValueError):
    """The invitation is not sent: its address is already a member's, or has one pending; `field` names the input.
    Not a refusal of the actor's role (`NotPermitted`, a 403 on the API): the same invitation by anyone is refused."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class InvitationNotMailed(RuntimeError):
    """The invitation's mail was not taken (`mail_sender.send_later`: the senders' backlog full), so it was withdrawn:
    nothing was sent and nothing is pending; try again in `retry_after_s`."""

    retry_after_s = 60

    def __init__(self):
        super().__init__("We could not email the invitation just now (too many mails are waiting to be sent): nothing "
                         "was sent and nothing is pending. Try again in a minute.")


class TooManyInvitations(NotPermitted):
    """Past `throttle.INVITATIONS` (invitations revoked count too): try again in `retry_after_s`."""

    def __init__(self, retry_after_s: int):
        super().__init__("email", f"Too many invitations; try again in {max(1, retry_after_s // 60)} minutes.")
        self.retry_after_s = retry_after_s


def invitation_token(invitation: Invitation) -> str:
    return signing.TimestampSigner(salt=INVITATION_SALT).sign(str(invitation.pk))


def invitation_link(invitation: Invitation) -> str:
    return settings.PUBLIC_URL + reverse("invitation", args=[invitation_token(invitation)])


def find_invitation(token: str) -> Invitation | None:
    """The invitation a signed link names (whatever its state), or None for a forged or stale link."""
    try:
        pk = signing.TimestampSigner(salt=INVITATION_SALT).unsign(token, max_age=INVITATION_TTL)
    except signing.BadSignature:
        return None
    return Invitation.objects.select_related("organization", "invited_by").filter(pk=pk).first() if pk.isdigit() else None


def _ensure_admin(actor: Actor, organization: Organization, field: str) -> None:
    ensure_admin(actor, organization, field, "invite members or revoke invitations")


def invite_member(actor: Actor, organization: Organization, *, email: str, role: str) -> Invitation:
    """A pending invitation, audited, and its signed link mailed to `email`.

    NOTE: nobody joins by being named: whoever accepts must be signed in as a verified
    user with this email, so registering an address first gains nothing. And nobody is invited with an API key
    (`members.ensure_in_a_session`): a seat would outlive the key's bounds and its revocation.

    Raises `NotPermitted` where the actor's role does not allow it, `AlreadyInvited` where the address is a member's
    or has one pending, `TooManyInvitations` past the throttle, `InvitationNotMailed` where its mail could not be
    handed to the senders (the invitation withdrawn); a `ValidationError` where the address is too long once
    normalised (`backends.normalize_email`: forms and serializers take it from there first).
    """
    email = normalize_email(email)
    ensure_in_a_session(actor, "email")
    _ensure_admin(actor, organization, "email")
    ensure_may_touch_owner_role(actor, organization, role)
    # NOTE: or by its username: an account's address stored before `normalize_email` folded NFKC (`ada@\uff45xample
    # .test`) has its username folded (Django's `normalize_username`), and the address typed is folded now
    if Membership.objects.filter(Q(user__email__iexact=email) | Q(user__username__iexact=email),
                                 organization=organization).exists():
        raise AlreadyInvited("email", "This person is already a member; change their role in the table.")
    if Invitation.objects.for_org(organization).pending().filter(email__iexact=email).exists():
        raise AlreadyInvited("email", "An invitation to this email is pending; revoke it to send a new one.")
    with transaction.atomic():
        # NOTE: the account at the address first, as its deletion holds it to its commit (`models.lock_person`): an
        # invitation sent while the account was being deleted committed after the deletion revoked those pending to the
        # address, and stayed pending for whoever held the address next. Now either it commits first, and the deletion
        # revokes it, or it waits, and is sent once the address belongs to nobody.
        for user_id in sorted(get_user_model().objects.filter(Q(email__iexact=email) | Q(username__iexact=email))
                              .values_list("pk", flat=True)):
            lock_person(user_id)
        # NOTE: the organisation's row lock makes "one pending invitation per email" hold under races.
        lock_organizations([organization.pk])
        ensure_open(organization.pk, "email")
        # NOTE: and the sender's role is read again under it, as removing or re-roling a member takes it
        # (`members._lock_membership`): one removed after the check above, whose removal revoked their pending
        # invitations before this one was written, left a pending invitation of a non-member.
        _ensure_admin(actor, organization, "email")
        ensure_may_touch_owner_role(actor, organization, role)
        if Invitation.objects.for_org(organization).pending().filter(email__iexact=email).exists():
            raise AlreadyInvited("email", "An invitation to this email is pending; revoke it to send a new one.")
        # NOTE: counted only here, past every refusal, under the lock: a refusal sends nothing, and counted it spent the
        # address's budget, shared by every organisation. One invitation and two refused repeats from a throwaway
        # organisation kept every other from inviting that address for the day (the tenancy review); counted before
        # the lock, repeats sent at once all passed the check above, all counted, and all but one were refused here.
        retry_after_s = throttle.take(throttle.INVITATIONS, {
            "organization": str(organization.pk), "email": email, "user": str(actor.user.pk) if actor.user else "",
            "ip": actor.source_ip or "",
        }).retry_after_s
        if retry_after_s is not None:
            raise TooManyInvitations(retry_after_s)
        # NOTE: its TTL (days) stamped and judged (`refusal`) by web pods' own clocks: moved by a pod's skew, minutes
        # at worst in days, as a web process's skew past 2 s is an ERROR and on `/metrics` (`controlplane.clock.record_offset`)
        invitation = Invitation.objects.create(organization=organization, email=email, role=role, invited_by=actor.user,
                                               from_platform=actor.user is None,
                                               expires_at=timezone.now() + INVITATION_TTL)
        record_audit(actor, organization, "invitation.create", invitation, email=email, role=role)
    # NOTE: the name on one line in the body too: one with line breaks wrote lines of its own, in the mail's voice.
    organization_name = one_line(organization.name)
    body = render_to_string("controlplane/invitation_email.txt", {
        "invitation": invitation, "link": invitation_link(invitation), "inviter": actor.user,
        "organization_name": organization_name,
    })
    # NOTE: off the request (`mail_sender.send_later`): sent within it, a relay refusing the address (or down) answered
    # with a 500 an invitation already made and audited, and a second try was refused as pending.
    taken = send_later(EmailMessage(f"You are invited to {organization_name} on Inferplane", body, None, [email]),
                       what="an invitation's email")
    if not taken:
        # NOTE: withdrawn, not left pending: dropped by the full backlog, it was said to be emailed and stayed pending,
        # and the inviter's second try was refused as pending for a link nobody got. Its try stays counted
        # (`throttle.INVITATIONS`): a full backlog is no way around the address's budget.
        with transaction.atomic():
            revoke_pending_invitations(actor, Invitation.objects.filter(pk=invitation.pk), reason="mail.dropped")
        raise InvitationNotMailed()
    return invitation


def revoke_invitation(actor: Actor, invitation: Invitation) -> Invitation:
    _ensure_admin(actor, invitation.organization, "invitation")
    ensure_may_touch_owner_role(actor, invitation.organization, invitation.role)
    with transaction.atomic():
        # NOTE: the organisation's row first, as removing or demoting the sender does before revoking their pending
        # invitations: with the invitation's row alone, each waited on the other (this commit's foreign keys take the
        # organisation's row) and PostgreSQL failed one.
        lock_organizations([invitation.organization_id])
        # NOTE: again, under it (`members.ensure_admin`), the owner role's guard too: an owner demoted to admin while
        # their revocation of an owner's invitation waited on the row revoked it once the demotion committed.
        _ensure_admin(actor, invitation.organization, "invitation")
        ensure_may_touch_owner_role(actor, invitation.organization, invitation.role)
        revoked = Invitation.objects.filter(pk=invitation.pk, accepted_at__isnull=True, revoked_at__isnull=True).update(
            revoked_at=timezone.now())
        if revoked:
            record_audit(actor, invitation.organization, "invitation.revoke", invitation, email=invitation.email)
    invitation.refresh_from_db()
    return invitation


def remove_members_invited_by(actor: Actor, user, *, reason: str) -> int:
    """Removes, in each organisation where `user` is still an owner or admin, the members who joined through an
    invitation `user` sent, and those who joined through theirs (and so on), each audited with `reason` and their
    keys revoked; the number removed. A member who also accepted an invitation from someone else in that
    organisation (or one the platform made) stays, as does one whose removal would leave no owner.

    NOTE: a forgotten password's reset of an address its owner never confirmed (`signup.secure_after_password_reset`)
    ends a stranger's session, keys and pending invitations; an invitation that session sent to a second address of
    the stranger's and that was already accepted had left the stranger a seat (perhaps an owner's) in the
    organisation the owner took back (a review's finding). Whoever that seat invited in turn is the stranger's too."""
    num_removed = 0
    # NOTE: only where the account still holds a seat that invites (the organisation its owner takes back): where it
    # was removed or demoted since, the organisation's other admins kept its invitees, and a reset (perhaps by an
    # ex-admin who never confirmed their address) must not remove them (found by this stop's review).
    still_inviting = Membership.objects.filter(user=user, role__in=[Role.OWNER, Role.ADMIN]).values("organization_id")
    suspects = [(organization_id, user.pk) for organization_id in
                Invitation.objects.filter(invited_by=user, accepted_by__isnull=False,
                                          organization_id__in=still_inviting)
                .values_list("organization_id", flat=True).distinct()]
    seen = set(suspects)
    while suspects:
        organization_id, inviter_id = suspects.pop()
        let_in_by_suspects = {inviter for (org, inviter) in seen if org == organization_id}
        accepted = (Invitation.objects.filter(organization_id=organization_id, invited_by_id=inviter_id,
                                              accepted_by__isnull=False)
                    .exclude(accepted_by=user).order_by("pk").values_list("accepted_by_id", flat=True))
        for member_id in accepted:
            if (organization_id, member_id) in seen:
                continue
            vouched_for = (Invitation.objects.filter(organization_id=organization_id, accepted_by_id=member_id)
                           .exclude(invited_by_id__in=let_in_by_suspects).exists())
            membership = Membership.objects.filter(organization_id=organization_id, user_id=member_id).first()
            if vouched_for or membership is None:
                continue
            if remove_member_for_security(actor, membership, reason=reason):
                num_removed += 1
                seen.add((organization_id, member_id))
                suspects.append((organization_id, member_id))
    return num_removed


def invitation_refusal(invitation: Invitation, user) -> str | None:
    """Why `user` may not accept `invitation` now, in words for that user; None if they may (or did)."""
    if user is None or not email_is_verified(user):
        return "Verify your email address before accepting an invitation."
    if not same_address(invitation.email, user.email):
        return (f"This invitation was sent to another email address than yours ({shown_name(user.email)}). "
                "Log in with the address it was sent to.")
    if invitation.accepted_at is not None:
        if invitation.accepted_by_id != user.pk:
            return "This invitation has already been used."
        # NOTE: a used link never brings back a member removed since: that takes a new invitation.
        if not Membership.objects.filter(organization_id=invitation.organization_id, user=user).exists():
            return ("You were removed from this organisation after accepting this invitation; "
                    "ask an admin of the organisation for a new invitation.")
        return None
    if invitation.revoked_at is not None:
        return "This invitation was revoked. Ask an admin of the organisation for a new one."
    if invitation.expires_at <= timezone.now():
        return "This invitation has expired. Ask an admin of the organisation for a new one."
    if not _inviter_may_still_grant(invitation):
        return ("The person who sent this invitation may no longer invite to this role. "
                "Ask an admin of the organisation for a new one.")
    return None


def _inviter_may_still_grant(invitation: Invitation) -> bool:
    """An invitation is worth what its sender may grant now: one sent by an admin who was since removed
    or demoted (perhaps to a second address of their own) grants nothing.

    NOTE: the platform's own invitations are marked (`from_platform`); a null sender is a deleted one (SET_NULL)
    and grants nothing. Before, a null sender read as the platform: a sender deleted outside the Django admin (the
    shell, a cascade), or one who sent an invitation while the admin's delete ran, left invitations that granted
    their role, owner included (a review's finding)."""
    if invitation.from_platform:
        return True
    if invitation.invited_by_id is None:
        return False
    role = Membership.objects.filter(organization_id=invitation.organization_id, user_id=invitation.invited_by_id,
                                     user__is_active=True).values_list("role", flat=True).first()
    return may_invite(role, invitation.role)


def accept_invitation(actor: Actor, invitation: Invitation) -> Membership:
    """The invitee's membership, created once: accepting twice (or twice at once) is one membership."""
    user = actor.user
    with transaction.atomic():
        # NOTE: the account's row before all, as its deletion holds it (`models.lock_person`), and read again: one
        # accepted while the account was being deleted left a tombstoned, inactive member (an owner, perhaps).
        if user is not None:
            user = lock_person(user.pk)
            if user is None or not user.is_active:
                raise InvitationRefused("This account was deleted or deactivated; it accepts no invitation.")
        # NOTE: the organisation's row first, then the invitation's, as a removal, a role change or a revocation does
        # (they lock the organisation, then revoke the invitation). Locking both in one query took them in table order,
        # the invitation's first: each waited on the other and PostgreSQL failed one (a 500; a review's finding).
        # The organisation of an invitation never changes, so it is read unlocked.
        lock_organizations([invitation.organization_id])
        invitation = (Invitation.objects.select_for_update(of=("self",)).select_related("organization")
                      .get(pk=invitation.pk))
        organization = invitation.organization
        refusal = invitation_refusal(invitation, user)
        if refusal is not None:
            raise InvitationRefused(refusal)
        if invitation.accepted_at is not None:  # by this user: accepting again changes nothing
            return Membership.objects.get(organization=organization, user=user)
        membership, created = Membership.objects.get_or_create(organization=organization, user=user,
                                                               defaults={"role": invitation.role})
        invitation.accepted_at, invitation.accepted_by = timezone.now(), user
        invitation.save(update_fields=["accepted_at", "accepted_by"])
        record_audit(actor, organization, "invitation.accept", invitation, email=user.email, role=membership.role)
        if created:
            record_audit(actor, organization, "member.add", membership, role=membership.role, invitation=invitation.pk)
    return membership
