"""Replicas: every change of a replica's state, and why. The one writer of `Replica.state`.

A replica is born PENDING when placement picks its node (`place_replica`); its agent moves it
through STARTING to READY, and its reports are applied through one transition table
(`state_after_report`); the control plane drains it (`drain_replica`, `drain_replicas`,
`drain_node`) or gives up on it (`fail_replica`). STOPPED and FAILED are final
(`gpu_agent.protocol.FINAL_REPLICA_STATES`): nothing revives a replica from them.

Sleep mode (issue #17, an endpoint's `idle_action` "sleep" where `INFERPLANE_SLEEP_MODE` is on): a
READY replica on a GPU node that the autoscaler lets go sleeps (`sleep_replica`: SLEEPING, its agent
calls the engine's `/sleep` and keeps the process; a CPU node's replica drains instead, saying why);
a call for the endpoint wakes it (`wake_replica`: back to STARTING, its agent calls `/wake_up` and
reports READY; if its GPUs were given away meanwhile it stops and a new replica is placed). Every time
asleep is one `ReplicaSleep` row, opened and closed here, which billing counts as zero GPU-seconds.

A failure counts against its endpoint (`record_replica_failure`: back off, then stop the endpoint);
a READY replica clears the count (`record_replica_ready`). Whatever needs the endpoint's replicas
brought back to what its autoscaler wants calls `request_reconcile`, which runs the reconcile task
once the current transaction commits.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import F, Q, Sum
from django.utils import timezone

from controlplane import redis_keys
from controlplane.clock import database_now, database_time_ago
from controlplane.redis_client import as_text, get_redis, redis_time
from controlplane.tasks import send_task
from endpoints.events import record_event
from endpoints.models import (
    ACTIVE_REPLICA_STATES,
    SERVING_REPLICA_STATES,
    Endpoint,
    EventKind,
    IdleAction,
    ModelFacts,
    Replica,
    ReplicaSleep,
)
from endpoints.nodes.models import Node
from endpoints.nodes.notify import notify_endpoint_ready, notify_node
from endpoints.placement import (
    CPU_KV_CACHE_MB,
    GpuHold,
    choose_node,
    estimated_weights_mb,
    failures_here,
    host_memory_asleep_mb,
    memory_needed_mb,
    node_memory_mb,
    nodes_holding_weights,
    reported_weights_sizes_mb,
    room_to_sleep,
    room_to_wake,
)
from gpu_agent import protocol
from gpu_agent.protocol import FINAL_REPLICA_STATES, NodeState, ReplicaAction, ReplicaState

# NOTE: sent by name: the task (`endpoints.tasks`) calls the scheduler, which calls this module.
RECONCILE_TASK = "endpoints.reconcile_endpoint"
# An engine's own memory figures off placement's estimate by more than this share (and this many MB)
# make an event: the reservation is wrong, and the node may run out of memory or waste it.
MEMORY_ESTIMATE_MARGIN = 0.25
MEMORY_ESTIMATE_SLACK_MB = 256

logger = logging.getLogger(__name__)
# How long staff's log remembers the last reason it gave for an endpoint's unplaced replica (`_not_yet_logged`).
UNPLACED_LOGGED_FOR_S = 24 * 3600


def request_reconcile(endpoint_id) -> None:
    """Reconcile the endpoint once the current transaction commits (at once outside one).

    After commit, so the reconcile reads what this transaction wrote.
    """
    endpoint_id = str(endpoint_id)
    # NOTE: robust: a hint, the autoscaler's tick reconciles every endpoint anyway. A broker out of reach raised
    # here after the request's writes had committed: a 500 for an endpoint created, changed or deleted.
    transaction.on_commit(lambda: send_task(RECONCILE_TASK, args=[endpoint_id]), robust=True)


def place_replica(endpoint: Endpoint) -> tuple[Replica | None, str]:
    """Create a PENDING replica on the best node and GPUs (`placement.choose_node`), or explain why none fits.

    NOTE: nodes are locked while reservations are summed, so two concurrent
    placements can never both take the same free memory.
    """
    needed_mb = memory_needed_mb(endpoint)
    with transaction.atomic():
        candidates = list(
            Node.objects.select_for_update().filter(state=NodeState.READY, gpu_type=endpoint.gpu_type).order_by("pk")
        )
        active = Replica.objects.filter(node__in=candidates, state__in=ACTIVE_REPLICA_STATES)
        used_mb = dict(active.values_list("node").annotate(total=Sum("reserved_memory_mb")))
        holds = {}
        for node_id, gpu_indices, reserved_mb, fraction in active.values_list(
            "node", "gpu_indices", "reserved_memory_mb", "gpu_memory_fraction"
        ):
            holds.setdefault(node_id, []).append(GpuHold(tuple(gpu_indices), reserved_mb, shared=fraction is not None))
        replicas_here = {}
        for node_id in active.filter(endpoint=endpoint).values_list("node", flat=True):
            replicas_here[node_id] = replicas_here.get(node_id, 0) + 1
        decision = choose_node(endpoint, needed_mb, candidates, used_mb, replicas_here, holds,
                               nodes_holding_weights(endpoint, candidates), failures_here(endpoint, candidates))
        if decision.node is None:
            if decision.fleet_detail and _not_yet_logged(endpoint, decision.reason):
                # Staff's detail (the fleet's free memory), once per change of what its tenant is told.
                logger.info("endpoint %s not placed: %s", endpoint.pk, decision.fleet_detail)
            return None, decision.reason
        # NOTE: its start's clock by PostgreSQL's, which the sweep judges it by (`scheduler._sweep`): by this
        # process's, one 16 minutes behind placed a replica the next sweep failed while it loaded its weights.
        placed_at = database_now()
        replica = Replica.objects.create(
            created_at=placed_at, state_changed_at=placed_at, endpoint=endpoint, node=decision.node, reserved_memory_mb=needed_mb, engine_generation=endpoint.engine_generation,
            gpu_indices=list(decision.gpu_indices), gpu_memory_fraction=decision.gpu_memory_fraction,
        )
        notify_node(decision.node.pk)
        # NOTE: no node name: this reason becomes an event every member reads, and a node's name is a host name of the
        # fleet; owners and admins see the replica's node on the replica itself.
        return replica, f"placed ({decision.reason}, {needed_mb} MB)"


def _not_yet_logged(endpoint: Endpoint, reason: str) -> bool:
    """Whether `reason` is not the one staff's log last gave for the endpoint, which it becomes (kept a day).

    NOTE: kept apart from what the tenant reads: while a node pool provisions one, the endpoint's `status_message` is
    "provisioning a node", which names no reason, and the comparison with it logged the figure every tick."""
    try:
        last = get_redis().set(redis_keys.unplaced_logged_key(str(endpoint.pk)), reason, ex=UNPLACED_LOGGED_FOR_S,
                               get=True)
    except redis.RedisError:
        return True  # a line too many in staff's log, rather than a tick lost
    return last is None or as_text(last) != reason


def drain_replica(replica: Replica, *, reason: str, moved: bool = False) -> bool:
    """The replica takes no new requests; its agent stops it once in-flight ones finish.

    A replica not yet started stops at once. Returns whether this call changed it. `moved`: the platform takes it off
    its node for a reason of its own (`Replica.moved_at`): its replacement is no start of its organisation's.

    NOTE: its drain's start by PostgreSQL's clock, as the sweep judges it (`scheduler._sweep`), as each change of a
    replica's state is stamped here: by this process's, a web pod or worker 5 minutes behind began a drain the next
    sweep stopped at once as never confirmed (its GPU placeable while its engine still ran).
    """
    now = database_now()
    moved_at = {"moved_at": now} if moved else {}
    if replica.state == ReplicaState.PENDING:
        changed = Replica.objects.filter(pk=replica.pk, state=ReplicaState.PENDING).update(
            state=ReplicaState.STOPPED, state_changed_at=now, stopped_at=now, **moved_at
        )
    else:
        changed = Replica.objects.filter(
            pk=replica.pk, state__in=[ReplicaState.STARTING, ReplicaState.READY, ReplicaState.SLEEPING]
        ).update(state=ReplicaState.DRAINING, state_changed_at=now, **moved_at)
    if changed:
        _end_sleep(replica.pk, now)
        notify_node(replica.node_id)
        record_event(replica.endpoint, EventKind.SCALE, f"Draining replica {str(replica.pk)[:8]}: {reason}", replica=replica)
    return bool(changed)


def drain_replicas(endpoint: Endpoint, *, reason: str) -> int:
    """Every serving (or sleeping) replica of the endpoint drains."""
    replicas = Replica.objects.filter(endpoint=endpoint, state__in=(*SERVING_REPLICA_STATES, ReplicaState.SLEEPING))
    return sum(drain_replica(replica, reason=reason) for replica in replicas)


def drain_node(node: Node, *, reason: str) -> int:
    """Every serving replica on the node drains, and its endpoint is reconciled to replace it elsewhere."""
    return drain_each(
        Replica.objects.filter(node=node, state__in=(*SERVING_REPLICA_STATES, ReplicaState.SLEEPING)).select_related(
            "endpoint"
        ),
        reason=reason,
    )


def drain_each(replicas: Iterable[Replica], *, reason: str) -> int:
    """Each of `replicas` drains, moved by the platform (`Replica.moved_at`: their replacements are no starts of their
    organisations'), and each one's endpoint is reconciled (once) to replace it elsewhere."""
    num_drained, endpoint_ids = 0, set()
    for replica in replicas:
        num_drained += drain_replica(replica, reason=reason, moved=True)
        endpoint_ids.add(replica.endpoint_id)
    for endpoint_id in endpoint_ids:
        request_reconcile(endpoint_id)
    return num_drained


def fail_replica(replica: Replica, reason: str, *, final_state: str = ReplicaState.FAILED, moved: bool = False) -> bool:
    """Stop a replica the control plane gave up on, and replace it; returns whether this call changed it. `moved`: the
    platform's reason, not its tenant's nor its engine's (its node lost, retired or unreachable, a sleeper that could
    not wake in place): its replacement is no start of its organisation's (`Replica.moved_at`).

    NOTE: only one that served or slept is moved: one DRAINING was on its way out by its tenant's doing (a scale-down,
    a pause) or was moved already, and owes no replacement."""
    now = database_now()
    moved_at = {"moved_at": now} if moved and replica.state in (*SERVING_REPLICA_STATES, ReplicaState.SLEEPING) else {}
    changed = Replica.objects.filter(pk=replica.pk, state=replica.state).update(
        state=final_state, state_changed_at=now, stopped_at=now, failure_reason=reason if final_state == ReplicaState.FAILED else "",
        num_running=0, num_waiting=0, **moved_at,
    )
    if changed:
        _end_sleep(replica.pk, now)
        notify_node(replica.node_id)
        kind = EventKind.FAILURE if final_state == ReplicaState.FAILED else EventKind.REPLICA
        # NOTE: the value, as the console shows states: an f-string of the member reads "ReplicaState.FAILED".
        state = ReplicaState(final_state).value
        record_event(replica.endpoint, kind, f"Replica {str(replica.pk)[:8]} {state}: {reason}", replica=replica)
        request_reconcile(replica.endpoint_id)
    return bool(changed)


def fail_replica_and_count(replica: Replica, reason: str, *, permanent: bool = False) -> bool:
    """`fail_replica`, and when this call failed it, count the failure against its endpoint (`record_replica_failure`),
    in one transaction: the reconcile it requests runs after both commit. Returns whether this call failed it.

    NOTE: apart, `fail_replica`'s reconcile (sent at once, outside a transaction) read the endpoint before its count:
    a start from zero that timed out was replaced at once, with no backoff (a review's finding). The endpoint's row is
    locked first, as a reconcile takes it before its replicas': a reconcile draining this replica meanwhile would
    otherwise wait on this one, and this one on the reconcile's endpoint. Endpoint rows are locked `FOR NO KEY UPDATE`
    (here, `record_replica_failure`, the reconcile): an event's or a replica's deferred foreign-key check at commit
    takes `FOR KEY SHARE` on its endpoint, which a plain `FOR UPDATE` held elsewhere blocks; and a heartbeat's report
    (`apply_replica_report`) locks its replica's row alone, or, one that fails it, its endpoint's first. Each was a deadlock with a heartbeat
    or the silent-node sweep (`tests/test_replica_lock_order.py`).
    """
    with transaction.atomic():
        Endpoint.objects.select_for_update(no_key=True).filter(pk=replica.endpoint_id).values_list("pk", flat=True).first()
        changed = fail_replica(replica, reason)
        if changed:
            record_replica_failure(replica.endpoint_id, reason, permanent=permanent)
    return changed


def sleep_replica(replica: Replica, *, reason: str, why_not: str | None = None) -> bool:
    """A READY replica the autoscaler lets go sleeps instead of stopping, where it can; else it drains.

    It sleeps when its endpoint's `idle_action` is "sleep", the platform's sleep mode is on, its node is a GPU node
    and its node's sleepers, this one with them, fit in their share of the node's memory (`placement.room_to_sleep`);
    otherwise it drains, the reason in the event log. `why_not`: `_why_not_asleep` as its caller judged it, where it
    locked the node on that judgement (`sleep_replicas`); None, judged here. Returns whether this call changed it.
    """
    endpoint = replica.endpoint
    if not _may_try_to_sleep(replica):
        return drain_replica(replica, reason=reason)
    why_not = _why_not_asleep(replica) if why_not is None else why_not
    if why_not:
        return drain_replica(replica, reason=f"{reason}; stopped rather than asleep: {why_not}")
    now = database_now()  # NOTE: as `stop_long_sleepers` judges it
    with transaction.atomic():
        # NOTE: under its node's lock (as placement and `wake_replica` take it, before the replica's row): two sleeps
        # at once on one node cannot both count the room one of them takes.
        node = Node.objects.select_for_update().filter(pk=replica.node_id).first()
        why_not = "its node is gone" if node is None else _room_to_sleep_here(node, replica)
        changed = 0 if why_not else Replica.objects.filter(pk=replica.pk, state=ReplicaState.READY).update(
            state=ReplicaState.SLEEPING, state_changed_at=now, num_running=0, num_waiting=0)
        if changed:
            ReplicaSleep.objects.create(replica_id=replica.pk, started_at=now)
    if why_not:
        return drain_replica(replica, reason=f"{reason}; stopped rather than asleep: {why_not}")
    if changed:
        notify_node(replica.node_id)
        record_event(endpoint, EventKind.SCALE, f"Replica {str(replica.pk)[:8]} sleeps: {reason}", replica=replica,
                     stops_after_s=settings.SLEEP_STOP_AFTER_S)
    return bool(changed)


def sleep_replicas(replicas: list[Replica], *, reason: str) -> int:
    """`sleep_replica` for each of `replicas` (a reconcile's scale-down), in one transaction (the caller's, where it has
    one), the rows of the nodes of those that may sleep locked first, in their primary key's order. Returns how many this call changed.

    NOTE: each sleep holds its node's row lock until the transaction commits (`sleep_replica`). Taken one sleep at a
    time, in the order the replicas are let go, a reconcile letting go a replica on node B then one on node A waited
    for A while another held A and waited for B: another endpoint's scale-down letting go one on A then one on B, or a
    placement, which locks a GPU type's nodes in that order (`place_replica`). PostgreSQL's deadlock detection then
    rolled one back (a review's finding, `tests/test_sleep_host_memory.py`)."""
    with transaction.atomic():
        # NOTE: the nodes of replicas that may sleep alone: one that stops rather than sleeps (a CPU node's, an agent
        # older than sleep mode) counts nothing on its node, and its scale-down waited behind whatever held the node.
        # Each replica is judged once, here: judged again by `sleep_replica` once the locks were granted, a node whose
        # agent was upgraded meanwhile was locked then, alone and out of order, and a placement holding it and waiting
        # for a node locked here deadlocked with the scale-down (a review's finding).
        why_not = {replica.pk: _why_not_asleep(replica) for replica in replicas if _may_try_to_sleep(replica)}
        node_ids = {replica.node_id for replica in replicas if replica.node_id and why_not.get(replica.pk) == ""}
        if node_ids:
            list(Node.objects.select_for_update().filter(pk__in=node_ids).order_by("pk").values_list("pk", flat=True))
        return sum(sleep_replica(replica, reason=reason, why_not=why_not.get(replica.pk)) for replica in replicas)


def _may_try_to_sleep(replica: Replica) -> bool:
    """Whether `sleep_replica` considers sleeping the replica at all: else it drains as any other let go."""
    return replica.endpoint.idle_action == IdleAction.SLEEP and replica.state == ReplicaState.READY


def _why_not_asleep(replica: Replica) -> str:
    """Why a replica `sleep_replica` considers stops rather than sleeps, before its node's room is counted; "" where it
    may sleep."""
    return ("" if settings.SLEEP_MODE else "sleep mode is off on this platform (INFERPLANE_SLEEP_MODE)") or (
        "CPU nodes never sleep" if replica.endpoint.gpu_type == "cpu" else "") or (
        "its node's agent is older than sleep mode" if replica.node_id and not _node_knows_sleep(replica) else "")


def _room_to_sleep_here(node: Node, replica: Replica) -> str:
    """`placement.room_to_sleep` for `replica` on its node, with what the node's sleepers hold now (call under the
    node's lock). A sleeper told to drain counts until it stops (its engine keeps its weights in host memory until
    its agent stops it): it is DRAINING, and its last time asleep ended as it began to drain (`drain_replica`).

    NOTE: the newcomer stops rather than an older sleeper: each sleeper was told when it fell asleep how long it
    would stay (its event), and the host memory an older one frees comes back only once its engine exits, while
    the newcomer's weights would be copied out at once. README "Sleep mode"."""
    asleep = list(Replica.objects.filter(node=node).exclude(pk=replica.pk)
                  .filter(Q(state=ReplicaState.SLEEPING) | Q(state=ReplicaState.DRAINING, sleeps__ended_at=F("state_changed_at")))
                  .select_related("endpoint").distinct())
    # NOTE: their checkpoints' sizes in one query: read sleeper by sleeper, twice each, a node of 40 sleepers took 80
    # queries under its row lock, which its heartbeat waits for (a review's finding).
    sizes = reported_weights_sizes_mb([sleeper.endpoint for sleeper in (*asleep, replica)])
    asleep_mb = sum(host_memory_asleep_mb(sleeper, sizes[sleeper.endpoint_id]) for sleeper in asleep)
    sleeper_mb = host_memory_asleep_mb(replica, sizes[replica.endpoint_id])
    why_not = room_to_sleep(node, asleep_mb, sleeper_mb)
    if why_not:  # staff's detail: what the node's sleepers hold (its tenant reads `why_not` alone)
        logger.info("replica %s did not sleep on node %s: %s (its sleepers hold %d MB, this one %d MB, of its %d MB)",
                    replica.pk, node.name, why_not, asleep_mb, sleeper_mb, node_memory_mb(node))
    return why_not


def _node_knows_sleep(replica: Replica) -> bool:
    node = Node.objects.filter(pk=replica.node_id).only("last_status").first()
    return node is None or node.knows_action(ReplicaAction.SLEEP)


def lock_nodes_to_wake(endpoint: Endpoint, sleeping: list[Replica], *, to_place: bool) -> None:
    """Lock, in their primary key's order and in one step, the nodes a scale-up waking `sleeping` may lock: theirs
    (`wake_replica`) and, `to_place` (a wake may fail, a replica may be placed), those placement takes (`place_replica`:
    the READY nodes of the endpoint's GPU type). Call in the scale-up's transaction.

    NOTE: `wake_replica` locks its sleeper's node until the reconcile commits, and wakes go newest sleeper first: one
    that could not wake on node B, then one on node A (or a placement, which locks A first), waited for A while a
    scale-down onto sleep (`sleep_replicas`) or another placement held A and waited for B. PostgreSQL's deadlock
    detection then rolled one back (a review's finding, `tests/test_sleep_host_memory.py`). Not `to_place`, the
    scale-up must place nothing under these locks: taken after the sleepers' nodes, placement's would be out of order
    (`scheduler._add_replicas` starts again, these given back, rather than place)."""
    in_wake = Q(pk__in={replica.node_id for replica in sleeping if replica.node_id})
    list(Node.objects.select_for_update()
         .filter(in_wake | Q(state=NodeState.READY, gpu_type=endpoint.gpu_type) if to_place else in_wake)
         .order_by("pk").values_list("pk", flat=True))


def wake_replica(replica: Replica) -> str:
    """Wake a SLEEPING replica for the calls waiting on its endpoint: back to STARTING (its agent calls
    `/wake_up`, then reports READY). Returns "" when woken.

    NOTE: its GPUs were placeable while it slept; if they no longer have room for it (checked under the
    node's lock, as placement does), it stops and the reason is returned: the caller places a new replica.
    """
    now = database_now()  # NOTE: as the sweep judges a wake (`scheduler._sweep`)
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(pk=replica.node_id).first()
        current = Replica.objects.select_for_update().filter(pk=replica.pk, state=ReplicaState.SLEEPING).first()
        if current is None:
            return "it no longer sleeps"
        why_not = "its node is gone" if node is None else (
            "" if node.state == NodeState.READY else f"its node is {node.state}")
        if not why_not:
            active = Replica.objects.filter(node=node, state__in=ACTIVE_REPLICA_STATES)
            holds = [GpuHold(tuple(indices), reserved_mb, shared=fraction is not None) for indices, reserved_mb, fraction in
                     active.values_list("gpu_indices", "reserved_memory_mb", "gpu_memory_fraction")]
            used_mb = sum(hold.reserved_mb for hold in holds)
            why_not = room_to_wake(node, holds, used_mb, GpuHold(tuple(current.gpu_indices), current.reserved_memory_mb,
                                                                 shared=current.gpu_memory_fraction is not None))
            if why_not:  # staff's detail: what the node holds (its tenant reads `why_not` alone)
                logger.info("replica %s could not wake on node %s: %s (its active replicas hold %d of its %d MB)",
                            replica.pk, node.name, why_not, used_mb, node.total_gpu_memory_mb)
        if not why_not:
            Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.STARTING, state_changed_at=now, woken_at=now,
                                                         progress="waking (sleep mode)")
            _end_sleep(replica.pk, now)
    if why_not:
        # A failed wake falls back to a new start: this one stops, the caller places another.
        fail_replica(current, f"could not wake: {why_not}; a new replica starts instead", final_state=ReplicaState.STOPPED,
                     moved=True)
        return why_not
    notify_node(replica.node_id)
    record_event(replica.endpoint, EventKind.SCALE, f"Waking replica {str(replica.pk)[:8]} (asleep since "
                 f"{current.state_changed_at:%H:%M:%S} UTC)", replica=replica)
    return ""


def stop_long_sleepers(endpoint: Endpoint, *, may_sleep: bool = True) -> int:
    """Sleeping replicas of the endpoint stop for real once asleep `INFERPLANE_SLEEP_STOP_AFTER_S`, or at once when
    the endpoint no longer sleeps (its `idle_action` changed, the platform's sleep mode is off, or not `may_sleep`: its
    organisation is held to an idle cap, `quota_room.idle_caps`)."""
    sleeping = Replica.objects.filter(endpoint=endpoint, state=ReplicaState.SLEEPING).select_related("endpoint")
    keeps_sleeping = endpoint.idle_action == IdleAction.SLEEP and settings.SLEEP_MODE and may_sleep
    if keeps_sleeping:
        # NOTE: by PostgreSQL's clock: by this worker's, one 31 minutes ahead stopped a replica asleep a moment ago
        sleeping = sleeping.filter(state_changed_at__lt=database_time_ago(settings.SLEEP_STOP_AFTER_S))
    reason = (f"asleep for {settings.SLEEP_STOP_AFTER_S:.0f} s (INFERPLANE_SLEEP_STOP_AFTER_S)" if keeps_sleeping
              else "its endpoint no longer sleeps idle replicas" if may_sleep
              else "an organisation without a payment method keeps no replica asleep")
    return sum(drain_replica(replica, reason=reason) for replica in sleeping)


def _end_sleep(replica_id, now) -> None:
    """Close the replica's open time asleep, if any: its GPU-seconds count again from `now`."""
    ReplicaSleep.objects.filter(replica_id=replica_id, ended_at__isnull=True).update(ended_at=now)


def state_after_report(current: str, reported: ReplicaState) -> str:
    """The transition table: the control plane's state for a replica after its agent's report.

    The control plane owns DRAINING, SLEEPING and the final states: an agent saying READY
    never revives a replica that was told to drain or was already stopped, nor wakes one told to
    sleep (only `wake_replica` does, through STARTING); an agent still saying SLEEPING of a replica
    being woken leaves it STARTING until its engine answers READY.
    """
    if current in FINAL_REPLICA_STATES:
        return current
    if reported in FINAL_REPLICA_STATES:
        return reported
    if current == ReplicaState.DRAINING:
        return current
    if reported == ReplicaState.DRAINING:  # the agent drains on its own (e.g. its shutdown)
        return reported
    if current == ReplicaState.PENDING and reported in (ReplicaState.STARTING, ReplicaState.READY):
        return reported
    if current == ReplicaState.STARTING and reported == ReplicaState.READY:
        return reported
    if current == ReplicaState.READY and reported == ReplicaState.STARTING:  # the engine crashed and is restarting
        return reported
    return current


def apply_replica_report(node: Node, report: protocol.ReplicaStatus, *, heartbeat: tuple[str, int] | None = None) -> None:
    """Take what the node's agent says of one of its replicas: its load, address, restarts and state.

    A report about another node's replica, one that no longer exists, or one stopped or failed already, is ignored:
    a final state is the control plane's, and nothing a node says of it afterwards (a restart, its reason, its load)
    reaches the replica's row or its endpoint's event log. `heartbeat` (boot id, sequence) is the numbered heartbeat
    that carries the report: it is taken only while that is still the node's last heartbeat taken.

    NOTE: a report that fails its replica (FAILED, or an engine address refused) writes FAILED and counts the failure
    against its endpoint (`record_replica_failure`) in one transaction, as `fail_replica_and_count` does. Counted after
    the commit, a reconcile in between (the periodic pass, one a waiting call requests) saw no replica and no backoff
    and placed a replacement at once (a review's finding). For such a report alone, its endpoint's row is locked
    `FOR NO KEY UPDATE` first, then its replica's, the order every other writer of both takes: never the replica's then
    the endpoint's (`tests/test_replica_lock_order.py`). Every other report locks its replica's row alone.
    """
    refused_address = report.address and node.engine_address_problem(report.address)
    with transaction.atomic():
        if report.state == ReplicaState.FAILED or refused_address:
            # A replica's endpoint never changes: read unlocked, then locked before the replica's row.
            endpoint_id = (Replica.objects.filter(pk=report.replica_id, node=node).exclude(state__in=FINAL_REPLICA_STATES)
                           .values_list("endpoint_id", flat=True).first())
            if endpoint_id is None:
                return
            Endpoint.objects.select_for_update(no_key=True).filter(pk=endpoint_id).values_list("pk", flat=True).first()
        replica = (
            Replica.objects.select_for_update(of=("self",)).select_related("endpoint").filter(pk=report.replica_id, node=node)
            .exclude(state__in=FINAL_REPLICA_STATES).first()
        )
        if replica is None:
            return
        # NOTE: read under the replica's row lock. Two heartbeats of one agent in flight at once each pass the node's
        # check in turn (`fleet.services.record_heartbeat`), and their reports are taken after it: the older's could
        # land last. A newer heartbeat taken by now makes the older's report stale; one taken later waits on this
        # lock for its own report, so it lands after.
        if heartbeat is not None and not Node.objects.last_heartbeat_is(node.pk, heartbeat).exists():
            return
        previous = replica.state
        new_state = ReplicaState(state_after_report(previous, report.state)).value
        fields = {
            "num_running": report.num_running, "num_waiting": report.num_waiting,
            "kv_cache_usage": report.kv_cache_usage, "tokens_per_s": report.tokens_per_s,
            "num_prefix_cache_queries": report.num_prefix_cache_queries,
            "num_prefix_cache_hits": report.num_prefix_cache_hits,
            "progress": report.progress[:100], "progress_percent": report.progress_percent,
        }
        memory = report.engine_memory
        memory_changed = memory is not None and (memory.weights_mb, memory.kv_cache_mb) != (
            replica.engine_weights_mb, replica.engine_kv_cache_mb
        )
        for name in ("download_s", "engine_start_s"):  # measured once by the agent; kept once heard
            if getattr(report, name) is not None and getattr(replica, name) is None:
                fields[name] = getattr(report, name)
        if memory_changed:
            fields["engine_weights_mb"], fields["engine_kv_cache_mb"] = memory.weights_mb, memory.kv_cache_mb
        if report.address and not refused_address:
            fields["address"] = report.address
        if report.num_restarts > replica.num_restarts:
            fields["num_restarts"] = report.num_restarts
            record_event(
                replica.endpoint, EventKind.FAILURE,
                f"Replica {str(replica.pk)[:8]} engine crashed and was restarted (restart {report.num_restarts})",
                replica=replica, reason=report.failure_reason[-500:],
            )
        if refused_address and new_state not in FINAL_REPLICA_STATES:
            # NOTE: a node may only point the gateway at its own registered host and port range; an
            # engine elsewhere (a stolen node secret, a misconfigured agent) is failed, never routed to.
            new_state = ReplicaState.FAILED.value
            logger.warning("node %s reported replica %s's engine at %r, refused: %s (its host %s, ports %d-%d)", node.pk,
                           replica.pk, report.address[:200], refused_address, node.advertise_host, node.engine_port_min,
                           node.engine_port_max)
            report = dataclasses.replace(report, failure_reason=f"refused: {refused_address}")
        if new_state != previous:
            now = database_now()  # NOTE: a change of state by PostgreSQL's clock, as the sweeps judge it (`drain_replica`)
            fields["state"] = new_state
            fields["state_changed_at"] = now
            if previous == ReplicaState.SLEEPING:
                _end_sleep(replica.pk, now)
            if new_state == ReplicaState.READY:
                fields["ready_at"] = now
            if new_state in FINAL_REPLICA_STATES:
                fields["stopped_at"] = now
                fields["num_running"] = fields["num_waiting"] = 0
            if new_state == ReplicaState.FAILED:
                fields["failure_reason"] = report.failure_reason[-2000:] or "engine failed"
        Replica.objects.filter(pk=replica.pk).update(**fields)
        if new_state != previous and new_state == ReplicaState.FAILED:
            _announce_failure(replica, previous, report)
    if new_state == ReplicaState.READY and report.chat_template_tokens is not None:
        record_chat_template_tokens(replica.endpoint, report.chat_template_tokens, node_id=node.pk,
                                    replica_id=replica.pk)
    if memory_changed:
        problem = memory_estimate_problem(replica.endpoint, memory)
        if problem:
            record_event(replica.endpoint, EventKind.CAPACITY, f"Replica {str(replica.pk)[:8]}: {problem}"[:300],
                         replica=replica, **memory.to_dict())
    if new_state != previous and new_state != ReplicaState.FAILED:
        _announce_transition(replica, previous, new_state, report)
    elif new_state == ReplicaState.READY and replica.endpoint.num_failures_since_ready:
        # NOTE: a READY's clear runs after its commit: one lost there (the pod killed, the database restarted) left
        # "failures with none READY" beside a READY replica for good (a scaled-to-zero endpoint's calls 503 for up to
        # an hour, the next crash's back-off continuing the old run); any later READY report heals it (a review's
        # finding). Read from the row the report already fetched: no query on a plain heartbeat.
        record_replica_ready(replica.endpoint_id, first=False)


def record_chat_template_tokens(endpoint: Endpoint, measured: protocol.ChatTemplateTokens, *, node_id,
                                replica_id) -> None:
    """Keep what a READY engine counted of its model's chat template, in the scope the endpoint reads the model in
    (as `fleet.services.record_model_facts` keeps a config's facts): the gateway's estimate of every prompt to
    that model allows at least this (`endpoints.gateway.estimate`).

    NOTE: from any READY report that carries it, not only the one that says READY first: the agent measures on a
    thread once the engine is READY, and its heartbeat says READY at once, before the count is in. Once kept, the
    same count from the same replica is not looked up again for a minute (`_kept_template_counts`): a heartbeat
    pays nothing for it. And only while the endpoint still reads the copy the engine was started on (the source and scope
    the agent reports with the count): an endpoint edited since (its credential dropped, say: a tenant's own
    copy of a catalogue name now reads the catalogue's) would otherwise file its old engine's count, a template
    the tenant wrote, as the catalogue copy's, which every other tenant's reservations read.
    NOTE: a fact like the model's others (`ModelFacts.learn`): bounded to what a template can add, and a shared
    copy's count is changed only by two nodes' agreeing reports; `node_id` is the node whose engine counted, and
    `replica_id` its replica, whose claim a tenant's copy keeps as its own (two revisions may run on one node)."""
    claimant = (endpoint.pk, str(node_id), str(replica_id), measured.model_source, measured.weights_scope)
    counts = (measured.per_conversation, measured.per_message, measured.flagged_per_conversation,
              measured.flagged_per_message)
    last = _kept_template_counts.get(claimant)
    if last is not None and last[0] == counts and time.monotonic() - last[1] < KEPT_TEMPLATE_COUNT_S:
        return
    source, scope = endpoint.model_source, endpoint.weights_scope
    if (measured.model_source, measured.weights_scope) != (source, scope):
        logger.info("endpoint %s: a chat template count of another copy (%s in scope %r) is not kept", endpoint.pk,
                    measured.model_source[:200], measured.weights_scope)
        return
    values = {"template_tokens_per_conversation": measured.per_conversation,
              "template_tokens_per_message": measured.per_message}
    if measured.flagged_per_conversation is not None:
        values |= {"template_tokens_flagged_per_conversation": measured.flagged_per_conversation,
                   "template_tokens_flagged_per_message": measured.flagged_per_message}
    problem = ModelFacts.learn(source, scope, node_id, values, replica_id=replica_id)
    if problem:
        logger.warning("endpoint %s: a chat template count (%s, %s) was not kept: %s", endpoint.pk,
                       measured.per_conversation, measured.per_message, problem)
    if len(_kept_template_counts) >= 10_000:
        _kept_template_counts.clear()
    _kept_template_counts[claimant] = (counts, time.monotonic())


# (endpoint, node, replica, measured copy) -> the counts this process last kept for it, and when
# (`record_chat_template_tokens`). NOTE: the last counts, not every count seen: a replica's claim lowered (900, then
# 40) and raised again (900) was never learned again, its engine adding 860 tokens a conversation unreserved. And
# only for a while: another web process may have kept another count since.
_kept_template_counts: dict[tuple, tuple[tuple, float]] = {}
# How long a count this process kept is taken as still kept (another process's report may have replaced it).
KEPT_TEMPLATE_COUNT_S = 60.0


def memory_estimate_problem(endpoint: Endpoint, memory: protocol.EngineMemory) -> str:
    """How the engine's own memory report differs from placement's estimate; "" when within the margin.

    Weights are compared where the engine says (CUDA); a CPU engine's KV cache against the fixed one
    placement reserves, when it is larger: the agent sizes it to what the replica's sequences can fill,
    at most that (`gpu_agent.runtime.engine.cpu_kv_cache_bytes`). A CUDA engine's KV cache fills what
    --gpu-memory-utilization leaves: not compared.
    """

    def off(actual: int, expected: int) -> bool:
        gap = abs(actual - expected)
        return gap > MEMORY_ESTIMATE_MARGIN * expected and gap > MEMORY_ESTIMATE_SLACK_MB

    if memory.weights_mb is not None:
        expected = estimated_weights_mb(endpoint)
        if off(memory.weights_mb, expected):
            return (f"the engine's weights take {memory.weights_mb} MB, placement estimated {expected} MB "
                    f"(quantization {endpoint.quantization} on {endpoint.gpu_type})")
    kv_cache_mb = memory.kv_cache_mb
    if endpoint.gpu_type == "cpu" and kv_cache_mb is not None and kv_cache_mb > CPU_KV_CACHE_MB and off(kv_cache_mb, CPU_KV_CACHE_MB):
        return f"the engine's KV cache takes {kv_cache_mb} MB, placement reserved {CPU_KV_CACHE_MB} MB"
    return ""


def _announce_failure(replica: Replica, previous: str, report: protocol.ReplicaStatus) -> None:
    """A replica its agent's report failed: its event, its failure counted, its endpoint reconciled once that commits.
    In `apply_replica_report`'s transaction, with the endpoint's row locked."""
    reason = report.failure_reason or "engine failed"
    record_event(replica.endpoint, EventKind.FAILURE, f"Replica {str(replica.pk)[:8]} failed: {reason[-200:]}",
                 replica=replica, **{"from": previous, "to": ReplicaState.FAILED.value})
    record_replica_failure(replica.endpoint_id, reason, permanent=report.failure_permanent)
    request_reconcile(replica.endpoint_id)


def _keep_warm_from() -> datetime:
    """Now by Redis's clock, the one the tick judges a keep-warm window by (`autoscaler.floor`): a cold start's end,
    from which it counts (`Endpoint.last_cold_start_at`). This process's own clock where Redis cannot be read (nor
    can the tick read it then).

    NOTE: stamped by the clock of the web pod that heard the READY and judged at Redis's, a web pod 15 minutes behind
    gave a 10-minute keep-warm none at all: the replica let go at the next idle tick."""
    # NOTE: on Redis Cluster a cluster it cannot reach raises `RedisClusterException`, no `RedisError`: the READY's
    # announcement raised after its commit (the heartbeat a 500, the cold start's event and window lost)
    try:
        return datetime.fromtimestamp(redis_time(), UTC)
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError):
        logger.warning("could not read Redis's clock; a keep-warm window counts from this process's own", exc_info=True)
        return timezone.now()


def _announce_transition(replica: Replica, previous: str, new_state: str, report: protocol.ReplicaStatus) -> None:
    """A replica's change of state other than to FAILED (`_announce_failure`): its event, and a READY's counts."""
    short = str(replica.pk)[:8]
    details = {"from": previous, "to": new_state}
    if new_state == ReplicaState.READY and replica.woken_at is not None and (
            replica.ready_at is None or replica.woken_at > replica.ready_at):
        record_replica_ready(replica.endpoint_id, first=replica.ready_at is None)  # a wake of one that served: not first
        notify_endpoint_ready(replica.endpoint_id)
        # NOTE: by PostgreSQL's clock, as `woken_at` was stamped: by this web pod's, one 15 minutes behind showed the
        # tenant a wake of -880 s
        seconds = (database_now() - replica.woken_at).total_seconds()
        record_event(replica.endpoint, EventKind.COLD_START, f"Replica {short} woke READY after {seconds:.1f} s (a wake, not a start)",
                     replica=replica, wake=True, wake_s=round(seconds, 3), **details)
    elif new_state == ReplicaState.READY:
        record_replica_ready(replica.endpoint_id, first=replica.ready_at is None)  # else its engine restarted in place
        notify_endpoint_ready(replica.endpoint_id)
        seconds = (timezone.now() - replica.created_at).total_seconds()
        Endpoint.objects.filter(pk=replica.endpoint_id).update(last_cold_start_at=_keep_warm_from())
        record_event(replica.endpoint, EventKind.COLD_START, f"Replica {short} READY after {seconds:.1f} s", replica=replica,
                     cold_start_s=round(seconds, 3), **details)
    else:
        # NOTE: the agent's reason, if any (a replica that could not sleep says why it stopped instead).
        reason = {"reason": report.failure_reason[-300:]} if report.failure_reason and previous == ReplicaState.SLEEPING else {}
        record_event(replica.endpoint, EventKind.REPLICA, f"Replica {short} {previous} → {new_state}", replica=replica,
                     **details, **reason)


# What varies between two crashes of one cause: hex addresses (`object at 0x7fab12cd`), temporary names
# (`/tmp/tmpk3j_x9z2`), hashes and ids (hex runs, alone or with digits), and numbers.
VARYING_IN_A_REASON = re.compile(r"0x[0-9a-f]+|\btmp[a-z0-9_]{6,}|\b[0-9a-f]*\d[0-9a-f]*\b|\b[0-9a-f]{8,}\b|\d+", re.IGNORECASE)
# The longest wait between two replicas of a crash-looping endpoint, however many failed in a row.
REPLICA_RETRY_MAX_S = 3600.0


def failure_signature(reason: str) -> str:
    """A failure reason with its varying parts (numbers, addresses, temp names, ids) blanked, to tell repeats apart."""
    return VARYING_IN_A_REASON.sub("#", reason.strip().splitlines()[-1] if reason.strip() else "")[-300:]


def max_failures_since_ready() -> int:
    """Failures in a row, whatever their reasons, that stop an endpoint: twice the identical ones allowed."""
    return 2 * settings.REPLICA_MAX_IDENTICAL_FAILURES


def retry_delay_s(num_failures: int) -> float:
    """The backoff after the `num_failures`-th failure in a row: base × 2^(n-1), at most `REPLICA_RETRY_MAX_S`."""
    return min(settings.REPLICA_RETRY_BASE_S * 2 ** min(num_failures - 1, 20), REPLICA_RETRY_MAX_S)


def record_replica_failure(endpoint_id, reason: str, *, permanent: bool = False) -> None:
    """Count a replica's failure against its endpoint: back off, and stop the endpoint when it repeats.

    The n-th failure in a row with no replica READY in between, whatever its reason, delays the next
    placement by base × 2^(n-1) (at most `REPLICA_RETRY_MAX_S`); the `REPLICA_MAX_IDENTICAL_FAILURES`-th
    identical one in a row, the `max_failures_since_ready()`-th of any reasons with none of its replicas READY, or
    one the agent calls permanent (the spec cannot run on this model) stops the endpoint as FAILED, with the reason as its
    status, until a spec change or a resume. A failure while another replica of it is READY is a scale-up's: the
    n-th of those in a row delays its next scale-up alike (`Endpoint.scale_up_backing_off`), and does not count
    toward the failures with none READY. A replica turning READY starts the counts again (`record_replica_ready`).

    NOTE: counting identical reasons alone let a reason that varied (an address in the last line) or
    alternated (a tenant's weights swapped between two broken versions) place a replica every
    `REPLICA_RETRY_BASE_S` for ever, each holding a GPU nobody paid for (a review's finding).
    """
    now = database_now()  # NOTE: the backoff by PostgreSQL's clock, as it is judged (`Endpoint.backoff_left_s`)
    reason = (reason.strip() or "engine failed")[-2000:]
    with transaction.atomic():
        endpoint = Endpoint.objects.select_for_update(no_key=True).filter(pk=endpoint_id, failed_at__isnull=True).first()
        if endpoint is None:
            return
        serving = Replica.objects.filter(endpoint_id=endpoint.pk, state=ReplicaState.READY).exists()
        # NOTE: a scale-up count stands only with its backoff: a web pod of the release before 0032 clears the other
        # counts and `next_attempt_at` (a replica READY, a resume, a spec change), never this one, and the next failed
        # scale-up after a rolling deploy backed off an hour (a review's finding). Every reset here clears both.
        num_scale_ups_before = endpoint.num_scale_up_failures if endpoint.next_attempt_at is not None else 0
        # NOTE: the first failure with none READY after failed scale-ups starts its own run of identical reasons: the
        # model served meanwhile. Carried over, three scale-ups killed by the kernel's OOM killer ("engine exited with
        # code -9") and, weeks later, the first crash of the replica that served set the endpoint FAILED (a review's
        # finding). Identical failures of scale-ups alone still fail it, as from none.
        after_scale_ups = not serving and endpoint.num_failures_since_ready == 0 and num_scale_ups_before > 0
        signature = failure_signature(reason)
        repeats = (endpoint.num_identical_failures + 1
                   if signature == endpoint.last_failure_reason and not after_scale_ups else 1)
        short = reason.splitlines()[-1][-200:]
        fields = {"num_identical_failures": repeats, "last_failure_reason": signature,
                  # NOTE: backing off or failed, it wants no replica now: a node pool launches no machine for it.
                  "unplaced_replicas": 0, "waiting_for_capacity": False}
        # NOTE: while a replica of it serves, the model works, so varied failures of extra replicas are capacity or
        # node faults: they back off its scale-ups (up to `REPLICA_RETRY_MAX_S`) and are not counted toward the rule
        # for failures with none serving. Counted, 8 of them failed the endpoint while its READY replica went on
        # serving (a review's finding), and later the first crash of that replica failed it, "none served", or its
        # hour of backoff held its start from zero. Identical or permanent ones still fail it.
        # NOTE: with a replica READY none failed since one was: counted on (a web pod of the release before 0032 added
        # a scale-up's failure here; a READY not yet committed when another's crash was counted), every rule that reads
        # "no failure since READY" (`Endpoint.scale_up_backing_off`, `after_scale_ups`) went off for good: a scaled-to-
        # zero endpoint's calls were 503 for up to an hour, and identical scale-up failures then the serving replica's
        # first crash failed it (a review's finding).
        num_failures = 0 if serving else endpoint.num_failures_since_ready + 1
        num_scale_up_failures = num_scale_ups_before + int(serving)
        fields.update(num_failures_since_ready=num_failures, num_scale_up_failures=num_scale_up_failures)
        stopped_by = ("permanent" if permanent else "identical" if repeats >= settings.REPLICA_MAX_IDENTICAL_FAILURES
                      else "many" if num_failures >= max_failures_since_ready() and not serving else "")
        if stopped_by:
            fields.update(failed_at=now, next_attempt_at=None, status_message=f"failed: {short}"[:300])
            message = {
                "permanent": f"Endpoint failed: {short}",
                "identical": f"Endpoint failed: {repeats} replicas in a row failed with the same reason ({short})",
                "many": f"Endpoint failed: {num_failures} replicas in a row failed, none served (last: {short})",
            }[stopped_by] + "; it stays stopped until its configuration changes or it is resumed"
        elif serving:
            delay_s = retry_delay_s(num_scale_up_failures)
            fields.update(next_attempt_at=now + timedelta(seconds=delay_s),
                          status_message=f"scale-up backing off: {short}; next try in {delay_s:.0f} s"[:300])
            message = (f"Next scale-up in {delay_s:.0f} s (failure {num_scale_up_failures} in a row while a replica serves, "
                       f"{repeats} of {settings.REPLICA_MAX_IDENTICAL_FAILURES} with this reason)")
        else:
            delay_s = retry_delay_s(num_failures)
            fields.update(next_attempt_at=now + timedelta(seconds=delay_s),
                          status_message=f"replica failed ({short}); retrying in {delay_s:.0f} s"[:300])
            message = (f"Next replica in {delay_s:.0f} s (failure {num_failures} of {max_failures_since_ready()} allowed in a row, "
                       f"{repeats} of {settings.REPLICA_MAX_IDENTICAL_FAILURES} with this reason)")
        Endpoint.objects.filter(pk=endpoint.pk).update(**fields)
        record_event(endpoint, EventKind.FAILURE, message, reason=short, repeats=repeats, num_failures=num_failures)


def record_replica_ready(endpoint_id, *, first: bool = True) -> None:
    """A replica served: earlier failures no longer predict the next one. `first`: its first READY (a start); else a
    restart in place or a wake, which proves the model still serves but nothing of the scale-ups that failed meanwhile:
    with failed scale-ups counted, only "failures with none READY" is cleared (their count, back-off and identical
    reasons stand); with none, every count is cleared, as by a first READY.

    NOTE: every READY cleared every count: a serving engine that crashed and was restarted by its agent between failed
    scale-ups cleared their back-off and identical count, and new replicas were placed at every tick, for ever (a
    review's finding).

    NOTE: the endpoint's row is locked first (`FOR NO KEY UPDATE`, as every writer of its counts): a failure being
    counted meanwhile (`record_replica_failure`, which read no replica READY before this one's READY committed) is
    waited for and then cleared. Without the lock this found no count to clear and took no lock, and that failure's
    count, written after, stood beside a READY replica (a review's finding). Called after the READY's commit, never
    under a replica's row lock."""
    with transaction.atomic():
        Endpoint.objects.select_for_update(no_key=True).filter(pk=endpoint_id).values_list("pk", flat=True).first()
        counted = Endpoint.objects.filter(pk=endpoint_id).filter(
            Q(num_identical_failures__gt=0) | Q(num_failures_since_ready__gt=0) | Q(num_scale_up_failures__gt=0)
            | Q(next_attempt_at__isnull=False))
        if not first:  # failed scale-ups stand; with none, every count is a start's, and a READY ends them
            Endpoint.objects.filter(pk=endpoint_id, num_scale_up_failures__gt=0,
                                    num_failures_since_ready__gt=0).update(num_failures_since_ready=0)
            counted = counted.filter(num_scale_up_failures=0)
        counted.update(num_identical_failures=0, num_failures_since_ready=0, num_scale_up_failures=0,
                       last_failure_reason="", next_attempt_at=None, status_message="")
