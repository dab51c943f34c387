"""Endpoints woken at once through the whole platform, as a user sees it: time to first token from zero.

Issue #17's "Done when" in the user's terms: N serverless endpoints on one node, each at zero replicas, each
called once at the same instant (one streaming `/v1/chat/completions` per endpoint, through the gateway), against
one endpoint called alone in the same run. A live control plane (uvicorn), Celery worker and beat, and one real
agent (`python -m gpu_agent run --cpu`, its zygote on) on the tiny model, as `bench_cold_start.py` starts them.
Sizes alternate in rounds (1, N, 1, N, ...) so each ratio compares neighbours; each round waits until every
endpoint is back at zero (idle timeout 5 s) and the machine has settled a second. Each call's time is from its
request to its first streamed token; each row also has the load average around it.

`bench_parallel_cold_start.py` measures the same at the node (the agent's supervisor alone); this adds what the
platform does between a request and the engine: placement, the agent's reaction, READY, the held request's release.

Writes `bench/results/wake_at_once.json` and prints a markdown table.

    INFERPLANE_DATA_DIR=.data/bench .venv/bin/python bench/bench_wake_at_once.py [--at-once 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("INFERPLANE_DATA_DIR", str(REPO / ".data" / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
os.environ.setdefault("DJANGO_DEBUG", "1")

import django  # noqa: E402

django.setup()

from bench.bench_cold_start import ACTIVE_STATES, IDLE_TIMEOUT_S, Stack, stream_chat  # noqa: E402
from controlplane.accounts.services import SYSTEM  # noqa: E402
from controlplane.accounts.signup import bootstrap_organization  # noqa: E402
from endpoints.fleet.services import create_join_token  # noqa: E402
from endpoints.models import Endpoint, Replica  # noqa: E402
from endpoints.nodes.models import Node  # noqa: E402
from gpu_agent.runtime.engine import engine_version  # noqa: E402
from gpu_agent.runtime.tiny_model import build_tiny_model  # noqa: E402
from tests.processes import wait_until  # noqa: E402

RATIO_TARGET = 1.5


def wake(url: str, names: list[str], headers: dict) -> list[dict]:
    """One streaming call per endpoint, all released at the same instant; each one's times."""
    answers: list[dict | None] = [None] * len(names)
    errors: list[BaseException] = []
    start = threading.Barrier(len(names))

    def call(index: int) -> None:
        try:
            start.wait()
            answers[index] = stream_chat(url, names[index], headers=headers)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=call, args=(index,)) for index in range(len(names))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
    if errors:
        raise errors[0]
    return answers


def measure(model_dir: Path, work_dir: Path, at_once: int, rounds: int) -> list[dict]:
    suffix = datetime.now().strftime("%Y%m%d%H%M%S")
    _org, _owner, key = bootstrap_organization(slug=f"bench-wake-{suffix}", owner_email=f"wake-{suffix}@example.com")
    headers = {"Authorization": f"Bearer {key.plain}"}
    stack = Stack(work_dir)
    try:
        stack.start(create_join_token(SYSTEM, name=f"bench-wake-{suffix}").plain)
        wait_until(lambda: Node.objects.filter(name="bench-cpu-node", state="READY").exists(), 120, interval_s=0.2,
                   message="the agent to register")
        wait_until(lambda: " ready after " in stack.agent.log_text(), 600, interval_s=0.5, message="the zygote")
        names, endpoint_ids = [], []
        for index in range(at_once):
            name = f"wake-{suffix}-{index}"
            created = httpx.post(f"{stack.url}/api/v1/endpoints/", headers=headers, timeout=30, json={
                "name": name, "model_source": str(model_dir), "gpu_type": "cpu", "min_replicas": 0,
                "max_replicas": 1, "max_model_len": 512, "max_num_seqs": 8, "cold_start_timeout_s": 600,
            })  # fmt: skip
            created.raise_for_status()
            names.append(name)
            endpoint_ids.append(created.json()["id"])
        Endpoint.objects.filter(pk__in=endpoint_ids).update(idle_timeout_s=IDLE_TIMEOUT_S)

        def all_at_zero() -> bool:
            return not Replica.objects.filter(endpoint_id__in=endpoint_ids, state__in=ACTIVE_STATES).exists()

        # A first call per endpoint, not measured: the node's first start of the model reads its per-model
        # facts once (as a node that has served it before would have), and every endpoint has run once.
        wake(stack.url, names, headers)
        rows = []
        for round_number in range(rounds):
            for size in (1, at_once):
                wait_until(all_at_zero, IDLE_TIMEOUT_S + 120, interval_s=0.2, message="every endpoint at zero")
                time.sleep(1.0)
                chosen = [names[round_number % at_once]] if size == 1 else names
                load_before = os.getloadavg()[0]
                answers = wake(stack.url, chosen, headers)
                ttfts = [round(answer["first_token_at"] - answer["sent_at"], 3) for answer in answers]
                rows.append({"round": round_number + 1, "at_once": size, "ttft_s": ttfts,
                             "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
                             "completion_tokens": [(answer["usage"] or {}).get("completion_tokens") for answer in answers]})
                print(f"round {round_number + 1}, {size} at once: time to first token {ttfts} s", flush=True)
        return rows
    finally:
        stack.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at-once", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "wake_at_once.json"))
    options = parser.parse_args()

    subprocess.run([sys.executable, "manage.py", "migrate", "--verbosity", "0"], cwd=REPO, check=True)
    with tempfile.TemporaryDirectory(prefix="bench-wake-at-once-") as tmp:
        work_dir = Path(tmp)
        rows = measure(build_tiny_model(work_dir / "model"), work_dir, options.at_once, options.rounds)

    ratios = []
    for round_number in range(1, options.rounds + 1):
        single = next(row for row in rows if row["round"] == round_number and row["at_once"] == 1)
        many = next(row for row in rows if row["round"] == round_number and row["at_once"] == options.at_once)
        ratios.append(round(max(many["ttft_s"]) / single["ttft_s"][0], 2))
    result = {
        "benchmark": "wake_at_once",
        "measured_at": datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "num_cpus": os.cpu_count()},
        "engine_version": engine_version(),
        "model": "tiny random Llama (gpu_agent.runtime.tiny_model), CPU, float32",
        "idle_timeout_s": IDLE_TIMEOUT_S,
        "rows": rows,
        "slowest_of_many_over_single": ratios,
        "target": {"ratio": RATIO_TARGET, "median": statistics.median(ratios),
                   "met": statistics.median(ratios) <= RATIO_TARGET},
    }
    Path(options.output).parent.mkdir(parents=True, exist_ok=True)
    Path(options.output).write_text(json.dumps(result, indent=2) + "\n")

    print(f"\n| round | one endpoint: TTFT | {options.at_once} at once: TTFT (each) | slowest ÷ one | load |")
    print("|---|---:|---|---:|---|")
    for round_number, ratio in enumerate(ratios, start=1):
        single = next(row for row in rows if row["round"] == round_number and row["at_once"] == 1)
        many = next(row for row in rows if row["round"] == round_number and row["at_once"] == options.at_once)
        print(f"| {round_number} | {single['ttft_s'][0]:.2f} s | {', '.join(f'{t:.2f}' for t in many['ttft_s'])} s "
              f"| {ratio:.2f}× | {single['load_before']}–{many['load_after']} |")
    print(f"\ntarget: slowest of {options.at_once} ≤ {RATIO_TARGET}× one (median {result['target']['median']:.2f}×, "
          f"met: {result['target']['met']}); wrote {options.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
