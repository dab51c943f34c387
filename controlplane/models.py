"""Organisations, members, API keys and the audit log."""

from __future__ import annotations

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.utils import timezone

from controlplane import tokens


class Role(models.TextChoices):
    OWNER = "owner", "Owner"
    ADMIN = "admin", "Admin"
    MEMBER = "member", "Member"
    VIEWER = "viewer", "Viewer"


# NOTE: higher ranks include everything lower ranks may do.
ROLE_RANK = {Role.VIEWER: 0, Role.MEMBER: 1, Role.ADMIN: 2, Role.OWNER: 3}


class Organization(models.Model):
    name = models.CharField(max_length=128)
    slug = models.SlugField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.slug

    def role_of(self, user) -> str | None:
        if user is None or not user.is_authenticated:
            return None
        membership = self.memberships.filter(user=user).only("role").first()
        return membership.role if membership else None


class Membership(models.Model):
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["organization", "user"], name="one_membership_per_user_and_org")]
        ordering = ["created_at"]

    def __str__(self) -> str:
        return f"{self.user} in {self.organization} as {self.role}"

    def can(self, needed: str) -> bool:
        return ROLE_RANK[Role(self.role)] >= ROLE_RANK[Role(needed)]


class Scope(models.TextChoices):
    INFERENCE = "inference", "Inference (/v1)"
    MANAGE = "manage", "Manage (/api/v1)"


class ApiKeyQuerySet(models.QuerySet):
    def for_org(self, organization):
        return self.filter(organization=organization)

    def usable(self):
        now = timezone.now()
        return self.filter(revoked_at__isnull=True).filter(models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=now))


class ApiKey(models.Model):
    TOKEN_KIND = tokens.API_KEY_KIND

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="api_keys")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")
    name = models.CharField(max_length=100)
    lookup = models.CharField(max_length=tokens.LOOKUP_LENGTH, unique=True)
    digest = models.CharField(max_length=64)
    scopes = ArrayField(models.CharField(max_length=16, choices=Scope.choices), default=list)
    # Per-key limits enforced by the gateway; null means the platform default.
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.display_prefix})"

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

    def is_usable(self, now=None) -> bool:
        now = now or timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


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
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["organization", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.action} {self.target_repr}"
