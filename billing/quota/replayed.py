"""Usage rows replayed from the journal into the ledger, counted in the quota counters that do not count them yet.

A call whose row went to the usage journal (`billing.usage_journal`: the ledger refused it) is settled as any, into
the counters that exist then (`counters.SETTLE`), and marks each one it was added to as counting it (`j:<request id>`
in a period counter, its id in the credit figure's `credit_journaled_key`). A counter Redis lost meanwhile (a flush,
a restart, an expired credit figure) was rebuilt from a ledger without the row: only its replay can teach it. So a
replay (the gateway's writer, the worker's replay of shipped segments) goes in three steps per batch:

1. `register_replaying`: before its rows are written, each one's request id is registered (`replaying_key`, for
   `REGISTRATION_TTL_S`): a rebuild that reads the ledger before the count knows to ask about it;
2. the ledger's INSERT (exactly once: the unique request id);
3. `count_replayed`: each row written now is counted, once:
   - in each of its counters that exists and is not marked for it (a mark: its settlement counted it there, or a
     rebuild that read the row did), the mark dropped;
   - in none that does not exist; a counter being rebuilt then (`rebuilding_key`) is told the cost, and its rebuild
     adds it if the ledger it read lacked the row (`billing.quota.rebuild`);
   - its settled marker is set for a day: a call replayed before its own settlement (the gateway's replay runs
     beside its calls) is then settled as one counted already, its hold released and nothing added;
   and its registration is dropped.

A rebuild, for its part, reads the registrations and what counts told it only after it took its ledger snapshot, asks
that snapshot which of those rows it holds, and writes the counter with each such row marked (its count drops the
mark) and each it lacks whose count already came added: every interleaving of a rebuild with a replay counts the row
once (`tests/billing/test_journaled_spend.py`). A row written again (a second replay, a segment replayed from the
bucket after the pod replayed it) writes nothing, and is not counted again: only the request ids a replay wrote now
are counted.

A `gateway_lost` row superseded by a replayed one (`count_superseded`) goes the same way, for its difference: a
rebuild holds the row only once superseded (`billing.quota.rebuild`).

One script per organisation (one Redis Cluster slot) and batch, each step: a replay of 500 rows was 500 round trips in
asgiref's one thread for sync code, which every other sync call of the gateway process waited behind.

Each INSERT is bounded well inside a registration's life (`REGISTRATION_TTL_S`): the gateway's gives up after
`usage_writer.WRITE_TIMEOUT_S`, the worker's is cancelled by PostgreSQL after `WRITE_TIMEOUT_S` (`bounded_write`), and
so is the worker's supersede of lost rows after it.

A replay killed between its commit and its count (or one whose INSERT, cut short by its timeout, committed after)
leaves its rows' registrations, kept a day past their time (`REGISTRATION_KEPT_S`), and its segment in the journal: the
next replay of it writes nothing, finds those rows registered already (`register_replaying`) and counts each the
ledger has as that replay wrote it, once (`count_replayed`'s `owed`); a rebuild meanwhile marks each held row still
registered, lapsed or not (`billing.quota.rebuild`); the sweeper, settling a call whose registration lapsed, drops it.
Before, its rows were counted in no counter that existed then, until each was next rebuilt. A supersede killed so is
finished the same way: the row keeps the lost row's cost (`lost_cost`), and the next replay counts the difference; a
woken gateway's own write, which leaves no segment, is finished by the sweeper once its registration lapsed
(`count_lapsed_supersedes`).

Two replays of the same rows at once (two workers, a task delivered again while its first run still runs, a segment
both shipped and replayed here) share each row's one registration: whoever drops it counts the row, and a replay drops
uncounted only a registration still its own (`Registration`).
"""

from __future__ import annotations

import logging
import secrets
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal

from django.db import close_old_connections, connection, transaction

from billing.ledger import UnknownEndpointError, UsageReport, record_usage_batch
from billing.models import BillingMode, UsageRecord, UsageStatus
from billing.periods import period_containing
from billing.quota import sweep_index
from billing.quota.counters import MISSED_LUA, SETTLED_MARKER_TTL_S, to_units
from controlplane.redis_client import as_text, get_async_redis, get_redis, redis_time
from controlplane.redis_keys import (
    credit_journaled_key,
    credit_key,
    key_period_key,
    org_period_key,
    rebuilding_key,
    replaying_key,
    reservations_key,
    settled_key,
)
from controlplane.redis_scripts import Script

logger = logging.getLogger("inferplane.billing")

# How long a registration lasts: far longer than a replay's batch takes between it and its count (its INSERT is
# bounded: the gateway's by `usage_writer.WRITE_TIMEOUT_S`, the worker's by `WRITE_TIMEOUT_S`).
REGISTRATION_TTL_S = 300
# The longest each statement of the worker's replay INSERT may run (`record_registered_batch`), PostgreSQL's own bound:
# the batch commits well inside its registration's life, or not at all (the segment waits for the next run).
WRITE_TIMEOUT_S = 30
# How long past that one a replay did not count (killed between its commit and its count) waits for the next replay of
# its rows, which counts it (`owed`): the journal's segment stays until a replay of it is done.
REGISTRATION_KEPT_S = SETTLED_MARKER_TTL_S
MISSED_PREFIX = "m:"  # `rebuilding_key`'s fields of costs counts could not add: m:<counter key>|<request id>
DIFFERENCE_PREFIX = "d:"  # and of superseded rows' differences: d:<counter key>|<request id>
REBUILDING_PREFIX = "c:"  # and of rebuilds under way: c:<counter key> -> until when

# KEYS: the organisation's registrations; ARGV: their ttl (s), how long the hash is kept (s), the replay's token
# (digits), then each request id. Each registration is `<deadline>.<token>` (a number still, for the rebuild and the
# sweeper). Returns the request ids registered already, each followed by the registration it had: a replay's that has
# not counted them (`count_replayed`'s `owed`), or one under way.
_REGISTER = Script("""
local registration = (tonumber(redis.call('TIME')[1]) + tonumber(ARGV[1])) .. '.' .. ARGV[3]
local owed = {}
for i = 4, #ARGV do
  local before = redis.call('HGET', KEYS[1], ARGV[i])
  if before then
    owed[#owed + 1] = ARGV[i]
    owed[#owed + 1] = before
  end
  redis.call('HSET', KEYS[1], ARGV[i], registration)
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return owed
""", once=True)
# How far PostgreSQL's clock (a row's `recorded_at`) may be behind Redis's (a registration's) for `count_replayed` to
# take a row written by the replay that registered it as such.
CLOCKS_APART_S = 1.0

# KEYS: the credit figure, the journaled calls the figure counted, the rebuilds under way, the registrations, then per
# row: its settled marker, its org period counter, its key period counter (the no-key placeholder without a key);
# ARGV: marker ttl, the number of rows, the replay's token (empty: it registered nothing), then per row: request id,
# cost (units), has key (1/0), draws credit (1/0), owed (1/0), then the request ids whose registration is dropped
# uncounted if it is still this replay's (its token). A row is counted only by whoever drops its registration: owed,
# or written now by a replay that registered it. Returns the rows counted.
_COUNT_REPLAYED = Script(MISSED_LUA + """
local function missed(counter, request_id, cost)
  quota_missed(KEYS[3], counter, request_id, cost)
end
local function count(counter, request_id, cost)
  if redis.call('EXISTS', counter) == 0 then return missed(counter, request_id, cost) end
  if redis.call('HDEL', counter, 'j:' .. request_id) == 0 then redis.call('HINCRBY', counter, 'spent', cost) end
end
local num_rows = tonumber(ARGV[2])
local unregistered = ARGV[3] == ''
local num_counted = 0
for n = 0, num_rows - 1 do
  local request_id, cost = ARGV[4 + 5 * n], ARGV[5 + 5 * n]
  if redis.call('HDEL', KEYS[4], request_id) == 1 or (unregistered and ARGV[8 + 5 * n] ~= '1') then
    redis.call('SET', KEYS[5 + 3 * n], '1', 'NX', 'EX', ARGV[1])
    count(KEYS[6 + 3 * n], request_id, cost)
    if ARGV[6 + 5 * n] == '1' then count(KEYS[7 + 3 * n], request_id, cost) end
    if ARGV[7 + 5 * n] == '1' then
      if redis.call('EXISTS', KEYS[1]) == 0 then
        missed(KEYS[1], request_id, cost)
      elseif redis.call('HDEL', KEYS[2], request_id) == 0 then
        redis.call('DECRBY', KEYS[1], cost)
      end
    end
    num_counted = num_counted + 1
  end
end
local own = '.' .. ARGV[3]
for i = 4 + 5 * num_rows, #ARGV do
  local registration = redis.call('HGET', KEYS[4], ARGV[i])
  if not unregistered and registration and string.sub(registration, -#own) == own then
    redis.call('HDEL', KEYS[4], ARGV[i])
  end
end
return num_counted
""", once=True)


@dataclass(slots=True, frozen=True)
class Registration:
    """What `register_replaying` registered: `token`, the part of each registration's value that is this replay's own
    (`_REGISTER`), and `owed`, the request ids registered already then, each with when (Redis's clock, s).

    NOTE: two replays of the same rows at once (two workers, or a task Celery delivered again while its first run still
    ran) share each row's one registration. Before, the one that wrote a row counted it whatever, and the other one
    counted it too if it found it owed and dropped the registration first ($0.60 counted for $0.30), or dropped it
    uncounted first, and a counter rebuilt then read the row without asking about it, which the count added again.
    Now whoever drops a registration counts its row, and a replay drops uncounted only a registration still its own."""

    token: str
    owed: dict[str, float]

    def __post_init__(self) -> None:
        if not self.token.isdigit():
            raise ValueError("a registration's token is digits: its value stays a number")


def _registrations(reports: Iterable[UsageReport], token: str) -> list[tuple[list[str], list[str]]]:
    """`_REGISTER`'s keys and arguments, one call per organisation."""
    by_organization: dict[int, list[str]] = defaultdict(list)
    for report in reports:
        by_organization[report.organization_id].append(report.request_id)
    kept_s = str(REGISTRATION_TTL_S + REGISTRATION_KEPT_S)
    return [([replaying_key(organization_id)], [str(REGISTRATION_TTL_S), kept_s, token, *request_ids])
            for organization_id, request_ids in by_organization.items()]


def _new_token() -> str:
    return f"{secrets.randbelow(10**9):09d}"


async def register_replaying(reports: Collection[UsageReport]) -> Registration:
    """Step 1 of a replay, before `reports` are written into the ledger (see the module's docstring); so too before a
    write's rows not written now may supersede lost rows (`count_superseded`). Returns what it registered:
    `count_replayed`'s `registration`. Their organisations are listed in the sweeper's index by when the registrations
    lapse (`sweep_index`: `count_lapsed_supersedes` reads them then)."""
    token, owed = _new_token(), {}
    seconds, _ = await get_async_redis().time()
    lapse_at = seconds + REGISTRATION_TTL_S  # no later than the script's own (Redis's clock read after)
    # NOTE: listed before they are registered: a replay killed between the two left registrations the index never
    # named (read only by the rolling audit).
    await sweep_index.list_due_async(dict.fromkeys(_organizations(reports), lapse_at))
    for keys, args in _registrations(reports, token):
        owed |= _registered_at(await _REGISTER(keys=keys, args=args))
    return Registration(token, owed)


def register_replaying_sync(reports: Collection[UsageReport]) -> Registration:
    """`register_replaying` from synchronous code (the worker's replay of shipped segments)."""
    token, owed = _new_token(), {}
    lapse_at = int(redis_time()) + REGISTRATION_TTL_S  # no later than the script's own (Redis's clock read after)
    sweep_index.list_due(get_redis(), dict.fromkeys(_organizations(reports), lapse_at))  # before: see the async one
    for keys, args in _registrations(reports, token):
        owed |= _registered_at(_REGISTER.run_sync(keys=keys, args=args))
    return Registration(token, owed)


def _organizations(reports: Iterable[UsageReport]) -> set[int]:
    return {report.organization_id for report in reports}


def record_registered_batch(reports: list[UsageReport]) -> set[str]:
    """Step 2 of a replay from synchronous code (the worker's replay of shipped segments): `record_usage_batch` in a
    transaction whose statements PostgreSQL cancels past `WRITE_TIMEOUT_S` (`statement_timeout`), raising
    `OperationalError`. Raises `UnknownEndpointError` once the rows it could write are committed.

    NOTE: on Django's connection, which has no statement timeout, an INSERT held up for minutes (a lock, a stalled
    disk) committed after its registration lapsed; a counter rebuilt then read the rows without asking about them, and
    their count added them again."""
    refused = None
    with bounded_write():
        try:
            return record_usage_batch(reports)
        except UnknownEndpointError as exc:  # the others are written: committed with the transaction
            refused = exc
    raise refused


@contextmanager
def bounded_write():
    """A transaction whose statements PostgreSQL cancels past `WRITE_TIMEOUT_S` (`statement_timeout`, raising
    `OperationalError`): each write of the worker's replay between its registration and its count, its INSERT
    (`record_registered_batch`) and its supersede (`billing.ledger.supersede_lost_rows`), commits well inside the
    registration's life, or not at all.

    NOTE: the supersede ran on Django's connection in autocommit: held up past the registration (a lock on the lost
    row), it committed after it; a counter rebuilt then read the whole cost, and `count_superseded` added the
    difference again."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL statement_timeout = {int(WRITE_TIMEOUT_S * 1000)}")
        yield



def _registered_at(answer: list) -> dict[str, float]:
    """`_REGISTER`'s answer: each request id registered already, with when (its deadline less `REGISTRATION_TTL_S`)."""
    return {as_text(answer[i]): float(as_text(answer[i + 1]).partition(".")[0]) - REGISTRATION_TTL_S
            for i in range(0, len(answer), 2)}


def count_replayed(request_ids: Collection[str], *, batch: Collection[UsageReport] = (),
                   registration: Registration | None = None) -> int:
    """Count the rows of `request_ids`, just written into the ledger by a replay of the journal, in the quota counters
    that lack them; returns how many rows. One query, and one script per organisation. Blocking I/O (the ORM, Redis).

    `batch`: the reports this replay registered; `registration`: what `register_replaying` registered of them (None:
    nothing, it failed: each row written now is counted). A row is counted by whoever drops its registration: this
    replay, or another one of the same rows at once (`Registration`). A replay killed between its commit and its count
    left its rows in the ledger, uncounted, their registrations there (kept `REGISTRATION_KEPT_S`) and its segment in
    the journal: the next replay writes nothing of it, and counts each owed row the ledger has as that replay wrote it
    (recorded since it was registered, as the journal has it: not a `gateway_lost` row, nor one superseded, whose
    `finished_at` is the lost row's) if it drops its registration: once, whichever replay comes first. A row recorded
    before (a write cut short by its timeout that committed: its call's settlement counted it) is not. So too a lost row
    the killed replay superseded (`count_superseded`, its difference from `lost_cost`). The registration of every other
    row of the batch is dropped uncounted if it is still this replay's, but a `gateway_lost` row's: its supersede, to
    come, drops it (`count_superseded`).

    NOTE: before, the next replay counted only what it wrote now, nothing: the rows stayed out of every counter that
    existed then (spend past a cap, the credit) until each was rebuilt; and a supersede killed before its count left
    its difference counted by none."""
    owed = registration.owed if registration is not None else {}
    owed_at = {report.request_id: report.finished_at for report in batch
               if report.request_id in owed and report.request_id not in request_ids}
    if not request_ids and not batch:
        return 0
    close_old_connections()
    rows = UsageRecord.objects.filter(request_id__in=list({*request_ids, *(r.request_id for r in batch)})).values_list(
        "request_id", "organization_id", "api_key_id", "cost", "finished_at", "billing_mode", "status", "recorded_at",
        "lost_cost")
    calls: dict[int, tuple[list[str], list[str]]] = {}

    def call(organization_id: int) -> tuple[list[str], list[str]]:
        if organization_id not in calls:
            calls[organization_id] = ([credit_key(organization_id), credit_journaled_key(organization_id),
                                       rebuilding_key(organization_id), replaying_key(organization_id)], [])
        return calls[organization_id]

    lost, superseded = set(), {}
    for (request_id, organization_id, api_key_id, cost, finished_at, billing_mode, status, recorded_at,
         lost_cost) in rows:
        if status == UsageStatus.GATEWAY_LOST:
            lost.add(request_id)
        if request_id not in request_ids and (
                request_id not in owed_at or status == UsageStatus.GATEWAY_LOST
                or recorded_at.timestamp() < owed[request_id] - CLOCKS_APART_S):
            continue
        if lost_cost is not None:  # superseded since the killed replay registered it: its difference
            superseded[request_id] = lost_cost
            continue
        if request_id not in request_ids and finished_at != owed_at[request_id]:
            continue
        keys, args = call(organization_id)
        period_key = period_containing(finished_at).key
        keys += [settled_key(organization_id, request_id), org_period_key(organization_id, period_key),
                 key_period_key(organization_id, api_key_id, period_key)]
        args += [request_id, str(to_units(cost)), "1" if api_key_id is not None else "0",
                 "1" if billing_mode == BillingMode.PREPAID else "0", "1" if request_id in owed_at else "0"]
    dropped: dict[int, list[str]] = defaultdict(list)
    counts_to_come = lost | set(request_ids) | superseded.keys()
    for report in batch:
        if report.request_id not in counts_to_come:
            call(report.organization_id)
            dropped[report.organization_id].append(report.request_id)
    token = registration.token if registration is not None else ""
    num_counted = sum(_COUNT_REPLAYED.run_sync(keys=keys, args=[str(SETTLED_MARKER_TTL_S), str(len(args) // 5), token,
                                                                *args, *dropped[organization_id]])
                      for organization_id, (keys, args) in calls.items())
    if superseded:
        num_counted += count_superseded(superseded, registered=True)
    return num_counted


async def drop_registrations(reports: Collection[UsageReport]) -> None:
    """Drop the registrations of `reports`, registered before a write's supersede that did not supersede them (rows
    written before, not lost): no count is to come."""
    by_organization: dict[int, list[str]] = defaultdict(list)
    for report in reports:
        by_organization[report.organization_id].append(report.request_id)
    for organization_id, request_ids in by_organization.items():
        await get_async_redis().hdel(replaying_key(organization_id), *request_ids)


# KEYS: the settled marker, the org period counter, the key period counter, the credit figure, the journaled calls the
# figure counted, the reservations, the rebuilds under way, the registrations; ARGV: request id, cost (units), the
# difference from the lost row's cost (units), has key (1/0), draws credit (1/0), marker ttl, registered (1/0: counted
# only if its registration is still there, which this drops). Returns 1 if it counted. A counter missing is
# left the difference if it is being rebuilt (as `_COUNT_REPLAYED` leaves the cost, but as `d:`: the lost row's
# settlement may leave its own `m:` to the same rebuild): its rebuild's snapshot has the row as lost or whole, so the
# difference is all it may lack.
_COUNT_SUPERSEDED = Script(MISSED_LUA + """
if redis.call('HDEL', KEYS[8], ARGV[1]) == 0 and ARGV[7] == '1' then return 0 end
local amount = ARGV[3]
if redis.call('HEXISTS', KEYS[6], ARGV[1]) == 1 and redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[6]) then
  amount = ARGV[2]
end
local function missed(counter)
  quota_missed(KEYS[7], counter, ARGV[1], ARGV[3], 'd:')
end
local field = 'j:' .. ARGV[1]
local function count(counter)
  if redis.call('EXISTS', counter) == 0 then return missed(counter) end
  if redis.call('HDEL', counter, field) == 0 then redis.call('HINCRBY', counter, 'spent', amount) end
end
count(KEYS[2])
if ARGV[4] == '1' then count(KEYS[3]) end
if ARGV[5] == '1' then
  if redis.call('EXISTS', KEYS[4]) == 0 then
    missed(KEYS[4])
  elseif redis.call('HDEL', KEYS[5], ARGV[1]) == 0 then
    redis.call('DECRBY', KEYS[4], amount)
  end
end
return 1
""", once=True)


def count_superseded(lost_costs: Mapping[str, Decimal], *, registered: bool = False) -> int:
    """Count the rows a replay of the journal, or a gateway woken from a freeze past its call's hold, wrote over the
    sweeper's `gateway_lost` rows of the same calls (`billing.ledger.supersede_lost_rows`; `lost_costs`: each request
    id's cost as the lost row had it) in the quota counters, once; returns how many rows. Blocking I/O (the ORM, Redis).

    The row keeps its `finished_at`, so it is counted in the same period as the lost row was, under the rules of
    `count_replayed`, but for the difference alone: the lost row's settlement (the sweeper's) counted its cost in the
    counters that existed then, and a counter rebuilt since read it from the ledger. Whole while the call's hold is still
    there (the sweeper wrote the lost row and has not settled it: its settlement, or the woken call's own, then finds the
    marker set here and adds nothing). A counter that counted the journaled row at the call's own settlement (marked)
    adds nothing.

    A counter rebuilt meanwhile counts the difference once too: the superseding row was registered before its supersede
    (`register_replaying`: a journal's replay registers its batch; a live write, the rows it may supersede), so a
    rebuild asks its snapshot about it and holds it only as superseded (a `gateway_lost` row is not held: its
    difference is still to come), writing it marked; a count that finds the counter missing while it is rebuilt leaves
    it the difference, which it adds unless its snapshot held the row superseded. This count drops the registration.
    `registered`: rows each registered by their writer (`register_replaying`: a replay, or a live write before its
    supersede): counted only by whoever drops its registration, this count, the next replay's (`count_replayed`) or the
    sweeper's (`count_lapsed_supersedes`), which finish the count of a supersede killed before it. NOTE: before, such
    a supersede's difference was counted by none: the lost row was gone, and the counters under-read (spend past the
    cap and the prepaid credit) until each was rebuilt.

    NOTE: the sweeper leaves a registered row's call to this count (`sweeper._registered`): settled after the
    superseding commit and before this count, it counted the call's whole cost, and this added the difference again."""
    if not lost_costs:
        return 0
    close_old_connections()
    rows = UsageRecord.objects.filter(request_id__in=list(lost_costs)).values_list(
        "request_id", "organization_id", "api_key_id", "cost", "finished_at", "billing_mode")
    num_counted = 0
    for request_id, organization_id, api_key_id, cost, finished_at, billing_mode in rows:
        period_key = period_containing(finished_at).key
        units = to_units(cost)
        num_counted += _COUNT_SUPERSEDED.run_sync(
            keys=[settled_key(organization_id, request_id), org_period_key(organization_id, period_key),
                  key_period_key(organization_id, api_key_id, period_key), credit_key(organization_id),
                  credit_journaled_key(organization_id), reservations_key(organization_id),
                  rebuilding_key(organization_id), replaying_key(organization_id)],
            args=[request_id, str(units), str(units - to_units(lost_costs[request_id])),
                  "1" if api_key_id is not None else "0", "1" if billing_mode == BillingMode.PREPAID else "0",
                  str(SETTLED_MARKER_TTL_S), "1" if registered else "0"])
    return num_counted


def count_lapsed_supersedes(organization_id: int, registrations: Mapping[str, str | bytes], now: float) -> int:
    """Count the superseded rows whose writer died between its supersede and its count; returns how many. Of the
    organisation's registrations (`registrations`: request id -> `<deadline>.<token>`, as read from `replaying_key`),
    those past their deadline at `now` (Redis's clock) whose row was superseded since it was registered (`lost_cost`
    set, `recorded_at` after the registration: not a row superseded and counted before, registered again by a later
    replay) are counted by `count_superseded(registered=True)`: once, whoever drops the registration, this or the next
    replay of a journal's rows (`count_replayed`). Run by the sweeper (`billing.quota.sweeper`). Blocking I/O.

    NOTE: a woken gateway's own write (`billing.usage_writer`) killed between its supersede and its count has no
    journal segment for a replay to finish it: its difference was counted by none until each counter was next rebuilt
    (spend past the cap and the prepaid credit)."""
    registered_at = {}
    for request_id, registration in registrations.items():
        deadline = float(as_text(registration).partition(".")[0])
        if deadline < now:
            registered_at[as_text(request_id)] = deadline - REGISTRATION_TTL_S
    if not registered_at:
        return 0
    close_old_connections()
    rows = UsageRecord.objects.filter(organization_id=organization_id, request_id__in=list(registered_at),
                                      lost_cost__isnull=False).values_list("request_id", "lost_cost", "recorded_at")
    return count_superseded({request_id: lost_cost for request_id, lost_cost, recorded_at in rows
                             if recorded_at.timestamp() >= registered_at[request_id] - CLOCKS_APART_S},
                            registered=True)


def replays_to_ask_about(organization_id: int, counter_key: str) -> set[str]:
    """The request ids a rebuild of `counter_key` must ask its ledger snapshot about, read after it took it: the rows
    a replay registered (written, or about to be, and not counted yet), and those whose count found the counter
    missing while it was being rebuilt. Blocking I/O (Redis)."""
    pipeline = get_redis().pipeline(transaction=False)
    pipeline.hkeys(replaying_key(organization_id))
    pipeline.hkeys(rebuilding_key(organization_id))
    registered, rebuilding = pipeline.execute()
    prefixes = (f"{MISSED_PREFIX}{counter_key}|", f"{DIFFERENCE_PREFIX}{counter_key}|")
    return {as_text(request_id) for request_id in registered} | {
        as_text(field).partition("|")[2] for field in rebuilding if as_text(field).startswith(prefixes)}
