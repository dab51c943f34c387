"""Writes with side effects for endpoints: create, update, pause, resume, delete, and the event log."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from controlplane.services import Actor, record_audit
from endpoints import quotas
from endpoints.catalogue import GPU_TYPES
from endpoints.models import Endpoint, EndpointEvent, EventKind, Replica
from gpu_agent.notify import notify_node
from gpu_agent.protocol import ReplicaState


def record_event(endpoint: Endpoint, kind: str, message: str, *, replica: Replica | None = None, **details) -> EndpointEvent:
    return EndpointEvent.objects.create(endpoint=endpoint, replica=replica, kind=kind, message=message[:300], details=details)


@transaction.atomic
def create_endpoint(actor: Actor, organization, **spec) -> Endpoint:
    """Raises `quotas.QuotaExceeded` when the organisation's plan refuses it (checked under its lock)."""
    quotas.check_spec(quotas.lock_organization(organization.pk), spec)
    gpu = GPU_TYPES[spec["gpu_type"]]
    spec.setdefault("price_input_per_million", gpu.price_input_per_million)
    spec.setdefault("price_cached_input_per_million", gpu.price_cached_input_per_million)
    spec.setdefault("price_output_per_million", gpu.price_output_per_million)
    endpoint = Endpoint.objects.create(organization=organization, **spec)
    record_event(endpoint, EventKind.CONFIG, "Endpoint created", spec=_plain(spec))
    record_audit(actor, organization, "endpoint.create", endpoint)
    _after_commit_reconcile(endpoint)
    return endpoint


@transaction.atomic
def update_endpoint(actor: Actor, endpoint: Endpoint, **changes) -> Endpoint:
    endpoint = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
    changed = {name: value for name, value in changes.items() if getattr(endpoint, name) != value}
    if not changed:
        return endpoint
    # NOTE: the endpoint's row, then its organisation's: the order the scheduler locks them in.
    quotas.check_spec(quotas.lock_organization(endpoint.organization_id), changed, endpoint)
    for name, value in changed.items():
        setattr(endpoint, name, value)
    endpoint.save()
    record_event(endpoint, EventKind.CONFIG, "Configuration changed: " + ", ".join(sorted(changed)), changes=_plain(changed))
    record_audit(actor, endpoint.organization, "endpoint.update", endpoint, changes=_plain(changed))
    _after_commit_reconcile(endpoint)
    return endpoint


@transaction.atomic
def pause_endpoint(actor: Actor, endpoint: Endpoint) -> Endpoint:
    if Endpoint.objects.filter(pk=endpoint.pk, paused_at__isnull=True).update(paused_at=timezone.now()):
        drain_replicas(endpoint, reason="endpoint paused")
        record_event(endpoint, EventKind.CONFIG, "Endpoint paused: replicas drain, calls get 503 until resumed")
        record_audit(actor, endpoint.organization, "endpoint.pause", endpoint)
    endpoint.refresh_from_db()
    return endpoint


@transaction.atomic
def resume_endpoint(actor: Actor, endpoint: Endpoint) -> Endpoint:
    if Endpoint.objects.filter(pk=endpoint.pk, paused_at__isnull=False).update(paused_at=None):
        record_event(endpoint, EventKind.CONFIG, "Endpoint resumed")
        record_audit(actor, endpoint.organization, "endpoint.resume", endpoint)
        _after_commit_reconcile(endpoint)
    endpoint.refresh_from_db()
    return endpoint


@transaction.atomic
def delete_endpoint(actor: Actor, endpoint: Endpoint) -> None:
    """Soft delete: the name is free again, replicas drain, usage and invoices keep their endpoint."""
    if Endpoint.objects.filter(pk=endpoint.pk, deleted_at__isnull=True).update(deleted_at=timezone.now()):
        drain_replicas(endpoint, reason="endpoint deleted")
        record_event(endpoint, EventKind.CONFIG, "Endpoint deleted")
        record_audit(actor, endpoint.organization, "endpoint.delete", endpoint)


def drain_replicas(endpoint: Endpoint, *, reason: str) -> int:
    """Every active replica of the endpoint drains."""
    replicas = Replica.objects.filter(
        endpoint=endpoint, state__in=[ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.READY]
    )
    return sum(drain_replica(replica, reason=reason) for replica in replicas)


def drain_replica(replica: Replica, *, reason: str) -> bool:
    """The replica takes no new requests; its agent stops it once in-flight ones finish.

    A replica not yet started stops at once. Returns whether this call changed it.
    """
    now = timezone.now()
    if replica.state == ReplicaState.PENDING:
        changed = Replica.objects.filter(pk=replica.pk, state=ReplicaState.PENDING).update(
            state=ReplicaState.STOPPED, state_changed_at=now, stopped_at=now
        )
    else:
        changed = Replica.objects.filter(pk=replica.pk, state__in=[ReplicaState.STARTING, ReplicaState.READY]).update(
            state=ReplicaState.DRAINING, state_changed_at=now
        )
    if changed:
        notify_node(replica.node_id)
        record_event(replica.endpoint, EventKind.SCALE, f"Draining replica {str(replica.pk)[:8]}: {reason}", replica=replica)
    return bool(changed)


def _after_commit_reconcile(endpoint: Endpoint) -> None:
    from endpoints.tasks import reconcile_endpoint

    endpoint_id = str(endpoint.pk)
    transaction.on_commit(lambda: reconcile_endpoint.delay(endpoint_id))


def _plain(values: dict) -> dict:
    return {key: (str(value) if not isinstance(value, (int, float, bool, str, type(None))) else value) for key, value in values.items()}
