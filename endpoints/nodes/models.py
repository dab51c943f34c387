"""GPU nodes and the join tokens that admit them."""

from __future__ import annotations

import ipaddress
import uuid
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.utils import timezone

from controlplane import tokens
from gpu_agent.protocol import DEFAULT_ENGINE_PORT_MAX, DEFAULT_ENGINE_PORT_MIN, GpuStatus, NodeState


def engine_address_problem(address: str, host: str, port_min: int, port_max: int) -> str:
    """Why `address` is not an engine of the node registered at `host` with ports in [min, max] ("" if it is).

    NOTE: the one rule for where the gateway may send customers' prompts: plain `http://host:port`
    on the node's own registered host and inside its port range; no path, user, query or fragment.
    """
    try:
        parts = urlsplit(address)
        port = parts.port
    except ValueError:
        return f"engine address {address[:100]!r} is not a URL"
    if parts.scheme != "http" or parts.username or parts.password or parts.path not in ("", "/") or parts.query or parts.fragment:
        return f"engine address {address[:100]!r} is not of the form http://host:port"
    reported_host = (parts.hostname or "").lower()
    if not reported_host or reported_host != _normal_host(host):
        return f"engine address {address[:100]!r} is not on the node's registered host {host}"
    if port is None or not port_min <= port <= port_max:
        return f"engine address {address[:100]!r} is outside the node's engine ports {port_min}-{port_max}"
    return ""


def _normal_host(host: str) -> str:
    host = host.strip().lower().strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


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
    # Each GPU as the agent reported it: [{index, uuid, name, memory_mb, mig_slices: [{uuid, profile,
    # memory_mb}]}]. Empty for CPU nodes and agents older than per-GPU placement: placement then
    # treats the node's GPU memory as one pool and assigns no GPU indices.
    gpus = models.JSONField(default=list, blank=True)
    # The latest heartbeat as the agent sent it (GPUs, weights cache, …), for the fleet pages.
    last_status = models.JSONField(default=dict, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # Where its engines listen, as registered (never from a heartbeat): replica addresses must match.
    advertise_host = models.CharField(max_length=253, default="127.0.0.1")
    engine_port_min = models.PositiveIntegerField(default=DEFAULT_ENGINE_PORT_MIN)
    engine_port_max = models.PositiveIntegerField(default=DEFAULT_ENGINE_PORT_MAX)
    registered_at = models.DateTimeField(default=timezone.now)

    objects = NodeQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["state", "gpu_type"])]

    def __str__(self) -> str:
        return self.name

    def engine_address_problem(self, address: str) -> str:
        return engine_address_problem(address, self.advertise_host, self.engine_port_min, self.engine_port_max)

    @property
    def total_gpu_memory_mb(self) -> int:
        return self.gpu_memory_mb * max(self.num_gpus, 1)


def gpu_inventory(gpus: list[GpuStatus]) -> list[dict]:
    """What a node keeps of its agent's GPU reports (`Node.gpus`): identity and size, not load."""
    return [
        {"index": gpu.index, "uuid": gpu.uuid, "name": gpu.name, "memory_mb": gpu.memory_total_mb,
         "mig_slices": [slice_.to_dict() for slice_ in gpu.mig_slices]}
        for gpu in sorted(gpus, key=lambda gpu: gpu.index)
    ]
