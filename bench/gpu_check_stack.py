"""The GPU checks on a live stack, run by `bench/gpu_check.py` inside the CUDA environment.

Builds the tiny model, starts a local control plane (embedded PostgreSQL and Redis in
`.data/gpu-check`, the web server, a Celery worker and beat) and an agent on the GPUs (no `--cpu`),
then, printing one line per check as it ends:
  phase 1, the agent without its standby (every engine a plain launch, so its environment is what
  `/proc/<pid>/environ` shows): GPU detection; three endpoints at once: one replica (pinned to its
  GPU), one with `quantization: fp8`, two replicas sharing one GPU with memory fractions;
  phase 2, the agent restarted with its warm standby: a cold start from zero served by the standby,
  then `vllm bench serve` on that replica directly and through the gateway; then sleep mode: an
  `idle_action: sleep` endpoint's replica sleeps once idle (its GPU memory freed, per nvidia-smi) and
  a call wakes it (the same process, within ~2 s, the same greedy answer).

What placement provides (`Replica.gpu_indices`, `Replica.gpu_memory_fraction`, an endpoint's
`allow_gpu_sharing`, the heartbeat's GPUs) is read in the small functions under "Interfaces".
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("INFERPLANE_DATA_DIR", str(REPO / ".data" / "gpu-check"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
os.environ.setdefault("DJANGO_DEBUG", "1")
# The checks' own endpoints and load must not meet an organisation's default limits.
STACK_ENV = {
    "INFERPLANE_AGENT_HEARTBEAT_INTERVAL_S": "1",
    "INFERPLANE_AUTOSCALER_TICK_S": "1",
    "INFERPLANE_DEFAULT_MAX_MIN_REPLICAS": "8",
    "INFERPLANE_DEFAULT_MAX_REPLICAS": "16",
    "INFERPLANE_DEFAULT_KEY_RPM": "0",
    "INFERPLANE_DEFAULT_KEY_TPM": "0",
    "INFERPLANE_SLEEP_MODE": "1",  # the sleep-wake check's endpoint sleeps
}
os.environ.update(STACK_ENV)

from bench.gpu_check import (  # noqa: E402 - after sys.path is set
    CHECKS,
    FAIL,
    PASS,
    SMI_APPS_QUERY,
    SMI_MEMORY_USED_QUERY,
    CheckResult,
    SmiGpu,
    bench_verdict,
    gpu_detection_verdict,
    not_run,
    parse_smi_compute_apps,
    parse_smi_memory_used,
    pinning_verdict,
    sharing_verdict,
    sleep_wake_verdict,
)
from gpu_agent.runtime.engine import DEVICE_CUDA, REPLICA_ENV_MARKER, quantization_plan  # noqa: E402
from tests.processes import ChildProcess, free_port, wait_until  # noqa: E402

# What an endpoint's `quantization: fp8` asks of a CUDA engine (the agent's own table).
FP8_ENGINE_METHOD = quantization_plan(DEVICE_CUDA, "fp8").flags[1]
MESSAGES = [{"role": "user", "content": "Say something"}]
BENCH_NUM_PROMPTS = 200
BENCH_CONCURRENCY = 32
PHASE_2_RESERVE_S = 240  # kept for the standby and the benchmark when phase 1 is slow
ACTIVE_STATES = ("PENDING", "STARTING", "READY", "DRAINING")
SLEEP_IDLE_TIMEOUT_S = 30  # the API's least idle_timeout_s


class CheckFailed(Exception):
    """A check's own failure, with the reason to print."""


def _raise(exc: Exception):
    raise exc


# -- Interfaces: what the checks read from placement (one place to adjust) --------------------------------------------


def reported_gpus(node) -> list[dict]:
    """The agent's hardware report: `GpuStatus` dicts (index, uuid, memory_total_mb) in its heartbeat."""
    return list((node.last_status or {}).get("gpus", []))


def replica_gpu_indices(replica) -> list[int] | None:
    """The GPU indices placement gave the replica (`Replica.gpu_indices`), None while it has none."""
    value = getattr(replica, "gpu_indices", None)
    return [int(index) for index in value] if value else None


def shared_gpu_endpoint_fields() -> dict:
    """An endpoint spec whose two replicas may share one GPU, each with a fraction of its memory (`Replica.gpu_memory_fraction`)."""
    return {"min_replicas": 2, "max_replicas": 2, "gpus_per_replica": 1, "allow_gpu_sharing": True}


# -- the stack ------------------------------------------------------------------------------------


class Stack:
    def __init__(self, work_dir: Path, node_name: str) -> None:
        self.work_dir = work_dir
        self.node_name = node_name  # one per run: a node left by an earlier run is never mistaken for it
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.url = ""
        self.children: list[ChildProcess] = []
        self.agent: ChildProcess | None = None
        self.num_agent_starts = 0

    def start_control_plane(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        python = sys.executable
        for name, argv in {
            "web": ["-m", "uvicorn", "controlplane.asgi:application", "--host", "127.0.0.1", "--port", str(port),
                    "--no-access-log", "--log-level", "warning"],
            "worker": ["-m", "celery", "-A", "controlplane", "worker", "--concurrency=2", "--loglevel=INFO",
                       "--without-gossip", "--without-mingle", "-n", f"gpu-check-{os.getpid()}@%h"],
            "beat": ["-m", "celery", "-A", "controlplane", "beat", "--loglevel=INFO",
                     "--schedule", str(self.work_dir / "celerybeat-schedule")],
        }.items():  # fmt: skip
            self.children.append(ChildProcess([python, *argv], self.env, self.work_dir / f"{name}.log"))

        def web_up() -> bool:
            try:
                return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(web_up, 120, interval_s=0.2, message="the control plane")

    def start_agent(self, join_token: str, *, standby: bool) -> None:
        self.num_agent_starts += 1
        argv = [sys.executable, "-m", "gpu_agent", "run", "--control-plane", self.url, "--join-token", join_token,
                "--data-dir", str(self.work_dir / "agent"), "--name", self.node_name]  # fmt: skip
        env = {k: v for k, v in self.env.items() if not k.startswith(("DJANGO", "INFERPLANE_DATA_DIR"))}
        log = self.work_dir / f"agent-{self.num_agent_starts}.log"
        self.agent = ChildProcess(argv if standby else [*argv, "--no-standby"], env, log)
        self.children.append(self.agent)

    def stop_agent(self) -> None:
        if self.agent is not None:
            self.agent.stop(timeout_s=60)
            self.children.remove(self.agent)
            self.agent = None

    def standby_waiting(self) -> bool:
        """The agent logged more ready standbys than hand-offs: one waits for a replica."""
        log = self.agent.log_text()
        if "standby refused to serve" in log:
            raise CheckFailed(
                "the standby refused: " + log.split("standby refused to serve", 1)[1][:300].strip()
            )
        return log.count(" ready after ") > log.count(" now runs replica ")

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop(timeout_s=60)


# -- helpers --------------------------------------------------------------------------------------


def engine_processes(replica_id: str) -> list[psutil.Process]:
    """The replica's engine processes: every one started with its marker (the agent's way to find them)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(REPLICA_ENV_MARKER) == replica_id and process.status() != "zombie":
                found.append(process)
        except psutil.Error:
            continue
    if not found:
        raise CheckFailed(f"no process carries the replica's marker {REPLICA_ENV_MARKER}={replica_id}")
    return found


def visible_devices(processes: list[psutil.Process]) -> dict[int, str | None]:
    """CUDA_VISIBLE_DEVICES of each process as `/proc/<pid>/environ` shows it (what it started with)."""
    found = {}
    for process in processes:
        try:
            found[process.pid] = process.environ().get("CUDA_VISIBLE_DEVICES")
        except psutil.Error:
            continue
    return found


def gpus_used(processes: list[psutil.Process]) -> dict[int, set[str]]:
    """GPU UUIDs each process holds memory on, per nvidia-smi (empty where it cannot see them)."""
    result = subprocess.run(SMI_APPS_QUERY, capture_output=True, text=True, timeout=60)
    pids = {process.pid for process in processes}
    return {pid: uuids for pid, uuids in parse_smi_compute_apps(result.stdout).items() if pid in pids}


def engine_flag(processes: list[psutil.Process], flag: str) -> str | None:
    for process in processes:
        try:
            argv = process.cmdline()
        except psutil.Error:
            continue
        if flag in argv[:-1]:
            return argv[argv.index(flag) + 1]
    return None


def chat(url: str, model: str, key: str, *, timeout_s: float = 120) -> dict:
    response = httpx.post(
        f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=timeout_s,
        json={"model": model, "messages": MESSAGES, "max_tokens": 8, "ignore_eos": True},
    )  # fmt: skip
    if response.status_code != 200:
        raise CheckFailed(f"{url} answered {response.status_code}: {response.text[:300]}")
    body = response.json()
    if not body.get("usage", {}).get("completion_tokens"):
        raise CheckFailed(f"{url} answered without tokens: {body}")
    return body


# -- the run --------------------------------------------------------------------------------------


class Run:
    """Holds the stack, the results and the clock; each check is one method."""

    def __init__(self, gpus: list[SmiGpu], time_limit_s: float) -> None:
        self.gpus = gpus
        self.deadline = time.monotonic() + time_limit_s
        self.results: dict[str, CheckResult] = {}
        self.work_dir = Path(tempfile.mkdtemp(prefix="gpu-check-"))

    def left_s(self, reserve_s: float = 0.0) -> float:
        return max(1.0, self.deadline - time.monotonic() - reserve_s)

    def record(self, name: str, check: Callable[[], CheckResult]) -> CheckResult:
        try:
            result = check()
        except (CheckFailed, AssertionError) as exc:
            result = CheckResult(name, FAIL, str(exc))
        except Exception as exc:  # a check's bug or a dead process fails that check, not the run
            result = CheckResult(name, FAIL, f"{type(exc).__name__}: {exc}")
        self.results[name] = result
        print(result.line(), flush=True)
        return result

    def main(self) -> int:
        subprocess.run([sys.executable, "manage.py", "migrate", "--verbosity", "0"], cwd=REPO, check=True)
        import django

        django.setup()
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the checks'
        from controlplane.accounts.services import SYSTEM
        from controlplane.accounts.signup import bootstrap_organization
        from endpoints.fleet.services import create_join_token
        from gpu_agent.runtime.tiny_model import build_tiny_model

        self.model_dir = build_tiny_model(self.work_dir / "model")
        suffix = datetime.now().strftime("%Y%m%d%H%M%S")
        _org, _owner, key = bootstrap_organization(
            slug=f"gpu-check-{suffix}", owner_email=f"gpu-check-{suffix}@example.com"
        )
        self.api_key = key.plain
        self.join_token = create_join_token(SYSTEM, name=f"gpu-check-{suffix}").plain
        self.stack = Stack(self.work_dir, node_name=f"gpu-check-{suffix}")
        try:
            self.stack.start_control_plane()
            self.stack.start_agent(self.join_token, standby=False)
            self.record("gpu-detection", self.check_gpu_detection)
            self.phase_1()
            self.phase_2()
        except Exception as exc:  # the stack itself failed: the checks not run yet say so below
            print(f"the run stopped: {type(exc).__name__}: {exc}", flush=True)
        finally:
            self.stack.stop()
            subprocess.run(
                [sys.executable, "-m", "controlplane.embedded", "down"], cwd=REPO, capture_output=True
            )
        for name in CHECKS:
            if name not in self.results and name != "cuda-engine":
                self.record(name, lambda name=name: not_run([name], "an earlier step failed")[0])
        print(f"logs: {self.work_dir}")
        return 0 if all(result.status == PASS for result in self.results.values()) else 1

    # -- checks -------------------------------------------------------------------------------

    def node(self):
        from endpoints.nodes.models import Node

        return (
            Node.objects.filter(name=self.stack.node_name, state="READY")
            .order_by("-last_heartbeat_at")
            .first()
        )

    def check_gpu_detection(self) -> CheckResult:
        node = wait_until(self.node, min(180, self.left_s()), interval_s=0.5, message="the agent to register")
        self.gpu_type = node.gpu_type
        wait_until(
            lambda: self.node().last_heartbeat_at, 60, interval_s=0.5, message="the agent's first heartbeat"
        )
        return gpu_detection_verdict(self.gpus, reported_gpus(self.node()))

    def create_endpoint(self, name: str, **fields) -> str:
        from endpoints.catalogue import GPU_TYPES

        if getattr(self, "gpu_type", None) not in GPU_TYPES:
            raise CheckFailed(
                f"the node's GPU type {getattr(self, 'gpu_type', None)!r} is not in the catalogue"
            )
        body = {
            "name": name, "model_source": str(self.model_dir), "gpu_type": self.gpu_type, "max_model_len": 512,
            "max_num_seqs": 32, "cold_start_timeout_s": 600, "min_replicas": 1, "max_replicas": 1, **fields,
        }  # fmt: skip
        response = httpx.post(
            f"{self.stack.url}/api/v1/endpoints/", json=body, timeout=30,
            headers={"Authorization": f"Bearer {self.api_key}"},
        )  # fmt: skip
        if response.status_code != 201:
            raise CheckFailed(f"creating {name}: {response.status_code} {response.text[:300]}")
        return response.json()["id"]

    def ready_replicas(self, endpoint_id: str, count: int, timeout_s: float) -> list:
        from endpoints.models import Endpoint, Replica

        def ready():
            endpoint = Endpoint.objects.get(pk=endpoint_id)
            if endpoint.failed_at is not None:
                raise CheckFailed(f"endpoint {endpoint.name} FAILED: {endpoint.status_message}")
            replicas = list(Replica.objects.filter(endpoint_id=endpoint_id, state="READY"))
            return replicas if len(replicas) >= count else None

        try:
            return wait_until(ready, timeout_s, interval_s=1.0, message="READY replicas")
        except AssertionError:
            endpoint = Endpoint.objects.get(pk=endpoint_id)
            states = list(
                Replica.objects.filter(endpoint_id=endpoint_id).values_list("state", "failure_reason")
            )
            raise CheckFailed(
                f"{endpoint.name}: no {count} READY replica(s) in {timeout_s:.0f} s "
                f"({endpoint.status_message or 'no status'}; replicas {states}); agent log {self.stack.agent.log_path}"
            ) from None

    def phase_1(self) -> None:
        endpoints = {}
        for name, fields in (
            ("gc-pinned", {}),
            ("gc-fp8", {"quantization": "fp8"}),
            ("gc-shared", shared_gpu_endpoint_fields()),
        ):
            try:
                endpoints[name] = self.create_endpoint(name, **fields)
            except CheckFailed as exc:
                endpoints[name] = exc
        check_of = {
            "gc-pinned": "replica-pinned",
            "gc-fp8": "fp8-serving",
            "gc-shared": "two-replicas-one-gpu",
        }
        method_of = {"gc-pinned": self.check_pinned, "gc-fp8": self.check_fp8, "gc-shared": self.check_shared}
        for name, endpoint_id in endpoints.items():
            if isinstance(endpoint_id, CheckFailed):
                self.record(check_of[name], functools.partial(_raise, endpoint_id))
            else:
                self.record(check_of[name], functools.partial(method_of[name], endpoint_id))
        # Phase 2 starts from an idle node: the standby then takes the first cold start.
        for endpoint_id in endpoints.values():
            if not isinstance(endpoint_id, CheckFailed):
                httpx.delete(
                    f"{self.stack.url}/api/v1/endpoints/{endpoint_id}/", timeout=30,
                    headers={"Authorization": f"Bearer {self.api_key}"},
                )  # fmt: skip

    def check_pinned(self, endpoint_id: str) -> CheckResult:
        (replica,) = self.ready_replicas(endpoint_id, 1, self.left_s(PHASE_2_RESERVE_S))
        processes = engine_processes(str(replica.pk))
        return pinning_verdict(
            replica_gpu_indices(replica), visible_devices(processes), gpus_used(processes),
            {gpu.index: gpu.uuid for gpu in self.gpus},
        )  # fmt: skip

    def check_fp8(self, endpoint_id: str) -> CheckResult:
        (replica,) = self.ready_replicas(endpoint_id, 1, self.left_s(PHASE_2_RESERVE_S))
        quantization = engine_flag(engine_processes(str(replica.pk)), "--quantization")
        expected = FP8_ENGINE_METHOD
        if quantization != expected:
            raise CheckFailed(f"the engine runs with --quantization {quantization!r}, not {expected}")
        answer = chat(self.stack.url, "gc-fp8", self.api_key)
        tokens = answer["usage"]["completion_tokens"]
        return CheckResult(
            "fp8-serving", PASS, f"--quantization {expected} engine answered {tokens} tokens through the gateway"
        )

    def check_shared(self, endpoint_id: str) -> CheckResult:
        replicas = self.ready_replicas(endpoint_id, 2, self.left_s(PHASE_2_RESERVE_S))
        observed = []
        for replica in replicas:
            fraction = engine_flag(engine_processes(str(replica.pk)), "--gpu-memory-utilization")
            observed.append((replica_gpu_indices(replica), float(fraction) if fraction else None))
            chat(replica.address, replica.endpoint.name, replica.engine_api_key)
        return sharing_verdict(observed)

    def phase_2(self) -> None:
        from endpoints.models import Replica

        try:
            wait_until(
                lambda: not Replica.objects.filter(node__name=self.stack.node_name, state__in=ACTIVE_STATES).exists(),
                min(120, self.left_s()), interval_s=0.5, message="phase 1's replicas to stop",
            )  # fmt: skip
        except AssertionError:
            pass  # stopping the agent stops its engines in any case
        self.stack.stop_agent()
        self.stack.start_agent(self.join_token, standby=True)
        self.record("standby-cold-start", self.check_standby)
        if self.results["standby-cold-start"].status == PASS:
            self.record("bench-gateway-vs-direct", self.check_bench)
        self.record("sleep-wake", self.check_sleep_wake)

    def check_standby(self) -> CheckResult:
        from endpoints.models import Replica

        wait_until(
            self.stack.standby_waiting, min(300, self.left_s()), interval_s=0.5, message="a ready standby"
        )
        self.cold_endpoint_id = self.create_endpoint("gc-cold", min_replicas=0)
        sent_at = time.monotonic()
        chat(self.stack.url, "gc-cold", self.api_key, timeout_s=self.left_s())
        ttft_s = time.monotonic() - sent_at
        replica = Replica.objects.filter(endpoint_id=self.cold_endpoint_id).order_by("-created_at").first()
        if not re.search(
            rf"replica {replica.pk}: launched pid \d+ on port \d+ \(warm standby\)",
            self.stack.agent.log_text(),
        ):
            raise CheckFailed(f"the cold start ({ttft_s:.1f} s) was launched plainly, not by the standby")
        processes = engine_processes(str(replica.pk))
        used = sorted(set().union(*gpus_used(processes).values()) or {"(not visible to nvidia-smi)"})
        return CheckResult(
            "standby-cold-start", PASS,
            f"answered from zero in {ttft_s:.1f} s by the warm standby; GPUs {replica_gpu_indices(replica)}, in use {used}",
        )  # fmt: skip

    def check_bench(self) -> CheckResult:
        from endpoints.models import Replica

        replica = Replica.objects.get(endpoint_id=self.cold_endpoint_id, state="READY")
        results = {}
        for label, url, key in (
            ("direct", replica.address, replica.engine_api_key),
            ("gateway", self.stack.url, self.api_key),
        ):
            command = bench_serve_command(url, "gc-cold", self.model_dir, self.work_dir, label)
            env = {**os.environ, "OPENAI_API_KEY": key}
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=self.left_s())
            output = self.work_dir / f"bench-{label}.json"
            if done.returncode != 0 or not output.exists():
                raise CheckFailed(
                    f"vllm bench serve ({label}) exited {done.returncode}: {done.stderr[-500:]}"
                )
            results[label] = json.loads(output.read_text())
        return bench_verdict(results["direct"], results["gateway"], BENCH_NUM_PROMPTS)

    def check_sleep_wake(self) -> CheckResult:
        from endpoints.models import EndpointEvent, Replica

        if getattr(self, "cold_endpoint_id", None):  # the GPU to itself: its memory is the sleeper's alone
            httpx.delete(f"{self.stack.url}/api/v1/endpoints/{self.cold_endpoint_id}/", timeout=30,
                         headers={"Authorization": f"Bearer {self.api_key}"})
            wait_until(lambda: not Replica.objects.filter(endpoint_id=self.cold_endpoint_id, state__in=ACTIVE_STATES).exists(),
                       min(120, self.left_s()), interval_s=0.5, message="the benchmark's replica to stop")
        endpoint_id = self.create_endpoint("gc-sleep", min_replicas=0, idle_action="sleep",
                                           idle_timeout_s=SLEEP_IDLE_TIMEOUT_S)
        before = greedy_answer(self.stack.url, "gc-sleep", self.api_key, timeout_s=self.left_s())
        replica = Replica.objects.get(endpoint_id=endpoint_id, state="READY")
        index = (replica_gpu_indices(replica) or [0])[0]
        pids = {process.pid for process in engine_processes(str(replica.pk))}
        awake_mb = gpu_memory_used_mb(index)
        wait_until(lambda: Replica.objects.filter(pk=replica.pk, state="SLEEPING").exists()
                   and f"replica {replica.pk} SLEEPING after" in self.stack.agent.log_text(),
                   min(SLEEP_IDLE_TIMEOUT_S + 90, self.left_s()), interval_s=0.5, message="the replica to sleep")
        time.sleep(2)  # nvidia-smi's figure settles
        asleep_mb = gpu_memory_used_mb(index)
        sent_at = time.monotonic()
        after = greedy_answer(self.stack.url, "gc-sleep", self.api_key, timeout_s=self.left_s())
        woken_call_s = time.monotonic() - sent_at
        replica.refresh_from_db()
        woke = re.search(rf"replica {replica.pk} woke \(READY\) after ([0-9.]+)s", self.stack.agent.log_text())
        same = (replica.num_restarts == 0 and {process.pid for process in engine_processes(str(replica.pk))} == pids
                and EndpointEvent.objects.filter(replica=replica, kind="cold_start", details__wake=True).exists())
        return sleep_wake_verdict(awake_mb=awake_mb, asleep_mb=asleep_mb, same_process=same,
                                  engine_wake_s=float(woke.group(1)) if woke else None, woken_call_s=woken_call_s,
                                  answer_before=before, answer_after=after)


def gpu_memory_used_mb(index: int) -> int:
    done = subprocess.run(SMI_MEMORY_USED_QUERY, capture_output=True, text=True, timeout=60, check=True)
    return parse_smi_memory_used(done.stdout)[index]


def greedy_answer(url: str, model: str, key: str, *, timeout_s: float) -> str:
    """One prompt at temperature 0: the same engine and weights give the same words."""
    response = httpx.post(
        f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=timeout_s,
        json={"model": model, "messages": MESSAGES, "max_tokens": 16, "temperature": 0},
    )  # fmt: skip
    if response.status_code != 200:
        raise CheckFailed(f"{url} answered {response.status_code}: {response.text[:300]}")
    return response.json()["choices"][0]["message"]["content"] or ""


def bench_serve_command(url: str, model: str, tokenizer: Path, result_dir: Path, label: str) -> list[str]:
    """`vllm bench serve`: streamed chat completions of random prompts at a fixed concurrency."""
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
        "--model", model, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "64",
        "--num-prompts", str(BENCH_NUM_PROMPTS), "--max-concurrency", str(BENCH_CONCURRENCY), "--ignore-eos",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", f"bench-{label}.json",
        "--disable-tqdm",
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gpus", required=True, help="JSON: nvidia-smi's GPUs, as bench/gpu_check.py read them"
    )
    parser.add_argument("--time-limit-s", type=float, default=600.0)
    options = parser.parse_args()
    gpus = [SmiGpu(**gpu) for gpu in json.loads(options.gpus)]
    # NOTE: the stack's processes run in their own sessions: a SIGTERM must unwind to Run.main's
    # `finally`, which stops them, rather than end this process and leave them behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return Run(gpus, options.time_limit_s).main()


if __name__ == "__main__":
    sys.exit(main())
