"""A quota counter that Redis lost (a flush, a new period, an expired credit figure), rebuilt from
PostgreSQL: spend is the ledger's sum, credit what the grants leave after it."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal

from django.db import DatabaseError, OperationalError, connection, transaction
from psycopg.errors import QueryCanceled
from redis.exceptions import RedisClusterException, RedisError

from billing.ledger import period_spend_and_pending, undrawn_prepaid_spend_and_pending, undrawn_prepaid_usage
from billing.models import (
    ApiKeySpendCap,
    BillingAccount,
    BillingMode,
    CreditGrant,
    UsageRecord,
    UsageStatus,
    credit_draw,
)
from billing.periods import Period, period_containing
from billing.quota import replayed
from billing.quota.counters import (
    PERIOD_TTL_S,
    Reservation,
    limit_fields,
    refresh_key_cap,
    refresh_limits,
    to_units,
)
from billing.quota.server_change import SERVER_LUA
from billing.standing import card_spend, spend_ceiling_applies
from controlplane.clock import database_now, redis_datetime
from controlplane.per_loop import PerLoop
from controlplane.redis_client import as_text, get_async_redis, get_redis
from controlplane.redis_keys import (
    credit_journaled_key,
    credit_key,
    held_again_key,
    key_period_key,
    limits_refreshed_key,
    org_period_key,
    rebuilding_key,
    replaying_key,
    reservations_key,
    settled_key,
)
from controlplane.redis_scripts import Script
from controlplane.worker_threads import FairSlots, in_worker_thread

logger = logging.getLogger("inferplane.billing")

CREDIT_FIGURE_MAX_TTL_S = 3600
# At most one rewrite of an organisation counter's limits for a version mismatch in this long (`rebuild_missing`).
LIMITS_REFRESH_INTERVAL_S = 10
# The longest reading an organisation counter's limits again after its rebuild may take (`_limits_again`).
LIMITS_AGAIN_MAX_S = 2
# What leaves the limits (or the credit figure) as a rebuild wrote them, the call going on (`_limits_again`,
# `_credit_again`): a database that cannot answer in time, or Redis failing at the write (a failed refresh marks
# `limits_stale` where the database takes it, for the beat task's review).
REFRESH_FAILURES = (DatabaseError, RedisError, RedisClusterException)

# The longest a rebuild may take from its start (`_BEGIN_REBUILD`) to its write, its window: one slower writes nothing,
# so the counts that found its counter missing meanwhile were all told to it (`replayed`: they are, while a rebuild's
# window lasts). A rebuild's window is `REBUILD_MAX_S`, or twice what the last one of its counter that was too slow
# took (`s:<counter key>` in the rebuilds under way, `TOO_SLOW_PREFIX`), at most `REBUILD_LONGEST_S`: so an
# organisation whose ledger takes longer than a minute to read has its counter written by the next rebuild.
# NOTE: every rebuild of such a counter wrote nothing, and every call that needed it failed (after four rebuilds in a
# row, a 500), for as long as its ledger took that long to read.
REBUILD_MAX_S = 60
REBUILD_LONGEST_S = 3600
TOO_SLOW_PREFIX = "s:"

# How many of a process's rebuilds read PostgreSQL at once, each on a thread of its own with its own connection; the
# rest wait their turn before their window begins (`_BEGIN_REBUILD`), and a counter's callers in one event loop share
# its one rebuild (`_under_way`). NOTE: they ran on asgiref's one shared thread (the gateway's `/v1` path sets up no
# request context): one organisation's minute-long ledger read queued every other organisation's rebuild behind it,
# and after a Redis flush they all ran past their windows (503, `RebuildTooSlow`). A pool without a bound would instead
# take a connection per organisation rebuilding at once, up to PostgreSQL's `max_connections`; one rebuild per call
# would let one organisation's many calls take every thread.
REBUILD_THREADS = 4
# How many of those one organisation's rebuilds may hold at once (its other counters wait in its own queue, and a thread
# that frees goes first to the organisation holding fewest: `FairSlots`). NOTE: one organisation's four slow counters
# at once (four keys with huge ledgers, or a ledger made slow on purpose) took all four threads, and every other
# organisation's rebuild waited behind them, its calls held at the rebuild window or answered 503 (`RebuildTooSlow`).
REBUILD_THREADS_PER_ORGANIZATION = 2
_rebuild_threads = ThreadPoolExecutor(REBUILD_THREADS, thread_name_prefix="quota-rebuild")
_rebuild_slots = FairSlots(REBUILD_THREADS, per_owner=REBUILD_THREADS_PER_ORGANIZATION)
_under_way: PerLoop[dict[str, asyncio.Task]] = PerLoop(dict)  # counter key -> its rebuild, in this event loop


class RebuildUnfinished(TimeoutError):
    """A counter's rebuild wrote nothing this time (its tries all began again: `REBUILD_TRIES`), or the counters kept
    vanishing while a call was admitted: the call is answered as in an outage (503, retry), never a 500."""


class RebuildTooSlow(RebuildUnfinished):
    """A counter's rebuild took longer than its window and wrote nothing: the call is answered as in an outage (503,
    retry), and the counter's next rebuild is given twice as long as this one took."""


# Which Redis a script runs on: `server_change.SERVER_LUA`'s identity (`<run_id>/<master_replid2>`: new at every start
# and every promotion, not when a replica attaches). A rebuild's run carries the one it began on (`r:<counter>` is
# `<s.µs>@<identity>`, `_BEGIN_REBUILD`), and one that finds another since (not `same_server`) writes nothing
# (`LOST_LUA`).
RUN_SERVER_LUA = SERVER_LUA + """
local function run_server(run)
  return string.match(run, '@([%w/]*)$')
end
"""

# KEYS: the rebuilds under way, the organisation's reservations; ARGV: the counter's key, `REBUILD_MAX_S`,
# `REBUILD_LONGEST_S`. Says a rebuild of the counter is under way for its window (a replay's count that finds it missing
# leaves it the cost: `replayed`), and returns Redis's clock (s), the window (s), the calls reserved now, read before
# the ledger, and the run of rebuilds it joins (`r:<counter>`: Redis's clock (s.µs) when the first of the rebuilds
# under way began, and the replication id of the Redis it began on, `SERVER_LUA`; `LOST_LUA`). A run begun on another
# Redis (kept by a replica promoted since) is not joined: a new one begins.
_BEGIN_REBUILD = Script(RUN_SERVER_LUA + """
local time = redis.call('TIME')
local now = tonumber(time[1])
local field = 'c:' .. ARGV[1]
local under_way = tonumber(redis.call('HGET', KEYS[1], field) or '0')
local run = redis.call('HGET', KEYS[1], 'r:' .. ARGV[1])
local server = server_identity()
if under_way < now or not run or not same_server(run_server(run), server) then
  run = time[1] .. '.' .. time[2] .. '@' .. server
  redis.call('HSET', KEYS[1], 'r:' .. ARGV[1], run)
end
local took = tonumber(redis.call('HGET', KEYS[1], 's:' .. ARGV[1]) or '0')
local window = math.min(math.max(tonumber(ARGV[2]), 2 * took), tonumber(ARGV[3]))
local until_s = now + window
if under_way < until_s then redis.call('HSET', KEYS[1], field, until_s) end
if redis.call('TTL', KEYS[1]) < 2 * window then redis.call('EXPIRE', KEYS[1], 2 * window) end
return {now, window, redis.call('HKEYS', KEYS[2]), run}
""")

# A rebuild older than its window (`_BEGIN_REBUILD`): how long it took is kept for the counter's next rebuild, in the
# rebuilds under way, which last long enough for it.
TOO_SLOW_LUA = """
local function too_slow(rebuilding, counter, took, longest)
  redis.call('HSET', rebuilding, 's:' .. counter, took)
  if redis.call('TTL', rebuilding) < 2 * longest then redis.call('EXPIRE', rebuilding, 2 * longest) end
  return -1
end
"""
# KEYS: the rebuilds under way; ARGV: the counter's key, the rebuild's start and window (`_BEGIN_REBUILD`),
# `REBUILD_LONGEST_S`. A rebuild whose read PostgreSQL cancelled at its window (`_until`): kept as one too slow, as
# `_INIT_SPEND` keeps one that read to the end, as if it took twice its window (how long it would have taken is not
# known), so the counter's next rebuild is given four times as long. NOTE: kept as taking its window, a ledger that
# takes 3.5 windows to read was answered 503 twice (windows 1, 2, then 4) where one that read to the end was once.
_CANCELLED_TOO_SLOW = Script(TOO_SLOW_LUA + """
local took = math.max(tonumber(redis.call('TIME')[1]) - tonumber(ARGV[2]), 2 * tonumber(ARGV[3]))
return too_slow(KEYS[1], ARGV[1], took, ARGV[4])
""")

# The rows replayed from the journal, as a rebuilt counter must count them (`replayed`): its ledger snapshot has each
# of `present` (A[first..first+num_present-1]: the rows it was asked about and holds, a `gateway_lost` one too, and
# those of the calls reserved when it began) and holds as their count counts them each of `held`
# (A[h_first..h_first+h_num-1]: the rows asked about and held, a superseded one only as such: `_held`); one of `held`
# whose count is still to come (registered, its registration there: lapsed too, a killed replay's, which the next
# replay counts, `replayed`) is marked as counted (`marks`, under `mark_prefix`), so the count drops the mark and adds
# nothing, unless `left` (its cost left to its settlement). Returns the costs of the rows whose count (a replay's, or
# a call's settlement: `counters.MISSED_LUA`) found the counter missing while it was rebuilt and that are not
# `present`, and the differences (`d:`) of rows superseded meanwhile that are not `held` (the snapshot has the lost
# row, or none): the caller adds them. Those are dropped. NOTE: a lost row's call reserved when the rebuild began,
# settled meanwhile (its `m:`) and superseded (its `d:`, overwriting the same field before), was `present` for both,
# and marked: the difference was counted by none.
# NOTE: an `m:` whose row the snapshot has as `gateway_lost` (the sweeper's settlement of a lost call, while the
# counter was missing within an earlier rebuild's window), the call not reserved when this rebuild began, was not
# `present` (a lost row is not `held`) and was added on top of the snapshot: counted twice.
REPLAYED_ROWS_LUA = """
local function replayed_rows(counter, marks, mark_prefix, rebuilding, registrations, now, A, first, num_present, left,
                             h_first, h_num)
  local present, held = {}, {}
  for i = first, first + num_present - 1 do present[A[i]] = true end
  for i = h_first, h_first + h_num - 1 do
    local request_id = A[i]
    held[request_id] = true
    if not left[request_id] and redis.call('HEXISTS', registrations, request_id) == 1 then
      redis.call('HSET', marks, mark_prefix .. request_id, '1')
    end
  end
  local missed = {}
  local fields = redis.call('HGETALL', rebuilding)
  for prefix, counted in pairs({['m:' .. counter .. '|'] = present, ['d:' .. counter .. '|'] = held}) do
    for i = 1, #fields, 2 do
      if string.sub(fields[i], 1, #prefix) == prefix then
        if not counted[string.sub(fields[i], #prefix + 1)] then missed[#missed + 1] = fields[i + 1] end
        redis.call('HDEL', rebuilding, fields[i])
      end
    end
  end
  return missed
end
"""

# The calls held again while the rebuild of a counter was under way (`marks`, its set: `held_again_key`, written by
# `counters._RESTORE_RESERVATIONS`): none was reserved when it began, and a row of one may be in its snapshot. Each
# asked about (`asked`: A[first..first+num-1], read once its snapshot began) counts as a call reserved when it began
# (`_rebuild_from_database`); one held again since it read them (not asked) leaves it unable to tell: false, and the
# rebuild writes nothing (`HELD_AGAIN_MEANWHILE`: it begins again, and reads it). True drops the marks. Reads only the
# counter's own marks (its calls, each looked up once).
# NOTE: a call held again after a rebuild began, its row in the snapshot, was counted twice: its settlement added its
# cost to the counter written without leaving it out, or left it as `m:` (`counters.MISSED_LUA`) to a rebuild that
# asked nothing about it (for a sweeper's `gateway_lost` row, one that asked about it: `_held`).
HELD_AGAIN_LUA = """
local function held_again_asked(marks, A, first, num)
  local num_marked = redis.call('SCARD', marks)
  if num_marked == 0 then return true end
  local num_asked_marked = 0
  for i = first, first + num - 1 do num_asked_marked = num_asked_marked + redis.call('SISMEMBER', marks, A[i]) end
  if num_asked_marked < num_marked then return false end
  redis.call('DEL', marks)
  return true
end
"""
HELD_AGAIN_MEANWHILE = -2
# How many times a rebuild begins again for calls held again meanwhile (`HELD_AGAIN_MEANWHILE`), or for Redis losing
# its run (`LOST_MEANWHILE`), before it gives up (`RebuildUnfinished`: the call is a 503, and its retry rebuilds again).
# NOTE: it left the counter to the caller's next attempt, which rebuilt it as often (`admission.MAX_REBUILDS` times
# this, each a read of the organisation's month), then failed the call with a 500.
REBUILD_TRIES = 3

# Whether Redis lost what a rebuild of `counter` begun at `run` (`_BEGIN_REBUILD`) relies on since it began (a flush,
# a restart without persistence, a failover to a replica without the recent writes): its run (`r:<counter>`), or its
# window (`c:<counter>`, at least `until_s`), and with them the costs that counts left it (`m:`, `counters.MISSED_LUA`)
# and the calls held again it asks about (`HELD_AGAIN_LUA`). A count that found the counter missing while `c:` was
# gone left it nothing: true, and the rebuild writes nothing (`LOST_MEANWHILE`: it begins again, with a snapshot that
# has the row).
# NOTE: a call whose row was committed after the snapshot and settled after Redis lost `c:` was counted nowhere: the
# settlement found no counter and no rebuild under way, and the rebuild wrote the counter without it (spend past the
# hard cap and the prepaid credit for the rest of the period).
# A failover to a replica behind by some writes keeps the run (`r:`, `c:`, written before) and lacks what was written
# after: a count's `m:` (with a settlement with no hold, its mark and settled marker: nothing of the call left), which
# no field tells apart. The Redis it runs on does: a replica promoted takes a new identity (`SERVER_LUA`), and a
# run begun on another is lost. NOTE: such a rebuild wrote the counter without the call's cost, counted nowhere.
LOST_LUA = RUN_SERVER_LUA + """
local function rebuild_lost(rebuilding, counter, run, until_s)
  if redis.call('HGET', rebuilding, 'r:' .. counter) ~= run then return true end
  if not same_server(run_server(run), server_identity()) then return true end
  return tonumber(redis.call('HGET', rebuilding, 'c:' .. counter) or '0') < tonumber(until_s)
end
"""
LOST_MEANWHILE = -3

# KEYS: a period counter (a hash), the organisation's reservations, the rebuilds under way, the replays' registrations,
# the calls held again while it was rebuilt (`held_again_key`), then the settled marker of each pending call; ARGV:
# ttl, the rebuild's start and window (`_BEGIN_REBUILD`), `REBUILD_LONGEST_S`, its run (`LOST_LUA`), the number of
# calls held again it asked about, their request ids (`HELD_AGAIN_LUA`), the number of replayed rows present, their
# request ids, the number of those held (`_held`), their request ids, then each pending call's request id, then each
# one's cost
# (units, > 0), then the hash's field/value pairs, and `rb`, its start (a settlement with no hold drops a counter
# rebuilt since its call was last known held: `counters.SETTLE_LUA`). Writes the hash only if nobody did meanwhile
# (0), the rebuild is
# not too old (-1), Redis lost nothing it relies on since it began (-3: `LOST_LUA`) and no call was held again since
# it read them (-2), its spend less the cost of each pending call
# still reserved and not settled, whose own settlement (`counters.SETTLE`) adds it once the counter exists, and with
# the journal's replayed rows counted once (`REPLAYED_ROWS_LUA`).
_INIT_SPEND = Script(REPLAYED_ROWS_LUA + TOO_SLOW_LUA + HELD_AGAIN_LUA + LOST_LUA + """
local now = tonumber(redis.call('TIME')[1])
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if now > tonumber(ARGV[2]) + tonumber(ARGV[3]) then return too_slow(KEYS[3], KEYS[1], now - tonumber(ARGV[2]), ARGV[4]) end
if rebuild_lost(KEYS[3], KEYS[1], ARGV[5], tonumber(ARGV[2]) + tonumber(ARGV[3])) then return -3 end
local num_asked = tonumber(ARGV[6])
if not held_again_asked(KEYS[5], ARGV, 7, num_asked) then return -2 end
local present_at = 8 + num_asked
local pending = #KEYS - 5
local num_present = tonumber(ARGV[present_at - 1])
local held_at = present_at + num_present + 1
local num_held = tonumber(ARGV[held_at - 1])
local ids_at = held_at + num_held
redis.call('HSET', KEYS[1], unpack(ARGV, ids_at + 2 * pending))
redis.call('HSET', KEYS[1], 'rb', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[1])
local left = {}
for i = 1, pending do
  local request_id = ARGV[ids_at + i - 1]
  if redis.call('HEXISTS', KEYS[2], request_id) == 1 and redis.call('EXISTS', KEYS[5 + i]) == 0 then
    redis.call('HINCRBY', KEYS[1], 'spent', '-' .. ARGV[ids_at + pending + i - 1])
    left[request_id] = true
  end
end
for _, cost in ipairs(replayed_rows(KEYS[1], KEYS[1], 'j:', KEYS[3], KEYS[4], now, ARGV, present_at, num_present, left,
                                    held_at, num_held)) do
  redis.call('HINCRBY', KEYS[1], 'spent', cost)
end
return 1
""")


# KEYS: the credit figure, the organisation's reservations, the journaled calls the figure counted, the rebuilds under
# way, the replays' registrations, the calls held again while it was rebuilt (`held_again_key`), then the settled
# marker of each pending call; ARGV: ttl, the figure (units), the
# rebuild's start and window, `REBUILD_LONGEST_S`, its run, the number of calls held again it asked about, their
# request ids, the number of replayed rows present, their request ids, the number of those held (`_held`), their
# request ids, then each pending call's request id, then each one's cost (units, > 0). Writes the figure only if
# nobody did meanwhile (0), the rebuild is not too old (-1), Redis lost nothing it relies on since it began (-3) and
# no call was held again since it read them (-2), with the cost of each pending call still reserved and not settled
# given back: its own
# settlement (`counters.SETTLE`) takes it once the figure exists. Its start is `@rb` in the journaled calls (a plain
# value has no fields), as `rb` in a period counter (`_INIT_SPEND`).
# NOTE: the figure counted it, then the settlement took it again:
# a prepaid account refused (402) early for up to an hour after any grant or mode change. A new figure has counted no
# journaled call but the replayed rows it marks (`REPLAYED_ROWS_LUA`): what the last one had is dropped.
_INIT_CREDIT = Script(REPLAYED_ROWS_LUA + TOO_SLOW_LUA + HELD_AGAIN_LUA + LOST_LUA + """
local now = tonumber(redis.call('TIME')[1])
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if now > tonumber(ARGV[3]) + tonumber(ARGV[4]) then return too_slow(KEYS[4], KEYS[1], now - tonumber(ARGV[3]), ARGV[5]) end
if rebuild_lost(KEYS[4], KEYS[1], ARGV[6], tonumber(ARGV[3]) + tonumber(ARGV[4])) then return -3 end
local num_asked = tonumber(ARGV[7])
if not held_again_asked(KEYS[6], ARGV, 8, num_asked) then return -2 end
local present_at = 9 + num_asked
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[1])
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], '@rb', ARGV[3])
local pending = #KEYS - 6
local num_present = tonumber(ARGV[present_at - 1])
local held_at = present_at + num_present + 1
local num_held = tonumber(ARGV[held_at - 1])
local ids_at = held_at + num_held
local left = {}
for i = 1, pending do
  local request_id = ARGV[ids_at + i - 1]
  if redis.call('HEXISTS', KEYS[2], request_id) == 1 and redis.call('EXISTS', KEYS[6 + i]) == 0 then
    redis.call('INCRBY', KEYS[1], ARGV[ids_at + pending + i - 1])
    left[request_id] = true
  end
end
for _, cost in ipairs(replayed_rows(KEYS[1], KEYS[3], '', KEYS[4], KEYS[5], now, ARGV, present_at, num_present, left,
                                    held_at, num_held)) do
  redis.call('DECRBY', KEYS[1], cost)
end
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('EXPIRE', KEYS[3], ARGV[1]) end
return 1
""")


@dataclass(slots=True, frozen=True)
class _Rebuild:
    key: str
    fields: dict[str, str] | None  # a hash, or
    value: str | None  # a plain counter
    ttl_s: int
    # request id -> cost (units) of the rows in it whose calls were still reserved (`_INIT_SPEND`, `_INIT_CREDIT`)
    pending: dict[str, int] = field(default_factory=dict)
    # the rows it was asked about and holds, as lost or whole (`replayed.replays_to_ask_about`), and those of the calls
    # reserved when it began: a call settled while it is under way tells it its cost (`counters.MISSED_LUA`)
    present: tuple[str, ...] = ()
    # the calls held again since it began that it asked about, as reserved then (`HELD_AGAIN_LUA`)
    held_again: tuple[str, ...] = ()
    # of `present`, the rows it was asked about and holds as their count counts them (`_held`, `REPLAYED_ROWS_LUA`)
    held: tuple[str, ...] = ()
    # the credit figure's: the grants it read (`_credit_again`)
    grants: frozenset[int] = frozenset()


def _rebuild_from_database(what: str, organization_id: int, api_key_id: int | None, period: Period,
                           reserved_ids: Collection[str] = (), deadline: float | None = None) -> _Rebuild:
    """The counter `what` as PostgreSQL has it; `reserved_ids`: the organisation's reservations (read before),
    whose calls may have a row in the period's spend and settle after the counter is written, as may those held again
    since (`_held_again`). `deadline` (`time.monotonic()`): when its window ends, and PostgreSQL cancels whichever of
    its reads runs then (`_until`)."""
    with _until(deadline) if deadline is not None else nullcontext():
        return _read_rebuild(what, organization_id, api_key_id, period, reserved_ids)


def _read_rebuild(what: str, organization_id: int, api_key_id: int | None, period: Period,
                  reserved_ids: Collection[str]) -> _Rebuild:
    counter = _counter_key(what, organization_id, api_key_id, period)
    if what in ("org", "key"):
        # made first if need be: the snapshot only reads
        account = BillingAccount.objects.for_organization(organization_id) if what == "org" else None
        with _one_snapshot():
            asked = _replays_in_snapshot(organization_id, counter)
            held_again = _held_again(counter)
            reserved = {*reserved_ids, *held_again}
            spent, costs = period_spend_and_pending(organization_id, period, {*reserved, *asked},
                                                    api_key_id=api_key_id if what == "key" else None)
            held = _held(organization_id, asked)
        pending = {request_id: cost for request_id, cost in costs.items() if request_id in reserved}
        present = tuple(costs)  # NOTE: a `gateway_lost` row too (`_held`, `REPLAYED_ROWS_LUA`)
        held = tuple(request_id for request_id in costs if request_id in held)
    if what == "org":
        # NOTE: the card's others' spend of the counter's month (Redis's clock, as the gateway picked it), not of the
        # month PostgreSQL's clock is in (`card_spend` with no period): at a month's start, a database a minute behind
        # gave the new month's counter the room the old month left, and its first calls were refused for it. So for
        # the others' spend without a payment method (`period`): it gave the allowance's, kept for the month.
        card = (card_spend([account.card_fingerprint], period)[account.card_fingerprint]
                if account.card_fingerprint and spend_ceiling_applies(account) else None)
        fields = limit_fields(account, card=card, period=period)
        return _Rebuild(counter, {"spent": str(to_units(spent))} | fields, None, PERIOD_TTL_S,
                        _units(pending), present, held_again, held)
    if what == "key":
        key_cap = ApiKeySpendCap.objects.filter(api_key_id=api_key_id).values_list("spend_cap", flat=True).first()
        fields = {"spent": str(to_units(spent)), "cap": str(to_units(key_cap) if key_cap is not None else -1)}
        return _Rebuild(counter, fields, None, PERIOD_TTL_S, _units(pending), present, held_again, held)
    if what == "credit":
        available, ttl_s, pending, present, held_again, held, grants = _credit_and_pending(
            organization_id, reserved_ids, counter=counter)
        return _Rebuild(counter, None, str(to_units(available, ROUND_HALF_UP)), ttl_s, _units(pending), present,
                        held_again, held, grants)
    raise ValueError(what)


def _counter_key(what: str, organization_id: int, api_key_id: int | None, period: Period) -> str:
    if what == "org":
        return org_period_key(organization_id, period.key)
    if what == "key":
        return key_period_key(organization_id, api_key_id, period.key)
    if what == "credit":
        return credit_key(organization_id)
    raise ValueError(what)


def _replays_in_snapshot(organization_id: int, counter: str) -> set[str]:
    """The snapshot taken (`_one_snapshot`), the journal's replayed rows a rebuild of `counter` asks it about.

    NOTE: read from Redis after the snapshot began: a row registered later is committed after it, so the snapshot
    lacks it and its count adds it (`replayed`); one registered before is asked about, and counted as it holds it."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")  # the snapshot's first read: it begins here
    return replayed.replays_to_ask_about(organization_id, counter)


def _held_again(counter: str) -> tuple[str, ...]:
    """The calls held again since the rebuild of `counter` began (`HELD_AGAIN_LUA`), read once its snapshot began: a
    call's row committed before the snapshot, its hold put back after this read, leaves the rebuild's write undone
    (`HELD_AGAIN_MEANWHILE`). Blocking I/O (Redis)."""
    return tuple(as_text(member) for member in get_redis().smembers(held_again_key(counter)))


def _held(organization_id: int, asked: set[str]) -> set[str]:
    """Of the rows `asked` about, those the snapshot holds as their replay or supersede counts them: a `gateway_lost`
    row is not held, since a replay's row that supersedes it (`replayed.count_superseded`) counts the difference its
    snapshot lacks. NOTE: a lost row is never itself replayed: the sweeper writes it straight into the ledger."""
    if not asked:
        return set()
    return set(UsageRecord.objects.filter(organization_id=organization_id, request_id__in=asked)
               .exclude(status=UsageStatus.GATEWAY_LOST).values_list("request_id", flat=True))


def _units(pending: dict[str, Decimal]) -> dict[str, int]:
    return {request_id: units for request_id, cost in pending.items() if (units := to_units(cost)) > 0}


def credit_available(organization_id: int, *, now=None) -> tuple[Decimal, int]:
    """Prepaid credit left now (active grants less usage not yet drawn from them), and for how many
    seconds that figure holds before a grant starts or expires."""
    available, ttl_s, *_ = _credit_and_pending(organization_id, (), now=now)
    return available, ttl_s


def _credit_and_pending(organization_id: int, reserved_ids: Collection[str], *, now=None, counter: str | None = None,
                        ) -> tuple[Decimal, int, dict[str, Decimal], tuple[str, ...], tuple[str, ...], tuple[str, ...],
                                   frozenset[int]]:
    """`credit_available`, the cost of each prepaid row in it whose call is one of `reserved_ids` or held again since
    (`_held_again`), and, to rebuild the figure (`counter`), the journal's replayed prepaid rows it holds
    (`_replays_in_snapshot`), the calls held again it asked about, of the first those it holds (`_held`), and the
    grants it read (their ids)."""
    now = now or database_now()  # NOTE: the clock the grants are stamped by (`credits.grant_credits`), not this process's
    BillingAccount.objects.for_organization(organization_id)  # made first if need be: the snapshot only reads
    with _one_snapshot():
        # NOTE: one snapshot for the account's `credit_drawn`, the grants and the ledger. A draw (`draw_credits`)
        # committed between two of these reads was counted twice: the grants had taken it while `credit_drawn`
        # still left it undrawn, and a prepaid account near the end of its credit was refused (402) early for up
        # to the figure's TTL.
        account = BillingAccount.objects.get(organization_id=organization_id)
        asked = _replays_in_snapshot(organization_id, counter) if counter is not None else set()
        held_again = _held_again(counter) if counter is not None else ()
        present = tuple(UsageRecord.objects.filter(organization_id=organization_id, billing_mode=BillingMode.PREPAID,
                                                   request_id__in=asked).values_list("request_id", flat=True)
                        ) if asked else ()
        held_ids = _held(organization_id, set(present))
        held = tuple(request_id for request_id in present if request_id in held_ids)
        grants = list(CreditGrant.objects.filter(organization_id=organization_id))
        undrawn, pending = undrawn_prepaid_spend_and_pending(account, {*reserved_ids, *held_again})
        present = (*present, *(request_id for request_id in pending if request_id not in present))
        # NOTE: a grant expired since pays for the usage not drawn yet made while it was active, as the draw will
        # take it (`billing.models.credit_shares`), and never for anything more.
        # NOTE: and an overcharge given back to a grant counts as the draw will give it (`credit_draw`), apart from
        # the usage: netted, the usage was counted short and the credit given back to a lapsed grant as active.
        drawing = undrawn_prepaid_usage(account)  # the same amount: one snapshot
        dates = [started_at for started_at, _ in (*drawing.usage, *drawing.overcharge)]
        paying = (list(CreditGrant.objects.paying_for(organization_id, since=min(dates, default=now), now=now))
                  if drawing.drawn > 0 or drawing.returned > 0 else [])
    draw = credit_draw(paying, drawing.usage, drawing.overcharge, returned=drawing.returned,
                       unpaid=account.credit_unpaid, now=now)
    lapsed = [grant.pk for grant in paying if not grant.is_active(now)]
    undrawn_on_lapsed = sum((draw.taken.get(pk, Decimal(0)) for pk in lapsed), Decimal(0))
    active = [grant for grant in grants if grant.is_active(now)]
    undrawn_on_active = max(undrawn + drawing.returned - draw.netted - undrawn_on_lapsed, Decimal(0))
    given_back_to_active = sum((draw.returned.get(grant.pk, Decimal(0)) for grant in active), Decimal(0))
    available = sum((grant.remaining for grant in active), Decimal(0)) - undrawn_on_active + given_back_to_active
    changes = [g.expires_at for g in active if g.expires_at] + [g.granted_at for g in grants if g.granted_at > now]
    ttl_s = CREDIT_FIGURE_MAX_TTL_S
    if changes:
        ttl_s = max(1, min(ttl_s, int((min(changes) - now).total_seconds()) + 1))
    return available, ttl_s, pending, present, held_again, held, frozenset(grant.pk for grant in grants)


@contextmanager
def _one_snapshot():
    """A read-only transaction whose reads all see the database as it was at the first of them (REPEATABLE READ):
    what others commit meanwhile stays unseen, and nothing is locked. Inside a caller's transaction, its reads are
    that one's. NOTE: `SET LOCAL` (as `SET TRANSACTION`, before the first read) keeps no session state
    (`DATABASE_POOLER=transaction`)."""
    if connection.in_atomic_block:
        yield
        return
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL transaction_isolation = 'repeatable read'")
            cursor.execute("SET LOCAL transaction_read_only = on")
        yield


@contextmanager
def _until(deadline: float):
    """While it lasts, PostgreSQL cancels any statement of this thread's connection still running at `deadline`
    (`time.monotonic()`; `QueryCanceled`, in an `OperationalError`), a wait for a lock or a row lock included: each is
    given the time left (`SET LOCAL statement_timeout`, at least 1 ms), and one outside a transaction runs in one of
    its own, so the setting keeps no session state (`DATABASE_POOLER=transaction`). A rebuild's reads all end by its
    window, since one that reads past it writes nothing anyway (`_INIT_SPEND`).

    NOTE: a ledger slow to read (huge, or a lock held on it) held a rebuild thread and its connection for as long as
    the read took, minutes past any use; then, the window given to each read of its snapshot, three reads each just
    under it held the thread three windows, and the reads outside the snapshot (the account, a key's cap) none."""

    def bounded(execute, sql, params, many, context):
        if not connection.in_atomic_block:
            with transaction.atomic():
                return bounded(execute, sql, params, many, context)
        time_left_ms = max(1, math.ceil((deadline - time.monotonic()) * 1000))
        # NOTE: a SET takes no snapshot, so `_one_snapshot`'s isolation level may still be set after it; on the
        # driver's own cursor, past these wrappers, its errors Django's as the statement's own are
        with connection.wrap_database_errors:
            context["cursor"].cursor.execute(f"SET LOCAL statement_timeout = {time_left_ms}")
        return execute(sql, params, many, context)

    with connection.execute_wrapper(bounded):
        yield


async def _write_rebuild(rebuild: _Rebuild, organization_id: int, started_at: int, window_s: int, run: str) -> int:
    """1 when written, 0 when another wrote the counter first, -1 when the rebuild is older than its window,
    `LOST_MEANWHILE` when Redis lost its run since it began (`LOST_LUA`), `HELD_AGAIN_MEANWHILE` when a call was held
    again since it read those (`_held_again`)."""
    request_ids = list(rebuild.pending)
    markers = [settled_key(organization_id, request_id) for request_id in request_ids]
    costs = [rebuild.pending[request_id] for request_id in request_ids]
    under_way = [rebuilding_key(organization_id), replaying_key(organization_id), held_again_key(rebuild.key)]
    began = [started_at, window_s, REBUILD_LONGEST_S, run, len(rebuild.held_again), *rebuild.held_again,
             len(rebuild.present), *rebuild.present, len(rebuild.held), *rebuild.held]
    if rebuild.fields is not None:
        return await _INIT_SPEND(keys=[rebuild.key, reservations_key(organization_id), *under_way, *markers],
                                 args=[rebuild.ttl_s, *began, *request_ids, *costs,
                                       *[item for pair in rebuild.fields.items() for item in pair]])
    return await _INIT_CREDIT(keys=[rebuild.key, reservations_key(organization_id),
                                    credit_journaled_key(organization_id), *under_way, *markers],
                              args=[rebuild.ttl_s, rebuild.value, *began, *request_ids, *costs])


async def rebuild_missing(what: str, reservation: Reservation) -> bool:
    """`quota_reserve` answered {'missing', what}: rebuild that counter from PostgreSQL. True when the
    caller should take the organisation counter's limits as they stand (`any_limits`).

    NOTE: during a rolling deploy that changes `limits_version` (this code's fields, the limit without a
    payment method, Stripe's set-up) pods of both versions find the other's `lv`. Each would rewrite the
    limits under the account's row lock on every request, and a request whose every attempt found the
    other's failed. So a version mismatch rewrites the limits at most once per organisation per
    `LIMITS_REFRESH_INTERVAL_S`; meanwhile calls take the limits the other version wrote moments ago."""
    period = period_containing(redis_datetime())  # NOTE: the month the reservation is prepared in (Redis's clock)
    if period.key != reservation.period_key:
        return False  # a new month began meanwhile: the caller prepares the reservation again
    if what == "limits" and not await get_async_redis().set(
            limits_refreshed_key(reservation.organization_id), "1", nx=True, ex=LIMITS_REFRESH_INTERVAL_S):
        return True
    if what == "limits":  # the counter exists, its spend stands; only its limits are written again
        async with _rebuild_slots.held(reservation.organization_id):
            await in_worker_thread(_limits_again, executor=_rebuild_threads)(reservation.organization_id)
        return False
    counter = _counter_key(what, reservation.organization_id, reservation.api_key_id, period)
    under_way = _under_way.get()
    rebuilding = under_way.get(counter)
    if rebuilding is None:
        rebuilding = under_way[counter] = asyncio.ensure_future(
            _rebuild_counter(what, counter, reservation.organization_id, reservation.api_key_id, period))
        rebuilding.add_done_callback(lambda done: _rebuilt(under_way, counter, done))
    # NOTE: a caller gone (a client's disconnect) leaves the rebuild to the others that wait for it.
    await asyncio.shield(rebuilding)
    return False


async def _rebuild_counter(what: str, counter: str, organization_id: int, api_key_id: int | None,
                           period: Period) -> None:
    """Rebuild `counter` once a thread is free for it and its organisation's turn came (`REBUILD_THREADS`,
    `REBUILD_THREADS_PER_ORGANIZATION`), and an organisation counter's limits read again (`_limits_again`); raises
    `RebuildUnfinished` (`RebuildTooSlow`).

    NOTE: nothing in its slot waits for another rebuild (an admission rebuilds its counters one after another, each
    outside the slots: `endpoints.gateway.admission.admit`), so an organisation's counters queued behind its own
    never wait for each other."""
    async with _rebuild_slots.held(organization_id):
        # NOTE: read before the ledger. A call reserved then whose row the ledger has may settle after the counter is
        # written (the row is written first; a call reserved in the last month spends in this one when it finishes
        # in it), and adds its cost then: the counter is written without it (`_INIT_SPEND`). A call reserved since
        # found this counter missing (its own rebuild wrote it first, or ours does) and reserved nothing; one held again
        # since (its hold put back after Redis lost it) is marked for this rebuild (`_held_again`).
        for _try in range(REBUILD_TRIES):  # again while calls are held again meanwhile, or Redis lost its run
            started_at, window_s, reserved_ids, run = await _BEGIN_REBUILD(
                keys=[rebuilding_key(organization_id), reservations_key(organization_id)],
                args=[counter, REBUILD_MAX_S, REBUILD_LONGEST_S])
            # NOTE: at or after the window's end in Redis's clock (its start is a whole second, at or before now)
            deadline = time.monotonic() + int(window_s)
            try:
                rebuild = await in_worker_thread(_rebuild_from_database, executor=_rebuild_threads)(
                    what, organization_id, api_key_id, period, reserved_ids, deadline)
            except OperationalError as exc:
                if not isinstance(exc.__cause__, QueryCanceled):
                    raise
                if time.monotonic() < deadline:
                    # NOTE: cancelled by another (an operator's `pg_cancel_backend`), not at its window: it was
                    # answered 503, logged as taking over the window, and the next window doubled
                    logger.warning("organisation %s: its %s counter's rebuild was cancelled before its window ended; "
                                   "not written", organization_id, what)
                    raise RebuildUnfinished(f"the {what} counter's rebuild was cancelled") from exc
                # its reads outlasted the window (`_until`): too slow, as one that read to the end
                written = await _CANCELLED_TOO_SLOW(keys=[rebuilding_key(organization_id)],
                                                    args=[counter, started_at, window_s, REBUILD_LONGEST_S])
                break
            written = await _write_rebuild(rebuild, organization_id, int(started_at), int(window_s), run)
            if written not in (HELD_AGAIN_MEANWHILE, LOST_MEANWHILE):
                break
        if what == "org" and written in (0, 1):
            # NOTE: the limits read (again) after the counter exists, under the account's lock: a change committed
            # between the rebuild's read and its write refreshed nothing (no counter yet), and would otherwise stay
            # unseen for the month. Once per rebuild, in its slot: read once per waiting call, outside the slots,
            # one organisation's 400 calls after a flush queued another's rebuild behind 400 refreshes (2 s; ~11,000
            # calls: past its window, a 503).
            await in_worker_thread(_limits_again, executor=_rebuild_threads)(organization_id)
        elif what == "key" and written in (0, 1):
            # NOTE: so too a key's cap: one set between the rebuild's read and its write found no counter to refresh,
            # and the key spent past it for the rest of the month (the counter lives `PERIOD_TTL_S`).
            await in_worker_thread(_limits_again, executor=_rebuild_threads)(organization_id, api_key_id)
        elif what == "credit" and written == 1:
            # NOTE: and a grant made between the figure's read and its write: its refresh dropped no figure (none yet),
            # and the one written without it stood for its time (up to `CREDIT_FIGURE_MAX_TTL_S`), refusing calls it
            # paid for.
            await in_worker_thread(_credit_again, executor=_rebuild_threads)(organization_id, rebuild.grants)
    if written in (HELD_AGAIN_MEANWHILE, LOST_MEANWHILE):
        logger.warning("organisation %s: its %s counter's rebuild began again %d times (calls held again, or Redis "
                       "lost its run, meanwhile); not written", organization_id, what, REBUILD_TRIES)
        raise RebuildUnfinished(f"the {what} counter's rebuild began again {REBUILD_TRIES} times")
    if written == -1:
        logger.warning("organisation %s: its %s counter's rebuild took over %d s; not written (the next is given "
                       "longer)", organization_id, what, window_s)
        raise RebuildTooSlow(f"the {what} counter's rebuild took over {window_s} s")


def _rebuilt(under_way: dict[str, asyncio.Task], counter: str, done: asyncio.Task) -> None:
    if under_way.get(counter) is done:
        del under_way[counter]
    if not done.cancelled():
        done.exception()  # NOTE: its callers raise it; one whose callers all left is not logged as never retrieved


def _credit_again(organization_id: int, grants_read: frozenset[int]) -> None:
    """The credit figure just written dropped (`refresh_limits`, as a grant's own refresh drops it) when a grant its
    rebuild did not read exists now: rebuilt with it by the next call. A grant committed after this read is refreshed
    after it, with the figure written. Grants are only added (`billing.credits.grant_credits`), never edited or
    deleted. A database that cannot answer in time, or Redis failing at the drop, leaves the figure as written
    (`_limits_again`; the failed refresh leaves `limits_stale` for the beat task's review, which drops it)."""
    try:
        with _until(time.monotonic() + LIMITS_AGAIN_MAX_S):
            if CreditGrant.objects.filter(organization_id=organization_id).exclude(pk__in=grants_read).exists():
                refresh_limits(BillingAccount.objects.for_organization(organization_id))
    except REFRESH_FAILURES as exc:
        logger.warning("organisation %s: its credit figure's grants are not read again (%s); the rebuilt one stands",
                       organization_id, type(exc).__name__)


def _limits_again(organization_id: int, api_key_id: int | None = None) -> None:
    """The organisation counter's limits read again under the account's lock after its rebuild; with `api_key_id`,
    that key's cap alone after its counter's (`counters.refresh_key_cap`).

    NOTE: a database that serves reads and refuses writes (a failover's demoted primary, a full disk) refuses the
    refresh's row lock: the limits just rebuilt from it stand, as good as it can tell, and the call goes on. It raised
    `InternalError` (read-only transaction), not an outage: every call that found its counter missing was a 500 for
    the rest of the outage. So does one that waits for the lock longer than `LIMITS_AGAIN_MAX_S` (`_until`): a
    transaction holding the account's row (a webhook's, a migration's) held the refresh, its rebuild thread, its slot
    and its callers for as long as it lasted; the change it commits is refreshed after it (`refresh_limits`).

    NOTE: so too Redis failing at the write (the counter was just written): the refresh leaves `limits_stale` set for
    the beat task's review, and the call goes on to its admission, answered as any call in a Redis outage if Redis
    still fails there. It raised: the call and every call waiting on the rebuild failed (503) with the counter written."""
    try:
        with _until(time.monotonic() + LIMITS_AGAIN_MAX_S):
            if api_key_id is None:
                refresh_limits(BillingAccount.objects.for_organization(organization_id), credit=False)
            else:
                refresh_key_cap(organization_id, api_key_id)
    except REFRESH_FAILURES as exc:
        logger.warning("organisation %s: its limits are not read again under its lock (%s); the rebuilt ones stand "
                       "until the next review", organization_id, type(exc).__name__)
