"""Reservations whose gateway died mid-request, released once their deadline passes (a crash never
holds a cap forever). Run by the `billing.sweep_expired_reservations` task."""

from __future__ import annotations

import json
import time

from billing.quota.counters import DEADLINES, RESERVATIONS, key_reserved_key, org_reserved_key
from controlplane.redis_client import get_redis
from controlplane.redis_scripts import Script

# KEYS: reservations, deadlines, org reserved, key reserved; ARGV: request id, has key, now
_RELEASE_EXPIRED = Script("""
local deadline = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not deadline or tonumber(deadline) > tonumber(ARGV[3]) then return 0 end
local payload = redis.call('HGET', KEYS[1], ARGV[1])
if payload then
  local amount = cjson.decode(payload)['a']
  if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('DECRBY', KEYS[3], amount) end
  if ARGV[2] == '1' and redis.call('EXISTS', KEYS[4]) == 1 then redis.call('DECRBY', KEYS[4], amount) end
  redis.call('HDEL', KEYS[1], ARGV[1])
end
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
""")


def sweep_expired_reservations(now: float | None = None, *, batch_size: int = 1000) -> int:
    """Release reservations whose deadline passed (their gateway died mid-request). Returns how many."""
    client = get_redis()
    now = time.time() if now is None else now
    released = 0
    while True:
        expired = client.zrangebyscore(DEADLINES, "-inf", now, start=0, num=batch_size)
        if not expired:
            return released
        for request_id in expired:
            payload = client.hget(RESERVATIONS, request_id)
            reservation = json.loads(payload) if payload else {"o": 0, "k": None}
            keys = [RESERVATIONS, DEADLINES, org_reserved_key(reservation["o"]), key_reserved_key(reservation["k"])]
            has_key = "1" if reservation["k"] is not None else "0"
            released += _RELEASE_EXPIRED.run_sync(keys=keys, args=[request_id, has_key, f"{now:.3f}"])
        if len(expired) < batch_size:
            return released
