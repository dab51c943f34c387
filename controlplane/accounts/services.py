"""Writes with side effects for accounts, organisations, invitations, API keys and the audit log."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core import signing
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.utils.text import slugify

from controlplane import tokens
from controlplane.accounts.models import (
    ROLE_RANK,
    ApiKey,
    AuditEvent,
    EmailVerification,
    Invitation,
    Membership,
    Organization,
    Plan,
    Role,
    Scope,
    email_is_verified,
)

User = get_user_model()

# last_used_at is written at most this often per key, so hot keys cost no write per call.
LAST_USED_RESOLUTION = timedelta(seconds=60)


@dataclass(slots=True, frozen=True)
class Actor:
    """Who performs an action: a signed-in user, an API key (acting for its creator), or the system."""

    user: object | None = None
    api_key: ApiKey | None = None
    source_ip: str | None = None

    @classmethod
    def from_request(cls, request) -> Actor:
        api_key = request.auth if isinstance(getattr(request, "auth", None), ApiKey) else None
        user = request.user if getattr(request, "user", None) is not None and request.user.is_authenticated else None
        return cls(user=user, api_key=api_key, source_ip=client_ip(request))


SYSTEM = Actor()


def client_ip(request) -> str | None:
    # NOTE: behind the ingress the client is the first X-Forwarded-For hop, which the
    # ingress sets; without one REMOTE_ADDR is the client.
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    candidate = forwarded.split(",")[0].strip() if forwarded else request.META.get("REMOTE_ADDR")
    return candidate or None


def record_audit(actor: Actor, organization, action: str, target=None, **details) -> AuditEvent:
    return AuditEvent.objects.create(
        organization=organization,
        actor=actor.user,
        api_key=actor.api_key,
        action=action,
        target_type=type(target).__name__ if target is not None else "",
        target_id=str(getattr(target, "pk", "") or ""),
        target_repr=str(target)[:200] if target is not None else "",
        details=details,
        source_ip=actor.source_ip,
    )


def unique_org_slug(name: str) -> str:
    base = slugify(name)[:50] or "org"
    slug, counter = base, 1
    while Organization.objects.filter(slug=slug).exists():
        counter += 1
        slug = f"{base}-{counter}"
    return slug


@transaction.atomic
def create_organization(actor: Actor, *, name: str, owner, slug: str | None = None) -> Organization:
    organization = Organization.objects.create(name=name, slug=slug or unique_org_slug(name))
    Membership.objects.create(organization=organization, user=owner, role=Role.OWNER)
    record_audit(actor, organization, "organization.create", organization, owner=owner.email)
    return organization


def sign_up_user(*, email: str, password: str, organization_name: str, source_ip: str | None = None):
    """A new user and their first organisation, which they own: nobody is ever without one.

    NOTE: the account is unverified: the console shows it nothing but the verify-email page,
    and it may join nothing, until the link mailed here is followed.
    """
    with transaction.atomic():
        user = User.objects.create_user(username=email.lower(), email=email.lower(), password=password)
        organization = create_organization(Actor(user=user, source_ip=source_ip), name=organization_name, owner=user)
    send_verification_email(user)
    return user, organization


# --- email verification ------------------------------------------------------------------

VERIFY_EMAIL_SALT = "inferplane.verify-email"
VERIFY_EMAIL_MAX_AGE = timedelta(days=3)


class InvalidLink(ValueError):
    """A signed link that is forged, expired or no longer matches what it was made for."""


def email_verification_token(user) -> str:
    # NOTE: the token names the address as well as the user: it proves that mailbox, no other.
    return signing.TimestampSigner(salt=VERIFY_EMAIL_SALT).sign_object({"user": user.pk, "email": user.email.lower()})


def send_verification_email(user) -> None:
    link = settings.PUBLIC_URL + reverse("verify-email-confirm", args=[email_verification_token(user)])
    body = render_to_string("registration/verify_email_email.txt", {"user": user, "link": link,
                                                                     "max_age_days": VERIFY_EMAIL_MAX_AGE.days})
    send_mail("Verify your email for Inferplane", body, None, [user.email])


def mark_email_verified(user) -> EmailVerification:
    verification, _ = EmailVerification.objects.update_or_create(
        user=user, defaults={"email": user.email.lower(), "verified_at": timezone.now()}
    )
    return verification


def verify_email(token: str):
    """The user whose email the signed `token` proves, now verified; `InvalidLink` otherwise."""
    try:
        claim = signing.TimestampSigner(salt=VERIFY_EMAIL_SALT).unsign_object(token, max_age=VERIFY_EMAIL_MAX_AGE)
        user = User.objects.get(pk=claim["user"], is_active=True)
    except (signing.BadSignature, User.DoesNotExist, KeyError, TypeError):
        raise InvalidLink("This verification link is invalid or has expired. Log in and send a new one.") from None
    if user.email.lower() != claim["email"]:
        raise InvalidLink("This verification link was sent to an address that is no longer yours.")
    if not email_is_verified(user):
        mark_email_verified(user)
        for membership in Membership.objects.filter(user=user).select_related("organization"):
            record_audit(Actor(user=user), membership.organization, "user.verify_email", user, email=user.email)
    return user


@transaction.atomic
def add_member(actor: Actor, organization: Organization, *, user, role: str) -> Membership:
    existing = Membership.objects.filter(organization=organization, user=user).values_list("role", flat=True).first()
    ensure_may_touch_owner_role(actor, organization, role, existing or "")
    membership, created = Membership.objects.get_or_create(organization=organization, user=user, defaults={"role": role})
    if not created and membership.role != role:
        membership.role = role
        membership.save(update_fields=["role"])
    record_audit(actor, organization, "member.add" if created else "member.change_role", membership, role=role)
    return membership


class LastOwnerError(ValueError):
    pass


# --- invitations -------------------------------------------------------------------------

INVITATION_SALT = "inferplane.invitation"
INVITATION_TTL = timedelta(days=7)


class InvitationRefused(ValueError):
    """The invitation cannot be accepted by this user now; the message says why, to that user."""


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
    if actor.user is None:
        return
    role = actor_role(actor, organization)
    if role is None or ROLE_RANK[Role(role)] < ROLE_RANK[Role.ADMIN]:
        raise NotPermitted(field, "Only owners and admins may invite members or revoke invitations.")


def invite_member(actor: Actor, organization: Organization, *, email: str, role: str) -> Invitation:
    """A pending invitation, audited, and its signed link mailed to `email`.

    NOTE: nobody joins by being named: whoever accepts must be signed in as a verified
    user with this email, so registering an address first gains nothing.
    """
    email = email.strip().lower()
    _ensure_admin(actor, organization, "email")
    ensure_may_touch_owner_role(actor, organization, role)
    if Membership.objects.filter(organization=organization, user__email__iexact=email).exists():
        raise NotPermitted("email", "This person is already a member; change their role in the table.")
    with transaction.atomic():
        # NOTE: the organisation's row lock makes "one pending invitation per email" hold under races.
        Organization.objects.select_for_update().filter(pk=organization.pk).first()
        if Invitation.objects.for_org(organization).pending().filter(email__iexact=email).exists():
            raise NotPermitted("email", "An invitation to this email is pending; revoke it to send a new one.")
        invitation = Invitation.objects.create(organization=organization, email=email, role=role, invited_by=actor.user,
                                               expires_at=timezone.now() + INVITATION_TTL)
        record_audit(actor, organization, "invitation.create", invitation, email=email, role=role)
    body = render_to_string("controlplane/invitation_email.txt", {
        "invitation": invitation, "link": invitation_link(invitation), "inviter": actor.user,
    })
    send_mail(f"You are invited to {organization.name} on Inferplane", body, None, [email])
    return invitation


def revoke_invitation(actor: Actor, invitation: Invitation) -> Invitation:
    _ensure_admin(actor, invitation.organization, "invitation")
    ensure_may_touch_owner_role(actor, invitation.organization, invitation.role)
    with transaction.atomic():
        revoked = Invitation.objects.filter(pk=invitation.pk, accepted_at__isnull=True, revoked_at__isnull=True).update(
            revoked_at=timezone.now())
        if revoked:
            record_audit(actor, invitation.organization, "invitation.revoke", invitation, email=invitation.email)
    invitation.refresh_from_db()
    return invitation


def invitation_refusal(invitation: Invitation, user) -> str | None:
    """Why `user` may not accept `invitation` now, in words for that user; None if they may (or did)."""
    if user is None or not email_is_verified(user):
        return "Verify your email address before accepting an invitation."
    if invitation.email.lower() != user.email.lower():
        return (f"This invitation was sent to another email address than yours ({user.email}). "
                "Log in with the address it was sent to.")
    if invitation.accepted_at is not None:
        return None if invitation.accepted_by_id == user.pk else "This invitation has already been used."
    if invitation.revoked_at is not None:
        return "This invitation was revoked. Ask an admin of the organisation for a new one."
    if invitation.expires_at <= timezone.now():
        return "This invitation has expired. Ask an admin of the organisation for a new one."
    return None


def accept_invitation(actor: Actor, invitation: Invitation) -> Membership:
    """The invitee's membership, created once: accepting twice (or twice at once) is one membership."""
    user = actor.user
    with transaction.atomic():
        invitation = Invitation.objects.select_for_update().select_related("organization").get(pk=invitation.pk)
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


class NotPermitted(ValueError):
    """The actor's role does not allow this; `field` names the input at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def actor_role(actor: Actor, organization: Organization) -> str | None:
    """The acting user's role in the organisation; None for the system (scripts, bootstrap)."""
    if actor.user is None:
        return None
    return Membership.objects.filter(organization=organization, user=actor.user).values_list("role", flat=True).first()


def ensure_may_touch_owner_role(actor: Actor, organization: Organization, *roles: str) -> None:
    """NOTE: only owners grant, take away or remove the owner role."""
    if Role.OWNER not in roles:
        return
    role = actor_role(actor, organization)
    if actor.user is not None and role != Role.OWNER:
        raise NotPermitted("role", "Only owners may grant, take away or remove the owner role.")


@transaction.atomic
def change_member_role(actor: Actor, membership: Membership, *, role: str) -> Membership:
    membership = _lock_membership(membership)
    ensure_may_touch_owner_role(actor, membership.organization, role, membership.role)
    _ensure_an_owner_remains(membership, leaving=role != Role.OWNER)
    membership.role = role
    membership.save(update_fields=["role"])
    record_audit(actor, membership.organization, "member.change_role", membership, role=role)
    return membership


@transaction.atomic
def remove_member(actor: Actor, membership: Membership) -> None:
    membership = _lock_membership(membership)
    ensure_may_touch_owner_role(actor, membership.organization, membership.role)
    _ensure_an_owner_remains(membership, leaving=True)
    record_audit(actor, membership.organization, "member.remove", membership, email=membership.user.email)
    membership.delete()


def _lock_membership(membership: Membership) -> Membership:
    """The membership as it is now, with its organisation's row locked until the transaction ends.

    NOTE: every change of roles in one organisation queues on its row, so the checks that
    follow (the actor is an owner, another owner remains) read what earlier changes committed:
    two owners demoting each other at once cannot both succeed.
    """
    Organization.objects.select_for_update().get(pk=membership.organization_id)
    return Membership.objects.select_related("organization", "user").get(pk=membership.pk)


def _ensure_an_owner_remains(membership: Membership, *, leaving: bool) -> None:
    if not leaving or membership.role != Role.OWNER:
        return
    others = Membership.objects.filter(organization=membership.organization_id, role=Role.OWNER).exclude(pk=membership.pk)
    if not others.exists():
        raise LastOwnerError("An organisation needs at least one owner.")


@dataclass(slots=True, frozen=True)
class CreatedApiKey:
    api_key: ApiKey
    plain: str  # the only time the secret exists outside the client


def create_api_key(
    actor: Actor,
    organization: Organization,
    *,
    name: str,
    scopes: list[str],
    expires_at: datetime | None = None,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
) -> CreatedApiKey:
    """A new key; its secret is in the answer and nowhere else.

    NOTE: a key acts with its creator's role, and a `manage` key can do what its creator can,
    so only owners and admins may mint one.
    """
    if Scope.MANAGE in scopes and actor.user is not None:
        role = actor_role(actor, organization)
        if role not in (Role.OWNER, Role.ADMIN):
            raise NotPermitted("scopes", "Only owners and admins may create keys with the 'manage' scope.")
    for _ in range(3):
        issued = tokens.issue_token(ApiKey.TOKEN_KIND)
        try:
            with transaction.atomic():
                api_key = ApiKey.objects.create(
                    organization=organization,
                    created_by=actor.user,
                    name=name,
                    lookup=issued.lookup,
                    digest=issued.digest,
                    scopes=sorted(set(scopes)),
                    expires_at=expires_at,
                    requests_per_minute=requests_per_minute,
                    tokens_per_minute=tokens_per_minute,
                )
                record_audit(actor, organization, "api_key.create", api_key, scopes=api_key.scopes)
            return CreatedApiKey(api_key=api_key, plain=issued.plain)
        except IntegrityError:  # a lookup collision: astronomically rare, try a new one
            continue
    raise RuntimeError("could not allocate a unique API key lookup")


def may_revoke_api_key(actor: Actor, api_key: ApiKey, *, actor_role: str | None, creator_role: str | None) -> bool:
    """Members revoke their own keys, admins any key but an owner's, owners every key.

    `creator_role` is the key creator's role now (None once they left: anyone who may revoke
    others' keys may revoke it). The system (actor without a user) may revoke any key.
    """
    if actor.user is None:
        return True
    if actor_role is None or actor_role == Role.VIEWER:
        return False
    if api_key.created_by_id == actor.user.pk or actor_role == Role.OWNER:
        return True
    return actor_role == Role.ADMIN and creator_role != Role.OWNER


def member_roles(organization: Organization) -> dict[int, str]:
    """Each member's role by user id: one query for a page of keys."""
    return dict(Membership.objects.filter(organization=organization).values_list("user_id", "role"))


@transaction.atomic
def revoke_api_key(actor: Actor, api_key: ApiKey) -> ApiKey:
    roles = member_roles(api_key.organization)
    if not may_revoke_api_key(actor, api_key, actor_role=roles.get(actor.user.pk) if actor.user else None,
                              creator_role=roles.get(api_key.created_by_id)):
        raise NotPermitted("api_key", "Members may revoke only their own keys, and only owners may revoke an owner's key.")
    updated = ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    api_key.refresh_from_db()
    if updated:
        record_audit(actor, api_key.organization, "api_key.revoke", api_key)
    return api_key


def find_api_key(plain: str) -> ApiKey | None:
    """The usable key that `plain` names, or None. Marks it used (coarsely)."""
    lookup = tokens.split_token(plain, ApiKey.TOKEN_KIND)
    if lookup is None:
        return None
    api_key = ApiKey.objects.select_related("organization", "created_by").filter(lookup=lookup).first()
    if api_key is None or not tokens.token_matches(plain, api_key.digest) or not api_key.is_usable():
        return None
    touch_api_key(api_key)
    return api_key


def authenticate_api_key(plain: str) -> ApiKey | None:
    """The key, if it is usable and its creator still belongs to its organisation."""
    authenticated = authenticate_api_key_with_role(plain)
    return authenticated[0] if authenticated else None


def authenticate_api_key_with_role(plain: str) -> tuple[ApiKey, str] | None:
    """The key and its creator's current role, if it is usable and the creator still belongs to its organisation.

    NOTE: a key acts with its creator's role, so it dies with the creator's membership and
    a creator demoted to viewer demotes their keys.
    """
    api_key = find_api_key(plain)
    if api_key is None:
        return None
    creator = api_key.created_by
    if creator is None or not creator.is_active:
        return None
    role = Membership.objects.filter(organization_id=api_key.organization_id, user_id=creator.pk).values_list(
        "role", flat=True).first()
    if role is None:
        return None
    return api_key, role


def touch_api_key(api_key: ApiKey) -> None:
    now = timezone.now()
    if api_key.last_used_at is None or now - api_key.last_used_at > LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
        api_key.last_used_at = now


def bootstrap_organization(*, slug: str, owner_email: str, name: str | None = None, password: str | None = None):
    """Operators' and tests' one-shot set-up: org, owner (created if new) and a manage+inference key."""
    with transaction.atomic():
        owner, created = User.objects.get_or_create(
            username=owner_email.lower(), defaults={"email": owner_email.lower()}
        )
        if created or password:
            if password:
                owner.set_password(password)
            else:
                owner.set_unusable_password()
            owner.save()
        # NOTE: an operator names this owner; there is no stranger's sign-up to guard against.
        if not email_is_verified(owner):
            mark_email_verified(owner)
        organization = Organization.objects.filter(slug=slug).first()
        if organization is None:
            organization = create_organization(SYSTEM, name=name or slug, owner=owner, slug=slug)
        elif not Membership.objects.filter(organization=organization, user=owner).exists():
            add_member(SYSTEM, organization, user=owner, role=Role.OWNER)
    created_key = create_api_key(
        Actor(user=owner), organization, name="bootstrap", scopes=[Scope.MANAGE, Scope.INFERENCE]
    )
    return organization, owner, created_key


PLAN_FIELDS = ("name", "max_endpoints", "max_replicas", "max_min_replicas", "max_held_requests", "max_gpus_by_type")


@transaction.atomic
def save_plan(actor: Actor, plan: Plan) -> Plan:
    """Staff create or change a plan; audited with what changed. Gateways see it within their
    endpoint cache window (seconds), the autoscaler at its next placement."""
    before = Plan.objects.filter(pk=plan.pk).values(*PLAN_FIELDS).first() if plan.pk else None
    plan.quotas  # noqa: B018 - validates the numbers before anything is written
    plan.save()
    after = {name: getattr(plan, name) for name in PLAN_FIELDS}
    changes = {name: value for name, value in after.items() if before is None or before[name] != value}
    record_audit(actor, None, "plan.create" if before is None else "plan.update", plan, changes=changes)
    return plan


@transaction.atomic
def set_organization_plan(actor: Actor, organization: Organization, plan: Plan | None) -> Organization:
    """Staff move an organisation to a plan (None: the platform defaults); audited."""
    locked = Organization.objects.select_for_update(of=("self",)).select_related("plan").get(pk=organization.pk)
    previous = locked.plan.name if locked.plan_id else None
    Organization.objects.filter(pk=organization.pk).update(plan=plan)
    organization.plan = plan
    record_audit(actor, organization, "organization.plan", organization, before=previous, after=plan.name if plan else None)
    return organization
