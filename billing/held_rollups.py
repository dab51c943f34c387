"""Rollups held for an operator, counted by why, for the web's `/metrics` (`inferplane_usage_rollups_held{reason}`).

A hold stops a rollup's usage from reaching Stripe until staff decide in the admin (usage rollups, "push held at"),
and each is told by an ERROR log line (and an audit event) once, when it is made: a rewind that held dozens of rollups,
or one held for a week, showed nowhere an alert could see. The push task counts them every minute
(`billing.tasks.push_pending_rollups`, one grouped query through the index of held rollups) and keeps the counts in
Redis (`HELD_ROLLUPS_KEY`) for `COUNTS_TTL_S`; each scrape of a web process reads them from there, never from the
database (`endpoints.gateway.metrics`). Counts not refreshed within that time are not reported at all (the push task
has not run: alert on the series' absence too).

Reasons: `unanswered` (an event whose answer never came, past Stripe's duplicate window: `stripe_sync.hold_for_review`),
`duplicate` (refused as a duplicate of a send the database does not remember: `stripe_sync.hold_duplicate`),
`unknown_lines` (an ended subscription's invoice line whose price cannot be told: `stripe_sync._count_unknown_lines`),
`customer_deleted` (pushed to a Stripe customer deleted since, billed or not unknown: `services.hold_for_operator`).
"""

from __future__ import annotations

import logging

import redis.exceptions
from django.db.models import Case, Count, Q, Value, When

from billing.models import UsageRollup
from billing.stripe_sync import _DUPLICATE_HOLD, UNKNOWN_LINES_HOLD_AFTER
from controlplane.redis_client import get_redis
from controlplane.redis_keys import HELD_ROLLUPS_KEY

logger = logging.getLogger(__name__)

REASONS = ("unanswered", "duplicate", "unknown_lines", "customer_deleted")
# Counts older than this (the push task runs every minute) are not reported.
COUNTS_TTL_S = 600
METRIC_NAME = "inferplane_usage_rollups_held"


def count_held() -> dict[str, int]:
    """The rollups held now, by reason (every reason, 0 for none), in one query."""
    reason = Case(
        When(pushed_at__isnull=False, then=Value("customer_deleted")),
        When(num_unknown_lines_failures__gte=UNKNOWN_LINES_HOLD_AFTER, then=Value("unknown_lines")),
        When(push_error__contains=_DUPLICATE_HOLD, then=Value("duplicate")),
        default=Value("unanswered"))
    rows = (UsageRollup.objects.filter(Q(push_held_at__isnull=False)).annotate(reason=reason)
            .values("reason").annotate(num=Count("id")).order_by())
    return {**dict.fromkeys(REASONS, 0), **{row["reason"]: row["num"] for row in rows}}


def record_held_counts() -> dict[str, int] | None:
    """Count the held rollups and keep the counts for the web's scrapes; None (logged) when Redis refused them."""
    counts = count_held()
    try:
        pipeline = get_redis().pipeline(transaction=True)
        pipeline.hset(HELD_ROLLUPS_KEY, mapping=counts)
        pipeline.expire(HELD_ROLLUPS_KEY, COUNTS_TTL_S)
        pipeline.execute()
    except redis.exceptions.RedisError:
        logger.warning("could not keep the held rollups' counts in Redis; the next push task tries again", exc_info=True)
        return None
    return counts


def recorded_held_counts() -> dict[str, int]:
    """The counts the push task last kept, by reason; empty when none are fresh (`COUNTS_TTL_S`). A field that is not a
    count is left out, with a warning. NOTE: before, it raised out of the scrape, and `/metrics` answered 500: every
    series lost for one bad value."""
    counts = {}
    for reason, num in get_redis().hgetall(HELD_ROLLUPS_KEY).items():
        try:
            counts[reason] = int(num)
        except ValueError:
            logger.warning("the held rollups' count %r in Redis is %r, not a count; left out", reason, num)
    return counts


def held_families() -> list:
    """The gauge for a scrape, from Redis; none when Redis is down or the counts are stale."""
    # NOTE: imported only to scrape, never as a worker imports its tasks (`controlplane.metrics_processes`).
    from prometheus_client.core import GaugeMetricFamily

    try:
        counts = recorded_held_counts()
    except redis.exceptions.RedisError:
        return []
    if not counts:
        return []
    held = GaugeMetricFamily(METRIC_NAME, "Rollups held for an operator (their usage not sent to Stripe until staff "
                             "decide in the admin), by reason, as the push task last counted them.", labels=["reason"])
    for reason in REASONS:
        held.add_metric([reason], counts.get(reason, 0))
    return [held]
