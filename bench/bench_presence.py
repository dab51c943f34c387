"""The gateway's heartbeat and its reconcile (`endpoints.gateway.presence`): cost with N organisations in flight or idle.

A gateway process beats every second (`presence.beat`) and every `RECONCILE_EVERY_BEATS` beats compares what Redis
holds for it with what it serves (`presence._reconcile`). Measured on the embedded Redis of the data folder
(`INFERPLANE_DATA_DIR`, default `.data/bench`; its database is flushed), the process acting as one gateway:
  * in flight: N organisations with one call each, tracked and held in Redis with its reservation and its progress
    recorded (so a reconcile also asks what Redis lost of them: `counters.holds_lost`): a reconcile, and a beat that
    does not reconcile (the calls' progress asked for, unchanged since the last beat, as a stalled stream's);
  * idle: N organisations this process served once and serves nothing for now, nothing of theirs in Redis: the first
    reconcile after they went idle, and a later one (once two reconciles found nothing of theirs, they are no longer
    read; before, every one of them was read by every reconcile, forever);
  * deadlines due: N organisations with one long call each whose reservation deadline is due to be pushed on (once a
    minute, `presence._push_deadlines_on`): the push, the loop's largest stall, the largest pipeline sent;
  * progress due: N organisations with one stream each whose tokens grew since the last beat: the beat's recording of
    their progress (`presence._record_progress`), and the event loop's largest stall meanwhile (a task ticking every
    5 ms), which the beats beside it wait for; the loop thread's CPU per recording (`time.thread_time`) and the
    garbage collector's collections meanwhile (`gc.callbacks`: how many were full, the longest).

    .venv/bin/python bench/bench_presence.py [--organizations 100,1000,10000] [--repeat 7] [--progress-only]
        [--default-collector]

The process collects garbage as the gateway's does (`endpoints.gateway.app._freeze_startup_objects`);
`--default-collector` keeps CPython's defaults, as the bench did before.

Prints a markdown table (µs per call, and per organisation) and writes `bench/results/presence.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("INFERPLANE_DATA_DIR", str(REPO / ".data" / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

FIRST_ORGANIZATION = 9_000_000  # far from any real row: nothing here is in PostgreSQL


def _reset(presence, traffic) -> None:
    from controlplane.redis_client import get_redis

    get_redis().flushdb()
    presence.serving.clear()
    presence.unfinished.clear()
    presence._repair = presence._Repair()
    traffic._registered = (os.getpid(), set())


async def _ticking(gaps: list[float]) -> None:
    """A task ticking every 5 ms until cancelled, each gap between its ticks noted in `gaps`: the loop's stalls."""
    last = time.monotonic()
    while True:
        await asyncio.sleep(0.005)
        gaps.append(time.monotonic() - last)
        last = time.monotonic()


async def _timed(call, repeat: int) -> list[float]:
    """Microseconds of each of `repeat` awaits of `call()`."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        await call()
        times.append((time.perf_counter() - started) * 1e6)
    return times


async def in_flight(num_organizations: int, repeat: int) -> dict:
    from billing.quota.counters import Reservation
    from controlplane import redis_keys
    from controlplane.redis_client import get_async_redis
    from endpoints.gateway import presence, traffic

    _reset(presence, traffic)
    gateway = traffic.gateway_id()
    redis = get_async_redis()
    await presence.beat()
    async with redis.pipeline(transaction=False) as pipe:
        for organization_id in range(FIRST_ORGANIZATION, FIRST_ORGANIZATION + num_organizations):
            request_id = f"call-{organization_id}"
            reservation = Reservation(request_id, organization_id, None, Decimal("0.01"), "2026-12")
            held = presence.track(request_id, organization_id, f"endpoint-{organization_id}", None, reservation,
                                  progress=lambda recorded: None)  # nothing new since the last beat
            held.progress_recorded = (100, 0, 20)
            traffic._registered[1].add(organization_id)
            pipe.hset(traffic.gateway_requests_key(organization_id), request_id, held.value())
            pipe.hset(redis_keys.reservations_key(organization_id), request_id, "{}")  # as its admission held it
            pipe.hset(redis_keys.progress_key(organization_id), request_id, "{}")  # as a beat recorded it
        await pipe.execute()
    reconcile = await _timed(lambda: presence._reconcile(gateway), repeat)
    # NOTE: the reconciles above may outlast the alive key (`ALIVE_TTL_S`): written again, so that the beats below do not
    # reconcile (a beat that finds it gone does, forgotten, and so may each after it while one outlasts the key).
    await redis.set(redis_keys.gateway_alive_key(gateway), "1", ex=presence.ALIVE_TTL_S)
    presence._repair.num_beats = -10 * repeat
    beat = await _timed(presence.beat, repeat)
    _reset(presence, traffic)
    return {"num_organizations": num_organizations, "state": "in flight",
            "reconcile_us": round(statistics.median(reconcile)), "beat_us": round(statistics.median(beat))}


async def idle(num_organizations: int, repeat: int) -> dict:
    from endpoints.gateway import presence, traffic

    _reset(presence, traffic)
    gateway = traffic.gateway_id()
    await presence.beat()
    traffic._registered[1].update(range(FIRST_ORGANIZATION, FIRST_ORGANIZATION + num_organizations))
    first = await _timed(lambda: presence._reconcile(gateway), 1)
    await presence._reconcile(gateway)
    later = await _timed(lambda: presence._reconcile(gateway), repeat)
    _reset(presence, traffic)
    return {"num_organizations": num_organizations, "state": "idle",
            "first_reconcile_us": round(first[0]), "later_reconcile_us": round(statistics.median(later))}


async def progress_due(num_organizations: int, repeat: int) -> dict:
    from billing.ledger import UsageReport
    from billing.quota.counters import Reservation
    from controlplane import redis_keys
    from controlplane.redis_client import get_async_redis
    from endpoints.gateway import presence, traffic

    _reset(presence, traffic)
    started_at = datetime.now(UTC)

    def growing(organization_id: int, request_id: str):
        def progress(recorded):  # a token more since the last beat recorded it, the row built as a stream's
            return UsageReport(request_id=request_id, organization_id=organization_id, api_key_id=None,
                               endpoint_id=f"endpoint-{organization_id}", replica_id="replica", prompt_tokens=100,
                               cached_tokens=0, completion_tokens=(recorded[2] if recorded else 0) + 1,
                               started_at=started_at, first_token_at=started_at, finished_at=datetime.now(UTC),
                               status="gateway_lost", cold_start_s=0.0)
        return progress

    redis = get_async_redis()
    async with redis.pipeline(transaction=False) as pipe:
        for organization_id in range(FIRST_ORGANIZATION, FIRST_ORGANIZATION + num_organizations):
            request_id = f"call-{organization_id}"
            reservation = Reservation(request_id, organization_id, None, Decimal("0.01"), "2026-12")
            presence.track(request_id, organization_id, f"endpoint-{organization_id}", None, reservation,
                           progress=growing(organization_id, request_id))
            pipe.hset(redis_keys.reservations_key(organization_id), request_id, "{}")  # as its admission held it
        await pipe.execute()
    gaps: list[float] = []
    ticker = asyncio.get_running_loop().create_task(_ticking(gaps))
    recording, stalls, loop_cpu = [], [], []
    with _collections_watched() as collections:
        for _ in range(repeat):
            gaps.clear()
            await asyncio.sleep(0.05)
            cpu_before = time.thread_time()
            recording += await _timed(presence._record_progress, 1)
            loop_cpu.append(time.thread_time() - cpu_before)
            stalls.append(max(gaps))
    ticker.cancel()
    _reset(presence, traffic)
    return {"num_organizations": num_organizations, "state": "progress due",
            "record_progress_us": round(statistics.median(recording)),
            "largest_stall_us": round(max(stalls) * 1e6),
            "loop_cpu_us": round(statistics.median(loop_cpu) * 1e6),
            "num_full_collections": sum(1 for generation, _ in collections if generation == 2),
            "largest_collection_us": round(max((pause for _, pause in collections), default=0) * 1e6)}


async def deadlines_due(num_organizations: int, repeat: int) -> dict:
    """A push of the reservation deadlines of N organisations' long calls (`presence._push_deadlines_on`, due once a
    minute): its time, the loop's largest stall meanwhile, and the largest pipeline it sent."""
    from billing.quota.counters import Reservation
    from controlplane import redis_keys
    from controlplane.redis_client import get_async_redis
    from endpoints.gateway import presence, traffic

    _reset(presence, traffic)
    redis = get_async_redis()
    async with redis.pipeline(transaction=False) as pipe:
        for organization_id in range(FIRST_ORGANIZATION, FIRST_ORGANIZATION + num_organizations):
            request_id = f"call-{organization_id}"
            reservation = Reservation(request_id, organization_id, None, Decimal("0.01"), "2026-12")
            held = presence.track(request_id, organization_id, f"endpoint-{organization_id}", None, reservation)
            held.since -= 120  # served two minutes: its push is due
            pipe.zadd(redis_keys.deadlines_key(organization_id), {request_id: 1e10})  # as its admission held it
        await pipe.execute()
    sizes: list[int] = []

    class Watched:  # the gateway's client, each pipeline's size noted
        def __getattr__(self, name):
            return getattr(redis, name)

        def pipeline(self, transaction=True):
            pipe = redis.pipeline(transaction=transaction)
            execute = pipe.execute

            async def counted(*args, **kwargs):
                sizes.append(len(pipe.command_stack))
                return await execute(*args, **kwargs)
            pipe.execute = counted
            return pipe

    gaps: list[float] = []
    ticker = asyncio.get_running_loop().create_task(_ticking(gaps))
    pushes, stalls = [], []
    for _ in range(repeat):
        presence._extended = presence._Extended()  # due
        gaps.clear()
        await asyncio.sleep(0.05)
        pushes += await _timed(lambda: presence._push_deadlines_on(Watched()), 1)
        stalls.append(max(gaps))
    ticker.cancel()
    _reset(presence, traffic)
    return {"num_organizations": num_organizations, "state": "deadlines due",
            "push_us": round(statistics.median(pushes)), "largest_stall_us": round(max(stalls) * 1e6),
            "largest_pipeline": max(sizes)}


@contextlib.contextmanager
def _collections_watched():
    """The garbage collector's collections meanwhile (`gc.callbacks`): (generation, seconds) each."""
    collections: list[tuple[int, float]] = []
    started = [0.0]

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(watch)
    try:
        yield collections
    finally:
        gc.callbacks.remove(watch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--organizations", default="100,1000,10000")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--progress-only", action="store_true", help="measure the progress recorded alone")
    parser.add_argument("--default-collector", action="store_true",
                        help="keep CPython's collector settings, not the gateway's (as the bench ran before)")
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "presence.json"))
    args = parser.parse_args()
    import django

    django.setup()
    import logging

    logging.getLogger("inferplane.gateway").setLevel(logging.ERROR)
    if not args.default_collector:
        # NOTE: as the gateway's own startup (`app._freeze_startup_objects`: startup objects frozen, a young threshold of
        # 20,000). Without it, the bench's process collected as no gateway does: a full collection walked every
        # object of startup and of the calls (0.22-0.30 s, 6 in 5 recordings of 10,000 organisations), the recording's
        # 0.3-0.5 s "stalls" (the review of presence at scale, measured with `gc.callbacks`).
        from endpoints.gateway import app

        app._freeze_startup_objects()
    levels = [int(value) for value in args.organizations.split(",")]

    async def run() -> list[dict]:
        results = []
        for num_organizations in levels:
            parts = [progress_due] if args.progress_only else [in_flight, idle, progress_due, deadlines_due]
            for part in parts:
                results.append(await part(num_organizations, args.repeat))
                print(results[-1], flush=True)
        return results

    results = asyncio.run(run())
    output = Path(args.output)
    if args.progress_only and output.exists():  # the other rows kept, as measured before
        kept = [result for result in json.loads(output.read_text())["results"] if result["state"] != "progress due"]
        results = kept + results
    document = {"benchmark": "presence", "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": platform.platform(), "num_cpus": os.cpu_count(),
                "note": "embedded Redis on the same cores; medians of --repeat calls; largest_stall_us: the largest "
                        "of --repeat recordings", "results": results}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")

    print("\n| organisations | state | reconcile µs | µs per organisation | beat µs (no reconcile) | later reconcile µs |")
    print("|---:|---|---:|---:|---:|---:|")
    for result in results:
        n = result["num_organizations"]
        if result["state"] == "progress due":
            print(f"| {n:,} | progress due | recorded in {result['record_progress_us']:,} | "
                  f"largest stall {result['largest_stall_us']:,} | loop CPU {result.get('loop_cpu_us', 0):,} | "
                  f"{result.get('num_full_collections', 0)} full collections, largest "
                  f"{result.get('largest_collection_us', 0):,} |")
        elif result["state"] == "deadlines due":
            print(f"| {n:,} | deadlines due | pushed in {result['push_us']:,} | "
                  f"largest stall {result['largest_stall_us']:,} | largest pipeline {result['largest_pipeline']:,} | |")
        elif result["state"] == "in flight":
            print(f"| {n:,} | in flight | {result['reconcile_us']:,} | {result['reconcile_us'] / n:.1f} "
                  f"| {result['beat_us']:,} | |")
        else:
            print(f"| {n:,} | idle | {result['first_reconcile_us']:,} | {result['first_reconcile_us'] / n:.1f} | "
                  f"| {result['later_reconcile_us']:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
