"""Autoscaler tick time with 10,000 endpoints and 1,000 nodes in the database.

Rows are made with `bulk_create` on a dedicated data folder (`INFERPLANE_DATA_DIR=.data/bench`,
embedded PostgreSQL and Redis). Of all endpoints, only some are active, in a realistic mix:
  * 60% serving: one or two READY replicas and in-flight requests in Redis that want exactly them;
  * 20% recently used, now idle past their timeout, at zero replicas (traffic in the last day);
  * 20% with a floor: `min_replicas: 1`, one READY replica, no traffic.
The rest are idle endpoints at zero, never called today: the tick must not pay for them.

It times `endpoints.scheduler.autoscale_tick()` (the real one: lock, active set, loads from
Redis, a decision per endpoint) at several active counts with 10,000 endpoints in total, then
at one active count with 1,000 and with 10,000 in total (the cost must not follow the total),
and one tick in which 10 endpoints each scale up by one replica (placement on 1,000 nodes).

    .venv/bin/python bench/bench_autoscaler.py [--ticks 15] [--active 10,100,500]

Writes `bench/results/autoscaler.json` and prints a markdown table. Target: ≤ 200 ms per tick.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.update({"INFERPLANE_DATA_DIR": str(REPO / ".data" / "bench"), "DJANGO_SETTINGS_MODULE": "controlplane.settings",
                   "DJANGO_DEBUG": "1"})

ORG_SLUG = "bench-autoscaler"
NODE_PREFIX = "bench-as-"
NUM_NODES = 1000
GPU_TYPES = ("l4", "a10g", "a100-80gb", "h100")
TARGET_CONCURRENCY = 8
TARGET_MS = 200


def setup_django() -> None:
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def reset_rows() -> tuple:
    """A clean organisation and 1,000 READY nodes; returns (organization, nodes)."""
    from django.utils import timezone

    from controlplane.accounts.signup import bootstrap_organization
    from endpoints.models import Endpoint, EndpointEvent, Replica
    from endpoints.nodes.models import Node
    from gpu_agent.protocol import NodeState

    organization, _, _ = bootstrap_organization(slug=ORG_SLUG, owner_email="bench-autoscaler@inferplane.local")
    EndpointEvent.objects.filter(endpoint__organization=organization).delete()
    Replica.objects.filter(endpoint__organization=organization).delete()
    forget_traffic(list(Endpoint.objects.filter(organization=organization)))
    Endpoint.objects.filter(organization=organization).delete()
    Node.objects.filter(name__startswith=NODE_PREFIX).delete()
    # NOTE: no agent beats for these nodes: heartbeats a day ahead keep a sweeper on the same data
    # folder (another benchmark's Celery beat) from marking them OFFLINE mid-run.
    now = timezone.now() + timedelta(days=1)
    nodes = Node.objects.bulk_create([
        Node(name=f"{NODE_PREFIX}{index:04d}", gpu_type=GPU_TYPES[index % len(GPU_TYPES)], num_gpus=8, gpu_memory_mb=80_000,
             secret_lookup=f"bas{index:09d}", secret_digest="x", state=NodeState.READY, quantizations=["none", "fp8"],
             last_heartbeat_at=now, last_status={"weights": []})
        for index in range(NUM_NODES)
    ], batch_size=1000)
    return organization, nodes


def forget_traffic(endpoints: list) -> None:
    """Drop the Redis state of these endpoints only (the data folder may be shared: never FLUSHDB)."""
    from controlplane import redis_keys
    from controlplane.redis_client import get_redis
    from endpoints import autoscaler

    redis = get_redis()
    for first in range(0, len(endpoints), 1000):
        batch = [(e.organization_id, str(e.pk)) for e in endpoints[first: first + 1000]]
        keys = [key for org, i in batch for key in (redis_keys.inflight_key(org, i), redis_keys.waiting_key(org, i),
                                                     redis_keys.last_request_key(org, i), autoscaler.samples_key(org, i))]
        redis.delete(*keys)
        redis.zrem(redis_keys.RECENT_ENDPOINTS_KEY, *[i for _, i in batch])


def cleanup(organization) -> None:
    """Leave nothing a real scheduler on this data folder would act on."""
    from endpoints.models import Endpoint, EndpointEvent, Replica
    from endpoints.nodes.models import Node

    forget_traffic(list(Endpoint.objects.filter(organization=organization)))
    EndpointEvent.objects.filter(endpoint__organization=organization).delete()
    Replica.objects.filter(endpoint__organization=organization).delete()
    Endpoint.objects.filter(organization=organization).delete()
    Node.objects.filter(name__startswith=NODE_PREFIX).delete()


def add_endpoints(organization, first: int, count: int) -> list:
    from endpoints.models import Endpoint

    return Endpoint.objects.bulk_create([
        Endpoint(organization=organization, name=f"model-{index:05d}", model_source=f"bench/model-{index % 50}-8B",
                 gpu_type=GPU_TYPES[index % len(GPU_TYPES)], min_replicas=0, max_replicas=4, idle_timeout_s=300,
                 target_concurrency=TARGET_CONCURRENCY, price_input_per_million="0.10",
                 price_cached_input_per_million="0.05", price_output_per_million="0.30")
        for index in range(first, first + count)
    ], batch_size=2000)


def make_active(endpoints: list, nodes: list, num_active: int) -> dict:
    """Turn the first `num_active` endpoints active (see the module docstring); the rest stay idle at zero."""
    from django.utils import timezone

    from controlplane import redis_keys
    from controlplane.redis_client import get_redis
    from endpoints.models import Endpoint, Replica
    from gpu_agent.protocol import ReplicaState

    redis = get_redis()
    forget_traffic(endpoints)
    Replica.objects.filter(endpoint__in=endpoints).delete()
    Endpoint.objects.filter(pk__in=[e.pk for e in endpoints]).update(min_replicas=0, status_message="")
    nodes_by_type = {gpu: [n for n in nodes if n.gpu_type == gpu] for gpu in GPU_TYPES}
    now, moment = time.time(), timezone.now()
    replicas, floors, mix = [], [], {"serving": 0, "recent_idle": 0, "floor": 0}
    pipe = redis.pipeline(transaction=False)
    for index, endpoint in enumerate(endpoints[:num_active]):
        kind = ("serving", "serving", "serving", "recent_idle", "floor")[index % 5]
        mix[kind] += 1
        candidates = nodes_by_type[endpoint.gpu_type]
        if kind == "serving":
            num_replicas = 1 + index % 2
            for replica_index in range(num_replicas):
                node = candidates[(index + replica_index * 7) % len(candidates)]
                replicas.append(Replica(endpoint=endpoint, node=node, state=ReplicaState.READY, address="http://10.0.0.1:8000",
                                        reserved_memory_mb=20_000, ready_at=moment))
            # In flight that wants exactly `num_replicas` replicas: a steady tick changes nothing.
            inflight = {f"req-{uuid.uuid4().hex}": now for _ in range(num_replicas * TARGET_CONCURRENCY - 1)}
            pipe.zadd(redis_keys.inflight_key(endpoint.organization_id, str(endpoint.pk)), inflight)
            pipe.set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), now)
            pipe.zadd(redis_keys.RECENT_ENDPOINTS_KEY, {str(endpoint.pk): now})
        elif kind == "recent_idle":
            pipe.set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), now - 3600)
            pipe.zadd(redis_keys.RECENT_ENDPOINTS_KEY, {str(endpoint.pk): now - 3600})
        else:
            floors.append(endpoint.pk)
            replicas.append(Replica(endpoint=endpoint, node=candidates[index % len(candidates)], state=ReplicaState.READY,
                                    address="http://10.0.0.1:8000", reserved_memory_mb=20_000, ready_at=moment))
    pipe.execute()
    Endpoint.objects.filter(pk__in=floors).update(min_replicas=1)
    Replica.objects.bulk_create(replicas, batch_size=2000)
    return mix


def time_ticks(num_ticks: int) -> dict:
    from django.db import connection, reset_queries

    from endpoints.scheduler import autoscale_tick

    autoscale_tick()  # warm: connections, caches, the stable window's first sample
    durations, num_queries, num_endpoints = [], [], 0
    while len(durations) < num_ticks:
        reset_queries()
        started = time.perf_counter()
        num_endpoints = autoscale_tick()
        elapsed_ms = (time.perf_counter() - started) * 1000
        if num_endpoints == 0:  # another beat on this data folder held the tick lock: not a tick
            time.sleep(0.05)
            continue
        durations.append(elapsed_ms)
        num_queries.append(len(connection.queries))
    durations.sort()
    return {
        "num_active_seen": num_endpoints,
        "tick_ms_median": round(statistics.median(durations), 1),
        "tick_ms_p95": round(durations[min(len(durations) - 1, int(0.95 * len(durations)))], 1),
        "tick_ms_max": round(durations[-1], 1),
        "queries_per_tick": int(statistics.median(num_queries)),
    }


def scale_up_tick(endpoints: list) -> dict:
    """One tick in which 10 serving endpoints each want one more replica (placement on 1,000 nodes)."""
    from django.db import connection, reset_queries

    from controlplane import redis_keys
    from controlplane.redis_client import get_redis
    from endpoints.models import Replica
    from endpoints.scheduler import autoscale_tick

    serving = [e for index, e in enumerate(endpoints) if index % 5 in (0, 2)][:10]  # one replica each, room for more
    now = time.time()
    pipe = get_redis().pipeline(transaction=False)
    for endpoint in serving:
        pipe.zadd(redis_keys.inflight_key(endpoint.organization_id, str(endpoint.pk)), {f"burst-{uuid.uuid4().hex}": now for _ in range(TARGET_CONCURRENCY + 1)})
    pipe.execute()
    before = Replica.objects.filter(endpoint__in=serving).count()
    reset_queries()
    started = time.perf_counter()
    autoscale_tick()
    elapsed = (time.perf_counter() - started) * 1000
    placed = Replica.objects.filter(endpoint__in=serving).count() - before
    return {"num_endpoints_scaling": len(serving), "num_replicas_placed": placed, "tick_ms": round(elapsed, 1),
            "queries": len(connection.queries)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=15)
    parser.add_argument("--active", default="10,100,500")
    parser.add_argument("--total", type=int, default=10_000)
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "autoscaler.json"))
    args = parser.parse_args()
    active_levels = [int(value) for value in args.active.split(",")]
    flat_active = 100 if 100 in active_levels else active_levels[0]

    load_at_start = round(os.getloadavg()[0], 2)
    setup_django()
    import logging

    logging.getLogger("endpoints").setLevel(logging.WARNING)
    started = time.perf_counter()
    organization, nodes = reset_rows()
    endpoints = add_endpoints(organization, 0, 1000)
    print(f"made {len(nodes)} nodes and {len(endpoints)} endpoints in {time.perf_counter() - started:.1f} s", flush=True)

    flat = []
    make_active(endpoints, nodes, flat_active)
    flat.append({"num_endpoints_total": len(endpoints), "num_active": flat_active, **time_ticks(args.ticks)})
    print(f"  total {len(endpoints)}, active {flat_active}: {flat[-1]}", flush=True)

    endpoints += add_endpoints(organization, len(endpoints), args.total - len(endpoints))
    levels = []
    for num_active in active_levels:
        mix = make_active(endpoints, nodes, num_active)
        levels.append({"num_endpoints_total": len(endpoints), "num_active": num_active, "mix": mix, **time_ticks(args.ticks)})
        print(f"  total {len(endpoints)}, active {num_active}: {levels[-1]}", flush=True)
    flat.append(next(level for level in levels if level["num_active"] == flat_active))

    make_active(endpoints, nodes, flat_active)
    scale_up = scale_up_tick(endpoints)
    print(f"  scale-up tick: {scale_up}", flush=True)
    cleanup(organization)

    document = {
        "benchmark": "autoscaler",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(), "num_cpus": os.cpu_count(),
        "load_average_1m_at_start": load_at_start, "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "num_nodes": NUM_NODES, "num_endpoints": len(endpoints), "ticks_per_level": args.ticks,
        "note": "DJANGO_DEBUG=1 (query logging on); embedded PostgreSQL and Redis on the same 2 cores",
        "levels": levels, "flat_in_total": flat, "scale_up_tick": scale_up,
        "target_ms": TARGET_MS,
        "target_met": all(level["tick_ms_median"] <= TARGET_MS for level in levels),
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")

    print("\n| endpoints total | active | tick median ms | p95 ms | queries per tick |")
    print("|---:|---:|---:|---:|---:|")
    for level in flat[:1] + levels:
        print(f"| {level['num_endpoints_total']:,} | {level['num_active']} | {level['tick_ms_median']} | {level['tick_ms_p95']} | {level['queries_per_tick']} |")
    print(f"\nscale-up tick (10 endpoints +1 replica each on {NUM_NODES:,} nodes): {scale_up['tick_ms']} ms, {scale_up['queries']} queries")
    print(f"load average (1 min) at end: {document['load_average_1m_at_end']}; target ≤ {TARGET_MS} ms met: {document['target_met']}")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
