"""A CPU engine's decode rate with OpenMP's passive wait policy against libgomp's default (issue #17).

The agent starts every CPU engine, and the zygote, with `OMP_WAIT_POLICY=PASSIVE` (`engine.CPU_OPENMP_ENV`):
OpenMP's threads sleep between parallel regions instead of spinning, which halved the CPU a concurrent
cold start costs. Spinning threads answer the next parallel region sooner, so the question is what the
policy costs an engine that is serving. This starts the tiny model's engine (as `bench_gateway.start_vllm`
does, one at a time) with the policy and without it, alternating the order each round, and measures
completion tokens/s of 64-token completions at concurrency 1 and 8. Appends the run to
`bench/results/openmp_wait_policy.json`; prints one line per engine and the paired ratios.

    .venv/bin/python bench/probe_openmp_wait.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import bench_gateway as bench  # noqa: E402

MAX_TOKENS = 64


async def tokens_per_second(url: str, concurrency: int, requests_each: int) -> float:
    body = {"model": "tiny", "prompt": "hello world " * 8, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS,
            "temperature": 0}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body | {"max_tokens": 4, "min_tokens": 4}) as warm:
            await warm.read()

        async def client() -> int:
            num_tokens = 0
            for _ in range(requests_each):
                async with session.post(url + "/v1/completions", json=body) as response:
                    num_tokens += (await response.json())["usage"]["completion_tokens"]
            return num_tokens

        started = time.perf_counter()
        num_tokens = sum(await asyncio.gather(*[client() for _ in range(concurrency)]))
        return num_tokens / (time.perf_counter() - started)


def start_engine(policy: str | None, logs: Path) -> tuple[bench.ChildProcess, str]:
    port = bench.free_port()
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(bench.TINY_MODEL_DIR),
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "512", "--max-num-seqs", "64", "--enforce-eager", "--distributed-executor-backend", "uni",
            "--disable-uvicorn-access-log"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    child = bench.Child(args, logs / f"vllm-{policy or 'default'}-{port}.log", env=env)
    url = f"http://127.0.0.1:{port}"
    bench.wait_healthy(url + "/health", child, 300)
    return child, url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "openmp_wait_policy.json"))
    args = parser.parse_args()
    if "OMP_WAIT_POLICY" in os.environ:
        parser.error("unset OMP_WAIT_POLICY first: the engines inherit this environment")
    if not (bench.TINY_MODEL_DIR / "config.json").exists():
        bench.build_tiny_model(bench.TINY_MODEL_DIR)
    logs = Path(tempfile.mkdtemp(prefix="openmp-wait-"))
    rows = []
    for round_number in range(args.rounds):
        order = ["PASSIVE", None] if round_number % 2 == 0 else [None, "PASSIVE"]
        for policy in order:
            child, url = start_engine(policy, logs)
            try:
                load = os.getloadavg()[0]
                row = {"round": round_number + 1, "policy": policy or "default",
                       "c1_tokens_per_s": round(asyncio.run(tokens_per_second(url, 1, 6)), 1),
                       "c8_tokens_per_s": round(asyncio.run(tokens_per_second(url, 8, 3)), 1),
                       "load_average_1min": round(load, 1)}
            finally:
                child.stop()
            print(json.dumps(row), flush=True)
            rows.append(row)
    ratios = {}
    for level in ("c1", "c8"):
        paired = []
        for round_number in range(1, args.rounds + 1):
            by_policy = {row["policy"]: row[f"{level}_tokens_per_s"] for row in rows if row["round"] == round_number}
            paired.append(round(by_policy["PASSIVE"] / by_policy["default"], 2))
        ratios[level] = {"passive_over_default_per_round": paired, "median": statistics.median(paired)}
    print(json.dumps(ratios))
    # NOTE: runs accumulate (a busy machine's runs disagree with each other): each is kept with its load.
    output = Path(args.output)
    runs = json.loads(output.read_text())["runs"] if output.exists() else []
    runs.append({"when": datetime.now(UTC).isoformat(timespec="seconds"), "rows": rows, "ratios": ratios})
    document = {"machine": f"{os.cpu_count()} cores", "model": "tiny (tests' fixture), CPU, float32",
                "max_tokens": MAX_TOKENS, "runs": runs}
    output.write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
