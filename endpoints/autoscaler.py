"""How many replicas an endpoint should have, from the traffic the gateways see.

desired = ceil((in flight + waiting) / target_concurrency), bounded by min and max replicas.
As in Knative's autoscaler, scaling up acts on the load right now (a burst is
served at once), while scaling down acts on the highest load seen during the
stable window (default 60 s), so a dip does not throw replicas away. With
nothing in flight or waiting for `idle_timeout_s`, an endpoint falls back to
`min_replicas`, zero for a serverless one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from django.conf import settings

from controlplane.redis_client import get_redis
from endpoints.gateway import traffic


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


def samples_key(endpoint_id: str) -> str:
    return f"as:samples:{endpoint_id}"


def read_load(endpoint_ids: list[str], *, now: float | None = None, record: bool = True) -> dict[str, Load]:
    """Current load of each endpoint, in two Redis round trips; records a sample for the stable window."""
    if not endpoint_ids:
        return {}
    now = now or time.time()
    since = now - traffic.STALE_AFTER_S
    window_start = now - settings.AUTOSCALER_STABLE_WINDOW_S
    redis = get_redis()
    with redis.pipeline(transaction=False) as pipe:
        for endpoint_id in endpoint_ids:
            pipe.zcount(traffic.inflight_key(endpoint_id), since, "+inf")
            pipe.zcount(traffic.waiting_key(endpoint_id), since, "+inf")
            pipe.get(traffic.last_request_key(endpoint_id))
            pipe.zrangebyscore(samples_key(endpoint_id), window_start, "+inf")
        raw = pipe.execute()
    loads = {}
    with redis.pipeline(transaction=False) as pipe:
        for index, endpoint_id in enumerate(endpoint_ids):
            inflight, waiting, last, samples = raw[4 * index: 4 * index + 4]
            concurrency = inflight + waiting
            peak = max([concurrency] + [int(sample.split(":")[1]) for sample in samples])
            loads[endpoint_id] = Load(inflight, waiting, float(last) if last else None, peak)
            if record:
                pipe.zadd(samples_key(endpoint_id), {f"{now:.3f}:{concurrency}": now})
                pipe.zremrangebyscore(samples_key(endpoint_id), "-inf", window_start)
                pipe.expire(samples_key(endpoint_id), int(settings.AUTOSCALER_STABLE_WINDOW_S) + 60)
        if record:
            pipe.execute()
    return loads


def decide(endpoint, load: Load, *, now: float | None = None) -> Decision:
    now = now or time.time()
    if endpoint.paused_at is not None or endpoint.deleted_at is not None:
        return Decision(0, "paused" if endpoint.deleted_at is None else "deleted")
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
