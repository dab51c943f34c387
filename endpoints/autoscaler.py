"""How many replicas an endpoint should have, from the traffic the gateways see.

desired = ceil((in flight + waiting) / target_concurrency), bounded by min and max replicas.
As in Knative's autoscaler, scaling up acts on the load right now (a burst is
served at once), while scaling down acts on the highest load seen during the
stable window (default 60 s), so a dip does not throw replicas away. With
nothing in flight or waiting for `idle_timeout_s`, an endpoint falls back to
`min_replicas`, zero for a serverless one. Queued batch work then holds warm replicas, or wakes a
sleeping endpoint when its deadline needs it (`endpoints.batches.scheduling.apply`).

Redis is a cache of this state, not its record: an endpoint that has replicas but no last-request
time in Redis (a restart without persistence, a flush) is read as "a request just now", never as
idle, and that time is written back, so its replicas get a whole `idle_timeout_s` before any
scale-down (and the gateways put their live requests back within a heartbeat,
`endpoints.gateway.presence`). Only an endpoint with no replicas and no known request reads as
"no requests yet".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from django.conf import settings

from controlplane import redis_keys
from controlplane.redis_client import get_redis
from controlplane.redis_keys import key_slot, org_tag, samples_key
from controlplane.redis_scripts import Script
from endpoints.batches import scheduling as batch_scheduling
from endpoints.batches.scheduling import BatchDemand
from endpoints.gateway import traffic
from endpoints.models import SERVING_REPLICA_STATES, Endpoint, Replica


@dataclass(slots=True, frozen=True)
class Load:
    num_inflight: int
    num_waiting: int
    last_request_at: float | None  # unix time
    peak_concurrency: int  # highest in-flight + waiting during the stable window

    @property
    def concurrency(self) -> int:
        return self.num_inflight + self.num_waiting


@dataclass(slots=True, frozen=True)
class Decision:
    desired: int
    reason: str
    batch_rule: str = ""  # "hold", "wake" or "wait" when queued batch work shaped it (`endpoints.batches.scheduling`)


# One Redis Cluster slot per call. KEYS: per endpoint, its in-flight, waiting, last-request and samples keys (4 each).
# ARGV: since (stale cut-off), window start, now, the sample's member prefix ("<now>:"), record (0/1), samples TTL.
# Returns per endpoint: in flight, waiting, last request time ("" if none), peak concurrency in the window.
_READ_LOAD = Script("""
local out = {}
for i = 1, #KEYS, 4 do
  local inflight = redis.call('ZCOUNT', KEYS[i], ARGV[1], '+inf')
  local waiting = redis.call('ZCOUNT', KEYS[i + 1], ARGV[1], '+inf')
  local last = redis.call('GET', KEYS[i + 2]) or ''
  local concurrency = inflight + waiting
  local peak = concurrency
  for _, sample in ipairs(redis.call('ZRANGEBYSCORE', KEYS[i + 3], ARGV[2], '+inf')) do
    local value = tonumber(string.match(sample, ':(%d+)$'))
    if value and value > peak then peak = value end
  end
  if ARGV[5] == '1' then
    redis.call('ZADD', KEYS[i + 3], ARGV[3], ARGV[4] .. concurrency)
    redis.call('ZREMRANGEBYSCORE', KEYS[i + 3], '-inf', ARGV[2])
    redis.call('EXPIRE', KEYS[i + 3], ARGV[6])
  end
  out[#out + 1] = inflight
  out[#out + 1] = waiting
  out[#out + 1] = last
  out[#out + 1] = peak
end
return out
""")
# Endpoints per script call: one call never blocks Redis for long.
READ_LOAD_BATCH = 1000


def read_load(endpoint_ids: list[str], *, now: float | None = None, record: bool = True) -> dict[str, Load]:
    """Current load of each endpoint, in one Redis call per thousand endpoints of one Redis Cluster
    slot; records a sample for the stable window. An endpoint that no longer exists reads as idle.

    NOTE: the work runs in Redis (a script) because a tick reads hundreds of endpoints: seven
    pipelined commands each cost the tick far more in the client than in Redis.
    """
    if not endpoint_ids:
        return {}
    now = now or time.time()
    since = now - traffic.STALE_AFTER_S
    window_start = now - settings.AUTOSCALER_STABLE_WINDOW_S
    redis = get_redis()
    args = [since, window_start, now, f"{now:.3f}:", "1" if record else "0", int(settings.AUTOSCALER_STABLE_WINDOW_S) + 60]
    organizations = {str(pk): organization_id for pk, organization_id in
                     Endpoint.objects.filter(pk__in=endpoint_ids).order_by().values_list("pk", "organization_id")}
    by_slot: dict[int, list[tuple[str, int]]] = {}
    for endpoint_id in endpoint_ids:
        if (organization_id := organizations.get(endpoint_id)) is not None:
            by_slot.setdefault(key_slot(org_tag(organization_id)), []).append((endpoint_id, organization_id))
    loads = {endpoint_id: Load(0, 0, None, 0) for endpoint_id in endpoint_ids}
    for in_slot in by_slot.values():
        for first in range(0, len(in_slot), READ_LOAD_BATCH):
            batch = in_slot[first: first + READ_LOAD_BATCH]
            keys = []
            for endpoint_id, organization_id in batch:
                keys += [redis_keys.inflight_key(organization_id, endpoint_id), redis_keys.waiting_key(organization_id, endpoint_id),
                         redis_keys.last_request_key(organization_id, endpoint_id), samples_key(organization_id, endpoint_id)]
            raw = _READ_LOAD.run_sync(keys=keys, args=args)
            for index, (endpoint_id, _) in enumerate(batch):
                inflight, waiting, last, peak = raw[4 * index: 4 * index + 4]
                loads[endpoint_id] = Load(int(inflight), int(waiting), float(last) if last else None, int(peak))
    unknown = [endpoint_id for endpoint_id, load in loads.items() if load.last_request_at is None]
    if unknown:
        _unknown_is_now(redis, loads, unknown, now, organizations)
    return loads


def _unknown_is_now(redis, loads: dict[str, Load], unknown: list[str], now: float, organizations: dict) -> None:
    """Endpoints with replicas but no last-request time in Redis: it was lost, so it is now (see above)."""
    serving = {str(pk) for pk in Replica.objects.filter(endpoint_id__in=unknown, state__in=SERVING_REPLICA_STATES)
               .order_by().values_list("endpoint_id", flat=True).distinct()}
    for endpoint_id in serving:
        # NOTE: NX: a gateway that wrote a real time meanwhile wins; the next tick reads it.
        redis.set(redis_keys.last_request_key(organizations[endpoint_id], endpoint_id), now, nx=True)
        load = loads[endpoint_id]
        loads[endpoint_id] = Load(load.num_inflight, load.num_waiting, now, load.peak_concurrency)


def decide(endpoint, load: Load, *, now: float | None = None, batch: BatchDemand | None = None, num_ready: int = 0,
           num_serving: int = 0) -> Decision:
    """Replicas the endpoint should have for its interactive `load`, then for its queued `batch` work
    given its `num_ready` READY (of `num_serving` serving) replicas."""
    now = now or time.time()
    if endpoint.paused_at is not None or endpoint.deleted_at is not None:
        return Decision(0, "paused" if endpoint.deleted_at is None else "deleted")
    interactive = _decide_interactive(endpoint, load, now)
    if batch is None:
        return interactive
    verdict = batch_scheduling.apply(
        interactive.desired, interactive.reason, demand=batch, num_ready=num_ready, num_serving=num_serving,
        target_concurrency=endpoint.target_concurrency, max_replicas=endpoint.max_replicas,
        cold_start_s=endpoint.cold_start_timeout_s, seconds_per_line=settings.BATCH_SECONDS_PER_LINE, now=now)
    return Decision(verdict.desired, verdict.reason, verdict.rule)


def _decide_interactive(endpoint, load: Load, now: float) -> Decision:
    idle_s = None if load.last_request_at is None else now - load.last_request_at
    if load.concurrency == 0 and (idle_s is None or idle_s >= endpoint.idle_timeout_s):
        if endpoint.min_replicas == 0:
            reason = "no requests yet" if idle_s is None else f"idle for {idle_s:.0f} s (timeout {endpoint.idle_timeout_s} s)"
            return Decision(0, f"scale to zero: {reason}")
        return Decision(endpoint.min_replicas, f"idle: min_replicas {endpoint.min_replicas}")
    target = max(endpoint.target_concurrency, 1)
    want_now = math.ceil(load.concurrency / target)
    want_stable = math.ceil(load.peak_concurrency / target)
    desired = max(want_now, want_stable, 1)
    bounded = min(max(desired, endpoint.min_replicas), endpoint.max_replicas)
    reason = (
        f"{load.num_inflight} in flight + {load.num_waiting} waiting, peak {load.peak_concurrency} in "
        f"{settings.AUTOSCALER_STABLE_WINDOW_S:.0f} s, target {target} per replica"
    )
    if bounded != desired:
        reason += f" (bounded to {endpoint.min_replicas}..{endpoint.max_replicas})"
    return Decision(bounded, reason)
