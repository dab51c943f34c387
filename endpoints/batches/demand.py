"""Queued batch work per endpoint, read for the autoscaler tick in one query (`read_demand`)."""

from __future__ import annotations

from django.conf import settings

from controlplane.clock import DatabaseClock
from endpoints.batches.models import Batch, BatchStatus
from endpoints.batches.scheduling import USE_WINDOW_S, BatchDemand, stalled


def read_demand(endpoint_ids: list[str] | None = None, *, now: float | None = None) -> dict[str, BatchDemand]:
    """Pending lines, earliest deadline, the lines per second their keys may send (`requests_per_minute`: the
    platform's default where unset; 0: none) and the lines their runs kept in flight (measured in the last
    `USE_WINDOW_S`; None where no run measured any), of the running batches of each endpoint (all with work if None).
    Stalled batches (`scheduling.stalled`) are left out: they hold and wake nothing. `now`: a unix time by
    PostgreSQL's clock, its own if None; each demand keeps it (`read_at`): its deadline is judged by it."""
    asked_at = now
    batches = Batch.objects.filter(status=BatchStatus.IN_PROGRESS, endpoint__isnull=False)
    if endpoint_ids is not None:
        batches = batches.filter(endpoint_id__in=endpoint_ids)
    # NOTE: judged by PostgreSQL's clock, as a run stores its refusals and measures (`services._run_lines`), read in
    # the same query: no round trip more
    rows = batches.order_by().annotate(database_now=DatabaseClock()).values_list(
        "endpoint_id", "num_total", "num_completed", "num_failed", "expires_at", "api_key_id", "created_by_id",
        "api_key__requests_per_minute", "refused_since", "last_refused_at", "line_concurrency",
        "line_concurrency_at", "database_now")
    pending: dict[str, int] = {}
    deadline: dict[str, float] = {}
    # NOTE: per caller, not per batch: a key's batches share its requests per minute (a member's, the default)
    callers: dict[str, dict[tuple, int]] = {}
    measured: dict[str, float] = {}
    read_at: dict[str, float] = {}
    for (endpoint_id, num_total, num_completed, num_failed, expires_at, api_key_id, created_by_id, key_rpm,
         refused_since, last_refused_at, line_concurrency, line_concurrency_at, database_now) in rows:
        now = database_now.timestamp() if asked_at is None else asked_at
        num_pending = max(0, num_total - num_completed - num_failed)
        if not num_pending or stalled(refused_since=refused_since and refused_since.timestamp(),
                                      last_refused_at=last_refused_at and last_refused_at.timestamp(), now=now):
            continue
        endpoint_id = str(endpoint_id)
        pending[endpoint_id] = pending.get(endpoint_id, 0) + num_pending
        read_at[endpoint_id] = now
        deadline[endpoint_id] = min(deadline.get(endpoint_id, expires_at.timestamp()), expires_at.timestamp())
        rpm = key_rpm if key_rpm is not None else settings.DEFAULT_KEY_REQUESTS_PER_MINUTE
        callers.setdefault(endpoint_id, {})[("key", api_key_id) if api_key_id else ("user", created_by_id)] = rpm
        if line_concurrency_at is not None and now - line_concurrency_at.timestamp() < USE_WINDOW_S:
            measured[endpoint_id] = measured.get(endpoint_id, 0.0) + line_concurrency
    demand = {}
    for endpoint_id, num_pending in pending.items():
        limits = callers[endpoint_id].values()
        max_lines_per_s = None if 0 in limits else sum(limits) / 60
        demand[endpoint_id] = BatchDemand(num_pending, deadline[endpoint_id], max_lines_per_s, measured.get(endpoint_id),
                                          read_at[endpoint_id])
    return demand
