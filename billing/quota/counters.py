"""The quota's Redis keys and Lua parts: reserve a request's largest cost, settle its real one.

`RESERVE` and `SETTLE` are parts of the gateway's admission and finish scripts
(`endpoints/gateway/admission.py`); `prepare_reservation` and `settle_keys_and_args` give their keys
and arguments. `refresh_limits` makes Redis see a changed cap, billing mode or credit grant at once.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_CEILING, ROUND_HALF_UP, Decimal

from django.conf import settings
from django.db import transaction

from billing.ledger import UsageReport
from billing.models import MONEY_QUANTUM, ApiKeySpendCap, BillingAccount, BillingMode
from billing.periods import Period, period_containing, periods_near
from billing.standing import CardSpend, bills_through_stripe, hold_reason, spend_limit
from billing.usage_journal import encode
from controlplane import clock
from controlplane.accounts.models import ApiKey
from controlplane.hot_settings import hot
from controlplane.redis_client import as_text, get_redis
from controlplane.redis_keys import (
    credit_journaled_key,
    credit_key,
    deadlines_key,
    held_again_key,
    key_period_key,
    key_reserved_key,
    org_period_key,
    org_reserved_key,
    progress_key,
    rebuilding_key,
    reservations_key,
    settled_key,
)
from controlplane.redis_scripts import Script
from controlplane.script_parts import ScriptPart

UNITS_PER_DOLLAR = 10**9
PERIOD_TTL_S = 40 * 86_400
SETTLED_MARKER_TTL_S = 86_400
CALL_SETTLED_MARKER_TTL_S = 300  # a gateway call's own id (`SETTLE_LUA`)


class QuotaExceeded(Exception):
    """The request may cost more than the cap or credit left, or the organisation is past due
    (`billing.standing`). The gateway answers 402 insufficient_quota."""

    code = "insufficient_quota"

    def __init__(self, reason: str):
        self.reason = reason
        self.message = {
            "org_cap": "Your organisation has reached its monthly spend cap. Raise it in the console to continue.",
            "key_cap": "This API key has reached its monthly spend cap.",
            "credit": "Your prepaid credit balance is too low for this request. Add credit to continue.",
            "payment_method": (
                f"Your organisation has reached the ${settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD:,.2f} a month that "
                "accounts without a payment method may spend; what the other organisations of its owners spent "
                "without one this month counts too. Add one in the console (Billing) to continue."),
            "spend_ceiling": (
                "Your organisation has reached its monthly spending ceiling for its payment history: new accounts "
                "may spend a bounded amount a month, and the ceiling rises as invoices are paid (Billing in the "
                "console shows it and the next step). Where other organisations have the same card on file, what "
                "they spent this month counts against it too. To raise it sooner, contact support."),
            "spend_ceiling_staff": (
                "Your organisation has reached the monthly spending ceiling set for it by Inferplane staff. Contact "
                "support to change it."),
            "past_due": "Your organisation has an unpaid invoice. Pay it in the console (Billing) to continue.",
            "disputed": (
                "A payment of your organisation is disputed with its card's bank (a chargeback). If that was a "
                "mistake, ask the bank to withdraw the dispute; otherwise contact us to settle the payment. Calls "
                "resume once it is settled."),
        }.get(reason, "You exceeded your current quota.")
        super().__init__(self.message)


@dataclass(slots=True, frozen=True)
class Reservation:
    request_id: str
    organization_id: int
    api_key_id: int | None
    amount: Decimal
    period_key: str

    def __post_init__(self) -> None:
        if self.amount < 0:
            raise ValueError("a reservation cannot be negative")


def to_units(amount: Decimal, rounding=ROUND_HALF_UP) -> int:
    return int((amount * UNITS_PER_DOLLAR).to_integral_value(rounding=rounding))


def from_units(units: int) -> Decimal:
    return (Decimal(units) / UNITS_PER_DOLLAR).quantize(MONEY_QUANTUM)


# --- Redis scripts (key names: `controlplane.redis_keys`, all in the organisation's slot) ------------

# The checks and holds of one reservation, as a Lua function of `RESERVE`'s keys and arguments.
# Returns {'ok', 'new'|'existing', billing mode}, {'refused', reason} or {'missing', what}; only 'ok' changes anything.
# The billing mode ('prepaid' or 'postpaid', `BillingMode`'s values) is the one the call is admitted under, read from
# the counter the checks read: its usage row is billed in it (`billing.ledger.UsageReport.billing_mode`), whatever
# the mode is when the row is written.
# An organisation counter whose limits were worked out under other rules (`lv`, the limits version:
# written by an older version, or before the limit without a payment method or Stripe's set-up changed)
# has its 'limits' missing: they are written again from the account, its spend kept. A version of '*'
# takes the limits as they stand (`rebuild.rebuild_missing`: another version wrote them moments ago).
# A call refused for the organisation's limit marks the counter `reached` with the cap it was refused at (its limits
# written again clear it: `limit_fields`): the spend stops short of the limit, by what the refused calls' worst case did
# not fit, and the spend alert at 100 % is sent on this mark while the counter's cap is still that one
# (`billing.alerts.check_spend_alerts`, `limit_reached`). NOTE: judged by the spend alone, it never went out while every
# call was refused. NOTE: the mark is written only when it is not there yet: written on every refusal, a client
# retrying its 402 in a loop made each one a write, to the AOF and every replica; and a mark of '1', which a pod of the
# release before never cleared when it wrote the limits (a cap raised on it), told of the new cap that it was reached.
RESERVE_LUA = """
local function quota_reserve(K, A)
  local org = redis.call('HMGET', K[1], 'lv', 'prepaid', 'hold', 'cap', 'capr', 'spent')
  if not org[1] and redis.call('EXISTS', K[1]) == 0 then return {'missing', 'org'} end
  if A[6] ~= '*' and org[1] ~= A[6] then return {'missing', 'limits'} end
  local has_key = A[4] == '1'
  local key
  if has_key then
    key = redis.call('HMGET', K[3], 'cap', 'spent')
    if not key[1] and redis.call('EXISTS', K[3]) == 0 then return {'missing', 'key'} end
  end
  local prepaid = org[2] == '1'
  local credit
  if prepaid then
    credit = redis.call('GET', K[5])
    if not credit then return {'missing', 'credit'} end
  end
  local mode = prepaid and 'prepaid' or 'postpaid'
  if redis.call('HEXISTS', K[6], A[1]) == 1 then return {'ok', 'existing', mode} end
  if org[3] and org[3] ~= '' then return {'refused', org[3]} end
  local amount = tonumber(A[2])
  local org_reserved = tonumber(redis.call('GET', K[2]) or '0')
  local cap = tonumber(org[4])
  if cap >= 0 and tonumber(org[6]) + org_reserved + amount > cap then
    -- the spend alert's 100 % (`billing.alerts`): the cap it was reached at, written once per limit; a failure to
    -- write it (Redis at its memory limit) leaves the refusal a refusal
    if redis.call('HGET', K[1], 'reached') ~= org[4] then redis.pcall('HSET', K[1], 'reached', org[4]) end
    return {'refused', org[5]}
  end
  if has_key then
    local key_cap = tonumber(key[1])
    if key_cap >= 0 and tonumber(key[2]) + tonumber(redis.call('GET', K[4]) or '0') + amount > key_cap then
      return {'refused', 'key_cap'}
    end
  end
  if prepaid and tonumber(credit) - org_reserved - amount < 0 then
    return {'refused', 'credit'}
  end
  redis.call('INCRBY', K[2], A[2])
  if has_key then redis.call('INCRBY', K[4], A[2]) end
  redis.call('HSET', K[6], A[1], A[5])
  -- NOTE: the deadline on Redis's clock, which the sweeper reads too (`sweeper`), never the gateway's
  redis.call('ZADD', K[7], tonumber(redis.call('TIME')[1]) + 1 + tonumber(A[3]), A[1])
  return {'ok', 'new', mode}
end
"""

RESERVE = ScriptPart(
    "quota_reserve",
    keys=("org period", "org reserved", "key period", "key reserved", "credit", "reservations", "deadlines"),
    args=("request id", "amount (units)", "seconds it holds (its deadline: Redis's clock plus these)", "has key (1/0)",
          "payload", "limits version"), lua=RESERVE_LUA)

# A reserved counter less a reservation's amount, never below zero: one it would take below (a counter Redis
# lost, or one rebuilt since) is no key, as a counter never written (read as zero). Used by `SETTLE` and the
# sweeper's release of expired reservations.
UNRESERVE_LUA = """
local function quota_unreserve(key, amount)
  if redis.call('DECRBY', key, amount) < 0 then redis.call('DEL', key) end
end
"""

# A count that found a counter missing while it is rebuilt (the rebuilds under way have `c:<counter>`, until when: the
# rebuild's window, `rebuild._BEGIN_REBUILD`) leaves the rebuild its cost as `m:<counter>|<request id>`: the rebuild
# adds it unless its snapshot of the ledger has the row (`rebuild.REPLAYED_ROWS_LUA`). Used by `SETTLE` and the
# journal's replays (`replayed`). NOTE: a call settled while its counter was rebuilt, its row committed after the
# rebuild's snapshot, was counted nowhere: spend past the cap and the prepaid credit.
# A superseded row's difference (`replayed.count_superseded`, `kind` 'd:') is told apart, `d:<counter>|<request id>`:
# the rebuild adds it unless its snapshot holds the row superseded. NOTE: both were `m:`, and the lost row's
# settlement and the supersede of the same call in one rebuild wrote one field: the second overwrote the first, and
# one cost was counted nowhere ($0.36 or $0.14 counted for $0.50).
# A settlement that found no hold (`marks`: the counter's calls held again, `held_again_key`) also marks its call for
# the rebuild, as one held again: the rebuild asks its snapshot about it, or begins again if it read the marks before
# (`rebuild.HELD_AGAIN_LUA`). NOTE: a call whose hold Redis lost before the rebuild began (not among the calls reserved
# then), its row in the snapshot, settled after the rebuild read which `m:` to ask about: its `m:` was added on top of
# the snapshot that had the row, counted twice.
MISSED_LUA = """
local function quota_missed(rebuilding, counter, request_id, cost, kind, marks)
  local until_s = redis.call('HGET', rebuilding, 'c:' .. counter)
  if until_s and tonumber(until_s) >= tonumber(redis.call('TIME')[1]) then
    redis.call('HSET', rebuilding, (kind or 'm:') .. counter .. '|' .. request_id, cost)
    if marks then
      redis.call('SADD', marks, request_id)
      local ttl = redis.call('TTL', rebuilding)
      if ttl > 0 then redis.call('EXPIRE', marks, ttl) end
    end
  end
end
"""

# Replaces a reservation by the real cost, never more than the reservation, once per request id: the first
# settlement leaves a settled marker (`settled_key`); one that finds it releases its hold and adds no spend.
# The hold is released from the reserved sums (one per organisation and key, for every period); the spend goes to the
# period counters of the month the ledger bills the call in (its row's `finished_at`: `settle_keys_and_args`), which
# is not the month it was reserved in for a call that runs past midnight at a month's end.
# The marker lives as long as a second settlement can come:
# - a day (`SETTLED_MARKER_TTL_S`) for a request id that recurs (a batch line, run again under its id after a
#   crash: its second usage row is a no-op) and for the sweeper's settlement (`billing.quota.sweeper`);
# - minutes (`CALL_SETTLED_MARKER_TTL_S`) for a gateway call's own random id, settled by its end: long enough
#   for a resend of the same finish script (a client retrying after a lost reply) and for the sweeper racing
#   the call's own settlement. A call that outlived its reservation's deadline had its hold released by the
#   sweeper without a marker, so its late settlement counts its spend.
# A settlement that finds its hold gone and no marker more than a sweeper's marker lives past its deadline (`lapsed_at`
# plus `SETTLED_MARKER_TTL_S`: its gateway froze that long) cannot tell whether the sweeper released the hold (nothing
# counted) or settled it (counted, its marker expired since): it counts nothing and drops the counters it would have
# counted in, which the next call rebuilds from the ledger (its row is there, once; a journaled one is counted by its
# replay). Before that, no marker means the sweeper released the hold unbilled: it counts as any settlement.
# NOTE: it counted its cost, again after the sweeper's settlement, once a gateway woke from a freeze over a day; and
#   then (past its deadline alone) counted nothing for a call the sweeper had released unbilled minutes before.
#   NOTE: a day's marker per call was ~86 million keys (~9–11 GB of Redis) a day at 1,000 requests a second,
#   each also in every snapshot and append-only rewrite; minutes' is ~300,000.
# - none (a ttl of 0) for a try that recorded nothing (no ledger row: never served, or a batch line's try that
#   failed with nothing counted): its settlement adds no spend, and a batch line's next try under the same id
#   must settle its own. NOTE: the day's marker of such a try made the retry that succeeded add nothing to the
#   organisation's spend in Redis (its ledger row was written): caps and prepaid credit lagged the ledger.
# - a day, whatever its id, for a call whose row went to the usage journal (`journaled`): its replay, which may come
#   after minutes of outage, finds it (`billing.quota.replayed`).
# A settlement with no hold and no marker (Redis lost the hold, or the sweeper released it unbilled) of a row in the
# ledger cannot tell whether a counter rebuilt since its call was last known held (its `rb`, when its rebuild began, at
# or after `held since`; the credit figure's `@rb`, in its journaled calls) has the row in its snapshot: that rebuild
# did not find the call reserved, so left nothing out for it. It drops that counter rather than add, and the next call
# rebuilds it from the ledger (the row there, once).
# While the counter is rebuilt, it marks the call for the rebuild (`quota_missed`).
# NOTE: such a call settled after the rebuild wrote its counter added its cost to a snapshot that had it: counted
# twice, until the counter was next lost.
SETTLE_LUA = UNRESERVE_LUA + MISSED_LUA + """
local function quota_settle(K, A)
  local first = true
  if A[4] ~= '0' then first = redis.call('SET', K[3], '1', 'NX', 'EX', A[4]) end
  local has_key = A[3] == '1'
  local actual = A[2]
  local payload = redis.call('HGET', K[1], A[1])
  if payload then
    local amount = cjson.decode(payload)['a']
    if tonumber(actual) > tonumber(amount) then actual = amount end
    quota_unreserve(K[5], amount)
    if has_key then quota_unreserve(K[7], amount) end
    redis.call('HDEL', K[1], A[1])
    redis.call('ZREM', K[2], A[1])
  end
  redis.call('HDEL', K[10], A[1])  -- its progress (`record_progress`): the call is over
  if not first then return 0 end
  if not payload and A[4] ~= '0' and A[7] ~= '' and tonumber(redis.call('TIME')[1]) > tonumber(A[7]) then
    redis.call('DEL', K[4])
    if has_key then redis.call('DEL', K[6]) end
    if A[5] == '1' then redis.call('DEL', K[8], K[9]) end
    return 2
  end
  -- A missing counter is rebuilt from the ledger, which has this call's row (written before); one rebuilt while the
  -- call was still reserved and unsettled left its cost out for this settlement to add (`rebuild`). One being rebuilt
  -- now may have read its snapshot before the row: it is told the cost (`quota_missed`), and adds it unless its
  -- snapshot has the row. A row in the journal is in no ledger yet: each counter this adds it to says so
  -- (`replayed`), its replay adds it to the others (and tells a rebuild under way).
  local journaled = A[6] == '1'
  local field = 'j:' .. A[1]
  local unheld = not payload and A[4] ~= '0' and not journaled  -- its row in the ledger, maybe in a rebuild's snapshot
  local function rebuilt_since_held(counter, field)
    if not unheld or A[8] == '' then return false end
    local began = redis.call('HGET', counter, field or 'rb')
    return began ~= false and tonumber(began) >= tonumber(A[8])
  end
  local unheld_marks = function(marks) if unheld then return marks end end
  if rebuilt_since_held(K[4]) then
    redis.call('DEL', K[4])
  elseif redis.call('EXISTS', K[4]) == 1 then
    redis.call('HINCRBY', K[4], 'spent', actual)
    if journaled then redis.call('HSET', K[4], field, '1') end
  elseif not journaled then
    quota_missed(K[11], K[4], A[1], actual, nil, unheld_marks(K[12]))
  end
  if has_key and rebuilt_since_held(K[6]) then
    redis.call('DEL', K[6])
  elseif has_key and redis.call('EXISTS', K[6]) == 1 then
    redis.call('HINCRBY', K[6], 'spent', actual)
    if journaled then redis.call('HSET', K[6], field, '1') end
  elseif has_key and not journaled then
    quota_missed(K[11], K[6], A[1], actual, nil, unheld_marks(K[13]))
  end
  if A[5] == '1' and rebuilt_since_held(K[9], '@rb') then
    redis.call('DEL', K[8], K[9])
  elseif A[5] == '1' and redis.call('EXISTS', K[8]) == 1 then
    redis.call('DECRBY', K[8], actual)
    if journaled then
      redis.call('HSET', K[9], A[1], '1')
      local ttl = redis.call('PTTL', K[8])
      if ttl > 0 then redis.call('PEXPIRE', K[9], ttl) end
    end
  elseif A[5] == '1' and not journaled then
    quota_missed(K[11], K[8], A[1], actual, nil, unheld_marks(K[14]))
  end
  return 1
end
"""

SETTLE = ScriptPart(
    "quota_settle",
    keys=("reservations", "deadlines", "settled marker", "org period", "org reserved", "key period",
          "key reserved", "credit", "credit journaled", "progress", "rebuilds under way",
          "calls held again while the org period was rebuilt", "those while the key period was",
          "those while the credit was"),
    args=("request id", "actual (units)", "has key (1/0)", "marker ttl", "draws credit (1/0)", "journaled (1/0)",
          "when it can no longer tell whether the sweeper counted it (Redis's clock, s; empty: not known)",
          "since when its hold is not known held (Redis's clock, s; empty: not known)"),
    lua=SETTLE_LUA)

# KEYS: a hash; ARGV: field/value pairs. Changes the hash only if it exists.
_UPDATE_HASH = Script("""
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
""")


# NOTE: the keys and the payload's fixed part depend only on the caller and the month: built once, not
# on every request (they were a few percent of the gateway's CPU per request).
PREPARED_MAX = 4096


@functools.lru_cache(maxsize=PREPARED_MAX)
def _prepared(organization_id: int, api_key_id: int | None, period_key: str) -> tuple[tuple[str, ...], tuple[str, ...], str, str]:
    """`RESERVE`'s keys, `SETTLE`'s keys but the settled marker, and the reservation payload's JSON
    around its amount (`json.dumps` of `{"o", "k", "a", "p"}`, cut where the amount goes)."""
    reserve = (
        org_period_key(organization_id, period_key), org_reserved_key(organization_id),
        key_period_key(organization_id, api_key_id, period_key), key_reserved_key(organization_id, api_key_id),
        credit_key(organization_id), reservations_key(organization_id), deadlines_key(organization_id),
    )
    settle = (
        reservations_key(organization_id), deadlines_key(organization_id),
        org_period_key(organization_id, period_key), org_reserved_key(organization_id),
        key_period_key(organization_id, api_key_id, period_key), key_reserved_key(organization_id, api_key_id),
        credit_key(organization_id), credit_journaled_key(organization_id), progress_key(organization_id),
        rebuilding_key(organization_id), held_again_key(org_period_key(organization_id, period_key)),
        held_again_key(key_period_key(organization_id, api_key_id, period_key)),
        held_again_key(credit_key(organization_id)),
    )
    before, _, after = json.dumps({"o": organization_id, "k": api_key_id, "a": "#", "p": period_key}).partition('"#"')
    return reserve, settle, before + '"', '"' + after


def prepare_reservation(*, organization_id: int, api_key_id: int | None, amount: Decimal, request_id: str,
                        any_limits: bool = False) -> tuple[Reservation, tuple[str, ...], list[str]]:
    """A reservation and the keys and arguments of `RESERVE` that hold it; with `any_limits`, held
    under the organisation counter's limits whatever version wrote them.

    NOTE: in the month of Redis's clock (`clock.redis_datetime`, the gateway's offset: no round trip), which the call's
    usage row is stamped by and settles in (`settle_keys_and_args`). By the gateway's own clock, one 10 minutes ahead
    reserved in the new month's counter (nothing spent) at a month's end, and admitted a tenant past the old month's
    cap, where its calls then settled; one behind refused it (402) for 10 minutes of the new month."""
    period = period_containing(clock.redis_datetime())
    reservation = Reservation(request_id, organization_id, api_key_id, amount, period.key)
    units = to_units(amount, ROUND_CEILING)
    keys, _, payload_before, payload_after = _prepared(organization_id, api_key_id, period.key)
    args = [request_id, str(units), str(math.ceil(hot.BILLING_RESERVATION_TTL_S)), "1" if api_key_id is not None else "0",
            f"{payload_before}{units}{payload_after}", "*" if any_limits else limits_version()]
    return reservation, keys, args


# Puts back the reservations of calls a live gateway still serves after Redis lost them (a restart without persistence,
# a flush, a failover: `endpoints.gateway.presence`), as `RESERVE` held them. KEYS: the reservations, the deadlines,
# the organisation's reserved sum, the rebuilds under way, the calls held again while the organisation counter was
# rebuilt, those while the credit figure was (`held_again_key`), the organisation counter (the month's: what the calls'
# settlements count in), the credit figure, its journaled calls, then per call: its key's reserved sum (the
# organisation's again for a call without a key), its settled marker, the calls held again while its key's counter was
# rebuilt and that counter (the organisation counter's, and the organisation counter, without a key). ARGV: the seconds
# a reservation holds (its deadline: Redis's clock plus these), then per call: request id, amount (units), has key
# (1/0), payload, when it can no longer tell whether the sweeper counted it (Redis's clock, s; empty: not known), since
# when it is not known held (`_held_since`; empty: not known), whether its gateway is writing its usage row (1/0).
# A reservation still there (Redis forgot only the gateway's own keys), one whose call settled meanwhile (its marker:
# the sweeper's settlement too, a day), or one past that (its gateway froze longer than the sweeper's marker lives,
# `SETTLE_LUA`) is left. One the sweeper released unbilled (no marker) is held again: its call still runs.
# NOTE: a gateway woken from a freeze longer than the sweeper's marker lives held its swept calls again, and their
# settlement then counted their cost a second time; and, kept from holding any call past its deadline, it ran one the
# sweeper had released minutes before unheld: a second call was admitted past the cap beside it.
# A call held again while a counter it counts in is rebuilt (`c:<counter>` in the rebuilds under way, within its
# window) is marked for that rebuild, in the counter's set (`held_again_key`): it was not among the calls reserved when
# the rebuild began, and its row may be in the rebuild's snapshot (`rebuild.HELD_AGAIN_LUA`). The sets last as long as
# the rebuilds under way.
# For a call whose usage row may be in the ledger (its gateway is writing it; or its hold may have lapsed: Redis's clock
# is past a reservation's time after "since when", and the sweeper may have written a `gateway_lost` row for it), a
# counter it counts in that was rebuilt since the call was last known held and is written already (its `rb`, the
# credit figure's `@rb`: `rebuild._INIT_SPEND`) is dropped, as a settlement with no hold drops it (`SETTLE_LUA`): that
# rebuild did not find the call reserved and may have its row, and the call, held again, settles as one that held all
# along. The next call rebuilds it, with the call reserved. (A call still running within its deadline has no row in
# that snapshot: nothing is dropped for it, so a flush does not have every counter rebuilt twice. One past it that the
# sweeper did not sweep costs an extra rebuild, never money.) NOTE: "may have lapsed" is read on Redis's clock, in the
# script: from "since when" plus a reservation's time, `lapses_at` less `HELD_SINCE_SLACK_S` at most; the sweeper
# takes a hold only once Redis's clock reaches its deadline, a second after `lapses_at` as the gateway's estimate of
# Redis's clock set it, so a swept call is always taken as lapsed while that estimate was off by under 3 s (a skew
# past 2 s is an ERROR: `controlplane.clock`). NOTE: its settlement added its cost to a counter whose
# snapshot had its row (Redis lost the hold after the row was written, a rebuild wrote the counter before the gateway's
# next beat held the call again): counted twice. NOTE: so too a call whose gateway froze past its deadline, swept (a
# `gateway_lost` row, settled), then Redis flushed (the sweeper's marker with it) and a rebuild read that row before
# the woken gateway held the call again (not writing its row yet): its own row superseded the lost one and its
# settlement, finding its hold, added its whole cost to a counter that had the lost row's: 0.000041 for 0.000025.
# NOTE: each call was marked, in the rebuilds' hash, for every counter of its organisation being rebuilt, other keys'
# too, and each rebuild's write read that whole hash: after a flush, 5,000 calls in flight under 20 keys wrote 110,000
# fields in one script, and each write scanned them all (seconds, Redis blocked for every tenant; rebuilds past their
# window, 503s, then 500s).
_RESTORE_RESERVATIONS = Script("""
local restored = 0
local now = tonumber(redis.call('TIME')[1])
local deadline = now + 1 + tonumber(ARGV[1])
local rebuilt, marked = {}, {}
local function mark(counter, marks, request_id)
  if rebuilt[counter] == nil then
    rebuilt[counter] = tonumber(redis.call('HGET', KEYS[4], 'c:' .. counter) or '0') >= now
  end
  if rebuilt[counter] then
    redis.call('SADD', marks, request_id)
    marked[marks] = true
  end
end
local function drop_rebuilt_since(since, began_in, began_field, ...)
  if since == '' then return end
  local began = redis.call('HGET', began_in, began_field)
  if began and tonumber(began) >= tonumber(since) then redis.call('DEL', ...) end
end
for i = 2, #ARGV, 7 do
  local n = (i - 2) / 7
  local untold = ARGV[i + 4] ~= '' and now > tonumber(ARGV[i + 4])
  if not untold and redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 and redis.call('EXISTS', KEYS[11 + 4 * n]) == 0 then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 3])
    redis.call('ZADD', KEYS[2], deadline, ARGV[i])
    redis.call('INCRBY', KEYS[3], ARGV[i + 1])
    if ARGV[i + 2] == '1' then redis.call('INCRBY', KEYS[10 + 4 * n], ARGV[i + 1]) end
    restored = restored + 1
    mark(KEYS[7], KEYS[5], ARGV[i])
    mark(KEYS[8], KEYS[6], ARGV[i])
    local since = ARGV[i + 5]
    if since ~= '' and ARGV[i + 6] ~= '1' and now < tonumber(since) + tonumber(ARGV[1]) then since = '' end
    drop_rebuilt_since(since, KEYS[7], 'rb', KEYS[7])
    drop_rebuilt_since(since, KEYS[9], '@rb', KEYS[8], KEYS[9])
    if ARGV[i + 2] == '1' then
      mark(KEYS[13 + 4 * n], KEYS[12 + 4 * n], ARGV[i])
      drop_rebuilt_since(since, KEYS[13 + 4 * n], 'rb', KEYS[13 + 4 * n])
    end
  end
end
local ttl = redis.call('TTL', KEYS[4])
for marks in pairs(marked) do
  if ttl > 0 then redis.call('EXPIRE', marks, ttl) end
end
return restored
""")


async def restore_reservations(organization_id: int, reservations: list[Reservation],
                               lapsed_at: list[float | None] | None = None,
                               rows_written: list[bool] | None = None) -> int:
    """Hold again the reservations of one organisation's calls that are still running, which Redis lost; returns how
    many it held again. Each is held as its admission held it (its amount, its key, its period), with a new deadline,
    unless its marker says it was settled, or more than a marker lives past `lapsed_at` (each one's, Redis's clock:
    when its hold may have lapsed; None: not known): `told_until`. For a call whose usage row may be in the ledger
    already (`rows_written`, each one's: its gateway is writing it; or, Redis's clock past its `lapsed_at`, the
    sweeper's `gateway_lost` row), a counter it counts in rebuilt since it was last known held (`lapsed_at` less a
    reservation's time) is dropped, rebuilt by the next call with it reserved; a call still running within its
    deadline has no row in that rebuild's snapshot, and its settlement adds its cost as any.

    NOTE: without this, a flushed or restarted Redis rebuilt the organisation's counters from the ledger with nothing
    reserved, while its calls then running went on: until they ended, new calls were admitted against the caps and
    prepaid credit those calls still held (a long stream: up to `GATEWAY_MAX_ANSWER_WAIT_S`)."""
    if not reservations:
        return 0
    # NOTE: a call still running settles in this month's counters, not its own; the month by Redis's clock, as its row
    # is stamped (`prepare_reservation`)
    period_key = period_containing(clock.redis_datetime()).key
    org_counter = org_period_key(organization_id, period_key)
    keys = [reservations_key(organization_id), deadlines_key(organization_id), org_reserved_key(organization_id),
            rebuilding_key(organization_id), held_again_key(org_counter), held_again_key(credit_key(organization_id)),
            org_counter, credit_key(organization_id), credit_journaled_key(organization_id)]
    args = [str(math.ceil(settings.BILLING_RESERVATION_TTL_S))]
    for reservation, lapses, row_written in zip(reservations, lapsed_at or [None] * len(reservations),
                                                rows_written or [False] * len(reservations), strict=True):
        if reservation.organization_id != organization_id:
            raise ValueError("one organisation's reservations at a time (one Redis Cluster slot)")
        api_key_id = reservation.api_key_id
        units = to_units(reservation.amount, ROUND_CEILING)
        _, _, payload_before, payload_after = _prepared(organization_id, api_key_id, reservation.period_key)
        key_counter = key_period_key(organization_id, api_key_id, period_key) if api_key_id is not None else org_counter
        keys += [key_reserved_key(organization_id, api_key_id) if api_key_id is not None else keys[2],
                 settled_key(organization_id, reservation.request_id), held_again_key(key_counter), key_counter]
        args += [reservation.request_id, str(units), "1" if api_key_id is not None else "0",
                 f"{payload_before}{units}{payload_after}", _told_until(lapses),
                 _held_since(lapses), "1" if row_written else "0"]
    return await _RESTORE_RESERVATIONS(keys=keys, args=args)


# The usage so far of one organisation's calls still running, written by their gateway's beat so that a gateway lost
# mid-call (killed, OOM) leaves what its calls were already answered: the sweeper writes their usage rows from it when
# their holds lapse (`billing.quota.sweeper`). KEYS: the reservations, the progress. ARGV: the progress's TTL, then per
# call: request id, its report (`usage_journal.encode`).
# NOTE: only for a call still reserved: a beat's write that reaches Redis after its call's settlement (which deletes
# its progress, `SETTLE_LUA`) writes nothing, so a call that ended leaves no progress behind.
_RECORD_PROGRESS = Script("""
local recorded = {}
for i = 2, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
    recorded[#recorded + 1] = ARGV[i]
  end
end
if #recorded > 0 then redis.call('EXPIRE', KEYS[2], ARGV[1]) end
return recorded
""")

# How long a call's progress outlives the organisation's last write of one: its hold lapses a reservation's time
# (`BILLING_RESERVATION_TTL_S`) after its gateway's last beat, and the sweeper may be down for a while past that.
PROGRESS_TTL_S = 86_400


async def record_progress(organization_id: int, reports: list[UsageReport]) -> list[str]:
    """Record the usage so far (`reports`, as their rows would be written now) of one organisation's calls still
    running; returns the request ids of those still reserved, and so recorded. Their settlement deletes them."""
    if not reports:
        return []
    args = [str(PROGRESS_TTL_S)]
    for report in reports:
        if report.organization_id != organization_id:
            raise ValueError("one organisation's calls at a time (one Redis Cluster slot)")
        args += [report.request_id, encode(report).rstrip(b"\n")]
    return list(await _RECORD_PROGRESS(keys=[reservations_key(organization_id), progress_key(organization_id)],
                                       args=args))


# What Redis lost of one organisation's running calls, in one script (`endpoints.gateway.presence`'s reconcile): the
# calls whose reservation it no longer holds, and of the others those whose progress it lost (back a moment in the
# past, it kept the reservation and lost the progress written after). KEYS: the reservations, the progress. ARGV: per
# call: request id, whether its progress was recorded (1/0).
# NOTE: a reservation is found missing here, not only where its gateway put back its request: the put-back's reply
# could be lost (a timeout; redis-py's retry running it again and finding nothing to put back), and Redis could come
# back a moment in the past between the put-back and the hold again (two scripts, a round trip apart). Each left the
# call's entry there, and no later reconcile held its reservation again: it ran unheld against the caps and prepaid
# credit, with no deadline for the sweeper should its gateway die, for as long as it ran (up to 6 h).
_HOLDS_LOST = Script("""
local unreserved, unrecorded = {}, {}
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then
    unreserved[#unreserved + 1] = ARGV[i]
  elseif ARGV[i + 1] == '1' and redis.call('HEXISTS', KEYS[2], ARGV[i]) == 0 then
    unrecorded[#unrecorded + 1] = ARGV[i]
  end
end
return {unreserved, unrecorded}
""")


async def holds_lost(organization_id: int, calls: list[tuple[str, bool]]) -> tuple[list[str], list[str]]:
    """Of one organisation's running calls (`calls`: request id, whether its progress was recorded), those whose
    reservation Redis lost (their gateway holds them again: `restore_reservations`, which leaves one settled or past
    its deadline), and those still reserved whose recorded progress it lost (their gateway records it again:
    `record_progress`)."""
    if not calls:
        return [], []
    args = [item for request_id, recorded in calls for item in (request_id, "1" if recorded else "0")]
    unreserved, unrecorded = await _HOLDS_LOST(keys=[reservations_key(organization_id), progress_key(organization_id)],
                                               args=args)
    return list(unreserved), list(unrecorded)


def refusal(status: str, detail: str) -> QuotaExceeded | None:
    """What an answer of `quota_reserve` means for the caller: None when the reservation holds."""
    if status == "ok":
        return None
    if status == "refused":
        return QuotaExceeded(detail)
    raise ValueError(f"not a final answer: {status} {detail}")


def settle_keys_and_args(reservation: Reservation, actual: Decimal, *, finished_at: datetime | None = None,
                         fresh_id: bool = False, recorded: bool = True, billing_mode: str = BillingMode.PREPAID,
                         journaled: bool = False, lapsed_at: float | None = None) -> tuple[list[str], list[str]]:
    """The keys and arguments of `SETTLE` for replacing `reservation` by `actual`, spent in the period containing
    `finished_at` (the ledger row's: now when None); `fresh_id` when its request id is a gateway call's own, which
    no caller settles again (its marker is kept minutes: see `SETTLE_LUA`); not `recorded` when the try wrote no
    ledger row (no marker: `actual` must then be 0). Prepaid credit is drawn only for a call billed prepaid
    (`billing_mode`, its row's): one admitted postpaid and settled after a switch to prepaid drew credit it never uses.
    `journaled`: its row went to the usage journal, not the ledger (`billing.usage_writer.Recorded.JOURNALED`): the
    counters it is added to are marked as counting it, for its replay (`billing.quota.replayed`). `lapsed_at`: from when
    (Redis's clock) its hold may have lapsed, as its gateway last pushed its deadline (`Held.lapses_at`): a settlement
    more than a marker lives past it (`told_until`) that finds its hold gone and no marker drops its counters rather
    than count (see `SETTLE_LUA`).

    NOTE: the ledger bills a row in the period of its `finished_at` (`billing.ledger.period_spend`), and the
    counters are rebuilt from it: a call reserved on the 31st before midnight and finished after spends in the
    new month's counters, as the ledger bills it. It spent in its reservation's month before, so the new month's
    counters never counted it: its caps and the limit without a payment method held less than was spent."""
    if actual < 0:
        raise ValueError("a cost cannot be negative")
    if not recorded and actual:
        raise ValueError("a try that recorded nothing costs nothing")
    org, key = reservation.organization_id, reservation.api_key_id
    kept = _prepared(org, key, period_containing(finished_at).key)[1]
    keys = [kept[0], kept[1], settled_key(org, reservation.request_id), *kept[2:]]
    has_key = "1" if key is not None else "0"
    marker_ttl_s = 0 if not recorded else CALL_SETTLED_MARKER_TTL_S if fresh_id and not journaled else SETTLED_MARKER_TTL_S
    draws_credit = "1" if billing_mode == BillingMode.PREPAID else "0"
    return keys, [reservation.request_id, str(to_units(actual)), has_key, str(marker_ttl_s), draws_credit,
                  "1" if journaled and recorded else "0", _told_until(lapsed_at), _held_since(lapsed_at)]


def told_until(lapsed_at: float) -> float:
    """Until when (Redis's clock, s) a call whose hold may have lapsed at `lapsed_at` can tell from its settled marker
    whether the sweeper counted it: the sweeper's marker lives a day from its settlement, after the deadline. Before,
    no marker means the sweeper released its hold unbilled: it is held again and counted as any call; after, it is
    neither (`SETTLE_LUA`, `_RESTORE_RESERVATIONS`)."""
    return lapsed_at + SETTLED_MARKER_TTL_S


def _told_until(lapsed_at: float | None) -> str:
    return "" if lapsed_at is None else str(int(told_until(lapsed_at)))


# How far the gateway's estimate of Redis's clock (`clock.redis_now`, behind `lapsed_at`) may be off.
HELD_SINCE_SLACK_S = 2


def _held_since(lapsed_at: float | None) -> str:
    """Since when (Redis's clock, s) a call whose hold may have lapsed at `lapsed_at` is not known held: its admission,
    or the last beat that pushed its deadline on (`lapsed_at` is a reservation's time after it), less a margin. A
    counter whose rebuild began before found it reserved, or was written before it was admitted; one begun since may
    have its row and not it (`SETTLE_LUA`)."""
    if lapsed_at is None:
        return ""
    return str(math.floor(lapsed_at - hot.BILLING_RESERVATION_TTL_S) - HELD_SINCE_SLACK_S)


def limits_version() -> str:
    """What the organisation counters' limits were worked out under, beyond the account: this code's
    fields and the settings of payment standing. A counter of another version is rebuilt."""
    return f"4:{hot.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD}:{int(bills_through_stripe())}:{_ceilings_version(hot.SPEND_CEILINGS)}"


@functools.lru_cache(maxsize=4)
def _ceilings_version(steps: tuple[tuple[Decimal, Decimal | None], ...]) -> str:
    """`SPEND_CEILINGS` as a short part of `limits_version` (made once per value: it is read on every call)."""
    return ",".join(f"{paid}:{'none' if ceiling is None else ceiling}" for paid, ceiling in steps)


def limit_fields(account: BillingAccount, *, card: CardSpend | None = None, period: Period | None = None
                 ) -> dict[str, str]:
    """The organisation counter's limits: `lv` (`limits_version`), `cap` (units, -1: none) and `capr`,
    the refusal reason when it is reached (`billing.standing.spend_limit`), `prepaid` (1/0) and `hold`
    (a refusal reason for every call, or empty); and `reached` cleared: no call was refused at these limits yet
    (`RESERVE_LUA`). `period`: the month of the counter they are written to (this one by PostgreSQL's clock by
    default), whose others' spend leaves it its room (`billing.standing.spend_limit`)."""
    limit = spend_limit(account, card=card, period=period)
    return {
        "lv": limits_version(), "cap": str(to_units(limit.cap) if limit.cap is not None else -1),
        "capr": limit.reason, "prepaid": "1" if account.is_prepaid else "0",
        "hold": hold_reason(account), "reached": "",
    }


def limit_reached(organization_id: int, period_key: str, reason: str) -> bool:
    """A call of the organisation was refused for its limit in the period, at its limits as they stand (`RESERVE_LUA`),
    and that limit is `reason`'s (`billing.standing.spend_limit`): its spend stops short of the limit, and no further
    call fits. NOTE: only while the counter's cap is the one the call was refused at: limits written by a pod of the
    release before leave the mark, or a refresh failed, and the limit was raised since. NOTE: and only for the limit
    the tenant is shown: a call refused for the room a shared card's other organisations leave (`spend_ceiling`) told
    of its own lower cap that it was reached, calls refused "until the cap is raised", which lifts nothing."""
    reached, cap, cap_reason = get_redis().hmget(org_period_key(organization_id, period_key), "reached", "cap", "capr")
    return bool(reached) and reached == cap and as_text(cap_reason or "") == reason


# NOTE: how far this process's clock may stand from the one a gateway picks its reservations' month by
# (`prepare_reservation`: Redis's, as its offset says); a web pod or worker refreshing limits has no offset to Redis.
MONTH_EDGE_SLACK = timedelta(hours=1)


def _months_in_use() -> tuple[Period, ...]:
    """The months whose counters a limits refresh writes: this process's clock's, and, within `MONTH_EDGE_SLACK` of a
    month's end, the neighbouring one (`_UPDATE_HASH` writes only a counter that exists).

    NOTE: a refresh wrote only its own clock's month: a web pod 10 minutes behind Redis at a month's end wrote a lowered
    cap (or a hold) to the old month's counter, and the new month's, made by the gateways' first calls (by Redis's clock),
    kept the old limits for the month; one ahead found no counter for the new month, and the old one's last minutes
    ran on the old cap."""
    return periods_near(MONTH_EDGE_SLACK)


def refresh_limits(account: BillingAccount, *, credit: bool = True, card: CardSpend | None = None) -> None:
    """Make Redis see the organisation's changed cap, billing mode, payment standing or (`credit`)
    credit grants at once (counters stay as they are). Inside a transaction (the Django admin's), once
    it commits: Redis never runs ahead of what a rollback could undo.

    NOTE: reads the account again and writes Redis under its row lock, so two refreshes never leave the
    older state last: a change's own write takes the same lock, and its refresh runs after it commits.
    A refresh that fails leaves `limits_stale` set, and the payment-standing beat task refreshes again.
    """
    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(lambda: refresh_limits(account, credit=credit, card=card), robust=True)
        return
    try:
        with transaction.atomic():
            account = BillingAccount.objects.select_for_update().get(pk=account.pk)
            # NOTE: each month's counter its own month's limits: the room the allowance without a payment method leaves
            # is the limit less the others' spend of that month (`billing.standing.limit_without_payment_method`).
            # One month's written to both, near a month's edge, left the new month's counter (made by a gateway whose
            # clock had passed midnight) what the old month left, and nothing wrote it again that month.
            for period in _months_in_use():
                fields = [item for pair in limit_fields(account, card=card, period=period).items() for item in pair]
                _UPDATE_HASH.run_sync(keys=[org_period_key(account.organization_id, period.key)], args=fields)
            if credit:
                get_redis().delete(credit_key(account.organization_id))  # rebuilt from the grants when next needed
            if account.limits_stale:
                _refresh_key_caps(account.organization_id)  # a key's cap changed too (`set_key_spend_cap`) may be unwritten
                BillingAccount.objects.filter(pk=account.pk).update(limits_stale=False)
    except Exception:
        BillingAccount.objects.filter(pk=account.pk).update(limits_stale=True)
        raise


def _refresh_key_caps(organization_id: int) -> None:
    """Every live key's cap of the organisation written again to its counter (those of this month that exist;
    a revoked key spends nothing more)."""
    caps = dict(ApiKeySpendCap.objects.filter(api_key__organization_id=organization_id)
                .values_list("api_key_id", "spend_cap"))
    for api_key_id in ApiKey.objects.filter(organization_id=organization_id, revoked_at__isnull=True).values_list("pk", flat=True):
        refresh_key_limit(organization_id, api_key_id, caps.get(api_key_id))


def refresh_key_cap(organization_id: int, api_key_id: int) -> None:
    """Write a key's cap, as PostgreSQL has it now, to its counter (this month's, if it exists), read under its
    organisation account's row lock: a cap change (`billing.services.set_key_spend_cap`) writes under that lock and
    refreshes after it, so whichever of the two comes last writes the newest cap.

    NOTE: one that fails leaves `limits_stale` set, as `refresh_limits` does, and the payment-standing beat task writes
    every key's cap again: a cap set while the key's counter was rebuilt had found no counter to write (its own refresh
    cleared the mark), and this write failing (Redis) left the key spending past it for the month."""
    try:
        with transaction.atomic():
            BillingAccount.objects.select_for_update().for_organization(organization_id)
            key_cap = ApiKeySpendCap.objects.filter(api_key_id=api_key_id).values_list("spend_cap", flat=True).first()
            refresh_key_limit(organization_id, api_key_id, key_cap)
    except Exception:
        BillingAccount.objects.filter(organization_id=organization_id).update(limits_stale=True)
        raise


def refresh_key_limit(organization_id: int, api_key_id: int, key_cap: Decimal | None) -> None:
    """Make Redis see a key's changed spend cap (None: no cap) at once."""
    for period in _months_in_use():
        _UPDATE_HASH.run_sync(
            keys=[key_period_key(organization_id, api_key_id, period.key)],
            args=["cap", str(to_units(key_cap) if key_cap is not None else -1)],
        )
