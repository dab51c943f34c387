"""Speculative decoding on vs off: output tokens/s and inter-token latency on an "edit this text" workload.

Starts one replica of the tiny model through the agent's supervisor (the command line production
uses) for each mode in turn, in the same run: speculation off, n-gram prompt lookup, and a draft
model. Each gets the same streamed completions (greedy, fixed `max_tokens`, `ignore_eos`) at
concurrency 1 and 4. Inter-token latency per request is (last token - first token) / (tokens - 1),
so several tokens arriving in one chunk (accepted guesses) count as what the client sees. Next to
the speed it reports what the engine says about its guesses (`vllm:spec_decode_*` metrics): draft
tokens proposed, accepted, and the acceptance rate, because speed without it is not interpretable.

NOTE, read before the numbers: the tiny model has random weights. It does not edit text; greedy
decoding makes it repeat one token, which prompt lookup then predicts from its own output, so the
n-gram acceptance is that of a degenerate output, not of an edit. The draft model is a copy of the
target (the only model here with the same tokenizer), so every guess is accepted: an upper bound for
acceptance, and on CPU the worst case for cost (the draft costs as much as the target). What this
measures honestly is the engine's mechanics and overhead of each mode on this machine; the speed-up
of a real model depends on how often its guesses land, which the acceptance rate shows.

    .venv/bin/python bench/bench_speculative.py [--model DIR] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpu_agent.protocol import ReplicaSpec, ReplicaState, SpeculativeSpec  # noqa: E402
from gpu_agent.runtime.engine import engine_version  # noqa: E402
from gpu_agent.runtime.hardware import detect_hardware  # noqa: E402
from gpu_agent.runtime.supervisor import Supervisor  # noqa: E402
from gpu_agent.runtime.tiny_model import build_tiny_model  # noqa: E402

ENGINE_KEY = "bench-speculative-engine-key"
CONCURRENCY_LEVELS = (1, 4)
TEXT = (
    "the replica starts when a request arrives and the node loads the weights from the bucket . "
    "the engine serves the model and the gateway holds the request until the replica is ready . "
)


def edit_prompt(index: int) -> str:
    """An editing task: the answer is mostly the given text again."""
    return f"request {index} . rewrite this text and fix the typos : {TEXT * 2} rewritten text : {TEXT}"


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def stream_one(client: httpx.AsyncClient, address: str, index: int, max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": edit_prompt(index), "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    started_at = time.perf_counter()
    first_at = last_at = None
    num_tokens = 0
    async with client.stream("POST", f"{address}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last_at = time.perf_counter()
                first_at = first_at or last_at
    return {"num_tokens": num_tokens, "ttft_s": first_at - started_at,
            "itl_s": (last_at - first_at) / max(1, num_tokens - 1)}


async def run_level(address: str, concurrency: int, num_requests: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {ENGINE_KEY}"}) as client:
        queue = list(range(num_requests))
        done: list[dict] = []

        async def worker() -> None:
            while queue:
                done.append(await stream_one(client, address, queue.pop(), max_tokens))

        started_at = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed_s = time.perf_counter() - started_at
    itl_ms = [request["itl_s"] * 1000 for request in done]
    num_tokens = sum(request["num_tokens"] for request in done)
    return {
        "concurrency": concurrency, "num_requests": len(done), "num_output_tokens": num_tokens,
        "elapsed_s": round(elapsed_s, 3), "output_tokens_per_s": round(num_tokens / elapsed_s, 1),
        "itl_p50_ms": round(statistics.median(itl_ms), 2), "itl_p95_ms": round(percentile(itl_ms, 0.95), 2),
    }


def spec_metrics(address: str) -> dict[str, float]:
    text = httpx.get(f"{address}/metrics", headers={"Authorization": f"Bearer {ENGINE_KEY}"}, timeout=30).text
    totals = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        values = re.findall(rf"^vllm:spec_decode_{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        totals[name] = sum(float(value) for value in values)
    return totals


def run_mode(name: str, speculative: SpeculativeSpec | None, model_dir: Path, scratch: Path, args) -> dict:
    supervisor = Supervisor(scratch / f"agent-{name}", device="cpu" if detect_hardware().is_cpu else "cuda")
    spec = ReplicaSpec(replica_id=f"bench-{name}", endpoint_id="bench", served_model_name="tiny",
                       model_source=str(model_dir), max_model_len=1024, max_num_seqs=16,
                       engine_api_key=ENGINE_KEY, speculative=speculative)
    try:
        supervisor.start(spec, model_dir)
        while (replica := supervisor.get(spec.replica_id)).state != ReplicaState.READY:
            if replica.state == ReplicaState.FAILED:
                raise SystemExit(f"{name}: engine failed: {replica.failure_reason}")
            supervisor.poll()
            time.sleep(0.5)
        asyncio.run(run_level(replica.address, 1, 1, 8))  # warm-up
        before = spec_metrics(replica.address)
        levels = [asyncio.run(run_level(replica.address, concurrency, args.num_requests, args.max_tokens))
                  for concurrency in CONCURRENCY_LEVELS]
        after = spec_metrics(replica.address)
    finally:
        supervisor.shutdown(timeout_s=20)
    proposed = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    drafts = after["num_drafts"] - before["num_drafts"]
    return {
        "mode": name, "levels": levels, "num_draft_tokens": int(proposed), "num_accepted_tokens": int(accepted),
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        "mean_accepted_per_draft": round(accepted / drafts, 2) if drafts else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: build the tiny model in a temp dir)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=8, help="per concurrency level")
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "speculative.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-speculative-") as scratch_name:
        scratch = Path(scratch_name)
        model_dir = Path(args.model) if args.model else build_tiny_model(scratch / "tiny")
        draft_dir = shutil.copytree(model_dir, scratch / "draft")  # the same tokenizer: see the NOTE above
        modes = [
            ("off", None),
            ("ngram", SpeculativeSpec(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)),
            ("draft", SpeculativeSpec(method="draft", num_speculative_tokens=4, draft_source=str(draft_dir))),
        ]
        results = [run_mode(name, speculative, model_dir, scratch, args) for name, speculative in modes]

    result = {
        "benchmark": "speculative",
        "engine": f"vllm {engine_version()}",
        "device": "cpu" if detect_hardware().is_cpu else "cuda",
        "machine": platform.machine(),
        "num_cpus": detect_hardware().num_cpus,
        "model": "tiny llama (hidden 128, 2 layers, random weights)" if not args.model else str(args.model),
        "draft": "a copy of the target (same tokenizer; every guess is accepted)",
        "max_tokens": args.max_tokens,
        "modes": results,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")

    print("| mode | concurrency | output tokens/s | ITL p50 ms | ITL p95 ms | draft tokens | acceptance |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode in results:
        for level in mode["levels"]:
            acceptance = "—" if mode["acceptance_rate"] is None else f"{mode['acceptance_rate']:.0%}"
            print(f"| {mode['mode']} | {level['concurrency']} | {level['output_tokens_per_s']} | "
                  f"{level['itl_p50_ms']} | {level['itl_p95_ms']} | {mode['num_draft_tokens']} | {acceptance} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
