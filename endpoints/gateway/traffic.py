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

# KEYS: outstanding counters of the candidate replicas. Returns the 1-based index picked.
_PICK_LEAST_OUTSTANDING = """
local best, best_value = 1, nil
for i, key in ipairs(KEYS) do
  local value = tonumber(redis.call('GET', key) or '0')
  if best_value == nil or value < best_value then best, best_value = i, value end
end
redis.call('INCR', KEYS[best])
redis.call('EXPIRE', KEYS[best], ARGV[1])
return best
"""

_RELEASE = """
local value = tonumber(redis.call('GET', KEYS[1]) or '0')
if value > 0 then return redis.call('DECR', KEYS[1]) end
return 0
"""

_scripts: dict[int, tuple] = {}


def _script_pair():
    redis = get_async_redis()
    pair = _scripts.get(id(redis))
    if pair is None:
        pair = (redis.register_script(_PICK_LEAST_OUTSTANDING), redis.register_script(_RELEASE))
        _scripts[id(redis)] = pair
    return pair


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


async def begin_request(endpoint_id: str, request_id: str, *, waiting: bool) -> None:
    now = time.time()
    redis = get_async_redis()
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zadd(waiting_key(endpoint_id) if waiting else inflight_key(endpoint_id), {request_id: now})
        pipe.set(last_request_key(endpoint_id), now)
        pipe.zadd(RECENT_ENDPOINTS_KEY, {endpoint_id: now})
        await pipe.execute()


async def promote_request(endpoint_id: str, request_id: str) -> None:
    """A held request got a replica: it stops waiting and is in flight."""
    redis = get_async_redis()
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zrem(waiting_key(endpoint_id), request_id)
        pipe.zadd(inflight_key(endpoint_id), {request_id: time.time()})
        await pipe.execute()


async def end_request(endpoint_id: str, request_id: str) -> None:
    now = time.time()
    redis = get_async_redis()
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrem(inflight_key(endpoint_id), request_id)
        pipe.zrem(waiting_key(endpoint_id), request_id)
        pipe.set(last_request_key(endpoint_id), now)
        await pipe.execute()


async def num_waiting(endpoint_id: str) -> int:
    return await get_async_redis().zcount(waiting_key(endpoint_id), time.time() - STALE_AFTER_S, "+inf")
