"""Per-organisation quotas: how much of the fleet one organisation may hold.

The numbers come from the organisation's plan, or the platform defaults
(`controlplane.accounts.models.Quotas`). They are checked in three places, each against the same rules here:

- an endpoint spec (create or update, API and console wizard): endpoints, each endpoint's
  `max_replicas`, the sum of warm floors (`warm_floor`: `min_replicas` or pre-warm windows), and GPU
  types the plan allows (400 with field errors);
- placement (`endpoints.scheduler`): a new replica only while the organisation holds fewer than its
  `max_replicas` in all and its GPUs of that type, so the autoscaler never scales it past them
  (the endpoint shows "waiting for quota: …"), and while it started fewer than it may in the last hour
  (`start_refusal`, `quota_room.ReplicaStarts`: its gateway calls then get a 429 at once);
- a quota lowered below what the organisation holds (its plan changed, or it moved to a smaller one: `over_quota`):
  its endpoints' reconciles drain its replicas down to it, one at a time, newest first, each drain audited
  (`replica.quota_drain`) and the endpoints holding them showing why ("over quota: …"), never all at once: a
  mistyped plan must not take every tenant on it cold in one tick; and only `QUOTA_DRAIN_GRACE_S` after it was first
  found over (`Organization.over_quota_since`), staff having seen and confirmed what the change drains (`drains_of`);
- the gateway (`endpoints.gateway.cold_start`): requests held for a cold start;
- file uploads (`endpoints.batches.services.create_file`): bytes of files kept (400 `storage_quota_exceeded`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, Q, Sum
from rest_framework.exceptions import ValidationError

from controlplane.accounts.models import Organization, Quotas
from controlplane.accounts.services import Drains
from controlplane.clock import DatabaseClock
from controlplane.redis_client import get_redis, redis_time
from controlplane.redis_keys import held_key
from endpoints.batches.models import File
from endpoints.models import ACTIVE_REPLICA_STATES, SERVING_REPLICA_STATES, Endpoint, Replica
from endpoints.quota_room import ReplicaStarts, recounted, replica_room, replica_starts
from endpoints.replicas import request_reconcile
from gpu_agent.protocol import ReplicaState

# The first key of the transaction-scoped locks a person's organisations without a card place under (`lock_starts`),
# the second an organisation's id. NOTE: the two-key form: apart from the one-key locks (`billing.rollups`).
PERSON_STARTS_LOCK = 7301


class QuotaExceeded(ValidationError):
    """A spec the organisation's quotas refuse: 400 with field errors on /api/."""


@dataclass(slots=True, frozen=True)
class QuotaRow:
    quota: str  # the plan's field, e.g. "max_replicas" or "max_gpus_by_type.h100"
    label: str
    limit: int
    used: int
    unit: str = ""  # "bytes", or a count


@dataclass(slots=True, frozen=True)
class QuotaUse:
    """What an organisation holds now, beside its quotas."""

    plan: str | None  # None: the platform defaults
    quotas: Quotas
    num_endpoints: int
    num_replicas: int
    num_min_replicas: int
    num_held_requests: int
    num_file_bytes: int = 0
    num_gpus_by_type: dict[str, int] = field(default_factory=dict)
    starts: ReplicaStarts | None = None  # None: its replica starts an hour are not bounded

    @property
    def rows(self) -> list[QuotaRow]:
        rows = [
            QuotaRow("max_endpoints", "Endpoints", self.quotas.max_endpoints, self.num_endpoints),
            QuotaRow("max_replicas", "Replicas at once", self.quotas.max_replicas, self.num_replicas),
            QuotaRow("max_min_replicas", "Replicas kept warm (min_replicas and pre-warm windows)",
                     self.quotas.max_min_replicas, self.num_min_replicas),
            QuotaRow("max_held_requests", "Requests waiting for cold starts", self.quotas.max_held_requests,
                     self.num_held_requests),
            QuotaRow("max_file_bytes", "File storage (batch inputs and outputs)", self.quotas.max_file_bytes,
                     self.num_file_bytes, unit="bytes"),
        ]
        for gpu_type in sorted(set(self.quotas.max_gpus_by_type) | set(self.num_gpus_by_type)):
            rows.append(QuotaRow(f"max_gpus_by_type.{gpu_type}", f"{gpu_type} GPUs at once",
                                 self.quotas.max_gpus(gpu_type), self.num_gpus_by_type.get(gpu_type, 0)))
        if self.starts is not None:
            label = "Replicas started in the last hour" + (" (without a payment method)" if self.starts.without_card
                                                           else " (on hold: none)" if self.starts.on_hold else "")
            rows.append(QuotaRow("replica_starts_per_hour", label, self.starts.limit, self.starts.num_started))
        return rows


def warm_floor(min_replicas: int, prewarm_windows: list[dict] | None) -> int:
    """The replicas an endpoint may keep warm with no traffic, as `max_min_replicas` counts them: its
    `min_replicas`, or its largest pre-warm window's floor.

    NOTE: a window counts whole, however seldom it opens: `* * * * *` for a week is `min_replicas`
    under another name, and the quota bounds what is warm at once. Keep-warm after a cold start is not
    counted: it follows a call, keeps one replica, and for no longer than `idle_timeout_s` may (a day).
    """
    return max([min_replicas, *(window["min_replicas"] for window in prewarm_windows or [])])


def _num_warm(endpoints) -> int:
    return sum(warm_floor(min_replicas, windows) for min_replicas, windows
               in endpoints.values_list("min_replicas", "prewarm_windows"))


def use_of(organization: Organization) -> QuotaUse:
    endpoints = Endpoint.objects.for_org(organization).order_by()
    totals = endpoints.aggregate(num=Count("pk"))
    held = Replica.objects.filter(endpoint__organization=organization, state__in=ACTIVE_REPLICA_STATES).order_by()
    gpus_by_type = dict(  # GPUs, not replicas: a tensor-parallel replica holds gpus_per_replica of them
        held.values("endpoint__gpu_type").annotate(num=Sum("endpoint__gpus_per_replica"))
        .values_list("endpoint__gpu_type", "num")
    )
    num_held = get_redis().zcount(held_key(organization.pk), f"({redis_time()}", "+inf")  # `cold_start`'s clock
    file_bytes = File.objects.held_by(organization.pk).aggregate(total=Sum("bytes"))["total"] or 0
    return QuotaUse(organization.plan.name if organization.plan_id else None, organization.quotas, totals["num"],
                    held.count(), _num_warm(endpoints), num_held, file_bytes, gpus_by_type, replica_starts(organization))


QUOTA_FIELDS = ("gpu_type", "min_replicas", "max_replicas", "gpus_per_replica", "prewarm_windows")
GPU_FIELDS = ("gpu_type", "max_replicas", "gpus_per_replica")  # what the GPU quota judges


def spec_errors(organization: Organization, changes: dict, instance: Endpoint | None = None) -> dict[str, list[str]]:
    """Field errors for a new endpoint's spec, or for `changes` to `instance`.

    An update that touches none of `QUOTA_FIELDS` passes: lowering a plan never locks an endpoint's
    other settings; each rule judges an update only when it changes that rule's fields (the GPU quota
    `GPU_FIELDS`), and none is refused for replicas kept warm unless it raises the endpoint's warm floor.
    """
    changed = {name for name in QUOTA_FIELDS if name in changes and (instance is None or changes[name] != getattr(instance, name))}
    if instance is not None and not changed:
        return {}
    spec = {name: changes[name] if name in changes else
            getattr(instance, name) if instance is not None else Endpoint._meta.get_field(name).get_default()
            for name in QUOTA_FIELDS}
    quotas = organization.quotas
    others = Endpoint.objects.for_org(organization).order_by()
    if instance is not None:
        others = others.exclude(pk=instance.pk)
    errors: dict[str, list[str]] = {}
    if instance is None and others.count() >= quotas.max_endpoints:
        errors["name"] = [f"Your plan allows {quotas.max_endpoints} endpoints (quota max_endpoints); "
                          "delete one or ask us for a larger plan."]
    gpu_type, max_replicas = spec["gpu_type"], spec["max_replicas"]
    max_gpus = quotas.max_gpus(gpu_type)
    if instance is not None and not changed & set(GPU_FIELDS):
        pass  # a plan lowered below this endpoint's GPUs still lets its other quota fields change
    elif max_gpus == 0:
        errors["gpu_type"] = [f"Your plan allows no {gpu_type} GPUs (quota max_gpus_by_type)."]
    elif spec["gpus_per_replica"] > max_gpus:
        errors["gpus_per_replica"] = [f"Your plan allows at most {max_gpus} {gpu_type} GPUs at once (quota "
                                      f"max_gpus_by_type); one replica here takes {spec['gpus_per_replica']}."]
    elif max_replicas * spec["gpus_per_replica"] > max_gpus:
        quota = "max_replicas" if max_gpus == quotas.max_replicas else f"max_gpus_by_type for {gpu_type}"
        most, num_gpus = max_gpus // spec["gpus_per_replica"], spec["gpus_per_replica"]
        errors["max_replicas"] = [f"Your plan allows at most {most} replicas at once on {gpu_type} (quota {quota})"
                                  + (f": {max_gpus} GPUs, {num_gpus} per replica." if num_gpus > 1 else ".")]
    warm = warm_floor(spec["min_replicas"], spec["prewarm_windows"])
    raises_warm = instance is None or warm > warm_floor(instance.min_replicas, instance.prewarm_windows)
    warm_elsewhere = _num_warm(others) if raises_warm else 0
    if raises_warm and warm + warm_elsewhere > quotas.max_min_replicas:
        room = max(0, quotas.max_min_replicas - warm_elsewhere)
        message = (f"Your plan keeps at most {quotas.max_min_replicas} replicas warm over all endpoints (quota "
                   f"max_min_replicas); your other endpoints keep {warm_elsewhere}, so at most {room} here")
        if warm > spec["min_replicas"]:
            errors["prewarm_windows"] = [f"{message}. A pre-warm window counts as its min_replicas kept warm, and "
                                         f"one here keeps {warm}."]
        else:
            errors["min_replicas"] = [message + "."]
    return errors


def check_spec(organization: Organization, changes: dict, instance: Endpoint | None = None) -> None:
    errors = spec_errors(organization, changes, instance)
    if errors:
        raise QuotaExceeded(errors)


def lock_organization(organization_id: int, *, skip_locked: bool = False) -> Organization | None:
    """The organisation's row, locked until the transaction ends: quota checks that count and then
    add (endpoints, replicas) run one at a time per organisation. With `skip_locked`, None where another
    transaction holds the row (the caller retries later) instead of waiting for it.

    NOTE: FOR NO KEY UPDATE, as the accounts' changes take it (they conflict with each other): FOR UPDATE also held up
    every row whose foreign key names the organisation (usage rows, audit events) until the placement committed."""
    locked = Organization.objects.select_for_update(of=("self",), skip_locked=skip_locked, no_key=True).select_related(
        "plan"
    )
    return locked.get(pk=organization_id) if not skip_locked else locked.filter(pk=organization_id).first()


def replica_refusal(endpoint: Endpoint) -> str | None:
    """Why the endpoint's organisation may not hold one more replica now, or None.

    NOTE: call with the organisation locked (`lock_organization`), then place in the same transaction.
    """
    room = replica_room(endpoint.organization, starts=False)  # NOTE: the starts are `start_refusal`'s, a placement's
    quotas = room.quotas
    if room.num_held >= quotas.max_replicas:
        return f"your plan allows {quotas.max_replicas} replicas at once and your endpoints hold {room.num_held}"
    max_gpus = quotas.max_gpus(endpoint.gpu_type)
    num_of_type = room.num_gpus_held.get(endpoint.gpu_type, 0)
    if num_of_type + endpoint.gpus_per_replica > max_gpus:
        return f"your plan allows {max_gpus} {endpoint.gpu_type} GPUs at once and your endpoints hold {num_of_type}"
    return None


def start_refusal(endpoint: Endpoint) -> str | None:
    """Why the endpoint's organisation may not start (place anew) one more replica this hour, or None
    (`quota_room.ReplicaStarts`); waking a sleeping one is not a start.

    NOTE: call with the organisation locked (`lock_organization`), then place in the same transaction; its starts are
    read under the person's lock where their bound is shared (`lock_starts`)."""
    starts = lock_starts(endpoint)
    return None if starts is None or starts.num_left else starts.refusal()


def lock_starts(endpoint: Endpoint) -> ReplicaStarts | None:
    """The endpoint's organisation's `ReplicaStarts`, read under transaction-scoped locks where its bound is shared with
    the other organisations of its people (`ReplicaStarts.shared_with`): their placements are serialised too, and the
    count read again once they are held. Each holding its own organisation's row alone, two at once each counted the
    other's start as not yet made.

    NOTE: one lock an organisation, its own and each it counts, in their ids' order in one statement: who counts whom
    is no equivalence (handed on, an organisation counts its creator's others and its new owner's, each of those it
    alone), so one lock of the lowest id of each circle left two that counted each other under two locks.

    NOTE: lock order: the organisation's row, then these locks, then nodes' rows (`place_replica`, `wake_replica`). A
    scale-up that locks its GPU type's nodes before it may place (`replicas.lock_nodes_to_wake`) takes them first:
    after the nodes, it waited for them holding the nodes while another of its people's organisations held them and
    waited for the nodes to place, a deadlock (`tests/test_replica_starts_per_person.py`). Taken again in the same
    transaction, they are held already and wait for nothing."""
    starts = replica_starts(endpoint.organization)
    if starts is not None and starts.shared_with:
        with connection.cursor() as cursor:
            # NOTE: ordered in a subquery, which PostgreSQL never flattens, so each placement takes them in that order
            cursor.execute("SELECT pg_advisory_xact_lock(%s, organization_id) FROM (SELECT unnest(%s::integer[]) AS "
                           "organization_id ORDER BY 1) AS ordered",
                           [PERSON_STARTS_LOCK, sorted({endpoint.organization_id, *starts.shared_with})])
        starts = recounted(starts, endpoint.organization_id)
    return starts


@dataclass(slots=True, frozen=True)
class OverQuota:
    """An organisation holding more serving replicas than its plan now allows, in the scope one endpoint counts in."""

    message: str  # shown on the endpoint, the reason of each drain
    quota: str  # the plan's field: "max_replicas" or "max_gpus_by_type.<type>"
    limit: int
    num_held: int  # serving (not draining) replicas, or their GPUs, in that scope
    newest: Replica  # the next to drain: the scope's newest serving replica
    num_draining: int  # the scope's replicas draining now: the next waits for them (one at a time)
    drains_from: datetime | None  # the grace's end (`QUOTA_DRAIN_GRACE_S` after `Organization.over_quota_since`);
    # None: its start not yet stamped (its row held by another write), at a later tick
    in_grace: bool  # before `drains_from` by PostgreSQL's clock: nothing drains yet


def over_quota(endpoint: Endpoint) -> OverQuota | None:
    """Where the endpoint's organisation serves more replicas than its plan allows (in all, or GPUs of the endpoint's
    type): what to drain next, or None.

    NOTE: serving replicas only (pending, starting, ready): those draining are on their way out, and counting them
    drained a second replica before the first had stopped. Placement still counts them (`replica_refusal`), so
    nothing new is placed until the organisation is within its quota.
    NOTE: an organisation on a plan only (`drains_to_quota`).
    NOTE: nothing drains before the grace ends (`in_grace`), counted from when the organisation was first found over
    (`Organization.over_quota_since`, stamped here if no change or tick has yet): a plan mistyped and raised back within
    it stops nothing."""
    organization = endpoint.organization
    if not drains_to_quota(organization):
        return None
    quotas = organization.quotas
    held = Replica.objects.filter(endpoint__organization_id=endpoint.organization_id, state__in=ACTIVE_REPLICA_STATES)
    of_type = Q(endpoint__gpu_type=endpoint.gpu_type)
    # NOTE: both scopes, whatever this endpoint's own GPUs a replica, in one query: judged only where this endpoint
    # took more than one GPU a replica or its type was bounded below `max_replicas`, an organisation past its GPUs whose
    # newest replica was such an endpoint's was never drained (that endpoint found nothing over, the others did not
    # hold the newest), and the tick reconciled its endpoints at every tick for as long as it held them.
    counts = held.filter(state__in=SERVING_REPLICA_STATES).order_by().aggregate(
        num=Count("pk"), gpus=Sum("endpoint__gpus_per_replica", filter=of_type, default=0))
    scopes = [("max_replicas", quotas.max_replicas, counts["num"], held, "replicas"),
              (f"max_gpus_by_type.{endpoint.gpu_type}", quotas.max_gpus(endpoint.gpu_type), counts["gpus"],
               held.filter(of_type), f"{endpoint.gpu_type} GPUs")]
    for quota, limit, num_held, in_scope, what in scopes:
        if num_held <= limit:
            continue
        drains_from, in_grace = _grace(organization)
        # NOTE: no count of what is held, and the grace's end fixed when it starts: the message is the same from the
        # grace to the drains' end, so it is one event on the endpoint's log, not one per tick or drain
        # NOTE: its start not yet stamped, no time: one counted from this reconcile's clock moved at each one, a new
        # message and event on each endpoint at every tick for as long as other writes held the row
        when = (f"from {drains_from.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC" if drains_from is not None
                else f"no sooner than {int(settings.QUOTA_DRAIN_GRACE_S)} s from now")
        message = (f"over quota: your plan now allows {limit} {what} at once, fewer than your endpoints hold; replicas "
                   f"above it stop {when}, one at a time, newest first, unless the plan is raised before")
        serving = in_scope.filter(state__in=SERVING_REPLICA_STATES)
        return OverQuota(message, quota, limit, num_held, serving.order_by("-created_at", "-pk").first(),
                         in_scope.filter(state=ReplicaState.DRAINING).count(), drains_from, in_grace)
    return None


def _grace(organization: Organization) -> tuple[datetime | None, bool]:
    """When the over-quota organisation's drains start (None: not yet stamped), and whether that is still to come
    (PostgreSQL's clock).

    NOTE: stamped here where neither the change that put it over (`mark_over_quota`) nor a tick has: never later than
    the first reconcile that would drain, so no drain skips the grace. Asked of the row, not of `organization` as this
    reconcile read it: a raise committed since may have ended the grace. Where the row is held by another write, its
    grace starts at a later reconcile (never waited for with the endpoint's row held, as `lock_organization`)."""
    if organization.over_quota_since is None:
        _stamp(Organization.objects.filter(pk=organization.pk, over_quota_since__isnull=True), DatabaseClock())
    since, now = Organization.objects.filter(pk=organization.pk).annotate(now=DatabaseClock()).values_list(
        "over_quota_since", "now").get()
    if since is None:
        return None, True
    drains_from = since + timedelta(seconds=settings.QUOTA_DRAIN_GRACE_S)
    return drains_from, now < drains_from


def _stamp(organizations, over_quota_since, *, wait: bool = False) -> None:
    """Write `over_quota_since` on those of `organizations` no other transaction holds (or on each, once free, `wait`).

    NOTE: skipped, never waited for: the tick (and a reconcile holding an endpoint's row) waited behind one tenant's key
    revocation (seconds with thousands of keys), and every tenant's scale-up with it; one skipped is stamped or cleared
    at a later tick, and until its grace is stamped nothing of it drains."""
    with transaction.atomic():
        ids = list(organizations.select_for_update(skip_locked=not wait, no_key=True).order_by("pk")
                   .values_list("pk", flat=True))
        if ids:
            Organization.objects.filter(pk__in=ids).update(over_quota_since=over_quota_since)


def drains_to_quota(organization: Organization) -> bool:
    """Whether a quota lowered below what the organisation holds drains it (`over_quota`): only where it is on a plan.

    NOTE: the platform defaults (`Quotas.platform_default`) are each process's environment, not a row staff change
    and audit: while a deploy that raises them rolls out, the workers of the release before read the old ones, and a
    slip in one manifest reads lower ones. Judged by them, such a worker drained, one after another, every organisation
    on the defaults that held more, each replica the new workers placed included. A lowered default bounds what is
    placed (`replica_refusal`), as before the drains; staff move an organisation to a plan to drain it."""
    return organization.plan_id is not None


def endpoints_over_quota(endpoint_ids, *, judged=(), lowered: bool = False) -> set[str]:
    """Those of `endpoint_ids` that serve replicas for an organisation past its replica or GPU quotas (`over_quota`),
    in two queries. NOTE: for the tick, which otherwise skips an endpoint serving what its autoscaler wants: a reconcile
    asked for when the quota was lowered (`reconcile_organizations`) is a hint a broker out of reach loses, and an
    organisation's every endpoint is among them (the tick's endpoints include every one with replicas).
    Starts the grace of those over and ends that of the others, `judged` (organisation ids) too; `lowered`: a change
    lowered their quotas, and the grace of those over starts again (`mark_over_quota`)."""
    rows = list(Replica.objects.filter(endpoint_id__in=endpoint_ids, state__in=SERVING_REPLICA_STATES).order_by()
                .values("endpoint_id", "endpoint__organization_id", "endpoint__gpu_type")
                .annotate(num=Count("pk"), gpus=Sum("endpoint__gpus_per_replica"))
                .values_list("endpoint_id", "endpoint__organization_id", "endpoint__gpu_type", "num", "gpus"))
    num_held, gpus_held = {}, {}  # organisation -> replicas; organisation -> {GPU type -> GPUs}
    for _, organization_id, gpu_type, num, gpus in rows:
        num_held[organization_id] = num_held.get(organization_id, 0) + num
        of_type = gpus_held.setdefault(organization_id, {})
        of_type[gpu_type] = of_type.get(gpu_type, 0) + (gpus or 0)
    over, stamped = set(), set()
    # NOTE: organisations on a plan only (`drains_to_quota`). Each judged by its own GPU types: a scan of every
    # organisation's for each one was quadratic: 0.4 s of CPU a tick with 3,000 organisations serving, 4 s (past the 2 s
    # tick) with 10,000.
    for organization in Organization.objects.filter(pk__in=num_held, plan__isnull=False).select_related("plan"):
        quotas = organization.quotas
        if num_held[organization.pk] > quotas.max_replicas or any(
                gpus > quotas.max_gpus(gpu_type) for gpu_type, gpus in gpus_held[organization.pk].items()):
            over.add(organization.pk)
        if organization.over_quota_since is not None:
            stamped.add(organization.pk)
    # NOTE: no query at a tick unless an organisation's grace starts or ends there (`mark_over_quota`)
    if judged or over - stamped or stamped - over:
        mark_over_quota(over, judged={*num_held, *judged}, lowered=lowered)
    return {str(endpoint_id) for endpoint_id, organization_id, *_ in rows if organization_id in over}


def mark_over_quota(over, *, judged, lowered: bool = False) -> None:
    """The grace of the organisations in `over` starts now where it has not (`Organization.over_quota_since`), or
    again where a change `lowered` their quotas, and that of the others of `judged` ends: within their plan again
    (raised back, or drained down to it), a later lowering gives them a grace of their own.

    NOTE: a further lowering while over starts the grace again: kept, a mistyped one late in a grace (or while an
    earlier lowering still drained) drained at once, with no time to raise it back, confirmed or not. A raise that
    leaves an organisation over keeps its start: what it still drains was due."""
    if lowered:
        # NOTE: waited for (staff's change, no endpoint's row held; in pk order, as `lock_organizations`): skipped, one
        # held by another write kept its first start, long ended, and drained at once
        _stamp(Organization.objects.filter(pk__in=over), DatabaseClock(), wait=True)
    else:
        _stamp(Organization.objects.filter(pk__in=over, over_quota_since__isnull=True), DatabaseClock())
    _stamp(Organization.objects.filter(pk__in=set(judged) - set(over), over_quota_since__isnull=False), None)


def reconcile_organizations(sender=None, *, organization_ids, lowered=False, **kwargs) -> None:
    """The endpoints of these organisations that serve replicas past their quotas, changed now
    (`accounts.services.replica_quotas_changed`), are reconciled once the change commits: they drain (`over_quota`).

    NOTE: those over alone (`endpoints_over_quota`): each endpoint serving on the plan, asked for at each change, a raise
    too, was thousands of tasks on a plan thousands of organisations are on, sent one by one by staff's save and queued
    ahead of every tenant's cold start, for nothing to drain. An endpoint waiting for quota is the tick's (its message).
    NOTE: the grace of those put over starts with the change, in its transaction, and that of those it puts within ends
    (`mark_over_quota`): a plan raised back cancels the drains still to come, one lowered again starts it again."""
    endpoint_ids = (Replica.objects.filter(endpoint__organization_id__in=organization_ids,
                                           state__in=SERVING_REPLICA_STATES)
                    .order_by().values_list("endpoint_id", flat=True).distinct())
    for endpoint_id in sorted(endpoints_over_quota(list(endpoint_ids), judged=organization_ids, lowered=lowered)):
        request_reconcile(endpoint_id)


def drains_of(organization_ids, quotas: Quotas | None) -> Drains:
    """What giving these organisations `quotas` (None: the platform defaults, which drain nothing: `drains_to_quota`)
    would drain once the grace ends: of their serving replicas, those past the new replica and GPU limits, newest
    first, as `over_quota` picks them, in one query. For staff to see and confirm before the change is saved (the
    Django admin's plan and organisation pages, `accounts.services`)."""
    if quotas is None:
        return Drains()
    rows = (Replica.objects.filter(endpoint__organization_id__in=organization_ids, state__in=SERVING_REPLICA_STATES)
            .order_by("-created_at", "-pk")
            .values_list("endpoint__organization_id", "endpoint_id", "endpoint__gpu_type", "endpoint__gpus_per_replica"))
    by_organization: dict[int, list[tuple]] = {}
    for organization_id, *replica in rows:
        by_organization.setdefault(organization_id, []).append(tuple(replica))
    return _drained(by_organization, quotas)


def _drained(by_organization: dict[int, list[tuple]], quotas: Quotas) -> Drains:
    """Each organisation's serving replicas (endpoint, GPU type, GPUs a replica; newest first), drained one by one while
    it holds more replicas than `quotas` allow (the newest of all) or more GPUs of a type (the newest of that type)."""
    organizations, endpoints, num_replicas = set(), set(), 0
    for organization_id, serving in by_organization.items():
        gpus: dict[str, int] = {}
        for _, gpu_type, gpus_per_replica in serving:
            gpus[gpu_type] = gpus.get(gpu_type, 0) + gpus_per_replica
        while serving:
            past = [gpu_type for gpu_type, num in gpus.items() if num > quotas.max_gpus(gpu_type)]
            if len(serving) <= quotas.max_replicas and not past:
                break
            newest = next(r for r in serving if len(serving) > quotas.max_replicas or r[1] in past)
            serving.remove(newest)
            gpus[newest[1]] -= newest[2]
            organizations.add(organization_id)
            endpoints.add(newest[0])
            num_replicas += 1
    return Drains(len(organizations), len(endpoints), num_replicas)
