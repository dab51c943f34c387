"""How many replicas an endpoint should have, from the traffic the gateways see and what its engines feel.

    desired = max(ceil((in flight + waiting) / target_concurrency),   the load right now
                  ceil(stable-window peak / target_concurrency),       no scale-down before the window passes
                  engine pressure,                                     queues and KV cache inside the engines
                  panic)                                               load doubling within seconds
    bounded by the floor (min_replicas, open pre-warm windows, keep-warm after a cold start) and max_replicas.

As in Knative's autoscaler, scaling up acts on the load right now (a burst is served at once),
while scaling down acts on the highest load seen during the stable window (default 60 s), so a dip
does not throw replicas away. Two signals are an LLM server's own:
  * engine pressure: the engines' waiting queues (requests admitted but not yet scheduled because
    the batch or the KV cache is full) and their KV-cache use, from the replicas' heartbeats. A
    queue of q on n READY replicas wants n + ceil(q / target) replicas; a KV cache above
    `KV_CACHE_PRESSURE` on average wants one more, since the engine is about to preempt;
  * panic: when the load is at least `PANIC_GROWTH` times the lowest load of the panic window
    (default 6 s) and above what the READY replicas are sized for, the load is taken to keep
    growing: the endpoint gets enough replicas for `PANIC_GROWTH` times the load now (one more
    doubling), since a replica takes tens of seconds to start.
With nothing in flight or waiting for `idle_timeout_s`, an endpoint falls back to its floor, zero
for a serverless one outside its pre-warm windows. Every decision carries its inputs (`Decision.inputs`),
which the scheduler writes with each scale event.

Redis is a cache of this state, not its record: an endpoint that has replicas but no last-request
time in Redis (a restart without persistence, a flush) is read as "a request just now", never as
idle, and that time is written back, so its replicas get a whole `idle_timeout_s` before any
scale-down (and the gateways put their live requests back within a heartbeat,
`endpoints.gateway.presence`). Only an endpoint with no replicas and no known request reads as
"no requests yet".
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from django.conf import settings
from django.db.models import Count, Q, Sum

from controlplane import redis_keys
from controlplane.redis_client import get_redis
from controlplane.redis_keys import key_slot, org_tag, samples_key
from controlplane.redis_scripts import Script
from endpoints import prewarm
from endpoints.gateway import traffic
from endpoints.models import SERVING_REPLICA_STATES, Endpoint, Replica
from gpu_agent.protocol import ReplicaState

# Average KV-cache use of the READY replicas above which one more replica is wanted.
KV_CACHE_PRESSURE = 0.9
# Load this many times the panic window's lowest, and above the READY replicas' size: panic.
PANIC_GROWTH = 2.0


@dataclass(slots=True, frozen=True)
class Load:
    num_inflight: int
    num_waiting: int
    last_request_at: float | None  # unix time
    peak_concurrency: int  # highest in-flight + waiting during the stable window
    panic_low: int | None = None  # lowest in-flight + waiting during the panic window (None: no sample)
    num_ready: int = 0  # READY replicas
    engine_waiting: int = 0  # requests queued inside the READY replicas' engines
    kv_cache_usage: float = 0.0  # the READY replicas' average KV-cache use, 0..1

    @property
    def concurrency(self) -> int:
        return self.num_inflight + self.num_waiting


@dataclass(slots=True, frozen=True)
class Decision:
    desired: int
    reason: str
    inputs: dict = field(default_factory=dict)  # what the decision read, for the event log


# One Redis Cluster slot per call. KEYS: per endpoint, its in-flight, waiting, last-request and samples keys (4 each).
# ARGV: since (stale cut-off), window start, now, the sample's member prefix ("<now>:"), record (0/1), samples TTL,
# panic window start.
# Returns per endpoint: in flight, waiting, last request time ("" if none), peak concurrency in the window,
# lowest concurrency in the panic window ("" if no sample there).
_READ_LOAD = Script("""
local out = {}
for i = 1, #KEYS, 4 do
  local inflight = redis.call('ZCOUNT', KEYS[i], ARGV[1], '+inf')
  local waiting = redis.call('ZCOUNT', KEYS[i + 1], ARGV[1], '+inf')
  local last = redis.call('GET', KEYS[i + 2]) or ''
  local concurrency = inflight + waiting
  local peak = concurrency
  local low = ''
  local low_candidate = nil
  local panic_start = tonumber(ARGV[7])
  for _, sample in ipairs(redis.call('ZRANGEBYSCORE', KEYS[i + 3], ARGV[2], '+inf', 'WITHSCORES')) do
    if _ % 2 == 1 then
      local value = tonumber(string.match(sample, ':(%d+)$'))
      if value and value > peak then peak = value end
      low_candidate = value
    else
      if low_candidate and tonumber(sample) >= panic_start and (low == '' or low_candidate < low) then low = low_candidate end
      low_candidate = nil
    end
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
  out[#out + 1] = low
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
    args = [since, window_start, now, f"{now:.3f}:", "1" if record else "0", int(settings.AUTOSCALER_STABLE_WINDOW_S) + 60,
            now - settings.AUTOSCALER_PANIC_WINDOW_S]
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
            engines = _engine_signals([endpoint_id for endpoint_id, _ in batch])
            for index, (endpoint_id, _) in enumerate(batch):
                inflight, waiting, last, peak, low = raw[5 * index: 5 * index + 5]
                num_ready, engine_waiting, kv_cache_usage = engines.get(endpoint_id, (0, 0, 0.0))
                loads[endpoint_id] = Load(int(inflight), int(waiting), float(last) if last else None, int(peak),
                                          int(low) if low not in ("", None) else None,
                                          num_ready, engine_waiting, kv_cache_usage)
    unknown = [endpoint_id for endpoint_id, load in loads.items() if load.last_request_at is None]
    if unknown:
        _unknown_is_now(redis, loads, unknown, now, organizations)
    return loads


def _engine_signals(endpoint_ids: list[str]) -> dict[str, tuple[int, int, float]]:
    """Per endpoint: READY replicas, requests queued in their engines, their average KV-cache use (one query).

    From the replicas' last heartbeats (`endpoints.replicas.record_report`), a few seconds old at most.
    """
    ready = Q(replicas__state=ReplicaState.READY)
    rows = (Endpoint.objects.filter(pk__in=endpoint_ids).order_by()
            .annotate(num_ready=Count("replicas", filter=ready),
                      engine_waiting=Sum("replicas__num_waiting", filter=ready),
                      kv_cache_total=Sum("replicas__kv_cache_usage", filter=ready))
            .values_list("pk", "num_ready", "engine_waiting", "kv_cache_total"))
    return {str(pk): (num, waiting or 0, (kv or 0.0) / num if num else 0.0) for pk, num, waiting, kv in rows}


def _unknown_is_now(redis, loads: dict[str, Load], unknown: list[str], now: float, organizations: dict) -> None:
    """Endpoints with replicas but no last-request time in Redis: it was lost, so it is now (see above)."""
    serving = {str(pk) for pk in Replica.objects.filter(endpoint_id__in=unknown, state__in=SERVING_REPLICA_STATES)
               .order_by().values_list("endpoint_id", flat=True).distinct()}
    for endpoint_id in serving:
        # NOTE: NX: a gateway that wrote a real time meanwhile wins; the next tick reads it.
        redis.set(redis_keys.last_request_key(organizations[endpoint_id], endpoint_id), now, nx=True)
        loads[endpoint_id] = dataclasses.replace(loads[endpoint_id], last_request_at=now)


def floor(endpoint, now: float) -> prewarm.Floor:
    """The fewest replicas the endpoint keeps now: min_replicas, an open pre-warm window, or keep-warm."""
    at = datetime.fromtimestamp(now, UTC)
    floors = [prewarm.Floor(endpoint.min_replicas, f"min_replicas {endpoint.min_replicas}"),
              prewarm.window_floor(endpoint.prewarm_windows, at),
              prewarm.keep_warm_floor(endpoint.keep_warm_after_cold_start_s, endpoint.last_cold_start_at, at)]
    return max(floors, key=lambda candidate: candidate.replicas)


def decide(endpoint, load: Load, *, now: float | None = None) -> Decision:
    now = now or time.time()
    if endpoint.paused_at is not None or endpoint.deleted_at is not None:
        return Decision(0, "paused" if endpoint.deleted_at is None else "deleted")
    lowest = floor(endpoint, now)
    lowest_replicas = min(lowest.replicas, endpoint.max_replicas)
    idle_s = None if load.last_request_at is None else now - load.last_request_at
    inputs = {"in_flight": load.num_inflight, "waiting": load.num_waiting, "peak": load.peak_concurrency,
              "panic_low": load.panic_low, "ready": load.num_ready, "engine_waiting": load.engine_waiting,
              "kv_cache_usage": round(load.kv_cache_usage, 3), "idle_s": None if idle_s is None else round(idle_s, 1),
              "floor": lowest_replicas, "target": endpoint.target_concurrency}
    if load.concurrency == 0 and (idle_s is None or idle_s >= endpoint.idle_timeout_s):
        if lowest_replicas == 0:
            reason = "no requests yet" if idle_s is None else f"idle for {idle_s:.0f} s (timeout {endpoint.idle_timeout_s} s)"
            return Decision(0, f"scale to zero: {reason}", inputs)
        return Decision(lowest_replicas, f"idle: {lowest.reason}", inputs)
    target = max(endpoint.target_concurrency, 1)
    want_now = math.ceil(load.concurrency / target)
    want_stable = math.ceil(load.peak_concurrency / target)
    want_engine = 0
    if load.num_ready and load.engine_waiting > 0:
        want_engine = load.num_ready + math.ceil(load.engine_waiting / target)
    if load.num_ready and load.kv_cache_usage >= KV_CACHE_PRESSURE:
        want_engine = max(want_engine, load.num_ready + 1)
    panic = (load.panic_low is not None and load.concurrency >= PANIC_GROWTH * max(load.panic_low, 1)
             and load.concurrency > load.num_ready * target)
    want_panic = math.ceil(PANIC_GROWTH * load.concurrency / target) if panic else 0
    desired = max(want_now, want_stable, want_engine, want_panic, 1)
    bounded = min(max(desired, lowest_replicas), endpoint.max_replicas)
    reason = (
        f"{load.num_inflight} in flight + {load.num_waiting} waiting, peak {load.peak_concurrency} in "
        f"{settings.AUTOSCALER_STABLE_WINDOW_S:.0f} s, target {target} per replica"
    )
    if want_engine > max(want_now, want_stable):
        reason += (f"; engines queue {load.engine_waiting}, KV cache {100 * load.kv_cache_usage:.0f}% "
                   f"on {load.num_ready} ready")
    if panic:
        reason += f"; panic: load {load.concurrency} from {load.panic_low} in {settings.AUTOSCALER_PANIC_WINDOW_S:.0f} s"
    if lowest_replicas > desired:
        reason += f"; floor {lowest_replicas}: {lowest.reason}"
    if bounded < desired:
        reason += f" (bounded to max_replicas {endpoint.max_replicas})"
    return Decision(bounded, reason, inputs | {"panic": panic, "want_engine": want_engine})
