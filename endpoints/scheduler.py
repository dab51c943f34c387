"""Reconciling endpoints: bring each one's replicas to what the autoscaler wants.

Run by the autoscaler tick (Celery beat, every `INFERPLANE_AUTOSCALER_TICK_S`),
at once when a cold request wakes an endpoint, and after every spec change.
Safe to run twice or concurrently: an endpoint is reconciled under
`select_for_update(skip_locked=True)`, so a second runner skips it. The
replicas themselves change through `endpoints.replicas`.

Sleep mode (an endpoint's `idle_action` "sleep"): a READY replica let go sleeps rather than drains
(`replicas.sleep_replica`), a replica wanted wakes a sleeping one before any is placed
(`replicas.wake_replica`), and one asleep too long stops (`replicas.stop_long_sleepers`).
"""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import transaction
from django.db.models import Count, DurationField, ExpressionWrapper, F, Q
from django.db.models.functions import Now

from controlplane import redis_keys
from controlplane.accounts.services import SYSTEM, record_audit
from controlplane.clock import database_time_ago
from controlplane.redis_client import get_redis, held_alone, redis_time
from controlplane.redis_keys import FLEET_SILENT_SINCE_KEY, LISTENING_SINCE_KEY, TICK_LOCK_KEY
from controlplane.redis_scripts import Script
from controlplane.tasks import send_task
from endpoints import autoscaler, quotas
from endpoints.batches.demand import read_demand
from endpoints.events import record_event, record_event_once
from endpoints.fleet.pool_demand import PROVISIONING_MESSAGE, provisioning_pool, request_provisioning
from endpoints.gateway import presence, traffic
from endpoints.models import (
    LIVE_REPLICA_STATES,
    SERVING_REPLICA_STATES,
    Endpoint,
    EventKind,
    IdleAction,
    Replica,
)
from endpoints.nodes.models import Node, NodeSweep
from endpoints.quota_room import idle_caps, replica_room
from endpoints.replicas import (
    RECONCILE_TASK,
    drain_replica,
    fail_replica,
    fail_replica_and_count,
    lock_nodes_to_wake,
    place_replica,
    sleep_replicas,
    stop_long_sleepers,
    wake_replica,
)
from gpu_agent.protocol import NodeState, ReplicaState

logger = logging.getLogger(__name__)

# Surplus replicas drain in this order: not started yet first, serving last.
DRAIN_ORDER = {ReplicaState.PENDING: 0, ReplicaState.STARTING: 1, ReplicaState.READY: 2}
# An idle deadline's reconcile runs this long after it (`schedule_idle_deadlines`).
IDLE_DEADLINE_MARGIN_S = 0.05


class _OrganizationHeld(Exception):
    """A reconcile's scale-up, or its over-quota grace's stamp (`quotas.over_quota`), found its organisation's row held
    by another write: rolled back, to wait for it holding nothing (`reconcile_endpoint`)."""


def reconcile_endpoint(endpoint_id: str, load: autoscaler.Load | None = None, *,
                       now: float | None = None, in_a_tick: bool = False) -> autoscaler.Decision | None:
    """Place missing replicas and drain surplus ones, for the `load` read at `now` (Redis's clock; both read here
    when None). `in_a_tick` (the autoscaler's pass over every endpoint): a scale-up whose organisation's row another
    write holds is left to the next tick rather than waited for; the endpoint's own task (a wake, a spec change)
    waits for it, holding nothing, then reconciles again with the organisation's row taken first.

    NOTE: no reconcile waits for its organisation's row while it holds its endpoint's. It did: the task held the
    endpoint's row behind a key revocation (12 s with 3,000 minted keys), and a heartbeat reporting a replica of that
    endpoint failed or READY (which take the endpoint's row) waited behind both: the node's whole heartbeat, every
    tenant's replicas on it, past its agent's 10 s timeout, and the node taken OFFLINE after a few
    (`tests/test_replica_lock_order.py`)."""
    try:
        return _reconcile(endpoint_id, load, now=now, in_a_tick=in_a_tick)
    except _OrganizationHeld:
        pass
    # NOTE: the load and the clock read again unless given: the wait may have been seconds long.
    return _reconcile(endpoint_id, load, now=now, in_a_tick=False, organization_first=True)


def _reconcile(endpoint_id: str, load: autoscaler.Load | None, *, now: float | None, in_a_tick: bool,
               organization_first: bool = False) -> autoscaler.Decision | None:
    """`reconcile_endpoint` in one transaction. Raises `_OrganizationHeld` (nothing written) where a scale-up outside a
    tick finds its organisation's row held; `organization_first`: that row is waited for and taken before the
    endpoint's."""
    now = redis_time() if now is None else now
    if load is None:
        load = autoscaler.read_load([str(endpoint_id)], now=now)[str(endpoint_id)]
    with transaction.atomic():
        if organization_first:
            organization_id = Endpoint.objects.filter(pk=endpoint_id).values_list("organization_id", flat=True).first()
            if organization_id is None:
                return None
            quotas.lock_organization(organization_id)  # NOTE: waited for holding no endpoint's row
        endpoint = Endpoint.objects.select_for_update(skip_locked=True, no_key=True).filter(pk=endpoint_id).first()
        if endpoint is None:  # gone, or another worker is reconciling it right now
            return None
        serving = list(Replica.objects.filter(endpoint=endpoint, state__in=SERVING_REPLICA_STATES).select_related("endpoint"))
        idle_cap_s = idle_caps([endpoint.organization_id]).get(endpoint.organization_id, 0)
        decision = autoscaler.decide(endpoint, load, now=now, batch=read_demand([str(endpoint.pk)]).get(str(endpoint.pk)),
                                     num_ready=sum(1 for r in serving if r.state == ReplicaState.READY),
                                     num_serving=len(serving), idle_cap_s=idle_cap_s)
        if decision.batch_rule in ("hold", "wait"):
            # NOTE: once per change of what batch work asks, not every tick.
            record_event_once(endpoint, EventKind.BATCH, decision.reason[:1].upper() + decision.reason[1:])
        backing_off = endpoint.backing_off  # NOTE: once: PostgreSQL's clock, a query while a backoff is set
        held_back = endpoint.failed_at is not None or backing_off
        # A failure's message stays while it holds the endpoint back; a capacity message is rewritten each time.
        message, waiting_for_capacity = (endpoint.status_message if held_back else ""), False
        num_unplaced, event = 0, ""
        organization = None
        # NOTE: a scale-up's backoff (failures of replicas added while another served) holds the replicas beyond the
        # first: with none serving nor starting now (scaled to zero, or the one READY lost), one starts as any cold
        # start would. Before, its hour of backoff held a start from zero of a model that had served.
        num_wanted = decision.desired
        if backing_off and endpoint.scale_up_backing_off and not serving and num_wanted > 0:
            held_back, num_wanted = False, 1
        # NOTE: its organisation past a quota lowered since (`quotas.over_quota`) and this endpoint wanting no fewer
        # replicas than it serves: nothing is placed, and its organisation's newest replica drains, when it is this
        # endpoint's and none drains already (one at a time: the tick reconciles this endpoint again while its message
        # says so). An autoscaler's own scale-down goes first: it lowers what the organisation holds. Nothing drains
        # during the grace (`over.in_grace`): the message says from when.
        over = quotas.over_quota(endpoint) if serving and num_wanted >= len(serving) else None
        if over is not None and over.drains_from is None and not in_a_tick and not organization_first:
            # NOTE: its grace's start not stamped, its organisation's row held by another write: a task waits for the
            # row holding nothing, as a scale-up does, and stamps it. Skipped by every reconcile as by the tick, a
            # tenant whose own writes kept its row held never had its grace started, nor its replicas drained.
            raise _OrganizationHeld
        if over is not None:
            message = message or over.message  # NOTE: a failure's message, holding it back, says more
            if not over.in_grace and not over.num_draining and over.newest.endpoint_id == endpoint.pk:
                _drain_over_quota(endpoint, over)
        elif num_wanted > len(serving) and held_back:
            # NOTE: a failed endpoint places nothing until a spec change or resume; one backing off
            # after a failure waits for `next_attempt_at` (a later tick).
            pass
        elif num_wanted > len(serving) and (organization := quotas.lock_organization(
                endpoint.organization_id, skip_locked=True)) is None:
            # NOTE: the organisation's row is held by another write (a key revocation walking thousands of minted keys,
            # a member's change, another of its endpoints placing), never waited for here, with the endpoint's row
            # held: a task rolls back and waits for it holding nothing (`reconcile_endpoint`); a tick leaves the
            # endpoint as it is and the next one retries. Waiting held the tick, which reconciles every endpoint in
            # turn, so every tenant's scale-up waited behind one tenant's revocation (12 s with 3,000 minted keys; a
            # review's finding).
            if not in_a_tick and not organization_first:
                raise _OrganizationHeld
            message, waiting_for_capacity = endpoint.status_message, endpoint.waiting_for_capacity
            num_unplaced = endpoint.unplaced_replicas
        elif num_wanted > len(serving):
            record_event(endpoint, EventKind.SCALE, f"Scale up {len(serving)} → {num_wanted}: {decision.reason}",
                         desired=num_wanted, current=len(serving), inputs=decision.inputs)
            # NOTE: the organisation's row stays locked until commit, so its endpoints place one at a
            # time and together never pass its replica and GPU quotas.
            endpoint.organization = organization
            sleeping = list(Replica.objects.filter(endpoint=endpoint, state=ReplicaState.SLEEPING)
                            .select_related("endpoint").order_by("-state_changed_at"))
            # NOTE: a scale-up whose sleepers all wake locks their nodes alone; one that must place a replica (a wake
            # that failed, too few sleepers) starts again, those locks given back, under placement's: a GPU type's
            # READY nodes, its sleepers' with them, locked in one step (`lock_nodes_to_wake`). Under placement's lock
            # every time, endpoints waking on distinct nodes of a GPU type woke one after another.
            for may_place in (False, True) if sleeping else (True,):
                try:
                    with transaction.atomic():  # a savepoint: rolled back, its writes and its nodes' locks go
                        if sleeping and may_place:
                            quotas.lock_starts(endpoint)  # NOTE: before the nodes' locks, as placement takes it
                        if sleeping:
                            lock_nodes_to_wake(endpoint, sleeping, to_place=may_place)
                        num_unplaced, message, event, waiting_for_capacity = _add_replicas(
                            endpoint, list(sleeping), num_wanted - len(serving), serving=bool(serving),
                            may_place=may_place)
                    break
                except _PlacementNeeded:
                    continue
        elif decision.desired < len(serving):
            record_event(endpoint, EventKind.SCALE, f"Scale down {len(serving)} → {decision.desired}: {decision.reason}",
                         desired=decision.desired, current=len(serving), inputs=decision.inputs)
            surplus = sorted(serving, key=lambda r: (DRAIN_ORDER[r.state], -r.created_at.timestamp()))
            let_go = surplus[: len(serving) - decision.desired]
            # NOTE: a sleeper holds its GPU (and its pool's machine) and wakes for free (no start): an organisation held
            # to an idle cap keeps none, or one call an `INFERPLANE_SLEEP_STOP_AFTER_S` kept a GPU past the cap for ever.
            if endpoint.idle_action == IdleAction.SLEEP and not idle_cap_s:
                sleep_replicas(let_go, reason=decision.reason)  # a replica not READY, or on a CPU node, drains
            else:
                for replica in let_go:
                    drain_replica(replica, reason=decision.reason)
        stop_long_sleepers(endpoint, may_sleep=not idle_cap_s)
        if (endpoint.status_message != message or endpoint.waiting_for_capacity != waiting_for_capacity
                or endpoint.unplaced_replicas != num_unplaced):
            if message and message != endpoint.status_message:
                record_event(endpoint, EventKind.CAPACITY, event or message)
            if num_unplaced > endpoint.unplaced_replicas and message == PROVISIONING_MESSAGE:
                request_provisioning()  # new demand: the pool tick runs now, not at its next beat
            Endpoint.objects.filter(pk=endpoint.pk).update(status_message=message, waiting_for_capacity=waiting_for_capacity,
                                                           unplaced_replicas=num_unplaced)
    return decision


def _drain_over_quota(endpoint: Endpoint, over: quotas.OverQuota) -> None:
    """The organisation's newest replica, this endpoint's, drains for a quota lowered below what it holds; audited."""
    replica = over.newest
    replica.endpoint = endpoint
    if drain_replica(replica, reason=over.message):
        record_audit(SYSTEM, endpoint.organization, "replica.quota_drain", endpoint, replica=str(replica.pk),
                     quota=over.quota, limit=over.limit, held=over.num_held)


class _PlacementNeeded(Exception):
    """A scale-up under its sleepers' nodes' locks alone must place a replica: it starts again under placement's."""


def _add_replicas(endpoint: Endpoint, sleeping: list[Replica], num_to_add: int, *, serving: bool,
                  may_place: bool) -> tuple[int, str, str, bool]:
    """Wake `sleeping` (newest first) or place replicas until `num_to_add` more serve. Returns how many are left
    unplaced, the endpoint's status message, the event to record with it, and whether it waits for capacity.
    Raises `_PlacementNeeded` where it must place one and may not."""
    num_placed, num_unplaced, message, event, waiting_for_capacity = 0, 0, "", "", False
    for _ in range(num_to_add):
        refusal = quotas.replica_refusal(endpoint)
        if refusal is not None:
            message = f"waiting for quota: {refusal}"
            break
        # NOTE: a sleeping replica wakes in about a second; one that cannot (its GPUs were given
        # away meanwhile) has stopped, saying why, and the next sleeper or a new replica follows.
        woken = False
        while sleeping and not woken:
            woken = not wake_replica(sleeping.pop(0))
        if woken:
            num_placed += 1
            continue
        if not may_place:
            raise _PlacementNeeded
        refusal = quotas.start_refusal(endpoint)
        if refusal is not None:
            message = f"waiting for quota: {refusal}"
            break
        replica, reason = place_replica(endpoint)
        if replica is None:
            # NOTE: only what its organisation's quota lets it hold is demand for a node pool's machine: all of them
            # counted, one endpoint wanting more than its quota allows had the pool launch machines none could use.
            num_unplaced = min(num_to_add - num_placed, replica_room(endpoint.organization).num_more(
                endpoint.gpu_type, endpoint.gpus_per_replica))
            message = f"waiting for capacity: {reason}"
            pool = provisioning_pool(endpoint)
            if pool is not None:
                # NOTE: a node is on its way: calls are held as in any cold start, not refused.
                message, event = PROVISIONING_MESSAGE, f"Provisioning a node (pool {pool.name}): {reason}"
            else:
                # Nothing serving nor starting: calls cannot be served until a node frees up.
                waiting_for_capacity = not serving and not num_placed
            break
        num_placed += 1
        record_event(endpoint, EventKind.SCALE, f"Replica {str(replica.pk)[:8]} {reason}", replica=replica)
    return num_unplaced, message, event, waiting_for_capacity


def active_endpoint_ids(now: float | None = None) -> list[str]:
    """Endpoints the tick must look at: with replicas, with a floor, or with recent traffic (at `now`, Redis's clock).

    NOTE: the cost of a tick grows with these, not with every endpoint ever created.
    """
    now = redis_time() if now is None else now
    # NOTE: `order_by()` drops the models' default ordering: with it, DISTINCT would run over
    # (endpoint, created_at), one row per replica, and the floor query would sort every match by name.
    with_replicas = (Replica.objects.filter(state__in=LIVE_REPLICA_STATES).order_by()
                     .values_list("endpoint_id", flat=True).distinct())  # sleeping ones too: they stop after a while
    # NOTE: an endpoint with pre-warm windows is looked at every tick: one of them may open now.
    with_floor = Endpoint.objects.live().filter(
        Q(min_replicas__gt=0) | ~Q(prewarm_windows=[]), paused_at__isnull=True, failed_at__isnull=True,
    ).order_by().values_list("pk", flat=True)
    forget_past_recent_endpoints(now)
    recent = get_redis().zrangebyscore(redis_keys.RECENT_ENDPOINTS_KEY, now - traffic.RECENT_WINDOW_S, "+inf")
    with_batch_work = read_demand().keys()  # a sleeping endpoint may have to wake for a batch's deadline
    ids = {str(pk) for pk in with_replicas} | {str(pk) for pk in with_floor} | set(recent) | set(with_batch_work)
    return sorted(ids)


# How many endpoints past the recent window one tick takes out of `RECENT_ENDPOINTS_KEY` (the first tick after a long
# time without may find every endpoint ever called there).
FORGET_PAST_RECENT_BATCH = 1000

# KEYS: `RECENT_ENDPOINTS_KEY`; ARGV: the window's start (Redis's clock), then endpoints read past it. Takes out those
# still past it; how many. NOTE: in one script: a beat's newer time for one of them (ZADD GT) comes before or after,
# never between its check and its removal, and keeps it.
_TAKE_PAST_RECENT = Script("""
local past = {}
for index = 2, #ARGV do
    local score = redis.call('ZSCORE', KEYS[1], ARGV[index])
    if score and tonumber(score) < tonumber(ARGV[1]) then past[#past + 1] = ARGV[index] end
end
if #past > 0 then redis.call('ZREM', KEYS[1], unpack(past)) end
return #past
""")


def forget_past_recent_endpoints(now: float) -> int:
    """Take the endpoints whose last request is older than the recent window out of `RECENT_ENDPOINTS_KEY`, and a
    deleted one's last-request time with it; how many were taken out.

    NOTE: the gateways' beats only add to the set (no TTL: it is written at every beat), and the gateways' scripts set
    an endpoint's last request without one: before, both kept every endpoint ever called, deleted ones too, for the
    life of Redis. A live endpoint keeps its last request (its replicas' idle deadlines are read from it).
    NOTE: read, then the deleted ones' last requests dropped, then taken out of the set: a tick cut before the end
    leaves them in the set, and the next tick finds them again; taken out first, a tick cut before the deletes left
    their last requests for ever (found by the review of the tick's forgetting)."""
    start = now - traffic.RECENT_WINDOW_S
    redis = get_redis()
    past = redis.zrangebyscore(redis_keys.RECENT_ENDPOINTS_KEY, "-inf", f"({start!r}", start=0,
                               num=FORGET_PAST_RECENT_BATCH)
    if not past:
        return 0
    deleted = Endpoint.objects.filter(pk__in=past, deleted_at__isnull=False).order_by().values_list(
        "pk", "organization_id")
    keys = [redis_keys.last_request_key(organization_id, str(pk)) for pk, organization_id in deleted]
    if keys:
        with redis.pipeline(transaction=False) as pipe:
            for key in keys:  # NOTE: one command per key: an organisation's keys are in its own cluster slot
                pipe.delete(key)
            pipe.execute()
    return _TAKE_PAST_RECENT.run_sync(keys=[redis_keys.RECENT_ENDPOINTS_KEY], args=[start, *past])


def endpoints_to_reconcile(endpoint_ids: list[str], loads: dict[str, autoscaler.Load], *,
                           idle_deadlines: dict[str, float] | None = None, now: float | None = None) -> list[str]:
    """The endpoints among `endpoint_ids` that a reconcile would change, found in a few queries.

    An endpoint whose serving replicas already number what the autoscaler wants, and that shows no
    "waiting for capacity" message, would be locked, read and left as it is: the tick skips it, so a
    steady fleet costs two queries, not four per endpoint. The reconcile itself re-reads under its lock.
    Of the ones skipped, those that will be allowed to scale down once idle long enough go into
    `idle_deadlines` (endpoint id -> that moment, `autoscaler.idle_deadline`). `now`: the clock `loads` were read at
    (Redis's).
    """
    if not endpoint_ids:
        return []
    now = redis_time() if now is None else now
    endpoints = Endpoint.objects.filter(pk__in=endpoint_ids).order_by().only(
        "pk", "paused_at", "deleted_at", "min_replicas", "max_replicas", "idle_timeout_s", "target_concurrency",
        "status_message", "failed_at", "prewarm_windows", "keep_warm_after_cold_start_s", "last_cold_start_at",
        "unplaced_replicas", "idle_action", "organization_id",
    )
    num_serving, num_ready = {}, {}
    for endpoint_id, state, num in (Replica.objects.filter(endpoint_id__in=endpoint_ids, state__in=SERVING_REPLICA_STATES)
                                    .order_by().values("endpoint_id", "state").annotate(num=Count("pk"))
                                    .values_list("endpoint_id", "state", "num")):
        num_serving[endpoint_id] = num_serving.get(endpoint_id, 0) + num
        if state == ReplicaState.READY:
            num_ready[endpoint_id] = num
    demand = read_demand(endpoint_ids)
    # Sleeping replicas that should stop now (asleep too long, or their endpoint no longer sleeps).
    sleepers = Replica.objects.filter(endpoint_id__in=endpoint_ids, state=ReplicaState.SLEEPING).order_by()
    if settings.SLEEP_MODE:
        sleepers = sleepers.filter(Q(state_changed_at__lt=database_time_ago(settings.SLEEP_STOP_AFTER_S))
                                   | ~Q(endpoint__idle_action=IdleAction.SLEEP))
    changing = {str(pk) for pk in sleepers.values_list("endpoint_id", flat=True).distinct()}
    # NOTE: an organisation past a quota lowered since drains one replica at a time, at each tick (`quotas.over_quota`)
    changing |= quotas.endpoints_over_quota(endpoint_ids)
    caps = idle_caps({endpoint.organization_id for endpoint in endpoints})
    for endpoint in endpoints:
        try:
            idle_cap_s = caps.get(endpoint.organization_id, 0)
            decision = autoscaler.decide(endpoint, loads[str(endpoint.pk)], now=now, batch=demand.get(str(endpoint.pk)),
                                         num_ready=num_ready.get(endpoint.pk, 0), num_serving=num_serving.get(endpoint.pk, 0),
                                         idle_cap_s=idle_cap_s)
            if endpoint.failed_at is not None and decision.desired >= num_serving.get(endpoint.pk, 0):
                # NOTE: stopped until a spec change or resume: nothing to place. Its surplus still drains (the reconcile
                # places nothing for it): skipped whenever failed, a replica READY at the failure held its GPU for ever.
                continue
            if decision.batch_rule in ("hold", "wait"):
                changing.add(str(endpoint.pk))  # its event log says why it holds or waits (once per change)
                continue
            if decision.desired != num_serving.get(endpoint.pk, 0) or endpoint.status_message or endpoint.unplaced_replicas:
                changing.add(str(endpoint.pk))
            elif idle_deadlines is not None and (deadline := autoscaler.idle_deadline(
                    endpoint, loads[str(endpoint.pk)], num_serving.get(endpoint.pk, 0), now,
                    idle_cap_s=idle_cap_s)) is not None:
                idle_deadlines[str(endpoint.pk)] = deadline
        except Exception:  # noqa: BLE001 - one broken endpoint must not stall the others, as in the tick's reconciles
            logger.exception("deciding for endpoint %s failed", endpoint.pk)
    return sorted(changing)


def schedule_idle_deadlines(idle_deadlines: dict[str, float], now: float) -> int:
    """Reconcile each endpoint whose idle deadline falls before the next tick at that very moment
    (a Celery task with that ETA), once per deadline; returns how many were scheduled.

    NOTE: only endpoints about to go idle, at most one task per idle period each: a big fleet pays
    for its endpoints going idle, not for a faster tick. Without it scale to zero lands up to a tick
    after the deadline. A request meanwhile moves the deadline; the reconcile then finds it busy and
    changes nothing.
    """
    due = {endpoint_id: deadline for endpoint_id, deadline in idle_deadlines.items()
           if deadline < now + settings.AUTOSCALER_TICK_S}
    if not due:
        return 0
    redis = get_redis()
    ttl = max(1, int(settings.AUTOSCALER_TICK_S * 3) + 1)
    with redis.pipeline(transaction=False) as pipe:
        for endpoint_id, deadline in due.items():
            pipe.set(redis_keys.idle_deadline_key(endpoint_id, deadline), "1", nx=True, ex=ttl)
        claimed = pipe.execute()
    scheduled = 0
    for (endpoint_id, deadline), first in zip(due.items(), claimed, strict=True):
        if first:
            # NOTE: a hair after the deadline, so that the reconcile reads the timeout as passed.
            send_task(RECONCILE_TASK, args=[endpoint_id], countdown=max(0.0, deadline - now) + IDLE_DEADLINE_MARGIN_S,
                      expires=deadline - now + settings.AUTOSCALER_TICK_S * 2 + 60)
            scheduled += 1
    return scheduled


def autoscale_tick() -> int:
    """One autoscaler pass over the active endpoints; a second beat's overlapping tick does nothing."""
    with held_alone(TICK_LOCK_KEY, max(1, int(settings.AUTOSCALER_TICK_S * 5))) as held:
        return _tick() if held else 0


def _tick() -> int:
    presence.sweep_dead_gateways()  # first, so a dead gateway's requests do not count as load
    # NOTE: Redis's clock, which the gateways stamp requests with (`autoscaler`), never this worker's own.
    now = redis_time()
    endpoint_ids = active_endpoint_ids(now)
    loads = autoscaler.read_load(endpoint_ids, now=now)
    idle_deadlines: dict[str, float] = {}
    changing = endpoints_to_reconcile(endpoint_ids, loads, idle_deadlines=idle_deadlines, now=now)
    schedule_idle_deadlines(idle_deadlines, now)
    for endpoint_id in changing:
        try:
            reconcile_endpoint(endpoint_id, loads[endpoint_id], now=now, in_a_tick=True)
        except Exception:  # noqa: BLE001 - one broken endpoint must not stall the others
            logger.exception("reconciling endpoint %s failed", endpoint_id)
    return len(endpoint_ids)


# Sweeps run every 5 s: one this long after the last one ended means nobody could hear heartbeats meanwhile.
SWEEP_GAP_S = 20.0
SWEEP_KEYS_TTL_S = 7 * 24 * 3600


# No web process beat for this long: the web tier, which hears the agents' heartbeats, is down (they beat every second).
WEB_SILENT_AFTER_S = 10.0


def web_tier_silent(redis, now: float) -> bool:
    """Whether no web process has beaten (`redis_keys.WEB_BEATS_KEY`) for `WEB_SILENT_AFTER_S` of the sweeps' time.

    False when none ever beat (Redis emptied, or a deployment without the gateway): a Redis restart alone must not
    hold node failure back. NOTE: a count compared between sweeps, so that web and worker clocks apart by more than
    the threshold never read as silence."""
    beats = redis.get(redis_keys.WEB_BEATS_KEY)
    if beats is None:
        return False
    seen = redis.hgetall(redis_keys.WEB_BEATS_SEEN_KEY)
    if seen.get("beats") != beats:
        with redis.pipeline(transaction=False) as pipe:
            pipe.hset(redis_keys.WEB_BEATS_SEEN_KEY, mapping={"beats": beats, "at": now})
            pipe.expire(redis_keys.WEB_BEATS_SEEN_KEY, SWEEP_KEYS_TTL_S)
            pipe.execute()
        return False
    return now - float(seen["at"]) > WEB_SILENT_AFTER_S


def _heard_long_enough(redis, now: float) -> bool:
    """Whether the control plane has been able to hear heartbeats long enough to judge silence.

    NOTE: a heartbeat is a PostgreSQL write. While PostgreSQL was down no agent could beat, and each backed off (up
    to 60 s); the first sweep after it came back found every node silent past the grace period, marked the whole
    fleet OFFLINE and failed every replica (told to stop when their nodes beat again: every tenant cold again). A
    gap in the sweeps themselves (they read PostgreSQL too) starts a new listening period: no node, replica start
    or drain is judged until agents had `NODE_HEARTBEAT_RETRY_S` to beat again and the grace period passed. When the
    sweeps last ended is PostgreSQL's (`NodeSweep`, its clock): Redis may lose its memory in the same outage, and a
    missing key read as no gap. No record at all (the first sweep) is no gap, and a Redis restart alone is none either:
    it must not slow node failure down.

    The same while the web tier is down (`web_tier_silent`: every web pod crashing after a bad deploy, say): nobody
    hears the agents, whose silence says nothing of their nodes, and the period starts again at each sweep until a
    web process beats again."""
    last = NodeSweep.objects.annotate(gap=ExpressionWrapper(Now() - F("swept_at"), output_field=DurationField())).first()
    if last is not None and last.gap.total_seconds() > SWEEP_GAP_S:
        redis.set(LISTENING_SINCE_KEY, now, ex=SWEEP_KEYS_TTL_S)
        logger.warning("no sweep for %.0f s (PostgreSQL or the worker was down): nodes get %.0f s to beat again before "
                       "any is judged silent", last.gap.total_seconds(),
                       settings.NODE_HEARTBEAT_RETRY_S + settings.NODE_HEARTBEAT_GRACE_S)
    if web_tier_silent(redis, now):
        redis.set(LISTENING_SINCE_KEY, now, ex=SWEEP_KEYS_TTL_S)
        logger.warning("no web process has beaten for over %.0f s: no node is judged silent until one has, and its "
                       "agents have %.0f s to beat again", WEB_SILENT_AFTER_S,
                       settings.NODE_HEARTBEAT_RETRY_S + settings.NODE_HEARTBEAT_GRACE_S)
    since = redis.get(LISTENING_SINCE_KEY)
    return since is None or now - float(since) >= settings.NODE_HEARTBEAT_RETRY_S + settings.NODE_HEARTBEAT_GRACE_S


def sweep_stuck() -> None:
    """Nodes silent past the grace period go OFFLINE and their replicas FAILED (and are replaced);
    replicas STARTING for too long fail with the reason; replicas on nodes the gateway may not reach move
    (`move_off_unreachable_nodes`). Nothing is judged until the control plane has heard
    heartbeats long enough after a time it could not (`_heard_long_enough`).

    NOTE: the times the sweeps keep are PostgreSQL's clock (when they ended) and Redis's (since when they listen), never
    a worker's: sweeps run on any worker, and one whose clock ran 20 s ahead of the last sweeper's read a gap in the
    sweeps every time, so no node was ever judged. A sweep that could not reach PostgreSQL records nothing: it is part
    of the gap."""
    redis = get_redis()
    move_off_unreachable_nodes()
    if _heard_long_enough(redis, redis_time(redis)):
        _sweep()
    if not NodeSweep.objects.filter(pk=NodeSweep.ROW).update(swept_at=Now()):
        NodeSweep.objects.get_or_create(pk=NodeSweep.ROW, defaults={"swept_at": Now()})


def move_off_unreachable_nodes() -> int:
    """Live replicas on a node whose registered host the gateway refuses (`Node.host_problem`) fail, as on a node
    gone OFFLINE, and their endpoints place them elsewhere (placement skips such a node); returns how many failed.

    NOTE: a node registered before the rule, or before `ALLOW_LOOPBACK_NODES` was turned off: the gateway never
    routes to its engines, so a replica there serves nothing however long it runs. Judged whatever the heartbeats
    say: it is the node's registration, not its silence. Not counted as the endpoint's failure (no back-off)."""
    unreachable = [node for node in Node.objects.exclude(state=NodeState.OFFLINE).filter(
        replicas__state__in=LIVE_REPLICA_STATES).distinct().only(
        "pk", "name", "advertise_host", "engine_port_min", "engine_port_max") if node.host_problem()]
    num_failed = 0
    for node in unreachable:
        # NOTE: the reason is shown to every member: it names neither the node nor its host (the log below does).
        reason = "its node's registered host is not one the gateway may reach"
        for replica in Replica.objects.filter(node=node, state__in=LIVE_REPLICA_STATES).select_related("endpoint"):
            num_failed += fail_replica(replica, reason, moved=True)
        logger.warning("node %s: its registered host %r is refused (%s): its replicas were moved", node.name,
                       node.advertise_host, node.host_problem())
    return num_failed


def whole_fleet_silent(redis, now: float) -> bool:
    """Whether every node went silent together and has been held from judgement less than
    `NODE_FLEET_SILENCE_HOLD_S` (`_sweep`).

    NOTE: the web tier up but refusing heartbeats (a bad deploy whose heartbeat view fails, a network policy between
    the nodes and the web pods) reads as every node silent at once while web processes beat (`web_tier_silent` sees
    nothing wrong): the sweeps took the whole fleet OFFLINE and failed every replica, every tenant cold once the fault
    was fixed. Every node falling silent within a few heartbeats is far likelier the control plane's fault, or the
    network's, than every machine's, as Kubernetes' node controller also judges (no evictions in a zone whose every
    node is unready). Held while at least two live nodes are all unheard for three heartbeat intervals (agents beat
    at staggered times, so one node passes the grace period a few seconds before the others); one node alone is
    judged as before. Bounded: a fleet truly lost (a region down) is judged after the hold, so that its endpoints
    are placed again (new machines from the pools)."""
    recently = database_time_ago(min(settings.NODE_HEARTBEAT_GRACE_S, 3 * settings.AGENT_HEARTBEAT_INTERVAL_S))
    live = Node.objects.exclude(state=NodeState.OFFLINE)
    if live.filter(Q(last_heartbeat_at__gte=recently) | Q(last_heartbeat_at__isnull=True)).exists() or live.count() < 2:
        redis.delete(FLEET_SILENT_SINCE_KEY)
        return False
    if redis.set(FLEET_SILENT_SINCE_KEY, now, nx=True, ex=SWEEP_KEYS_TTL_S):
        logger.error("every node is silent at once (%d nodes): the web tier refusing heartbeats, or the network to it, "
                     "is the likelier fault; no node is judged for up to %.0f s", live.count(),
                     settings.NODE_FLEET_SILENCE_HOLD_S)
    since = float(redis.get(FLEET_SILENT_SINCE_KEY) or now)
    if now - since < settings.NODE_FLEET_SILENCE_HOLD_S:
        return True
    logger.error("every node has been silent for %.0f s: judging them now", now - since)
    return False


def _sweep() -> None:
    silent_since = database_time_ago(settings.NODE_HEARTBEAT_GRACE_S)
    silent = Node.objects.exclude(state=NodeState.OFFLINE).filter(last_heartbeat_at__lt=silent_since)
    if not silent.exists():
        # NOTE: a silence that healed ends here: its start left in Redis made the next one, days later, judged at
        # once as if held for its whole bound already.
        get_redis().delete(FLEET_SILENT_SINCE_KEY)
    elif whole_fleet_silent(get_redis(), redis_time()):
        silent = Node.objects.none()
    for node in silent:
        # NOTE: one transaction: nobody reads an OFFLINE node whose replicas still look READY (the gateway
        # would route to them, the console show them serving). The notices and reconciles go after commit.
        with transaction.atomic():
            if not Node.objects.filter(pk=node.pk, last_heartbeat_at__lt=silent_since).exclude(state=NodeState.OFFLINE).update(
                    state=NodeState.OFFLINE, state_before_offline=F("state")):
                continue  # it beat in the meantime, or another sweeper won
            # NOTE: the replica's failure reason is shown to every member: the node's name (a host name of the fleet)
            # stays in the log below and on the replica's node, which owners and admins see.
            reason = "its node stopped sending heartbeats"
            for replica in Replica.objects.filter(node=node, state__in=LIVE_REPLICA_STATES).select_related("endpoint"):
                fail_replica(replica, reason, moved=True)
        logger.warning("node %s went OFFLINE (no heartbeat since %s)", node.name, node.last_heartbeat_at)
    # NOTE: a start's and a drain's age by PostgreSQL's clock, never this worker's: one 5 minutes ahead stopped every
    # draining replica at once (its GPU placeable while its engine still ran), one 16 minutes ahead failed a replica
    # loading its weights.
    started_before = database_time_ago(settings.REPLICA_START_TIMEOUT_S)
    # NOTE: a woken replica (sleep mode) is STARTING again long after it was created: its clock is its wake. So is one
    # READY before whose engine crashed and its agent restarts (READY -> STARTING): its clock is that change. Timed from
    # its creation, one READY longer than the timeout failed at the next sweep, its restart thrown away.
    for replica in Replica.objects.filter(state__in=[ReplicaState.PENDING, ReplicaState.STARTING], created_at__lt=started_before).filter(
            Q(woken_at__isnull=True) | Q(woken_at__lt=started_before)).filter(
            Q(ready_at__isnull=True) | Q(state_changed_at__lt=started_before)).select_related("endpoint"):
        reason = f"did not become READY within {settings.REPLICA_START_TIMEOUT_S:.0f} s"
        fail_replica_and_count(replica, reason)
    drained_before = database_time_ago(settings.REPLICA_DRAIN_TIMEOUT_S + settings.NODE_HEARTBEAT_GRACE_S)
    for replica in Replica.objects.filter(state=ReplicaState.DRAINING, state_changed_at__lt=drained_before).select_related("endpoint"):
        fail_replica(replica, "its agent never confirmed the drain", final_state=ReplicaState.STOPPED)
