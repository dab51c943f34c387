"""Scale to zero on a bursty trace: GPU-seconds saved against always-on, and the latency paid for it.

A pure simulation (no processes, no database): a seeded Markov-modulated Poisson process per
endpoint (idle for long stretches, a trickle, steady use, bursts) over a few hours of simulated
time, replayed against a simulated fleet whose scaling decisions come from the real decision
function, `endpoints.autoscaler.decide(endpoint, Load)`, evaluated as production does: every
autoscaler tick, and at once when a request arrives to an endpoint with no replica (the
gateway's wake-up). Stable-window peaks are kept exactly as `read_load` keeps them.

The fleet model:
  * a new replica holds its GPU from the moment it is placed, and serves after `--cold-start-s`
    (uniform within ±`--cold-start-jitter-s`; measured engine starts here are 25–40 s);
  * a replica serves up to `--slots` requests at once (continuous batching), each for a
    lognormal service time of mean `--service-s`; further requests wait in the gateway's queue,
    first come first served; a request held longer than `--cold-start-timeout-s` is refused (503);
  * a replica told to drain takes nothing new and frees its GPU when its last request ends.

Policies, same trace: scale to zero (min 0), one warm replica (min 1), always-on (min = max).
Then autoscaling signals, same trace: engines of differing capacity (`--engine-slots`, as long prompts
fill a KV cache sooner) that queue what they cannot run, as vLLM does, decided on the gateways' load
only (the policy before the engines' own signals) and with them (queues, KV cache, learned capacity, panic).
Reports GPU-seconds, the saving against always-on, and latency (queueing + cold start + service):
p50 / p99 of the whole request and of the wait alone, and the share of requests that met a cold start.

    .venv/bin/python bench/bench_trace.py [--hours 4] [--endpoints 20] [--seed 7] [--cold-start-s 32]

Writes `bench/results/trace.json` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import os
import platform
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Traffic regimes: requests per second (before the endpoint's own scale) and mean dwell, seconds.
REGIMES = {"idle": (0.0, 1800.0), "trickle": (0.03, 600.0), "steady": (0.4, 900.0), "burst": (3.0, 150.0)}
TRANSITIONS = {
    "idle": {"trickle": 0.5, "steady": 0.3, "burst": 0.2},
    "trickle": {"idle": 0.5, "steady": 0.3, "burst": 0.2},
    "steady": {"idle": 0.3, "trickle": 0.3, "burst": 0.4},
    "burst": {"steady": 0.5, "trickle": 0.3, "idle": 0.2},
}


@dataclass(slots=True)
class Spec:
    """What `decide` reads of an endpoint."""

    min_replicas: int
    max_replicas: int
    target_concurrency: int
    idle_timeout_s: int
    paused_at: None = None
    deleted_at: None = None
    prewarm_windows: tuple = ()
    keep_warm_after_cold_start_s: int = 0
    last_cold_start_at: None = None


def make_trace(rng: random.Random, duration_s: float) -> list[tuple[float, float]]:
    """(arrival time, service seconds) of one endpoint's requests."""
    scale = rng.lognormvariate(0, 0.6)
    regime = rng.choice(list(REGIMES))
    now, arrivals = 0.0, []
    while now < duration_s:
        rate, mean_dwell = REGIMES[regime]
        until = min(duration_s, now + rng.expovariate(1 / mean_dwell))
        rate *= scale
        if rate > 0:
            moment = now + rng.expovariate(rate)
            while moment < until:
                arrivals.append(moment)
                moment += rng.expovariate(rate)
        now = until
        choices = TRANSITIONS[regime]
        regime = rng.choices(list(choices), weights=list(choices.values()))[0]
    return arrivals


@dataclass(slots=True)
class Replica:
    ready_at: float
    placed_at: float
    num_busy: int = 0  # requests on it: running, plus queued in its engine (engine-queue model)
    draining: bool = False
    stopped_at: float | None = None
    engine_queue: deque = field(default_factory=deque)  # (service_s, request index) waiting for a slot


@dataclass
class EndpointSim:
    spec: Spec
    slots: int  # sequences one replica's engine runs at once (its batch and KV cache)
    queue: deque = field(default_factory=deque)  # (arrival, service_s, request index)
    replicas: list = field(default_factory=list)
    samples: deque = field(default_factory=deque)  # (time, concurrency) for the stable window
    last_request_at: float | None = None
    capacity: tuple[float, float] | None = None  # learned sequences per replica, until when

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if not r.draining and r.stopped_at is None]

    def concurrency(self) -> tuple[int, int]:
        return sum(r.num_busy for r in self.replicas if r.stopped_at is None), len(self.queue)


def simulate(traces: list[list[tuple[float, float]]], spec_for, args, decide, Load, *, slots_of=None,
             engine_queue: bool = False, signals: bool = False) -> dict:
    """Replays every endpoint's trace under one policy; returns GPU-seconds and request latencies.

    `engine_queue`: the gateway sends every request to a READY replica at once (least outstanding), and
    each engine runs `slots` of them, queueing the rest inside (as vLLM does), instead of the gateway
    holding requests while every slot is busy. `signals`: the decision also reads the engines' queues,
    their KV-cache use (running ÷ slots) and the panic window, as `read_load` gives them in production.
    """
    counter = itertools.count()
    events: list = []  # (time, order, kind, endpoint index, payload)
    sims = [EndpointSim(spec_for(index), (slots_of or (lambda _: args.slots))(index)) for index in range(len(traces))]
    requests: list[dict] = []
    rng = random.Random(args.seed + 1)

    def push(moment, kind, index, payload=None):
        heapq.heappush(events, (moment, next(counter), kind, index, payload))

    for index, trace in enumerate(traces):
        for arrival, service_s in trace:
            push(arrival, "arrive", index, service_s)
        if spec_for(index).min_replicas:  # a floor is already running when the trace begins
            sims[index].replicas = [Replica(ready_at=0.0, placed_at=0.0) for _ in range(spec_for(index).min_replicas)]
    tick = 0.0
    while tick <= args.hours * 3600:
        push(tick, "tick", -1)
        tick += args.tick_s

    def dispatch(sim: EndpointSim, index: int, now: float):
        while sim.queue:
            ready = [r for r in sim.live() if r.ready_at <= now and (engine_queue or r.num_busy < sim.slots)]
            if not ready:
                return
            replica = min(ready, key=lambda r: r.num_busy)  # the gateway's least outstanding
            arrival, service_s, number = sim.queue.popleft()
            replica.num_busy += 1
            if replica.num_busy > sim.slots:  # only with engine_queue: the engine's batch is full
                replica.engine_queue.append((service_s, number))
                continue
            requests[number]["started_at"] = now
            push(now + service_s, "done", index, (replica, number))

    def engine_next(replica: Replica, index: int, now: float):
        if replica.engine_queue:
            service_s, number = replica.engine_queue.popleft()
            requests[number]["started_at"] = now
            push(now + service_s, "done", index, (replica, number))

    def reconcile(sim: EndpointSim, index: int, now: float):
        inflight, waiting = sim.concurrency()
        window_start = now - args.stable_window_s
        while sim.samples and sim.samples[0][0] < window_start:
            sim.samples.popleft()
        peak = max([inflight + waiting] + [value for _, value in sim.samples])
        if signals:  # what `read_load` gives: the surge of the window, the engines' queues and learned capacity
            ready = [r for r in sim.live() if r.ready_at <= now]
            points = list(sim.samples) + [(now, inflight + waiting)]
            surges = [value for j, (moment, value) in enumerate(points)
                      if (earlier := [v for t, v in points[:j] if moment - t <= args.panic_window_s])
                      and value >= 2 * max(min(earlier), 1)]
            engine_waiting = sum(len(r.engine_queue) for r in ready)
            running = sum(min(r.num_busy, sim.slots) for r in ready)
            kv = running / (sim.slots * len(ready)) if ready else 0.0
            if ready and running and (engine_waiting or kv >= 0.9):
                sim.capacity = (running / len(ready), now + args.stable_window_s)
            capacity = sim.capacity[0] if sim.capacity and sim.capacity[1] > now else None
            load = Load(inflight, waiting, sim.last_request_at, peak, max(surges) if surges else None, len(ready),
                        engine_waiting, kv, capacity)
        else:
            load = Load(inflight, waiting, sim.last_request_at, peak)
        decision = decide(sim.spec, load, now=now)
        sim.samples.append((now, inflight + waiting))
        live = sim.live()
        if decision.desired > len(live):
            for _ in range(decision.desired - len(live)):
                start_s = args.cold_start_s + rng.uniform(-args.cold_start_jitter_s, args.cold_start_jitter_s)
                sim.replicas.append(Replica(ready_at=now + start_s, placed_at=now))
                push(now + start_s, "ready", index)
        elif decision.desired < len(live):
            # Not started yet first, then the least busy (the scheduler's drain order).
            for replica in sorted(live, key=lambda r: (r.ready_at <= now, r.num_busy))[: len(live) - decision.desired]:
                replica.draining = True
                if replica.num_busy == 0:
                    replica.stopped_at = now

    while events:
        now, _, kind, index, payload = heapq.heappop(events)
        if now > args.hours * 3600 and kind in ("arrive", "tick"):
            continue
        if kind == "tick":
            for sim_index, sim in enumerate(sims):
                reconcile(sim, sim_index, now)
                dispatch(sim, sim_index, now)
            continue
        sim = sims[index]
        if kind == "arrive":
            number = len(requests)
            requests.append({"arrival": now, "service_s": payload, "started_at": None, "cold": not any(r.ready_at <= now for r in sim.live())})
            sim.last_request_at = now
            sim.queue.append((now, payload, number))
            if not any(r.ready_at <= now for r in sim.live()):
                reconcile(sim, index, now)  # the gateway wakes the autoscaler at once
            dispatch(sim, index, now)
        elif kind == "ready":
            dispatch(sim, index, now)
        elif kind == "done":
            replica, number = payload
            replica.num_busy -= 1
            requests[number]["finished_at"] = now
            engine_next(replica, index, now)
            if replica.draining and replica.num_busy == 0 and replica.stopped_at is None:
                replica.stopped_at = now
            dispatch(sim, index, now)
        # Requests held past the cold-start timeout are refused (503 with Retry-After).
        while sim.queue and now - sim.queue[0][0] > args.cold_start_timeout_s:
            _, _, number = sim.queue.popleft()
            requests[number]["refused"] = True

    end = args.hours * 3600
    gpu_s = sum(min(r.stopped_at if r.stopped_at is not None else end, end) - r.placed_at for sim in sims for r in sim.replicas)
    served = [r for r in requests if r.get("finished_at") is not None]
    latencies = sorted(r["finished_at"] - r["arrival"] for r in served)
    waits = sorted(r["started_at"] - r["arrival"] for r in served)
    cold = [r for r in served if r["cold"]]

    def pct(values, fraction):
        return round(values[min(len(values) - 1, int(fraction * (len(values) - 1)))], 2) if values else None

    return {
        "gpu_seconds": round(gpu_s), "gpu_hours": round(gpu_s / 3600, 2),
        "num_replica_starts": sum(len(sim.replicas) for sim in sims),
        "num_requests": len(requests), "num_served": len(served),
        "num_refused": sum(1 for r in requests if r.get("refused")),
        "latency_p50_s": pct(latencies, 0.50), "latency_p99_s": pct(latencies, 0.99), "latency_p999_s": pct(latencies, 0.999),
        "wait_p50_s": pct(waits, 0.50), "wait_p99_s": pct(waits, 0.99),
        "cold_start_share": round(len(cold) / len(served), 4) if served else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=4)
    parser.add_argument("--endpoints", type=int, default=20)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--cold-start-s", type=float, default=32, help="engine start, mean (measured 25–40 s)")
    parser.add_argument("--cold-start-jitter-s", type=float, default=7)
    parser.add_argument("--cold-start-timeout-s", type=float, default=300)
    parser.add_argument("--service-s", type=float, default=3.0, help="mean seconds one request occupies a replica slot")
    parser.add_argument("--slots", type=int, default=16, help="requests one replica serves at once")
    parser.add_argument("--target-concurrency", type=int, default=8)
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--idle-timeout-s", type=int, default=300)
    parser.add_argument("--tick-s", type=float, default=2.0)
    parser.add_argument("--stable-window-s", type=float, default=60.0)
    parser.add_argument("--panic-window-s", type=float, default=6.0)
    parser.add_argument("--signals-max-replicas", type=int, default=8, help="max replicas in the signals comparison")
    parser.add_argument("--engine-slots", default="3,4,6,8,16",
                        help="sequences an engine runs at once, per endpoint (cycled): long prompts fill the KV cache sooner")
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "trace.json"))
    args = parser.parse_args()

    # NOTE: Django is set up (the decision module imports the models) but no database or Redis is
    # ever opened: `decide` reads the endpoint object it is given and two windows from settings.
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("DJANGO_DEBUG", "1")
    os.environ.setdefault("INFERPLANE_DATA_DIR", str(REPO / ".data" / "bench-trace"))
    import django
    from django.conf import settings

    django.setup()
    settings.AUTOSCALER_STABLE_WINDOW_S, settings.AUTOSCALER_PANIC_WINDOW_S = args.stable_window_s, args.panic_window_s
    from endpoints.autoscaler import Load, decide

    started = time.perf_counter()
    rng = random.Random(args.seed)
    duration_s = args.hours * 3600
    sigma = 0.5
    mu = math.log(args.service_s) - sigma**2 / 2
    traces = []
    for _ in range(args.endpoints):
        arrivals = make_trace(rng, duration_s)
        traces.append([(moment, rng.lognormvariate(mu, sigma)) for moment in arrivals])

    def policy(min_replicas_of):
        return lambda index: Spec(min_replicas=min_replicas_of, max_replicas=args.max_replicas,
                                  target_concurrency=args.target_concurrency, idle_timeout_s=args.idle_timeout_s)

    policies = {"scale_to_zero": policy(0), "one_warm": policy(1), "always_on": policy(args.max_replicas)}
    results = {name: simulate(traces, spec_for, args, decide, Load) for name, spec_for in policies.items()}
    always_on = results["always_on"]["gpu_seconds"]
    for result in results.values():
        result["gpu_seconds_saved_vs_always_on"] = round(1 - result["gpu_seconds"] / always_on, 4) if always_on else None
    # Autoscaling signals: the same scale-to-zero endpoints on engines of differing capacity (their
    # requests queue inside the engine, as on vLLM), decided on gateway load only (the previous
    # policy) and with the engines' queues, KV cache and the panic window.
    engine_slots = [int(value) for value in args.engine_slots.split(",")]
    slots_of = lambda index: engine_slots[index % len(engine_slots)]  # noqa: E731
    roomy = lambda index: Spec(min_replicas=0, max_replicas=args.signals_max_replicas,  # noqa: E731
                               target_concurrency=args.target_concurrency, idle_timeout_s=args.idle_timeout_s)
    signal_results = {
        name: simulate(traces, roomy, args, decide, Load, slots_of=slots_of, engine_queue=True, signals=signals)
        for name, signals in (("gateway_load_only", False), ("llm_aware", True))
    }
    num_requests = sum(len(t) for t in traces)
    idle_share = sum(1 for t in traces if not t) / len(traces)

    document = {
        "benchmark": "trace",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(), "num_cpus": os.cpu_count(),
        "parameters": vars(args) | {"regimes": REGIMES},
        "trace": {"num_endpoints": len(traces), "num_requests": num_requests, "hours": args.hours,
                  "mean_requests_per_s": round(num_requests / duration_s, 3), "share_of_endpoints_never_called": idle_share},
        "policies": results,
        "autoscaling_signals": {"engine_slots": engine_slots, "policies": signal_results},
        "simulation_wall_s": round(time.perf_counter() - started, 2),
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")

    print(f"{len(traces)} endpoints, {args.hours:g} h, {num_requests:,} requests (seed {args.seed}); cold start "
          f"{args.cold_start_s:g}±{args.cold_start_jitter_s:g} s; {args.slots} slots × {args.service_s:g} s per replica; "
          f"idle timeout {args.idle_timeout_s} s\n")
    print("| policy | GPU-hours | saved vs always-on | replica starts | latency p50 / p99 / p99.9 s | wait p50 / p99 s | requests meeting a cold start | refused |")
    print("|---|---:|---:|---:|---|---|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['gpu_hours']} | {r['gpu_seconds_saved_vs_always_on']:.1%} | {r['num_replica_starts']} | "
              f"{r['latency_p50_s']} / {r['latency_p99_s']} / {r['latency_p999_s']} | {r['wait_p50_s']} / {r['wait_p99_s']} | "
              f"{r['cold_start_share']:.2%} | {r['num_refused']} |")
    print(f"\nAutoscaling signals (scale to zero, up to {args.signals_max_replicas} replicas; engines of "
          f"{args.engine_slots} slots queue what they cannot run; target {args.target_concurrency}):\n")
    print("| decision reads | GPU-hours | replica starts | latency p50 / p99 / p99.9 s | wait p50 / p99 s | refused |")
    print("|---|---:|---:|---|---|---:|")
    for name, r in signal_results.items():
        print(f"| {name} | {r['gpu_hours']} | {r['num_replica_starts']} | {r['latency_p50_s']} / {r['latency_p99_s']} / "
              f"{r['latency_p999_s']} | {r['wait_p50_s']} / {r['wait_p99_s']} | {r['num_refused']} |")
    print(f"\nsimulated in {document['simulation_wall_s']} s; wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
