"""Writes with side effects for accounts, organisations, API keys and the audit log."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.text import slugify

from controlplane import tokens
from controlplane.models import ApiKey, AuditEvent, Membership, Organization, Plan, Role, Scope

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


@transaction.atomic
def sign_up_user(*, email: str, password: str, organization_name: str, source_ip: str | None = None):
    """A new user and their first organisation, which they own: nobody is ever without one."""
    user = User.objects.create_user(username=email.lower(), email=email.lower(), password=password)
    organization = create_organization(Actor(user=user, source_ip=source_ip), name=organization_name, owner=user)
    return user, organization


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
    ensure_may_touch_owner_role(actor, membership.organization, role, membership.role)
    _ensure_an_owner_remains(membership, leaving=role != Role.OWNER)
    membership.role = role
    membership.save(update_fields=["role"])
    record_audit(actor, membership.organization, "member.change_role", membership, role=role)
    return membership


@transaction.atomic
def remove_member(actor: Actor, membership: Membership) -> None:
    ensure_may_touch_owner_role(actor, membership.organization, membership.role)
    _ensure_an_owner_remains(membership, leaving=True)
    record_audit(actor, membership.organization, "member.remove", membership, email=membership.user.email)
    membership.delete()


def _ensure_an_owner_remains(membership: Membership, *, leaving: bool) -> None:
    if not leaving or membership.role != Role.OWNER:
        return
    owners = Membership.objects.select_for_update().filter(organization=membership.organization, role=Role.OWNER)
    if owners.exclude(pk=membership.pk).count() == 0:
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


@transaction.atomic
def revoke_api_key(actor: Actor, api_key: ApiKey) -> ApiKey:
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
    """The key, if it is usable and its creator still belongs to its organisation.

    NOTE: a key acts with its creator's role, so it dies with the creator's membership.
    """
    api_key = find_api_key(plain)
    if api_key is None:
        return None
    creator = api_key.created_by
    if creator is None or not creator.is_active:
        return None
    if not Membership.objects.filter(organization_id=api_key.organization_id, user_id=creator.pk).exists():
        return None
    return api_key


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
