"""Batch work holds and wakes only the replicas it can use: what its keys may send (`requests_per_minute`), and
nothing while every try of its lines is refused (rvwake F2: a key of 1 request a minute and a 50,000-line batch
kept `max_replicas` READY replicas for its 24 h, ~1,440 one-token lines billed a day)."""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from django.utils import timezone

from controlplane.accounts.models import ApiKey
from endpoints import autoscaler, scheduler
from endpoints.batches import runner, services
from endpoints.batches.demand import read_demand
from endpoints.batches.models import Batch, BatchStatus, File
from endpoints.batches.runner import RETRY_STATUSES
from endpoints.batches.scheduling import (
    STALL_FORGOTTEN_S,
    STALL_S,
    USE_WINDOW_S,
    BatchDemand,
    LineUse,
    wake_at,
)
from endpoints.models import Replica
from gpu_agent.protocol import ReplicaState
from tests.batches.conftest import new_batch, one_chat_line
from tests.factories import EndpointFactory, UserFactory
from tests.gateway.conftest import serve_endpoint

NOW = 1_000_000.0
DAY = 86_400.0
IDLE = autoscaler.Load(0, 0, None, 0)


def _endpoint(**overrides):
    spec = dict(paused_at=None, deleted_at=None, min_replicas=0, max_replicas=4, idle_timeout_s=300,
                target_concurrency=1, cold_start_timeout_s=300, prewarm_windows=[], keep_warm_after_cold_start_s=0,
                last_cold_start_at=None)
    return SimpleNamespace(**(spec | overrides))


def test_a_batch_whose_key_sends_a_line_a_minute_neither_wakes_an_endpoint_nor_holds_its_replicas():
    # Before: woken at once from zero ("woken for batch work: 50000 line(s) pending") and 4 READY replicas held
    # ("hold") 80,000 s on with 48,600 lines pending: desired (1, 4).
    assert 429 in RETRY_STATUSES  # a line its key's minute refused stays pending, tried again until the batch expires
    endpoint = _endpoint()
    a_line_a_minute = 1 / 60
    woken = autoscaler.decide(endpoint, IDLE, now=NOW, batch=BatchDemand(50_000, NOW + DAY, a_line_a_minute))
    held = autoscaler.decide(endpoint, IDLE, now=NOW + 80_000, batch=BatchDemand(48_600, NOW + DAY, a_line_a_minute),
                             num_ready=4, num_serving=4)
    assert (woken.desired, held.desired) == (0, 0), (woken, held)
    assert woken.batch_rule == "wait" and "too few to keep a replica busy" in woken.reason


def test_the_hold_keeps_only_the_replicas_the_keys_can_keep_busy():
    # Before: all 4 READY replicas held for 48,600 pending lines whose key sends 4 a second (8 in flight at 2 s each).
    endpoint = _endpoint(target_concurrency=8)
    held = autoscaler.decide(endpoint, IDLE, now=NOW, batch=BatchDemand(48_600, NOW + DAY, 4.0), num_ready=4,
                             num_serving=4)
    assert held.desired == 1 and held.batch_rule == "hold"
    unlimited = autoscaler.decide(endpoint, IDLE, now=NOW, batch=BatchDemand(48_600, NOW + DAY), num_ready=4,
                                  num_serving=4)
    assert unlimited.desired == 4


def test_a_run_measures_the_lines_it_keeps_in_flight_and_not_those_refused():
    use = LineUse(began_at=0.0)
    for n in range(600):  # 10 one-token lines a second for a minute, 0.05 s each
        use.ended(n / 10, n / 10 + 0.05)
    assert use.concurrency(60.0, []) == pytest.approx(0.5)
    # refused lines are never `ended`; a line still running counts from its start
    assert use.concurrency(60.0, [30.0]) == pytest.approx(1.0)
    assert use.concurrency(200.0, []) == 0  # nothing in the last minute


def test_the_hold_keeps_no_more_replicas_than_the_lines_its_runs_kept_in_flight():
    # Before: the default key's 600 requests a minute (10 lines a second x 2 s: 20 in flight) held all 4 READY
    # replicas at target 1 for one-token lines that kept half a slot busy.
    endpoint = _endpoint()
    held = autoscaler.decide(endpoint, IDLE, now=NOW, batch=BatchDemand(48_600, NOW + DAY, 10.0, 0.5), num_ready=4,
                             num_serving=4)
    assert held.desired == 1 and held.batch_rule == "hold"
    idle_lately = autoscaler.decide(endpoint, IDLE, now=NOW, batch=BatchDemand(48_600, NOW + DAY, 10.0, 0.0),
                                    num_ready=4, num_serving=4)
    assert idle_lately.desired == 1  # one kept while the work may use it: a run needs a replica to measure
    busy = autoscaler.decide(_endpoint(target_concurrency=8), IDLE, now=NOW,
                             batch=BatchDemand(48_600, NOW + DAY, None, 30.0), num_ready=4, num_serving=4)
    assert busy.desired == 4


def test_the_wake_allows_for_a_key_slower_than_the_replica():
    # 80 lines at a line a second take 80 s, not the 20 s 8 slots would: woken 2 x 60 s earlier than before
    slow = BatchDemand(80, NOW + DAY, 1.0)
    assert wake_at(slow, target_concurrency=8, cold_start_s=300, seconds_per_line=2.0) == NOW + DAY - 2 * (300 + 80)
    assert wake_at(BatchDemand(80, NOW + DAY), target_concurrency=8, cold_start_s=300,
                   seconds_per_line=2.0) == NOW + DAY - 2 * (300 + 20)


def test_a_batch_of_a_key_too_slow_to_keep_a_replica_busy_still_wakes_its_endpoint_for_its_deadline():
    # Before (rvrv5): 1,000 lines of a 59 rpm key, 10 minutes before the deadline: desired 0, rule "wait" for ever (the
    # runner starts no line through a cold start): on a scale-to-zero endpoint the batch expired with no line run.
    endpoint = _endpoint(target_concurrency=8)  # the model's default target concurrency: any key under 60 rpm
    demand = BatchDemand(1_000, NOW + DAY, 59 / 60)  # 1,017 s of work at the key's rate
    due = NOW + DAY - 300 - 1_000 / (59 / 60)  # deadline - cold start - work
    early = autoscaler.decide(endpoint, IDLE, now=due - 1, batch=demand)
    assert (early.desired, early.batch_rule) == (0, "wait")
    ten_min_left = autoscaler.decide(endpoint, IDLE, now=NOW + DAY - 600, batch=demand)
    assert (ten_min_left.desired, ten_min_left.batch_rule) == (1, "wake"), ten_min_left
    # once woken it keeps one replica, not more, while the work is due; before it is due a warm one goes as before
    held = autoscaler.decide(endpoint, IDLE, now=due, batch=demand, num_ready=4, num_serving=4)
    assert (held.desired, held.batch_rule) == (1, "hold")
    assert autoscaler.decide(endpoint, IDLE, now=due - 1, batch=demand, num_ready=1, num_serving=1).desired == 0


def _batch(endpoint, *, api_key=None, user=None, num_total=50_000, **fields):
    input_file = File.objects.create(organization=endpoint.organization, purpose="batch", filename="in.jsonl", bytes=1,
                                     s3_key=f"files/{secrets.token_hex(4)}")
    return Batch.objects.create(organization=endpoint.organization, endpoint=endpoint, api_key=api_key,
                                created_by=user, request_path="/v1/chat/completions", input_file=input_file,
                                status=BatchStatus.IN_PROGRESS, num_total=num_total,
                                expires_at=timezone.now() + timedelta(hours=24), **fields)


def _key(organization, rpm):
    return ApiKey.objects.create(organization=organization, name="k", lookup=secrets.token_hex(6), digest="x",
                                 requests_per_minute=rpm)


@pytest.mark.django_db
def test_the_demand_counts_each_callers_requests_per_minute_once(settings):
    settings.DEFAULT_KEY_REQUESTS_PER_MINUTE = 600
    endpoint = EndpointFactory()
    key = _key(endpoint.organization, 1)
    _batch(endpoint, api_key=key)
    _batch(endpoint, api_key=key)  # the same key's minute: shared
    assert read_demand([str(endpoint.pk)])[str(endpoint.pk)] == BatchDemand(100_000, pytest.approx(
        time.time() + DAY, abs=60), 1 / 60)
    _batch(endpoint, user=UserFactory())  # a member's batch: the platform's default
    assert read_demand([str(endpoint.pk)])[str(endpoint.pk)].max_lines_per_s == pytest.approx(601 / 60)
    settings.DEFAULT_KEY_REQUESTS_PER_MINUTE = 0  # none
    assert read_demand([str(endpoint.pk)])[str(endpoint.pk)].max_lines_per_s is None


@pytest.mark.django_db
def test_the_demand_sums_the_lines_in_flight_its_runs_measured_lately():
    endpoint = EndpointFactory()
    now = time.time()
    moment = lambda unix: datetime.fromtimestamp(unix, UTC)  # noqa: E731
    _batch(endpoint, line_concurrency=0.5, line_concurrency_at=moment(now - 1))
    _batch(endpoint, line_concurrency=2.0, line_concurrency_at=moment(now - 2))
    _batch(endpoint, line_concurrency=9.0, line_concurrency_at=moment(now - USE_WINDOW_S - 1))  # too old: not counted
    assert read_demand([str(endpoint.pk)], now=now)[str(endpoint.pk)].line_concurrency == 2.5
    assert read_demand([str(endpoint.pk)], now=now + USE_WINDOW_S)[str(endpoint.pk)].line_concurrency is None


@pytest.mark.django_db
def test_a_batch_refused_at_every_try_for_five_minutes_is_left_out_of_the_demand_until_it_progresses():
    endpoint = EndpointFactory()
    now = time.time()
    moment = lambda unix: datetime.fromtimestamp(unix, UTC)  # noqa: E731
    batch = _batch(endpoint, refused_since=moment(now - STALL_S - 1), last_refused_at=moment(now - 1))
    assert read_demand([str(endpoint.pk)], now=now) == {}
    # not tried for an hour since (no READY replica): its deadline may wake the endpoint again
    assert str(endpoint.pk) in read_demand([str(endpoint.pk)], now=now + STALL_FORGOTTEN_S)
    Batch.objects.filter(pk=batch.pk).update(refused_since=None)  # a line finished since
    assert str(endpoint.pk) in read_demand([str(endpoint.pk)], now=now)
    Batch.objects.filter(pk=batch.pk).update(refused_since=moment(now - 60))  # refused for a minute only
    assert str(endpoint.pk) in read_demand([str(endpoint.pk)], now=now)


@pytest.mark.django_db
def test_the_tick_lets_go_of_replicas_a_batch_of_a_line_a_minute_cannot_use():
    # Before: the 4 READY replicas stayed READY, held for the batch ("Holding 4 warm replica(s) for batch work").
    endpoint = serve_endpoint(EndpointFactory().organization, *["http://127.0.0.1:9"] * 4, max_replicas=4,
                              target_concurrency=1)
    _batch(endpoint, api_key=_key(endpoint.organization, 1))
    idle = {str(endpoint.pk): autoscaler.Load(0, 0, 0.0, 0)}  # idle since 1970: would scale to zero

    for _ in range(3):
        for endpoint_id in scheduler.endpoints_to_reconcile([str(endpoint.pk)], idle):
            scheduler.reconcile_endpoint(endpoint_id, idle[endpoint_id])

    assert not Replica.objects.filter(endpoint=endpoint, state=ReplicaState.READY).exists()


@pytest.mark.django_db(transaction=True)
def test_a_run_records_since_when_its_lines_are_refused_and_forgets_it_once_one_finishes(
        files_bucket, tenant, start_mock_upstream, monkeypatch, settings):
    # Before: the batch kept no trace of its refusals (no `refused_since`): its refused lines counted as demand.
    monkeypatch.setattr(runner, "RETRY_PAUSE_S", 0.1)
    settings.BATCH_RUN_SLICE_S = 3
    settings.DEFAULT_KEY_REQUESTS_PER_MINUTE = 1  # the member's: one line a minute, the next ones 429
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    batch = new_batch(endpoint, b"".join(one_chat_line(endpoint).replace(b'"only"', f'"l{n}"'.encode())
                                         for n in range(3)))
    # NOTE: the limit counts by the clock's minutes: a run slice (3 s) across a minute's end ran one line in each
    # minute (2 completed, a failure of the test by the time of day). Start it clear of the minute's end.
    if (seconds_into_minute := time.time() % 60) > 50:
        time.sleep(60.5 - seconds_into_minute)
    started = time.time()

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.IN_PROGRESS, 1, 0)
    assert started <= batch.refused_since.timestamp() < batch.last_refused_at.timestamp() <= time.time()

    settings.DEFAULT_KEY_REQUESTS_PER_MINUTE = 0  # no limit: the lines run
    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.refused_since) == (BatchStatus.COMPLETED, 3, None)
    assert batch.line_concurrency > 0 and batch.line_concurrency_at.timestamp() <= time.time()


def test_refusals_with_no_try_between_them_for_five_minutes_are_two_streaks():
    # Before this rule a 503 hours ago, the endpoint asleep since, made the first refusal after its wake a stall.
    now = time.time()
    long_ago = runner.Progress(num_completed=0, num_failed=0, refused_since=now - 4 * STALL_S,
                               last_refused_at=now - 3 * STALL_S)
    long_ago.refused()
    assert long_ago.refused_since == long_ago.last_refused_at >= now
    going_on = runner.Progress(num_completed=0, num_failed=0, refused_since=now - 10, last_refused_at=now - 1)
    going_on.refused()
    assert going_on.refused_since == now - 10 and going_on.last_refused_at >= now


@pytest.mark.django_db(transaction=True)
def test_a_batch_whose_key_cannot_wake_its_endpoint_says_so_rather_than_a_wake_time(files_bucket, tenant, settings):
    # Before: "... does not wake the endpoint before <its deadline's time>", a wake the autoscaler never makes.
    from endpoints.models import EndpointEvent, EventKind

    settings.DEFAULT_KEY_REQUESTS_PER_MINUTE = 1
    endpoint = EndpointFactory(organization=tenant.org, target_concurrency=8)  # asleep: no replica
    batch = new_batch(endpoint, one_chat_line(endpoint) * 1 + one_chat_line(endpoint).replace(b'"only"', b'"two"'))

    assert services.run_batch(batch.pk) == "cold"

    [event] = EndpointEvent.objects.filter(endpoint=endpoint, kind=EventKind.BATCH, message__contains="waits")
    assert "too few lines a minute to keep a replica busy" in event.message and "before" not in event.message
