"""Usage rows replayed from the journal into the ledger, counted in the quota counters that do not count them yet.

A call whose row went to the usage journal (`billing.usage_journal`: the ledger refused it) is settled as any, into
the counters that exist then (`counters.SETTLE`), and marks each one it was added to as counting it (`j:<request id>`
in a period counter, its id in the credit figure's `credit_journaled_key`). A counter Redis lost meanwhile (a flush,
a restart, an expired credit figure) was rebuilt from a ledger without the row: only its replay can teach it. So once
a replay writes rows (the gateway's writer, the worker's replay of shipped segments), each is counted here, once:

- in each of its counters that exists and is not marked for it: a counter rebuilt since its settlement, or one that
  existed when it settled and was not marked (its settlement found none and adds nothing);
- in none that is marked for it (its settlement counted it there: the mark is dropped), nor in one that does not
  exist (rebuilt from the ledger, which has the row now);
- its settled marker is set for a day: a call replayed before its own settlement (the gateway's replay runs
  beside its calls) is then settled as one counted already, its hold released and nothing added.

A row written again (a second replay, a segment replayed from the bucket after the pod replayed it) writes nothing,
and is not counted again: only the request ids a replay wrote now come here.

NOTE: before, the replay wrote the ledger and told no counter: one rebuilt while rows waited in the journal never
counted them, for the rest of the month (the credit figure: until it expired), and caps, the limit without a payment
method and prepaid credit admitted that much more. Left open, each a window of one round trip between a replay's
commit and its count here: a counter rebuilt from a ledger read after the commit and written before the count counts
the row twice; one read before the commit and written after the count lacks it; a replayer killed there counts it
nowhere. Each holds until the counter is next rebuilt.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from decimal import Decimal

from django.db import close_old_connections

from billing.models import BillingMode, UsageRecord
from billing.periods import period_containing
from billing.quota.counters import SETTLED_MARKER_TTL_S, to_units
from controlplane.redis_keys import (
    credit_journaled_key,
    credit_key,
    key_period_key,
    org_period_key,
    reservations_key,
    settled_key,
)
from controlplane.redis_scripts import Script

logger = logging.getLogger("inferplane.billing")

# KEYS: the settled marker, the org period counter, the key period counter, the credit figure, the journaled calls the
# figure counted; ARGV: request id, cost (units), has key (1/0), draws credit (1/0), marker ttl.
_COUNT_REPLAYED = Script("""
redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[5])
local field = 'j:' .. ARGV[1]
local function count(counter)
  if redis.call('EXISTS', counter) == 1 and redis.call('HDEL', counter, field) == 0 then
    redis.call('HINCRBY', counter, 'spent', ARGV[2])
  end
end
count(KEYS[2])
if ARGV[3] == '1' then count(KEYS[3]) end
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[4]) == 1 and redis.call('HDEL', KEYS[5], ARGV[1]) == 0 then
  redis.call('DECRBY', KEYS[4], ARGV[2])
end
return 1
""")


def count_replayed(request_ids: Collection[str]) -> int:
    """Count the rows of `request_ids`, just written into the ledger by a replay of the journal, in the quota counters
    that lack them; returns how many rows. Blocking I/O (the ORM, Redis)."""
    if not request_ids:
        return 0
    close_old_connections()
    rows = UsageRecord.objects.filter(request_id__in=list(request_ids)).values_list(
        "request_id", "organization_id", "api_key_id", "cost", "finished_at", "billing_mode")
    num_counted = 0
    for request_id, organization_id, api_key_id, cost, finished_at, billing_mode in rows:
        period_key = period_containing(finished_at).key
        _COUNT_REPLAYED.run_sync(
            keys=[settled_key(organization_id, request_id), org_period_key(organization_id, period_key),
                  key_period_key(organization_id, api_key_id, period_key), credit_key(organization_id),
                  credit_journaled_key(organization_id)],
            args=[request_id, str(to_units(cost)), "1" if api_key_id is not None else "0",
                  "1" if billing_mode == BillingMode.PREPAID else "0", str(SETTLED_MARKER_TTL_S)])
        num_counted += 1
    return num_counted


# KEYS: the settled marker, the org period counter, the key period counter, the credit figure, the journaled calls the
# figure counted, the reservations; ARGV: request id, cost (units), the difference from the lost row's cost (units),
# has key (1/0), draws credit (1/0), marker ttl.
_COUNT_SUPERSEDED = Script("""
local amount = ARGV[3]
if redis.call('HEXISTS', KEYS[6], ARGV[1]) == 1 and redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[6]) then
  amount = ARGV[2]
end
local field = 'j:' .. ARGV[1]
local function count(counter)
  if redis.call('EXISTS', counter) == 1 and redis.call('HDEL', counter, field) == 0 then
    redis.call('HINCRBY', counter, 'spent', amount)
  end
end
count(KEYS[2])
if ARGV[4] == '1' then count(KEYS[3]) end
if ARGV[5] == '1' and redis.call('EXISTS', KEYS[4]) == 1 and redis.call('HDEL', KEYS[5], ARGV[1]) == 0 then
  redis.call('DECRBY', KEYS[4], amount)
end
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

    NOTE: left open, a window of one round trip: a sweeper that settles the row after the superseding commit and before
    this count settles the call's own cost, and this adds the difference again."""
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
                  credit_journaled_key(organization_id), reservations_key(organization_id)],
            args=[request_id, str(units), str(units - to_units(lost_costs[request_id])),
                  "1" if api_key_id is not None else "0", "1" if billing_mode == BillingMode.PREPAID else "0",
                  str(SETTLED_MARKER_TTL_S)])
        num_counted += 1
    return num_counted
