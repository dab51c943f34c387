"""Scale-to-zero precision: how long after an endpoint's idle deadline its last replica is stopped.

A live control plane (uvicorn), Celery worker and beat (autoscaler tick 1 s, as in the tests), a real
agent (`python -m gpu_agent run`, warm standby on) and an endpoint at `min_replicas: 0` with
`idle_timeout_s` 5 (ORM; the API's floor is 30 s). Each repetition wakes it with one streaming call,
then measures from the idle deadline (the last-request time the autoscaler reads from Redis, plus the
timeout) to
  * the scale-down decision (its "Scale down" event),
  * the replica STOPPED (`Replica.stopped_at`: its agent saw the engine exit),
and, as a client sees it, from the end of the last request to zero active replicas (target: idle + 5 s).
Before #17's fix the decision waited for the next tick after the deadline and the engine's process
spent seconds in interpreter teardown after its server had stopped.

Writes `bench/results/scale_to_zero.json` and prints a markdown table.

    INFERPLANE_DATA_DIR=.data/bench .venv/bin/python bench/bench_scale_to_zero.py [--repetitions 5]
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
            wait_until(lambda: not active(), IDLE_TIMEOUT_S + 120, interval_s=0.05, message="zero replicas")
            zero_at = time.time()
            replica.refresh_from_db()
            deadline = float(get_redis().get(last_request_key)) + IDLE_TIMEOUT_S
            decision = (EndpointEvent.objects.filter(endpoint_id=endpoint_id, message__startswith="Scale down",
                                                     created_at__gte=replica.created_at).order_by("created_at").first())
            sample = {
                "deadline_to_decision_s": round(decision.created_at.timestamp() - deadline, 3) if decision else None,
                "deadline_to_stopped_s": round(replica.stopped_at.timestamp() - deadline, 3) if replica.stopped_at else None,
                "last_request_end_to_zero_s": round(zero_at - answer["ended_at"], 3),
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

    worst_zero = max(column("last_request_end_to_zero_s"))
    result = {
        "benchmark": "scale_to_zero",
        "when": datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average": os.getloadavg()},
        "idle_timeout_s": IDLE_TIMEOUT_S,
        "autoscaler_tick_s": 1,
        "samples": samples,
        "median_deadline_to_stopped_s": statistics.median(column("deadline_to_stopped_s")),
        "worst_deadline_to_stopped_s": max(column("deadline_to_stopped_s")),
        "target": {"last_request_end_to_zero_s": IDLE_TIMEOUT_S + SCALE_TO_ZERO_SLACK_S, "worst": worst_zero,
                   "met": worst_zero <= IDLE_TIMEOUT_S + SCALE_TO_ZERO_SLACK_S},
    }
    Path(options.output).write_text(json.dumps(result, indent=2) + "\n")
    print("| run | deadline → decision (s) | deadline → STOPPED (s) | last request end → zero (s) |")
    print("|---:|---:|---:|---:|")
    for index, s in enumerate(samples, 1):
        print(f"| {index} | {s['deadline_to_decision_s']} | {s['deadline_to_stopped_s']} | {s['last_request_end_to_zero_s']} |")
    print(f"target: zero ≤ idle + {SCALE_TO_ZERO_SLACK_S:.0f} s — {'met' if result['target']['met'] else 'MISSED'} (worst {worst_zero:.2f} s)")
    return 0 if result["target"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
