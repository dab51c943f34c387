"""Cold start from zero through the whole platform, against a naive `vllm serve`, in one run.

(i)  naive: spawn `python -m vllm.entrypoints.openai.api_server` for the tiny model
     -> /health 200 -> first streamed token;
(ii) platform: a live control plane (uvicorn), Celery worker and beat (autoscaler tick 1 s),
     a real agent (`python -m gpu_agent run`, warm standby on), an endpoint at
     `min_replicas: 0`, one streaming `/v1/chat/completions` through the gateway, broken
     down into request arrival -> placed (Replica row) -> STARTING reported -> READY
     (`Replica.ready_at`) -> first token (client side). The engine's own start (launch ->
     /health 200) comes from the agent's log in the same run; the platform's share is
     time to first token minus that;
(iii) scale to zero: with `idle_timeout_s` lowered to 5 s (ORM; the API's floor is 30 s),
     seconds from the end of the last request to zero active replicas, each repetition
     woken by a new cold request.

Writes `bench/results/cold_start.json` and prints a markdown table.

    INFERPLANE_DATA_DIR=.data/bench .venv/bin/python bench/bench_cold_start.py [--repetitions 3]
"""

from __future__ import annotations

import argparse
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

FAST = {"INFERPLANE_AGENT_HEARTBEAT_INTERVAL_S": "0.5", "INFERPLANE_AUTOSCALER_TICK_S": "1"}
MESSAGES = [{"role": "user", "content": "Say something"}]

from tests.processes import ChildProcess, free_port, wait_until  # noqa: E402 - after sys.path is set

IDLE_TIMEOUT_S = 5
PLATFORM_SHARE_TARGET_S = 0.5
TTFT_RATIO_TARGET = 0.35
SCALE_TO_ZERO_SLACK_S = 5.0
ACTIVE_STATES = ("PENDING", "STARTING", "READY", "DRAINING")


def stream_chat(url: str, model: str, *, headers: dict | None = None, timeout_s: float = 600) -> dict:
    """One streaming chat completion; wall-clock times of sending, first token and end."""
    sent_at = time.time()
    first_token_at, usage = None, None
    body = {
        "model": model, "messages": MESSAGES, "max_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=timeout_s
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if (
                first_token_at is None
                and chunk.get("choices")
                and chunk["choices"][0]["delta"].get("content")
            ):
                first_token_at = time.time()
            usage = chunk.get("usage") or usage
    return {"sent_at": sent_at, "first_token_at": first_token_at, "ended_at": time.time(), "usage": usage}


# -- (i) naive -------------------------------------------------------------------------


def measure_naive(model_dir: Path, work_dir: Path) -> dict:
    from gpu_agent.protocol import ReplicaSpec
    from gpu_agent.runtime import engine

    spec = ReplicaSpec(
        replica_id="bench-naive", endpoint_id="bench", served_model_name="tiny", model_source=str(model_dir),
        max_model_len=512, max_num_seqs=8, engine_api_key="bench-naive-engine-key",
    )  # fmt: skip
    port = free_port()
    command = engine.build_engine_command(spec, model_dir, port=port, device=engine.DEVICE_CPU)
    spawned_at = time.time()
    child = ChildProcess(command.argv, {**os.environ, **command.env}, work_dir / "naive-engine.log")
    try:

        def healthy() -> bool:
            if child.process.poll() is not None:
                raise RuntimeError(f"naive engine exited:\n{child.log_text()[-3000:]}")
            try:
                return httpx.get(f"{command.address}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 600, message="the naive engine's /health")
        healthy_at = time.time()
        answer = stream_chat(command.address, "tiny", headers={"Authorization": f"Bearer {spec.engine_api_key}"})
    finally:
        child.stop()
    return {
        "spawn_to_health_s": round(healthy_at - spawned_at, 3),
        "health_to_first_token_s": round(answer["first_token_at"] - healthy_at, 3),
        "spawn_to_first_token_s": round(answer["first_token_at"] - spawned_at, 3),
    }


# -- (ii) and (iii) the platform -------------------------------------------------------


class Stack:
    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.children: list[ChildProcess] = []
        self.url = ""
        self.agent: ChildProcess | None = None

    def start(self, join_token: str) -> None:
        env = {**os.environ, **FAST, "PYTHONUNBUFFERED": "1"}
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        python = sys.executable
        self.children.append(ChildProcess(
            [python, "-m", "uvicorn", "controlplane.asgi:application", "--host", "127.0.0.1", "--port", str(port),
             "--no-access-log", "--log-level", "warning"],
            env, self.work_dir / "web.log",
        ))  # fmt: skip
        self.children.append(ChildProcess(
            [python, "-m", "celery", "-A", "controlplane", "worker", "--pool=solo", "--concurrency=1",
             "--loglevel=INFO", "--without-gossip", "--without-mingle", "-n", f"bench-{os.getpid()}@%h"],
            env, self.work_dir / "worker.log",
        ))  # fmt: skip
        self.children.append(ChildProcess(
            [python, "-m", "celery", "-A", "controlplane", "beat", "--loglevel=INFO",
             "--schedule", str(self.work_dir / "celerybeat-schedule")],
            env, self.work_dir / "beat.log",
        ))  # fmt: skip

        def web_up() -> bool:
            try:
                return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(web_up, 120, interval_s=0.2, message="the control plane")
        self.agent = ChildProcess(
            [python, "-m", "gpu_agent", "run", "--control-plane", self.url, "--join-token", join_token,
             "--data-dir", str(self.work_dir / "agent"), "--cpu", "--name", "bench-cpu-node"],
            {k: v for k, v in env.items() if not k.startswith(("DJANGO", "INFERPLANE_DATA_DIR"))},
            self.work_dir / "agent.log",
        )  # fmt: skip
        self.children.append(self.agent)

    def standby_waiting(self) -> bool:
        """The agent logged more ready standbys than hand-offs: one waits for a replica."""
        log = self.agent.log_text()
        return log.count(" ready after ") > log.count(" now runs replica ")

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop(timeout_s=60)


def engine_start_s(agent_log: str, replica_id: str, occurrence: int = -1) -> float | None:
    """The engine's own start (launch -> /health 200) as the agent's supervisor logged it."""
    found = re.findall(rf"replica {re.escape(replica_id)} READY at \S+ after ([0-9.]+)s", agent_log)
    return float(found[occurrence]) if found else None


def measure_platform(model_dir: Path, work_dir: Path, repetitions: int) -> dict:
    import django

    django.setup()
    from controlplane.accounts.services import SYSTEM
    from controlplane.accounts.signup import bootstrap_organization
    from endpoints.fleet.services import create_join_token
    from endpoints.models import Endpoint, EndpointEvent, Replica
    from endpoints.nodes.models import Node

    suffix = datetime.now().strftime("%Y%m%d%H%M%S")
    _org, _owner, key = bootstrap_organization(
        slug=f"bench-cold-{suffix}", owner_email=f"bench-{suffix}@example.com"
    )
    join_token = create_join_token(SYSTEM, name=f"bench-{suffix}").plain
    headers = {"Authorization": f"Bearer {key.plain}"}
    stack = Stack(work_dir)
    try:
        stack.start(join_token)
        wait_until(
            lambda: Node.objects.filter(name="bench-cpu-node", state="READY").order_by("-id").first(),
            120, interval_s=0.2, message="the agent to register",
        )  # fmt: skip
        name = f"cold-{suffix}"
        created = httpx.post(f"{stack.url}/api/v1/endpoints/", headers=headers, timeout=30, json={
            "name": name, "model_source": str(model_dir), "gpu_type": "cpu", "min_replicas": 0, "max_replicas": 1,
            "max_model_len": 512, "max_num_seqs": 8, "cold_start_timeout_s": 600,
        })  # fmt: skip
        created.raise_for_status()
        endpoint_id = created.json()["id"]
        Endpoint.objects.filter(pk=endpoint_id).update(idle_timeout_s=IDLE_TIMEOUT_S)

        def active() -> bool:
            return Replica.objects.filter(endpoint_id=endpoint_id, state__in=ACTIVE_STATES).exists()

        cold_starts, scale_to_zero = [], []
        for repetition in range(repetitions):
            # Each cold start finds a ready standby, as a node that has been idle for a while would.
            wait_until(stack.standby_waiting, 600, interval_s=0.5, message="a ready standby")
            wait_until(lambda: not active(), 120, interval_s=0.2, message="zero replicas before the call")
            time.sleep(1.0)
            answer = stream_chat(stack.url, name, headers=headers)
            replica = Replica.objects.filter(endpoint_id=endpoint_id).order_by("-created_at").first()
            starting = (
                EndpointEvent.objects.filter(replica=replica, details__to="STARTING")
                .order_by("created_at")
                .first()
            )
            agent_log = wait_until(
                lambda r=replica: (log := stack.agent.log_text()) and engine_start_s(log, str(r.pk)) and log,
                10, message="the agent's READY line",
            )  # fmt: skip
            arrival = answer["sent_at"]
            ttft = answer["first_token_at"] - arrival
            engine_s = engine_start_s(agent_log, str(replica.pk))
            sample = {
                "arrival_to_placed_s": round(replica.created_at.timestamp() - arrival, 3),
                "placed_to_starting_s": round(
                    starting.created_at.timestamp() - replica.created_at.timestamp(), 3
                )
                if starting
                else None,
                "starting_to_ready_s": round(
                    replica.ready_at.timestamp() - starting.created_at.timestamp(), 3
                )
                if starting and replica.ready_at
                else None,
                "ready_to_first_token_s": round(answer["first_token_at"] - replica.ready_at.timestamp(), 3),
                "time_to_first_token_s": round(ttft, 3),
                "engine_start_s": engine_s,
                "platform_share_s": round(ttft - engine_s, 3),
                "from_standby": bool(
                    re.search(
                        rf"replica {replica.pk}: launched pid \d+ on port \d+ \((warm standby|zygote)\)", agent_log
                    )
                ),
                "completion_tokens": (answer["usage"] or {}).get("completion_tokens"),
            }
            cold_starts.append(sample)
            ended_at = answer["ended_at"]
            wait_until(lambda: not active(), IDLE_TIMEOUT_S + 120, interval_s=0.1, message="zero replicas")
            scale_to_zero.append(round(time.time() - ended_at, 2))
            print(f"repetition {repetition + 1}: {sample}; zero after {scale_to_zero[-1]} s", flush=True)
        return {"cold_starts": cold_starts, "scale_to_zero_s": scale_to_zero}
    finally:
        stack.stop()


# -- report ----------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "cold_start.json"))
    options = parser.parse_args()

    subprocess.run([sys.executable, "manage.py", "migrate", "--verbosity", "0"], cwd=REPO, check=True)
    from gpu_agent.runtime.engine import engine_version
    from gpu_agent.runtime.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-cold-start-") as tmp:
        work_dir = Path(tmp)
        model_dir = build_tiny_model(work_dir / "model")
        naive = measure_naive(model_dir, work_dir)
        print(f"naive: {naive}", flush=True)
        platform_run = measure_platform(model_dir, work_dir, options.repetitions)

    cold = platform_run["cold_starts"]
    first = cold[0]
    median_ttft = statistics.median(sample["time_to_first_token_s"] for sample in cold)
    median_share = statistics.median(sample["platform_share_s"] for sample in cold)
    worst_zero = max(platform_run["scale_to_zero_s"])
    targets = {
        "platform_share_s": {"target": PLATFORM_SHARE_TARGET_S, "median": median_share,
                             "met": median_share <= PLATFORM_SHARE_TARGET_S},
        "ttft_over_naive_start": {"target": TTFT_RATIO_TARGET,
                                  "median": round(median_ttft / naive["spawn_to_first_token_s"], 3),
                                  "met": median_ttft <= TTFT_RATIO_TARGET * naive["spawn_to_first_token_s"]},
        "scale_to_zero_s": {"target": IDLE_TIMEOUT_S + SCALE_TO_ZERO_SLACK_S, "worst": worst_zero,
                            "met": worst_zero <= IDLE_TIMEOUT_S + SCALE_TO_ZERO_SLACK_S},
    }  # fmt: skip
    result = {
        "benchmark": "cold_start",
        "measured_at": datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "num_cpus": os.cpu_count()},
        "engine_version": engine_version(),
        "model": "tiny random Llama (gpu_agent.runtime.tiny_model), CPU, float32",
        "naive": naive,
        "platform": platform_run,
        "idle_timeout_s": IDLE_TIMEOUT_S,
        "targets": targets,
    }
    Path(options.output).parent.mkdir(parents=True, exist_ok=True)
    Path(options.output).write_text(json.dumps(result, indent=2) + "\n")

    def fmt(value) -> str:
        return "—" if value is None else f"{value:.2f}"

    print("\n| cold start (s) | " + " | ".join(f"run {i + 1}" for i in range(len(cold))) + " |")
    print("|---|" + "---|" * len(cold))
    rows = [
        ("request arrival → placed", "arrival_to_placed_s"),
        ("placed → STARTING reported", "placed_to_starting_s"),
        ("STARTING → READY", "starting_to_ready_s"),
        ("READY → first token", "ready_to_first_token_s"),
        ("**time to first token**", "time_to_first_token_s"),
        ("engine's own start (launch → /health)", "engine_start_s"),
        ("**platform's share** (TTFT − engine start)", "platform_share_s"),
    ]
    for label, key in rows:
        print(f"| {label} | " + " | ".join(fmt(sample[key]) for sample in cold) + " |")
    print("| started from the warm standby | " + " | ".join(str(s["from_standby"]) for s in cold) + " |")
    print(
        f"\nnaive `vllm serve`: spawn → /health {naive['spawn_to_health_s']:.2f} s, "
        f"→ first token {naive['spawn_to_first_token_s']:.2f} s"
    )
    print(
        f"scale to zero (idle_timeout_s={IDLE_TIMEOUT_S}): "
        + ", ".join(f"{s:.1f} s" for s in platform_run["scale_to_zero_s"])
    )
    print("\n| target | value | met |\n|---|---|---|")
    print(
        f"| platform adds ≤ {PLATFORM_SHARE_TARGET_S} s (median) | {median_share:.2f} s | {targets['platform_share_s']['met']} |"
    )
    print(
        f"| TTFT from zero ≤ {TTFT_RATIO_TARGET} × naive start (median) | {targets['ttft_over_naive_start']['median']:.2f} × | {targets['ttft_over_naive_start']['met']} |"
    )
    print(
        f"| zero replicas ≤ idle + {SCALE_TO_ZERO_SLACK_S:.0f} s (worst) | {worst_zero:.1f} s | {targets['scale_to_zero_s']['met']} |"
    )
    print(f"\nfirst run TTFT {first['time_to_first_token_s']:.2f} s; wrote {options.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
