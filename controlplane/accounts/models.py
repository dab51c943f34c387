"""Organisations, members, invitations, verified emails, API keys, staff's enrolment codes and the audit log."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import GinIndex, OpClass
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models.functions import Cast, Upper
from django.utils import timezone

from controlplane import tokens
from controlplane.clock import DatabaseClock
from controlplane.text import shown_name


class Role(models.TextChoices):
    OWNER = "owner", "Owner"
    ADMIN = "admin", "Admin"
    MEMBER = "member", "Member"
    VIEWER = "viewer", "Viewer"


# NOTE: higher ranks include everything lower ranks may do.
ROLE_RANK = {Role.VIEWER: 0, Role.MEMBER: 1, Role.ADMIN: 2, Role.OWNER: 3}


@dataclass(slots=True, frozen=True)
class Quotas:
    """How much of the fleet one organisation may hold: from its plan, or the platform's defaults."""

    max_endpoints: int  # live endpoints
    max_replicas: int  # replicas held at once (starting, ready or draining), over all its endpoints
    max_min_replicas: int  # replicas kept warm while idle: each endpoint's min_replicas or largest pre-warm window's
    max_held_requests: int  # requests held at once while their endpoint cold-starts
    max_file_bytes: int  # bytes of files kept at once: batch inputs it uploads and the outputs its batches write
    max_gpus_by_type: dict[str, int] = field(default_factory=dict)  # GPU type -> replicas at once; absent: max_replicas

    def __post_init__(self) -> None:
        if min(self.max_endpoints, self.max_replicas, self.max_min_replicas, self.max_held_requests,
               self.max_file_bytes) < 0:
            raise ValueError("quotas are never negative")
        if any(not isinstance(n, int) or n < 0 for n in self.max_gpus_by_type.values()):
            raise ValueError("max_gpus_by_type maps GPU types to counts of 0 or more")

    @classmethod
    def platform_default(cls) -> Quotas:
        return cls(settings.DEFAULT_MAX_ENDPOINTS, settings.DEFAULT_MAX_REPLICAS, settings.DEFAULT_MAX_MIN_REPLICAS,
                   settings.DEFAULT_MAX_HELD_REQUESTS, settings.DEFAULT_MAX_FILE_BYTES, dict(settings.DEFAULT_MAX_GPUS_BY_TYPE))

    def max_gpus(self, gpu_type: str) -> int:
        return min(self.max_gpus_by_type.get(gpu_type, self.max_replicas), self.max_replicas)


class Plan(models.Model):
    """A named set of quotas staff assign to organisations (Django admin, through `set_plan`/`save_plan`)."""

    name = models.CharField(max_length=64, unique=True)
    max_endpoints = models.PositiveIntegerField(default=10)
    max_replicas = models.PositiveIntegerField(default=8, help_text="Replicas held at once, over all endpoints.")
    max_min_replicas = models.PositiveIntegerField(default=2, help_text="Replicas kept warm: the sum over endpoints of min_replicas or the largest pre-warm window's.")
    max_held_requests = models.PositiveIntegerField(default=64, help_text="Requests held at once for cold starts.")
    max_file_bytes = models.PositiveBigIntegerField(
        default=10 * 1024**3, db_default=10 * 1024**3, help_text="Bytes of files kept at once (batch inputs and outputs); uploads past it are refused.")
    max_gpus_by_type = models.JSONField(default=dict, blank=True,
                                        help_text='Replicas at once per GPU type, e.g. {"h100-80gb": 2}; absent: max_replicas.')
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        counts = self.max_gpus_by_type
        if not isinstance(counts, dict) or any(not isinstance(n, int) or isinstance(n, bool) or n < 0
                                               for n in counts.values()):
            raise ValidationError({"max_gpus_by_type": 'Map GPU types to counts of 0 or more, e.g. {"h100-80gb": 2}.'})

    @property
    def quotas(self) -> Quotas:
        return Quotas(self.max_endpoints, self.max_replicas, self.max_min_replicas, self.max_held_requests, self.max_file_bytes,
                      dict(self.max_gpus_by_type or {}))


class Organization(models.Model):
    name = models.CharField(max_length=128)
    slug = models.SlugField(max_length=64, unique=True)
    # None: the platform's default quotas (`INFERPLANE_DEFAULT_MAX_*`).
    plan = models.ForeignKey(Plan, on_delete=models.PROTECT, null=True, blank=True, related_name="organizations")
    created_at = models.DateTimeField(default=timezone.now)
    # NOTE: set once, by its owner (`closing.close_organization`), never cleared: a closed organisation keeps its
    # billing and audit records and nothing else. Null in the database by default: a pod of the release before writes
    # rows without it.
    closed_at = models.DateTimeField(null=True, blank=True)
    # When its serving replicas were first found past its plan's replicas or GPUs (PostgreSQL's clock), cleared once
    # they are within it again: its drains start `QUOTA_DRAIN_GRACE_S` later (`endpoints.quotas.over_quota`).
    # NOTE: stored, not held in a worker's memory: a scheduler restarted mid-grace neither restarts nor skips it.
    over_quota_since = models.DateTimeField(null=True, blank=True, editable=False)
    # When its creator (every account at their mailbox) last stopped owning it, by PostgreSQL's clock; None while one
    # does (`organizations.note_handed_on`): its spend without a card is its creator's allowance's, and from then its
    # owners' too (`organizations.holdings_of`). Null in the database by default, as `closed_at`.
    handed_on_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.slug

    @property
    def quotas(self) -> Quotas:
        return self.plan.quotas if self.plan_id is not None else Quotas.platform_default()

    @property
    def is_closed(self) -> bool:
        return self.closed_at is not None


def lock_organizations(ids) -> None:
    """Hold these organisations' rows (a list of ids, or a subquery of them) until the transaction ends.

    NOTE: every change of an organisation's members, keys and invitations takes its organisation's row first, in pk
    order where there are several, so none deadlocks with another (each commit's foreign keys check the organisation's
    row too: with a key's or an invitation's row taken first, two changes waited on each other and PostgreSQL failed
    one). NO KEY UPDATE: they queue behind each other, but rows that only reference the organisation (usage rows'
    foreign-key checks, FOR KEY SHARE) never wait for them."""
    list(Organization.objects.select_for_update(no_key=True).filter(pk__in=ids).order_by("pk"))


def lock_person(user_id: int):
    """Hold the user's row until the transaction ends, and return it as it is now (None: no such user).

    NOTE: the end of their account (`endpoints.closing.end_account`) holds it from its start to its commit, and what
    must not interleave with it takes it first, before any organisation's row: a new organisation of theirs
    (`organizations.create_own_organization`), an invitation to their address (`invitations.invite_member`), their
    acceptance of one (`invitations.accept_invitation`) and staff's save of their admin form (`admin.UserAdmin`).
    Each either commits first and the end, reading after it, ends what it made, or waits and then finds the account
    tombstoned and inactive: an organisation created while the account's end read its memberships was left open, its
    only owner the tombstone; an invitation sent meanwhile stayed pending to the departed person's address; a stale
    admin form wrote the address back. NO KEY UPDATE: the foreign-key checks of rows that name the user (a membership,
    a key) never wait for it."""
    return get_user_model().objects.select_for_update(no_key=True).filter(pk=user_id).first()


class MembershipQuerySet(models.QuerySet):
    def active_owners(self):
        """The owners who can sign in: a deactivated account's owner role (a deleted account's too: it is deactivated
        as it is tombstoned) manages nothing, so it never counts as the owner an organisation must keep.

        NOTE: every rule that refuses to leave an organisation without an owner counts these (a role change, a
        removal, an account's deletion, staff's delete: `owners_besides`): counting every owner, one whose co-owner had been
        deactivated stepped down or deleted their account, and nobody was left able to manage or close it."""
        return self.filter(role=Role.OWNER, user__is_active=True)

    def owners_besides(self, user):
        """The owners who keep an organisation owned once `user` leaves it (or steps down): its other active owners
        (`active_owners`) where `user` is active; any other owner where `user` is deactivated.

        NOTE: a deactivated account's departure takes no owner who can sign in away. Counting only active owners there
        too, an organisation whose owners were all deactivated could lose none of them: staff deleting one was refused
        for the other ("other members"), and the other for the first, for ever."""
        others = self.exclude(user=user)
        return others.active_owners() if user.is_active else others.filter(role=Role.OWNER)


class Membership(models.Model):
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(default=timezone.now)

    objects = MembershipQuerySet.as_manager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["organization", "user"], name="one_membership_per_user_and_org")]
        ordering = ["created_at"]

    def __str__(self) -> str:
        return f"{self.user} in {self.organization} as {self.role}"

    def can(self, needed: str) -> bool:
        return ROLE_RANK[Role(self.role)] >= ROLE_RANK[Role(needed)]


class EmailVerification(models.Model):
    """Proof that a user reads mail at an address: the console and invitations need it.

    NOTE: it proves `email` only; a user whose address changes is unverified again.
    """

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, primary_key=True,
                                related_name="email_verification")
    email = models.EmailField()
    verified_at = models.DateTimeField(default=timezone.now)
    # NOTE: False only on rows from before a link counted in the account's own session alone: such a link followed
    # signed out may have verified a stranger's sign-up; a password reset then revokes the account's keys and
    # pending invitations (migration 0012 confirmed the rows operators made). The database's default is False: a row
    # written by a web pod from before the field, during a rolling deploy, may be such a link.
    confirmed_by_owner = models.BooleanField(
        default=True, db_default=False, help_text="Proven by the address's owner: the link followed in the account's own session, a "
                                "password reset, or an operator's word (False: followed signed out, before that was refused).")

    def __str__(self) -> str:
        return f"{self.email} verified {self.verified_at:%Y-%m-%d}"


def email_is_verified(user) -> bool:
    if user is None or not user.is_authenticated:
        return False
    if user.is_staff:
        # NOTE: staff accounts are made by operators (`createsuperuser`, the admin), never by sign-up.
        return True
    if not user.email:
        return False
    return EmailVerification.objects.filter(user=user, email__iexact=user.email).exists()


class InvitationQuerySet(models.QuerySet):
    def for_org(self, organization):
        return self.filter(organization=organization)

    def pending(self):
        return self.filter(accepted_at__isnull=True, revoked_at__isnull=True, expires_at__gt=timezone.now())


class Invitation(models.Model):
    """An admin's offer of a role to whoever proves they own `email`; accepted once, by that user."""

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField()
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    invited_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")
    # NOTE: the platform's own invitations (no acting user) grant their role whatever; a null `invited_by` alone is
    # a deleted sender (SET_NULL), whose invitation grants nothing (`invitations.invitation_refusal`).
    from_platform = models.BooleanField(default=False, db_default=False)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
                                    related_name="+")
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = InvitationQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["organization", "email"])]

    def __str__(self) -> str:
        return f"{self.email} to {self.organization} as {self.role}"

    @property
    def status(self) -> str:
        if self.accepted_at is not None:
            return "accepted"
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at <= timezone.now():
            return "expired"
        return "pending"


class StaffEnrolmentCode(models.Model):
    """Proof from outside the password and the mailbox that lets a staff account with no authenticator enrol one:
    printed by an operator's command or issued in the admin by a staff member who passed their own second factor
    (`controlplane.accounts.enrolment_codes`). Taken once, before `expires_at`; only a digest of it is kept
    (`tokens.typed_code_digest`).

    NOTE: rows with the channel "email" are codes once mailed to the account's own address, taken ones kept (until
    the account is issued a new code) as the record of who enrolled with one; none is issued or taken any more
    (migration 0008_staff_enrolment_code_channels voided those never taken)."""

    class Channel(models.TextChoices):
        OPERATOR = "operator", "Printed by an operator's command"
        STAFF = "staff", "Issued in the admin by a verified staff member"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    digest = models.CharField(max_length=16)
    channel = models.CharField(max_length=16, choices=Channel.choices)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["user", "digest"])]

    def __str__(self) -> str:
        return f"enrolment code for {self.user} ({self.channel})"


class Scope(models.TextChoices):
    INFERENCE = "inference", "Inference (/v1)"
    MANAGE = "manage", "Manage (/api/v1)"


# The most a key may move its calls' engine priority: batch work runs at 100 (lower runs sooner), so
# no interactive call, however deprioritised, waits behind it.
MAX_PRIORITY_BOOST = 99


class ApiKeyQuerySet(models.QuerySet):
    def for_org(self, organization):
        return self.filter(organization=organization)


class ApiKey(models.Model):
    TOKEN_KIND = tokens.API_KEY_KIND

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="api_keys")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")
    # The key that created this one (with `manage`); null for a key made in a signed-in session. Revoking a key
    # revokes the keys it minted (`keys.revoke_api_key`).
    minted_by = models.ForeignKey("self", on_delete=models.SET_NULL, null=True, blank=True, related_name="minted_keys")
    name = models.CharField(max_length=100)
    lookup = models.CharField(max_length=tokens.LOOKUP_LENGTH, unique=True)
    digest = models.CharField(max_length=64)
    scopes = ArrayField(models.CharField(max_length=16, choices=Scope.choices), default=list)
    # Per-key limits enforced by the gateway; null means the platform default.
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    # How far a call with this key may move its own engine priority (`priority` in the body, from
    # -N, sooner, to N, later; lower runs sooner); null: the key may not pass `priority` at all.
    max_priority_boost = models.PositiveSmallIntegerField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        # NOTE: escaped (`text.shown_name`): a name from before the name rule may hold a direction override, and this is
        # what the Django admin lists and an audit event's `target_repr` keeps
        return f"{shown_name(self.name)} ({self.display_prefix})"

    @property
    def display_prefix(self) -> str:
        return f"{self.TOKEN_KIND}_{self.lookup}"

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes

    @property
    def effective_requests_per_minute(self) -> int:
        """What the gateway enforces (0: no limit); `endpoints.gateway.limits.Window` resolves it the same way."""
        return self.requests_per_minute if self.requests_per_minute is not None else settings.DEFAULT_KEY_REQUESTS_PER_MINUTE

    @property
    def effective_tokens_per_minute(self) -> int:
        return self.tokens_per_minute if self.tokens_per_minute is not None else settings.DEFAULT_KEY_TOKENS_PER_MINUTE

    def is_usable(self, now) -> bool:
        """Neither revoked nor expired at `now`: PostgreSQL's clock (`controlplane.clock.database_now`), as every
        judge of it reads it, never a pod's or a worker's own."""
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


# The audit action of an organisation's creation (`services.create_organization`), its actor the person who created it:
# who created an organisation is read from it (`organizations.people_of`, `held_by_any`), through its own indexes.
ORGANIZATION_CREATED_ACTION = "organization.create"


class AuditEvent(models.Model):
    """One mutating action: who did what to which object, when and from where."""

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, null=True, related_name="audit_events")
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")
    api_key = models.ForeignKey(ApiKey, on_delete=models.SET_NULL, null=True, related_name="+")
    action = models.CharField(max_length=64)  # "<noun>.<verb>", e.g. "endpoint.create"
    target_type = models.CharField(max_length=64, blank=True)
    target_id = models.CharField(max_length=64, blank=True)
    target_repr = models.CharField(max_length=200, blank=True)
    details = models.JSONField(default=dict, blank=True)
    source_ip = models.GenericIPAddressField(null=True, blank=True)
    # NOTE: done by the platform's staff (the Django admin, an operator's shell), not by one of the organisation's
    # members (`services.record_audit`): its members read it as done by "Inferplane staff", with no address and no IP
    # (`serializers.AuditEventSerializer`), since a tenant who learns staff's addresses and networks has a phishing
    # list. Staff's own pages show everything.
    by_staff = models.BooleanField(default=False, db_default=False)
    # NOTE: by PostgreSQL's clock (the statement's moment), filled in and returned by the insert: by each web pod's or
    # worker's own, one minutes off put an event before or after what it followed (a close's events around its
    # `closed_at`, which the database's clock stamps).
    created_at = models.DateTimeField(db_default=DatabaseClock(), db_index=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["organization", "-created_at"]),
            # NOTE: an account's deletion reads the events that name its address (`erasure.pseudonymise_records`:
            # `icontains`, which PostgreSQL reads as `UPPER(<column>::text) LIKE`) and those about the account
            # (`erasure.former_addresses_of`) under its organisations' and its own row locks. Without these, each was a
            # scan of every event since the account joined, every organisation's, while those locks held every change
            # of its organisations' members, keys and invitations (migration 0019).
            GinIndex(OpClass(Upper(Cast("target_repr", models.TextField())), name="gin_trgm_ops"),
                     name="audit_target_repr_trgm"),
            GinIndex(OpClass(Upper(Cast("details", models.TextField())), name="gin_trgm_ops"), name="audit_details_trgm"),
            models.Index(fields=["target_type", "target_id"], name="audit_target"),
            # NOTE: who created an organisation, and which organisations a person created (what one person may have
            # without paying, `organizations.people_of`, `held_by_any`), read on a card's first sighting, a billing
            # mode's change and the shared allowances' beat: by `organization, -created_at` alone, every event of a
            # large organisation was read to find its one creation (migration 0024).
            models.Index(fields=["organization"], condition=models.Q(action=ORGANIZATION_CREATED_ACTION),
                         name="audit_org_creation_by_org"),
            models.Index(fields=["actor"], condition=models.Q(action=ORGANIZATION_CREATED_ACTION),
                         name="audit_org_creation_by_actor"),
        ]

    def __str__(self) -> str:
        # NOTE: escaped (`text.shown_name`): one recorded before `ApiKey.__str__` escaped a key's name kept its override
        return f"{self.action} {shown_name(self.target_repr)}"
