"""Demand on node pools: which pool's machines an endpoint's unplaced replicas wait for, and how big they are.

Read by the scheduler (an endpoint whose pool will bring a node shows `provisioning a node`, and its
calls are held rather than refused) and by the pool tick (`endpoints.fleet.pools`), so both agree
on which pool serves an endpoint: of the pools of its GPU type whose machines can hold a replica,
the cheapest with room (or a machine on its way), else the cheapest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from django.db import transaction
from django.db.models import Count, Q

from controlplane.tasks import send_task
from endpoints.events import record_event, record_event_once
from endpoints.fleet.pool_plan import Need, NodeShape, PoolCounts
from endpoints.models import ACTIVE_REPLICA_STATES, Endpoint, EventKind, Replica
from endpoints.nodes.models import LaunchState, NodeLaunch, NodePool
from endpoints.placement import choose_node, memory_needed_mb, smallest_gpu_count
from gpu_agent.protocol import NodeState

# NOTE: sent by name (the task lives in `endpoints.tasks`, which imports the scheduler).
PROVISION_TASK = "endpoints.provision_nodes"
# What a held request sees as progress (an SSE comment) while a pool brings a node for it.
PROVISIONING_MESSAGE = "provisioning a node"
BOOTING_STATES = (LaunchState.REQUESTED, LaunchState.LAUNCHING)
COUNTED_STATES = (*BOOTING_STATES, LaunchState.JOINED)


def need_of(endpoint: Endpoint) -> Need:
    """One replica of `endpoint` as a pool plan sees it: what placement would reserve, whole GPUs."""
    memory_mb = memory_needed_mb(endpoint)
    if endpoint.gpu_type == "cpu":
        return Need(str(endpoint.pk), memory_mb, 0)
    return Need(str(endpoint.pk), memory_mb, endpoint.gpus_per_replica or smallest_gpu_count(endpoint, memory_mb) or 1)


def pool_shape(pool: NodePool) -> NodeShape:
    return NodeShape(num_gpus=pool.gpus_per_node if pool.gpu_type != "cpu" else 0, gpu_memory_mb=pool.gpu_memory_mb)


def pool_counts(pool: NodePool) -> PoolCounts:
    """The pool's live, booting, empty (`spare_launches`) and unusable (`unusable_launches`) machines."""
    totals = NodeLaunch.objects.filter(pool=pool, state__in=COUNTED_STATES).aggregate(
        num_live=Count("pk"), num_booting=Count("pk", filter=Q(state__in=BOOTING_STATES)))
    return PoolCounts(min_nodes=pool.min_nodes, max_nodes=pool.max_nodes, warm_nodes=pool.warm_nodes,
                      num_live=totals["num_live"], num_booting=totals["num_booting"],
                      num_empty=len(spare_launches(pool)), num_unusable=len(unusable_launches(pool)))


def spare_launches(pool: NodePool) -> list[NodeLaunch]:
    """The pool's joined machines placement could give a replica now: READY, no active replica, and a registered
    host the gateway may reach (`Node.host_problem`, the rule `placement.choose_node` applies).

    NOTE: a machine whose host the gateway refuses is no spare capacity: counted as empty it was the pool's warm
    machine, kept for ever, and a pool at its maximum never launched a usable one (`pool_plan.nodes_to_release`
    releases it instead)."""
    busy_nodes = Replica.objects.filter(state__in=ACTIVE_REPLICA_STATES).values("node_id")
    empty = NodeLaunch.objects.filter(pool=pool, state=LaunchState.JOINED, node__state=NodeState.READY).exclude(
        node_id__in=busy_nodes).select_related("node")
    return [launch for launch in empty if not launch.node.host_problem()]


def unusable_launches(pool: NodePool) -> list[NodeLaunch]:
    """The pool's joined machines placement never gives a replica: a registered host the gateway refuses
    (`Node.host_problem`), busy or not.

    NOTE: counted toward `min_nodes`, such a machine was the pool's minimum until its idle timeout released it: no
    usable one was launched meanwhile (`pool_plan.plan_launches` launches one at once now)."""
    joined = NodeLaunch.objects.filter(pool=pool, state=LaunchState.JOINED, node__isnull=False).select_related("node")
    return [launch for launch in joined if launch.node.host_problem()]


def choose_pool(need: Need, pools: Iterable[tuple[NodePool, PoolCounts]]) -> NodePool | None:
    """The pool that serves `need`: cheapest with room or a machine booting, else cheapest that fits; None if none fits."""
    fitting = sorted(((pool, counts) for pool, counts in pools if need.fits(pool_shape(pool))),
                     key=lambda item: (item[0].hourly_price, item[0].name))
    if not fitting:
        return None
    with_room = [pool for pool, counts in fitting if counts.num_live < counts.max_nodes or counts.num_booting]
    return with_room[0] if with_room else fitting[0][0]


def spare_takes(endpoint: Endpoint, need: Need, launch: NodeLaunch) -> bool:
    """Whether placement (`placement.choose_node`, its one rule) puts a replica of `endpoint` on the empty machine of
    `launch` (one of `spare_launches`)."""
    return choose_node(endpoint, need.memory_mb, [launch.node], {}, {}).node is not None


def serving_pool(endpoint: Endpoint, need: Need, pools: list[tuple[NodePool, PoolCounts]],
                 spares: dict[int, list[NodeLaunch]]) -> tuple[NodePool | None, Need]:
    """The pool that serves one more replica of `endpoint` (`choose_pool`), and the need as that pool's plan counts it.

    `spares`: each pool's `spare_launches`. A pool whose empty machines placement refuses the replica on (its
    quantization, an agent older than it needs), one of them launched under the pool's definition as it stands
    (`NodePool.updated_at`: a new machine would be the same), is passed over for the next: a new one would refuse it
    too. Where every empty machine refusing it predates the definition, the pool launches for it (`Need.on_empty`
    False). NOTE: counted against those machines, the cheaper pool took the demand, and the pool that would serve it
    (a pricier one, or a new machine of an upgraded template) never launched: its calls got a 503 for ever. Where
    every pool would refuse it, the cheapest holds it against its empty machines and launches nothing for it."""
    refused, launch_for = set(), set()
    for pool, _ in pools:
        empty = spares.get(pool.pk, [])
        if not empty or any(spare_takes(endpoint, need, launch) for launch in empty):
            continue
        if any(launch.requested_at >= pool.updated_at for launch in empty):
            refused.add(pool.pk)
        else:
            launch_for.add(pool.pk)
    chosen = choose_pool(need, [(pool, counts) for pool, counts in pools if pool.pk not in refused])
    if chosen is None:
        return choose_pool(need, pools), need
    return chosen, dataclasses.replace(need, on_empty=chosen.pk not in launch_for)


def provisioning_pool(endpoint: Endpoint) -> NodePool | None:
    """The pool that will bring a node for one more replica of `endpoint`, or None (no pool, none fits it, its pool is
    at its maximum with nothing booting, or one of its machines stands empty that the replica may go on: placement, if
    it refused it there, would refuse a new one of the pool as well, and the pool launches none (`serving_pool`,
    `pool_plan.plan_launches`); the endpoint says why placement refused instead of "provisioning a node")."""
    pools = [(pool, pool_counts(pool)) for pool in NodePool.objects.filter(gpu_type=endpoint.gpu_type)]
    if not pools:
        return None
    spares = {pool.pk: spare_launches(pool) for pool, _ in pools}
    chosen, need = serving_pool(endpoint, need_of(endpoint), pools, spares)
    if chosen is None:
        return None
    counts = dict((pool.pk, counts) for pool, counts in pools)[chosen.pk]
    if need.on_empty and counts.num_empty:
        return None
    return chosen if counts.num_live < counts.max_nodes or counts.num_booting else None


def request_provisioning() -> None:
    """Run the pool tick once the current transaction commits, rather than at the next beat."""
    transaction.on_commit(lambda: send_task(PROVISION_TASK, expires=60), robust=True)  # the beat's tick too


def tell_endpoints(endpoint_ids: Iterable[str], message: str, *, once: bool = False) -> None:
    """A pool decision in the event log (CAPACITY) of each endpoint waiting on it; `once`: not again
    while it says the same."""
    for endpoint in Endpoint.objects.filter(pk__in=list(endpoint_ids)):
        (record_event_once if once else record_event)(endpoint, EventKind.CAPACITY, message)
