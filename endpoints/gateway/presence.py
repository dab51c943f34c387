"""Gateway processes' heartbeats, and what happens to the requests of one that dies or that Redis forgot.

Each gateway process refreshes `gw:alive:<gateway>` (TTL `ALIVE_TTL_S`) every `BEAT_S` and lists
itself in `gw:gateways`; its requests sit in `gw:requests:<gateway>` (written by the admission and
finish scripts, `endpoints.gateway.traffic`). Two repairs follow:

- **A dead gateway** (killed, OOM, its machine gone) stops beating. `sweep_dead_gateways` (each
  autoscaler tick) releases its requests within seconds: out of the endpoints' in-flight and
  waiting sets, and each replica's outstanding count back down by one. Before, they counted for an
  hour (`traffic.STALE_AFTER_S`), which kept the endpoint from scaling to zero.
- **Redis lost its memory** (a restart without persistence, a flush, a failover). A live gateway's
  next beat finds its alive key gone and puts back every request it is still serving: in flight on
  its endpoint, one outstanding on its replica. So the autoscaler sees the load that is really
  there, instead of idle endpoints whose streams it would drain.

Requests whose end could not reach Redis (it was down) are kept here and ended by a later beat.

NOTE: a gateway that only froze past `ALIVE_TTL_S` (a stalled event loop) is swept like a dead one;
when it beats again it finds its key gone and puts its requests back, so its counts come back and
are released once, by the request's own end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from controlplane.per_loop import PerLoop
from controlplane.redis_client import get_async_redis, get_redis
from controlplane.redis_scripts import Script
from endpoints.gateway import traffic

logger = logging.getLogger("inferplane.gateway")

BEAT_S = 1.0
ALIVE_TTL_S = 5
SWEEP_BATCH = 200

# KEYS: the gateway's requests hash, its alive key, the gateways set, then per request: in-flight set,
# waiting set, the outstanding counter it held (or the placeholder). ARGV: only_if_dead (0/1), then
# per request: request id, the hash value read. Releases each request still held as read.
_RELEASE_REQUESTS = Script(traffic.TRAFFIC_LUA + """
if ARGV[1] == '1' and redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local released = 0
for i = 2, #ARGV, 2 do
  local base = 4 + 3 * (i / 2 - 1)
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[base], ARGV[i])
    redis.call('ZREM', KEYS[base + 1], ARGV[i])
    if KEYS[base + 2] ~= '""" + traffic.NO_REPLICA_KEY + """' then traffic_release({KEYS[base + 2]}) end
    released = released + 1
  end
end
if ARGV[1] == '1' and redis.call('HLEN', KEYS[1]) == 0 then redis.call('SREM', KEYS[3], KEYS[1]) end
return released
""")

# KEYS: the gateway's requests hash, then per request: in-flight set, the outstanding counter (or the
# placeholder). ARGV: now, counter TTL, then per request: request id, hash value. Puts back each
# request the hash does not hold (Redis forgot it, or a sweeper released it).
_RESTORE_REQUESTS = Script("""
local restored = 0
for i = 3, #ARGV, 2 do
  local base = 2 + 2 * ((i - 3) / 2)
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    redis.call('ZADD', KEYS[base], ARGV[1], ARGV[i])
    if KEYS[base + 1] ~= '""" + traffic.NO_REPLICA_KEY + """' then
      redis.call('INCR', KEYS[base + 1])
      redis.call('EXPIRE', KEYS[base + 1], ARGV[2])
    end
    restored = restored + 1
  end
end
return restored
""")


@dataclass(slots=True)
class Held:
    """A request this process serves: its endpoint and the replica whose outstanding count it holds."""

    endpoint_id: str
    replica_id: str | None = None

    def value(self) -> str:
        return f"{self.endpoint_id}|{traffic.outstanding_key(self.replica_id) if self.replica_id else ''}"


# The requests this process serves (request id -> Held), and those whose end did not reach Redis.
serving: dict[str, Held] = {}
unfinished: set[str] = set()


@dataclass(slots=True)
class _Beating:
    task: asyncio.Task | None = None  # this loop's heartbeat


_beats: PerLoop[_Beating] = PerLoop(_Beating)


def track(request_id: str, endpoint_id: str, replica_id: str | None) -> Held:
    held = serving[request_id] = Held(endpoint_id, replica_id)
    return held


def untrack(request_id: str) -> None:
    serving.pop(request_id, None)


def end_later(request_id: str) -> None:
    """The request's end could not reach Redis: a later beat releases it (as a sweeper would)."""
    serving.pop(request_id, None)
    unfinished.add(request_id)


async def beat() -> None:
    """One heartbeat: stay alive, put back what Redis forgot, end what could not be ended."""
    redis = get_async_redis()
    gateway = traffic.gateway_id()
    async with redis.pipeline(transaction=False) as pipe:
        pipe.set(traffic.gateway_alive_key(gateway), "1", ex=ALIVE_TTL_S, get=True)
        pipe.sadd(traffic.GATEWAYS_KEY, traffic.gateway_requests_key(gateway))
        was_alive, _ = await pipe.execute()
    if was_alive is None and serving:
        snapshot = list(serving.items())
        keys, args = [traffic.gateway_requests_key(gateway)], [time.time(), traffic.OUTSTANDING_TTL_S]
        for request_id, held in snapshot:
            keys += [traffic.inflight_key(held.endpoint_id),
                     traffic.outstanding_key(held.replica_id) if held.replica_id else traffic.NO_REPLICA_KEY]
            args += [request_id, held.value()]
        restored = await _RESTORE_REQUESTS(keys=keys, args=args)
        if restored:
            logger.warning("gateway %s: put back %d request(s) Redis had lost", gateway, restored)
    if unfinished:
        ids = list(unfinished)
        await asyncio.to_thread(release_requests, gateway, ids, only_if_dead=False)
        unfinished.difference_update(ids)


async def _beat_forever() -> None:
    while True:
        try:
            await beat()
        except Exception as exc:  # noqa: BLE001 - Redis down: beat again, the requests are still served
            logger.warning("gateway heartbeat failed: %r", exc)
        await asyncio.sleep(BEAT_S)


async def start() -> None:
    """Beat once now (so this gateway is known before it admits anything), then every `BEAT_S`."""
    beating = _beats.get()
    if beating.task is not None and not beating.task.done():
        return
    try:
        await beat()
    except Exception as exc:  # noqa: BLE001 - Redis may be down at start; the loop keeps trying
        logger.warning("gateway heartbeat failed: %r", exc)
    beating.task = asyncio.get_running_loop().create_task(_beat_forever())


def ensure_started() -> None:
    """Start beating on this loop if nothing started it (a server without lifespan events)."""
    beating = _beats.get()
    if beating.task is None or beating.task.done():
        beating.task = asyncio.get_running_loop().create_task(_beat_forever())


# --- the sweeper (control plane side) -------------------------------------------------------------

def release_requests(gateway: str, request_ids: list[str] | None = None, *, only_if_dead: bool) -> int:
    """Release a gateway's requests (all, or `request_ids`) as their own end would; -1 if it is alive."""
    client = get_redis()
    hash_key = traffic.gateway_requests_key(gateway)
    entries = client.hgetall(hash_key) if request_ids is None else dict(
        zip(request_ids, client.hmget(hash_key, request_ids), strict=True))
    items = [(request_id, value) for request_id, value in entries.items() if value is not None]
    if not items and only_if_dead:
        client.srem(traffic.GATEWAYS_KEY, hash_key)
        return 0
    released = 0
    for first in range(0, max(len(items), 1), SWEEP_BATCH):
        keys, args = [hash_key, traffic.gateway_alive_key(gateway), traffic.GATEWAYS_KEY], ["1" if only_if_dead else "0"]
        for request_id, value in items[first:first + SWEEP_BATCH]:
            endpoint_id, _, counter = value.partition("|")
            keys += [traffic.inflight_key(endpoint_id), traffic.waiting_key(endpoint_id), counter or traffic.NO_REPLICA_KEY]
            args += [request_id, value]
        result = _RELEASE_REQUESTS.run_sync(keys=keys, args=args)
        if result < 0:
            return -1
        released += result
    return released


def sweep_dead_gateways() -> int:
    """Release the requests of every gateway whose heartbeat stopped; returns how many were released."""
    client = get_redis()
    released = 0
    for hash_key in client.smembers(traffic.GATEWAYS_KEY):
        gateway = hash_key.removeprefix("gw:requests:")
        if client.exists(traffic.gateway_alive_key(gateway)):
            continue
        count = release_requests(gateway, only_if_dead=True)
        if count > 0:
            logger.warning("gateway %s stopped beating: released %d of its request(s)", gateway, count)
            released += count
    return released
