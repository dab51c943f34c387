"""An endpoint's numbers for its owners: cost truth per day and its recent cold starts, by phase.

Shared by the API (`/api/v1/endpoints/{id}/stats/`, `/api/v1/endpoints/{id}/cold-starts/`) and the
endpoint page's panels (`templates/endpoints/_cost_truth.html`, `_cold_starts.html`). The daily
figures come from `billing.cost_truth`; the margin (GPU-seconds used against billed) only ever
reaches staff.
"""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone
from rest_framework import serializers

from billing import cost_truth
from billing.models import UsageRecord
from billing.serializers import ReportDateField
from endpoints.gateway.anatomy import PHASES

DEFAULT_DAYS = 14
NUM_RECENT_COLD_STARTS = 10


class StatsQuerySerializer(serializers.Serializer):
    """`?start=YYYY-MM-DD&end=YYYY-MM-DD` (inclusive, UTC; default: the last 14 days)."""

    start = ReportDateField(required=False)
    end = ReportDateField(required=False)

    def validate(self, data):
        data.setdefault("end", timezone.now().date())
        data.setdefault("start", data["end"] - timedelta(days=DEFAULT_DAYS - 1))
        if data["start"] > data["end"]:
            raise serializers.ValidationError({"start": ["Must be on or before end."]})
        if (data["end"] - data["start"]).days >= cost_truth.MAX_DAYS:
            raise serializers.ValidationError({"start": [f"The range may span at most {cost_truth.MAX_DAYS} days."]})
        return data


class DayStatsSerializer(serializers.Serializer):
    day = serializers.DateField()
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    cost = serializers.DecimalField(max_digits=20, decimal_places=9, coerce_to_string=True)
    ttft_p50_ms = serializers.IntegerField(allow_null=True, help_text="Time to first token, median (ms).")
    ttft_p95_ms = serializers.IntegerField(allow_null=True, help_text="Time to first token, 95th percentile (ms).")
    output_tokens_per_s = serializers.FloatField(allow_null=True)
    prefix_cache_hit_rate = serializers.FloatField(allow_null=True, help_text="Cached prompt tokens / prompt tokens.")
    cost_per_million_tokens = serializers.DecimalField(max_digits=20, decimal_places=6, allow_null=True,
                                                       help_text="Billed cost / (prompt + completion tokens) × 10⁶.")
    gpu_seconds_used = serializers.FloatField(required=False, help_text="Staff only: GPU-seconds its replicas held.")
    gpu_seconds_billed = serializers.FloatField(required=False, help_text="Staff only: request-seconds billed.")


class ColdStartSerializer(serializers.Serializer):
    request_id = serializers.CharField()
    started_at = serializers.DateTimeField()
    cold_start_ms = serializers.IntegerField()
    phases = serializers.DictField(child=serializers.IntegerField(), help_text=f"Milliseconds per phase: {', '.join(PHASES)}.")


def daily(endpoint, *, start, end, staff: bool) -> list[dict]:
    return cost_truth.daily(endpoint, start=start, end=end, margin=staff)


def recent_cold_starts(endpoint, limit: int = NUM_RECENT_COLD_STARTS) -> list[dict]:
    """The latest requests of `endpoint` that waited for a cold start, newest first, with their phases."""
    rows = (UsageRecord.objects.filter(organization=endpoint.organization_id, endpoint=endpoint, cold_start_ms__isnull=False)
            .order_by("-started_at").values("request_id", "started_at", "cold_start_ms", "cold_start_phases")[:limit])
    return [{"request_id": r["request_id"], "started_at": r["started_at"], "cold_start_ms": r["cold_start_ms"],
             "phases": {phase: int((r["cold_start_phases"] or {}).get(phase, 0)) for phase in PHASES}} for r in rows]


def chart(cold_starts: list[dict]) -> list[dict]:
    """The panel's bars: each cold start's phases as percentages of the longest one's total, each segment starting
    (`start_percent`) where the one before it ended."""
    longest = max((c["cold_start_ms"] for c in cold_starts), default=0) or 1
    return [c | {"segments": _segments(c["phases"], longest)} for c in cold_starts]


def _segments(phases: dict[str, int], longest: int) -> list[dict]:
    segments, start_ms = [], 0
    for phase in PHASES:
        if phases[phase]:
            segments.append({"phase": phase, "ms": phases[phase], "start_percent": round(100 * start_ms / longest, 2),
                             "percent": round(100 * phases[phase] / longest, 2)})
            start_ms += phases[phase]
    return segments
