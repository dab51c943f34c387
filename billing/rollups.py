"""Hourly rollups of the ledger per organisation × endpoint × hour × billing mode.

The billing mode comes from each usage row (written with the row), so an hour in which the
organisation switched mode has one rollup per mode: its prepaid part is paid from credit and never
pushed to Stripe, its postpaid part is pushed.

A run recomputes, from the ledger itself, every hour that received rows since the previous run
(so running it twice changes nothing), then closes hours older than the close delay. An open hour
simply takes its new totals. A closed hour never changes: if late rows arrive for it, or a row of it is
superseded (`billing.ledger`), the difference becomes an ADJUSTMENT rollup with the next sequence, pushed to Stripe
on its own; its fields are negative where the ledger's went down (a superseding row cheaper than the one it replaced),
and go to Stripe as negative meter events. Fewer rows than the closed rollups count is usage deleted: logged as an
ERROR, never adjusted.
One run at a time (a transaction-scoped advisory lock); a run killed midway rolls back whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction

from billing.ledger import HOURLY_TOTAL_FIELDS, RECORDED_AT_MARGIN, hourly_totals
from billing.models import BillingAccount, BillingMode, RollupCursor, RollupKind, UsageRollup

logger = logging.getLogger(__name__)

ROLLUP_LOCK_ID = 0x1B111_0001


@dataclass(slots=True)
class RollupResult:
    num_groups: int = 0
    num_created: int = 0
    num_updated: int = 0
    num_adjustments: int = 0
    num_closed: int = 0
    # The organisations whose prepaid rollups changed: their credit is drawn next (`credit_draw_due`).
    prepaid_organization_ids: set[int] = field(default_factory=set)


def close_delay() -> timedelta:
    """How long after an hour starts its rollup closes: the hour itself, then the wait for late rows."""
    return timedelta(hours=1, seconds=settings.BILLING_ROLLUP_CLOSE_AFTER_S)


def rollup_usage(*, now: datetime | None = None, full: bool = False) -> RollupResult:
    """Bring the rollups up to date with the ledger; `full` recomputes every hour ever recorded. `now`: when hours
    close and rollups are stamped, PostgreSQL's clock if None."""
    result = RollupResult()
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [ROLLUP_LOCK_ID])
            cursor.execute("SELECT now(), clock_timestamp()")
            started_at, database_now = cursor.fetchone()
        # NOTE: hours close by PostgreSQL's clock, which the rows' `recorded_at` and the push's claims are stamped by;
        # by the worker's own (`timezone.now()`), one 90 minutes ahead closed the hour whose calls were still arriving
        # (each later call pushed to Stripe as an adjustment of its own), and one behind held every push back as long.
        now = now or database_now
        state, _ = RollupCursor.objects.select_for_update().get_or_create(id=1)
        totals = hourly_totals(recorded_since=None if full else state.recorded_since)
        result.num_groups = len(totals)
        if totals:
            _apply(totals, now, result)
        # NOTE: with the rollups, in their transaction: the draw that follows (`billing.tasks.rollup_usage`) may not
        # happen (the worker killed, a draw failing, the time limit), and a rerun finds nothing changed to draw for.
        # Chosen by the rollups' mode, not the account's: prepaid rows recorded before a switch to postpaid are still
        # drawn from credit (`draw_credits` reads the ledger's prepaid rows), and are never pushed to Stripe.
        BillingAccount.objects.filter(organization_id__in=result.prepaid_organization_ids,
                                      credit_draw_due=False).update(credit_draw_due=True)
        result.num_closed = UsageRollup.objects.filter(
            closed_at__isnull=True,
            hour_start__lte=now - close_delay(),
        ).update(closed_at=now)
        state.recorded_since = started_at - RECORDED_AT_MARGIN
        state.last_run_at = now
        state.save()
    return result


def _note_changed_group(result: RollupResult, organization_id: int, mode: str) -> None:
    """A rollup of the organisation in `mode` was made or changed: a prepaid one has usage to draw from credit."""
    if mode == BillingMode.PREPAID:
        result.prepaid_organization_ids.add(organization_id)


def _apply(totals: dict, now: datetime, result: RollupResult) -> None:
    hours = [hour for _, _, hour, _ in totals]
    existing: dict[tuple, list[UsageRollup]] = {}
    candidates = UsageRollup.objects.filter(
        hour_start__gte=min(hours), hour_start__lte=max(hours),
        organization_id__in={org for org, _, _, _ in totals}, endpoint_id__in={endpoint for _, endpoint, _, _ in totals},
    ).order_by("sequence")
    for rollup in candidates:
        key = (rollup.organization_id, rollup.endpoint_id, rollup.hour_start, rollup.billing_mode)
        existing.setdefault(key, []).append(rollup)

    to_create, to_update = [], []
    for group, total in totals.items():
        org, endpoint, hour, mode = group
        rollups = existing.get(group)
        if not rollups:
            to_create.append(UsageRollup(organization_id=org, endpoint_id=endpoint, hour_start=hour, billing_mode=mode,
                                         computed_at=now, push_uid=UsageRollup.push_uid_of(endpoint, hour, mode, 0),
                                         **total))
            _note_changed_group(result, org, mode)
            continue
        primary = rollups[0]
        if primary.closed_at is None:
            # NOTE: adjustments exist only for closed hours, so an open primary is the hour's only rollup.
            if any(getattr(primary, name) != value for name, value in total.items()):
                for name, value in total.items():
                    setattr(primary, name, value)
                primary.computed_at = now
                to_update.append(primary)
                _note_changed_group(result, org, mode)
            continue
        difference = {name: total[name] - sum(getattr(r, name) for r in rollups) for name in HOURLY_TOTAL_FIELDS}
        if not any(difference.values()):
            continue
        if difference["num_requests"] < 0:
            # NOTE: rows are only added or superseded (`billing.ledger`: a superseding row replaces one, the count
            # stays), so fewer rows means someone deleted usage: never bill it backwards silently.
            logger.error("ledger lost rows under closed rollup %s: %s", primary, difference)
            continue
        # NOTE: the whole difference, negative fields too: a superseding row may cost less than the one it replaced
        # (a lost row's progress knew no prefix-cache hits). Before, any negative field skipped the group: Stripe kept
        # the overcharge, and later rows of that hour were swallowed until they outweighed it.
        sequence = rollups[-1].sequence + 1
        to_create.append(UsageRollup(
            organization_id=org, endpoint_id=endpoint, hour_start=hour, billing_mode=mode, sequence=sequence,
            kind=RollupKind.ADJUSTMENT, computed_at=now, closed_at=now,
            push_uid=UsageRollup.push_uid_of(endpoint, hour, mode, sequence), **difference,
        ))
        result.num_adjustments += 1
        _note_changed_group(result, org, mode)

    UsageRollup.objects.bulk_create(to_create, batch_size=1000)
    UsageRollup.objects.bulk_update(to_update, [*HOURLY_TOTAL_FIELDS, "computed_at"], batch_size=1000)
    result.num_created = len(to_create) - result.num_adjustments
    result.num_updated = len(to_update)
