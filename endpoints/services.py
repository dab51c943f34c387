"""Writes with side effects for endpoints: create, update, pause, resume, delete, and the event log."""

from __future__ import annotations

import re
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
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
    _clear_failures(endpoint)  # a new spec deserves a fresh try
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
    if Endpoint.objects.filter(pk=endpoint.pk).filter(Q(paused_at__isnull=False) | Q(failed_at__isnull=False)).update(
        paused_at=None, **FRESH_START,
    ):
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


# What a spec change or a resume resets: failures counted, backoff, giving up.
FRESH_START = {
    "num_identical_failures": 0, "last_failure_reason": "", "next_attempt_at": None, "failed_at": None,
    "status_message": "", "waiting_for_capacity": False,
}


def _clear_failures(endpoint: Endpoint) -> None:
    for name, value in FRESH_START.items():
        setattr(endpoint, name, value)


def failure_signature(reason: str) -> str:
    """A failure reason with its varying parts (numbers, addresses, ids) blanked, to tell repeats apart."""
    return re.sub(r"\d+", "#", reason.strip().splitlines()[-1] if reason.strip() else "")[-300:]


def record_replica_failure(endpoint_id, reason: str, *, permanent: bool = False) -> None:
    """Count a replica's failure against its endpoint: back off, and stop the endpoint when it repeats.

    The n-th identical failure in a row delays the next placement by base × 2^(n-1); the
    `REPLICA_MAX_IDENTICAL_FAILURES`-th (or one the agent calls permanent: the spec cannot run on
    this model) stops the endpoint as FAILED, with the reason as its status, until a spec change or
    a resume. A replica turning READY starts the count again (`record_replica_ready`).
    """
    now = timezone.now()
    reason = (reason.strip() or "engine failed")[-2000:]
    with transaction.atomic():
        endpoint = Endpoint.objects.select_for_update().filter(pk=endpoint_id, failed_at__isnull=True).first()
        if endpoint is None:
            return
        signature = failure_signature(reason)
        repeats = endpoint.num_identical_failures + 1 if signature == endpoint.last_failure_reason else 1
        short = reason.splitlines()[-1][-200:]
        fields = {"num_identical_failures": repeats, "last_failure_reason": signature}
        if permanent or repeats >= settings.REPLICA_MAX_IDENTICAL_FAILURES:
            fields.update(failed_at=now, next_attempt_at=None, waiting_for_capacity=False,
                          status_message=f"failed: {short}"[:300])
            message = (f"Endpoint failed: {short}; it stays stopped until its configuration changes or it is resumed"
                       if permanent else
                       f"Endpoint failed: {repeats} replicas in a row failed with the same reason ({short}); "
                       "it stays stopped until its configuration changes or it is resumed")
        else:
            delay_s = settings.REPLICA_RETRY_BASE_S * 2 ** (repeats - 1)
            fields.update(next_attempt_at=now + timedelta(seconds=delay_s),
                          status_message=f"replica failed ({short}); retrying in {delay_s:.0f} s"[:300])
            message = f"Next replica in {delay_s:.0f} s (failure {repeats} of {settings.REPLICA_MAX_IDENTICAL_FAILURES} allowed in a row)"
        Endpoint.objects.filter(pk=endpoint.pk).update(**fields)
        record_event(endpoint, EventKind.FAILURE, message, reason=short, repeats=repeats)


def record_replica_ready(endpoint_id) -> None:
    """A replica served: earlier failures no longer predict the next one."""
    Endpoint.objects.filter(pk=endpoint_id).filter(
        Q(num_identical_failures__gt=0) | Q(next_attempt_at__isnull=False)
    ).update(num_identical_failures=0, last_failure_reason="", next_attempt_at=None, status_message="")


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
