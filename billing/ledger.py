"""The usage ledger: one row per inference request, written exactly once, priced at write time.

The gateway records each request once (`billing.usage_writer.arecord_usage`, which writes through
`record_usage_batch_on`), also for aborted streams; synchronous callers use `record_usage`. A retry
with the same request id writes nothing: the unique constraint on `request_id` and
`INSERT … ON CONFLICT DO NOTHING` make the write exactly-once, whoever calls. A caller that holds
many reports may hand them to `record_usage_batch` directly. One exception: a call's own row (written by its gateway
late, or replayed from its journal) supersedes the sweeper's `gateway_lost` row of the same call (`supersede_lost_rows`).

Every query that reads the ledger lives here too: the usage API and its CSV (`summarize_usage`), the
console's charts and metrics, period spend (what the spend caps are rebuilt from), prepaid spend not yet
drawn from credit, and the hourly totals the rollups are made of.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, date, datetime, time, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import NamedTuple

import msgspec
from django.db import connection
from django.db.models import (
    Count,
    DateTimeField,
    DurationField,
    ExpressionWrapper,
    F,
    FloatField,
    Func,
    Q,
    Sum,
    Value,
)
from django.db.models.aggregates import Aggregate
from django.db.models.functions import Cast, Coalesce, Extract, TruncDate
from django.utils import timezone

from billing.models import (
    MONEY_PLACES,
    MONEY_QUANTUM,
    SET_MODE_AUDIT_ACTION,
    BillingAccount,
    BillingMode,
    UsageRecord,
    UsageStatus,
)
from billing.periods import Period
from controlplane.accounts.models import AuditEvent
from controlplane.text import shown_name

PER_MILLION = Decimal("0.000001")
# NOTE: read once: Django computes `Choices.values` anew on every access, and the gateway checks
# every request's report.
_USAGE_STATUSES = frozenset(UsageStatus.values)
_BILLING_MODES = frozenset(BillingMode.values)
# A report's fields that JSON carries as text (`UsageReport.as_json_row`): times, and money (exact).
REPORT_TIMES = ("started_at", "first_token_at", "finished_at")
REPORT_MONEY = ("max_cost", "price_input_per_million", "price_cached_input_per_million", "price_output_per_million",
                "price_fraction")
_MINUTE = timedelta(minutes=1)
# Readers that find rows by `recorded_at` (the rollups, the credit draw) read this far back before their previous run's
# start (the database's clock), so a row whose transaction committed after that run had started is never missed
# (single-statement inserts take milliseconds).
RECORDED_AT_MARGIN = timedelta(minutes=5)


@dataclass(slots=True)
class UsageReport:
    request_id: str  # unique; the gateway's request id
    organization_id: int
    api_key_id: int | None
    endpoint_id: str  # UUID string
    replica_id: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    started_at: datetime
    first_token_at: datetime | None
    finished_at: datetime
    status: str  # "ok" | "client_aborted" | "upstream_error"
    cold_start_s: float = 0.0  # never billed
    max_cost: Decimal | None = None  # what the gateway reserved: the row never costs more
    batch_id: str = ""  # a batch line's batch: priced at the endpoint's batch price
    # The cold start it waited for (`endpoints.gateway.anatomy`): total and phase → ms; None if none.
    cold_start_ms: int | None = None
    cold_start_phases: dict[str, int] | None = None
    adapter: str = ""  # the LoRA adapter the call named: priced at its own prices where it has them
    # The prices per million tokens the call was admitted at (its reservation's, the adapter's where it has its own):
    # the row is priced by them, not by the endpoint's prices when the row is written, which a tenant may have
    # changed meanwhile (another GPU type). None: the endpoint's (and adapter's) prices now (older journals).
    price_input_per_million: Decimal | None = None
    price_cached_input_per_million: Decimal | None = None
    price_output_per_million: Decimal | None = None
    # The fraction of those prices it pays (a batch line's, as its run read it); None: the endpoint's batch fraction now
    # for a batch line, 1 otherwise.
    price_fraction: Decimal | None = None
    # The billing mode the call was admitted under (`BillingMode`'s value, `billing.quota.counters.RESERVE_LUA`): the
    # row is billed in it, not in the organisation's mode when the row is written (a call admitted postpaid and ended
    # after a switch to prepaid was metered to no invoice and paid by no credit). None: the mode now, or with
    # `mode_when_started`, the mode in effect when the call started (`_INSERT_SQL`).
    billing_mode: str | None = None
    # A report of a journal written before reports carried `billing_mode` (`billing.usage_journal.decode`): replayed
    # after a switch of mode, it took the mode of the replay, not the one its call was admitted under.
    mode_when_started: bool = False

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > 128:
            raise ValueError("request_id must be 1 to 128 characters")
        if min(self.prompt_tokens, self.cached_tokens, self.completion_tokens) < 0:
            raise ValueError("token counts cannot be negative")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("cached_tokens cannot exceed prompt_tokens")
        if self.status not in _USAGE_STATUSES:
            raise ValueError(f"status must be one of {UsageStatus.values}, not {self.status!r}")
        if self.billing_mode is not None and self.billing_mode not in _BILLING_MODES:
            raise ValueError(f"billing_mode must be one of {BillingMode.values}, not {self.billing_mode!r}")
        if self.mode_when_started and self.billing_mode is not None:
            raise ValueError("a report with its billing_mode is billed in it, not in the mode when it started")
        # NOTE: naive times first: a naive time and an aware one cannot be compared (a TypeError, not this ValueError).
        for name in REPORT_TIMES:
            moment = getattr(self, name)
            if moment is None or moment.tzinfo is UTC:  # NOTE: the gateway's own times (`clock.redis_datetime`): fine
                continue
            if timezone.is_naive(moment):
                raise ValueError(f"{name} must be timezone-aware")
            # NOTE: msgspec writes an offset to the minute (`_rows`): one with seconds (a zone's local mean time, as
            # Amsterdam's before 1937) moved the row's times by them (28 s for +00:19:32). The same moment in UTC.
            if moment.tzinfo is not UTC and moment.utcoffset() % _MINUTE:
                setattr(self, name, moment.astimezone(UTC))
        if self.finished_at < self.started_at:
            raise ValueError("finished_at is before started_at")

    def as_json_row(self) -> dict:
        """The report as a dict of JSON's types, a key per field: times in ISO 8601 with their offset, money and the
        endpoint id as text (exact). A journal's line, a progress and the ledger's rows when msgspec cannot encode
        them (`reports_json`)."""
        # NOTE: a shallow dict, not `dataclasses.asdict`: its deep copy of every value (each Decimal, each datetime) made
        # a row ~86 µs, and a gateway's beat encodes one for every call whose progress changed since the last
        # (`billing.quota.counters.record_progress`); ~16 µs so. Nothing of the report is changed in place.
        row = {name: getattr(self, name) for name in REPORT_FIELDS}
        for name in REPORT_TIMES:
            row[name] = row[name].isoformat() if row[name] is not None else None
        row["endpoint_id"] = str(row["endpoint_id"])
        for name in REPORT_MONEY:
            row[name] = str(row[name]) if row[name] is not None else None
        return row


REPORT_FIELDS = tuple(field.name for field in fields(UsageReport))


class UnknownEndpointError(LookupError):
    """A report names an endpoint that does not exist in its organisation (its usage is refused;
    the other reports of the same batch are written all the same)."""

    def __init__(self, refused_ids: list[str], written_ids: set[str]):
        self.refused_ids = refused_ids
        self.written_ids = written_ids
        super().__init__(f"endpoint not found in the organisation for request(s) {refused_ids[:5]}")


def cost_of(endpoint, prompt_tokens: int, cached_tokens: int, completion_tokens: int, *,
            fraction: Decimal = Decimal(1)) -> Decimal:
    """What a request costs: cached prompt tokens at the cached rate, the rest of the prompt at the
    input rate, completion tokens at the output rate, times `fraction` (a batch line's: the
    endpoint's `batch_price_fraction`); rounded half-up to the nano-dollar.

    NOTE: `_INSERT_SQL` computes the same figure in PostgreSQL; a test holds them equal.
    """
    uncached = prompt_tokens - cached_tokens
    raw = (
        uncached * endpoint.price_input_per_million
        + cached_tokens * endpoint.price_cached_input_per_million
        + completion_tokens * endpoint.price_output_per_million
    ) * fraction * PER_MILLION
    return raw.quantize(MONEY_QUANTUM, rounding=ROUND_HALF_UP)


@dataclass(slots=True, frozen=True)
class CostCeiling:
    """Whether tokens cost more than a ceiling: exactly `cost_of(endpoint, …, fraction=…) > ceiling`, in
    integer arithmetic.

    NOTE: a stream checks its reservation on every chunk (`endpoints.gateway.call`); there, Decimal
    arithmetic and rounding cost more than the rest of the chunk's own work. Here the prices are
    exact integer ratios over one denominator, and the rounding (half-up to the nano-dollar) is folded
    into the threshold: a cost rounds above the ceiling iff its raw value reaches the next
    nano-dollar less half a nano-dollar.
    """

    per_uncached: int
    per_cached: int
    per_completion: int
    threshold: int  # exceeded iff uncached·per_uncached + cached·per_cached + completion·per_completion ≥ threshold

    @classmethod
    def of(cls, endpoint, ceiling: Decimal, *, fraction: Decimal = Decimal(1)) -> CostCeiling:
        numerators, denominator = _price_ratios(endpoint.price_input_per_million,
                                                endpoint.price_cached_input_per_million,
                                                endpoint.price_output_per_million)
        fraction_num, fraction_den = Decimal(fraction).as_integer_ratio()
        # the smallest multiple of a nano-dollar above the ceiling, less half a nano-dollar, as a ratio
        next_units = math.floor(Decimal(ceiling) * 10**MONEY_PLACES) + 1
        limit_num, limit_den = 2 * next_units - 1, 2 * 10**MONEY_PLACES
        if fraction_num <= 0:  # free: never above a ceiling of zero or more
            return cls(0, 0, 0, 1 if limit_num > 0 else 0)
        # raw = Σ·fraction / (denominator · 10⁶) ≥ limit  ⟺  Σ ≥ limit · denominator · 10⁶ / fraction
        needed_num, needed_den = limit_num * denominator * 10**6 * fraction_den, limit_den * fraction_num
        return cls(*numerators, threshold=-(-needed_num // needed_den))

    def exceeded(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> bool:
        return ((prompt_tokens - cached_tokens) * self.per_uncached + cached_tokens * self.per_cached
                + completion_tokens * self.per_completion) >= self.threshold


@functools.lru_cache(maxsize=1024)
def _price_ratios(*prices) -> tuple[tuple[int, ...], int]:
    """Prices as integer numerators over one denominator (`CostCeiling`): the same for every stream of an endpoint at
    its prices, so worked out once, not at each stream's start (~3 µs of its ~6)."""
    ratios = [Decimal(price).as_integer_ratio() for price in prices]
    denominator = math.lcm(*(den for _, den in ratios))
    return tuple(num * (denominator // den) for num, den in ratios), denominator


_TABLE = UsageRecord._meta.db_table

# The rows' columns as `json_to_recordset` reads them, each by its name from a row's key: a report's field.
_RECORDSET_COLUMNS = {
    "request_id": "text", "organization_id": "bigint", "api_key_id": "bigint", "endpoint_id": "uuid",
    "replica_id": "text", "prompt_tokens": "integer", "cached_tokens": "integer", "completion_tokens": "integer",
    "started_at": "timestamptz", "first_token_at": "timestamptz", "finished_at": "timestamptz", "status": "text",
    "cold_start_s": "float8", "max_cost": "numeric", "batch_id": "text", "cold_start_ms": "integer",
    "cold_start_phases": "json", "adapter": "text", "price_input_per_million": "numeric",
    "price_cached_input_per_million": "numeric", "price_output_per_million": "numeric", "price_fraction": "numeric",
    "billing_mode": "text", "mode_when_started": "boolean",
}


def check_recordset_columns(columns: Collection[str]) -> None:
    """Raise unless every column is a field of `UsageReport`.

    NOTE: `json_to_recordset` makes a column no row has a key for NULL, without a word: one renamed on either side would
    be NULL in every row, and a NULL price is the endpoint's price now (`coalesce`), not the call's. Checked once, when
    this module is imported."""
    if unknown := sorted(set(columns) - set(REPORT_FIELDS)):
        raise TypeError(f"the ledger's recordset columns {unknown} are not fields of UsageReport")


check_recordset_columns(_RECORDSET_COLUMNS)
_RECORDSET = ", ".join(f"{name} {kind}" for name, kind in _RECORDSET_COLUMNS.items())


# NOTE: a row is billed in the mode its call was admitted under (the report's), so each call is in one billing path,
# never both and never neither. A journal's report without one (`mode_when_started`, written before reports carried
# it) takes the mode in effect when its call started: the `previous` mode of the organisation's first switch after that
# (`SET_MODE_AUDIT_ACTION`, audited in the switch's transaction), or the mode now if none came after. Any other report
# without one takes the mode read in the same statement that writes the row (`set_billing_mode` locks the account
# row). `least` ignores a NULL max_cost.
_PRICED_SQL = f"""
SELECT r.request_id, r.organization_id, r.api_key_id, e.id AS endpoint_id, coalesce(r.replica_id, '') AS replica_id,
       r.prompt_tokens, r.cached_tokens, r.completion_tokens,
       least(round(((r.prompt_tokens - r.cached_tokens)
                    * coalesce(r.price_input_per_million, ad.price_input_per_million, e.price_input_per_million)
                    + r.cached_tokens * coalesce(r.price_cached_input_per_million,
                                                 least(ad.price_input_per_million, e.price_cached_input_per_million))
                    + r.completion_tokens
                    * coalesce(r.price_output_per_million, ad.price_output_per_million, e.price_output_per_million))
                   * coalesce(r.price_fraction, CASE WHEN r.batch_id <> '' THEN e.batch_price_fraction ELSE 1 END)
                   * 0.000001, 9), r.max_cost) AS cost,
       coalesce(r.billing_mode,
                CASE WHEN r.mode_when_started THEN (
                    SELECT switch.details ->> 'previous' FROM {AuditEvent._meta.db_table} switch
                    WHERE switch.organization_id = r.organization_id AND switch.action = '{SET_MODE_AUDIT_ACTION}'
                      AND switch.created_at > r.started_at
                    ORDER BY switch.created_at LIMIT 1) END,
                a.mode, '{BillingMode.POSTPAID}') AS billing_mode,
       r.started_at, r.first_token_at, r.finished_at, r.status, r.cold_start_s, now(), r.batch_id,
       r.cold_start_ms, r.cold_start_phases::jsonb, r.adapter
FROM json_to_recordset(%s::json) AS r({_RECORDSET})
JOIN endpoints_endpoint e ON e.id = r.endpoint_id AND e.organization_id = r.organization_id
LEFT JOIN endpoints_adapter ad ON ad.endpoint_id = e.id AND ad.name = r.adapter AND r.adapter <> ''
LEFT JOIN {BillingAccount._meta.db_table} a ON a.organization_id = r.organization_id
"""
_INSERT_SQL = f"""
INSERT INTO {_TABLE} (
    request_id, organization_id, api_key_id, endpoint_id, replica_id, prompt_tokens, cached_tokens,
    completion_tokens, cost, billing_mode, started_at, first_token_at, finished_at, status, cold_start_s, recorded_at,
    batch_id, cold_start_ms, cold_start_phases, adapter
)
{_PRICED_SQL}
ON CONFLICT (request_id) DO NOTHING
RETURNING request_id
"""

# NOTE: a row the sweeper wrote for a call cut by a lost gateway (`gateway_lost`, from its last progress) is superseded
# by the call's own row, replayed from its gateway's journal or written by a gateway that froze past its call's hold and
# woke (`supersede_lost_rows`): its tokens, cost and status become the call's, priced as the insert prices them. It keeps
# its `finished_at` (its last progress's, before the call's end) and its billing mode (the call's admission's, as the
# call's row has it): it stays in the hour and the month it was billed in, so what counted it counts the difference
# (`billing.quota.replayed.count_superseded`, the rollups: `recorded_at` is now). Only a `gateway_lost` row, only by a
# row that is not one, and only once: the row is no longer `gateway_lost` after it (concurrent writes: PostgreSQL
# rechecks the condition on the row it locked).
# `lost` is the row as the statement found it: its cost, already counted, kept as `lost_cost` (a replay finishes the
# count of a supersede killed before it: `billing.quota.replayed.count_replayed`), and when it reached the ledger,
# `lost_recorded_at` (the credit draw dates `lost_cost` then, the difference now: `undrawn_prepaid_usage`).
_SUPERSEDE_SQL = f"""
UPDATE {_TABLE} u
SET prompt_tokens = p.prompt_tokens, cached_tokens = p.cached_tokens, completion_tokens = p.completion_tokens,
    cost = p.cost, status = p.status, recorded_at = now(), lost_cost = lost.cost, lost_recorded_at = lost.recorded_at
FROM ({_PRICED_SQL}) p, {_TABLE} lost
WHERE u.request_id = p.request_id AND u.organization_id = p.organization_id AND u.endpoint_id = p.endpoint_id
  AND lost.id = u.id AND u.status = '{UsageStatus.GATEWAY_LOST}' AND p.status <> '{UsageStatus.GATEWAY_LOST}'
RETURNING u.request_id, lost.cost
"""


# NOTE: the reports themselves, encoded by msgspec's C encoder straight from their slots: no dict per row, no
# `isoformat` or `str` per value in Python (a row ~1 µs, against ~8 µs for the dicts through the json module:
# bench/results/gateway_profile.md, round 24). Money goes as text (exact), times as RFC 3339 with their offset ("Z" for
# UTC; to the minute: `UsageReport` keeps no other), a UUID as its canonical text; `json_to_recordset` takes each field
# by its name and ignores any it does not list.
_ENCODER = msgspec.json.Encoder()


def reports_json(reports: UsageReport | Sequence[UsageReport]) -> bytes:
    """A report, or a list of them, as JSON: a usage journal's line (`billing.usage_journal.encode`), a call's progress
    in Redis (`billing.quota.counters.record_progress`), the ledger statement's parameter (`_rows`).

    NOTE: a value msgspec cannot encode (a lone surrogate: UnicodeEncodeError; a subclass of str, int, Decimal or
    datetime: TypeError) raised, before PostgreSQL saw the batch; the journal's replays and the sweeper set aside only
    a batch PostgreSQL refuses for what its rows hold (SQLSTATE 22, 23), so the replay failed on every try until the
    journal was full. Such a report goes through the json module (`as_json_row`): PostgreSQL takes a subclass's value
    and refuses a lone surrogate (escaped, `\ud800`) with a `DataError`, which each of them handles.
    """
    try:
        return _ENCODER.encode(reports)
    except (TypeError, ValueError):
        if isinstance(reports, UsageReport):
            return json.dumps(reports.as_json_row(), separators=(",", ":")).encode()
        rows = [report.as_json_row() for report in reports]  # NOTE: any sequence of reports, as `_rows` took
        return json.dumps(rows, separators=(",", ":")).encode()


def _rows(reports: list[UsageReport]) -> list[str]:
    """The reports as the statement's one parameter: a JSON array of rows (`json_to_recordset`).

    NOTE: one string, encoded in C and parsed by PostgreSQL, rather than eighteen arrays bound value by value: binding
    arrays in psycopg is Python code per element, and it was most of the gateway's CPU spent on a usage row.
    """
    return [reports_json(reports).decode()]


def record_usage_batch(reports: list[UsageReport]) -> set[str]:
    """Write many reports in one statement; returns the request ids written now (duplicates are skipped).

    Raises UnknownEndpointError when a report's endpoint is not in its organisation.
    """
    if not reports:
        return set()
    with connection.cursor() as cursor:
        cursor.execute(_INSERT_SQL, _rows(reports))
        written = {row[0] for row in cursor.fetchall()}
    if len(written) < len({r.request_id for r in reports}):
        _check_endpoints(reports, written)
    return written


def _check_endpoints(reports: list[UsageReport], written: set[str]) -> None:
    skipped = [r for r in reports if r.request_id not in written]
    existing = set(UsageRecord.objects.filter(request_id__in=[r.request_id for r in skipped]).values_list("request_id", flat=True))
    _raise_if_lost(skipped, written, existing)


def _raise_if_lost(skipped: list[UsageReport], written: set[str], existing: set[str]) -> None:
    # NOTE: a report skipped because its id exists is fine; one skipped because its endpoint is
    # not in its organisation would be usage lost silently, so it is an error.
    lost = [r.request_id for r in skipped if r.request_id not in existing]
    if lost:
        raise UnknownEndpointError(lost, written)


_EXISTING_SQL = f"SELECT request_id FROM {UsageRecord._meta.db_table} WHERE request_id = ANY(%s::text[])"


async def record_usage_batch_on(connection, reports: list[UsageReport]) -> set[str]:
    """`record_usage_batch` on an async psycopg connection in autocommit (`billing.usage_writer`)."""
    if not reports:
        return set()
    async with connection.cursor() as cursor:
        # NOTE: prepared on a cursor that binds server-side (`billing.usage_writer`); a client-side one ignores it.
        await cursor.execute(_INSERT_SQL, _rows(reports), prepare=True)
        written = {row[0] for row in await cursor.fetchall()}
        if len(written) < len({r.request_id for r in reports}):
            skipped = [r for r in reports if r.request_id not in written]
            await cursor.execute(_EXISTING_SQL, [[r.request_id for r in skipped]])
            _raise_if_lost(skipped, written, {row[0] for row in await cursor.fetchall()})
    return written


def superseding(reports: list[UsageReport], written: Collection[str]) -> list[UsageReport]:
    """The reports of `reports` that may supersede a `gateway_lost` row (`supersede_lost_rows`): those not written now."""
    return [r for r in reports if r.request_id not in written and r.status != UsageStatus.GATEWAY_LOST]


def supersede_lost_rows(reports: list[UsageReport], written: Collection[str] = ()) -> dict[str, Decimal]:
    """Replace the `gateway_lost` rows of `reports`' request ids by the reports (`_SUPERSEDE_SQL`): calls' own rows (a
    journal's, replayed, or a late gateway's) whose insert found the row the sweeper had written for their call
    (`written`: the ids it wrote, which have none). Returns each superseded request id's cost as it was (counted already: `replayed.count_superseded`)."""
    if not (reports := superseding(reports, written)):
        return {}
    with connection.cursor() as cursor:
        cursor.execute(_SUPERSEDE_SQL, _rows(reports))
        return dict(cursor.fetchall())


async def supersede_lost_rows_on(connection, reports: list[UsageReport], written: Collection[str] = ()) -> dict[str, Decimal]:
    """`supersede_lost_rows` on an async psycopg connection in autocommit (`billing.usage_writer`)."""
    if not (reports := superseding(reports, written)):
        return {}
    async with connection.cursor() as cursor:
        await cursor.execute(_SUPERSEDE_SQL, _rows(reports))
        return dict(await cursor.fetchall())


def record_usage(report: UsageReport) -> bool:
    """Write one request's usage, exactly once per request id. True if this call wrote it."""
    return bool(record_usage_batch([report]))


# --- reading the ledger: every usage query of the API, the CSV export, the console and the quota rebuild ---

# "adapter": per endpoint and LoRA adapter, labelled as calls name them ("<endpoint>:<adapter>", the bare
# endpoint name for calls to the base model).
GROUPINGS = ("endpoint", "day", "key", "adapter")


def _day_bounds(start: date, end: date) -> tuple[datetime, datetime]:
    """From the start of `start` to the end of `end`, in UTC (TIME_ZONE is UTC)."""
    return (datetime.combine(start, time.min, tzinfo=UTC), datetime.combine(end + timedelta(days=1), time.min, tzinfo=UTC))


def summarize_usage(organization, *, group_by: str, start: date, end: date) -> list[dict]:
    """Requests, tokens and cost of `organization` between two dates (inclusive, UTC), grouped."""
    if group_by not in GROUPINGS:
        raise ValueError(f"group_by must be one of {GROUPINGS}")
    since, until = _day_bounds(start, end)
    rows = UsageRecord.objects.filter(organization=organization, finished_at__gte=since, finished_at__lt=until)
    if group_by == "endpoint":
        rows = rows.values("endpoint_id", label=F("endpoint__name")).order_by("label", "endpoint_id")
    elif group_by == "day":
        rows = rows.annotate(label=TruncDate("finished_at")).values("label").order_by("label")
    elif group_by == "adapter":
        rows = rows.values("endpoint_id", "adapter", label=F("endpoint__name")).order_by("label", "endpoint_id", "adapter")
    else:
        rows = rows.values("api_key_id", label=F("api_key__lookup"), key_name=F("api_key__name")).order_by("label")
    rows = rows.annotate(
        requests=Count("id"),
        sum_prompt=Coalesce(Sum("prompt_tokens"), 0),
        sum_cached=Coalesce(Sum("cached_tokens"), 0),
        sum_completion=Coalesce(Sum("completion_tokens"), 0),
        sum_cost=Coalesce(Sum("cost"), Decimal(0)),
        cold_starts=Count("id", filter=Q(cold_start_ms__isnull=False)),
        sum_cold_start_ms=Coalesce(Sum("cold_start_ms"), 0),
    )
    results = []
    for row in rows:
        label = row["label"]
        if group_by == "day":
            label = label.isoformat()
        elif group_by == "key" and label is not None:
            label = f"ip_{label}"
        elif group_by == "adapter" and row["adapter"]:
            label = f"{label}:{row['adapter']}"
        item = {group_by: label}
        if group_by == "key":
            # NOTE: as the keys page shows it (`text.shown_name`): a name from before the name rule listed here raw kept
            # its direction override, another key's name on the usage page, its chart, the API and the CSV
            item["key_name"] = shown_name(row["key_name"]) if row["key_name"] is not None else None
        item |= {
            "requests": row["requests"],
            "prompt_tokens": row["sum_prompt"],
            "cached_tokens": row["sum_cached"],
            "completion_tokens": row["sum_completion"],
            "cost": row["sum_cost"],
            # requests that waited for a cold start, and how long they waited in all (ms, held to first token)
            "cold_starts": row["cold_starts"],
            "cold_start_ms": row["sum_cold_start_ms"],
        }
        results.append(item)
    return results


def tokens_by_day(organization, *, by: str, start: date, end: date) -> list[dict]:
    """Prompt plus completion tokens per UTC day and per endpoint or key name (`by`: "endpoint" or
    "key"), between two dates inclusive: rows of {"day", "group", "tokens"} (the console's chart)."""
    group = {"endpoint": F("endpoint__name"), "key": F("api_key__name")}[by]
    since, until = _day_bounds(start, end)
    rows = list(
        UsageRecord.objects.filter(organization=organization, finished_at__gte=since, finished_at__lt=until)
        .annotate(day=TruncDate("finished_at", tzinfo=UTC), group=group)
        .values("day", "group")
        .annotate(tokens=Sum(F("prompt_tokens") + F("completion_tokens")))
    )
    if by == "key":  # NOTE: the chart's legend names keys as the keys page does (`text.shown_name`)
        for row in rows:
            row["group"] = shown_name(row["group"]) if row["group"] is not None else None
    return rows


class _Percentile(Aggregate):
    function = "percentile_cont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()


class _DateBin(Func):
    """PostgreSQL's date_bin: the start of the fixed-width bucket a timestamp falls in."""

    function = "date_bin"
    output_field = DateTimeField()


BUCKET_ORIGIN = datetime(2000, 1, 1, tzinfo=UTC)  # buckets of `usage_by_bucket` start from here


def usage_by_bucket(endpoint, *, since: datetime, bucket_s: int) -> dict[datetime, dict]:
    """Per bucket of `bucket_s` seconds (from BUCKET_ORIGIN) of requests started since `since` at
    `endpoint`: requests, completion tokens and latency percentiles p50/p95 (seconds)."""
    latency_s = Extract(ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField()), "epoch")
    rows = (
        UsageRecord.objects.filter(organization=endpoint.organization_id, endpoint=endpoint, started_at__gte=since)
        .annotate(bucket=_DateBin(Cast(Value(f"{bucket_s} seconds"), DurationField()), F("started_at"), Value(BUCKET_ORIGIN)))
        .values("bucket")
        .annotate(
            requests=Count("pk"),
            completion_tokens=Coalesce(Sum("completion_tokens"), 0),
            p50=_Percentile(latency_s, fraction=0.5),
            p95=_Percentile(latency_s, fraction=0.95),
        )
    )
    return {row["bucket"]: row for row in rows}


HOURLY_TOTAL_FIELDS = ("num_requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost")

_HOURLY_ALL = f"""
SELECT organization_id, endpoint_id, date_trunc('hour', finished_at, 'UTC') AS hour_start, billing_mode,
       count(*), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens), sum(cost)
FROM {_TABLE}
GROUP BY 1, 2, 3, 4
"""
_HOURLY_TOUCHED_SINCE = f"""
WITH dirty AS (
    SELECT DISTINCT organization_id, endpoint_id, date_trunc('hour', finished_at, 'UTC') AS hour_start, billing_mode
    FROM {_TABLE} WHERE recorded_at >= %s
)
SELECT d.organization_id, d.endpoint_id, d.hour_start, d.billing_mode,
       count(*), sum(u.prompt_tokens), sum(u.cached_tokens), sum(u.completion_tokens), sum(u.cost)
FROM dirty d
JOIN {_TABLE} u ON u.organization_id = d.organization_id AND u.endpoint_id = d.endpoint_id
     AND u.billing_mode = d.billing_mode
     AND u.finished_at >= d.hour_start AND u.finished_at < d.hour_start + interval '1 hour'
GROUP BY 1, 2, 3, 4
"""


def hourly_totals(*, recorded_since: datetime | None) -> dict[tuple, dict]:
    """The ledger's totals (HOURLY_TOTAL_FIELDS) per (organisation, endpoint, UTC hour, billing mode)
    of every hour, or only of the hours that received a row recorded since `recorded_since`, each
    such hour whole (`billing.rollups`)."""
    with connection.cursor() as cursor:
        if recorded_since is None:
            cursor.execute(_HOURLY_ALL)
        else:
            cursor.execute(_HOURLY_TOUCHED_SINCE, [recorded_since])
        return {
            (org, endpoint, hour, mode): dict(zip(HOURLY_TOTAL_FIELDS, values, strict=True))
            for org, endpoint, hour, mode, *values in cursor.fetchall()
        }


def period_spend(organization_id: int, period: Period, *, api_key_id: int | None = None) -> Decimal:
    """The ledger's spend in a billing period: the truth the Redis counters are rebuilt from."""
    return _period_rows(organization_id, period, api_key_id).aggregate(total=Coalesce(Sum("cost"), Decimal(0)))["total"]


def organizations_period_spends(organization_ids: Collection[int], period: Period) -> dict[int, Decimal]:
    """`period_spend` of each of several organisations (a card's: `billing.standing.card_spend`), in one grouped read
    (the `usage_org_finished` index); one with no usage is not in it."""
    if not organization_ids:
        return {}
    rows = UsageRecord.objects.filter(organization_id__in=organization_ids, finished_at__gte=period.start,
                                      finished_at__lt=period.end).order_by()
    return dict(rows.values("organization_id").annotate(total=Sum("cost")).values_list("organization_id", "total"))


def _period_rows(organization_id: int, period: Period, api_key_id: int | None):
    """The rows a period bills: those that finished in it (`finished_at`)."""
    rows = UsageRecord.objects.filter(organization_id=organization_id, finished_at__gte=period.start, finished_at__lt=period.end)
    return rows.filter(api_key_id=api_key_id) if api_key_id is not None else rows


def period_spend_and_pending(organization_id: int, period: Period, request_ids: Collection[str], *,
                             api_key_id: int | None = None) -> tuple[Decimal, dict[str, Decimal]]:
    """`period_spend`, and the cost of each of its rows whose request id is one of `request_ids` (calls still
    reserved, which may settle after a counter is rebuilt: `billing.quota.rebuild`).

    NOTE: the rows of `request_ids` are read apart from the sum of the others, after it: one committed between the
    two statements is in the total and the costs both, or in neither, never in the total alone."""
    return _total_and_pending(_period_rows(organization_id, period, api_key_id), request_ids)


def _total_and_pending(rows, request_ids: Collection[str]) -> tuple[Decimal, dict[str, Decimal]]:
    """The cost of `rows`, and of each of them whose request id is one of `request_ids`, read after the others' sum."""
    others = rows.exclude(request_id__in=request_ids).aggregate(total=Coalesce(Sum("cost"), Decimal(0)))["total"]
    pending = dict(rows.filter(request_id__in=request_ids).values_list("request_id", "cost")) if request_ids else {}
    return others + sum(pending.values(), Decimal(0)), pending


# The prepaid usage not drawn yet (`amount`: the ledger's prepaid cost less the account's `credit_drawn`), and its
# parts, newest recorded first until they make that amount, summed per minute of their start (`undrawn_prepaid_usage`):
# the part of the last of them that the amount takes, and no more. A superseded row (`_SUPERSEDE_SQL`) is two parts of
# one start: its `lost_cost` recorded when the sweeper's row was (`lost_recorded_at`), the difference when the call's
# own row superseded it (`recorded_at`); a part of 0 or less is none. The overcharges (parts below 0: a superseding row
# cheaper than the one it replaced) are read apart, the same way: the ledger's all (`overcharged`, from the partial
# index `usage_org_prepaid_overcharged`) less those given back already (`credit_given_back`) is what is given back
# (`returned`; the amount less than 0 for an account whose draws never kept that figure), newest first until they make
# it; the usage to draw is the amount plus that. One statement, so one snapshot: a row committed while the draw read is
# in the amounts and the parts both, or in neither.
# NOTE: before, a superseded row was one part, its whole cost recorded at the supersede: its `lost_cost`, drawn
# already, pushed out as much of the rows really not drawn yet, and that amount was dated at the superseded call's
# start (expired credit spent, or a late row made under an expired grant paid by the next: paid twice). And the amount
# was read in a statement before the parts': a row committed between them was "newest" and pushed out an older one.
# Rows (`u`) recorded before `recorded_since` have no part recorded since: a superseded row's `recorded_at` is its
# later part's. A row superseded with no `lost_recorded_at` (by code from before billing/0028, in a rolling deploy) is
# one part, its whole cost recorded at the supersede, as before: NOTE: split with a NULL date, its `lost_cost` part was
# dropped as drawn long ago although the sweeper's row may have come after the last draw, and older rows filled its
# place, dated under an expired grant (the review of this split: expired credit paid $4 of usage made after it).
_UNDRAWN_BY_MINUTE = f"""
WITH ledger AS MATERIALIZED (
    SELECT (SELECT coalesce(sum(cost), 0) FROM {_TABLE}
            WHERE organization_id = %(organization_id)s AND billing_mode = '{BillingMode.PREPAID}') - %(drawn)s AS net,
           (SELECT coalesce(sum(lost_cost - cost), 0) FROM {_TABLE}
            WHERE organization_id = %(organization_id)s AND billing_mode = '{BillingMode.PREPAID}'
              AND lost_recorded_at IS NOT NULL AND lost_cost > cost) AS overcharged),
undrawn AS (
    SELECT net, overcharged, greatest(coalesce(overcharged - %(given_back)s::numeric, -net), 0) AS returned FROM ledger),
amounts AS (
    SELECT 1 AS sign, net + returned AS amount FROM undrawn UNION ALL SELECT -1, returned FROM undrawn),
parts AS (
    SELECT u.id, u.started_at, part.recorded_at, part.cost, part.n
    FROM {_TABLE} u CROSS JOIN LATERAL (
        VALUES (u.recorded_at, u.cost - CASE WHEN u.lost_recorded_at IS NULL THEN 0 ELSE u.lost_cost END, 1),
               (u.lost_recorded_at, CASE WHEN u.lost_recorded_at IS NULL THEN 0 ELSE u.lost_cost END, 0)
    ) part (recorded_at, cost, n)
    WHERE u.organization_id = %(organization_id)s AND u.billing_mode = '{BillingMode.PREPAID}'{{row_since}}),
undrawn_parts AS (
    SELECT a.sign, a.amount, started_at, abs(cost) AS cost,
           sum(abs(cost)) OVER (PARTITION BY a.sign ORDER BY recorded_at DESC, id DESC, n DESC) AS running
    FROM parts JOIN amounts a ON a.sign = sign(cost) WHERE cost <> 0{{part_since}})
SELECT 0, NULL::timestamptz, net, returned, overcharged FROM undrawn
UNION ALL
SELECT CASE WHEN sign > 0 THEN 1 ELSE 2 END, min(started_at), sum(least(cost, amount - (running - cost))), NULL, NULL
FROM undrawn_parts
WHERE running - cost < amount
GROUP BY sign, date_trunc('minute', started_at, 'UTC')
ORDER BY 1, 2
"""


class UndrawnUsage(NamedTuple):
    """The prepaid usage not drawn yet (`undrawn_prepaid_usage`)."""

    amount: Decimal  # the ledger's prepaid total less `BillingAccount.credit_drawn`: `returned` less than `drawn`
    drawn: Decimal  # the usage to draw: `usage`'s parts make it
    usage: list[tuple[datetime, Decimal]]
    returned: Decimal  # the overcharges (cheaper supersedes) to give back: `overcharge`'s parts make it or less
    overcharge: list[tuple[datetime, Decimal]]
    overcharged: Decimal  # every overcharge in the ledger: `BillingAccount.credit_given_back` once this is drawn


def undrawn_prepaid_usage(account: BillingAccount) -> UndrawnUsage:
    """The prepaid usage not drawn yet (`undrawn_prepaid_spend`, `amount`) in its two signs: the usage to draw
    (`drawn`) and the overcharges to give back (`returned`: the cheaper supersedes', `lost_cost` less `cost`, made
    since the last draw: those of the ledger less `BillingAccount.credit_given_back`), and each as when its parts began
    and their cost, earliest first: the rows last recorded (`recorded_at`, the database's clock) among those recorded
    since the last draw (`BillingAccount.credit_drawn_at`) less `RECORDED_AT_MARGIN`, newest first until they make the
    amount of their sign, summed per minute of their start (each part dated at its earliest: a grant that expired within
    that minute pays for it, by less than a minute of usage made after; a superseded row is two parts,
    `_UNDRAWN_BY_MINUTE`). What the usage's parts do not make (a row committed later than the margin after it was
    stamped) is dated at that draw; what the overcharge's do not make has no date (`billing.models.credit_draw`). All
    read in one statement (one snapshot). `credit_given_back` not kept yet (an account drawn by code from before it):
    only what the ledger holds less than was drawn is given back, as that code did.

    NOTE: the two signs apart: before, the draw had their sum alone. A new call and a cheaper supersede in one draw
    window (an active prepaid customer's normal case) netted: the new call was drawn short from its grants and the
    overcharge stayed with the grant that paid it (a promo expiring unused paid less, a grant expired since made bought
    credit). NOTE: by when rows reached the ledger, not when they finished: a row recorded after a draw but finished
    before it (a journal replayed after an outage, the sweeper's `gateway_lost` row, a superseded row keeping its
    `finished_at`, a row committed a moment after the draw read the ledger) is drawn by the next draw from the grants it
    was made under (`billing.models.credit_shares`). Before, only rows finished since the last draw dated the usage:
    such a row was drawn from a later grant (paid twice) or, with none left, from nothing. The amount stays
    `undrawn_prepaid_spend` (exactly once); the margin's rows drawn already only make the read longer, and a row
    among them that committed after the last draw read the ledger may lend its start to one that did not."""
    recorded_since = account.credit_drawn_at - RECORDED_AT_MARGIN if account.credit_drawn_at is not None else None
    with connection.cursor() as cursor:
        since = "" if recorded_since is None else " AND {}recorded_at >= %(recorded_since)s"
        cursor.execute(_UNDRAWN_BY_MINUTE.format(row_since=since.format("u."), part_since=since.format("")), {
            "drawn": account.credit_drawn, "given_back": account.credit_given_back,
            "organization_id": account.organization_id, "recorded_since": recorded_since})
        rows = cursor.fetchall()
    _, _, amount, returned, overcharged = rows[0]
    drawn = amount + returned
    usage = [(began, cost) for kind, began, cost, *_ in rows[1:] if kind == 1]
    overcharge = [(began, cost) for kind, began, cost, *_ in rows[1:] if kind == 2]
    left = drawn - sum((cost for _, cost in usage), Decimal(0))
    if drawn > 0 and left > 0:
        usage = sorted([*usage, (recorded_since or timezone.now(), left)], key=lambda part: part[0])
    return UndrawnUsage(amount, drawn, usage, returned, overcharge, overcharged)


def undrawn_prepaid_spend(account: BillingAccount) -> Decimal:
    """Prepaid usage in the ledger not yet drawn from credit grants (`billing.credits.draw_credits`
    draws it; until then it counts against the credit left)."""
    return undrawn_prepaid_spend_and_pending(account, ())[0]


def undrawn_prepaid_spend_and_pending(account: BillingAccount,
                                      request_ids: Collection[str]) -> tuple[Decimal, dict[str, Decimal]]:
    """`undrawn_prepaid_spend`, and the cost of each of its rows whose request id is one of `request_ids` (calls
    still reserved, which may settle after the credit figure is rebuilt: `billing.quota.rebuild`).

    NOTE: read as `period_spend_and_pending` reads: a row committed between the two statements is in the total and
    the costs both, or in neither."""
    rows = UsageRecord.objects.filter(organization_id=account.organization_id, billing_mode=BillingMode.PREPAID)
    total, pending = _total_and_pending(rows, request_ids)
    return total - account.credit_drawn, pending
