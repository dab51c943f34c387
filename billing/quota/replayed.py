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

NOTE: left open, a replayer killed between its commit and its count (or an INSERT cut short by its timeout that
commits after): its rows are counted in no counter that existed then, until each is next rebuilt (a counter rebuilt
while their registration lasts, `REGISTRATION_TTL_S`, counts them, marked). A count later than that (an INSERT that
took minutes) may count a row twice in a counter rebuilt after the registration lapsed.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from decimal import Decimal

from django.db import close_old_connections

from billing.ledger import UsageReport
from billing.models import BillingMode, UsageRecord
from billing.periods import period_containing
from billing.quota.counters import SETTLED_MARKER_TTL_S, to_units
from controlplane.redis_client import get_redis
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
# bounded by `usage_writer.WRITE_TIMEOUT_S`).
REGISTRATION_TTL_S = 300
MISSED_PREFIX = "m:"  # `rebuilding_key`'s fields of costs counts could not add: m:<counter key>|<request id>
REBUILDING_PREFIX = "c:"  # and of rebuilds under way: c:<counter key> -> until when

# KEYS: the organisation's registrations; ARGV: their ttl (s), then each request id.
_REGISTER = Script("""
local deadline = tonumber(redis.call('TIME')[1]) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('HSET', KEYS[1], ARGV[i], deadline) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return #ARGV - 1
""")

# KEYS: the credit figure, the journaled calls the figure counted, the rebuilds under way, the registrations, then per
# row: its settled marker, its org period counter, its key period counter (the no-key placeholder without a key);
# ARGV: marker ttl, then per row: request id, cost (units), has key (1/0), draws credit (1/0). Returns the rows.
_COUNT_REPLAYED = Script("""
local now = tonumber(redis.call('TIME')[1])
local function missed(counter, request_id, cost)
  local until_s = redis.call('HGET', KEYS[3], 'c:' .. counter)
  if until_s and tonumber(until_s) >= now then
    redis.call('HSET', KEYS[3], 'm:' .. counter .. '|' .. request_id, cost)
  end
end
local function count(counter, request_id, cost)
  if redis.call('EXISTS', counter) == 0 then return missed(counter, request_id, cost) end
  if redis.call('HDEL', counter, 'j:' .. request_id) == 0 then redis.call('HINCRBY', counter, 'spent', cost) end
end
local num_rows = (#ARGV - 1) / 4
for n = 0, num_rows - 1 do
  local request_id, cost = ARGV[2 + 4 * n], ARGV[3 + 4 * n]
  redis.call('SET', KEYS[5 + 3 * n], '1', 'NX', 'EX', ARGV[1])
  count(KEYS[6 + 3 * n], request_id, cost)
  if ARGV[4 + 4 * n] == '1' then count(KEYS[7 + 3 * n], request_id, cost) end
  if ARGV[5 + 4 * n] == '1' then
    if redis.call('EXISTS', KEYS[1]) == 0 then
      missed(KEYS[1], request_id, cost)
    elseif redis.call('HDEL', KEYS[2], request_id) == 0 then
      redis.call('DECRBY', KEYS[1], cost)
    end
  end
  redis.call('HDEL', KEYS[4], request_id)
end
return num_rows
""")


def _registrations(reports: Iterable[UsageReport]) -> list[tuple[list[str], list[str]]]:
    """`_REGISTER`'s keys and arguments, one call per organisation."""
    by_organization: dict[int, list[str]] = defaultdict(list)
    for report in reports:
        by_organization[report.organization_id].append(report.request_id)
    return [([replaying_key(organization_id)], [str(REGISTRATION_TTL_S), *request_ids])
            for organization_id, request_ids in by_organization.items()]


async def register_replaying(reports: Collection[UsageReport]) -> None:
    """Step 1 of a replay, before `reports` are written into the ledger (see the module's docstring); so too before a
    write's rows not written now may supersede lost rows (`count_superseded`)."""
    for keys, args in _registrations(reports):
        await _REGISTER(keys=keys, args=args)


def register_replaying_sync(reports: Collection[UsageReport]) -> None:
    """`register_replaying` from synchronous code (the worker's replay of shipped segments)."""
    for keys, args in _registrations(reports):
        _REGISTER.run_sync(keys=keys, args=args)


def count_replayed(request_ids: Collection[str]) -> int:
    """Count the rows of `request_ids`, just written into the ledger by a replay of the journal, in the quota counters
    that lack them; returns how many rows. One query, and one script per organisation. Blocking I/O (the ORM, Redis)."""
    if not request_ids:
        return 0
    close_old_connections()
    rows = UsageRecord.objects.filter(request_id__in=list(request_ids)).values_list(
        "request_id", "organization_id", "api_key_id", "cost", "finished_at", "billing_mode")
    calls: dict[int, tuple[list[str], list[str]]] = {}
    for request_id, organization_id, api_key_id, cost, finished_at, billing_mode in rows:
        if organization_id not in calls:
            calls[organization_id] = ([credit_key(organization_id), credit_journaled_key(organization_id),
                                       rebuilding_key(organization_id), replaying_key(organization_id)],
                                      [str(SETTLED_MARKER_TTL_S)])
        keys, args = calls[organization_id]
        period_key = period_containing(finished_at).key
        keys += [settled_key(organization_id, request_id), org_period_key(organization_id, period_key),
                 key_period_key(organization_id, api_key_id, period_key)]
        args += [request_id, str(to_units(cost)), "1" if api_key_id is not None else "0",
                 "1" if billing_mode == BillingMode.PREPAID else "0"]
    return sum(_COUNT_REPLAYED.run_sync(keys=keys, args=args) for keys, args in calls.values())


# KEYS: the settled marker, the org period counter, the key period counter, the credit figure, the journaled calls the
# figure counted, the reservations, the rebuilds under way, the registrations; ARGV: request id, cost (units), the
# difference from the lost row's cost (units), has key (1/0), draws credit (1/0), marker ttl. A counter missing is
# left the difference if it is being rebuilt (as `_COUNT_REPLAYED` leaves the cost): its rebuild's snapshot has the
# row as lost or whole, so the difference is all it may lack.
_COUNT_SUPERSEDED = Script("""
local now = tonumber(redis.call('TIME')[1])
local amount = ARGV[3]
if redis.call('HEXISTS', KEYS[6], ARGV[1]) == 1 and redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[6]) then
  amount = ARGV[2]
end
local function missed(counter)
  local until_s = redis.call('HGET', KEYS[7], 'c:' .. counter)
  if until_s and tonumber(until_s) >= now then
    redis.call('HSET', KEYS[7], 'm:' .. counter .. '|' .. ARGV[1], ARGV[3])
  end
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
redis.call('HDEL', KEYS[8], ARGV[1])
return 1
""")


def count_superseded(lost_costs: Mapping[str, Decimal]) -> int:
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

    NOTE: the sweeper leaves a registered row's call to this count (`sweeper._counted_later`): settled after the
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
        _COUNT_SUPERSEDED.run_sync(
            keys=[settled_key(organization_id, request_id), org_period_key(organization_id, period_key),
                  key_period_key(organization_id, api_key_id, period_key), credit_key(organization_id),
                  credit_journaled_key(organization_id), reservations_key(organization_id),
                  rebuilding_key(organization_id), replaying_key(organization_id)],
            args=[request_id, str(units), str(units - to_units(lost_costs[request_id])),
                  "1" if api_key_id is not None else "0", "1" if billing_mode == BillingMode.PREPAID else "0",
                  str(SETTLED_MARKER_TTL_S)])
        num_counted += 1
    return num_counted


def replays_to_ask_about(organization_id: int, counter_key: str) -> set[str]:
    """The request ids a rebuild of `counter_key` must ask its ledger snapshot about, read after it took it: the rows
    a replay registered (written, or about to be, and not counted yet), and those whose count found the counter
    missing while it was being rebuilt. Blocking I/O (Redis)."""
    pipeline = get_redis().pipeline(transaction=False)
    pipeline.hkeys(replaying_key(organization_id))
    pipeline.hkeys(rebuilding_key(organization_id))
    registered, rebuilding = pipeline.execute()
    prefix = f"{MISSED_PREFIX}{counter_key}|"
    return {_text(request_id) for request_id in registered} | {
        _text(field)[len(prefix):] for field in rebuilding if _text(field).startswith(prefix)}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
