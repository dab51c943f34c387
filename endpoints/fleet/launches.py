"""A node launch's life after the decision: joined, busy or idle, terminated, failed.

The one owner of `NodeLaunch` state and occupancy (node-hours, busy vs idle). The pool policy
(`endpoints.fleet.pools`) decides; registration (`endpoints.fleet.services.register_node`) reports a
join; both change launches only through here.

NOTE: a launch's times are PostgreSQL's clock (`database_now`), never a pod's: a join is stamped on a web pod and
judged on a worker, a deadline set by one worker's tick and judged by another's. A web pod 15 minutes behind had every
machine joining through it idle for 15 minutes at once, released before its replica was placed; a worker 15 minutes
behind gave its launches deadlines the others found passed, each machine terminated as late before it could join.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.db import transaction

from controlplane.clock import database_now
from endpoints.models import LIVE_REPLICA_STATES, Replica
from endpoints.nodes.models import LaunchState, Node, NodeLaunch
from endpoints.replicas import drain_each

logger = logging.getLogger(__name__)


def link_joined_node(node: Node, launch: NodeLaunch | None = None, now: datetime | None = None) -> NodeLaunch | None:
    """Mark the launch that `node` came from JOINED (by its one-use join token, or `launch` when the
    provider matched it by name); returns it, or None when the node came from no pool launch.

    NOTE: booting time (request to join) is added to the launch's idle seconds: it was paid for and
    served nothing. The node starts idle until a replica lands on it.
    """
    now = now or database_now()
    with transaction.atomic():
        query = NodeLaunch.objects.select_for_update().filter(
            node__isnull=True, state__in=[LaunchState.REQUESTED, LaunchState.LAUNCHING])
        if launch is not None:
            query = query.filter(pk=launch.pk)
        elif node.join_token_id is not None:
            query = query.filter(join_token_id=node.join_token_id)
        else:
            return None
        found = query.first()
        if found is None:
            return None
        found.node, found.state, found.joined_at = node, LaunchState.JOINED, now
        found.idle_s += max(0.0, (now - found.requested_at).total_seconds())
        found.idle_since = now
        found.save(update_fields=["node", "state", "joined_at", "idle_s", "idle_since"])
        ignored = node.keep_within_shape()  # its pool's shape, not what the machine said of itself
    if ignored:
        logger.warning("node %s of pool %s: what it registered past its pool's shape was ignored: %s",
                       node.name, found.pool_id, ignored)
        drain_unfitting_replicas(node, reason=f"its node was held to its pool's shape ({ignored})")
    return found


def drain_unfitting_replicas(node: Node, *, reason: str) -> int:
    """Drain the node's live replicas that its type and shape no longer hold (another GPU type's endpoint, a GPU past
    its count, more memory than their GPUs have); their endpoints are reconciled to replace them elsewhere.

    NOTE: a machine linked to its launch by name (a shared join token, `pools.link_joins`) was a node of the type and
    shape it claimed for up to a tick, and placement may have put another type's replica on it."""
    gpu_indices = {gpu["index"] for gpu in node.gpus} if node.gpus else set(range(node.num_gpus))
    unfitting = [
        replica
        for replica in Replica.objects.filter(node=node, state__in=LIVE_REPLICA_STATES).select_related("endpoint")
        if replica.endpoint.gpu_type != node.gpu_type
        or not set(replica.gpu_indices) <= gpu_indices
        or replica.reserved_memory_mb > node.gpu_memory_mb * max(len(replica.gpu_indices), 1)
    ]
    return drain_each(unfitting, reason=reason)


def record_launched(launch: NodeLaunch, provider_id: str, zone: str = "", now: datetime | None = None) -> bool:
    """The provider has the machine: REQUESTED becomes LAUNCHING (once; a retried answer changes nothing)."""
    now = now or database_now()
    changed = NodeLaunch.objects.filter(pk=launch.pk, state=LaunchState.REQUESTED).update(
        state=LaunchState.LAUNCHING, provider_id=provider_id[:255], zone=(zone or launch.zone)[:128], launched_at=now)
    if changed:
        launch.state, launch.provider_id, launch.zone, launch.launched_at = (
            LaunchState.LAUNCHING, provider_id[:255], (zone or launch.zone)[:128], now)
    return bool(changed)


def start_release(launch: NodeLaunch, reason: str) -> bool:
    """A joined launch's machine is to be terminated (its node cordoned and empty, or dead): RELEASING, once."""
    changed = NodeLaunch.objects.filter(pk=launch.pk, state=LaunchState.JOINED).update(
        state=LaunchState.RELEASING, reason=reason[:2000])
    if changed:
        launch.state, launch.reason = LaunchState.RELEASING, reason[:2000]
    return bool(changed)


def record_occupancy(launch: NodeLaunch, busy: bool, now: datetime | None = None) -> bool:
    """Start or end an idle spell of a joined launch's node; True if it changed."""
    now = now or database_now()
    if busy and launch.idle_since is not None:
        elapsed = max(0.0, (now - launch.idle_since).total_seconds())
        changed = NodeLaunch.objects.filter(pk=launch.pk, idle_since=launch.idle_since).update(
            idle_s=launch.idle_s + elapsed, idle_since=None)
        if changed:
            launch.idle_s, launch.idle_since = launch.idle_s + elapsed, None
        return bool(changed)
    if not busy and launch.idle_since is None:
        changed = NodeLaunch.objects.filter(pk=launch.pk, idle_since__isnull=True).update(idle_since=now)
        if changed:
            launch.idle_since = now
        return bool(changed)
    return False


def finish_launch(launch: NodeLaunch, state: LaunchState, reason: str = "", now: datetime | None = None) -> bool:
    """TERMINATED or FAILED, once: closes its idle spell so its node-hours stop growing; True if this call did it."""
    assert state in (LaunchState.TERMINATED, LaunchState.FAILED)
    now = now or database_now()
    with transaction.atomic():
        current = NodeLaunch.objects.select_for_update().filter(pk=launch.pk).exclude(
            state__in=[LaunchState.TERMINATED, LaunchState.FAILED]).first()
        if current is None:
            return False
        if current.idle_since is not None:
            current.idle_s += max(0.0, (now - current.idle_since).total_seconds())
        elif current.joined_at is None:
            current.idle_s += max(0.0, (now - current.requested_at).total_seconds())  # never joined: all idle
        current.idle_since, current.state, current.terminated_at = None, state, now
        current.reason = reason[:2000] or current.reason
        current.save(update_fields=["idle_s", "idle_since", "state", "terminated_at", "reason"])
    launch.refresh_from_db()
    return True
