"""Batch work filling warm capacity: GPU-seconds and batch completion times, with and without filling.

A pure simulation (no processes, no database) on `bench_trace`'s bursty trace (the same seeded
Markov-modulated arrivals per endpoint), with a batch of `--batch-lines` lines queued on every endpoint
at the start, due `--window-h` hours later. Scaling comes from the real decision functions: every tick
`endpoints.autoscaler.decide(endpoint, Load, batch=BatchDemand, num_ready, num_serving)` (which applies
`endpoints.batches.scheduling.apply`: hold warm replicas while batch work is queued, wake a sleeping
endpoint only when `wake_at` says the deadline needs it), and batch lines start only into
`scheduling.batch_slots` (READY replicas × target concurrency − interactive work), after every queued
interactive request (the engine's priority).

Policies, same trace:
  * `interactive_only`: no batch work (the baseline's GPU-seconds);
  * `fill`: the batch queue as Inferplane runs it;
  * `no_fill`: the batch's lines sent as ordinary calls at the start (what a client without a batch API
    does): they count as load, so the autoscaler wakes and scales every endpoint for them at once.

Reports GPU-hours, the extra over interactive only, replica starts, batch completion (p50 / max hours
after submission, share finished by the deadline) and interactive latency p50 / p99.

    .venv/bin/python bench/bench_batch_fill.py [--hours 6] [--endpoints 20] [--batch-lines 400] [--window-h 6]

Writes `bench/results/batch_fill.json` and prints a markdown table.
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
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_trace import EndpointSim, Replica, make_trace  # noqa: E402


class Spec:
    """What `decide` and the batch rules read of an endpoint."""

    def __init__(self, args):
        self.min_replicas, self.max_replicas = 0, args.max_replicas
        self.target_concurrency, self.idle_timeout_s = args.target_concurrency, args.idle_timeout_s
        self.cold_start_timeout_s = args.cold_start_allowance_s
        self.paused_at = self.deleted_at = self.last_cold_start_at = None
        self.prewarm_windows, self.keep_warm_after_cold_start_s = [], 0


def simulate(traces, args, policy: str, decide, Load, BatchDemand, batch_slots) -> dict:
    counter = itertools.count()
    events: list = []
    sims = [EndpointSim(Spec(args), args.slots) for _ in traces]
    rng = random.Random(args.seed + 1)
    requests: list[dict] = []
    end = args.hours * 3600
    deadline = args.window_h * 3600
    with_batch = policy != "interactive_only"
    # Per endpoint: batch lines not started, running, done, and when the last finished.
    batch = [{"queued": args.batch_lines if with_batch else 0, "running": 0, "done": 0, "finished_at": None}
             for _ in traces]

    def push(moment, kind, index, payload=None):
        heapq.heappush(events, (moment, next(counter), kind, index, payload))

    for index, trace in enumerate(traces):
        for arrival, service_s in trace:
            push(arrival, "arrive", index, service_s)
    tick = 0.0
    while tick <= end:
        push(tick, "tick", -1)
        tick += args.tick_s

    def batch_service_s() -> float:
        sigma = 0.5
        return rng.lognormvariate(math.log(args.batch_service_s) - sigma**2 / 2, sigma)

    def dispatch(sim, index, now):
        ready = lambda: [r for r in sim.live() if r.ready_at <= now and r.num_busy < sim.slots]  # noqa: E731
        while sim.queue and (candidates := ready()):  # interactive first: the engine's priority
            replica = min(candidates, key=lambda r: r.num_busy)
            _, service_s, number = sim.queue.popleft()
            replica.num_busy += 1
            requests[number]["started_at"] = now
            push(now + service_s, "done", index, (replica, number))
        work = batch[index]
        while work["queued"] and (candidates := ready()):
            num_ready = sum(1 for r in sim.live() if r.ready_at <= now)
            outstanding = sum(r.num_busy for r in sim.replicas if r.stopped_at is None)
            slots = (batch_slots(num_ready=num_ready, target_concurrency=sim.spec.target_concurrency,
                                 num_outstanding=outstanding, num_batch_in_flight=work["running"])
                     if policy == "fill" else sim.slots * num_ready)
            if work["running"] >= slots:
                return
            replica = min(candidates, key=lambda r: r.num_busy)
            replica.num_busy += 1
            work["queued"] -= 1
            work["running"] += 1
            push(now + batch_service_s(), "batch_done", index, replica)

    def reconcile(sim, index, now):
        inflight, waiting = sim.concurrency()
        work = batch[index]
        if policy == "no_fill":
            waiting += work["queued"]  # ordinary calls: the queue is load
        while sim.samples and sim.samples[0][0] < now - args.stable_window_s:
            sim.samples.popleft()
        peak = max([inflight + waiting] + [value for _, value in sim.samples])
        live = sim.live()
        demand = (BatchDemand(work["queued"] + work["running"], deadline)
                  if policy == "fill" and work["queued"] + work["running"] else None)
        decision = decide(sim.spec, Load(inflight, waiting, sim.last_request_at, peak), now=now, batch=demand,
                          num_ready=sum(1 for r in live if r.ready_at <= now), num_serving=len(live))
        sim.samples.append((now, inflight + waiting))
        if decision.desired > len(live):
            for _ in range(decision.desired - len(live)):
                start_s = args.cold_start_s + rng.uniform(-args.cold_start_jitter_s, args.cold_start_jitter_s)
                sim.replicas.append(Replica(ready_at=now + start_s, placed_at=now))
                push(now + start_s, "ready", index)
        elif decision.desired < len(live):
            for replica in sorted(live, key=lambda r: (r.ready_at <= now, r.num_busy))[: len(live) - decision.desired]:
                replica.draining = True
                if replica.num_busy == 0:
                    replica.stopped_at = now

    def replica_freed(sim, replica, now):
        if replica.draining and replica.num_busy == 0 and replica.stopped_at is None:
            replica.stopped_at = now

    while events:
        now, _, kind, index, payload = heapq.heappop(events)
        if now > end and kind in ("arrive", "tick"):
            continue
        if kind == "tick":
            for sim_index, sim in enumerate(sims):
                reconcile(sim, sim_index, now)
                dispatch(sim, sim_index, now)
            continue
        sim = sims[index]
        if kind == "arrive":
            number = len(requests)
            requests.append({"arrival": now, "started_at": None})
            sim.last_request_at = now
            sim.queue.append((now, payload, number))
            if not any(r.ready_at <= now for r in sim.live()):
                reconcile(sim, index, now)
            dispatch(sim, index, now)
        elif kind == "ready":
            dispatch(sim, index, now)
        elif kind == "done":
            replica, number = payload
            replica.num_busy -= 1
            requests[number]["finished_at"] = now
            replica_freed(sim, replica, now)
            dispatch(sim, index, now)
        elif kind == "batch_done":
            replica = payload
            replica.num_busy -= 1
            work = batch[index]
            work["running"] -= 1
            work["done"] += 1
            if policy == "no_fill":
                sim.last_request_at = now  # an ordinary call keeps the endpoint from idling
            if work["done"] == args.batch_lines:
                work["finished_at"] = now
            replica_freed(sim, replica, now)
            dispatch(sim, index, now)
        while sim.queue and now - sim.queue[0][0] > args.cold_start_timeout_s:
            _, _, number = sim.queue.popleft()
            requests[number]["refused"] = True

    horizon = max([end] + [w["finished_at"] or 0 for w in batch])
    gpu_s = sum(min(r.stopped_at if r.stopped_at is not None else horizon, horizon) - r.placed_at
                for sim in sims for r in sim.replicas)
    served = [r for r in requests if r.get("finished_at") is not None]
    latencies = sorted(r["finished_at"] - r["arrival"] for r in served)
    completions = sorted(w["finished_at"] / 3600 for w in batch if w["finished_at"] is not None)

    def pct(values, fraction):
        return round(values[min(len(values) - 1, int(fraction * (len(values) - 1)))], 2) if values else None

    return {
        "gpu_seconds": round(gpu_s), "gpu_hours": round(gpu_s / 3600, 2),
        "num_replica_starts": sum(len(sim.replicas) for sim in sims),
        "num_requests": len(requests), "num_refused": sum(1 for r in requests if r.get("refused")),
        "latency_p50_s": pct(latencies, 0.5), "latency_p99_s": pct(latencies, 0.99),
        "num_batches": len(traces) if with_batch else 0, "num_batches_finished": len(completions),
        "batch_completion_p50_h": pct(completions, 0.5), "batch_completion_max_h": round(completions[-1], 2) if completions else None,
        "batches_by_deadline_share": (round(sum(1 for c in completions if c <= args.window_h) / len(traces), 4)
                                      if with_batch else None),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=6)
    parser.add_argument("--endpoints", type=int, default=20)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--batch-lines", type=int, default=400, help="lines queued on each endpoint at the start")
    parser.add_argument("--batch-service-s", type=float, default=3.0, help="mean seconds a batch line holds a slot")
    parser.add_argument("--window-h", type=float, default=6, help="the batches' completion window (deadline)")
    parser.add_argument("--cold-start-s", type=float, default=32)
    parser.add_argument("--cold-start-jitter-s", type=float, default=7)
    parser.add_argument("--cold-start-allowance-s", type=float, default=300, help="endpoint's cold_start_timeout_s")
    parser.add_argument("--cold-start-timeout-s", type=float, default=300)
    parser.add_argument("--service-s", type=float, default=3.0)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--target-concurrency", type=int, default=8)
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--idle-timeout-s", type=int, default=300)
    parser.add_argument("--tick-s", type=float, default=2.0)
    parser.add_argument("--stable-window-s", type=float, default=60.0)
    parser.add_argument("--seconds-per-line", type=float, default=2.0, help="INFERPLANE_BATCH_SECONDS_PER_LINE")
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "batch_fill.json"))
    args = parser.parse_args()

    import django
    from django.conf import settings

    if not settings.configured:  # `decide` reads the stable window and the batch estimate from settings
        # NOTE: the apps are loaded (their models are imported with `decide`); no database is touched.
        settings.configure(AUTOSCALER_STABLE_WINDOW_S=args.stable_window_s, BATCH_SECONDS_PER_LINE=args.seconds_per_line,
                           REDIS_URL="redis://unused", INSTALLED_APPS=[
                               "django.contrib.contenttypes", "django.contrib.auth", "controlplane.accounts",
                               "controlplane", "endpoints", "billing", "endpoints.nodes", "endpoints.batches"])
        django.setup()
    from endpoints.autoscaler import Load, decide
    from endpoints.batches.scheduling import BatchDemand, batch_slots

    started = time.perf_counter()
    rng = random.Random(args.seed)
    sigma = 0.5
    mu = math.log(args.service_s) - sigma**2 / 2
    traces = [[(moment, rng.lognormvariate(mu, sigma)) for moment in make_trace(rng, args.hours * 3600)]
              for _ in range(args.endpoints)]
    results = {policy: simulate(traces, args, policy, decide, Load, BatchDemand, batch_slots)
               for policy in ("interactive_only", "fill", "no_fill")}
    baseline = results["interactive_only"]["gpu_seconds"]
    for result in results.values():
        result["extra_gpu_hours_vs_interactive_only"] = round((result["gpu_seconds"] - baseline) / 3600, 2)
    document = {
        "benchmark": "batch_fill", "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(), "num_cpus": os.cpu_count(), "parameters": vars(args),
        "trace": {"num_endpoints": len(traces), "num_requests": sum(len(t) for t in traces), "hours": args.hours},
        "policies": results, "simulation_wall_s": round(time.perf_counter() - started, 2),
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")

    print(f"{len(traces)} endpoints, {args.hours:g} h of the bursty trace ({document['trace']['num_requests']:,} "
          f"interactive requests, seed {args.seed}); {args.batch_lines} batch lines per endpoint queued at 0 h, "
          f"due at {args.window_h:g} h\n")
    print("| policy | GPU-hours | extra vs interactive only | replica starts | batches done by deadline | "
          "batch completion p50 / max (h) | interactive latency p50 / p99 s |")
    print("|---|---:|---:|---:|---:|---|---|")
    for name, r in results.items():
        by_deadline = "—" if r["batches_by_deadline_share"] is None else f"{r['batches_by_deadline_share']:.0%}"
        print(f"| {name} | {r['gpu_hours']} | {r['extra_gpu_hours_vs_interactive_only']} | {r['num_replica_starts']} | "
              f"{by_deadline} | {r['batch_completion_p50_h']} / {r['batch_completion_max_h']} | "
              f"{r['latency_p50_s']} / {r['latency_p99_s']} |")
    print(f"\nsimulated in {document['simulation_wall_s']} s; wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
