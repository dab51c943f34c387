"""Reconciling an endpoint: bring its active replicas to the desired count."""

from __future__ import annotations

import logging

from django.db import transaction

from endpoints.models import Endpoint, EventKind, Replica
from endpoints.placement import place_replica
from endpoints.services import drain_replica, record_event
from gpu_agent.protocol import ReplicaState

logger = logging.getLogger(__name__)


def desired_replicas(endpoint: Endpoint) -> int:
    if endpoint.paused_at is not None or endpoint.deleted_at is not None:
        return 0
    return endpoint.min_replicas


def reconcile_endpoint(endpoint_id: str) -> None:
    """Place missing replicas and drain surplus ones. Safe to run twice or concurrently."""
    with transaction.atomic():
        endpoint = Endpoint.objects.select_for_update(skip_locked=True).filter(pk=endpoint_id).first()
        if endpoint is None:  # gone, or another worker is reconciling it right now
            return
        wanted = desired_replicas(endpoint)
        serving = list(
            Replica.objects.filter(endpoint=endpoint, state__in=[ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.READY])
            .order_by("-created_at")
        )
        message = ""
        for _ in range(wanted - len(serving)):
            replica, reason = place_replica(endpoint)
            if replica is None:
                message = f"waiting for capacity: {reason}"
                break
            record_event(endpoint, EventKind.SCALE, f"Replica {str(replica.pk)[:8]} {reason}", replica=replica)
        surplus = serving[: max(0, len(serving) - wanted)]
        for replica in surplus:
            drain_replica(replica, reason="scale down")
        if endpoint.status_message != message:
            if message:
                record_event(endpoint, EventKind.CAPACITY, message)
            Endpoint.objects.filter(pk=endpoint.pk).update(status_message=message)
