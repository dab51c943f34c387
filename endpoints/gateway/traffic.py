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

# `begin_request` and `pick_replica` in one round trip: the hot path of a request to a warm endpoint.
# KEYS: in-flight set, last-request key, recent-endpoints set, then the candidates' outstanding counters.
# ARGV: request id, now, endpoint id, outstanding TTL. Returns the 1-based index of the candidate picked.
_BEGIN_AND_PICK = """
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[3])
local best, best_value = 4, nil
for i = 4, #KEYS do
  local value = tonumber(redis.call('GET', KEYS[i]) or '0')
  if best_value == nil or value < best_value then best, best_value = i, value end
end
redis.call('INCR', KEYS[best])
redis.call('EXPIRE', KEYS[best], ARGV[4])
return best - 3
"""

# `end_request` and `release_replica` in one round trip.
# KEYS: in-flight set, waiting set, last-request key[, the outstanding counter to release]. ARGV: request id, now.
_END = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], ARGV[2])
if KEYS[4] then
  local value = tonumber(redis.call('GET', KEYS[4]) or '0')
  if value > 0 then redis.call('DECR', KEYS[4]) end
end
return 0
"""

_scripts: dict[int, tuple] = {}


def _scripts_of_this_loop():
    redis = get_async_redis()
    scripts = _scripts.get(id(redis))
    if scripts is None:
        scripts = tuple(redis.register_script(source) for source in (_PICK_LEAST_OUTSTANDING, _RELEASE, _BEGIN_AND_PICK, _END))
        _scripts[id(redis)] = scripts
    return scripts


def _script_pair():
    return _scripts_of_this_loop()[:2]


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


async def begin_request_and_pick(endpoint_id: str, request_id: str, replica_ids: list[str]) -> int:
    """`begin_request(waiting=False)` then `pick_replica(replica_ids)`, atomically and in one round trip."""
    begin_and_pick = _scripts_of_this_loop()[2]
    keys = [inflight_key(endpoint_id), last_request_key(endpoint_id), RECENT_ENDPOINTS_KEY]
    keys += [outstanding_key(replica_id) for replica_id in replica_ids]
    return int(await begin_and_pick(keys=keys, args=[request_id, time.time(), endpoint_id, OUTSTANDING_TTL_S])) - 1


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


async def end_request(endpoint_id: str, request_id: str, *, release: str | None = None) -> None:
    """The request is over; with `release`, that replica's outstanding count drops too (same round trip)."""
    end = _scripts_of_this_loop()[3]
    keys = [inflight_key(endpoint_id), waiting_key(endpoint_id), last_request_key(endpoint_id)]
    if release is not None:
        keys.append(outstanding_key(release))
    await end(keys=keys, args=[request_id, time.time()])


async def num_waiting(endpoint_id: str) -> int:
    return await get_async_redis().zcount(waiting_key(endpoint_id), time.time() - STALE_AFTER_S, "+inf")
