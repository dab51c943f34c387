"""Continuous batching on one replica: output tokens/s at concurrency 1, 8 and 32.

Starts one replica of the tiny model through the agent's supervisor (the same
command line production uses), sends completions straight to the engine with
httpx (fixed `max_tokens`, `ignore_eos`), writes `bench/results/batching.json`
and prints a markdown table. Headline: throughput at c32 / throughput at c1.

    .venv/bin/python bench/bench_batching.py [--model DIR] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpu_agent.protocol import ReplicaSpec, ReplicaState  # noqa: E402
from gpu_agent.runtime.engine import engine_version  # noqa: E402
from gpu_agent.runtime.hardware import detect_hardware  # noqa: E402
from gpu_agent.runtime.supervisor import Supervisor  # noqa: E402
from gpu_agent.runtime.tiny_model import build_tiny_model  # noqa: E402

CONCURRENCY_LEVELS = (1, 8, 32)


ENGINE_KEY = "bench-batching-engine-key"  # engines answer only their replica's key


async def run_level(address: str, concurrency: int, num_requests_per_worker: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(
        timeout=300, limits=httpx.Limits(max_connections=concurrency + 4), headers={"Authorization": f"Bearer {ENGINE_KEY}"}
    ) as client:

        async def worker(worker_index: int) -> tuple[int, list[float]]:
            tokens, latencies = 0, []
            for request_index in range(num_requests_per_worker):
                started_at = time.perf_counter()
                response = await client.post(
                    f"{address}/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": f"request {worker_index} {request_index}: tell me a story about llamas",
                        "max_tokens": max_tokens,
                        "ignore_eos": True,
                        "temperature": 0.0,
                    },
                )
                response.raise_for_status()
                tokens += response.json()["usage"]["completion_tokens"]
                latencies.append(time.perf_counter() - started_at)
            return tokens, latencies

        started_at = time.perf_counter()
        results = await asyncio.gather(*(worker(index) for index in range(concurrency)))
        elapsed_s = time.perf_counter() - started_at
    num_tokens = sum(tokens for tokens, _ in results)
    latencies = sorted(latency for _, worker_latencies in results for latency in worker_latencies)
    return {
        "concurrency": concurrency,
        "num_requests": len(latencies),
        "num_output_tokens": num_tokens,
        "elapsed_s": round(elapsed_s, 3),
        "output_tokens_per_s": round(num_tokens / elapsed_s, 1),
        "p50_latency_s": round(latencies[len(latencies) // 2], 3),
        "max_latency_s": round(latencies[-1], 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: build the tiny model in a temp dir)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-requests", type=int, default=16, help="per level; at least 4 per worker")
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "batching.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-batching-") as scratch:
        model_dir = Path(args.model) if args.model else build_tiny_model(Path(scratch) / "tiny")
        supervisor = Supervisor(Path(scratch) / "agent", device="cpu" if detect_hardware().is_cpu else "cuda")
        spec = ReplicaSpec(
            replica_id="bench",
            endpoint_id="bench",
            served_model_name="tiny",
            model_source=str(model_dir),
            max_model_len=512,
            max_num_seqs=64,
            engine_api_key=ENGINE_KEY,
        )
        try:
            launched_at = time.monotonic()
            supervisor.start(spec, model_dir)
            while (replica := supervisor.get("bench")).state != ReplicaState.READY:
                if replica.state == ReplicaState.FAILED:
                    raise SystemExit(f"engine failed: {replica.failure_reason}")
                supervisor.poll()
                time.sleep(0.5)
            ready_s = time.monotonic() - launched_at
            address = replica.address
            asyncio.run(run_level(address, 4, 1, 8))  # warm-up
            levels = [
                asyncio.run(
                    run_level(
                        address, concurrency, max(4, -(-args.min_requests // concurrency)), args.max_tokens
                    )
                )
                for concurrency in CONCURRENCY_LEVELS
            ]
        finally:
            supervisor.shutdown(timeout_s=20)

    by_level = {level["concurrency"]: level for level in levels}
    result = {
        "benchmark": "batching",
        "engine": f"vllm {engine_version()}",
        "device": "cpu" if detect_hardware().is_cpu else "cuda",
        "machine": platform.machine(),
        "num_cpus": detect_hardware().num_cpus,
        "model": "tiny llama (hidden 128, 2 layers)" if not args.model else str(args.model),
        "max_tokens": args.max_tokens,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "time_to_ready_s": round(ready_s, 1),
        "levels": levels,
        "headline_c32_over_c1": round(
            by_level[32]["output_tokens_per_s"] / by_level[1]["output_tokens_per_s"], 2
        ),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")

    print("| concurrency | requests | output tokens | seconds | output tokens/s | p50 latency s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for level in levels:
        print(
            f"| {level['concurrency']} | {level['num_requests']} | {level['num_output_tokens']} | "
            f"{level['elapsed_s']} | {level['output_tokens_per_s']} | {level['p50_latency_s']} |"
        )
    print(
        f"\nc32 / c1 throughput: **{result['headline_c32_over_c1']}x** (time to READY {result['time_to_ready_s']} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
