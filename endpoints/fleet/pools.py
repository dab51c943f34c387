"""The node-pool policy: launch machines for replicas that have nowhere to go, release idle ones.

One tick (Celery beat, every `NODE_POOLS_TICK_S`, and at once when the scheduler records new
demand) runs over every pool:

1. joins: a booting launch whose agent registered (by its join token, or the name the provider
   reports) is JOINED (`launches.link_joined_node`);
2. deadlines: a launch not joined by its deadline is terminated and FAILED with the reason, in the
   event log of the endpoints waiting on the pool; their demand remains, so step 3 replaces it in
   another zone;
3. launches: the endpoints' unplaced replicas (`Endpoint.unplaced_replicas`) become `Need`s,
   `pool_plan.plan_launches` says how many machines, and the `NodeLaunch` rows are written under
   the pool's row lock and committed BEFORE the provider is called (outside any transaction, with the
   launch id as its idempotency key); a REQUESTED launch a crashed tick left behind is sent again;
4. occupancy and release (`endpoints.fleet.pool_release`).

NOTE: the whole tick holds a Redis lock and each pool's decision its row lock, so two beats never
launch twice for the same demand. The pools are taken least recently started first (`turn_order`): a provider slower
than the tick's time limit has the worker killed inside its pool's turn, and in a fixed order the pools after it never
had one (their demand never launched, their idle machines never released, paid for).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timedelta

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import transaction
from django.db.models import F

from controlplane.accounts.services import SYSTEM, record_audit
from controlplane.clock import database_now
from controlplane.redis_client import as_text, get_redis, held_alone, redis_time
from controlplane.redis_keys import POOLS_TICK_LOCK_KEY, POOLS_TICK_STARTED_KEY
from endpoints import quota_room
from endpoints.fleet import launches, pool_release
from endpoints.fleet.pool_demand import (
    BOOTING_STATES,
    need_of,
    pool_counts,
    pool_shape,
    serving_pool,
    spare_launches,
    tell_endpoints,
)
from endpoints.fleet.pool_plan import LaunchPlan, Need, PoolCounts, plan_launches
from endpoints.fleet.providers import get_provider, pool_spec
from endpoints.fleet.providers.base import LaunchSpec, Provider, ProviderError, ProviderUnreachable
from endpoints.fleet.services import create_join_token, revoke_join_token
from endpoints.models import Endpoint
from endpoints.nodes.models import LaunchState, Node, NodeLaunch, NodePool

logger = logging.getLogger(__name__)

# The tick's task time limit is below this, so a lock still held belongs to a tick that is alive.
TICK_LOCK_S = 150
# After the provider refused a launch in every zone, the pool waits this long before asking again
# (a quota or a sold-out zone is not fixed by asking every tick).
REFUSAL_BACKOFF_S = 60
REFUSED = "the provider refused"


def provision_tick(now: datetime | None = None, provider_for: Callable[[str], Provider] = get_provider) -> int:
    """One pass over every pool; returns how many machines it asked for. A second concurrent tick does nothing.

    `provider_for` maps a pool's provider name to the provider (`providers.get_provider`).
    """
    with held_alone(POOLS_TICK_LOCK_KEY, TICK_LOCK_S) as held:
        if not held:
            return 0
        pools = list(NodePool.objects.order_by("pk"))
        demand = assign_demand(pools)
        num_launched = 0
        for pool in turn_order(pools):
            start_turn(pool)  # NOTE: before it: a killed turn counts
            try:
                num_launched += tick_pool(pool, demand.get(pool.pk, []), provider_for(pool.provider), now=now)
            except SoftTimeLimitExceeded:
                # NOTE: the task's time is up (an Exception): taken for one pool's failure, the next pool's turn began
                # with the seconds left before the hard limit killed the worker in the middle of it (a machine asked
                # for, its launch never marked), and that pool went last next time
                raise
            except Exception:  # noqa: BLE001 - one broken pool (a provider down) must not stall the others
                logger.exception("node pool %s: tick failed", pool.name)
        return num_launched


def turn_order(pools: list[NodePool], started_key: str = POOLS_TICK_STARTED_KEY) -> list[NodePool]:
    """`pools`, the one whose turn started least recently first (one never started, first of all, by id); forgets
    the pools deleted since. `started_key`: the hash of the turns' starts (`start_turn`), the tick's or the stray
    sweep's (`POOLS_SWEEP_STARTED_KEY`).

    NOTE: the tick task's time limit kills its worker inside a provider's call that outlasts it (EC2 retried at 30 s
    a try): in the order of their ids, the pools after a slow one never got a turn. Marked when its turn starts, the
    slow pool goes last at the next tick."""
    started = {as_text(key): float(value) for key, value in get_redis().hgetall(started_key).items()}
    gone = set(started) - {str(pool.pk) for pool in pools}
    if gone:
        get_redis().hdel(started_key, *gone)
    return sorted(pools, key=lambda pool: (started.get(str(pool.pk), 0.0), pool.pk))


def start_turn(pool: NodePool, started_key: str = POOLS_TICK_STARTED_KEY) -> None:
    """`pool`'s turn starts now (Redis's clock), for `turn_order`."""
    get_redis().hset(started_key, str(pool.pk), redis_time())


def assign_demand(pools: list[NodePool]) -> dict[int, list[Need]]:
    """Every unplaced replica of a live endpoint that its organisation's quota lets it hold, as a `Need` of the pool
    that serves it (`serving_pool`: an empty machine placement refuses it on holds none of its demand).

    NOTE: an organisation's endpoints together ask for no more than its quota has room for (`quota_room.ReplicaRoom`),
    oldest endpoints first. Each endpoint's own check counted the replicas held, not those waiting for a machine: a
    tenant allowed two replicas had the fleet launch a machine for each of its endpoints, machines placement then
    gave none of its replicas (the quota refused them), paid for until their idle timeout."""
    by_type: dict[str, list[tuple[NodePool, PoolCounts]]] = defaultdict(list)
    for pool in pools:
        by_type[pool.gpu_type].append((pool, pool_counts(pool)))
    waiting = Endpoint.objects.live().filter(
        unplaced_replicas__gt=0, paused_at__isnull=True, failed_at__isnull=True, gpu_type__in=list(by_type)
    ).select_related("organization__plan")
    demand: dict[int, list[Need]] = defaultdict(list)
    rooms: dict[int, quota_room.ReplicaRoom] = {}
    spares = {pool.pk: spare_launches(pool) for pool in pools} if waiting.exists() else {}
    for endpoint in waiting.order_by("created_at", "pk"):
        pool, need = serving_pool(endpoint, need_of(endpoint), by_type[endpoint.gpu_type], spares)
        if pool is None:
            # NOTE: no pool's machine holds it: it is told so (`plan_launches`'s unplaceable) and takes none of its
            # organisation's room. Taken, oldest first, it kept a newer endpoint a machine would hold waiting for ever.
            cheapest = min((pool for pool, _ in by_type[endpoint.gpu_type]), key=lambda pool: (pool.hourly_price, pool.name))
            demand[cheapest.pk].extend([need] * endpoint.unplaced_replicas)
            continue
        room = rooms.get(endpoint.organization_id) or rooms.setdefault(
            endpoint.organization_id, quota_room.replica_room(endpoint.organization))
        num_needed = min(endpoint.unplaced_replicas, room.num_more(endpoint.gpu_type, endpoint.gpus_per_replica))
        if not num_needed:
            continue
        room.take(endpoint.gpu_type, endpoint.gpus_per_replica, num_needed)
        demand[pool.pk].extend([need] * num_needed)
    return demand


def tick_pool(pool: NodePool, needs: list[Need], provider: Provider, now: datetime | None = None) -> int:
    """The pool's joins, late launches, launches for `needs`, occupancy and releases; returns how many it launched."""
    now = now or database_now()
    link_joins(pool, provider, now)
    fail_late_launches(pool, provider, needs, now)
    num_launched = launch_for_demand(pool, provider, needs, now)
    pool_release.release_idle(pool, provider, now)
    return num_launched


def link_joins(pool: NodePool, provider: Provider, now: datetime) -> None:
    """Booting launches whose agent registered become JOINED: by join token, else by the machine's node name."""
    booting = list(NodeLaunch.objects.filter(pool=pool, state__in=BOOTING_STATES, node__isnull=True))
    if not booting:
        return
    unlinked = Node.objects.filter(launch__isnull=True)
    machines = {}
    if any(launch.state == LaunchState.LAUNCHING for launch in booting):
        try:
            machines = {machine.launch_id: machine for machine in provider.list(pool_spec(pool))}
        except ProviderError as error:
            logger.warning("node pool %s: could not list machines: %s", pool.name, error)
    for launch in booting:
        node = unlinked.filter(join_token_id=launch.join_token_id).first() if launch.join_token_id else None
        machine, contested = machines.get(str(launch.pk)), []
        if node is None and machine is not None and machine.node_name:
            # NOTE: the first node registered under the machine's name since its launch is its agent; a later one is
            # someone else holding the shared token (a DaemonSet's) who claims the name. Before, the newest was linked:
            # registering under a booting machine's name took it over (its launch, idle timeout and release), and the
            # machine's own node was left out of its pool. A retired node (its secret void) claims nothing: staff
            # retiring a claimant that came first leave the machine to the next. Where the provider knows the hosts
            # of the agents on the machine (Kubernetes: its agent pod's IP), only a node advertising one claims it:
            # one registered under the name before the machine's agent, at another host, is not linked meanwhile; nor
            # any while the provider knows of no agent host on the machine yet (its pod starting: `agent_hosts` empty).
            claimants = unlinked.filter(name=machine.node_name, registered_at__gte=launch.requested_at).exclude(
                secret_digest="").order_by("registered_at", "pk")
            # NOTE: of those at the agent's host, only one that has heartbeated since it registered: an agent whose
            # registration's answer was lost (an ingress's timeout after the commit) registers again there, and the
            # first node, whose secret nobody holds, never heartbeats. Before, that dead node was linked, and the live
            # one ran outside the pool. The agent heartbeats at once after registering: the join waits one beat.
            eligible = claimants if machine.agent_hosts is None else claimants.filter(
                advertise_host__in=machine.agent_hosts, last_heartbeat_at__gt=F("registered_at"))
            if machine.pod_bound:  # NOTE: Kubernetes: only a registration by an agent pod on it (`Machine.pod_bound`)
                # NOTE: and one heartbeat since, its hosts known or not: while the agent pods cannot be listed, an agent
                # whose registration's answer was lost registered twice with its pod's token, and the first (dead) node
                # was linked.
                eligible = eligible.exclude(agent_pod_uid="").filter(last_heartbeat_at__gt=F("registered_at"))
            node = eligible.first()
            if node is not None:
                contested = [str(pk) for pk in claimants.exclude(pk=node.pk).values_list("pk", flat=True)[:10]]
        if node is not None and launches.link_joined_node(node, launch, now=now):
            record_audit(SYSTEM, None, "node_launch.join", launch, pool=pool.name, node=node.name,
                         **({"also_claimed_by": contested} if contested else {}))
            if contested:
                logger.warning("node pool %s: launch %s linked to node %s, the first registered as %s; also claimed by "
                               "nodes %s (a shared join token's holder?)", pool.name, launch.pk, node.pk, node.name,
                               ", ".join(contested))


def fail_late_launches(pool: NodePool, provider: Provider, needs: list[Need], now: datetime) -> None:
    """A launch not joined by its deadline: terminated, FAILED with the reason, and the endpoints
    waiting on the pool are told; their demand stays, so the plan replaces it (in another zone)."""
    late = list(NodeLaunch.objects.filter(pool=pool, state__in=BOOTING_STATES, deadline_at__lte=now).select_related("join_token"))
    for launch in late:
        reason = f"did not join within {pool.join_deadline_s} s"
        try:
            # NOTE: one the provider never answered for may still have started: found by its launch id.
            for provider_id in pool_release.launch_machine_ids(pool, provider, launch):
                provider.terminate(pool_spec(pool), provider_id)
        except ProviderError as error:
            logger.warning("node pool %s: terminating late launch %s: %s", pool.name, launch.pk, error)
            continue  # tried again next tick: a machine is never forgotten while it may run
        if launch.join_token_id:
            revoke_join_token(SYSTEM, launch.join_token)  # a late agent must not join a finished launch
        if launches.finish_launch(launch, LaunchState.FAILED, reason, now=now):
            where = f" in zone {launch.zone}" if launch.zone else ""
            record_audit(SYSTEM, None, "node_launch.fail", launch, pool=pool.name, reason=reason, zone=launch.zone)
            tell_endpoints(
                {need.endpoint_id for need in needs},
                f"Node {str(launch.pk)[:8]} of pool {pool.name}{where} {reason}: terminated, launching a replacement")


def launch_for_demand(pool: NodePool, provider: Provider, needs: list[Need], now: datetime) -> int:
    """Decide under the pool's row lock, commit the launches, then ask the provider (outside the transaction)."""
    settle_s = settings.AUTOSCALER_TICK_S * 2 + 1
    with transaction.atomic():
        locked = NodePool.objects.select_for_update(skip_locked=True).filter(pk=pool.pk).first()
        if locked is None:
            return 0  # another tick is deciding for this pool right now
        # NOTE: REQUESTED launches at this point were left by a tick that died before the provider answered.
        orphaned = list(NodeLaunch.objects.filter(pool=pool, state=LaunchState.REQUESTED))
        counts = settled_counts(locked, now - timedelta(seconds=settle_s))
        plan = plan_launches(needs, pool_shape(locked), counts)
        if plan.num_launch and backing_off(locked, provider, now):
            plan = LaunchPlan(0, f"the provider refused recent launches in every zone: waiting {REFUSAL_BACKOFF_S} s",
                              plan.unplaceable)
        created = [create_launch(locked, provider, now, plan.reason) for _ in range(plan.num_launch)]
        waiting = {need.endpoint_id for need in needs} - {need.endpoint_id for need in plan.unplaceable}
        if waiting and (plan.num_launch or counts.num_live + plan.num_launch >= counts.max_nodes or counts.num_empty):
            tell_endpoints(waiting, f"Pool {locked.name}: {plan.reason}", once=not plan.num_launch)
        if plan.unplaceable:
            tell_endpoints({need.endpoint_id for need in plan.unplaceable},
                           f"Pool {locked.name}: no machine of this pool can hold a replica "
                           f"({locked.gpu_memory_mb} MB per {'GPU' if locked.gpus_per_node else 'machine'})", once=True)
    tokens = dict(created)
    for launch in orphaned:
        tokens[launch] = reissue_token(launch)
    for launch, plain in tokens.items():
        send_launch(locked, provider, launch, plain)
    return len(created)


def backing_off(pool: NodePool, provider: Provider, now: datetime) -> bool:
    """Whether the provider refused as many launches of the pool as it has zones, within the backoff."""
    num_refused = NodeLaunch.objects.filter(pool=pool, state=LaunchState.FAILED, reason__startswith=REFUSED,
                                            terminated_at__gt=now - timedelta(seconds=REFUSAL_BACKOFF_S)).count()
    return num_refused >= len(provider.zones(pool.template) or [""])


def settled_counts(pool: NodePool, joined_after: datetime) -> PoolCounts:
    """`pool_counts`, with nodes that joined since `joined_after` and are still empty counted as booting:
    the scheduler has not had a tick to place the replicas they came for."""
    counts = pool_counts(pool)
    num_fresh = sum(launch.joined_at is not None and launch.joined_at > joined_after and launch.idle_since is not None
                    for launch in spare_launches(pool))
    return PoolCounts(min_nodes=counts.min_nodes, max_nodes=counts.max_nodes, warm_nodes=counts.warm_nodes,
                      num_live=counts.num_live, num_booting=counts.num_booting + num_fresh,
                      num_empty=counts.num_empty - num_fresh, num_unusable=counts.num_unusable)


def create_launch(pool: NodePool, provider: Provider, now: datetime, reason: str) -> tuple[NodeLaunch, str]:
    """A REQUESTED launch with its one-use join token (expiring at the deadline); returns it and the token."""
    deadline_at = now + timedelta(seconds=pool.join_deadline_s)
    launch = NodeLaunch(pool=pool, requested_at=now, deadline_at=deadline_at, zone=choose_zone(pool, provider),
                        reason=reason[:2000])
    token = create_join_token(SYSTEM, name=f"pool {pool.name} {str(launch.pk)[:8]}", expires_at=deadline_at, max_uses=1)
    launch.join_token = token.join_token
    launch.save()
    record_audit(SYSTEM, None, "node_launch.request", launch, pool=pool.name, zone=launch.zone, reason=reason[:300])
    return launch, token.plain


def reissue_token(launch: NodeLaunch) -> str:
    """A fresh one-use token for a launch sent again (the first one's plain text was never stored).

    NOTE: the first token is left to expire at the deadline: if the machine did start with it, its
    agent still registers, and `link_joins` finds it by the name the provider reports.
    """
    token = create_join_token(SYSTEM, name=f"pool {launch.pool.name} {str(launch.pk)[:8]}",
                              expires_at=launch.deadline_at, max_uses=1)
    NodeLaunch.objects.filter(pk=launch.pk).update(join_token=token.join_token)
    launch.join_token = token.join_token
    return token.plain


def choose_zone(pool: NodePool, provider: Provider) -> str:
    """The provider's first zone, avoiding the one where this pool's latest launch failed."""
    zones = provider.zones(pool.template) or [""]
    failed = NodeLaunch.objects.filter(pool=pool, state=LaunchState.FAILED).order_by("-terminated_at").values_list(
        "zone", flat=True).first()
    return next((zone for zone in zones if zone != failed), zones[0])


def node_name(pool: NodePool, launch: NodeLaunch) -> str:
    return f"{pool.name}-{str(launch.pk)[:8]}"


def send_launch(pool: NodePool, provider: Provider, launch: NodeLaunch, join_token: str) -> None:
    """Ask the provider for the launch's machine (idempotent on its id): LAUNCHING, or FAILED with why."""
    spec = LaunchSpec(launch_id=str(launch.pk), name=node_name(pool, launch), join_token=join_token,
                      control_plane_url=settings.AGENT_CONTROL_PLANE_URL, zone=launch.zone)
    try:
        [result] = provider.launch(pool_spec(pool), [spec])
    except ProviderUnreachable as error:
        # NOTE: the machine may have started (the answer was lost): failing the launch forgot it, and it ran unseen,
        # paid for, its agent turned away. Left REQUESTED, it is sent again next tick (the same machine: launches are
        # idempotent on the launch id), and one still unanswered at its deadline is found by its id and terminated.
        logger.warning("node pool %s: launch %s got no answer (%s); sending it again", pool.name, launch.pk, error)
        return
    except ProviderError as error:
        result_error, provider_id, zone = str(error), "", ""
    else:
        result_error, provider_id, zone = result.error, result.provider_id, result.zone
    if provider_id:
        launches.record_launched(launch, provider_id, zone)
        record_audit(SYSTEM, None, "node_launch.launch", launch, pool=pool.name, provider_id=provider_id)
        return
    reason = f"{REFUSED}: {result_error or 'no machine'}"
    if launches.finish_launch(launch, LaunchState.FAILED, reason):
        record_audit(SYSTEM, None, "node_launch.fail", launch, pool=pool.name, reason=reason)
