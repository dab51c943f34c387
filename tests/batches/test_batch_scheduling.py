"""Scheduling batch work, decided by pure functions (no timing): fill only spare slots of READY replicas,
hold warm replicas the autoscaler would scale down while batch work is queued, and wake a sleeping
endpoint only when the deadline needs it; the autoscaler applies them and logs each decision."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.utils import timezone

from endpoints import autoscaler, scheduler
from endpoints.batches.models import Batch, BatchStatus, File
from endpoints.batches.scheduling import BatchDemand, apply, batch_slots, wake_at
from endpoints.models import EndpointEvent, EventKind, Replica
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory
from tests.gateway.conftest import serve_endpoint

NOW = 1_000_000.0
DAY = 86_400.0


def _endpoint(**overrides):
    spec = dict(paused_at=None, deleted_at=None, min_replicas=0, max_replicas=4, idle_timeout_s=300,
                target_concurrency=8, cold_start_timeout_s=300, prewarm_windows=[], keep_warm_after_cold_start_s=0,
                last_cold_start_at=None)
    return SimpleNamespace(**(spec | overrides))


def _idle_load():
    return autoscaler.Load(num_inflight=0, num_waiting=0, last_request_at=NOW - 3600, peak_concurrency=0)


def test_batch_lines_take_only_the_slots_interactive_work_leaves_free():
    assert batch_slots(num_ready=2, target_concurrency=8, num_outstanding=5, num_batch_in_flight=0) == 11
    # its own lines count as using the slots they hold
    assert batch_slots(num_ready=2, target_concurrency=8, num_outstanding=16, num_batch_in_flight=11) == 11
    assert batch_slots(num_ready=1, target_concurrency=8, num_outstanding=9, num_batch_in_flight=0) == 0
    assert batch_slots(num_ready=0, target_concurrency=8, num_outstanding=0, num_batch_in_flight=0) == 0


def test_an_idle_endpoint_about_to_scale_to_zero_keeps_its_warm_replica_while_batch_work_is_queued():
    endpoint = _endpoint()
    alone = autoscaler.decide(endpoint, _idle_load(), now=NOW)
    assert alone.desired == 0  # without batch work it would scale to zero

    held = autoscaler.decide(endpoint, _idle_load(), now=NOW, batch=BatchDemand(40, NOW + DAY), num_ready=2,
                             num_serving=2)
    assert held.desired == 2 and held.batch_rule == "hold"
    assert "holding 2 warm replica(s) for batch work: 40 line(s) pending" in held.reason


def test_the_hold_keeps_only_as_many_replicas_as_the_queue_needs_and_ends_with_it():
    endpoint = _endpoint()
    assert autoscaler.decide(endpoint, _idle_load(), now=NOW, batch=BatchDemand(3, NOW + DAY), num_ready=3,
                             num_serving=3).desired == 1
    assert autoscaler.decide(endpoint, _idle_load(), now=NOW, batch=BatchDemand(0, NOW + DAY), num_ready=3,
                             num_serving=3).desired == 0


def test_batch_work_never_scales_up_past_the_warm_replicas():
    decision = autoscaler.decide(_endpoint(), _idle_load(), now=NOW, batch=BatchDemand(10_000, NOW + DAY), num_ready=1,
                                 num_serving=1)
    assert decision.desired == 1


def test_a_sleeping_endpoint_is_not_woken_while_the_deadline_leaves_time():
    endpoint = _endpoint()
    demand = BatchDemand(80, NOW + DAY)
    decision = autoscaler.decide(endpoint, _idle_load(), now=NOW, batch=demand)
    assert decision.desired == 0 and decision.batch_rule == "wait"
    assert "waits for warm capacity" in decision.reason


def test_a_sleeping_endpoint_wakes_once_the_deadline_needs_it():
    endpoint = _endpoint()
    demand = BatchDemand(80, NOW + DAY)
    # 80 lines x 2 s / 8 slots = 20 s of work, 300 s cold start allowance, safety factor 2: 640 s before the deadline.
    wake = wake_at(demand, target_concurrency=8, cold_start_s=300, seconds_per_line=2.0)
    assert wake == NOW + DAY - 640
    assert autoscaler.decide(endpoint, _idle_load(), now=wake - 1, batch=demand).desired == 0
    woken = autoscaler.decide(endpoint, _idle_load(), now=wake, batch=demand)
    assert woken.desired == 1 and woken.batch_rule == "wake" and "woken for batch work" in woken.reason


def test_a_starting_endpoint_and_interactive_load_are_left_to_the_interactive_rule():
    busy = autoscaler.Load(num_inflight=20, num_waiting=0, last_request_at=NOW, peak_concurrency=20)
    decision = autoscaler.decide(_endpoint(), busy, now=NOW, batch=BatchDemand(5, NOW + 60), num_ready=2, num_serving=3)
    assert decision.desired == 3 and decision.batch_rule == ""
    starting = apply(0, "idle", demand=BatchDemand(5, NOW), num_ready=0, num_serving=1, target_concurrency=8,
                     max_replicas=4, cold_start_s=300, seconds_per_line=2, now=NOW)
    assert starting.desired == 0 and starting.rule == ""


def test_a_paused_endpoint_takes_no_batch_work():
    decision = autoscaler.decide(_endpoint(paused_at=NOW), _idle_load(), now=NOW, batch=BatchDemand(5, NOW),
                                 num_ready=1, num_serving=1)
    assert decision.desired == 0


@pytest.mark.django_db
def test_the_tick_holds_a_warm_replica_for_batch_work_and_logs_the_decision_once():
    endpoint = serve_endpoint(EndpointFactory().organization, "http://127.0.0.1:9")
    input_file = File.objects.create(organization=endpoint.organization, purpose="batch", filename="in.jsonl", bytes=1,
                                     s3_key="files/x")
    Batch.objects.create(organization=endpoint.organization, endpoint=endpoint, request_path="/v1/chat/completions",
                         input_file=input_file, status=BatchStatus.IN_PROGRESS, num_total=30,
                         expires_at=timezone.now() + timedelta(hours=24))
    idle = {str(endpoint.pk): autoscaler.Load(0, 0, 0.0, 0)}  # idle since 1970: would scale to zero

    for _ in range(3):
        for endpoint_id in scheduler.endpoints_to_reconcile([str(endpoint.pk)], idle):
            scheduler.reconcile_endpoint(endpoint_id, idle[endpoint_id])

    assert Replica.objects.get(endpoint=endpoint).state == ReplicaState.READY  # not drained
    events = EndpointEvent.objects.filter(endpoint=endpoint, kind=EventKind.BATCH)
    assert [e.message[:40] for e in events] == ["Holding 1 warm replica(s) for batch work"]
