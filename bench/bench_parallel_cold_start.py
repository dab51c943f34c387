"""Concurrent cold starts on one node: N endpoints woken at once, zygote against naive `vllm serve`.

For each N, on one agent's supervisor (in process, tiny model, CPU):
(i)  zygote: N replicas started at the same instant from a warm zygote (`gpu_agent/runtime/zygote.py`);
     each one's time is `Supervisor.start()` -> READY (the agent's /health check) -> first streamed token;
(ii) naive: N `python -m vllm.entrypoints.openai.api_server` processes spawned at the same instant;
     spawn -> /health 200 -> first streamed token.
The zygote's own import (once per node, before any replica) is reported apart. The zygote sizes run
in rounds (1, 2, 4, 8, then again), so each ratio compares rows of the same round. The headline is
the ratio of the slowest of 4 concurrent zygote starts to a single zygote start in the same round
(issue #17 asks for at most 1.5). Each replica also reports the CPU seconds its engine's processes had
used when it turned READY, and each row the load average around it: on a shared machine the wall
times stretch with other people's load, the CPU seconds do not.

Naive rows can take many minutes on a loaded 2-core machine: `--naive-timeout-s` caps each row, and
the larger rows are skipped once one ran out of time.

Writes `bench/results/parallel_cold_start.json` and prints a markdown table.

    .venv/bin/python bench/bench_parallel_cold_start.py [--sizes 1,2,4,8] [--rounds 2] [--naive-sizes 1,2,4,8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_cold_start import stream_chat  # noqa: E402 - after sys.path is set
from gpu_agent.protocol import ReplicaSpec, ReplicaState  # noqa: E402
from gpu_agent.runtime import engine  # noqa: E402
from gpu_agent.runtime.supervisor import Supervisor, SupervisorPolicy  # noqa: E402
from gpu_agent.runtime.tiny_model import build_tiny_model  # noqa: E402
from tests.processes import ChildProcess, free_port, wait_until  # noqa: E402

RATIO_TARGET = 1.5
FIRST_CPU = "engine_cpu_s_after_first_request"  # all its processes, once the first request's stream has ended
TIMEOUT_S = 900


def spec_for(replica_id: str, model_dir: Path) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id=replica_id, endpoint_id=f"bench-{replica_id}", served_model_name="tiny",
        model_source=str(model_dir), max_model_len=512, max_num_seqs=8, engine_api_key=f"{replica_id}-key",
    )  # fmt: skip


def _in_threads(work, count: int) -> list[dict]:
    results: list[dict] = [{} for _ in range(count)]

    def run(index: int) -> None:
        try:
            results[index] = work(index)
        except Exception as exc:  # reported in the results, not raised from a thread
            results[index] = {"error": repr(exc)}

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def engine_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) used so far by an engine and every process it started."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except (psutil.Error, ValueError, TypeError):
        return None
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return round(total, 2)


def measure_zygote(supervisor: Supervisor, model_dir: Path, size: int, round_id: str) -> list[dict]:
    specs = [spec_for(f"z{round_id}-{size}-{index}", model_dir) for index in range(size)]
    started_at = time.time()
    for spec in specs:
        supervisor.start(spec, model_dir)

    def one(index: int) -> dict:
        spec = specs[index]
        wait_until(
            lambda: supervisor.get(spec.replica_id).state in (ReplicaState.READY, ReplicaState.FAILED),
            TIMEOUT_S, interval_s=0.05, message=f"{spec.replica_id} READY",
        )  # fmt: skip
        replica = supervisor.get(spec.replica_id)
        if replica.state != ReplicaState.READY:
            raise RuntimeError(f"{spec.replica_id}: {replica.failure_reason}")
        ready_at = time.time()
        cpu_s = engine_cpu_s(replica.pid)
        answer = stream_chat(replica.address, "tiny", headers={"Authorization": f"Bearer {spec.engine_api_key}"})
        return {
            "from_zygote": replica.from_standby,
            "start_to_ready_s": round(ready_at - started_at, 3),
            "start_to_first_token_s": round(answer["first_token_at"] - started_at, 3),
            "engine_cpu_s_at_ready": cpu_s,
            "engine_cpu_s_after_first_request": engine_cpu_s(replica.pid),
        }

    results = _in_threads(one, size)
    for spec in specs:
        supervisor.drain(spec.replica_id, timeout_s=5)
    wait_until(
        lambda: all(supervisor.get(spec.replica_id).is_final for spec in specs), 120, interval_s=0.2,
        message="drained",
    )  # fmt: skip
    for spec in specs:
        supervisor.forget(spec.replica_id)
    return results


def measure_naive(model_dir: Path, work_dir: Path, size: int, timeout_s: float) -> list[dict]:
    specs = [spec_for(f"naive-{size}-{index}", model_dir) for index in range(size)]
    commands = [
        engine.build_engine_command(spec, model_dir, port=free_port(), device=engine.DEVICE_CPU) for spec in specs
    ]
    spawned_at = time.time()
    children = [
        ChildProcess(command.argv, {**os.environ, **command.env}, work_dir / f"{spec.replica_id}.log")
        for spec, command in zip(specs, commands, strict=True)
    ]

    def one(index: int) -> dict:
        child, command, spec = children[index], commands[index], specs[index]

        def healthy() -> bool:
            if child.process.poll() is not None:
                raise RuntimeError(f"naive engine exited:\n{child.log_text()[-2000:]}")
            try:
                return httpx.get(f"{command.address}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, max(1.0, spawned_at + timeout_s - time.time()), interval_s=0.1,
                   message="a naive engine's /health")  # fmt: skip
        healthy_at = time.time()
        cpu_s = engine_cpu_s(child.process.pid)
        answer = stream_chat(command.address, "tiny", headers={"Authorization": f"Bearer {spec.engine_api_key}"})
        return {
            "start_to_ready_s": round(healthy_at - spawned_at, 3),
            "start_to_first_token_s": round(answer["first_token_at"] - spawned_at, 3),
            "engine_cpu_s_at_ready": cpu_s,
        }

    try:
        return _in_threads(one, size)
    finally:
        for child in children:
            child.stop(timeout_s=30)


def summary(results: list[dict], load_before: float) -> dict:
    times = [r["start_to_first_token_s"] for r in results if "start_to_first_token_s" in r]
    cpu = [r["engine_cpu_s_at_ready"] for r in results if r.get("engine_cpu_s_at_ready") is not None]
    cpu_first = [r[FIRST_CPU] for r in results if r.get(FIRST_CPU) is not None]
    return {
        "num_ok": len(times),
        "num_failed": len(results) - len(times),
        "median_first_token_s": round(statistics.median(times), 3) if times else None,
        "max_first_token_s": round(max(times), 3) if times else None,
        "median_engine_cpu_s_at_ready": round(statistics.median(cpu), 2) if cpu else None,
        "median_engine_cpu_s_after_first_request": round(statistics.median(cpu_first), 2) if cpu_first else None,
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # before, after
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=2, help="zygote rows: every size once per round")
    parser.add_argument("--naive-sizes", default="1,2,4,8")
    parser.add_argument("--naive-timeout-s", type=float, default=300, help="cap on each naive row")
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "parallel_cold_start.json"))
    options = parser.parse_args()
    sizes = [int(size) for size in options.sizes.split(",") if size]
    naive_sizes = [int(size) for size in options.naive_sizes.split(",") if size]

    work_dir = Path(tempfile.mkdtemp(prefix="bench-parallel-cold-"))
    model_dir = build_tiny_model(work_dir / "model")
    report: dict = {
        "when": datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": "tiny (tests' fixture), CPU",
        "load_average_at_start": os.getloadavg(),
        "rounds": [],
        "naive": {},
    }

    def save() -> None:  # a cut-short run keeps its rows
        Path(options.output).write_text(json.dumps(report, indent=2) + "\n")

    supervisor = Supervisor(
        work_dir / "agent", device=engine.DEVICE_CPU, standby=True, zygote=True,
        policy=SupervisorPolicy(stop_timeout_s=10),
    )  # fmt: skip
    supervisor.start_monitor(interval_s=0.2, starting_interval_s=0.05)
    try:
        spawned_at = time.time()
        wait_until(lambda: supervisor.standby_ready, TIMEOUT_S, interval_s=0.2, message="the zygote")
        report["zygote_import_s"] = round(time.time() - spawned_at, 3)
        print(f"zygote ready after {report['zygote_import_s']} s", flush=True)
        for round_index in range(options.rounds):
            rows: dict = {}
            report["rounds"].append(rows)
            for size in sizes:
                load_before = os.getloadavg()[0]
                results = measure_zygote(supervisor, model_dir, size, f"r{round_index}")
                rows[str(size)] = {"replicas": results, **summary(results, load_before)}
                save()
                print(f"round {round_index} zygote x{size}: {rows[str(size)]}", flush=True)
            single, four = rows.get("1", {}).get("max_first_token_s"), rows.get("4", {}).get("max_first_token_s")
            if single and four:
                rows["ratio_4_to_1"] = round(four / single, 2)
    finally:
        supervisor.shutdown(timeout_s=20)
    for size in naive_sizes:
        load_before = os.getloadavg()[0]
        results = measure_naive(model_dir, work_dir, size, options.naive_timeout_s)
        report["naive"][str(size)] = {"replicas": results, **summary(results, load_before)}
        save()
        print(f"naive x{size}: {report['naive'][str(size)]}", flush=True)
        if any("error" in result for result in results):
            report["naive_note"] = f"x{size} ran out of its {options.naive_timeout_s:.0f} s: larger rows skipped"
            break

    report["load_average_at_end"] = os.getloadavg()
    ratios = [rows["ratio_4_to_1"] for rows in report["rounds"] if "ratio_4_to_1" in rows]
    if ratios:
        report["ratio_4_to_1_per_round"] = ratios
        report["ratio_target"] = RATIO_TARGET
    save()

    def cell(row: dict | None) -> str:
        if not row or row["median_first_token_s"] is None:
            return "not run"
        return f"{row['median_first_token_s']} / {row['max_first_token_s']} (CPU {row['median_engine_cpu_s_at_ready']} s)"

    print("\n| endpoints woken at once | zygote, per round: first token median / slowest (s) | naive `vllm serve` (s) |")
    print("|---|---|---|")
    for size in sorted({*sizes, *naive_sizes}):
        zygote = "; ".join(cell(rows.get(str(size))) for rows in report["rounds"])
        print(f"| {size} | {zygote} | {cell(report['naive'].get(str(size)))} |")
    if ratios:
        print(f"\nslowest of 4 at once / single, per round: {ratios} (target <= {RATIO_TARGET})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
