"""A request's two Redis round trips: admit it, and finish it.

`admit` checks the key's rate limits, reserves the request's largest cost against the spend caps
and prepaid credit, counts it in flight (or waiting for a cold start) and picks its replica (the one `routing`
prefers for the prompt's prefix within a margin of the least loaded, else the fewest outstanding
requests), all in one Lua script: nothing changes unless everything passes.
`finish` ends the in-flight count, releases the replica, gives back the tokens it reserved but did
not use, remembers the replica if it served the prompt's prefix from its cache (`routing.LEARN`) and
settles the real cost, in one more. The logic of each part lives with its owner (`limits`,
`billing.quota.counters`, `traffic`), which declares the keys and arguments its Lua functions read
(a `ScriptPart`); this module only puts them into one script each (`controlplane.script_parts`
computes where each part's keys and arguments sit).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import NoReturn

from billing.models import BillingMode
from billing.quota import counters, rebuild
from controlplane.redis_keys import outstanding_key
from controlplane.script_parts import ComposedScript
from endpoints.gateway import adapter_hold, directory, errors, limits, presence, routing, traffic
from endpoints.gateway.auth import Caller
from endpoints.gateway.ratelimit_headers import RateLimitReport

# Returns {'ok', index of the candidate picked (1-based; 0 without candidates)} (followed, after the counts, by the
# billing mode it is admitted under: `counters.RESERVE_LUA`),
# {'rate_limited', '1'|'2'|'3'}, {'refused', reason}, {'missing', counter to rebuild} or {'leftover', the entry an
# earlier try under the request's id left}, each followed by this minute's request and token counts as the script left
# them (the rate-limit headers).
# NOTE: on the pipelined connection of `controlplane.redis_scripts`, not redis-py's pool: these two
# calls are most of a request's Redis time.
# NOTE: redis-py's cluster client sends a call again after a timeout (`controlplane.redis_scripts`): a call this
# gateway's requests hash holds already (under its token), on this endpoint and one of these candidates (or waiting,
# without any), was admitted by that first run, so the second answers from its entry, taking no limit and no replica
# again. An entry under the request's id with another token is another call's: never this call's admission. `admit`
# releases it as its end would only if this process knows that call ended (`presence.ended_unreleased`: a batch line
# tried again, the earlier try's end not yet in Redis), and admits this call on its own; a live one's (its end not
# known) keeps its place, and this call is refused (`errors.request_in_progress`). The hash is this gateway process's
# own (`traffic.gateway_id`): another gateway's tries are in its hash, and a dead one's are the sweeper's.
_ADMIT = ComposedScript([limits.CHECK, counters.RESERVE, traffic.BEGIN, traffic.PICK], glue="""
local used = limits_read(limits_check_K)
local entry = redis.call('HGET', traffic_begin_K[3], traffic_begin_A[1])
if entry and not traffic_is_call(entry, traffic_begin_A[3]) then return {'leftover', entry, used[1], used[2]} end
local admitted = entry and traffic_held_index(traffic_pick_K, entry, traffic_begin_A[2], traffic_begin_A[3])
if admitted then
  local reserved = quota_reserve(quota_reserve_K, quota_reserve_A)
  if reserved[1] ~= 'ok' then return {reserved[1], reserved[2], used[1], used[2]} end
  return {'ok', tostring(admitted), used[1], used[2], reserved[3]}
end
local verdict = limits_check(limits_check_K, limits_check_A, used)
if verdict ~= 0 then return {'rate_limited', tostring(verdict), used[1], used[2]} end
local reserved = quota_reserve(quota_reserve_K, quota_reserve_A)
if reserved[1] ~= 'ok' then return {reserved[1], reserved[2], used[1], used[2]} end
used = limits_take(limits_check_K, limits_check_A, used)
local picked, held = 0, ''
if #traffic_pick_K > 1 then
  picked = traffic_pick(traffic_pick_K, traffic_pick_A)
  held = traffic_pick_K[picked + 1]
end
-- this gateway's requests hash holds the request as in flight on the replica picked (or as waiting: none)
traffic_begin(traffic_begin_K, traffic_begin_A, held)
return {'ok', tostring(picked), used[1], used[2], reserved[3]}
""")

# NOTE: the unused tokens go back against the call's reservation as noted in its minute (`limits`), whatever became of
# its entry (released by the sweeper, lost with Redis's memory, put back): a second run of the same call (a cluster
# client's retry) finds it given back, and ends only the call's own entry (`traffic_end`).
_FINISH = ComposedScript([traffic.END, limits.GIVE_BACK, routing.LEARN, counters.SETTLE], glue="""
traffic_end(traffic_end_K, traffic_end_A)
limits_give_back(limits_give_back_K, limits_give_back_A)
routing_learn(routing_learn_K, routing_learn_A)
return quota_settle(quota_settle_K, quota_settle_A)
""")

# A call that names no model of its caller's: counted as one request in the key's minute, or refused past it.
_COUNT_UNKNOWN_MODEL = ComposedScript([limits.CHECK], glue="""
local used = limits_read(limits_check_K)
local verdict = limits_check(limits_check_K, limits_check_A, used)
if verdict ~= 0 then return {'rate_limited', tostring(verdict), used[1], used[2]} end
used = limits_take(limits_check_K, limits_check_A, used)
return {'ok', '0', used[1], used[2]}
""")

# A key's rate state, changed in nothing ('0' or the verdict, then this minute's counts): before a model's name is
# looked up in PostgreSQL (`resolve_model`).
_CHECK_LIMITS = ComposedScript([limits.CHECK], glue="""
local used = limits_read(limits_check_K)
return {tostring(limits_check(limits_check_K, limits_check_A, used)), used[1], used[2]}
""")

MAX_REBUILDS = 4


@dataclass(slots=True, frozen=True)
class Admission:
    reservation: counters.Reservation
    picked: int | None  # index into the candidates, or None when there were none (a cold start)
    window: limits.Window  # the minute its request and worst-case tokens were counted in
    prefix_key: str | None = None  # the prompt's prefix (`routing.prefix_key`), learned from at the finish
    # The billing mode it was admitted under (`BillingMode`'s value): its usage row is billed in it.
    billing_mode: str = BillingMode.POSTPAID
    call_token: str = ""  # its entry's and its reservation's in its minute (`traffic.new_call_token`)


async def admit(*, caller: Caller, endpoint_id: str, request_id: str, amount: Decimal, num_tokens: int,
                candidates: list[str], report: RateLimitReport | None = None, prefix_key: str | None = None,
                margin: int = 0, prefer: frozenset[str] = frozenset(), call_token: str | None = None,
                why_so_many: str = "") -> Admission:
    """Admit a request, or raise the OpenAIError (429) or QuotaExceeded that refuses it.

    `report` (the answer's rate-limit headers) gets the counters as the script left them, admitted or not.

    `amount` is its largest possible cost and `num_tokens` the most tokens it may use (both
    reserved until `finish`). With `candidates` (READY replica ids) it is counted in flight on the
    one picked; without, it is counted as waiting for a cold start. The pick prefers, within `margin`
    outstanding requests of the least loaded, the replicas in `prefer` (e.g. an adapter's holders),
    then the one that last served `prefix_key` from its cache, then `prefix_key`'s rendezvous order.

    `call_token` (`traffic.new_call_token`, a new one when None) is this call's, and its end's: an entry an earlier try
    under `request_id` left in this gateway's requests hash, whose end this process knows, is released as that try's
    end would, never taken as this call's; a live try's refuses this call (503, `errors.request_in_progress`).
    `why_so_many`: said after a 429 for its tokens (`limits.Window.refusal`).

    A reply lost to an outage or a cancellation (the script may have run) leaves the call's end to a later beat
    (`presence.end_later`), with its whole reservation given back.
    """
    call_token = call_token or traffic.new_call_token()
    # NOTE: every key below carries the caller's organisation's hash tag (`controlplane.redis_keys`);
    # the endpoint and its replicas are the caller's organisation's, so both scripts run on Redis Cluster.
    await traffic.register_requests_key(caller.organization_id)  # its requests hash listed before the script writes it
    try:
        any_limits = False
        for _attempt in range(MAX_REBUILDS):
            window = limits.Window.now(caller.organization_id, caller.limit_subject, caller.requests_per_minute,
                                       caller.tokens_per_minute, num_tokens)
            reservation, reserve_keys, reserve_args = counters.prepare_reservation(
                organization_id=caller.organization_id, api_key_id=caller.api_key_id, amount=amount,
                request_id=request_id, any_limits=any_limits)
            try:
                status, detail, num_requests, num_tokens_counted, *admitted_under = await _ADMIT(
                    limits_check=window.check_keys_and_args(call_token),
                    quota_reserve=(reserve_keys, reserve_args),
                    traffic_begin=traffic.begin_keys_and_args(caller.organization_id, endpoint_id, request_id,
                                                              waiting=not candidates, call_token=call_token),
                    traffic_pick=traffic.pick_keys_and_args(caller.organization_id, candidates, routing.route(
                        caller.organization_id, endpoint_id, prefix_key, candidates, margin=margin, prefer=prefer)),
                )
            except BaseException as exc:
                # NOTE: the script may have run before its reply was lost: its entry is released and its reservation
                # given back whole by a later beat (no note in the minute: nothing changes).
                if isinstance(exc, asyncio.CancelledError) or errors.is_outage(exc):
                    presence.end_later(caller.organization_id, request_id, call_token=call_token,
                                       give_back=window.give_back_keys_and_args(0, call_token))
                raise
            if report is not None:
                report.counted(window, num_requests, num_tokens_counted)
            if status == "missing":
                any_limits = await rebuild.rebuild_missing(detail, reservation) or any_limits
                continue
            if status == "leftover":
                if not presence.ended_unreleased(caller.organization_id, request_id, traffic.entry_call_token(detail)):
                    raise errors.request_in_progress()
                await presence.release_leftover(caller.organization_id, request_id, detail)
                continue
            if status == "rate_limited":
                raise window.refusal(int(detail), why_so_many)
            if (refused := counters.refusal(status, detail)) is not None:
                raise refused
            traffic.note_recent(endpoint_id)
            return Admission(reservation, int(detail) - 1 if candidates else None, window, prefix_key, *admitted_under,
                             call_token=call_token)
        raise rebuild.RebuildUnfinished("billing counters kept vanishing while admitting a request")  # a 503
    finally:
        traffic.admitted(caller.organization_id)


async def finish(*, caller: Caller, endpoint_id: str, admission: Admission, release: str | None,
                 num_tokens: int, cost: Decimal, served_by: str | None = None, cached_tokens: int = 0,
                 fresh_id: bool = False, recorded: bool = True, finished_at: datetime | None = None,
                 journaled: bool = False, lapsed_at: float | None = None) -> None:
    """The request is over: out of flight, its replica released, the tokens it reserved replaced by
    the `num_tokens` it used, its cost settled in the period of `finished_at` (its usage row's, where the ledger
    bills it; now when None); if `served_by` (a replica id) reported `cached_tokens`,
    it is remembered as holding the prompt's prefix. `fresh_id`: its request id is the gateway's own, which
    only a resend or the sweeper can settle again, so its settled marker is kept minutes, not a day
    (`billing.quota.counters.SETTLE_LUA`); a batch line's id recurs. Not `recorded`: the try wrote no ledger row
    (`cost` 0) and leaves no marker, so the next try under its id settles its own. `journaled`: its row went to the
    usage journal, whose replay counts it where this settlement could not (`billing.quota.replayed`). `lapsed_at`: from
    when its hold may have lapsed (`presence.Held.lapses_at`)."""
    await _FINISH(
        traffic_end=traffic.end_keys_and_args(caller.organization_id, endpoint_id, admission.reservation.request_id,
                                              release=release, call_token=admission.call_token),
        limits_give_back=admission.window.give_back_keys_and_args(num_tokens, admission.call_token),
        routing_learn=routing.learn_keys_and_args(
            caller.organization_id, endpoint_id, admission.prefix_key,
            outstanding_key(caller.organization_id, served_by) if served_by else None, cached_tokens),
        quota_settle=counters.settle_keys_and_args(admission.reservation, cost, finished_at=finished_at,
                                                  fresh_id=fresh_id, recorded=recorded,
                                                  billing_mode=admission.billing_mode, journaled=journaled,
                                                  lapsed_at=lapsed_at),
    )


async def resolve_model(*, caller: Caller, model: str, report: RateLimitReport,
                        ) -> tuple[directory.EndpointInfo, directory.AdapterInfo | None]:
    """The endpoint and adapter a call's (or `GET /v1/models/{id}`'s) `model` names among its caller's organisation's,
    or the 404 (`refuse_unknown_model`); a key past its rate limit gets its 429 before any name is looked up.

    NOTE: a name the gateway has not cached (one made up, each new one) is a PostgreSQL query: a key already past its
    limit could still send new names as fast as the gateway answered, each a query before its 429. So before a lookup
    its counters are read (one Redis round trip, changing nothing); a cached name, every known model's warm call,
    costs none."""

    async def refuse_past_limit() -> None:
        window = limits.Window.now(caller.organization_id, caller.limit_subject, caller.requests_per_minute,
                                   caller.tokens_per_minute)
        if not window.requests_per_minute and not window.tokens_per_minute:
            return
        verdict, num_requests, num_tokens = await _CHECK_LIMITS(limits_check=window.check_keys_and_args())
        report.counted(window, num_requests, num_tokens)
        if verdict != "0":
            raise window.refusal(int(verdict))

    resolved = await adapter_hold.resolve(caller.organization_id, model, before_lookup=refuse_past_limit)
    if resolved is None:
        await refuse_unknown_model(caller=caller, model=model, report=report)
    return resolved


async def refuse_unknown_model(*, caller: Caller, model: str, report: RateLimitReport) -> NoReturn:
    """Refuse a call (or `GET /v1/models/{id}`) whose `model` names none of its caller's organisation's: OpenAI's 404,
    counted as one request against the key's requests per minute as an admitted call is; past them, the 429.

    NOTE: unknown names were counted against no limit, and each new one is a PostgreSQL query: one key could send
    them as fast as the gateway answered. A known model's call is counted by `admit` alone, its hot path unchanged;
    this is the Redis round trip the 404's rate-limit headers read anyway (`RateLimitReport.read_counts`)."""
    window = limits.Window.now(caller.organization_id, caller.limit_subject, caller.requests_per_minute,
                               caller.tokens_per_minute)
    status, detail, num_requests, num_tokens = await _COUNT_UNKNOWN_MODEL(limits_check=window.check_keys_and_args())
    report.counted(window, num_requests, num_tokens)
    if status == "rate_limited":
        raise window.refusal(int(detail))
    raise errors.model_not_found(model)
