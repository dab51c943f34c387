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
Three organisations, each with its own endpoint on the same agent: the main one (postpaid, a cap far
above its spend) whose answers time the recovery from each fault; a postpaid one whose hard cap is
reached early in the run; and a prepaid one with a small credit. The last two have high token prices
so that a few requests matter; their clients keep calling after the cap or the credit is spent and
are refused with 402 `insufficient_quota` (counted apart, as clean errors).
Then the money: every answered request must have exactly one ledger row with the tokens the client
saw (lost and mismatched must be 0), and spend must stay within each cap and the credit. Once the
traffic has stopped the books are closed in-process (the rollup run with a clock past the close of
the current hour, then the push to Stripe), and for each postpaid organisation the ledger, the
rollups and the meter events received by the fake Stripe (`tests/fakes/stripe_server.py`) must
agree; the prepaid organisation must have no meter event at all.

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
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("INFERPLANE_DATA_DIR", str(REPO / ".data" / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
os.environ.setdefault("DJANGO_DEBUG", "1")

from tests.fakes.stripe_server import FakeStripe  # noqa: E402 - after sys.path is set
from tests.processes import ChildProcess, free_port, wait_until  # noqa: E402

FAST = {"INFERPLANE_AGENT_HEARTBEAT_INTERVAL_S": "1", "INFERPLANE_AUTOSCALER_TICK_S": "1",
        "INFERPLANE_NODE_HEARTBEAT_GRACE_S": "15", "INFERPLANE_REDIS_TIMEOUT_S": "2"}
MESSAGES = [{"role": "user", "content": "Tell me something"}]
CLIENT_TIMEOUT_S = 60.0
COLD_START_TIMEOUT_S = 20
PYTHON = sys.executable
# The main organisation's traffic times recovery; its prices are whole micro-dollars per token, so
# the ledger converts to Stripe's micro-dollar cost meter exactly.
MAIN = "main"
CAPPED = "capped"
PREPAID = "prepaid"
ORGANIZATIONS = {
    MAIN: {"clients": 4, "price_per_million": Decimal("1"), "spend_cap": Decimal("5.00")},
    # $0.001 a token: about $0.03 a request, so the cap and the credit run out after ~30 requests.
    CAPPED: {"clients": 2, "price_per_million": Decimal("1000"), "spend_cap": Decimal("1.00")},
    PREPAID: {"clients": 2, "price_per_million": Decimal("1000"), "credit": Decimal("1.00")},
}
# Once a fault is injected the main clients must be answered again before the next one (bounded).
RECOVERY_WAIT_S = 180.0
REFUSED_PAUSE_S = 1.0


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
    """Client threads; each calls one organisation's endpoint with its key, alternately through either gateway."""

    def __init__(self, urls: list[str], targets: dict[str, tuple[str, str]]):
        self.urls, self.targets = urls, targets  # label -> (key, model)
        self.answers: list[dict] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.stopped_labels: set[str] = set()
        self.threads = {(label, i): threading.Thread(target=self._run, args=(label, i), daemon=True)
                        for label in targets for i in range(ORGANIZATIONS[label]["clients"])}

    def start(self) -> None:
        for thread in self.threads.values():
            thread.start()

    def stop(self, labels=None) -> None:
        if labels is None:
            self.stopping.set()
        self.stopped_labels.update(labels or ())
        for (label, _), thread in self.threads.items():
            if labels is None or label in labels:
                thread.join(CLIENT_TIMEOUT_S + 10)

    def answered_after(self, label: str, at: float) -> bool:
        with self.lock:
            return any(a["org"] == label and a["outcome"] == "answered" and a["at"] > at for a in self.answers)

    def _run(self, label: str, index: int) -> None:
        import openai

        key, model = self.targets[label]
        clients = [openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S)
                   for url in self.urls]
        number = index
        while not self.stopping.is_set() and label not in self.stopped_labels:
            answer = self._call(clients[number % 2], model, stream=index % 2 == 1, max_tokens=8 + number % 9)
            answer["org"] = label
            with self.lock:
                self.answers.append(answer)
            number += 1
            if answer["outcome"] == "refused_by_cap":
                time.sleep(REFUSED_PAUSE_S)
            elif answer["outcome"] != "answered":
                time.sleep(0.2)

    def _call(self, client, model: str, *, stream: bool, max_tokens: int) -> dict:
        import openai

        started = time.time()
        answer = {"stream": stream, "at": started, "request_id": None}
        try:
            if not stream:
                raw = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES,
                                                                        max_tokens=max_tokens)
                answer["request_id"] = raw.headers.get("x-request-id")
                usage = raw.parse().usage
                return answer | {"outcome": "answered", "prompt_tokens": usage.prompt_tokens,
                                 "completion_tokens": usage.completion_tokens}
            events = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=max_tokens,
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
            if exc.status_code == 402 and exc.code == "insufficient_quota":
                return answer | {"outcome": "refused_by_cap", "detail": "402 insufficient_quota"}
            clean = exc.status_code != 500 and isinstance(exc.body, dict) and "message" in exc.body
            return answer | {"outcome": "failed_clean" if clean else "broken", "detail": f"{exc.status_code} {exc.code}"}
        except openai.APIError as exc:  # an error event inside a stream, in OpenAI's shape
            if isinstance(exc, openai.APIConnectionError):
                # NOTE: refused before a byte (a gateway that is down) is clean; dropped mid-answer is a cut.
                # By name: the `openai` library may bring its own copy of httpx.
                refused = type(exc.__cause__).__name__ == "ConnectError"
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


def run_faults(stack: Stack, clients: Clients, endpoint_ids: dict[str, str], duration_s: float, log: list) -> None:
    """Inject the faults `duration_s / 7` apart; each waits until the main clients are answered again
    after the previous one (at most RECOVERY_WAIT_S), so every fault's recovery is seen within the run.

    Before the agent is killed, the capped and prepaid organisations (long refused by then) stop
    calling and their endpoints are paused, so the new agent starts one engine, not three: three
    concurrent cold vLLM starts on two shared cores take minutes.
    """
    import signal

    from controlplane import embedded
    from controlplane.accounts.services import SYSTEM
    from endpoints.models import ACTIVE_REPLICA_STATES, Endpoint, Replica
    from endpoints.services import pause_endpoint

    endpoint_id = endpoint_ids[MAIN]
    others = [label for label in endpoint_ids if label != MAIN]

    def retire_others():
        clients.stop(others)
        for label in others:
            pause_endpoint(SYSTEM, Endpoint.objects.get(pk=endpoint_ids[label]))
        wait_until(lambda: not Replica.objects.filter(endpoint_id__in=[endpoint_ids[label] for label in others],
                                                      state__in=ACTIVE_REPLICA_STATES).exists(),
                   90, interval_s=0.5, message="the paused endpoints' replicas to stop")

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

    def wait_for_recovery(since: float) -> None:
        deadline = time.time() + RECOVERY_WAIT_S
        while time.time() < deadline and not clients.answered_after(MAIN, since):
            time.sleep(0.5)

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
        if number == len(faults):
            retire_others()
        kill_and_restart(name, kill, restart, log)
        wait_for_recovery(log[-1]["at"])
    time.sleep(max(5.0, began + duration_s - time.time()))


# --- the accounts --------------------------------------------------------------------------------

def reconcile(answers: list[dict], organizations: dict, work_dir: Path, stack: Stack, fake_stripe) -> dict:
    from django.db.models import Count, Sum
    from django.utils import timezone

    from billing.credits import draw_credits
    from billing.models import BillingAccount, CreditGrant, MeterEventPush, UsageRecord, UsageRollup
    from billing.rollups import close_delay, rollup_usage
    from billing.stripe_sync import COST_METER, METERS, push_pending_rollups
    from billing.usage_journal import UsageJournal

    answered = {a["request_id"]: a for a in answers if a["outcome"] == "answered"}
    journal = UsageJournal(work_dir / "usage-journal")
    wait_until(lambda: journal.backlog() == 0, 120, interval_s=0.5, message="the usage journal to drain")
    # NOTE: the books are closed with the platform stopped, so no beat run interleaves with this one.
    stack.stop()
    rows = {row.request_id: row for row in UsageRecord.objects.filter(request_id__in=list(answered))}
    lost = [request_id for request_id in answered if request_id not in rows]
    mismatched = [request_id for request_id, row in rows.items()
                  if (row.prompt_tokens, row.completion_tokens)
                  != (answered[request_id]["prompt_tokens"], answered[request_id]["completion_tokens"])]
    client_tokens = sum(a["prompt_tokens"] + a["completion_tokens"] for a in answered.values())
    ledger_tokens_of_answered = sum(row.prompt_tokens + row.completion_tokens for row in rows.values())

    # Close the books: the current hour (and every earlier one) is closed as if its close had passed,
    # then every closed postpaid rollup is pushed to the fake Stripe.
    now = timezone.now()
    close_at = now.replace(minute=0, second=0, microsecond=0) + close_delay() + timedelta(seconds=1)
    rollup_usage(full=True, now=close_at)
    push_pending_rollups()
    meter_totals = fake_stripe.meter_totals()

    per_org = {}
    for label, organization in organizations.items():
        ledger = UsageRecord.objects.filter(organization_id=organization.pk).aggregate(
            requests=Count("id"), prompt_tokens=Sum("prompt_tokens"), cached_tokens=Sum("cached_tokens"),
            completion_tokens=Sum("completion_tokens"), cost=Sum("cost"))
        rollup_rows = list(UsageRollup.objects.filter(organization_id=organization.pk))
        rollups = {"requests": sum(r.num_requests for r in rollup_rows),
                   **{name: sum(getattr(r, name) for r in rollup_rows)
                      for name in ("prompt_tokens", "cached_tokens", "completion_tokens", "cost")}}
        ledger = {name: value or 0 for name, value in ledger.items()}
        account = BillingAccount.objects.get(organization_id=organization.pk)
        customer = account.stripe_customer_id
        stripe_meters = {meter.rollup_field: meter_totals.get((customer, meter.event_name), 0) for meter in METERS}
        rollup_meters = {meter.rollup_field: sum(getattr(r, meter.rollup_field) for r in rollup_rows
                                                 if r.billing_mode == "postpaid") for meter in METERS}
        spend = ledger["cost"]
        outcomes = Counter(a["outcome"] for a in answers if a["org"] == label)
        refused = sorted(a["at"] for a in answers if a["org"] == label and a["outcome"] == "refused_by_cap")
        entry = {
            "billing_mode": account.mode,
            "requests": dict(outcomes),
            "first_refused_by_cap_at_s": round(refused[0] - min(a["at"] for a in answers), 1) if refused else None,
            "ledger": {k: str(v) for k, v in ledger.items()},
            "rollups": {k: str(v) for k, v in rollups.items()},
            "ledger_equals_rollups": all(ledger[k] == rollups[k] for k in rollups),
            "spend": str(spend),
        }
        if account.mode == "postpaid":
            entry |= {
                "stripe_meter_events": stripe_meters,
                "rollups_as_metered": rollup_meters,
                "rollups_equal_stripe": stripe_meters == rollup_meters,
                "ledger_micro_dollars": str(spend * 1_000_000),
                "ledger_equals_stripe_cost": spend * 1_000_000 == stripe_meters[COST_METER.rollup_field],
                "unpushed_closed_rollups": UsageRollup.objects.filter(organization_id=organization.pk)
                .pushable().count(),
            }
        else:
            draw_credits(organization.pk)
            grants = CreditGrant.objects.filter(organization_id=organization.pk).aggregate(
                amount=Sum("amount"), consumed=Sum("consumed"))
            entry |= {
                "credit": str(grants["amount"]), "credit_consumed": str(grants["consumed"]),
                "spend_within_credit": spend <= grants["amount"],
                "meter_events_in_stripe": sum(v for (c, _), v in meter_totals.items() if customer and c == customer),
                "meter_event_pushes_recorded": MeterEventPush.objects.filter(
                    rollup__organization_id=organization.pk).count(),
            }
        if account.spend_cap is not None:
            entry |= {"spend_cap": str(account.spend_cap), "cap_overshoot": str(max(Decimal(0), spend - account.spend_cap))}
        per_org[label] = entry

    overshoot = sum(Decimal(e.get("cap_overshoot", "0")) for e in per_org.values())
    overshoot += sum(max(Decimal(0), Decimal(e["spend"]) - Decimal(e["credit"])) for e in per_org.values() if "credit" in e)
    return {
        "answered_with_a_ledger_row": len(rows),
        "tokens_lost": sum(answered[r]["prompt_tokens"] + answered[r]["completion_tokens"] for r in lost),
        "requests_lost": len(lost),
        "requests_with_other_tokens_in_the_ledger": len(mismatched),
        "client_seen_tokens": client_tokens,
        "ledger_tokens_of_answered": ledger_tokens_of_answered,
        "tokens_double_counted": max(0, ledger_tokens_of_answered - client_tokens),
        "books_closed_at": close_at.isoformat(),
        "stripe_duplicate_identifiers_refused": fake_stripe.num_duplicate_identifiers,
        "cap_and_credit_overshoot": str(overshoot),
        "ledger_equals_rollups": all(e["ledger_equals_rollups"] for e in per_org.values()),
        "ledger_equals_rollups_equals_stripe_postpaid": all(
            e["ledger_equals_rollups"] and e["rollups_equal_stripe"] and e["ledger_equals_stripe_cost"]
            for e in per_org.values() if e["billing_mode"] == "postpaid"),
        "prepaid_usage_in_stripe": sum(e["meter_events_in_stripe"] + e["meter_event_pushes_recorded"]
                                       for e in per_org.values() if e["billing_mode"] == "prepaid"),
        "organizations": per_org,
    }


def retire_earlier_runs() -> None:
    """Endpoints and nodes of earlier runs must not take this run's agent or CPU."""
    from django.utils import timezone

    from endpoints.models import Endpoint
    from endpoints.nodes.models import Node

    Endpoint.objects.filter(name__startswith="chaos-", paused_at__isnull=True).update(paused_at=timezone.now())
    Node.objects.filter(name__startswith="chaos-").exclude(state="OFFLINE").update(state="OFFLINE")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=180.0)
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "chaos.json"))
    options = parser.parse_args()

    # NOTE: the fake Stripe runs in this process; the platform's processes inherit its address.
    fake_stripe = FakeStripe().start()
    os.environ.update({"STRIPE_SECRET_KEY": "sk_test_chaos", "STRIPE_API_BASE": fake_stripe.base_url,
                       "STRIPE_RETRY_BASE_DELAY_S": "0.05"})
    subprocess.run([PYTHON, "manage.py", "migrate", "--verbosity", "0"], cwd=REPO, check=True)
    import django

    django.setup()
    from billing.credits import grant_credits
    from billing.models import BillingAccount, StripeMeter
    from billing.services import set_billing_mode, set_spend_cap
    from controlplane.accounts.services import SYSTEM
    from controlplane.accounts.signup import bootstrap_organization
    from endpoints.fleet.services import create_join_token
    from endpoints.models import Endpoint
    from endpoints.nodes.models import Node
    from gpu_agent.runtime.tiny_model import build_tiny_model

    retire_earlier_runs()
    # NOTE: each run has a new fake Stripe: forget the meters, price and customers an earlier run's made.
    StripeMeter.objects.all().delete()
    BillingAccount.objects.exclude(stripe_customer_id="").update(stripe_customer_id="", stripe_subscription_id="")
    suffix = datetime.now().strftime("%Y%m%d%H%M%S")
    organizations, keys = {}, {}
    for label, spec in ORGANIZATIONS.items():
        slug = f"chaos-{suffix}-{label}"
        organization, _owner, key = bootstrap_organization(slug=slug, owner_email=f"{slug}@example.com")
        if "credit" in spec:
            set_billing_mode(SYSTEM, organization, mode="prepaid")
            grant_credits(SYSTEM, organization, amount=spec["credit"], note="chaos benchmark")
        set_spend_cap(SYSTEM, organization, spend_cap=spec.get("spend_cap"))
        organizations[label], keys[label] = organization, key.plain
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
        endpoint_ids, targets = {}, {}
        for label, spec in ORGANIZATIONS.items():
            name = f"chaos-{suffix}-{label}"
            created = httpx.post(f"{stack.urls[0]}/api/v1/endpoints/", headers={"Authorization": f"Bearer {keys[label]}"},
                                 timeout=30, json={
                "name": name, "model_source": str(model_dir), "gpu_type": "cpu", "min_replicas": 1, "max_replicas": 1,
                "max_model_len": 512, "max_num_seqs": 16,
                # NOTE: below the clients' timeout: a request held while no replica is READY gets its 503.
                "cold_start_timeout_s": COLD_START_TIMEOUT_S,
            })
            created.raise_for_status()
            endpoint_ids[label] = created.json()["id"]
            # Prices are the operator's (read-only in the API); set before the first request reaches a gateway.
            price = spec["price_per_million"]
            Endpoint.objects.filter(pk=endpoint_ids[label]).update(
                price_input_per_million=price, price_cached_input_per_million=price, price_output_per_million=price)
            targets[label] = (keys[label], name)
        wait_until(lambda: all(Endpoint.objects.get(pk=pk).replicas.filter(state="READY").exists()
                               for pk in endpoint_ids.values()), 600, interval_s=1,
                   message="every endpoint's replica to be READY")
        clients = Clients(stack.urls, targets)
        began = time.time()
        clients.start()
        run_faults(stack, clients, endpoint_ids, options.duration_s, faults)
        clients.stop()
        ended = time.time()
        accounts = reconcile(clients.answers, organizations, work_dir, stack, fake_stripe)
    finally:
        stack.stop()
        retire_earlier_runs()
        fake_stripe.stop()

    outcomes = Counter(a["outcome"] for a in clients.answers)
    timeline = [[round(a["at"] - began, 2), a["org"], a["outcome"], a.get("detail", "")] for a in sorted(clients.answers, key=lambda a: a["at"])]
    for fault in faults:
        answered_after = [a["at"] for a in clients.answers
                          if a["org"] == MAIN and a["outcome"] == "answered" and a["at"] > fault["at"]]
        fault["next_answer_after_s"] = round(min(answered_after) - fault["at"], 2) if answered_after else None
    result = {
        "benchmark": "chaos",
        "measured_at": datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "num_cpus": os.cpu_count(),
                    "load_average": os.getloadavg()},
        "duration_s": round(ended - began, 1),
        "clients": {label: spec["clients"] for label, spec in ORGANIZATIONS.items()},
        "upstream": "tiny vLLM on CPU through a real agent",
        "faults": faults,
        "requests": {"total": len(clients.answers), **{k: outcomes.get(k, 0) for k in
                                                       ("answered", "failed_clean", "refused_by_cap", "cut", "broken", "hung")}},
        "failure_details": Counter(f"{a['org']}: {a.get('detail', '')}" for a in clients.answers
                                   if a["outcome"] != "answered").most_common(16),
        "accounts": accounts,
        "logs": str(work_dir),
        "timeline": timeline,
    }
    Path(options.output).parent.mkdir(parents=True, exist_ok=True)
    Path(options.output).write_text(json.dumps(result, indent=2, default=str) + "\n")
    requests = result["requests"]
    orgs = accounts["organizations"]
    print("\n| measure | result |\n|---|---:|")
    for label, value in [
        ("requests", requests["total"]), ("answered", requests["answered"]),
        ("failed with a clean error", requests["failed_clean"]),
        ("refused by a cap or the credit (402)", requests["refused_by_cap"]),
        ("cut by a killed process", requests["cut"]),
        ("broken (500 or malformed)", requests["broken"]), ("**hung**", requests["hung"]),
        ("**tokens lost**", accounts["tokens_lost"]), ("**tokens double-counted**", accounts["tokens_double_counted"]),
        ("**cap and credit overshoot**", f"${accounts['cap_and_credit_overshoot']}"),
        ("ledger = rollups = Stripe (postpaid)", accounts["ledger_equals_rollups_equals_stripe_postpaid"]),
        ("prepaid usage in Stripe", accounts["prepaid_usage_in_stripe"]),
        *[(f"{label} spend / {'credit' if 'credit' in e else 'cap'}",
           f"${e['spend']} / ${e.get('credit', e.get('spend_cap'))}") for label, e in orgs.items()],
    ]:
        print(f"| {label} | {value} |")
    print("\n| fault | restarted after | next answer after |\n|---|---:|---:|")
    for fault in faults:
        print(f"| {fault['fault']} | {fault.get('restarted_after_s', fault.get('error'))} s | {fault['next_answer_after_s']} s |")
    print(f"\nwrote {options.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
