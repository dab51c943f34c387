"""What an organisation may still place under its replica and GPU quotas and its replica starts an hour (`ReplicaRoom`),
and how long a call keeps its idle replicas when it has no payment method (`idle_caps`).

Its own module, beside `endpoints.quotas` (which judges specs, uploads and placement by it): the node pools
(`endpoints.fleet.pools`) read it too, and `quotas` depends on the batch app, which the pools must not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

from django.conf import settings
from django.db.models import Count, Q, Sum

from billing.models import BillingAccount
from billing.standing import held_without_payment_method, limit_without_payment_method_applies
from controlplane.accounts.models import Organization, Quotas
from controlplane.accounts.organizations import organizations_of_its_people
from controlplane.clock import database_now, database_time_ago
from endpoints.models import ACTIVE_REPLICA_STATES, Replica

# The window replica starts are counted over (`replica_starts`).
REPLICA_STARTS_WINDOW_S = 3600
# An organisation's starts an hour are at least this many times its replica quota (`replica_starts`): each replica it may
# hold started from zero, and replaced once, within the hour.
STARTS_PER_REPLICA_QUOTA = 2
# What a reconcile refused for the starts an hour says after "waiting for quota: " (`endpoints.scheduler`), which the
# gateway reads on the endpoint to refuse its cold calls at once (`endpoints.gateway.standing`).
REPLICA_STARTS_REFUSAL = "replica starts an hour"
# What follows it for an organisation on hold, whose cold calls the gateway answers as every call of its: a 402.
REPLICA_STARTS_ON_HOLD = "your organisation's calls are stopped for an unpaid invoice or a disputed payment"


@dataclass(slots=True)
class ReplicaRoom:
    """What an organisation holds now against its replica and GPU quotas, and so how many more it may place.

    NOTE: the one count both placement (`quotas.replica_refusal`) and the node pools' demand
    (`endpoints.fleet.pools.assign_demand`) judge by: a replica the quota will refuse is no demand for a machine."""

    quotas: Quotas
    num_held: int
    num_gpus_held: dict[str, int]  # GPU type -> GPUs its replicas hold (a tensor-parallel one holds several)
    starts: ReplicaStarts | None = None  # None: its replica starts are not bounded

    def num_more(self, gpu_type: str, gpus_per_replica: int) -> int:
        """How many more replicas of that shape the organisation may hold now (and start this hour)."""
        by_replicas = self.quotas.max_replicas - self.num_held
        by_gpus = (self.quotas.max_gpus(gpu_type) - self.num_gpus_held.get(gpu_type, 0)) // max(1, gpus_per_replica)
        by_starts = by_replicas if self.starts is None else self.starts.num_left
        return max(0, min(by_replicas, by_gpus, by_starts))

    def take(self, gpu_type: str, gpus_per_replica: int, num_replicas: int) -> None:
        """Count `num_replicas` more as held (a demand already given a machine), and as started."""
        self.num_held += num_replicas
        self.num_gpus_held[gpu_type] = self.num_gpus_held.get(gpu_type, 0) + num_replicas * gpus_per_replica
        if self.starts is not None:
            self.starts.num_started += num_replicas


@dataclass(slots=True)
class ReplicaStarts:
    """The replicas an organisation placed in the last `REPLICA_STARTS_WINDOW_S`, against how many it may.

    NOTE: a machine costs the fleet from its launch and a replica its GPU from its start, while a tenant pays per token
    alone: a call its client cut at once (unbilled), a pause and resume, a spec change each started one, and nothing
    but the replica quota bounded how often. An organisation without a payment method, which may never pay, is held to
    far fewer (`INFERPLANE_REPLICA_STARTS_PER_HOUR_WITHOUT_CARD`). A sleeping replica woken is not a start: it holds
    its GPU already."""

    limit: int
    num_started: int
    without_card: bool
    on_hold: bool = False  # its calls are stopped for an unpaid invoice or a disputed payment: it starts none (limit 0)
    # the other organisations of its people without a card, counted with it (`replica_starts`)
    shared_with: tuple[int, ...] = ()

    @property
    def num_left(self) -> int:
        return max(0, self.limit - self.num_started)

    def refusal(self) -> str:
        """Why no replica may start now (shown on the endpoint after "waiting for quota: ", and to its callers)."""
        if self.on_hold:
            return (f"{REPLICA_STARTS_REFUSAL}: {REPLICA_STARTS_ON_HOLD}, and it starts no replica until that is "
                    "settled on the billing page")
        if self.without_card:
            together = ", with the other organisations of its people" if self.shared_with else ""
            return (f"{REPLICA_STARTS_REFUSAL}: an organisation without a payment method starts at most {self.limit} "
                    f"replicas an hour{together}; add one on the billing page to start more")
        return f"{REPLICA_STARTS_REFUSAL}: your organisation starts at most {self.limit} replicas an hour"


def refused_for_starts(status_message: str) -> bool:
    """Whether an endpoint's status says a reconcile refused its next replica for its organisation's starts an hour.
    NOTE: "waiting for quota: " is what the scheduler puts before every quota's refusal."""
    return status_message.startswith(f"waiting for quota: {REPLICA_STARTS_REFUSAL}")


def refused_for_hold(status_message: str) -> bool:
    """Whether that refusal is an organisation's on hold (`ReplicaStarts.on_hold`), not its count."""
    return status_message.startswith(f"waiting for quota: {REPLICA_STARTS_REFUSAL}: {REPLICA_STARTS_ON_HOLD}")


def replica_starts(organization: Organization) -> ReplicaStarts | None:
    """The organisation's `ReplicaStarts` now (two queries; up to 15 for one without a card, its people's other
    organisations read too), None where its starts are not bounded.

    NOTE: counted from the replicas' own rows (kept when they stop), by PostgreSQL's clock less their creation time:
    nothing to lose with Redis's memory, and a replica counts wherever it started from (a call's wake, the tick, a
    resume, a spec change, a batch's deadline). An organisation on hold (`billing.standing.hold`, as last reviewed) starts
    none: every call of its is refused, so a replica started for its warm floor, a batch or a resume served nothing.
    NOTE: less those the platform moved in the hour (`Replica.moved_at`: a node drained, lost, retired or released, a
    sleeper that could not wake in place), each owed a replacement that is no start of the tenant's: counted, one lost
    node took an organisation without a card its hour's six, and its calls were refused for a fault of ours. At most the
    hour's bound of them: a tenant whose engine takes its nodes down starts at most twice its bound, never without end.
    NOTE: without a card, a person's bound, not an organisation's: the other organisations of its people without a card
    either (`organizations_of_its_people`, as `billing.standing.limit_without_payment_method` counts their spend) count
    with it. Each had its own, and a person with `MAX_OWNED_ORGANIZATIONS` started five times the bound an hour."""
    account = BillingAccount.objects.filter(organization_id=organization.pk).first()
    if account is not None and account.past_due_since is not None:
        return ReplicaStarts(0, _created_and_moved([organization.pk])[0], without_card=False, on_hold=True)
    # NOTE: an organisation whose account was never made holds no payment method (made on first use, as it would be).
    without_card = held_without_payment_method(account or BillingAccount(organization_id=organization.pk))
    # NOTE: grown with the plan: a plan allowing more replicas at once than the hour's bound could never hold them all
    # from zero within the hour. Not without a card, whose bound stands apart (the lower of the two).
    per_plan = settings.REPLICA_STARTS_PER_HOUR and max(settings.REPLICA_STARTS_PER_HOUR,
                                                        STARTS_PER_REPLICA_QUOTA * organization.quotas.max_replicas)
    limits = [per_plan] + ([settings.REPLICA_STARTS_PER_HOUR_WITHOUT_CARD] if without_card else [])
    limits = [limit for limit in limits if limit]  # 0: no bound
    if not limits:
        return None
    limit = min(limits)
    without_card = without_card and limit == settings.REPLICA_STARTS_PER_HOUR_WITHOUT_CARD
    others = _others_without_card(organization) if without_card else []
    return recounted(ReplicaStarts(limit, 0, without_card, shared_with=tuple(others)), organization.pk)


def recounted(starts: ReplicaStarts, organization_id: int) -> ReplicaStarts:
    """`starts` of the organisation with its count read now, for the same bound and organisations (one query): what a
    placement reads again once it holds the locks of those it counts (`quotas.lock_starts`)."""
    num_created, num_moved = _created_and_moved([organization_id, *starts.shared_with])
    return replace(starts, num_started=max(0, num_created - min(num_moved, starts.limit)))


def _others_without_card(organization: Organization) -> list[int]:
    """The other organisations of its people in the last `REPLICA_STARTS_WINDOW_S` (closed ones too) held to the limit
    without a payment method now: one with a card, prepaid or invoiced starts on its own bound, and counts for none."""
    others = organizations_of_its_people(
        organization.pk, since=database_now() - timedelta(seconds=REPLICA_STARTS_WINDOW_S))
    if not others:
        return []
    accounts = {account.organization_id: account for account in BillingAccount.objects.filter(organization_id__in=others)}
    return [other_id for other_id in others
            if held_without_payment_method(accounts.get(other_id) or BillingAccount(organization_id=other_id))]


def _created_and_moved(organization_ids: list[int]) -> tuple[int, int]:
    """The organisations' replicas created, and those the platform moved, in the last `REPLICA_STARTS_WINDOW_S`: one
    query, on the indexes of each by endpoint and time (`replica_endpoint_created`, `replica_endpoint_moved`)."""
    window_start = database_time_ago(REPLICA_STARTS_WINDOW_S)
    created, moved = Q(created_at__gte=window_start), Q(moved_at__gte=window_start)
    counts = Replica.objects.filter(created | moved, endpoint__organization_id__in=organization_ids).aggregate(
        num_created=Count("pk", filter=created), num_moved=Count("pk", filter=moved))
    return counts["num_created"], counts["num_moved"]


def replica_room(organization: Organization, *, starts: bool = True) -> ReplicaRoom:
    """The organisation's `ReplicaRoom` now (four queries; two without its `starts`, for the replica and GPU quotas
    alone: `quotas.replica_refusal`, before each replica woken or placed, where a woken one is no start)."""
    held = Replica.objects.filter(endpoint__organization_id=organization.pk, state__in=ACTIVE_REPLICA_STATES).order_by()
    # NOTE: GPUs, not replicas: a tensor-parallel replica holds gpus_per_replica of them.
    gpus = dict(held.values("endpoint__gpu_type").annotate(num=Sum("endpoint__gpus_per_replica"))
                .values_list("endpoint__gpu_type", "num"))
    return ReplicaRoom(organization.quotas, held.count(), {gpu_type: num or 0 for gpu_type, num in gpus.items()},
                       replica_starts(organization) if starts else None)


def idle_caps(organization_ids) -> dict[int, int]:
    """Organisation id -> the longest its endpoints keep an idle replica after a call (`idle_timeout_s`) or a cold start
    (`keep_warm_after_cold_start_s`), for those of `organization_ids` held to the limit without a payment method
    (`INFERPLANE_IDLE_TIMEOUT_WITHOUT_CARD_S`); absent: their endpoints' own. One query.

    NOTE: a replica costs its GPU (and a pool's machine) for as long as it stays; the tenant pays per token alone. Up to a
    day each, one call cut at once (unbilled) kept one, for every endpoint its replica quota allows, by an organisation
    that may never pay."""
    cap = settings.IDLE_TIMEOUT_WITHOUT_CARD_S
    organization_ids = set(organization_ids)
    if not cap or not organization_ids or not limit_without_payment_method_applies():
        return {}
    accounts = {account.organization_id: account
                for account in BillingAccount.objects.filter(organization_id__in=organization_ids)}
    return {organization_id: cap for organization_id in organization_ids if held_without_payment_method(
        accounts.get(organization_id) or BillingAccount(organization_id=organization_id))}
