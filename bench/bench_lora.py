"""N LoRA adapters on one base replica vs N separate endpoints: memory and output tokens/s.

Mode "adapters": one replica of the tiny model started as the agent starts an endpoint with
`max_loras=N` (`--enable-lora`), the N adapters loaded through the agent's `AdapterSlots` (vLLM's
runtime adapter API), and a workload spread round-robin over the adapters. Mode "endpoints": N
replicas of the base model, one per "fine-tune", all running at once, the same workload spread over
them. Memory is the resident memory of each engine's process tree (CPU) summed over engines; on a
GPU node it is what the engines logged they allocated (weights + KV cache) where they say so.
Writes `bench/results/lora.json` and prints a markdown table.

    .venv/bin/python bench/bench_lora.py [--adapters 2] [--requests 16] [--max-tokens 32]
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
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpu_agent.protocol import ReplicaSpec, ReplicaState  # noqa: E402
from gpu_agent.runtime.adapters import AdapterSlots  # noqa: E402
from gpu_agent.runtime.engine import engine_version  # noqa: E402
from gpu_agent.runtime.hardware import detect_hardware  # noqa: E402
from gpu_agent.runtime.supervisor import Supervisor  # noqa: E402
from gpu_agent.runtime.tiny_model import build_tiny_lora_adapter, build_tiny_model  # noqa: E402

ENGINE_KEY = "bench-lora-engine-key"
CONCURRENCY = 4


def tree_rss_mb(pid: int) -> float:
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def start_engines(supervisor: Supervisor, specs: list[ReplicaSpec], model_dir: Path) -> list:
    for spec in specs:
        supervisor.start(spec, model_dir)
    deadline = time.monotonic() + 1200
    while True:
        supervisor.poll()
        replicas = [supervisor.get(spec.replica_id) for spec in specs]
        failed = [r for r in replicas if r.state == ReplicaState.FAILED]
        if failed:
            raise SystemExit(f"engine failed: {failed[0].failure_reason}")
        if all(r.state == ReplicaState.READY for r in replicas):
            return replicas
        if time.monotonic() > deadline:
            raise SystemExit("engines did not become READY")
        time.sleep(0.5)


async def workload(targets: list[tuple[str, str]], num_requests: int, max_tokens: int) -> dict:
    """`num_requests` completions spread round-robin over (address, model) targets, CONCURRENCY at once."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(num_requests):
        queue.put_nowait(index)
    async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {ENGINE_KEY}"}) as client:

        async def worker() -> int:
            tokens = 0
            while not queue.empty():
                index = queue.get_nowait()
                address, model = targets[index % len(targets)]
                response = await client.post(f"{address}/v1/completions", json={
                    "model": model, "prompt": f"request {index}: tell me a story about llamas",
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0})
                response.raise_for_status()
                tokens += response.json()["usage"]["completion_tokens"]
            return tokens

        started_at = time.perf_counter()
        num_tokens = sum(await asyncio.gather(*(worker() for _ in range(CONCURRENCY))))
        elapsed_s = time.perf_counter() - started_at
    return {"num_output_tokens": num_tokens, "elapsed_s": round(elapsed_s, 2),
            "output_tokens_per_s": round(num_tokens / elapsed_s, 1)}


def run_mode(mode: str, scratch: Path, model_dir: Path, adapter_dirs: list[Path], args) -> dict:
    supervisor = Supervisor(scratch / f"agent-{mode}", device="cpu" if detect_hardware().is_cpu else "cuda")
    num = len(adapter_dirs)
    base = dict(endpoint_id="bench", served_model_name="tiny", model_source=str(model_dir),
                max_model_len=512, max_num_seqs=16, engine_api_key=ENGINE_KEY)
    if mode == "adapters":
        specs = [ReplicaSpec(replica_id="lora", max_loras=num, max_lora_rank=8, **base)]
    else:
        specs = [ReplicaSpec(replica_id=f"separate-{i}", **base) for i in range(num)]
    try:
        launched_at = time.monotonic()
        replicas = start_engines(supervisor, specs, model_dir)
        ready_s = time.monotonic() - launched_at
        if mode == "adapters":
            slots = AdapterSlots(replicas[0].address, ENGINE_KEY, num)
            for index, path in enumerate(adapter_dirs):
                slots.ensure(f"adapter-{index}", path)
            targets = [(replicas[0].address, f"adapter-{index}") for index in range(num)]
        else:
            targets = [(replica.address, "tiny") for replica in replicas]
        asyncio.run(workload(targets, len(targets), 4))  # warm-up
        measured = asyncio.run(workload(targets, args.requests, args.max_tokens))
        memory_mb = sum(tree_rss_mb(replica.pid) for replica in replicas if replica.pid)
        engine_memory = [replica.engine_memory for replica in replicas]
    finally:
        supervisor.shutdown(timeout_s=30)
    return {"mode": mode, "num_engines": len(specs), "time_to_ready_s": round(ready_s, 1),
            "resident_memory_mb": round(memory_mb), **measured,
            "engine_reported_mb": [m.to_dict() if m else None for m in engine_memory]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=2, help="N: adapters on one replica vs N endpoints")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "lora.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-lora-") as scratch:
        scratch = Path(scratch)
        model_dir = build_tiny_model(scratch / "tiny")
        adapter_dirs = [build_tiny_lora_adapter(scratch / f"adapter-{i}", seed=i + 1) for i in range(args.adapters)]
        modes = [run_mode(mode, scratch, model_dir, adapter_dirs, args) for mode in ("adapters", "endpoints")]

    by_mode = {m["mode"]: m for m in modes}
    result = {
        "benchmark": "lora",
        "engine": f"vllm {engine_version()}",
        "device": "cpu" if detect_hardware().is_cpu else "cuda",
        "machine": platform.machine(),
        "num_cpus": detect_hardware().num_cpus,
        "model": "tiny llama (hidden 128, 2 layers), rank-4 adapters on q_proj/v_proj",
        "num_adapters": args.adapters,
        "num_requests": args.requests,
        "max_tokens": args.max_tokens,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "modes": modes,
        "memory_endpoints_over_adapters": round(
            by_mode["endpoints"]["resident_memory_mb"] / max(1, by_mode["adapters"]["resident_memory_mb"]), 2),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print("| serving N fine-tunes as | engines | resident memory MB | output tokens/s | time to READY s |")
    print("|---|---:|---:|---:|---:|")
    for mode in modes:
        label = f"{args.adapters} adapters on one replica" if mode["mode"] == "adapters" else f"{args.adapters} endpoints"
        print(f"| {label} | {mode['num_engines']} | {mode['resident_memory_mb']} | "
              f"{mode['output_tokens_per_s']} | {mode['time_to_ready_s']} |")
    print(f"\nmemory of N endpoints / one replica with N adapters: **{result['memory_endpoints_over_adapters']}x**")
    return 0


if __name__ == "__main__":
    sys.exit(main())
