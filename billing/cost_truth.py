"""Cost truth per endpoint: what a day of an endpoint's traffic was like, and what it cost, per UTC day.

From its usage rows (SQL aggregates, percentiles in PostgreSQL): requests, time to first token
p50/p95 (`first_token_at - started_at`), output tokens per second (completion tokens over the
seconds spent generating them, first token to last), prefix-cache hit rate (cached prompt tokens
over prompt tokens) and effective cost per million tokens (billed cost over prompt + completion
tokens). For staff only (`margin=True`), the platform's margin: GPU-seconds its replicas held
(placement to stop, less any time asleep in vLLM sleep mode, times the GPUs or GPU fraction each held)
against the request-seconds billed.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

from django.db import connection
from django.db.models import Count, DurationField, ExpressionWrapper, F, FloatField, Q, Sum
from django.db.models.functions import Cast, Coalesce, Extract, TruncDate

from billing.ledger import _Percentile
from billing.models import UsageRecord

MAX_DAYS = 92

# NOTE: a replica's time asleep (`ReplicaSleep`, vLLM sleep mode: no GPU memory held) is not GPU time.
_GPU_SECONDS_SQL = """
WITH held AS (
  SELECT d::date AS day,
         sum(extract(epoch FROM least(coalesce(r.stopped_at, now()), d + interval '1 day') - greatest(r.created_at, d))
             * coalesce(r.gpu_memory_fraction, greatest(cardinality(r.gpu_indices), 1))) AS seconds
  FROM generate_series(%(since)s::timestamptz, %(last)s::timestamptz, interval '1 day') AS d
  JOIN endpoints_replica r ON r.endpoint_id = %(endpoint)s AND r.created_at < d + interval '1 day'
       AND coalesce(r.stopped_at, now()) > d
  GROUP BY 1
), slept AS (
  SELECT d::date AS day,
         sum(extract(epoch FROM least(coalesce(z.ended_at, r.stopped_at, now()), d + interval '1 day') - greatest(z.started_at, d))
             * coalesce(r.gpu_memory_fraction, greatest(cardinality(r.gpu_indices), 1))) AS seconds
  FROM generate_series(%(since)s::timestamptz, %(last)s::timestamptz, interval '1 day') AS d
  JOIN endpoints_replicasleep z ON z.started_at < d + interval '1 day'
  JOIN endpoints_replica r ON r.id = z.replica_id AND r.endpoint_id = %(endpoint)s
  WHERE coalesce(z.ended_at, r.stopped_at, now()) > d
  GROUP BY 1
)
SELECT held.day, held.seconds - coalesce(slept.seconds, 0) FROM held LEFT JOIN slept USING (day)
"""


def _seconds(later: str, earlier: str):
    return Extract(ExpressionWrapper(F(later) - F(earlier), output_field=DurationField()), "epoch")


def daily(endpoint, *, start: date, end: date, margin: bool = False) -> list[dict]:
    """One row per UTC day from `start` to `end` (inclusive) that had traffic, oldest first."""
    since = datetime.combine(start, time.min, tzinfo=UTC)
    until = datetime.combine(end + timedelta(days=1), time.min, tzinfo=UTC)
    rows = (
        UsageRecord.objects.filter(organization=endpoint.organization_id, endpoint=endpoint,
                                   finished_at__gte=since, finished_at__lt=until)
        .annotate(day=TruncDate("finished_at", tzinfo=UTC)).values("day").order_by("day")
        .annotate(
            requests=Count("pk"),
            prompt=Coalesce(Sum("prompt_tokens"), 0),
            cached=Coalesce(Sum("cached_tokens"), 0),
            completion=Coalesce(Sum("completion_tokens"), 0),
            cost=Coalesce(Sum("cost"), Decimal(0)),
            ttft_p50=_Percentile(_seconds("first_token_at", "started_at"), fraction=0.5),
            ttft_p95=_Percentile(_seconds("first_token_at", "started_at"), fraction=0.95),
            generating_s=Sum(_seconds("finished_at", "first_token_at"), filter=Q(first_token_at__isnull=False),
                             output_field=FloatField()),
            generated=Coalesce(Sum("completion_tokens", filter=Q(first_token_at__isnull=False)), 0),
            billed_s=Sum(Cast(_seconds("finished_at", "started_at"), FloatField())),
        )
    )
    used = _gpu_seconds_by_day(endpoint, since, until) if margin else {}
    results = []
    for row in rows:
        tokens = row["prompt"] + row["completion"]
        item = {
            "day": row["day"].isoformat(),
            "requests": row["requests"],
            "prompt_tokens": row["prompt"],
            "cached_tokens": row["cached"],
            "completion_tokens": row["completion"],
            "cost": row["cost"],
            "ttft_p50_ms": _ms(row["ttft_p50"]),
            "ttft_p95_ms": _ms(row["ttft_p95"]),
            "output_tokens_per_s": round(row["generated"] / row["generating_s"], 2) if row["generating_s"] else None,
            "prefix_cache_hit_rate": round(row["cached"] / row["prompt"], 4) if row["prompt"] else None,
            "cost_per_million_tokens": (row["cost"] * 1_000_000 / tokens).quantize(Decimal("0.000001")) if tokens else None,
        }
        if margin:
            item["gpu_seconds_used"] = round(used.get(row["day"], 0.0), 1)
            item["gpu_seconds_billed"] = round(row["billed_s"] or 0.0, 1)
        results.append(item)
    return results


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


def _gpu_seconds_by_day(endpoint, since: datetime, until: datetime) -> dict[date, float]:
    with connection.cursor() as cursor:
        cursor.execute(_GPU_SECONDS_SQL, {"since": since, "last": until - timedelta(days=1), "endpoint": endpoint.pk})
        return {day: float(seconds or 0.0) for day, seconds in cursor.fetchall()}
