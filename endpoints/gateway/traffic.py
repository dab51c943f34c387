"""Shared traffic state in Redis, exact across gateway processes.

- outstanding requests per replica (the balancer picks the fewest, atomically);
- in-flight and waiting requests per endpoint, as sorted sets of request ids scored by
  their start time, so a gateway that dies mid-request leaks nothing for long: readers
  ignore entries older than `STALE_AFTER_S`;
- the time of each endpoint's last request (scale to zero measures idleness from it).
"""

from __future__ import annotations

import time

from controlplane.redis_client import get_async_redis

STALE_AFTER_S = 3600
# Endpoints with a request in the last day, for the autoscaler tick (scored by last request time).
RECENT_ENDPOINTS_KEY = "gw:recent_endpoints"
RECENT_WINDOW_S = 86400
OUTSTANDING_TTL_S = 3600

# Lua functions shared by the scripts below and the gateway's admission script (admission.py).
# traffic_begin  K: in-flight (or waiting) set, last-request key, recent-endpoints set; A: request id, now, endpoint id
# traffic_pick   K: the candidates' outstanding counters; A: counter TTL. Counts one more on the
#                least outstanding and returns its 1-based index.
# traffic_end    K: in-flight set, waiting set, last-request key, outstanding counter; A: request id, now,
#                release (1 = drop that counter by one)
TRAFFIC_LUA = """
local function traffic_begin(K, A)
  redis.call('ZADD', K[1], A[2], A[1])
  redis.call('SET', K[2], A[2])
  redis.call('ZADD', K[3], A[2], A[3])
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
  if A[3] == '1' then traffic_release({K[4]}) end
end
"""
_PICK_LEAST_OUTSTANDING = TRAFFIC_LUA + "return traffic_pick(KEYS, ARGV)"
_RELEASE = TRAFFIC_LUA + "return traffic_release(KEYS)"
NO_REPLICA_KEY = "gw:outstanding:-"  # placeholder when a request holds no replica's count

_scripts: dict[int, tuple] = {}


def _script_pair():
    redis = get_async_redis()
    scripts = _scripts.get(id(redis))
    if scripts is None:
        scripts = _scripts[id(redis)] = tuple(redis.register_script(source) for source in (_PICK_LEAST_OUTSTANDING, _RELEASE))
    return scripts


def outstanding_key(replica_id: str) -> str:
    return f"gw:outstanding:{replica_id}"


def inflight_key(endpoint_id: str) -> str:
    return f"gw:inflight:{endpoint_id}"


def waiting_key(endpoint_id: str) -> str:
    return f"gw:waiting:{endpoint_id}"


def last_request_key(endpoint_id: str) -> str:
    return f"gw:last_request:{endpoint_id}"


async def pick_replica(replica_ids: list[str]) -> int:
    """Index of the replica with the fewest outstanding requests, already counted as one more."""
    if len(replica_ids) == 1:
        redis = get_async_redis()
        key = outstanding_key(replica_ids[0])
        async with redis.pipeline(transaction=False) as pipe:
            pipe.incr(key)
            pipe.expire(key, OUTSTANDING_TTL_S)
            await pipe.execute()
        return 0
    pick, _ = _script_pair()
    return int(await pick(keys=[outstanding_key(r) for r in replica_ids], args=[OUTSTANDING_TTL_S])) - 1


async def release_replica(replica_id: str) -> None:
    _, release = _script_pair()
    await release(keys=[outstanding_key(replica_id)])


def begin_keys_and_args(endpoint_id: str, request_id: str, *, waiting: bool) -> tuple[list[str], list]:
    now = time.time()
    keys = [waiting_key(endpoint_id) if waiting else inflight_key(endpoint_id), last_request_key(endpoint_id),
            RECENT_ENDPOINTS_KEY]
    return keys, [request_id, now, endpoint_id]


def end_keys_and_args(endpoint_id: str, request_id: str, *, release: str | None) -> tuple[list[str], list]:
    """`traffic_end`'s keys and arguments; with `release`, that replica's outstanding count drops too."""
    keys = [inflight_key(endpoint_id), waiting_key(endpoint_id), last_request_key(endpoint_id),
            outstanding_key(release) if release is not None else NO_REPLICA_KEY]
    return keys, [request_id, time.time(), "1" if release is not None else "0"]


async def promote_request(endpoint_id: str, request_id: str) -> None:
    """A held request got a replica: it stops waiting and is in flight."""
    redis = get_async_redis()
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zrem(waiting_key(endpoint_id), request_id)
        pipe.zadd(inflight_key(endpoint_id), {request_id: time.time()})
        await pipe.execute()


async def num_waiting(endpoint_id: str) -> int:
    return await get_async_redis().zcount(waiting_key(endpoint_id), time.time() - STALE_AFTER_S, "+inf")
