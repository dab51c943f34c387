"""Fault test: SIGKILL real Celery workers 40 times during rollups and Stripe pushes.

Four prefork workers run the billing tasks while the test keeps feeding them work, writes late
usage into closed hours, injects Stripe failures, and kills a worker that is running a task:
mostly its pool process (the master requeues the task), every tenth time the whole worker, master
and all. Then a fresh worker finishes. (`bench/bench_chaos.py` kills far more, with gateways too.) The ledger, the rollups and the fake Stripe's meters must agree to the token,
with nothing pushed twice.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import signal
import sys
import time
from collections import Counter
from datetime import timedelta
from decimal import Decimal

import psutil
import pytest
from django.db.models import F, Sum
from django.utils import timezone

from billing.ledger import record_usage_batch, supersede_lost_rows
from billing.models import BillingAccount, MeterEventPush, RollupKind, UsageRecord, UsageRollup
from controlplane.celery_app import app as celery_app
from controlplane.redis_client import get_redis
from tests.billing.conftest import usage_report
from tests.conftest import ChildProcess, child_env, wait_until
from tests.factories import EndpointFactory, OrganizationFactory
from tests.fakes.stripe_server import FakeStripe

NUM_KILLS = 20  # bench/bench_chaos.py kills far more; here enough for both tasks to be killed mid-run
NUM_WORKERS = 4
WHOLE_WORKER_EVERY = 10
MIN_ROLLUP_KILLS, MIN_PUSH_KILLS = NUM_KILLS // 20, NUM_KILLS // 5  # each kind's share of the kills
# A deadline for the chaos, not a speed to meet: on an idle machine it takes about a minute.
CHAOS_DEADLINE_S = 600


def _start_worker(tmp_path, env, number: int) -> ChildProcess:
    return ChildProcess(
        [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "--pool=prefork", "--concurrency=1",
         "--loglevel=INFO", "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", f"chaos{number}@%h"],
        env, tmp_path / f"worker-{number}.log",
    )


_TASK_EVENT = re.compile(r"Task (billing\.\w+)\[[^\]]+\] received|succeeded in|raised|exited with 'signal 9")


def _running_task(worker: ChildProcess) -> str | None:
    """The task the worker's pool process runs now, read from its log (one task at a time)."""
    events = list(_TASK_EVENT.finditer(worker.log_tail(200_000)))
    return events[-1].group(1) if events else None


def _kill_pool_process(worker: ChildProcess) -> bool:
    try:
        children = psutil.Process(worker.pid).children()
    except psutil.NoSuchProcess:
        return False
    for child in children:
        try:
            if child.status() == psutil.STATUS_ZOMBIE:  # killed already, not yet reaped by its master
                continue
            child.send_signal(signal.SIGKILL)
            return True
        except psutil.NoSuchProcess:
            continue
    return False


def _late_usage(endpoints, rng, count: int):
    now = timezone.now().replace(minute=0, second=0, microsecond=0)
    reports = [
        usage_report(rng.choice(endpoints), finished_at=now - timedelta(hours=rng.randint(1, 30), minutes=rng.randint(0, 59)),
                     prompt_tokens=rng.randint(1, 2000), cached_tokens=0, completion_tokens=rng.randint(0, 500))
        for _ in range(count)
    ]
    for report in reports[: count // 3]:
        report.cached_tokens = report.prompt_tokens // 2
    record_usage_batch(reports)


def _lost_then_superseded(endpoints, rng, lost: list, count: int):
    """Supersede the `gateway_lost` rows written before by their calls' own rows, which say every prompt token was a
    prefix-cache hit (cheaper: an adjustment of negative cost and input tokens where the hour closed), and write
    `count` new ones (a lost gateway's progress knows no cache hits)."""
    supersede_lost_rows([dataclasses.replace(report, status="ok", cached_tokens=report.prompt_tokens,
                                             completion_tokens=report.completion_tokens + 1) for report in lost])
    now = timezone.now().replace(minute=0, second=0, microsecond=0)
    lost[:] = [usage_report(rng.choice(endpoints), status="gateway_lost", prompt_tokens=rng.randint(1000, 2000),
                            finished_at=now - timedelta(hours=rng.randint(1, 30), minutes=rng.randint(0, 59)))
               for _ in range(count)]
    record_usage_batch(lost)


def _feed(*, full_rollup: bool, queue_depth: int = 2):
    if get_redis().llen("celery") < queue_depth:
        # A full rollup recomputes every hour from the ledger: long enough for kills to land inside.
        celery_app.send_task("billing.rollup_usage", kwargs={"full": full_rollup})
        celery_app.send_task("billing.push_pending_rollups")


@pytest.mark.heavy
@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(CHAOS_DEADLINE_S + 900)
def test_killing_workers_during_rollups_and_pushes_loses_nothing_and_bills_nothing_twice(tmp_path):
    rng = random.Random(6)
    fake = FakeStripe(latency_s=0.02).start()
    env = child_env() | {
        "STRIPE_SECRET_KEY": "sk_test_chaos", "STRIPE_API_BASE": fake.base_url, "STRIPE_TIMEOUT_S": "3",
        "STRIPE_RETRY_BASE_DELAY_S": "0.01", "INFERPLANE_BILLING_CLAIM_TIMEOUT_S": "1",
        "INFERPLANE_ROLLUP_CLOSE_AFTER_S": "0",
        # NOTE: a killed worker's push run holds off the next for its lock's life (30 s by default, renewed every
        # 10 s while it runs): a few seconds here, so the chaos's kills are not followed by pushes that wait it out.
        "INFERPLANE_BILLING_PUSH_RUN_LOCK_S": "3",
    }
    organizations = [OrganizationFactory(), OrganizationFactory()]
    # A cached input token cheaper than an uncached one: a superseding row that says so costs less.
    endpoints = [EndpointFactory(organization=org, price_input_per_million=Decimal("1"),
                                 price_cached_input_per_million=Decimal("0.1"), price_output_per_million=Decimal("2"))
                 for org in organizations for _ in range(2)]
    for _ in range(30):  # enough that a full rollup takes a while
        _late_usage(endpoints, rng, 2000)
    lost: list = []
    _lost_then_superseded(endpoints, rng, lost, 20)

    # NOTE: several workers at once: a master notices a killed pool process only at its next
    # pool check (up to 5 s), and the others work meanwhile; they also race for the same rollups.
    worker_numbers = itertools.count()
    workers = [_start_worker(tmp_path, env, next(worker_numbers)) for _ in range(NUM_WORKERS)]
    killed_during: Counter[str] = Counter()
    num_rounds = 0
    try:
        started = time.monotonic()
        # NOTE: until each kind of task has its share of the kills, not only until NUM_KILLS: on a quiet machine
        # the short pushes are rarely caught running, and a run that stopped at NUM_KILLS could miss them.
        while (sum(killed_during.values()) < NUM_KILLS or killed_during["billing.rollup_usage"] < MIN_ROLLUP_KILLS
               or killed_during["billing.push_pending_rollups"] < MIN_PUSH_KILLS):
            num_rounds += 1
            _feed(full_rollup=num_rounds % 2 == 0, queue_depth=2 * NUM_WORKERS)
            if num_rounds % 2 == 0:
                _late_usage(endpoints, rng, 20)  # late rows for closed hours: adjustments to push
                _lost_then_superseded(endpoints, rng, lost, 5)  # and cheaper supersedes: negative adjustments
            if num_rounds % 9 == 0:
                fake.fail_next(rng.choice(["500", "429", "timeout"]), times=rng.randint(1, 3))
            time.sleep(rng.uniform(0.02, 0.2))
            for index in rng.sample(range(NUM_WORKERS), NUM_WORKERS):
                worker = workers[index]
                # Only a pool process that is running a task is killed: that is the fault under test.
                task = _running_task(worker)
                if task is None:
                    if worker.process.poll() is not None:  # it died on its own: replace it, no kill counted
                        worker.stop()
                        workers[index] = _start_worker(tmp_path, env, next(worker_numbers))
                    continue
                if sum(killed_during.values()) % WHOLE_WORKER_EVERY == WHOLE_WORKER_EVERY - 1:
                    # The whole worker, master and all; its successor boots while the loop goes on.
                    worker.kill(signal.SIGKILL)
                    worker.stop()
                    workers[index] = _start_worker(tmp_path, env, next(worker_numbers))
                elif not _kill_pool_process(worker):
                    continue
                killed_during[task] += 1
                break
            assert time.monotonic() - started < CHAOS_DEADLINE_S, f"only {dict(killed_during)} kills in {CHAOS_DEADLINE_S} s"
        chaos_s = time.monotonic() - started
    finally:
        for worker in workers:
            worker.kill(signal.SIGKILL)
            worker.stop()

    # A fresh worker finishes everything. Stripe answers at once now: its latency only had to make the kills land
    # inside pushes (a push left ~240 rollups, ~1,000 meter events, to the fresh worker: 20 ms each was ~30 s).
    # NOTE: the "timeout" failures the chaos queued and did not use meet the fresh worker: each holds its answer
    # until the client's timeout, 0.5 s here (3 s was ~18 s of the fresh worker's run, 1 s still ~12 s: a dozen of
    # them met its first customer creations); a slow answer is one more timeout, retried with its idempotency key
    # like the injected ones (an answer of the fake at rest takes ~20 ms on a loaded 2-core machine).
    fake.latency_s = 0.0
    celery_app.control.purge()
    final_env = env | {"INFERPLANE_BILLING_CLAIM_TIMEOUT_S": "0.5", "STRIPE_TIMEOUT_S": "0.5"}
    final = _start_worker(tmp_path, final_env, next(worker_numbers))
    try:
        def finished():
            # NOTE: generous: the fresh worker may still be booting, and a full rollup is long.
            rollup = celery_app.send_task("billing.rollup_usage").get(timeout=300)
            pushed = celery_app.send_task("billing.push_pending_rollups").get(timeout=300)
            changed = rollup["created"] + rollup["updated"] + rollup["adjustments"] + rollup["closed"]
            return changed == 0 and pushed == 0 and not UsageRollup.objects.pushable().exists()

        # Claims of killed pushes go stale after 0.5 s; until then `finished` stays false.
        wait_until(finished, 600, interval_s=0.5, message="the fresh worker to push every rollup")
        # NOTE: late rows for hours now closed are adjustments, pushed like any rollup. The chaos adds such rows
        # too, but a short chaos (its kills land fast on a quiet machine) may end before any hour it fed closed.
        _late_usage(endpoints, rng, 20)
        _lost_then_superseded(endpoints, rng, lost, 0)
        wait_until(finished, 600, interval_s=0.5, message="the fresh worker to push the adjustments")
    finally:
        final.stop()
        fake.stop()

    print(f"{NUM_KILLS} kills in {chaos_s:.0f}s ({num_rounds} rounds), by the task running: {dict(killed_during)}")

    # Ledger == rollups == Stripe, per organisation and meter.
    meters = fake.meter_totals()
    for organization in organizations:
        customer = BillingAccount.objects.get(organization=organization).stripe_customer_id
        ledger = UsageRecord.objects.filter(organization=organization).aggregate(
            input=Sum(F("prompt_tokens") - F("cached_tokens")), cached=Sum("cached_tokens"), output=Sum("completion_tokens"),
            cost=Sum("cost"))
        rollups = UsageRollup.objects.filter(organization=organization).aggregate(
            input=Sum(F("prompt_tokens") - F("cached_tokens")), cached=Sum("cached_tokens"), output=Sum("completion_tokens"),
            cost=Sum("cost"))
        stripe = {
            "input": meters.get((customer, "inferplane_input_tokens"), 0),
            "cached": meters.get((customer, "inferplane_cached_input_tokens"), 0),
            "output": meters.get((customer, "inferplane_output_tokens"), 0),
        }
        assert ledger == rollups
        assert stripe == {name: ledger[name] for name in ("input", "cached", "output")}
        # What Stripe bills: each rollup's cost, rounded to the micro-dollar once.
        assert meters.get((customer, "inferplane_usage_cost"), 0) == sum(
            rollup.cost_micro_dollars for rollup in UsageRollup.objects.filter(organization=organization))
    assert UsageRecord.objects.count() == UsageRollup.objects.aggregate(n=Sum("num_requests"))["n"]
    assert UsageRollup.objects.filter(kind=RollupKind.ADJUSTMENT).exists()
    assert UsageRollup.objects.filter(kind=RollupKind.ADJUSTMENT, cost__lt=0).exists()
    assert not UsageRecord.objects.filter(status="gateway_lost").exists()
    # Every accepted meter event is recorded once, and Stripe accepted nothing we do not know of.
    assert MeterEventPush.objects.count() == len(fake.meter_events)
    assert set(MeterEventPush.objects.values_list("identifier", flat=True)) == set(fake.meter_events)
    # One customer each, however often its creation was retried or its worker killed (a server error moves
    # to a new key: `stripe_sync.IdempotencyKey`; the chaos's 500s come before Stripe does any work).
    assert len(fake.calls_to("/v1/customers")) >= 2
    assert len(fake.subscriptions) == len(fake.customers) == 2 and len(fake.prices) == 1
    assert not fake.unexpected
    # Both kinds of task were killed mid-run, each a fair share of the kills.
    assert killed_during["billing.rollup_usage"] >= MIN_ROLLUP_KILLS and killed_during["billing.push_pending_rollups"] >= MIN_PUSH_KILLS
