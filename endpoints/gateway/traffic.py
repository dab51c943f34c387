"""Shared traffic state in Redis, exact across gateway processes.

- outstanding requests per replica (the balancer picks the fewest, atomically);
- in-flight and waiting requests per endpoint, as sorted sets of request ids scored by
  their start time, so a gateway that dies mid-request leaks nothing for long: readers
  ignore entries older than `STALE_AFTER_S`;
- the time of each endpoint's last request (scale to zero measures idleness from it);
- each gateway process's own requests (`gw:requests:<gateway>`, request id -> "<endpoint>|<the
  outstanding counter it holds>"), so that a dead gateway's entries are released by
  `endpoints.gateway.presence` within seconds, and a live one can put them back after Redis lost them.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

from controlplane.redis_client import get_async_redis
from controlplane.redis_scripts import Script
from controlplane.script_parts import ScriptPart

STALE_AFTER_S = 3600
# Endpoints with a request in the last day, for the autoscaler tick (scored by last request time).
RECENT_ENDPOINTS_KEY = "gw:recent_endpoints"
RECENT_WINDOW_S = 86400
OUTSTANDING_TTL_S = 3600
GATEWAYS_KEY = "gw:gateways"  # ids of gateway processes that hold (or held) requests

# Lua functions shared by the scripts below, the gateway's admission and finish scripts (admission.py)
# and `endpoints.gateway.presence`; their keys and arguments are `BEGIN`'s, `PICK`'s, `END`'s below, and:
# traffic_hold     K: this gateway's requests hash; A: request id, endpoint id, the outstanding counter held
# traffic_release  K: an outstanding counter (dropped by one, never below zero)
# NOTE: a counter is released only by whoever removes the request from its gateway's hash, so the
# request's own end and a sweeper releasing a dead gateway's entries never both release it.
TRAFFIC_LUA = """
local function traffic_begin(K, A)
  redis.call('ZADD', K[1], A[2], A[1])
  redis.call('SET', K[2], A[2])
  redis.call('ZADD', K[3], A[2], A[3])
  redis.call('HSET', K[4], A[1], A[3] .. '|')
end
local function traffic_hold(K, A)
  redis.call('HSET', K[1], A[1], A[2] .. '|' .. A[3])
end
local function traffic_pick(K, A)
  local best, best_value = 1, nil
  for i, key in ipairs(K) do
    local value = tonumber(redis.call('GET', key) or '0')
    if best_value == nil or value < best_value then best, best_value = i, value end
  end
  redis.call('INCR', K[best])
  redis.call('EXPIRE', K[best], A[1])
  return best
end
local function traffic_release(K)
  local value = tonumber(redis.call('GET', K[1]) or '0')
  if value > 0 then return redis.call('DECR', K[1]) end
  return 0
end
local function traffic_end(K, A)
  redis.call('ZREM', K[1], A[1])
  redis.call('ZREM', K[2], A[1])
  redis.call('SET', K[3], A[2])
  local held = redis.call('HGET', K[5], A[1])
  redis.call('HDEL', K[5], A[1])
  if A[3] == '1' and held and string.sub(held, -string.len(K[4]) - 1) == '|' .. K[4] then traffic_release({K[4]}) end
end
"""
BEGIN = ScriptPart("traffic_begin",
                   keys=("the endpoint's in-flight (or waiting) set", "its last-request key", "the recent-endpoints set",
                         "this gateway's requests hash"),
                   args=("request id", "now", "endpoint id"), lua=TRAFFIC_LUA)
# Counts one more on the least outstanding candidate and returns its 1-based index.
PICK = ScriptPart("traffic_pick", keys=(), args=("counter TTL",), lua=TRAFFIC_LUA, variadic_keys=True)
END = ScriptPart("traffic_end",
                 keys=("the endpoint's in-flight set", "its waiting set", "its last-request key",
                       "the outstanding counter held (or a placeholder)", "this gateway's requests hash"),
                 args=("request id", "now", "release (1: drop the counter by one)"), lua=TRAFFIC_LUA)

# KEYS: this gateway's requests hash, then the candidates' counters; ARGV: TTL, request id, endpoint id.
_PICK_LEAST_OUTSTANDING = Script(TRAFFIC_LUA + """
local candidates = {}
for i = 2, #KEYS do candidates[#candidates + 1] = KEYS[i] end
local best = traffic_pick(candidates, {ARGV[1]})
traffic_hold({KEYS[1]}, {ARGV[2], ARGV[3], candidates[best]})
return best
""")
# KEYS: this gateway's requests hash, the counter; ARGV: request id, endpoint id. Releases the counter
# only if this request holds it.
_RELEASE = Script(TRAFFIC_LUA + """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] .. '|' .. KEYS[2] then return 0 end
traffic_hold({KEYS[1]}, {ARGV[1], ARGV[2], ''})
return traffic_release({KEYS[2]})
""")
NO_REPLICA_KEY = "gw:outstanding:-"  # placeholder when a request holds no replica's count

_gateway_id: tuple[int, str] = (0, "")


def gateway_id() -> str:
    """This gateway process's id (new in a forked child)."""
    global _gateway_id
    if _gateway_id[0] != os.getpid():
        _gateway_id = (os.getpid(), f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return _gateway_id[1]


def gateway_requests_key(gateway: str | None = None) -> str:
    return f"gw:requests:{gateway or gateway_id()}"


def gateway_alive_key(gateway: str | None = None) -> str:
    return f"gw:alive:{gateway or gateway_id()}"


def outstanding_key(replica_id: str) -> str:
    return f"gw:outstanding:{replica_id}"


def inflight_key(endpoint_id: str) -> str:
    return f"gw:inflight:{endpoint_id}"


def waiting_key(endpoint_id: str) -> str:
    return f"gw:waiting:{endpoint_id}"


def last_request_key(endpoint_id: str) -> str:
    return f"gw:last_request:{endpoint_id}"


async def pick_replica(replica_ids: list[str], *, request_id: str, endpoint_id: str) -> int:
    """Index of the replica with the fewest outstanding requests, already counted as one more (held by
    `request_id` in this gateway's requests)."""
    keys = [gateway_requests_key()] + [outstanding_key(r) for r in replica_ids]
    return int(await _PICK_LEAST_OUTSTANDING(keys=keys, args=[OUTSTANDING_TTL_S, request_id, endpoint_id])) - 1


async def release_replica(replica_id: str, *, request_id: str, endpoint_id: str) -> None:
    await _RELEASE(keys=[gateway_requests_key(), outstanding_key(replica_id)], args=[request_id, endpoint_id])


def begin_keys_and_args(endpoint_id: str, request_id: str, *, waiting: bool) -> tuple[list[str], list]:
    """`BEGIN`'s keys and arguments: the request counted in flight, or waiting for a cold start."""
    now = time.time()
    keys = [waiting_key(endpoint_id) if waiting else inflight_key(endpoint_id), last_request_key(endpoint_id),
            RECENT_ENDPOINTS_KEY, gateway_requests_key()]
    return keys, [request_id, now, endpoint_id]


def end_keys_and_args(endpoint_id: str, request_id: str, *, release: str | None) -> tuple[list[str], list]:
    """`END`'s keys and arguments; with `release`, that replica's outstanding count drops too."""
    keys = [inflight_key(endpoint_id), waiting_key(endpoint_id), last_request_key(endpoint_id),
            outstanding_key(release) if release is not None else NO_REPLICA_KEY, gateway_requests_key()]
    return keys, [request_id, time.time(), "1" if release is not None else "0"]


def pick_keys_and_args(replica_ids: list[str]) -> tuple[list[str], list]:
    """`PICK`'s keys and arguments: the candidates' outstanding counters."""
    return [outstanding_key(r) for r in replica_ids], [OUTSTANDING_TTL_S]


async def promote_request(endpoint_id: str, request_id: str) -> None:
    """A held request got a replica: it stops waiting and is in flight."""
    redis = get_async_redis()
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zrem(waiting_key(endpoint_id), request_id)
        pipe.zadd(inflight_key(endpoint_id), {request_id: time.time()})
        await pipe.execute()


async def num_waiting(endpoint_id: str) -> int:
    return await get_async_redis().zcount(waiting_key(endpoint_id), time.time() - STALE_AFTER_S, "+inf")
