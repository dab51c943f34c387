"""Chaos: mixed streaming and non-streaming traffic through the whole platform while its parts die.

A real stack (two gateway/web processes, a Celery worker and beat, a GPU agent running the tiny
vLLM model on CPU, embedded PostgreSQL and Redis) serves an always-warm endpoint to clients using the
official `openai` library (half of them streaming), for `--duration-s` seconds. Meanwhile a script
kills and restarts, one after another: the Celery worker, the engine (the agent restarts it), a
gateway process, Redis, PostgreSQL and the agent (with its engines).

Every answer is sorted as a client sees it:
- answered: a complete completion with its usage;
- failed cleanly: an error in OpenAI's shape (not a 500), or a connection refused by a gateway that
  is down (nothing was accepted, as a load balancer would see it);
- cut: the connection dropped mid-answer because the process serving it was killed;
- hung: no answer within the client timeout (must be 0).
Then the money: every answered request must have exactly one ledger row with the tokens the client
saw (lost and mismatched must be 0), the ledger must equal the rollups, and spend must stay under
the organisation's cap.

Writes `bench/results/chaos.json` and prints a markdown table.

    INFERPLANE_DATA_DIR=.data/bench .venv/bin/python bench/bench_chaos.py [--duration-s 180]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("INFERPLANE_DATA_DIR", str(REPO / ".data" / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
os.environ.setdefault("DJANGO_DEBUG", "1")

from tests.processes import ChildProcess, free_port, wait_until  # noqa: E402 - after sys.path is set

FAST = {"INFERPLANE_AGENT_HEARTBEAT_INTERVAL_S": "1", "INFERPLANE_AUTOSCALER_TICK_S": "1",
        "INFERPLANE_NODE_HEARTBEAT_GRACE_S": "15", "INFERPLANE_REDIS_TIMEOUT_S": "2"}
MESSAGES = [{"role": "user", "content": "Tell me something"}]
NUM_CLIENTS = 6
CLIENT_TIMEOUT_S = 60.0
COLD_START_TIMEOUT_S = 20
SPEND_CAP = Decimal("5.00")
PYTHON = sys.executable


class Stack:
    """The platform's processes; each can be killed and started again in its place."""

    def __init__(self, work_dir: Path):
        self.work_dir = work_dir
        self.env = {**os.environ, **FAST, "PYTHONUNBUFFERED": "1",
                    "INFERPLANE_USAGE_JOURNAL_DIR": str(work_dir / "usage-journal")}
        self.ports = [free_port(), free_port()]
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.gateways: list[ChildProcess | None] = [None, None]
        self.worker = self.beat = self.agent = None
        self.join_token = ""
        self.node_name = f"chaos-{time.strftime('%Y%m%d%H%M%S')}"
        self.num_starts = Counter()

    def _log(self, name: str) -> Path:
        self.num_starts[name] += 1
        return self.work_dir / f"{name}-{self.num_starts[name]}.log"

    def start_gateway(self, index: int) -> None:
        self.gateways[index] = ChildProcess(
            [PYTHON, "-m", "uvicorn", "controlplane.asgi:application", "--host", "127.0.0.1", "--port",
             str(self.ports[index]), "--no-access-log", "--log-level", "warning"],
            self.env, self._log(f"gateway{index}"))
        wait_until(lambda: _answers(f"{self.urls[index]}/healthz"), 120, interval_s=0.2, message=f"gateway {index}")

    def start_worker(self) -> None:
        self.worker = ChildProcess(
            [PYTHON, "-m", "celery", "-A", "controlplane", "worker", "--pool=solo", "--concurrency=1", "--loglevel=INFO",
             "--without-gossip", "--without-mingle", "-n", f"chaos-{os.getpid()}-{time.time_ns()}@%h"],
            self.env, self._log("worker"))

    def start_beat(self) -> None:
        self.beat = ChildProcess(
            [PYTHON, "-m", "celery", "-A", "controlplane", "beat", "--loglevel=INFO",
             "--schedule", str(self.work_dir / "celerybeat-schedule")], self.env, self._log("beat"))

    def start_agent(self) -> None:
        env = {k: v for k, v in self.env.items() if not k.startswith(("DJANGO", "INFERPLANE_DATA_DIR"))}
        self.agent = ChildProcess(
            [PYTHON, "-m", "gpu_agent", "run", "--control-plane", self.urls[0], "--join-token", self.join_token,
             "--data-dir", str(self.work_dir / "agent"), "--cpu", "--name", self.node_name],
            env, self._log("agent"))

    def stop(self) -> None:
        for child in [self.agent, self.beat, self.worker, *self.gateways]:
            if child is not None:
                child.stop(timeout_s=60)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# --- the clients ---------------------------------------------------------------------------------

class Clients:
    def __init__(self, urls: list[str], key: str, model: str):
        self.urls, self.key, self.model = urls, key, model
        self.answers: list[dict] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(NUM_CLIENTS)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(CLIENT_TIMEOUT_S + 10)

    def _run(self, index: int) -> None:
        import openai

        clients = [openai.OpenAI(base_url=f"{url}/v1", api_key=self.key, max_retries=0, timeout=CLIENT_TIMEOUT_S)
                   for url in self.urls]
        number = index
        while not self.stopping.is_set():
            answer = self._call(clients[number % 2], stream=index % 2 == 1, max_tokens=8 + number % 9)
            with self.lock:
                self.answers.append(answer)
            number += 1
            if answer["outcome"] != "answered":
                time.sleep(0.2)

    def _call(self, client, *, stream: bool, max_tokens: int) -> dict:
        import openai

        started = time.time()
        answer = {"stream": stream, "at": started, "request_id": None}
        try:
            if not stream:
                raw = client.chat.completions.with_raw_response.create(model=self.model, messages=MESSAGES,
                                                                        max_tokens=max_tokens)
                answer["request_id"] = raw.headers.get("x-request-id")
                usage = raw.parse().usage
                return answer | {"outcome": "answered", "prompt_tokens": usage.prompt_tokens,
                                 "completion_tokens": usage.completion_tokens}
            events = client.chat.completions.create(model=self.model, messages=MESSAGES, max_tokens=max_tokens,
                                                    stream=True, stream_options={"include_usage": True})
            answer["request_id"] = events.response.headers.get("x-request-id")
            usage = None
            for chunk in events:
                usage = chunk.usage or usage
            if usage is None:
                return answer | {"outcome": "cut", "detail": "stream ended without usage"}
            return answer | {"outcome": "answered", "prompt_tokens": usage.prompt_tokens,
                             "completion_tokens": usage.completion_tokens}
        except openai.APITimeoutError:
            return answer | {"outcome": "hung"}
        except openai.APIStatusError as exc:
            clean = exc.status_code != 500 and isinstance(exc.body, dict) and "message" in exc.body
            return answer | {"outcome": "failed_clean" if clean else "broken", "detail": f"{exc.status_code} {exc.code}"}
        except openai.APIError as exc:  # an error event inside a stream, in OpenAI's shape
            if isinstance(exc, openai.APIConnectionError):
                # NOTE: refused before a byte (a gateway that is down) is clean; dropped mid-answer is a cut.
                refused = isinstance(exc.__cause__, httpx.ConnectError)
                return answer | {"outcome": "failed_clean" if refused else "cut", "detail": repr(exc.__cause__)[:120]}
            return answer | {"outcome": "failed_clean", "detail": f"stream error {getattr(exc, 'code', None)}"}
        except (httpx.HTTPError, ConnectionError) as exc:
            return answer | {"outcome": "cut", "detail": repr(exc)[:120]}


# --- the faults ----------------------------------------------------------------------------------

def kill_and_restart(name: str, kill, restart, log: list) -> None:
    started = time.time()
    try:
        kill()
        time.sleep(2.0)
        restart()
        log.append({"fault": name, "at": round(started, 3), "restarted_after_s": round(time.time() - started, 2)})
    except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported, not fatal
        log.append({"fault": name, "at": round(started, 3), "error": repr(exc)[:300]})
    print(f"fault: {log[-1]}", flush=True)


def engine_pids(replica_id: str) -> list[int]:
    import psutil

    from gpu_agent.runtime.engine import REPLICA_ENV_MARKER

    pids = []
    for process in psutil.process_iter(["pid"]):
        try:
            if process.environ().get(REPLICA_ENV_MARKER) == replica_id:
                pids.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return pids


def run_faults(stack: Stack, endpoint_id: str, duration_s: float, log: list) -> None:
    import signal

    from controlplane import embedded
    from endpoints.models import Replica

    def kill_engine():
        replica = Replica.objects.filter(endpoint_id=endpoint_id, state="READY").first()
        pids = engine_pids(str(replica.pk)) if replica else []
        if not pids:
            raise RuntimeError("no running engine found")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    def restart_postgres():
        from django.db import connections

        embedded.ensure_postgres()
        connections.close_all()

    faults = [
        ("celery worker killed", lambda: stack.worker.kill(), stack.start_worker),
        ("engine killed (the agent restarts it)", kill_engine, lambda: None),
        ("gateway process killed", lambda: stack.gateways[1].kill(), lambda: stack.start_gateway(1)),
        ("redis restarted", embedded.stop_redis, embedded.ensure_redis),
        ("postgresql restarted", embedded.stop_postgres, restart_postgres),
        ("agent killed with its engines", lambda: stack.agent.kill(), stack.start_agent),
    ]
    gap_s = duration_s / (len(faults) + 1)
    began = time.time()
    for number, (name, kill, restart) in enumerate(faults, start=1):
        time.sleep(max(0.0, began + number * gap_s - time.time()))
        kill_and_restart(name, kill, restart, log)
    time.sleep(max(0.0, began + duration_s - time.time()))


# --- the accounts --------------------------------------------------------------------------------

def reconcile(answers: list[dict], organization_id: int, work_dir: Path) -> dict:
    from django.db.models import Count, Sum

    from billing.models import UsageRecord, UsageRollup
    from billing.rollups import rollup_usage
    from billing.usage_journal import UsageJournal

    answered = {a["request_id"]: a for a in answers if a["outcome"] == "answered"}
    journal = UsageJournal(work_dir / "usage-journal")
    wait_until(lambda: journal.backlog() == 0, 120, interval_s=0.5, message="the usage journal to drain")
    rows = {row.request_id: row for row in UsageRecord.objects.filter(request_id__in=list(answered))}
    lost = [request_id for request_id in answered if request_id not in rows]
    mismatched = [request_id for request_id, row in rows.items()
                  if (row.prompt_tokens, row.completion_tokens)
                  != (answered[request_id]["prompt_tokens"], answered[request_id]["completion_tokens"])]
    client_tokens = sum(a["prompt_tokens"] + a["completion_tokens"] for a in answered.values())
    ledger_tokens_of_answered = sum(row.prompt_tokens + row.completion_tokens for row in rows.values())
    rollup_usage(full=True)
    ledger = UsageRecord.objects.filter(organization_id=organization_id).aggregate(
        requests=Count("id"), tokens=Sum("prompt_tokens") + Sum("completion_tokens"), cost=Sum("cost"))
    rollups = UsageRollup.objects.filter(organization_id=organization_id).aggregate(
        requests=Sum("num_requests"), tokens=Sum("prompt_tokens") + Sum("completion_tokens"), cost=Sum("cost"))
    return {
        "answered_with_a_ledger_row": len(rows),
        "tokens_lost": sum(answered[r]["prompt_tokens"] + answered[r]["completion_tokens"] for r in lost),
        "requests_lost": len(lost),
        "requests_with_other_tokens_in_the_ledger": len(mismatched),
        "client_seen_tokens": client_tokens,
        "ledger_tokens_of_answered": ledger_tokens_of_answered,
        "tokens_double_counted": max(0, ledger_tokens_of_answered - client_tokens),
        "ledger": {k: str(v) for k, v in ledger.items()},
        "rollups": {k: str(v) for k, v in rollups.items()},
        "ledger_equals_rollups": all(str(ledger[k] or 0) == str(rollups[k] or 0) for k in ledger),
        "spend": str(ledger["cost"] or 0),
        "spend_cap": str(SPEND_CAP),
        "spend_within_cap": (ledger["cost"] or Decimal(0)) <= SPEND_CAP,
    }


def retire_earlier_runs() -> None:
    """Endpoints and nodes of earlier runs must not take this run's agent or CPU."""
    from django.utils import timezone

    from endpoints.models import Endpoint
    from gpu_agent.models import Node

    Endpoint.objects.filter(name__startswith="chaos-", paused_at__isnull=True).update(paused_at=timezone.now())
    Node.objects.filter(name__startswith="chaos-").exclude(state="OFFLINE").update(state="OFFLINE")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=180.0)
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "chaos.json"))
    options = parser.parse_args()

    subprocess.run([PYTHON, "manage.py", "migrate", "--verbosity", "0"], cwd=REPO, check=True)
    import django

    django.setup()
    from billing.services import set_spend_cap
    from controlplane.services import SYSTEM, bootstrap_organization
    from endpoints.models import Endpoint
    from gpu_agent.models import Node
    from gpu_agent.runtime.tiny_model import build_tiny_model
    from gpu_agent.services import create_join_token

    retire_earlier_runs()
    suffix = datetime.now().strftime("%Y%m%d%H%M%S")
    organization, _owner, key = bootstrap_organization(slug=f"chaos-{suffix}", owner_email=f"chaos-{suffix}@example.com")
    set_spend_cap(SYSTEM, organization, spend_cap=SPEND_CAP)
    # NOTE: kept (logs of every process) under the data folder, for a look at what a failure was.
    work_dir = Path(os.environ["INFERPLANE_DATA_DIR"]).resolve() / f"chaos-{suffix}"
    work_dir.mkdir(parents=True)
    model_dir = build_tiny_model(work_dir / "model")
    stack = Stack(work_dir)
    stack.join_token = create_join_token(SYSTEM, name=f"chaos-{suffix}").plain
    faults: list[dict] = []
    try:
        stack.start_gateway(0)
        stack.start_gateway(1)
        stack.start_worker()
        stack.start_beat()
        stack.start_agent()
        wait_until(lambda: Node.objects.filter(name=stack.node_name, state="READY").exists(), 180, interval_s=0.5,
                   message="the agent to register")
        headers = {"Authorization": f"Bearer {key.plain}"}
        name = f"chaos-{suffix}"
        created = httpx.post(f"{stack.urls[0]}/api/v1/endpoints/", headers=headers, timeout=30, json={
            "name": name, "model_source": str(model_dir), "gpu_type": "cpu", "min_replicas": 1, "max_replicas": 1,
            "max_model_len": 512, "max_num_seqs": 16,
            # NOTE: below the clients' timeout: a request held while no replica is READY gets its 503.
            "cold_start_timeout_s": COLD_START_TIMEOUT_S,
        })
        created.raise_for_status()
        endpoint_id = created.json()["id"]
        wait_until(lambda: Endpoint.objects.get(pk=endpoint_id).replicas.filter(state="READY").exists(), 600,
                   interval_s=0.5, message="the endpoint's replica to be READY")
        clients = Clients(stack.urls, key.plain, name)
        began = time.time()
        clients.start()
        run_faults(stack, endpoint_id, options.duration_s, faults)
        clients.stop()
        ended = time.time()
        accounts = reconcile(clients.answers, organization.pk, work_dir)
    finally:
        stack.stop()
        retire_earlier_runs()

    outcomes = Counter(a["outcome"] for a in clients.answers)
    timeline = [[round(a["at"] - began, 2), a["outcome"], a.get("detail", "")] for a in sorted(clients.answers, key=lambda a: a["at"])]
    for fault in faults:
        answered_after = [a["at"] for a in clients.answers if a["outcome"] == "answered" and a["at"] > fault["at"]]
        fault["next_answer_after_s"] = round(min(answered_after) - fault["at"], 2) if answered_after else None
    result = {
        "benchmark": "chaos",
        "measured_at": datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "num_cpus": os.cpu_count(),
                    "load_average": os.getloadavg()},
        "duration_s": round(ended - began, 1),
        "clients": NUM_CLIENTS,
        "upstream": "tiny vLLM on CPU through a real agent",
        "faults": faults,
        "requests": {"total": len(clients.answers), **{k: outcomes.get(k, 0) for k in
                                                       ("answered", "failed_clean", "cut", "broken", "hung")}},
        "failure_details": Counter(a.get("detail", "") for a in clients.answers if a["outcome"] != "answered").most_common(12),
        "accounts": accounts,
        "stripe_meters": "not compared: an hour's rollup goes to Stripe only once the hour has closed",
        "logs": str(work_dir),
        "timeline": timeline,
    }
    Path(options.output).parent.mkdir(parents=True, exist_ok=True)
    Path(options.output).write_text(json.dumps(result, indent=2, default=str) + "\n")
    requests = result["requests"]
    print("\n| measure | result |\n|---|---:|")
    for label, value in [
        ("requests", requests["total"]), ("answered", requests["answered"]),
        ("failed with a clean error", requests["failed_clean"]), ("cut by a killed process", requests["cut"]),
        ("broken (500 or malformed)", requests["broken"]), ("**hung**", requests["hung"]),
        ("**tokens lost**", accounts["tokens_lost"]), ("**tokens double-counted**", accounts["tokens_double_counted"]),
        ("ledger = rollups", accounts["ledger_equals_rollups"]),
        ("spend / cap", f"${accounts['spend']} / ${accounts['spend_cap']}"),
    ]:
        print(f"| {label} | {value} |")
    print("\n| fault | restarted after | next answer after |\n|---|---:|---:|")
    for fault in faults:
        print(f"| {fault['fault']} | {fault.get('restarted_after_s', fault.get('error'))} s | {fault['next_answer_after_s']} s |")
    print(f"\nwrote {options.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
