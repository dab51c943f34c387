"""Prefix-aware vs least-outstanding replica choice on two real engines, in the same run.

Starts two CPU (or CUDA) replicas of the tiny model through the agent's supervisor (production's
command line: prefix caching on, `--enable-prompt-tokens-details`), then sends a workload where groups
of requests share a long prefix (a system prompt of `--prefix-chars` characters, then a short question
of their own), streamed, `--concurrency` at a time, groups interleaved. Each request's replica is chosen
by the gateway's rule (`endpoints.gateway.routing`: `preference` + `choose`, the rule the admission
script applies, which `tests/gateway/test_prefix_routing.py` checks equal on real Redis) over
outstanding counts kept here, either with the prompt's prefix key (prefix-aware) or without one (the
least outstanding, as before). The two modes alternate round by round, each round with prefixes of its
own, so neither warms the other's cache. Reports output tokens/s, TTFT p50/p95 and the prefix-cache hit
rate (the engines' `usage.prompt_tokens_details.cached_tokens` / prompt tokens); writes
`bench/results/prefix_routing.json` and prints a markdown table.

    .venv/bin/python bench/bench_prefix_routing.py [--groups 6] [--per-group 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from endpoints.gateway import routing  # noqa: E402
from gpu_agent.protocol import ReplicaSpec, ReplicaState  # noqa: E402
from gpu_agent.runtime.engine import engine_version  # noqa: E402
from gpu_agent.runtime.hardware import detect_hardware  # noqa: E402
from gpu_agent.runtime.supervisor import Supervisor  # noqa: E402
from gpu_agent.runtime.tiny_model import build_tiny_model  # noqa: E402

ENGINE_KEY = "bench-prefix-engine-key"
WORDS = ("invoice replica prefix cache tenant gateway token stream endpoint adapter ledger quota region "
         "latency throughput policy refund support schedule warm cold node shard").split()


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def workload(seed: int, num_groups: int, per_group: int, prefix_chars: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for group in range(num_groups):
        words = []
        while sum(len(w) + 1 for w in words) < prefix_chars:
            words.append(rng.choice(WORDS))
        system = f"[policy {seed}-{group}] " + " ".join(words)
        prompts += [f"{system}\nQuestion {n}: what does the policy say about item {rng.randint(0, 999)}?"
                    for n in range(per_group)]
    rng.shuffle(prompts)
    return prompts


async def run_mode(addresses: list[str], replica_ids: list[str], prompts: list[str], *, prefix_aware: bool,
                   concurrency: int, max_tokens: int, margin: int) -> dict:
    outstanding = [0] * len(addresses)
    placed = [0] * len(addresses)
    ttfts, prompt_tokens, cached_tokens, output_tokens = [], 0, 0, 0
    queue = list(prompts)

    async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {ENGINE_KEY}"}) as client:

        async def one(prompt: str) -> None:
            nonlocal prompt_tokens, cached_tokens, output_tokens
            key = routing.prefix_key("completion", {"prompt": prompt}) if prefix_aware else None
            chosen = routing.choose(routing.route(0, "bench", key, replica_ids, margin=margin), outstanding)
            outstanding[chosen] += 1
            placed[chosen] += 1
            started = time.perf_counter()
            first = None
            try:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
                async with client.stream("POST", f"{addresses[chosen]}/v1/completions", json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if first is None and event.get("choices"):
                            first = time.perf_counter() - started
                        if usage := event.get("usage"):
                            prompt_tokens += usage["prompt_tokens"]
                            output_tokens += usage["completion_tokens"]
                            cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            finally:
                outstanding[chosen] -= 1
            ttfts.append(first)

        async def worker() -> None:
            while queue:
                await one(queue.pop(0))

        started_at = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed_s = time.perf_counter() - started_at
    return {"num_requests": len(ttfts), "elapsed_s": elapsed_s, "ttfts": ttfts, "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens, "output_tokens": output_tokens, "placed": placed}


def summarize(runs: list[dict]) -> dict:
    ttfts = [t for run in runs for t in run["ttfts"]]
    elapsed = sum(run["elapsed_s"] for run in runs)
    prompt = sum(run["prompt_tokens"] for run in runs)
    return {
        "num_requests": sum(run["num_requests"] for run in runs),
        "output_tokens_per_s": round(sum(run["output_tokens"] for run in runs) / elapsed, 1),
        "ttft_p50_ms": round(_percentile(ttfts, 0.5) * 1000, 1),
        "ttft_p95_ms": round(_percentile(ttfts, 0.95) * 1000, 1),
        "prompt_tokens_per_request": round(prompt / max(1, sum(run["num_requests"] for run in runs))),
        "cache_hit_rate": round(sum(run["cached_tokens"] for run in runs) / prompt, 3) if prompt else 0.0,
        "requests_per_replica": [sum(run["placed"][i] for run in runs) for i in range(len(runs[0]["placed"]))],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: build the tiny model in a temp dir)")
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--per-group", type=int, default=6)
    parser.add_argument("--prefix-chars", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--margin", type=int, default=8,
                        help="the endpoint's target concurrency: how far above the least loaded a preferred replica may be")
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "prefix_routing.json"))
    args = parser.parse_args()

    device = "cpu" if detect_hardware().is_cpu else "cuda"
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as scratch:
        model_dir = Path(args.model) if args.model else build_tiny_model(Path(scratch) / "tiny")
        supervisor = Supervisor(Path(scratch) / "agent", device=device)
        replica_ids = ["replica-a", "replica-b"]
        try:
            for replica_id in replica_ids:
                supervisor.start(ReplicaSpec(replica_id=replica_id, endpoint_id="bench", served_model_name="tiny",
                                             model_source=str(model_dir), max_model_len=2048, max_num_seqs=16,
                                             engine_api_key=ENGINE_KEY), model_dir)
            for replica_id in replica_ids:
                while (replica := supervisor.get(replica_id)).state != ReplicaState.READY:
                    if replica.state == ReplicaState.FAILED:
                        raise SystemExit(f"engine failed: {replica.failure_reason}")
                    supervisor.poll()
                    time.sleep(0.5)
            addresses = [supervisor.get(r).address for r in replica_ids]
            warm = workload(999, 2, 2, 200)
            asyncio.run(run_mode(addresses, replica_ids, warm, prefix_aware=False, concurrency=2, max_tokens=4,
                              margin=args.margin))
            runs: dict[str, list[dict]] = {"prefix_aware": [], "least_outstanding": []}
            for round_index in range(args.rounds):
                order = ["prefix_aware", "least_outstanding"][:: 1 if round_index % 2 == 0 else -1]
                for offset, mode in enumerate(order):
                    prompts = workload(round_index * 2 + offset, args.groups, args.per_group, args.prefix_chars)
                    runs[mode].append(asyncio.run(run_mode(
                        addresses, replica_ids, prompts, prefix_aware=mode == "prefix_aware",
                        concurrency=args.concurrency, max_tokens=args.max_tokens, margin=args.margin)))
        finally:
            supervisor.shutdown(timeout_s=20)

    modes = {mode: summarize(mode_runs) for mode, mode_runs in runs.items()}
    result = {
        "benchmark": "prefix_routing",
        "engine": f"vllm {engine_version()}",
        "device": device,
        "machine": platform.machine(),
        "num_cpus": detect_hardware().num_cpus,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "model": "tiny llama (hidden 128, 2 layers)" if not args.model else str(args.model),
        "workload": {"groups": args.groups, "per_group": args.per_group, "prefix_chars": args.prefix_chars,
                     "rounds": args.rounds, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                     "margin": args.margin},
        "modes": modes,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print("| routing | requests | output tokens/s | TTFT p50 ms | TTFT p95 ms | cache hit rate | requests per replica |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for mode, row in modes.items():
        print(f"| {mode.replace('_', '-')} | {row['num_requests']} | {row['output_tokens_per_s']} | {row['ttft_p50_ms']} | "
              f"{row['ttft_p95_ms']} | {row['cache_hit_rate']} | {row['requests_per_replica']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
