"""Scale-to-zero precision: how long after an endpoint's idle deadline its last replica is stopped, and where the seconds go.

A live control plane (uvicorn), Celery worker and beat (autoscaler tick 1 s, as in the tests), a real
agent (`python -m gpu_agent run`, zygote on) and an endpoint at `min_replicas: 0` with `idle_timeout_s` 5
(ORM; the API's floor is 30 s). Each repetition wakes it with one streaming call, then measures, as a
client sees it, from the end of the last request to
  * no serving replica (none PENDING, STARTING or READY: the gateway routes to none; target idle + 5 s),
  * zero replicas (the last one STOPPED: its engine's process is gone and the control plane heard it),
and splits the lag after the idle deadline (the last-request time the autoscaler reads from Redis, plus
the timeout) into
  deadline -> the scale-down decision (its "Scale down" event: the reconcile scheduled for the deadline),
  decision -> the agent draining (its reconciler's log line: the watch woke it, a heartbeat fetched the drain),
  draining -> SIGTERM (the supervisor's log line: an idle engine has no drain wait),
  SIGTERM -> exit seen (the supervisor's STOPPED line; SIGKILL after `idle_stop_grace_s` if still running),
  exit seen -> STOPPED at the control plane (`Replica.stopped_at`, where its GPU-seconds stop counting).
Before #17's fixes the decision waited for the next tick after the deadline, the supervisor acted on the
drain and saw the exit only at its 1 s tick, and STOPPED waited for the next heartbeat.

Writes `bench/results/scale_to_zero.json` and prints a markdown table.

    INFERPLANE_DATA_DIR=.data/bench .venv/bin/python bench/bench_scale_to_zero.py [--repetitions 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("INFERPLANE_DATA_DIR", str(REPO / ".data" / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
os.environ.setdefault("DJANGO_DEBUG", "1")

from bench.bench_cold_start import ACTIVE_STATES, IDLE_TIMEOUT_S, SCALE_TO_ZERO_SLACK_S, Stack, stream_chat  # noqa: E402
from tests.processes import wait_until  # noqa: E402 - after sys.path is set

SERVING_STATES = ("PENDING", "STARTING", "READY")
_AGENT_LINE = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO gpu_agent\.runtime\.%s: replica %s%s"


def agent_log_at(agent_log: str, module: str, replica_id: str, rest: str) -> tuple[float, str] | None:
    """Wall-clock time (and the rest of the line) of the agent's last log line about this replica that matches."""
    found = re.findall(_AGENT_LINE % (module, re.escape(replica_id), rest) + r"(.*)$", agent_log, re.MULTILINE)
    if not found:
        return None
    stamp, tail = found[-1]
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp(), tail


def split_lag(deadline: float, decision_at: float | None, agent_log: str, replica_id: str, stopped_at: float | None) -> dict:
    """The lag after the idle deadline, step by step (seconds; None where a step left no trace)."""
    draining = agent_log_at(agent_log, "reconciler", replica_id, r": draining")
    sigterm = agent_log_at(agent_log, "supervisor", replica_id, r": (?:idle|drain timeout), SIGTERM")
    exited = agent_log_at(agent_log, "supervisor", replica_id, r" STOPPED: ")
    steps = [("deadline", deadline), ("decision", decision_at), ("agent_draining", draining and draining[0]),
             ("sigterm", sigterm and sigterm[0]), ("exit_seen", exited and exited[0]), ("stopped_recorded", stopped_at)]
    split = {}
    for (name_from, at_from), (name_to, at_to) in itertools.pairwise(steps):
        split[f"{name_from}_to_{name_to}_s"] = round(at_to - at_from, 3) if at_from and at_to else None
    split["engine_killed"] = bool(exited and "killed" in exited[1])
    return split


def measure(model_dir: Path, work_dir: Path, repetitions: int) -> list[dict]:
    import django

    django.setup()
    from controlplane import redis_keys
    from controlplane.accounts.services import SYSTEM
    from controlplane.accounts.signup import bootstrap_organization
    from controlplane.redis_client import get_redis
    from endpoints.fleet.services import create_join_token
    from endpoints.models import Endpoint, EndpointEvent, Replica
    from endpoints.nodes.models import Node

    suffix = datetime.now().strftime("%Y%m%d%H%M%S")
    organization, _owner, key = bootstrap_organization(slug=f"bench-zero-{suffix}", owner_email=f"zero-{suffix}@example.com")
    join_token = create_join_token(SYSTEM, name=f"bench-zero-{suffix}").plain
    headers = {"Authorization": f"Bearer {key.plain}"}
    stack = Stack(work_dir)
    samples = []
    try:
        stack.start(join_token)
        wait_until(lambda: Node.objects.filter(name="bench-cpu-node", state="READY").exists(), 120, interval_s=0.2,
                   message="the agent to register")
        name = f"zero-{suffix}"
        created = httpx.post(f"{stack.url}/api/v1/endpoints/", headers=headers, timeout=30, json={
            "name": name, "model_source": str(model_dir), "gpu_type": "cpu", "min_replicas": 0, "max_replicas": 1,
            "max_model_len": 512, "max_num_seqs": 8, "cold_start_timeout_s": 600,
        })  # fmt: skip
        created.raise_for_status()
        endpoint_id = created.json()["id"]
        Endpoint.objects.filter(pk=endpoint_id).update(idle_timeout_s=IDLE_TIMEOUT_S)
        last_request_key = redis_keys.last_request_key(organization.pk, endpoint_id)

        def active() -> bool:
            return Replica.objects.filter(endpoint_id=endpoint_id, state__in=ACTIVE_STATES).exists()

        for repetition in range(repetitions):
            wait_until(stack.standby_waiting, 600, interval_s=0.5, message="a ready standby")
            wait_until(lambda: not active(), 120, interval_s=0.2, message="zero replicas before the call")
            answer = stream_chat(stack.url, name, headers=headers)
            replica = Replica.objects.filter(endpoint_id=endpoint_id).order_by("-created_at").first()
            no_serving_at = zero_at = None
            give_up_at = time.time() + IDLE_TIMEOUT_S + 120
            while zero_at is None and time.time() < give_up_at:
                states = set(Replica.objects.filter(endpoint_id=endpoint_id).values_list("state", flat=True))
                now = time.time()
                if no_serving_at is None and not states & set(SERVING_STATES):
                    no_serving_at = now
                if not states & set(ACTIVE_STATES):
                    zero_at = now
                time.sleep(0.05)
            if zero_at is None:
                raise RuntimeError(f"replicas still {states} {IDLE_TIMEOUT_S + 120} s after the last request")
            replica.refresh_from_db()
            deadline = float(get_redis().get(last_request_key)) + IDLE_TIMEOUT_S
            decision = (EndpointEvent.objects.filter(endpoint_id=endpoint_id, message__startswith="Scale down",
                                                     created_at__gte=replica.created_at).order_by("created_at").first())
            stopped_at = replica.stopped_at.timestamp() if replica.stopped_at else None
            sample = {
                "last_request_end_to_deadline_s": round(deadline - answer["ended_at"], 3),
                **split_lag(deadline, decision.created_at.timestamp() if decision else None, stack.agent.log_text(),
                            str(replica.pk), stopped_at),
                "deadline_to_stopped_s": round(stopped_at - deadline, 3) if stopped_at else None,
                "last_request_end_to_no_serving_s": round(no_serving_at - answer["ended_at"], 3),
                "last_request_end_to_zero_s": round(zero_at - answer["ended_at"], 3),
                "load_average_1m": round(os.getloadavg()[0], 2),
                "state": replica.state,
            }
            samples.append(sample)
            print(f"repetition {repetition + 1}: {sample}", flush=True)
        return samples
    finally:
        stack.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "scale_to_zero.json"))
    options = parser.parse_args()

    subprocess.run([sys.executable, "manage.py", "migrate", "--verbosity", "0"], cwd=REPO, check=True)
    from gpu_agent.runtime.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-scale-to-zero-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model")
        samples = measure(model_dir, Path(tmp), options.repetitions)

    def column(name: str) -> list[float]:
        return [s[name] for s in samples if s[name] is not None]

    target_s = IDLE_TIMEOUT_S + SCALE_TO_ZERO_SLACK_S
    worst_no_serving = max(column("last_request_end_to_no_serving_s"))
    split_names = ["deadline_to_decision_s", "decision_to_agent_draining_s", "agent_draining_to_sigterm_s",
                   "sigterm_to_exit_seen_s", "exit_seen_to_stopped_recorded_s"]
    result = {
        "benchmark": "scale_to_zero",
        "when": datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average": os.getloadavg()},
        "idle_timeout_s": IDLE_TIMEOUT_S,
        "autoscaler_tick_s": 1,
        "samples": samples,
        "median_split_s": {name: statistics.median(column(name)) for name in split_names if column(name)},
        "median_deadline_to_stopped_s": statistics.median(column("deadline_to_stopped_s")),
        "worst_deadline_to_stopped_s": max(column("deadline_to_stopped_s")),
        "median_last_request_end_to_zero_s": statistics.median(column("last_request_end_to_zero_s")),
        "worst_last_request_end_to_zero_s": max(column("last_request_end_to_zero_s")),
        "target": {"last_request_end_to_no_serving_s": target_s, "worst": worst_no_serving,
                   "met": worst_no_serving <= target_s},
    }
    Path(options.output).write_text(json.dumps(result, indent=2) + "\n")
    print("| run | deadline → decision | → agent draining | → SIGTERM | → exit seen | → STOPPED recorded "
          "| last request end → no serving | → zero (STOPPED) | load |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for index, s in enumerate(samples, 1):
        steps = " | ".join(str(s[name]) for name in split_names)
        print(f"| {index} | {steps} | {s['last_request_end_to_no_serving_s']} | {s['last_request_end_to_zero_s']} "
              f"| {s['load_average_1m']} |")
    print(f"target: no serving replica ≤ idle + {SCALE_TO_ZERO_SLACK_S:.0f} s — {'met' if result['target']['met'] else 'MISSED'} "
          f"(worst {worst_no_serving:.2f} s); zero replicas worst {result['worst_last_request_end_to_zero_s']:.2f} s")
    return 0 if result["target"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
