"""Giving machines back: a pool's idle nodes, and dead ones, are cordoned, terminated and retired.

Part of the pool tick (`endpoints.fleet.pools`): each joined launch's node is busy or idle
(`launches.record_occupancy`, node-hours); `pool_plan.nodes_to_release` picks the nodes empty past
the pool's idle timeout, down to min plus warm (a node placement never uses, its host refused, goes whatever they
say: `pool_demand.spare_launches`). Each is cordoned under its row lock after checking
again that it holds no replica (placement locks READY node rows too: a replica placed meanwhile keeps
the node), marked RELEASING and committed; the provider terminates it outside the transaction (a launch whose answer was lost,
with no provider id, by the machines listed under its launch id: `launch_machine_ids`); its
node then goes OFFLINE with its secret void and the launch TERMINATED. A RELEASING launch whose
termination failed is tried again every tick, unless the provider refused it as not this fleet's machine
(`NotThisFleets`: `INFERPLANE_FLEET_ID` changed since its launch, or its tags were edited): asking again cannot change
that, so the launch FAILS, audited (`node_launch.terminate_refused`) and logged as an ERROR, its machine left for an
operator to terminate by hand.

A joined node OFFLINE past another heartbeat grace period (the machine died) is terminated and
finished the same way, the reason saying so; its demand, if any, brings a replacement. `make run`
releases the local pool's machines whose agent `make stop` stopped at once (`release_stopped_machines`): those its
pool folder records, their process gone; never another `make run`'s (another folder, the same database).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction

from controlplane.accounts.services import SYSTEM, record_audit
from endpoints.fleet import launches
from endpoints.fleet.pool_demand import pool_counts
from endpoints.fleet.pool_plan import IdleNode, nodes_to_release
from endpoints.fleet.providers import pool_spec
from endpoints.fleet.providers.base import NotThisFleets, Provider, ProviderError
from endpoints.fleet.providers.local import LocalProvider
from endpoints.fleet.services import retire_node, set_node_state
from endpoints.models import ACTIVE_REPLICA_STATES, Replica
from endpoints.nodes.models import LaunchState, Node, NodeLaunch, NodePool
from gpu_agent.protocol import NodeState

logger = logging.getLogger(__name__)


def release_idle(pool: NodePool, provider: Provider, now: datetime) -> list[str]:
    """Occupancy, then release: returns the ids of launches terminated by this call."""
    joined = list(NodeLaunch.objects.filter(pool=pool, state=LaunchState.JOINED).select_related("node"))
    busy_nodes = set(Replica.objects.filter(node__in=[launch.node_id for launch in joined],
                                            state__in=ACTIVE_REPLICA_STATES).values_list("node_id", flat=True))
    for launch in joined:
        launches.record_occupancy(launch, launch.node_id in busy_nodes, now=now)
    # NOTE: OFFLINE is already a grace period of silence; one more, and the machine is taken for dead.
    dead_before = now - timedelta(seconds=2 * settings.NODE_HEARTBEAT_GRACE_S)
    for launch in joined:
        node = launch.node
        if node is None:
            reason = "its node was removed"  # by staff: the machine would run, paid for, unseen
        elif node.state == NodeState.OFFLINE and (node.last_heartbeat_at is None or node.last_heartbeat_at < dead_before):
            reason = f"node {node.name} stopped sending heartbeats"
        else:
            continue
        if launches.start_release(launch, reason):
            record_audit(SYSTEM, None, "node_launch.dead", launch, pool=pool.name, reason=reason)
    idle = [IdleNode(str(launch.pk), launch.idle_since.timestamp(), placeable=not launch.node.host_problem())
            for launch in joined if launch.state == LaunchState.JOINED and launch.idle_since is not None
            and launch.node is not None and launch.node.state == NodeState.READY]
    for launch_id in nodes_to_release(idle, pool_counts(pool), pool.idle_timeout_s, now.timestamp()):
        cordon_for_release(pool, launch_id)
    return finish_releases(pool, provider, now)


def cordon_for_release(pool: NodePool, launch_id: str) -> bool:
    """Cordon the launch's node and mark it RELEASING, unless a replica landed on it meanwhile."""
    with transaction.atomic():
        launch = NodeLaunch.objects.select_for_update().filter(pk=launch_id, state=LaunchState.JOINED).first()
        if launch is None or launch.node_id is None:
            return False
        # NOTE: the same row lock placement takes on READY nodes: after it, no replica can land here.
        node = Node.objects.select_for_update().filter(pk=launch.node_id, state=NodeState.READY).first()
        if node is None or Replica.objects.filter(node=node, state__in=ACTIVE_REPLICA_STATES).exists():
            return False
        reason = f"empty for {pool.idle_timeout_s} s (pool {pool.name})"
        if node.host_problem():
            reason = f"{reason}; the gateway refuses its registered host: {node.host_problem()}"
        set_node_state(SYSTEM, node, NodeState.CORDONED)
        launches.start_release(launch, reason)
        record_audit(SYSTEM, None, "node_launch.release", launch, pool=pool.name, node=node.name, reason=reason)
    return True


def release_stopped_machines(pool: NodePool, provider: LocalProvider, reason: str, now: datetime) -> list[str]:
    """Joined launches whose local agent `make stop` stopped are terminated, their nodes retired and their replicas
    replaced now, not two heartbeat grace periods later.

    NOTE: only a launch whose agent this machine's pool folder records, and whose process is gone: at `make run`'s
    start these records are the truth of this moment. A launch recorded nowhere here may be another `make run`'s
    (another data folder, the same database), its agent alive: it is judged by heartbeats (`release_idle`), as a
    cloud's machines are (a cloud's list may lag its machines)."""
    stopped = provider.stopped(pool_spec(pool))
    for launch in NodeLaunch.objects.filter(pool=pool, state=LaunchState.JOINED):
        if str(launch.pk) in stopped and launches.start_release(launch, reason):
            record_audit(SYSTEM, None, "node_launch.dead", launch, pool=pool.name, reason=reason)
    return finish_releases(pool, provider, now)


def finish_releases(pool: NodePool, provider: Provider, now: datetime) -> list[str]:
    """Terminate every RELEASING launch's machine (outside any transaction), retire its node, finish it."""
    finished = []
    for launch in NodeLaunch.objects.filter(pool=pool, state=LaunchState.RELEASING).select_related("node"):
        try:
            for provider_id in launch_machine_ids(pool, provider, launch):
                provider.terminate(pool_spec(pool), provider_id)
        except NotThisFleets as error:
            give_up_release(pool, launch, str(error), now)
            continue
        except ProviderError as error:
            logger.warning("node pool %s: terminating %s failed, trying again next tick: %s", pool.name, launch.pk, error)
            continue
        if launch.node is not None:
            retire_node(SYSTEM, launch.node, reason=launch.reason)
        if launches.finish_launch(launch, LaunchState.TERMINATED, launch.reason, now=now):
            record_audit(SYSTEM, None, "node_launch.terminate", launch, pool=pool.name, reason=launch.reason)
            finished.append(str(launch.pk))
    return finished


def launch_machine_ids(pool: NodePool, provider: Provider, launch: NodeLaunch) -> list[str]:
    """The provider ids of the launch's machine: the one its answer gave, else those the provider lists under its launch
    id; raises `ProviderError` when the list fails (the machine is then never taken for gone).

    NOTE: a launch whose answer was lost has no provider id, and its machine may have started: one still booting at its
    deadline, or one that joined by its token before the launch was sent again (JOINED, so never sent again). Released
    with no termination asked for, it ran on, paid for, its agent retired, and the stray sweep passes it over (its
    launch record exists)."""
    if launch.provider_id:
        return [launch.provider_id]
    return [machine.provider_id for machine in provider.list(pool_spec(pool)) if machine.launch_id == str(launch.pk)]


def give_up_release(pool: NodePool, launch: NodeLaunch, refusal: str, now: datetime) -> None:
    """The provider refuses to terminate the launch's machine as not this fleet's: its node is retired (its agent
    turned away), the launch FAILED, audited and logged once, and the machine left running for an operator."""
    reason = (f"the provider refused to terminate machine {launch.provider_id}: {refusal}. Was INFERPLANE_FLEET_ID "
              f"changed since its launch? Terminate the machine by hand.")
    if launch.node is not None:
        retire_node(SYSTEM, launch.node, reason=reason)
    if launches.finish_launch(launch, LaunchState.FAILED, reason, now=now):
        logger.error("node pool %s: launch %s: %s", pool.name, launch.pk, reason)
        record_audit(SYSTEM, None, "node_launch.terminate_refused", launch, pool=pool.name,
                     provider_id=launch.provider_id, reason=reason)
