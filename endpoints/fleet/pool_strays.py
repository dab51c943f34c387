"""The stray sweep: a pool's machines that carry this fleet's marking but that no launch record knows are terminated.

A launch's record (`NodeLaunch`) is committed before its provider is asked (`pools.launch_for_demand`), so every
machine the fleet starts has one, until PostgreSQL loses it: a failover to a replica that was behind, or a restore to
an earlier point. The machine then runs, paid for, its agent turned away (its join token went with the record), and no
other step looks for it: joins, deadlines and releases all start from a record.

Every minute (the beat's `sweep-stray-machines`, task `endpoints.sweep_stray_machines`), per pool:
1. the provider's whole list (`Provider.list`: every page). A list that fails or times out ends the pool's sweep:
   nothing is terminated on part of the picture, and no stray is forgotten;
2. a listed machine is a stray when it carries this installation's marking (`Machine.fleet_marked`: the fleet id, the
   pool and `FleetInstallation`'s random id, as EC2's tags, the placeholder's labels, the local agent's record), its
   launch id is one the fleet makes (a UUID), and no `NodeLaunch` of any pool, in any state, has that id;
3. a stray is remembered from the sweep that first saw it (`StrayMachine.first_seen_at`, PostgreSQL's clock); one that
   is no longer a stray (gone, or its record found) is forgotten;
4. a stray seen for `STRAY_GRACE_S` is claimed with a conditional update (of two sweeps at once, one terminates it),
   terminated outside any transaction, audited once (`node_launch.stray_terminate`) and logged. A termination that
   fails gives the claim back to the next sweep; one the provider accepted whose machine is still listed a claim
   period later is terminated again. One whose answer was lost (a timeout, the worker killed) is audited when a later
   sweep finds the machine gone (`StrayMachine.terminate_sent_at`), before its row is forgotten.

NOTE: the list is read before the records, so a launch committed meanwhile is known; the grace covers the rest (a
provider's listing that lags, a clock that is off). A machine of a pool whose own row was lost is not listed: the
pool's template (region, namespace) went with it. A machine without the installation id (launched before it existed,
or by another installation sharing the account, namespace or folder under the same fleet id and pool id) is never a
stray.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from celery.exceptions import SoftTimeLimitExceeded
from django.db.models import Q
from django.db.models.functions import Now

from controlplane.accounts.services import SYSTEM, record_audit
from controlplane.clock import database_time_ago
from controlplane.redis_keys import POOLS_SWEEP_STARTED_KEY
from endpoints.fleet.pools import start_turn, turn_order
from endpoints.fleet.providers import get_provider, pool_spec
from endpoints.fleet.providers.base import Machine, Provider, ProviderError, ProviderUnreachable
from endpoints.nodes.models import NodeLaunch, NodePool, StrayMachine

logger = logging.getLogger(__name__)

# A machine is a stray this long (by PostgreSQL's clock) before it is terminated.
STRAY_GRACE_S = 600.0
# A claim older than this belongs to a sweep that died (above `endpoints.sweep_stray_machines`' time limit, 240 s): the
# stray may be claimed again.
CLAIM_S = 300.0


def sweep_stray_machines(provider_for: Callable[[str], Provider] = get_provider) -> list[str]:
    """Every pool's strays seen for the grace period are terminated; returns their provider ids."""
    terminated = []
    # NOTE: least recently started first (`pools.turn_order`): in the order of their ids, a pool whose listing outlasted
    # the task's time limit ended every sweep, and the strays of the pools after it were never terminated, paid for.
    for pool in turn_order(list(NodePool.objects.order_by("pk")), POOLS_SWEEP_STARTED_KEY):
        start_turn(pool, POOLS_SWEEP_STARTED_KEY)
        try:
            terminated += sweep_pool(pool, provider_for(pool.provider))
        except SoftTimeLimitExceeded:
            raise  # the task's time is up: not one pool's failure to carry on past
        except Exception:  # noqa: BLE001 - one broken pool (its provider down) must not stop the others' sweep
            logger.exception("node pool %s: stray sweep failed", pool.name)
    return terminated


def sweep_pool(pool: NodePool, provider: Provider) -> list[str]:
    """The pool's strays: remembered, forgotten, and terminated once seen for `STRAY_GRACE_S`."""
    try:
        machines = provider.list(pool_spec(pool))
    except ProviderError as error:
        logger.warning("node pool %s: stray sweep could not list the machines, terminating none: %s", pool.name, error)
        return []
    strays = find_strays(machines)
    forget_strays(pool, {machine.provider_id for machine in machines}, {machine.provider_id for machine in strays})
    StrayMachine.objects.bulk_create(
        [StrayMachine(pool=pool, provider_id=machine.provider_id, launch_id=machine.launch_id, first_seen_at=Now())
         for machine in strays], ignore_conflicts=True)
    due = StrayMachine.objects.filter(pool=pool, provider_id__in=[machine.provider_id for machine in strays],
                                      first_seen_at__lte=database_time_ago(STRAY_GRACE_S))
    return [stray.provider_id for stray in due if terminate_stray(pool, provider, stray)]


def find_strays(machines: list[Machine]) -> list[Machine]:
    """The machines with this fleet's marking and a launch id of the fleet's form that no `NodeLaunch` has."""
    marked = {}
    for machine in machines:
        if machine.fleet_marked and machine.provider_id and (launch_id := _launch_uuid(machine.launch_id)):
            marked[machine.provider_id] = (machine, launch_id)
    known = set(NodeLaunch.objects.filter(pk__in={launch_id for _, launch_id in marked.values()}).values_list("pk", flat=True))
    return [machine for machine, launch_id in marked.values() if launch_id not in known]


def forget_strays(pool: NodePool, listed: set[str], strays: set[str]) -> None:
    """The pool's remembered machines that are no longer strays are forgotten; one gone after a termination was sent
    but never confirmed (its answer lost) is audited first, as terminated by the sweep."""
    gone = StrayMachine.objects.filter(pool=pool, terminate_sent_at__isnull=False, terminated_at__isnull=True).exclude(
        provider_id__in=listed)
    for stray in gone:
        if StrayMachine.objects.filter(pk=stray.pk).delete()[0]:  # NOTE: of two sweeps at once, one audits
            logger.warning("node pool %s: terminated stray machine %s (launch %s, no launch record since %s; the "
                           "provider's answer was lost, the machine is gone)", pool.name, stray.provider_id,
                           stray.launch_id, stray.first_seen_at.isoformat())
            _audit_terminated(pool, stray, answer_lost=True)
    StrayMachine.objects.filter(pool=pool).exclude(provider_id__in=strays).delete()


def terminate_stray(pool: NodePool, provider: Provider, stray: StrayMachine) -> bool:
    """Claim the stray, terminate its machine; audited the first time the provider accepts. Whether it terminated."""
    claimed = StrayMachine.objects.filter(pk=stray.pk).filter(
        Q(claimed_at__isnull=True) | Q(claimed_at__lte=database_time_ago(CLAIM_S))).update(
        claimed_at=Now(), terminate_sent_at=Now())
    if not claimed:
        return False  # another sweep is terminating it
    try:
        provider.terminate(pool_spec(pool), stray.provider_id)
    except ProviderError as error:
        # NOTE: a refusal is an answer (the machine stays); no answer may have terminated it (`forget_strays`).
        unanswered = isinstance(error, ProviderUnreachable)
        StrayMachine.objects.filter(pk=stray.pk).update(
            claimed_at=None, **({} if unanswered else {"terminate_sent_at": None}))
        logger.warning("node pool %s: terminating stray machine %s failed, trying again next sweep: %s",
                       pool.name, stray.provider_id, error)
        return False
    logger.warning("node pool %s: terminated stray machine %s (launch %s, no launch record since %s)",
                   pool.name, stray.provider_id, stray.launch_id, stray.first_seen_at.isoformat())
    if StrayMachine.objects.filter(pk=stray.pk, terminated_at__isnull=True).update(terminated_at=Now()):
        _audit_terminated(pool, stray, answer_lost=False)
    return True


def _audit_terminated(pool: NodePool, stray: StrayMachine, *, answer_lost: bool) -> None:
    reason = f"no launch record knows it, seen so for {int(STRAY_GRACE_S)} s"
    if answer_lost:
        reason += "; the provider's answer to its termination was lost, and the machine is gone"
    record_audit(SYSTEM, None, "node_launch.stray_terminate", stray, pool=pool.name, provider_id=stray.provider_id,
                 launch_id=stray.launch_id, first_seen_at=stray.first_seen_at.isoformat(), reason=reason)


def _launch_uuid(launch_id: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(launch_id)
    except ValueError:
        return None
