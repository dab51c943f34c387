"""GPU nodes and the join tokens that admit them."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.utils import timezone

from controlplane import tokens
from gpu_agent.protocol import NodeState


class JoinToken(models.Model):
    TOKEN_KIND = "jt"

    name = models.CharField(max_length=100)
    lookup = models.CharField(max_length=tokens.LOOKUP_LENGTH, unique=True)
    digest = models.CharField(max_length=64)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")
    expires_at = models.DateTimeField(null=True, blank=True)
    max_uses = models.PositiveIntegerField(null=True, blank=True)
    num_uses = models.PositiveIntegerField(default=0)
    revoked_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.TOKEN_KIND}_{self.lookup})"

    def is_usable(self, now=None) -> bool:
        now = now or timezone.now()
        return (
            self.revoked_at is None
            and (self.expires_at is None or self.expires_at > now)
            and (self.max_uses is None or self.num_uses < self.max_uses)
        )


class NodeQuerySet(models.QuerySet):
    def schedulable(self):
        return self.filter(state=NodeState.READY)


class Node(models.Model):
    SECRET_KIND = "nd"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=128)
    gpu_type = models.CharField(max_length=32)
    num_gpus = models.PositiveIntegerField(default=0)
    gpu_memory_mb = models.PositiveIntegerField(default=0)  # per GPU (CPU nodes: memory for the KV cache)
    num_cpus = models.PositiveIntegerField(default=1)
    memory_mb = models.PositiveIntegerField(default=0)
    labels = models.JSONField(default=dict, blank=True)
    quantizations = ArrayField(models.CharField(max_length=32), default=list, blank=True)
    state = models.CharField(max_length=16, choices=[(s.value, s.value.title()) for s in NodeState], default=NodeState.READY)
    agent_version = models.CharField(max_length=64, blank=True)
    engine_version = models.CharField(max_length=64, blank=True)
    secret_lookup = models.CharField(max_length=tokens.LOOKUP_LENGTH, unique=True)
    secret_digest = models.CharField(max_length=64)
    join_token = models.ForeignKey(JoinToken, on_delete=models.SET_NULL, null=True, related_name="nodes")
    # The latest heartbeat as the agent sent it (GPUs, weights cache, …), for the fleet pages.
    last_status = models.JSONField(default=dict, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    registered_at = models.DateTimeField(default=timezone.now)

    objects = NodeQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["state", "gpu_type"])]

    def __str__(self) -> str:
        return self.name

    @property
    def total_gpu_memory_mb(self) -> int:
        return self.gpu_memory_mb * max(self.num_gpus, 1)
