"""A request's two Redis round trips: admit it, and finish it.

`admit` checks the key's rate limits, reserves the request's largest cost against the spend caps
and prepaid credit, counts it in flight (or waiting for a cold start) and picks the replica with
the fewest outstanding requests, all in one Lua script: nothing changes unless everything passes.
`finish` ends the in-flight count, releases the replica, gives back the tokens it reserved but did
not use and settles the real cost, in one more. The logic of each part lives with its owner (`limits`,
`billing.quota`, `traffic`); this module only puts their Lua functions into one script each.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from billing import quota
from controlplane.redis_scripts import Script
from endpoints.gateway import limits, traffic
from endpoints.gateway.auth import Caller

# Copies KEYS[from..to] or ARGV[from..to] into a new table: each part reads its own K and A.
_PART = """
local function part(t, from, to)
  local out = {}
  for i = from, to do out[#out + 1] = t[i] end
  return out
end
"""

# KEYS: 1-2 rate limits, 3-9 reservation, 10-13 begin, 14.. candidates' outstanding counters.
# ARGV: 1-3 rate limits, 4-8 reservation, 9-11 begin, 12 outstanding TTL.
# Returns {'ok', index of the candidate picked (1-based; 0 without candidates)},
# {'rate_limited', '1'|'2'}, {'refused', reason} or {'missing', counter to rebuild}.
_ADMIT = _PART + limits.LIMITS_LUA + quota.RESERVE_LUA + traffic.TRAFFIC_LUA + """
local verdict = limits_check(part(KEYS, 1, 2), part(ARGV, 1, 3))
if verdict ~= 0 then return {'rate_limited', tostring(verdict)} end
local reserved = quota_reserve(part(KEYS, 3, 9), part(ARGV, 4, 8))
if reserved[1] ~= 'ok' then return reserved end
limits_take(part(KEYS, 1, 2), part(ARGV, 1, 3))
traffic_begin(part(KEYS, 10, 13), part(ARGV, 9, 11))
if #KEYS < 14 then return {'ok', '0'} end
local picked = traffic_pick(part(KEYS, 14, #KEYS), {ARGV[12]})
traffic_hold({KEYS[13]}, {ARGV[9], ARGV[11], KEYS[13 + picked]})
return {'ok', tostring(picked)}
"""

# KEYS: 1-5 end, 6 token counter, 7-14 settlement. ARGV: 1-3 end, 4-6 tokens given back, 7-10 settlement.
_FINISH = _PART + limits.LIMITS_LUA + quota.SETTLE_LUA + traffic.TRAFFIC_LUA + """
traffic_end(part(KEYS, 1, 5), part(ARGV, 1, 3))
limits_give_back({KEYS[6]}, part(ARGV, 4, 6))
return quota_settle(part(KEYS, 7, 14), part(ARGV, 7, 10))
"""

MAX_REBUILDS = 4

# NOTE: on the pipelined connection of `controlplane.redis_scripts`, not redis-py's pool: these two
# calls are most of a request's Redis time.
_admit_script = Script(_ADMIT)
_finish_script = Script(_FINISH)


@dataclass(slots=True, frozen=True)
class Admission:
    reservation: quota.Reservation
    picked: int | None  # index into the candidates, or None when there were none (a cold start)
    window: limits.Window  # the minute its request and worst-case tokens were counted in


async def admit(*, caller: Caller, endpoint_id: str, request_id: str, amount: Decimal, num_tokens: int,
                candidates: list[str]) -> Admission:
    """Admit a request, or raise the OpenAIError (429) or QuotaExceeded that refuses it.

    `amount` is its largest possible cost and `num_tokens` the most tokens it may use (both
    reserved until `finish`). With `candidates` (READY replica ids) it is counted in flight on the
    one picked; without, it is counted as waiting for a cold start.
    """
    for _attempt in range(MAX_REBUILDS):
        window = limits.Window.now(caller.limit_subject, caller.requests_per_minute, caller.tokens_per_minute,
                                   num_tokens)
        reservation, reserve_keys, reserve_args = quota.prepare_reservation(
            organization_id=caller.organization_id, api_key_id=caller.api_key_id, amount=amount, request_id=request_id)
        limit_keys, limit_args = window.check_keys_and_args()
        begin_keys, begin_args = traffic.begin_keys_and_args(endpoint_id, request_id, waiting=not candidates)
        keys = limit_keys + reserve_keys + begin_keys + [traffic.outstanding_key(c) for c in candidates]
        args = limit_args + reserve_args + begin_args + [traffic.OUTSTANDING_TTL_S]
        status, detail = await _admit_script(keys=keys, args=args)
        if status == "missing":
            await quota.rebuild_missing(detail, reservation)
            continue
        if status == "rate_limited":
            raise window.refusal(int(detail))
        if (refused := quota.refusal(status, detail)) is not None:
            raise refused
        return Admission(reservation, int(detail) - 1 if candidates else None, window)
    raise RuntimeError("billing counters kept vanishing while admitting a request")


async def finish(*, caller: Caller, endpoint_id: str, admission: Admission, release: str | None,
                 num_tokens: int, cost: Decimal) -> None:
    """The request is over: out of flight, its replica released, the tokens it reserved replaced by
    the `num_tokens` it used, its cost settled."""
    end_keys, end_args = traffic.end_keys_and_args(endpoint_id, admission.reservation.request_id, release=release)
    token_keys, token_args = admission.window.give_back_keys_and_args(num_tokens)
    settle_keys, settle_args = quota.settle_keys_and_args(admission.reservation, cost)
    await _finish_script(keys=end_keys + token_keys + settle_keys, args=end_args + token_args + settle_args)
