"""How many replicas an endpoint should have, from the traffic the gateways see and what its engines feel.

    desired = max(ceil((in flight + waiting) / target_concurrency),   the load right now
                  ceil(stable-window peak / target_concurrency),       no scale-down before the window passes
                  engine pressure,                                     queues and KV cache inside the engines
                  panic)                                               load doubling within seconds
    bounded by the floor (min_replicas, open pre-warm windows, keep-warm after a cold start) and max_replicas.

As in Knative's autoscaler, scaling up acts on the load right now (a burst is served at once),
while scaling down acts on the highest load seen during the stable window (default 60 s), so a dip
does not throw replicas away. Two signals are an LLM server's own:
  * engine capacity: when the READY replicas' engines queue requests (their batch or KV cache is
    full) or their KV cache is above `KV_CACHE_PRESSURE` on average, the sequences each one runs
    right then is what a replica really holds; it is remembered for the stable window (Redis) and
    replaces `target_concurrency` while lower, for the load now, the window's peak and the engines'
    queue (n READY replicas queueing q want n + ceil(q / capacity)). What a node reports only refines
    what the gateways count themselves: a replica's engine is believed to run and queue no more than the
    requests the gateways have outstanding on it (their counters in Redis, which no node can write), and
    a report that claims more teaches no capacity (`_engine_signals`);
  * panic: while a load that at least doubled (`PANIC_GROWTH`) within the panic window (default
    6 s) is in the stable window, no READY replica is let go, as in Knative's panic mode: the
    next burst of a bursty endpoint finds them warm. (Sizing one doubling ahead was measured too,
    `bench/bench_trace.py`: more GPU-seconds and replica starts, no better p99.)
With nothing in flight or waiting for `idle_timeout_s`, an endpoint falls back to its floor, zero
for a serverless one outside its pre-warm windows. Every decision carries its inputs (`Decision.inputs`),
which the scheduler writes with each scale event. Queued batch work then holds warm replicas, or
wakes a sleeping endpoint when its deadline needs it (`endpoints.batches.scheduling.apply`).

One clock: the gateways stamp requests with Redis's (`TIME` in their scripts, `endpoints.gateway.traffic`) and
the tick reads the load and decides at Redis's "now" (`redis_time`), never the worker's own, so a clock that stepped
on either side (NTP, a VM resumed) changes no endpoint's idle time.

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

from controlplane import redis_keys
from controlplane.redis_client import get_redis, redis_time
from controlplane.redis_keys import key_slot, org_tag, samples_key
from controlplane.redis_scripts import Script
from endpoints import prewarm
from endpoints.batches import scheduling as batch_scheduling
from endpoints.batches.scheduling import BatchDemand
from endpoints.gateway import traffic
from endpoints.models import SERVING_REPLICA_STATES, Endpoint, Replica
from gpu_agent.protocol import ReplicaState

# Average KV-cache use of the READY replicas above which one more replica is wanted.
KV_CACHE_PRESSURE = 0.9
# Load this many times the lowest of the panic window before it: a surge (panic for the stable window).
PANIC_GROWTH = 2.0


@dataclass(slots=True, frozen=True)
class Load:
    num_inflight: int
    num_waiting: int
    last_request_at: float | None  # unix time
    peak_concurrency: int  # highest in-flight + waiting during the stable window
    surge: int | None = None  # highest load that at least doubled within a panic window, this stable window
    num_ready: int = 0  # READY replicas
    engine_waiting: int = 0  # requests queued inside the READY replicas' engines
    kv_cache_usage: float = 0.0  # the READY replicas' average KV-cache use, 0..1
    engine_capacity: float | None = None  # sequences a replica ran when its engine last queued (stable window)
    last_busy_at: float | None = None  # unix time: the stable window's last sample with load (None: none had any)

    @property
    def concurrency(self) -> int:
        return self.num_inflight + self.num_waiting

    @property
    def idle_since(self) -> float | None:
        """When the endpoint was last seen with load or asked anything (None: never).

        NOTE: not the last request's start or end alone: a call in flight for longer than the idle timeout whose
        gateway's beats stopped for a few seconds (a stall, a Redis failover) had its count released, and the
        endpoint read as idle since that call began: scaled to zero, its replica drained under its live streams.
        """
        if self.last_busy_at is None:
            return self.last_request_at
        return max(self.last_request_at or 0.0, self.last_busy_at)


@dataclass(slots=True, frozen=True)
class Decision:
    desired: int
    reason: str
    inputs: dict = field(default_factory=dict)  # what the decision read, for the event log
    batch_rule: str = ""  # "hold", "wake" or "wait" when queued batch work shaped it (`endpoints.batches.scheduling`)


# One Redis Cluster slot per call. KEYS: per endpoint, its in-flight, waiting, last-request, samples and capacity
# keys (5 each). ARGV: since (stale cut-off), window start, now, the sample's member prefix ("<now>:"), record (0/1),
# samples TTL, panic window seconds, panic growth.
# Returns per endpoint: in flight, waiting, last request time ("" if none), peak concurrency in the window,
# surge ("" if none: the highest concurrency, samples and now, that was at least `growth` times the lowest of
# the panic window before it), learned engine capacity ("" if none), the window's last sample with load ("" if none).
_READ_LOAD = Script("""
local out = {}
local panic, growth = tonumber(ARGV[7]), tonumber(ARGV[8])
for i = 1, #KEYS, 5 do
  local inflight = redis.call('ZCOUNT', KEYS[i], ARGV[1], '+inf')
  local waiting = redis.call('ZCOUNT', KEYS[i + 1], ARGV[1], '+inf')
  local last = redis.call('GET', KEYS[i + 2]) or ''
  local concurrency = inflight + waiting
  local peak = concurrency
  local times, values = {}, {}
  local busy = ''
  local raw = redis.call('ZRANGEBYSCORE', KEYS[i + 3], ARGV[2], '+inf', 'WITHSCORES')
  for j = 1, #raw, 2 do
    local value = tonumber(string.match(raw[j], ':(%d+)$'))
    if value then
      if value > peak then peak = value end
      if value > 0 then busy = raw[j + 1] end
      times[#times + 1] = tonumber(raw[j + 1])
      values[#values + 1] = value
    end
  end
  times[#times + 1] = tonumber(ARGV[3])
  values[#values + 1] = concurrency
  local surge = ''
  for j = 2, #values do
    local low = nil
    for k = j - 1, 1, -1 do
      if times[j] - times[k] > panic then break end
      if low == nil or values[k] < low then low = values[k] end
    end
    if low ~= nil and values[j] >= growth * math.max(low, 1) and (surge == '' or values[j] > surge) then
      surge = values[j]
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
  out[#out + 1] = surge
  out[#out + 1] = redis.call('GET', KEYS[i + 4]) or ''
  out[#out + 1] = busy
end
return out
""")
# Endpoints per script call: one call never blocks Redis for long.
READ_LOAD_BATCH = 1000


def read_load(endpoint_ids: list[str], *, now: float | None = None, record: bool = True) -> dict[str, Load]:
    """Current load of each endpoint, in one Redis call per thousand endpoints of one Redis Cluster
    slot; records a sample for the stable window. An endpoint that no longer exists reads as idle.
    `now`: Redis's clock (`redis_time`, read here when None), which the gateways stamp requests with.

    NOTE: the work runs in Redis (a script) because a tick reads hundreds of endpoints: seven
    pipelined commands each cost the tick far more in the client than in Redis.
    """
    if not endpoint_ids:
        return {}
    redis = get_redis()
    now = redis_time(redis) if now is None else now
    since = now - traffic.STALE_AFTER_S
    window_start = now - settings.AUTOSCALER_STABLE_WINDOW_S
    args = [since, window_start, now, f"{now:.3f}:", "1" if record else "0", int(settings.AUTOSCALER_STABLE_WINDOW_S) + 60,
            settings.AUTOSCALER_PANIC_WINDOW_S, PANIC_GROWTH]
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
                         redis_keys.last_request_key(organization_id, endpoint_id), samples_key(organization_id, endpoint_id),
                         redis_keys.capacity_key(organization_id, endpoint_id)]
            raw = _READ_LOAD.run_sync(keys=keys, args=args)
            engines = _engine_signals(redis, batch)
            learned = {}
            for index, (endpoint_id, organization_id) in enumerate(batch):
                inflight, waiting, last, peak, surge, capacity, busy = raw[7 * index: 7 * index + 7]
                engine = engines.get(endpoint_id, _NO_ENGINES)
                capacity = float(capacity) if capacity not in ("", None) else None
                if record and engine.can_teach_capacity():
                    # The engines are full at this many sequences each: that is what a replica holds now.
                    capacity = engine.num_running / engine.num_ready
                    learned[redis_keys.capacity_key(organization_id, endpoint_id)] = capacity
                loads[endpoint_id] = Load(int(inflight), int(waiting), float(last) if last else None, int(peak),
                                          int(surge) if surge not in ("", None) else None,
                                          engine.num_ready, engine.num_waiting, engine.kv_cache_usage, capacity,
                                          float(busy) if busy not in ("", None) else None)
            if learned:
                with redis.pipeline(transaction=False) as pipe:
                    for key, capacity in learned.items():
                        pipe.set(key, f"{capacity:.3f}", ex=max(1, int(settings.AUTOSCALER_STABLE_WINDOW_S)))
                    pipe.execute()
    unknown = [endpoint_id for endpoint_id, load in loads.items() if load.last_request_at is None]
    if unknown:
        _unknown_is_now(redis, loads, unknown, now, organizations)
    return loads


@dataclass(slots=True, frozen=True)
class _Engines:
    """What an endpoint's READY replicas' engines report, as far as the gateways' own counts bear it out."""

    num_ready: int = 0
    num_running: int = 0  # sequences decoded, each replica's at most `SEQUENCES_PER_CALL` a call the gateways have on it
    num_waiting: int = 0  # sequences queued, each replica's at most that bound less what it runs
    kv_cache_usage: float = 0.0  # average; a replica that runs none of the gateways' requests holds none
    contradicted: bool = False  # a replica reported more requests than the gateways have on it

    def can_teach_capacity(self) -> bool:
        """The engines are full (they queue, or their KV cache is) at the sequences they run, and no replica's
        report claims more than the gateways sent it: a lie or a stale report teaches no capacity."""
        return (bool(self.num_ready and self.num_running) and not self.contradicted
                and (self.num_waiting > 0 or self.kv_cache_usage >= KV_CACHE_PRESSURE))


_NO_ENGINES = _Engines()
# The most engine requests one gateway call makes: its `n` (at most `endpoints.gateway.request.MAX_N`).
SEQUENCES_PER_CALL = 16


def _engine_signals(redis, batch: list[tuple[str, int]]) -> dict[str, _Engines]:
    """Per endpoint of `batch` ((endpoint id, organisation id), one Redis Cluster slot): its READY replicas'
    engines (one query, one MGET).

    From the replicas' last heartbeats (`endpoints.replicas.record_report`), a few seconds old at most, bounded by
    each replica's outstanding count (`endpoints.gateway.traffic`: the requests the gateways sent it and have not
    seen end, every interactive call and batch line). NOTE: a node writes its own reports, never those counters:
    one hosting a replica of another tenant's endpoint reported two billion queued requests and a full KV cache at
    one sequence, and the endpoint was scaled to `max_replicas`, all placed on that node, with a learned capacity
    of one for the stable window.
    """
    organizations = dict(batch)
    rows = list(Replica.objects.filter(endpoint_id__in=list(organizations), state=ReplicaState.READY).order_by()
                .values_list("pk", "endpoint_id", "num_running", "num_waiting", "kv_cache_usage"))
    reporting = [row for row in rows if row[2] or row[3] or row[4]]  # an idle engine's report needs no count
    counters = [redis_keys.outstanding_key(organizations[str(row[1])], str(row[0])) for row in reporting]
    counts = redis.mget(counters) if counters else []
    outstanding = {row[0]: int(count or 0) for row, count in zip(reporting, counts, strict=True)}
    believed: dict[str, list[tuple[int, int, float, bool]]] = {}
    for pk, endpoint_id, running, waiting, kv_cache_usage in rows:
        sent = outstanding.get(pk, 0)
        # NOTE: vLLM runs a call of `n` sequences as `n` requests: an honest engine saturated by 4 calls of n=8
        # reports 32; bounded by the calls alone, its queue was dropped and the endpoint never scaled up on it.
        bound = sent * SEQUENCES_PER_CALL
        runs = min(running, bound)
        believed.setdefault(str(endpoint_id), []).append(
            (runs, min(waiting, bound - runs), kv_cache_usage if runs else 0.0, running + waiting > sent))
    return {endpoint_id: _Engines(len(replicas), sum(r[0] for r in replicas), sum(r[1] for r in replicas),
                                  sum(r[2] for r in replicas) / len(replicas), any(r[3] for r in replicas))
            for endpoint_id, replicas in believed.items()}


def _unknown_is_now(redis, loads: dict[str, Load], unknown: list[str], now: float, organizations: dict) -> None:
    """Endpoints with replicas but no last-request time in Redis: it was lost, so it is now (see above)."""
    serving = {str(pk) for pk in Replica.objects.filter(endpoint_id__in=unknown, state__in=SERVING_REPLICA_STATES)
               .order_by().values_list("endpoint_id", flat=True).distinct()}
    for endpoint_id in serving:
        # NOTE: NX: a gateway that wrote a real time meanwhile wins; the next tick reads it.
        redis.set(redis_keys.last_request_key(organizations[endpoint_id], endpoint_id), now, nx=True)
        loads[endpoint_id] = dataclasses.replace(loads[endpoint_id], last_request_at=now)


def floor(endpoint, now: float, *, idle_cap_s: int = 0) -> prewarm.Floor:
    """The fewest replicas the endpoint keeps now: min_replicas, an open pre-warm window, or keep-warm (no longer than
    `idle_cap_s` where set: `quota_room.idle_caps`, and then neither of the others)."""
    at = datetime.fromtimestamp(now, UTC)
    keep_warm = prewarm.keep_warm_floor(idle_timeout_s(endpoint.keep_warm_after_cold_start_s, idle_cap_s),
                                        endpoint.last_cold_start_at, at)
    if idle_cap_s:
        # NOTE: a warm floor is replicas kept idle for as long as it says, without a call: an organisation held to an
        # idle cap (no payment method) kept `min_replicas` (up to its `max_min_replicas` quota) GPUs, and their pools'
        # machines, for ever, for nothing. Its floors apply once it has a card (`floor_needs_a_card`).
        return keep_warm
    floors = [prewarm.Floor(endpoint.min_replicas, f"min_replicas {endpoint.min_replicas}"),
              prewarm.window_floor(endpoint.prewarm_windows, at), keep_warm]
    return max(floors, key=lambda candidate: candidate.replicas)


def floor_needs_a_card(endpoint, now: float, idle_cap_s: int) -> bool:
    """Whether the endpoint asks for a warm floor (`min_replicas`, an open pre-warm window) its organisation's idle cap
    keeps it from (`floor`)."""
    return bool(idle_cap_s) and (endpoint.min_replicas > 0 or prewarm.window_floor(
        endpoint.prewarm_windows, datetime.fromtimestamp(now, UTC)).replicas > 0)


def idle_timeout_s(seconds: int, idle_cap_s: int = 0) -> int:
    """An endpoint's idle time (`idle_timeout_s`, `keep_warm_after_cold_start_s`) as its organisation may keep it:
    no longer than `idle_cap_s` where set (`quota_room.idle_caps`: one without a payment method)."""
    return min(seconds, idle_cap_s) if idle_cap_s else seconds


def decide(endpoint, load: Load, *, now: float | None = None, batch: BatchDemand | None = None, num_ready: int = 0,
           num_serving: int = 0, idle_cap_s: int = 0) -> Decision:
    """Replicas the endpoint should have for its interactive `load`, then for its queued `batch` work
    given its `num_ready` READY (of `num_serving` serving) replicas, at `now`: the clock `load` was read at
    (`read_load`'s, Redis's; the process's own only where no Redis is, as in the benchmarks). The batch's deadline is
    judged by the clock the demand was read at (`BatchDemand.read_at`, PostgreSQL's), as it was stamped. `idle_cap_s`:
    the longest its organisation keeps an idle replica (`quota_room.idle_caps`; 0: the endpoint's own times)."""
    now = now or time.time()
    if endpoint.paused_at is not None or endpoint.deleted_at is not None:
        return Decision(0, "paused" if endpoint.deleted_at is None else "deleted")
    interactive = _decide_interactive(endpoint, load, now, idle_cap_s)
    if batch is None:
        return interactive
    verdict = batch_scheduling.apply(
        interactive.desired, interactive.reason, demand=batch, num_ready=num_ready, num_serving=num_serving,
        target_concurrency=endpoint.target_concurrency, max_replicas=endpoint.max_replicas,
        cold_start_s=endpoint.cold_start_timeout_s, seconds_per_line=settings.BATCH_SECONDS_PER_LINE, now=now)
    return Decision(verdict.desired, verdict.reason, interactive.inputs | {"batch": verdict.rule}, batch_rule=verdict.rule)


def idle_deadline(endpoint, load: Load, num_serving: int, now: float, *, idle_cap_s: int = 0) -> float | None:
    """When the idle timeout will let the endpoint drop replicas, if that moment falls before the next
    tick and nothing else changes meanwhile: nothing in flight, a known last request and a floor at
    that moment below the `num_serving` replicas it has. None otherwise.

    The tick reconciles such an endpoint at this moment rather than at its next pass
    (`scheduler.schedule_idle_deadlines`), so scale to zero lands at the idle deadline, not up to a
    tick later.
    """
    if load.concurrency or load.last_request_at is None or not num_serving:
        return None
    if endpoint.paused_at is not None or endpoint.deleted_at is not None:
        return None
    deadline = load.idle_since + idle_timeout_s(endpoint.idle_timeout_s, idle_cap_s)
    if not now < deadline < now + settings.AUTOSCALER_TICK_S:  # NOTE: first: `floor` reads pre-warm windows
        return None
    if min(floor(endpoint, deadline, idle_cap_s=idle_cap_s).replicas, endpoint.max_replicas) >= num_serving:
        return None
    return deadline


def _decide_interactive(endpoint, load: Load, now: float, idle_cap_s: int = 0) -> Decision:
    lowest = floor(endpoint, now, idle_cap_s=idle_cap_s)
    timeout_s = idle_timeout_s(endpoint.idle_timeout_s, idle_cap_s)
    lowest_replicas = min(lowest.replicas, endpoint.max_replicas)
    idle_s = None if load.last_request_at is None else now - load.idle_since
    inputs = {"in_flight": load.num_inflight, "waiting": load.num_waiting, "peak": load.peak_concurrency,
              "surge": load.surge, "ready": load.num_ready, "engine_waiting": load.engine_waiting,
              "kv_cache_usage": round(load.kv_cache_usage, 3), "engine_capacity": load.engine_capacity,
              "idle_s": None if idle_s is None else round(idle_s, 1), "floor": lowest_replicas,
              "target": endpoint.target_concurrency}
    if load.concurrency == 0 and (idle_s is None or idle_s >= timeout_s):
        if lowest_replicas == 0:
            reason = "no requests yet" if idle_s is None else f"idle for {idle_s:.0f} s (timeout {timeout_s} s" + (
                ", the most without a payment method)" if timeout_s < endpoint.idle_timeout_s else ")")
            if floor_needs_a_card(endpoint, now, idle_cap_s):
                reason += "; its warm floor (min_replicas, pre-warm windows) needs a payment method"
            return Decision(0, f"scale to zero: {reason}", inputs)
        return Decision(lowest_replicas, f"idle: {lowest.reason}", inputs)
    target = max(endpoint.target_concurrency, 1)
    # An engine that queued (or filled its KV cache) at c sequences holds c, whatever the target says.
    per_replica = target if load.engine_capacity is None else max(1.0, min(target, load.engine_capacity))
    want_now = math.ceil(load.concurrency / per_replica)
    want_stable = math.ceil(load.peak_concurrency / per_replica)
    want_engine = load.num_ready + math.ceil(load.engine_waiting / per_replica) if load.num_ready and load.engine_waiting else 0
    # A surge this stable window (load at least doubled within the panic window, past one replica's
    # worth): as in Knative's panic mode, nothing READY is let go until the window passes.
    panic = load.surge is not None and load.surge >= per_replica
    want_panic = load.num_ready if panic else 0
    desired = max(want_now, want_stable, want_engine, want_panic, 1)
    bounded = min(max(desired, lowest_replicas), endpoint.max_replicas)
    reason = (
        f"{load.num_inflight} in flight + {load.num_waiting} waiting, peak {load.peak_concurrency} in "
        f"{settings.AUTOSCALER_STABLE_WINDOW_S:.0f} s, target {target} per replica"
    )
    if per_replica < target:
        reason += (f"; engines hold {per_replica:.1f} each (queue {load.engine_waiting}, KV cache "
                   f"{100 * load.kv_cache_usage:.0f}% on {load.num_ready} ready)")
    elif want_engine > max(want_now, want_stable):
        reason += f"; engines queue {load.engine_waiting} on {load.num_ready} ready"
    if panic:
        reason += f"; panic: load doubled to {load.surge} within {settings.AUTOSCALER_PANIC_WINDOW_S:.0f} s, holding {load.num_ready} ready"
    if lowest_replicas > desired:
        reason += f"; floor {lowest_replicas}: {lowest.reason}"
    if bounded < desired:
        reason += f" (bounded to max_replicas {endpoint.max_replicas})"
    return Decision(bounded, reason, inputs | {"panic": panic, "per_replica": round(per_replica, 2)})
