"""Node pools on a bursty trace: what the machines under the replicas cost, always on or scaled to zero.

`bench_trace.py` shows replicas scaling to zero; the GPU-hours it saves are saved only if the machines
under them go too. This replays the same seeded trace (`bench_trace.make_trace`, same seed, same
service times) over a fleet of *machines* that a node pool launches and releases. A pure simulation
(no processes, no database), in a simulated clock, on one core:

  * replica decisions come from the real `endpoints.autoscaler.decide`, every autoscaler tick and at
    once when a request reaches an endpoint with no ready replica (the gateway's wake-up), on the
    gateways' load with `read_load`'s stable-window peak, as in `bench_trace`;
  * a new replica takes one whole GPU of a joined node, chosen as `placement.choose_node` prefers: the
    fewest replicas of its endpoint there, then a node that holds its weights, then the best fit. One
    that fits nowhere is *unplaced*: demand on the pool, and placement tries again every tick;
  * every pool tick (`--pool-tick-s`, and at once when an endpoint's unplaced replicas grow, as the
    scheduler's `request_provisioning` does) the real `endpoints.fleet.pool_plan.plan_launches` turns
    unplaced replicas into launches (fewest machines, booting ones filled first, min and warm kept,
    never past max; nodes joined in the last two autoscaler ticks and still empty count as booting, as
    `pools.settled_counts` does), and the real `nodes_to_release` picks nodes empty for the pool's
    idle timeout, down to min plus warm;
  * a launched machine joins `--provision-s` ± `--provision-jitter-s` later (uniform, seeded), and the
    scheduler's next tick places the waiting replicas on it; a replica serves after its engine starts
    (`--cold-start-s` ± jitter) plus, on a node that never held its weights, `--weights-pull-s`: a
    fresh node pays both;
  * a machine is paid from its launch to its release: busy while any replica sits on it (starting,
    serving or draining), idle otherwise, booting included (as `endpoints.fleet.launches` counts it).

Every policy runs the trace and then a quiet tail long enough for replicas and nodes to time out, and
is paid over the same horizon. Latency counts requests after `--warmup-s`: at the trace's start every
policy ramps up from its floor at once (node scale-to-zero from no machine at all), a moment that a
fleet in service meets once, not every few hours; that first ramp is reported apart (`from_start`). Policies (the same trace, the same pool maximum): the fleet sized
for every endpoint at its maximum (what a person provisions without data), an always-on fleet sized
for this trace's observed peak (in hindsight), node scale-to-zero (min 0, warm 0), a warm node (min 0,
warm 1) and one node always on (min 1); then node scale-to-zero again for each node idle timeout of
`--sweep-node-idle-timeouts-s`. Two fleets: all endpoints, and the least-called few (sparse traffic). Not modelled: launches that fail or never join, spot reclaims, the agent's own restarts.

    .venv/bin/python bench/bench_node_pools.py [--hours 4] [--endpoints 20] [--seed 7] [--provision-s 90]

Writes `bench/results/node_pools.json` and prints a markdown table per fleet.
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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_trace import EndpointSim, Spec, make_trace  # noqa: E402

from endpoints.fleet.pool_plan import IdleNode, Need, NodeShape, PoolCounts, nodes_to_release, plan_launches  # noqa: E402


@dataclass(slots=True, frozen=True)
class PoolPolicy:
    name: str
    min_nodes: int
    max_nodes: int
    warm_nodes: int = 0


@dataclass(slots=True)
class SimNode:
    """One machine, from its launch to its release; occupancy kept as `fleet.launches` keeps it."""

    launch_id: str
    order: int
    requested_at: float
    joined_at: float | None = None
    released_at: float | None = None
    replicas: list = field(default_factory=list)  # replicas holding a GPU here (starting, serving, draining)
    weights: set = field(default_factory=set)  # endpoints whose weights it has pulled
    idle_since: float | None = None
    busy_since: float | None = None
    idle_s: float = 0.0
    busy_s: float = 0.0

    def join(self, now: float) -> None:
        self.joined_at, self.idle_since = now, now
        self.idle_s += now - self.requested_at  # NOTE: booting was paid for and served nothing: idle

    def occupy(self, replica, now: float) -> None:
        if not self.replicas:
            self.idle_s += now - self.idle_since
            self.idle_since, self.busy_since = None, now
        self.replicas.append(replica)

    def vacate(self, replica, now: float) -> None:
        self.replicas.remove(replica)
        if not self.replicas:
            self.busy_s += now - self.busy_since
            self.busy_since, self.idle_since = None, now

    def release(self, now: float) -> None:
        if self.joined_at is None:
            self.idle_s += now - self.requested_at
        elif self.busy_since is not None:
            self.busy_s += now - self.busy_since
        else:
            self.idle_s += now - self.idle_since
        self.released_at, self.idle_since, self.busy_since = now, None, None


@dataclass(slots=True)
class NodeReplica:
    """What `EndpointSim` reads of a replica (`num_busy`, `draining`, `stopped_at`), plus its node."""

    endpoint: int
    node: SimNode
    placed_at: float
    ready_at: float
    num_busy: int = 0
    draining: bool = False
    stopped_at: float | None = None


class FleetSim:
    """One policy over the traces; `run()` returns node-hours, cost, launches and request latencies."""

    def __init__(self, traces: list[list[tuple[float, float]]], policy: PoolPolicy, args, decide, Load):
        self.traces, self.policy, self.args, self.decide, self.Load = traces, policy, args, decide, Load
        self.shape = NodeShape(num_gpus=args.gpus_per_node, gpu_memory_mb=args.gpu_memory_mb)
        self.trace_end_s = args.hours * 3600
        self.end_s = self.trace_end_s + args.tail_s
        self.sims = [EndpointSim(Spec(min_replicas=0, max_replicas=args.max_replicas, target_concurrency=args.target_concurrency,
                                      idle_timeout_s=args.idle_timeout_s), args.slots) for _ in traces]
        self.num_unplaced = [0] * len(traces)
        self.nodes: list[SimNode] = []  # live: booting or joined
        self.released: list[SimNode] = []
        self.requests: list[list] = []  # [arrival, started_at, finished_at, cold, waited_for_node, refused]
        self.events: list = []
        self.counter = itertools.count()
        self.node_numbers = itertools.count()
        self.rng = random.Random(args.seed + 2)
        self.num_launches = self.num_replica_starts = self.peak_nodes = self.peak_replicas = 0
        self.replica_s = 0.0
        self.provision_requested = False

    def push(self, moment: float, kind: str, index: int = -1, payload=None) -> None:
        heapq.heappush(self.events, (moment, next(self.counter), kind, index, payload))

    # Machines -------------------------------------------------------------------------------------

    def launch(self, now: float, *, joined: bool = False) -> SimNode:
        number = next(self.node_numbers)
        node = SimNode(launch_id=f"launch-{number}", order=number, requested_at=now)
        self.nodes.append(node)
        if joined:  # the floor already running when the trace begins: not a launch
            node.join(now)
        else:
            self.num_launches += 1
            delay = self.args.provision_s + self.rng.uniform(-self.args.provision_jitter_s, self.args.provision_jitter_s)
            self.push(now + max(0.0, delay), "join", payload=node)
        self.peak_nodes = max(self.peak_nodes, len(self.nodes))
        return node

    def counts(self, now: float, *, settled: bool = False) -> tuple[PoolCounts, list[SimNode]]:
        """`pool_demand.pool_counts`; `settled`: as `pools.settled_counts`, nodes that joined within two
        autoscaler ticks and are still empty count as booting (no tick has placed their replicas yet)."""
        empty = [n for n in self.nodes if n.joined_at is not None and not n.replicas]
        num_booting = sum(1 for n in self.nodes if n.joined_at is None)
        if settled:
            fresh = [n for n in empty if n.joined_at > now - (2 * self.args.tick_s + 1)]
            empty = [n for n in empty if n not in fresh]
            num_booting += len(fresh)
        return PoolCounts(min_nodes=self.policy.min_nodes, max_nodes=self.policy.max_nodes, warm_nodes=self.policy.warm_nodes,
                          num_live=len(self.nodes), num_booting=num_booting, num_empty=len(empty)), empty

    def pool_tick(self, now: float) -> None:
        needs = [Need(str(index), self.args.replica_memory_mb, 1)
                 for index, count in enumerate(self.num_unplaced) for _ in range(count)]
        self.provision_requested = False
        counts, _ = self.counts(now, settled=True)
        for _ in range(plan_launches(needs, self.shape, counts).num_launch):
            self.launch(now)
        counts, empty = self.counts(now)
        idle = [IdleNode(n.launch_id, n.idle_since) for n in empty]
        chosen = set(nodes_to_release(idle, counts, self.args.node_idle_timeout_s, now))
        for node in [n for n in self.nodes if n.launch_id in chosen]:
            node.release(now)
            self.nodes.remove(node)
            self.released.append(node)

    # Replicas -------------------------------------------------------------------------------------

    def choose_node(self, index: int) -> SimNode | None:
        options = [n for n in self.nodes if n.joined_at is not None and len(n.replicas) < self.args.gpus_per_node]
        if not options:
            return None
        return min(options, key=lambda n: (sum(1 for r in n.replicas if r.endpoint == index), index not in n.weights,
                                           self.args.gpus_per_node - len(n.replicas), n.order))

    def place(self, index: int, now: float) -> bool:
        node = self.choose_node(index)
        if node is None:
            return False
        start_s = self.args.cold_start_s + self.rng.uniform(-self.args.cold_start_jitter_s, self.args.cold_start_jitter_s)
        if index not in node.weights:
            start_s += self.args.weights_pull_s
            node.weights.add(index)
        replica = NodeReplica(endpoint=index, node=node, placed_at=now, ready_at=now + start_s)
        node.occupy(replica, now)
        self.sims[index].replicas.append(replica)
        self.num_replica_starts += 1
        self.peak_replicas = max(self.peak_replicas, sum(len(n.replicas) for n in self.nodes))
        self.push(replica.ready_at, "ready", index)
        return True

    def stop(self, replica: NodeReplica, now: float) -> None:
        replica.stopped_at = now
        replica.node.vacate(replica, now)
        self.replica_s += now - replica.placed_at

    def reconcile(self, index: int, now: float) -> None:
        sim, args = self.sims[index], self.args
        inflight, waiting = sim.concurrency()
        while sim.samples and sim.samples[0][0] < now - args.stable_window_s:
            sim.samples.popleft()
        peak = max([inflight + waiting] + [value for _, value in sim.samples])
        decision = self.decide(sim.spec, self.Load(inflight, waiting, sim.last_request_at, peak), now=now)
        sim.samples.append((now, inflight + waiting))
        live = sim.live()
        missing = decision.desired - len(live)
        while missing > 0 and self.place(index, now):
            missing -= 1
        if missing > self.num_unplaced[index]:
            self.provision_requested = True  # new demand: the pool tick runs now, not at its next beat
        self.num_unplaced[index] = max(0, missing)
        if missing < 0:
            # Not started yet first, then the least busy (the scheduler's drain order).
            for replica in sorted(live, key=lambda r: (r.ready_at <= now, r.num_busy))[:-missing]:
                replica.draining = True
                if replica.num_busy == 0:
                    self.stop(replica, now)
        sim.replicas = [r for r in sim.replicas if r.stopped_at is None]

    # Requests -------------------------------------------------------------------------------------

    def dispatch(self, index: int, now: float) -> None:
        sim = self.sims[index]
        while sim.queue:
            ready = [r for r in sim.live() if r.ready_at <= now and r.num_busy < sim.slots]
            if not ready:
                return
            replica = min(ready, key=lambda r: r.num_busy)  # the gateway's least outstanding
            _, service_s, number = sim.queue.popleft()
            replica.num_busy += 1
            self.requests[number][1] = now
            self.push(now + service_s, "done", index, (replica, number))

    def arrive(self, index: int, service_s: float, now: float) -> None:
        sim = self.sims[index]
        cold = not any(r.ready_at <= now for r in sim.live())
        record = [now, None, None, cold, False, False]
        self.requests.append(record)
        sim.last_request_at = now
        sim.queue.append((now, service_s, len(self.requests) - 1))
        if cold:
            self.reconcile(index, now)  # the gateway wakes the autoscaler at once
            record[4] = not sim.live() and self.num_unplaced[index] > 0  # nothing placed: it waits for a machine
        self.dispatch(index, now)

    def done(self, index: int, replica: NodeReplica, number: int, now: float) -> None:
        replica.num_busy -= 1
        self.requests[number][2] = now
        if replica.draining and replica.num_busy == 0 and replica.stopped_at is None:
            self.stop(replica, now)
            self.sims[index].replicas = [r for r in self.sims[index].replicas if r.stopped_at is None]
        self.dispatch(index, now)

    def run(self) -> dict:
        args = self.args
        for _ in range(min(self.policy.min_nodes + self.policy.warm_nodes, self.policy.max_nodes)):
            self.launch(0.0, joined=True)
        for index, trace in enumerate(self.traces):
            for arrival, service_s in trace:
                self.push(arrival, "arrive", index, service_s)
        self.push(0.0, "tick")
        self.push(0.0, "pool")
        while self.events:
            now, _, kind, index, payload = heapq.heappop(self.events)
            if now > self.end_s:
                break
            if kind == "tick":
                for sim_index in range(len(self.sims)):
                    self.reconcile(sim_index, now)
                    self.dispatch(sim_index, now)
                self.push(now + args.tick_s, "tick")
                if self.provision_requested:
                    self.pool_tick(now)
                continue
            if kind == "pool":
                self.pool_tick(now)
                self.push(now + args.pool_tick_s, "pool")
                continue
            if kind == "join":
                if payload.released_at is None:
                    payload.join(now)
                continue
            if kind == "arrive":
                self.arrive(index, payload, now)
            elif kind == "ready":
                self.dispatch(index, now)
            elif kind == "done":
                self.done(index, *payload, now)
            if self.provision_requested:
                self.pool_tick(now)
            # Requests held past the cold-start timeout are refused (503 with Retry-After).
            queue = self.sims[index].queue
            while queue and now - queue[0][0] > args.cold_start_timeout_s:
                self.requests[queue.popleft()[2]][5] = True
        return self.summary()

    def summary(self) -> dict:
        num_nodes_at_end = len(self.nodes)
        for node in list(self.nodes):
            node.release(self.end_s)
        for sim in self.sims:
            self.replica_s += sum(self.end_s - r.placed_at for r in sim.replicas if r.stopped_at is None)
        nodes = self.released + self.nodes
        total_s = sum(n.released_at - n.requested_at for n in nodes)
        busy_s, idle_s = sum(n.busy_s for n in nodes), sum(n.idle_s for n in nodes)
        booting_s = sum((n.joined_at if n.joined_at is not None else n.released_at) - n.requested_at for n in nodes)
        served = [r for r in self.requests if r[2] is not None]
        settled = [r for r in served if r[0] >= self.args.warmup_s]
        price = self.args.hourly_price
        return {
            "policy": {"min_nodes": self.policy.min_nodes, "max_nodes": self.policy.max_nodes, "warm_nodes": self.policy.warm_nodes},
            "node_hours": round(total_s / 3600, 2), "busy_node_hours": round(busy_s / 3600, 2),
            "idle_node_hours": round(idle_s / 3600, 2), "booting_node_hours": round(booting_s / 3600, 2),
            "idle_share": round(idle_s / total_s, 4) if total_s else 0.0,
            "gpu_use": round(self.replica_s / (total_s * self.args.gpus_per_node), 4) if total_s else 0.0,
            "cost": round(total_s / 3600 * price, 2), "idle_cost": round(idle_s / 3600 * price, 2),
            "num_launches": self.num_launches, "peak_nodes": self.peak_nodes, "num_nodes_at_end": num_nodes_at_end,
            "peak_replicas": self.peak_replicas, "num_replica_starts": self.num_replica_starts,
            "num_requests": len(self.requests), "num_served": len(served), "num_refused": sum(1 for r in self.requests if r[5]),
            # After the fleet's first ramp from its floor (`--warmup-s`), then every request from the start.
            **latency_stats(settled), "from_start": latency_stats(served),
            "node_seconds_exact": {"total": total_s, "busy": busy_s, "idle": idle_s},
        }


def latency_stats(served: list[list]) -> dict:
    """p50 / p99 / p99.9 of whole requests and of the wait alone; the shares that met a cold start and
    that waited for a machine."""
    latencies = sorted(r[2] - r[0] for r in served)
    waits = sorted(r[1] - r[0] for r in served)

    def pct(values, fraction):
        return round(values[min(len(values) - 1, int(fraction * (len(values) - 1)))], 2) if values else None

    return {
        "num_measured": len(served),
        "latency_p50_s": pct(latencies, 0.50), "latency_p99_s": pct(latencies, 0.99), "latency_p999_s": pct(latencies, 0.999),
        "wait_p50_s": pct(waits, 0.50), "wait_p99_s": pct(waits, 0.99),
        "cold_start_share": round(sum(1 for r in served if r[3]) / len(served), 4) if served else 0.0,
        "node_wait_share": round(sum(1 for r in served if r[4]) / len(served), 4) if served else 0.0,
        # The price of each kind of start, for the requests that met one: a machine's boot, or a replica's only.
        "node_wait_latency_p50_s": pct(sorted(r[2] - r[0] for r in served if r[4]), 0.50),
        "replica_start_latency_p50_s": pct(sorted(r[2] - r[0] for r in served if r[3] and not r[4]), 0.50),
    }


def make_traces(args) -> list[list[tuple[float, float]]]:
    """`bench_trace`'s traces, drawn in its order: the same seed gives the same requests."""
    rng = random.Random(args.seed)
    sigma = 0.5
    mu = math.log(args.service_s) - sigma**2 / 2
    return [[(moment, rng.lognormvariate(mu, sigma)) for moment in make_trace(rng, args.hours * 3600)]
            for _ in range(args.endpoints)]


def compare(traces, args, decide, Load) -> dict:
    """Every policy on these traces; the always-on fleet is sized from the peak of the largest one."""
    cap = math.ceil(len(traces) * args.max_replicas / args.gpus_per_node)
    results = {"always_on_max": FleetSim(traces, PoolPolicy("always_on_max", cap, cap), args, decide, Load).run()}
    peak = math.ceil(results["always_on_max"]["peak_replicas"] / args.gpus_per_node)
    policies = [PoolPolicy("always_on_peak", peak, peak), PoolPolicy("node_scale_to_zero", 0, cap),
                PoolPolicy("warm_node", 0, cap, 1), PoolPolicy("min_one", 1, cap)]
    for policy in policies:
        results[policy.name] = FleetSim(traces, policy, args, decide, Load).run()
    return results


def sweep_idle_timeouts(traces, args, decide, Load) -> dict:
    """Node scale-to-zero with each of `--sweep-node-idle-timeouts-s`: idle node-hours against machine boots."""
    cap = math.ceil(len(traces) * args.max_replicas / args.gpus_per_node)
    results = {}
    for timeout_s in parse_list(args.sweep_node_idle_timeouts_s):
        swept = argparse.Namespace(**(vars(args) | {"node_idle_timeout_s": timeout_s}))
        results[f"{timeout_s:g}"] = FleetSim(traces, PoolPolicy("node_scale_to_zero", 0, cap), swept, decide, Load).run()
    return results


def parse_list(text: str) -> list[float]:
    return [float(value) for value in text.split(",") if value.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=4)
    parser.add_argument("--endpoints", type=int, default=20)
    parser.add_argument("--sparse-endpoints", type=int, default=3, help="the least-called endpoints, as a second fleet")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--provision-s", type=float, default=90, help="launch to the agent's join, mean")
    parser.add_argument("--provision-jitter-s", type=float, default=30)
    parser.add_argument("--weights-pull-s", type=float, default=30, help="extra engine start on a node without the weights")
    parser.add_argument("--cold-start-s", type=float, default=32, help="engine start with the weights on disk (measured 25–40 s)")
    parser.add_argument("--cold-start-jitter-s", type=float, default=7)
    parser.add_argument("--cold-start-timeout-s", type=float, default=300)
    parser.add_argument("--gpus-per-node", type=int, default=4, help="replicas one machine holds (one GPU each)")
    parser.add_argument("--gpu-memory-mb", type=int, default=24_000)
    parser.add_argument("--replica-memory-mb", type=int, default=20_000)
    parser.add_argument("--hourly-price", type=float, default=4.0, help="per node-hour (illustrative)")
    parser.add_argument("--node-idle-timeout-s", type=float, default=600, help="the pool's idle timeout (NodePool default)")
    parser.add_argument("--sweep-node-idle-timeouts-s", default="120,600,1800",
                        help="node scale-to-zero again with each of these idle timeouts (empty: no sweep)")
    parser.add_argument("--pool-tick-s", type=float, default=5.0, help="INFERPLANE_NODE_POOLS_TICK_S")
    parser.add_argument("--service-s", type=float, default=3.0)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--target-concurrency", type=int, default=8)
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--idle-timeout-s", type=int, default=300, help="the endpoints' (replicas') idle timeout")
    parser.add_argument("--tick-s", type=float, default=2.0)
    parser.add_argument("--stable-window-s", type=float, default=60.0)
    parser.add_argument("--warmup-s", type=float, default=600,
                        help="latency counts requests from here on: the first ramp from every policy's floor is reported apart")
    parser.add_argument("--tail-s", type=float, default=None, help="quiet after the trace (default: both idle timeouts + 2 min)")
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "node_pools.json"))
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.tail_s is None:  # every machine of every run times out before the horizon
        longest_s = max([args.node_idle_timeout_s] + parse_list(args.sweep_node_idle_timeouts_s))
        args.tail_s = args.idle_timeout_s + longest_s + 120
    return args


def print_table(title: str, results: dict) -> None:
    print(f"\n{title}\n")
    print("| policy | node-hours | busy / idle node-hours | cost | idle cost | GPU use | launches | peak nodes | "
          "latency p50 / p99 / p99.9 s | wait p99 s | requests waiting for a node (their p50 s) | "
          "from the start: p99 s, waiting for a node | refused |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|---:|---|---|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['node_hours']} | {r['busy_node_hours']} / {r['idle_node_hours']} | ${r['cost']:,.2f} | "
              f"${r['idle_cost']:,.2f} | {r['gpu_use']:.0%} | {r['num_launches']} | {r['peak_nodes']} | "
              f"{r['latency_p50_s']} / {r['latency_p99_s']} / {r['latency_p999_s']} | {r['wait_p99_s']} | "
              f"{r['node_wait_share']:.2%} ({r['node_wait_latency_p50_s']}) | {r['from_start']['latency_p99_s']}, {r['from_start']['node_wait_share']:.2%} | "
              f"{r['num_refused']} |")


def main() -> int:
    args = parse_args()
    # NOTE: Django is set up (the decision module imports the models) but no database or Redis is
    # ever opened: `decide` reads the endpoint object it is given and its windows from settings.
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("DJANGO_DEBUG", "1")
    os.environ.setdefault("INFERPLANE_DATA_DIR", str(REPO / ".data" / "bench-trace"))
    import django
    from django.conf import settings

    django.setup()
    settings.AUTOSCALER_STABLE_WINDOW_S = args.stable_window_s
    from endpoints.autoscaler import Load, decide

    started = time.perf_counter()
    traces = make_traces(args)
    sparse = sorted(range(len(traces)), key=lambda index: (len(traces[index]), index))[: args.sparse_endpoints]
    fleets = {"all": list(range(len(traces))), "sparse": sorted(sparse)}
    results = {name: compare([traces[i] for i in members], args, decide, Load) for name, members in fleets.items()}
    sweeps = {name: sweep_idle_timeouts([traces[i] for i in members], args, decide, Load) for name, members in fleets.items()}
    document = {
        "benchmark": "node_pools",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(), "num_cpus": os.cpu_count(),
        "parameters": vars(args),
        "fleets": {name: {"endpoints": members, "num_requests": sum(len(traces[i]) for i in members),
                          "policies": results[name], "node_idle_timeout_sweep": sweeps[name]}
                   for name, members in fleets.items()},
        "horizon_h": round((args.hours * 3600 + args.tail_s) / 3600, 3),
        "simulation_wall_s": round(time.perf_counter() - started, 2),
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")

    print(f"{args.endpoints} endpoints, {args.hours:g} h of trace + {args.tail_s:g} s quiet (seed {args.seed}); machines of "
          f"{args.gpus_per_node} GPUs at ${args.hourly_price:g}/h, join after {args.provision_s:g}±{args.provision_jitter_s:g} s, "
          f"released after {args.node_idle_timeout_s:g} s empty; engine start {args.cold_start_s:g}±{args.cold_start_jitter_s:g} s "
          f"+ {args.weights_pull_s:g} s on a node without the weights")
    for name, members in fleets.items():
        num_requests = document["fleets"][name]["num_requests"]
        print_table(f"Fleet '{name}': {len(members)} endpoints, {num_requests:,} requests", results[name])
        if sweeps[name]:
            print(f"\nNode scale-to-zero, fleet '{name}', by the pool's idle timeout:\n")
            print("| node idle timeout | node-hours | idle node-hours | cost | launches | latency p99 s | waiting for a node | "
                  "their latency p50 s |")
            print("|---:|---:|---:|---:|---:|---:|---:|---:|")
            for timeout, r in sweeps[name].items():
                print(f"| {timeout} s | {r['node_hours']} | {r['idle_node_hours']} | ${r['cost']:,.2f} | {r['num_launches']} | "
                      f"{r['latency_p99_s']} | {r['node_wait_share']:.2%} | {r['node_wait_latency_p50_s']} |")
    print(f"\nsimulated in {document['simulation_wall_s']} s; wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
