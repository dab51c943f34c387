"""Who acts and what they did, organisations and plans: the `Actor` every write names, its role
(`actor_role`) and the refusal of what that role does not allow (`NotPermitted`), the audit log it writes
to, creating an organisation, and staff's plans (quotas).

Everything else in accounts that writes builds on this: sign-up and email verification
(`signup`), members and their roles (`members`), invitations (`invitations`) and API keys (`keys`).
"""

from __future__ import annotations

import getpass
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, transaction
from django.dispatch import Signal
from django.utils.text import slugify

from controlplane.accounts.models import (
    ORGANIZATION_CREATED_ACTION,
    ApiKey,
    AuditEvent,
    Membership,
    Organization,
    Plan,
    Quotas,
    Role,
)


@dataclass(slots=True, frozen=True)
class Actor:
    """Who performs an action: a signed-in user, an API key (acting for its creator), or the system (with `staff`:
    a staff member acting as the platform)."""

    user: object | None = None
    api_key: ApiKey | None = None
    source_ip: str | None = None
    # NOTE: staff acting as the platform, where a member's rule would refuse a user who is not a member (revoking a key,
    # deleting an account in the Django admin): asked no role, as the system, and named by the audit log. Before, such
    # an actor was the system alone, and the events of keys staff revoked named nobody.
    staff: object | None = None
    # NOTE: an operator at a shell on the servers (`manage.py createsuperuser`, `changepassword`, ...), named by the
    # operating-system account running the command (`at_shell`): no Django account acts there, and before, a staff
    # account made or a password set from a shell left no audit event, or one that named nobody.
    operator: str | None = None

    @classmethod
    def at_shell(cls) -> Actor:
        """The operator running this management command: `<operating-system user>@<host>`, recorded in each audit
        event's details as `operator`."""
        try:
            who = getpass.getuser()
        except (KeyError, OSError):  # NOTE: a container's uid with no passwd entry and no LOGNAME/USER
            who = f"uid {os.getuid()}"
        return cls(operator=f"{who}@{socket.gethostname()}")

    @classmethod
    def from_request(cls, request) -> Actor:
        api_key = request.auth if isinstance(getattr(request, "auth", None), ApiKey) else None
        user = request.user if getattr(request, "user", None) is not None and request.user.is_authenticated else None
        return cls(user=user, api_key=api_key, source_ip=client_ip(request))

    @classmethod
    def platform_staff(cls, request) -> Actor:
        """The staff member signed in to `request`, acting as the platform (`staff`)."""
        return cls(staff=request.user, source_ip=client_ip(request))


SYSTEM = Actor()


class NotPermitted(ValueError):
    """The actor's role does not allow this; `field` names the input at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


ORGANIZATION_CLOSED = ("This organisation is closed: its invoices, usage and audit log stay readable, and nothing in it "
                       "changes any more.")


class OrganizationClosed(NotPermitted):
    """A write to an organisation its owner closed (`endpoints.closing.close_organization`): a 403 on `/api/`."""

    def __init__(self, field: str = "non_field_errors"):
        super().__init__(field, ORGANIZATION_CLOSED)


def ensure_open(organization_id: int, field: str = "non_field_errors") -> None:
    """`OrganizationClosed` where the organisation is closed. NOTE: called under its row's lock by the writes that
    take it (a key, an invitation, an endpoint), so one racing the close either committed before it, and was ended by
    it, or waits for it and is refused here."""
    if Organization.objects.filter(pk=organization_id, closed_at__isnull=False).exists():
        raise OrganizationClosed(field)


def actor_role(actor: Actor, organization: Organization) -> str | None:
    """The acting user's role in the organisation; None for the system (scripts, bootstrap)."""
    if actor.user is None:
        return None
    return Membership.objects.filter(organization=organization, user=actor.user).values_list("role", flat=True).first()


def client_ip(request) -> str | None:
    """The address a request came from: per-address throttles count it, the audit log records it.

    It is REMOTE_ADDR as the web server set it. Behind proxies it trusts (uvicorn's proxy headers and
    `FORWARDED_ALLOW_IPS`, README "Configuration"), the server puts there the right-most
    X-Forwarded-For hop that is not a trusted proxy: the client as the first proxy saw it. The header
    itself is never read here. Its left-most hops are whatever the client wrote, so trusting them let one
    address dodge its limits and write any address into the audit log.
    """
    return request.META.get("REMOTE_ADDR") or None


def record_audit(actor: Actor, organization, action: str, target=None, **details) -> AuditEvent:
    return AuditEvent.objects.create(
        by_staff=acts_as_staff(actor, organization),
        organization=organization,
        actor=actor.user if actor.user is not None else actor.staff,
        api_key=actor.api_key,
        action=action,
        target_type=type(target).__name__ if target is not None else "",
        target_id=str(getattr(target, "pk", "") or ""),
        target_repr=str(target)[:200] if target is not None else "",
        details={**details, "operator": actor.operator} if actor.operator is not None else details,
        source_ip=actor.source_ip,
    )


def acts_as_staff(actor: Actor, organization) -> bool:
    """Whether `actor` acts on `organization` as the platform's staff rather than as one of its members: staff acting as
    the platform, an operator at a shell, or a staff account that is not a member of it (the Django admin's changes of
    its plan, spend cap, prices). NOTE: a staff account that is a member acting in it (the demo's admin) is a member."""
    if actor.staff is not None or actor.operator is not None:
        return True
    if actor.user is None or actor.api_key is not None or organization is None or not actor.user.is_staff:
        return False
    return actor_role(actor, organization) is None


def unique_org_slug(name: str) -> str:
    base = slugify(name)[:50] or "org"
    slug, counter = base, 1
    while Organization.objects.filter(slug=slug).exists():
        counter += 1
        slug = f"{base}-{counter}"
    return slug


SLUG_ATTEMPTS = 3


@transaction.atomic
def create_organization(actor: Actor, *, name: str, owner, slug: str | None = None) -> Organization:
    """A new organisation owned by `owner`, under `slug` or a free slug made from its name.

    NOTE: two sign-ups with the same organisation name both found its slug free, and the second insert broke
    its unique constraint (a 500): a slug made from the name is looked for again, past the one just taken."""
    for attempt in range(1, SLUG_ATTEMPTS + 1):
        chosen = slug or unique_org_slug(name)
        try:
            with transaction.atomic():
                organization = Organization.objects.create(name=name, slug=chosen)
            break
        except IntegrityError:
            if slug is not None or attempt == SLUG_ATTEMPTS or not Organization.objects.filter(slug=chosen).exists():
                raise
    Membership.objects.create(organization=organization, user=owner, role=Role.OWNER)
    record_audit(actor, organization, ORGANIZATION_CREATED_ACTION, organization, owner=owner.email)
    return organization


PLAN_FIELDS = ("name", "max_endpoints", "max_replicas", "max_min_replicas", "max_held_requests", "max_file_bytes",
               "max_gpus_by_type")


# Sent with `organization_ids` once a change of the replicas or GPUs their plan allows is written (in its transaction):
# the endpoints app reconciles the endpoints of those now past it, which drain down to it (`endpoints.quotas.over_quota`).
# `lowered`: the change allows fewer replicas or GPUs of a type than before; those past it get a grace of its own.
# NOTE: a signal, as accounts may not import endpoints (the layers in pyproject.toml).
replica_quotas_changed = Signal()

REPLICA_QUOTA_FIELDS = ("max_replicas", "max_gpus_by_type")


@dataclass(slots=True, frozen=True)
class Drains:
    """What a change of quotas would drain once its grace ends (`endpoints.quotas.drains_of`): staff see it and confirm
    it before the change is saved."""

    num_organizations: int = 0
    num_endpoints: int = 0
    num_replicas: int = 0

    def __bool__(self) -> bool:
        return self.num_replicas > 0

    def __str__(self) -> str:
        return (f"{self.num_replicas} replica(s) of {self.num_endpoints} endpoint(s) in {self.num_organizations} "
                "organisation(s)")


# The endpoints app's `drains_of(organization_ids, quotas)`. NOTE: registered (`EndpointsConfig.ready`), as accounts
# may not import endpoints (the layers in pyproject.toml).
_drains_of: list[Callable[[list[int], object], Drains]] = []


def register_drains_of(drains_of: Callable[[list[int], object], Drains]) -> None:
    """Called once, by the app that owns replicas; again, it replaces what was there."""
    _drains_of[:] = [drains_of]


def drains_of_plan_change(plan: Plan, quotas) -> Drains:
    """What giving the plan's organisations `quotas` (the plan as staff edit it) would drain."""
    if plan.pk is None:
        return Drains()
    return _registered_drains_of()(list(plan.organizations.values_list("pk", flat=True)), quotas)


def drains_of_organization_plan(organization: Organization, plan: Plan | None) -> Drains:
    """What moving the organisation to `plan` (None: the platform defaults, which drain nothing) would drain."""
    return _registered_drains_of()([organization.pk], plan.quotas if plan is not None else None)


def _registered_drains_of() -> Callable[[list[int], object], Drains]:
    if not _drains_of:
        raise ImproperlyConfigured("No drains_of is registered: is the endpoints app installed?")
    return _drains_of[0]


@transaction.atomic
def save_plan(actor: Actor, plan: Plan, *, confirmed_drains: Drains | None = None) -> Plan:
    """Staff create or change a plan; audited with what changed. Gateways see it within their
    endpoint cache window (seconds), the autoscaler at its next placement; replicas or GPUs lowered, the organisations
    on it drain what they hold past it, one replica at a time, after a grace (`replica_quotas_changed`).
    `confirmed_drains`: what staff were shown it drains and confirmed, audited (`plan.change`)."""
    before = Plan.objects.filter(pk=plan.pk).values(*PLAN_FIELDS).first() if plan.pk else None
    plan.quotas  # noqa: B018 - validates the numbers before anything is written
    plan.save()
    after = {name: getattr(plan, name) for name in PLAN_FIELDS}
    changes = {name: value for name, value in after.items() if before is None or before[name] != value}
    record_audit(actor, None, "plan.create" if before is None else "plan.update", plan, changes=changes)
    _audit_confirmed_drains(actor, None, plan, confirmed_drains)
    if before is not None and set(changes) & set(REPLICA_QUOTA_FIELDS):
        replica_quotas_changed.send(Plan, organization_ids=list(plan.organizations.values_list("pk", flat=True)),
                                    lowered=_lowers(Plan(**before).quotas, plan.quotas))
    return plan


@transaction.atomic
def set_organization_plan(actor: Actor, organization: Organization, plan: Plan | None, *,
                          confirmed_drains: Drains | None = None) -> Organization:
    """Staff move an organisation to a plan (None: the platform defaults); audited. `confirmed_drains`: as `save_plan`."""
    locked = Organization.objects.select_for_update(of=("self",)).select_related("plan").get(pk=organization.pk)
    previous = locked.plan.name if locked.plan_id else None
    Organization.objects.filter(pk=organization.pk).update(plan=plan)
    organization.plan = plan
    record_audit(actor, organization, "organization.plan", organization, before=previous, after=plan.name if plan else None)
    _audit_confirmed_drains(actor, organization, plan, confirmed_drains)
    replica_quotas_changed.send(Organization, organization_ids=[organization.pk],
                                lowered=_lowers(locked.quotas, organization.quotas))
    return organization


def _lowers(before: Quotas, after: Quotas) -> bool:
    """Whether `after` allows fewer replicas, or fewer GPUs of some type, than `before` (`replica_quotas_changed`)."""
    return after.max_replicas < before.max_replicas or any(
        after.max_gpus(gpu_type) < before.max_gpus(gpu_type) for gpu_type in {*before.max_gpus_by_type,
                                                                              *after.max_gpus_by_type})


def _audit_confirmed_drains(actor: Actor, organization: Organization | None, plan: Plan | None,
                            drains: Drains | None) -> None:
    if drains:
        record_audit(actor, organization, "plan.change", plan, confirmed=True, drains=str(drains),
                     num_organizations=drains.num_organizations, num_endpoints=drains.num_endpoints,
                     num_replicas=drains.num_replicas)
