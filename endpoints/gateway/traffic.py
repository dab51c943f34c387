"""Shared traffic state in Redis, exact across gateway processes.

- outstanding requests per replica (the balancer picks, atomically, the fewest or the replica
  `endpoints.gateway.routing` prefers for the prompt's prefix, within a margin of the fewest);
- in-flight and waiting requests per endpoint, as sorted sets of request ids scored by
  their start time, so a gateway that dies mid-request leaks nothing for long: readers
  ignore entries older than `STALE_AFTER_S`;
- the time of each endpoint's last request (scale to zero measures idleness from it);
- each gateway process's own requests, one hash per organisation (`gw:{org:<id>}:requests:<gateway>`,
  request id -> "<endpoint>|<the outstanding counter it holds>|<the call's token>"), so that a dead gateway's entries are
  released by `endpoints.gateway.presence` within seconds, and a live one can put them back after
  Redis lost them. A gateway lists each of its hashes in `gw:gateways` before it first writes one, and takes
  it out once it holds nothing there (`endpoints.gateway.presence`);
- the endpoints with a recent request (`gw:recent_endpoints`, for the autoscaler tick), written by
  the heartbeat from what this process served since its last beat (`note_recent`).

A call's token (`new_call_token`, one per admission) tells its own entry from an earlier try's under the same request
id (a batch line tried again, whose end has not reached Redis yet): only the call that wrote an entry answers from it,
moves it or ends it (`endpoints.gateway.admission`).

Every key a script here touches carries its organisation's hash tag (`controlplane.redis_keys`): an
endpoint, its replicas and its callers belong to one organisation, so the scripts run on Redis Cluster.

NOTE: the times written here (a request's start, an endpoint's last request) are Redis's clock (`TIME`, read
inside the scripts), never the gateway's, and their readers read Redis's clock too (`autoscaler.read_load`,
the autoscaler tick): a gateway or worker whose clock stepped (NTP, a VM resumed) changed how long an endpoint
looked idle by as much. A worker 300 s ahead scaled to zero every endpoint with a 300 s idle timeout used
seconds before, and one an hour ahead no longer saw the calls in flight (`STALE_AFTER_S`).
"""

from __future__ import annotations

import functools
import itertools
import os
import secrets
import socket
import uuid

from controlplane import clock, redis_keys
from controlplane.redis_client import get_async_redis
from controlplane.redis_keys import (
    GATEWAYS_KEY,
    inflight_key,
    last_request_key,
    no_replica_placeholder,
    outstanding_key,
    waiting_key,
)
from controlplane.redis_scripts import Script
from controlplane.script_parts import ScriptPart
from endpoints.gateway import routing

STALE_AFTER_S = 3600
RECENT_WINDOW_S = 86400  # the autoscaler tick looks at endpoints with a request this recent
OUTSTANDING_TTL_S = 3600

# Lua functions shared by the scripts below, the gateway's admission and finish scripts (admission.py)
# and `endpoints.gateway.presence`; their keys and arguments are `BEGIN`'s, `PICK`'s, `END`'s below, and:
# traffic_hold     K: this gateway's requests hash; A: request id, endpoint id, the outstanding counter held, the call's
#                  token
# traffic_release  K: an outstanding counter (dropped by one, never below zero)
# NOTE: a counter is released only by whoever removes the request from its gateway's hash, so the
# request's own end and a sweeper releasing a dead gateway's entries never both release it.
TRAFFIC_LUA = """
-- Redis's clock: whole seconds (a request's score), and the time with its microseconds (a last-request time).
-- NOTE: scores are whole seconds: Redis keeps a small sorted set as a packed list, where an integer score is
-- stored as one and a fractional one as text, parsed again by every insertion's walk (an in-flight set's ZADD
-- cost ~10x more at concurrency 16). Staleness is judged in minutes.
local function traffic_now()
  local now = redis.call('TIME')
  return tonumber(now[1]), now[1] .. '.' .. string.format('%06d', tonumber(now[2]))
end
local function traffic_begin(K, A, held)
  local seconds, now = traffic_now()
  redis.call('ZADD', K[1], seconds, A[1])
  redis.call('SET', K[2], now)
  redis.call('HSET', K[3], A[1], A[2] .. '|' .. held .. '|' .. A[3])
end
local function traffic_hold(K, A)
  redis.call('HSET', K[1], A[1], A[2] .. '|' .. A[3] .. '|' .. A[4])
end
-- Whether a request's entry ("<endpoint>|<counter>|<call's token>") is the call's of `token`.
local function traffic_is_call(entry, token)
  return string.sub(entry, -#token - 1) == '|' .. token
end
local function traffic_pick(K, A)
  local values = redis.call('MGET', unpack(K))
  local counts, least = {}, nil
  for i = 2, #K do
    counts[i - 1] = tonumber(values[i] or '0')
    if least == nil or counts[i - 1] < counts[least] then least = i - 1 end
  end
  local order = {}
  for index in string.gmatch(A[2], '%d+') do order[#order + 1] = tonumber(index) end
  -- the replica that last served this prefix from its cache goes first (never ahead of `prefer`'s)
  local hinted = values[1]
  if hinted then
    for position, index in ipairs(order) do
      if K[index + 1] == hinted then
        if tonumber(A[3]) == 0 or position <= tonumber(A[3]) then
          table.remove(order, position)
          table.insert(order, 1, index)
        end
        break
      end
    end
  end
  local best = least
  for _, index in ipairs(order) do
    if counts[index] ~= nil and counts[index] <= counts[least] + tonumber(A[4]) then best = index break end
  end
  redis.call('INCR', K[best + 1])
  redis.call('EXPIRE', K[best + 1], A[1])
  return best
end
-- The 1-based index among the candidates' counters (`PICK`'s keys after the hint) of the one a call's entry in its
-- gateway's requests hash holds ("<endpoint>|<counter>|<token>"), 0 for an entry that holds none where there are no
-- candidates (waiting for a cold start); nil when the entry is another call's or endpoint's, or holds no candidate's
-- counter.
local function traffic_held_index(K, entry, endpoint, token)
  if string.sub(entry, 1, #endpoint + 1) ~= endpoint .. '|' or not traffic_is_call(entry, token) then return nil end
  local held = string.sub(entry, #endpoint + 2, -#token - 2)
  if held == '' then return #K == 1 and 0 or nil end
  for i = 2, #K do
    if K[i] == held then return i - 1 end
  end
  return nil
end
local function traffic_release(K)
  local value = redis.call('DECR', K[1])
  if value >= 0 then return value end
  redis.call('DEL', K[1])  -- never below zero: a counter at zero, or one Redis lost, is no key (TTL-less otherwise)
  return 0
end
-- NOTE: an entry of another call under the request's id (a new try admitted after this one's end missed Redis) is that
-- call's: it stays, counted in flight under the same id, holding its counter.
local function traffic_end(K, A)
  local held = redis.call('HGET', K[5], A[1])
  if held and not traffic_is_call(held, A[3]) then return end
  redis.call('ZREM', K[1], A[1])
  redis.call('ZREM', K[2], A[1])
  local _, now = traffic_now()
  redis.call('SET', K[3], now)
  if not held then return end
  redis.call('HDEL', K[5], A[1])
  if A[2] == '1' and string.sub(held, -#K[4] - #A[3] - 2) == '|' .. K[4] .. '|' .. A[3] then traffic_release({K[4]}) end
end
"""
BEGIN = ScriptPart("traffic_begin",
                   keys=("the endpoint's in-flight (or waiting) set", "its last-request key",
                         "this gateway's requests hash (of the endpoint's organisation)"),
                   args=("request id", "endpoint id", "the call's token"), lua=TRAFFIC_LUA)
# Counts one more on the candidate chosen (`endpoints.gateway.routing`: the first in the order of
# preference, the hinted one moved first, whose count is within the margin of the least loaded; else the
# least loaded) and returns its 1-based index among the candidates' counters (the keys after the hint).
PICK = ScriptPart("traffic_pick", keys=("the prefix's hint key (or a placeholder)",),
                  args=("counter TTL", "order of preference (1-based indices, comma-separated)",
                        "how many of its first entries are preferred (a hint stays behind them)", "margin"),
                  lua=TRAFFIC_LUA, variadic_keys=True)
END = ScriptPart("traffic_end",
                 keys=("the endpoint's in-flight set", "its waiting set", "its last-request key",
                       "the outstanding counter held (or a placeholder)", "this gateway's requests hash"),
                 args=("request id", "release (1: drop the counter by one)", "the call's token"), lua=TRAFFIC_LUA)

# KEYS: this gateway's requests hash, a hint placeholder, then the candidates' counters; ARGV: TTL,
# request id, endpoint id, the call's token. A call that holds one of them already (this call sent again: the caller
# released the one it held before picking) is answered that one, counted once.
_PICK_LEAST_OUTSTANDING = Script(TRAFFIC_LUA + """
local candidates = {}
for i = 2, #KEYS do candidates[#candidates + 1] = KEYS[i] end
local entry = redis.call('HGET', KEYS[1], ARGV[2])
local held = entry and traffic_held_index(candidates, entry, ARGV[3], ARGV[4])
if held then return held end
local best = traffic_pick(candidates, {ARGV[1], '', '0', '0'})
traffic_hold({KEYS[1]}, {ARGV[2], ARGV[3], candidates[best + 1], ARGV[4]})
return best
""")
# KEYS: this gateway's requests hash, the counter; ARGV: request id, endpoint id, the call's token. Releases the
# counter only if this call holds it.
_RELEASE = Script(TRAFFIC_LUA + """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] .. '|' .. KEYS[2] .. '|' .. ARGV[3] then return 0 end
traffic_hold({KEYS[1]}, {ARGV[1], ARGV[2], '', ARGV[3]})
return traffic_release({KEYS[2]})
""")
# KEYS: the set the request leaves, the set it joins (the endpoint's waiting set, its in-flight set: a held request got a
# replica; the other way, `demote_request`); ARGV: request id.
_PROMOTE = Script(TRAFFIC_LUA + """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], traffic_now(), ARGV[1])
""")


_gateway_id: tuple[int, str] = (0, "")
# This process's requests hashes listed in `GATEWAYS_KEY` (organisation ids) and the admissions now writing one
# (organisation id -> how many), and the endpoints it served since its last heartbeat (endpoint id -> time of the last
# request); all are this pid's.
_registered: tuple[int, set[int]] = (0, set())
_admitting: tuple[int, dict[int, int]] = (0, {})
_recent: tuple[int, dict[str, float]] = (0, {})


def _draw_call_tokens() -> None:
    global _call_tokens
    _call_tokens = (secrets.token_hex(6), itertools.count())


# This process's prefix for its calls' tokens, and their count (`new_call_token`): drawn again in a forked child.
_call_tokens: tuple[str, itertools.count] = ("", itertools.count())
_draw_call_tokens()
os.register_at_fork(after_in_child=_draw_call_tokens)


def new_call_token() -> str:
    """A call's token: its entry in its gateway's requests hash and its tokens reserved in its minute
    (`endpoints.gateway.limits`) are its own, never an earlier try's under the same request id.

    NOTE: this process's random prefix (48 bits, of a fixed length) and its count of calls: unique among every
    gateway's calls without reading the OS's random source per call (`secrets.token_hex(8)` did, ~1.5 µs a call,
    a system call; round 23 of `bench/results/gateway_profile.md`)."""
    prefix, numbers = _call_tokens
    return f"{prefix}{next(numbers):x}"


def entry_counter(entry: str) -> str:
    """The outstanding counter a request's entry holds ('' for none)."""
    return entry.split("|", 2)[1] if "|" in entry else ""


def entry_call_token(entry: str) -> str:
    """The token of the call whose entry this is ('' for an entry without one)."""
    return entry.rsplit("|", 1)[1] if entry.count("|") >= 2 else ""


def gateway_id() -> str:
    """This gateway process's id (new in a forked child)."""
    global _gateway_id
    if _gateway_id[0] != os.getpid():
        _gateway_id = (os.getpid(), f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return _gateway_id[1]


def gateway_requests_key(organization_id: int, gateway: str | None = None) -> str:
    """This gateway's (or `gateway`'s) requests hash of one organisation."""
    return redis_keys.gateway_requests_key(organization_id, gateway or gateway_id())


def registered_organizations() -> list[int]:
    """The organisations whose requests hashes this process listed in `GATEWAYS_KEY` (Redis may have lost it)."""
    pid, registered = _registered
    return list(registered) if pid == os.getpid() else []


async def register_requests_key(organization_id: int) -> None:
    """An admission begins: list this gateway's requests hash of the organisation in `GATEWAYS_KEY` before the first
    script writes it, so that a sweeper finds it if this process dies (once while it stays registered). It stays
    registered until the admission calls `admitted` (`unregister_requests_key`).

    NOTE: a pair of calls, not an async context manager: on the gateway's hot path, one cost 3 µs more an admission
    than the registration alone, these under 1 µs."""
    global _admitting, _registered
    pid = os.getpid()
    if _admitting[0] != pid:
        _admitting = (pid, {})
    if _registered[0] != pid:
        _registered = (pid, set())
    counts = _admitting[1]
    counts[organization_id] = counts.get(organization_id, 0) + 1
    if organization_id not in _registered[1]:
        try:
            await get_async_redis().sadd(GATEWAYS_KEY, gateway_requests_key(organization_id))
        except BaseException:
            admitted(organization_id)
            raise
        _registered[1].add(organization_id)


def admitted(organization_id: int) -> None:
    """The admission that called `register_requests_key` is over (admitted, refused or failed)."""
    counts = _admitting[1]
    if (num_left := counts.get(organization_id, 1) - 1) > 0:
        counts[organization_id] = num_left
    else:
        counts.pop(organization_id, None)


def unregister_requests_key(organization_id: int) -> bool:
    """Forget this process's requests hash of the organisation (`endpoints.gateway.presence` found it empty, and this
    process serves nothing there), unless an admission is writing it now; the next admission registers it again.
    Returns whether it was forgotten; the caller then takes it out of `GATEWAYS_KEY`.

    NOTE: an admission registers before its script writes the hash, and may wait on the rate limits' rebuilds
    (PostgreSQL) in between: a hash forgotten then would be written unlisted, and never read again by this process's
    reconcile (a call cancelled as its admission's reply came back stays in flight until this process dies)."""
    pid, registered = _registered
    if pid != os.getpid() or (_admitting[0] == pid and organization_id in _admitting[1]):
        return False
    registered.discard(organization_id)
    return True


def note_recent(endpoint_id: str) -> None:
    """The endpoint had a request now; the next heartbeat writes it to `RECENT_ENDPOINTS_KEY`."""
    global _recent
    if _recent[0] != os.getpid():
        _recent = (os.getpid(), {})
    _recent[1][endpoint_id] = clock.redis_now()  # the tick compares it with Redis's clock


def take_recent() -> dict[str, float]:
    """The endpoints noted since the last call (put them back with `note_recent` if writing them fails)."""
    global _recent
    pid, recent = _recent
    _recent = (os.getpid(), {})
    return recent if pid == os.getpid() else {}


async def pick_replica(organization_id: int, replica_ids: list[str], *, request_id: str, endpoint_id: str,
                       call_token: str) -> int:
    """Index of the replica with the fewest outstanding requests, already counted as one more (held by
    `request_id`'s call of `call_token` in this gateway's requests). The retry after a replica failed: no prefix
    preference."""
    keys = [gateway_requests_key(organization_id), routing.hint_key(organization_id, "-", None)] + [
        outstanding_key(organization_id, r) for r in replica_ids]
    return int(await _PICK_LEAST_OUTSTANDING(keys=keys, args=[OUTSTANDING_TTL_S, request_id, endpoint_id,
                                                              call_token])) - 1


async def release_replica(organization_id: int, replica_id: str, *, request_id: str, endpoint_id: str,
                          call_token: str) -> None:
    await _RELEASE(keys=[gateway_requests_key(organization_id), outstanding_key(organization_id, replica_id)],
                   args=[request_id, endpoint_id, call_token])


# NOTE: an endpoint's keys (and a set of candidates' counters) are the same from one request to the
# next: built once per endpoint and gateway process, not on every request.
KEYS_CACHE_MAX = 4096


@functools.lru_cache(maxsize=KEYS_CACHE_MAX)
def _begin_keys(organization_id: int, endpoint_id: str, waiting: bool, gateway: str) -> tuple[str, ...]:
    counted_in = waiting_key if waiting else inflight_key
    return (counted_in(organization_id, endpoint_id), last_request_key(organization_id, endpoint_id),
            redis_keys.gateway_requests_key(organization_id, gateway))


@functools.lru_cache(maxsize=KEYS_CACHE_MAX)
def _end_keys(organization_id: int, endpoint_id: str, release: str | None, gateway: str) -> tuple[str, ...]:
    counter = outstanding_key(organization_id, release) if release is not None else no_replica_placeholder(organization_id)
    return (inflight_key(organization_id, endpoint_id), waiting_key(organization_id, endpoint_id),
            last_request_key(organization_id, endpoint_id), counter, redis_keys.gateway_requests_key(organization_id, gateway))


@functools.lru_cache(maxsize=KEYS_CACHE_MAX)
def _outstanding_keys(organization_id: int, replica_ids: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(outstanding_key(organization_id, r) for r in replica_ids)


def begin_keys_and_args(organization_id: int, endpoint_id: str, request_id: str, *, waiting: bool,
                        call_token: str) -> tuple[tuple[str, ...], list]:
    """`BEGIN`'s keys and arguments: the request's call counted in flight, or waiting for a cold start."""
    return _begin_keys(organization_id, endpoint_id, waiting, gateway_id()), [request_id, endpoint_id, call_token]


def end_keys_and_args(organization_id: int, endpoint_id: str, request_id: str, *, release: str | None,
                      call_token: str) -> tuple[tuple[str, ...], list]:
    """`END`'s keys and arguments; with `release`, that replica's outstanding count drops too."""
    return (_end_keys(organization_id, endpoint_id, release, gateway_id()),
            [request_id, "1" if release is not None else "0", call_token])


def pick_keys_and_args(organization_id: int, replica_ids: list[str],
                       route: routing.Route | None = None) -> tuple[list[str], list]:
    """`PICK`'s keys and arguments: the prefix's hint key and the candidates' outstanding counters, and
    `route`'s order of preference (without one: the least outstanding)."""
    if route is None:
        route = routing.Route(routing.hint_key(organization_id, "-", None), (), 0, 0)
    order = ",".join([str(i + 1) for i in route.order]) if route.order else ""
    return ([route.hint_key, *_outstanding_keys(organization_id, tuple(replica_ids))],
            [OUTSTANDING_TTL_S, order, route.num_preferred, route.margin])


async def promote_request(organization_id: int, endpoint_id: str, request_id: str) -> None:
    """A held request got a replica: it stops waiting and is in flight."""
    await _PROMOTE(keys=[waiting_key(organization_id, endpoint_id), inflight_key(organization_id, endpoint_id)],
                   args=[request_id])


async def demote_request(organization_id: int, endpoint_id: str, request_id: str) -> None:
    """A request in flight lost its replica before any took it and waits again for one (`_PROMOTE`, the other way)."""
    await _PROMOTE(keys=[inflight_key(organization_id, endpoint_id), waiting_key(organization_id, endpoint_id)],
                   args=[request_id])
