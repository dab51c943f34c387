"""One clock for times that one process writes to Redis and another compares with "now": Redis's.

A gateway stamps an endpoint's last request, and its calls in flight, in Redis; the autoscaler tick, on a worker,
measures idleness from them; sweeps on any worker read what the last sweep wrote. Each with its own clock, a
worker whose clock stepped ahead (NTP, a VM resumed) scaled to zero endpoints used seconds before. Celery's task
expiry compares beat's clock with a worker's, which cannot be helped: each process checks its own against Redis's.
"""

import asyncio
import logging
import os
import re
import socket
import time
import types
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
import redis.exceptions
from celery.signals import task_revoked
from django.utils import timezone

from billing.quota import reads, sweeper
from controlplane import clock, embedded, redis_keys
from controlplane.redis_client import get_async_redis, get_redis, redis_time
from controlplane.tasks import ping
from endpoints import scheduler
from endpoints.gateway import admission, cold_start, errors, metrics, presence
from endpoints.gateway.auth import Caller
from endpoints.gateway.ratelimit_headers import RateLimitReport
from endpoints.models import Replica
from endpoints.nodes.models import Node
from gpu_agent.protocol import NodeState, ReplicaState
from tests.conftest import free_port, wait_until
from tests.factories import OrganizationFactory
from tests.gateway.conftest import serve_endpoint
from tests.gateway.test_ratelimit_headers import reset_s
from tests.test_placement import make_node

# NOTE: a missing spend counter is rebuilt in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)


def _idle_endpoint():
    """A serverless endpoint (scales to zero after 300 s idle) with one READY replica."""
    return serve_endpoint(OrganizationFactory(), f"http://127.0.0.1:{free_port()}", min_replicas=0,
                          idle_timeout_s=300)


def _clock_moved(monkeypatch, by_s: float) -> None:
    """This process's clock (a gateway's or a worker's) stepped `by_s` seconds from Redis's."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + by_s)


def _call(endpoint, *, ended: bool = True) -> None:
    """One call through the gateway's admission (and finish, if `ended`) scripts, on the endpoint's replica."""
    caller = Caller(organization_id=endpoint.organization_id, api_key_id=None, user_id=7, can_infer=True,
                    requests_per_minute=None, tokens_per_minute=None)
    replica_id = str(Replica.objects.get(endpoint=endpoint).pk)

    async def scenario():
        admitted = await admission.admit(caller=caller, endpoint_id=str(endpoint.pk), request_id=uuid.uuid4().hex,
                                         amount=Decimal("0.01"), num_tokens=20, candidates=[replica_id])
        if ended:
            await admission.finish(caller=caller, endpoint_id=str(endpoint.pk), admission=admitted, release=replica_id,
                                   num_tokens=20, cost=Decimal("0.001"))

    asyncio.run(scenario())


def _replica_state(endpoint) -> str:
    return Replica.objects.get(endpoint=endpoint).state


def test_a_worker_clock_ahead_keeps_an_endpoint_used_seconds_ago(monkeypatch):
    endpoint = _idle_endpoint()
    _call(endpoint)
    scheduler.autoscale_tick()
    assert _replica_state(endpoint) == ReplicaState.READY

    _clock_moved(monkeypatch, 400)  # the worker's clock stepped 400 s ahead, past the idle timeout
    scheduler.autoscale_tick()

    assert _replica_state(endpoint) == ReplicaState.READY


def test_a_worker_clock_ahead_reading_a_last_request_time_in_redis_keeps_the_endpoint(monkeypatch):
    # The review's case: a last request 10 s ago in Redis's time.
    endpoint = _idle_endpoint()
    get_redis().set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), redis_time() - 10)
    scheduler.autoscale_tick()
    assert _replica_state(endpoint) == ReplicaState.READY

    _clock_moved(monkeypatch, 400)
    scheduler.autoscale_tick()

    assert _replica_state(endpoint) == ReplicaState.READY


def test_a_gateway_clock_behind_keeps_an_endpoint_it_just_served(monkeypatch):
    endpoint = _idle_endpoint()
    with monkeypatch.context() as gateway:
        _clock_moved(gateway, -400)  # the gateway's clock, 400 s behind
        _call(endpoint)

    scheduler.autoscale_tick()

    assert _replica_state(endpoint) == ReplicaState.READY


def test_a_worker_clock_an_hour_ahead_still_sees_the_calls_in_flight(monkeypatch):
    # Entries older than `traffic.STALE_AFTER_S` (an hour) are a dead gateway's leftovers and not counted: a worker
    # clock an hour ahead read every call in flight as one, and the endpoint as idle under its streams.
    endpoint = _idle_endpoint()
    _call(endpoint, ended=False)

    _clock_moved(monkeypatch, 3700)
    scheduler.autoscale_tick()

    assert _replica_state(endpoint) == ReplicaState.READY


def test_an_idle_deadlines_reconcile_on_a_worker_clock_ahead_keeps_the_endpoint(monkeypatch):
    # The reconcile a tick schedules at an endpoint's idle deadline, or a cold request's, reads the load itself.
    endpoint = _idle_endpoint()
    _call(endpoint)

    _clock_moved(monkeypatch, 400)
    scheduler.reconcile_endpoint(str(endpoint.pk))

    assert _replica_state(endpoint) == ReplicaState.READY


def test_an_endpoint_idle_past_its_timeout_in_redis_time_still_scales_to_zero():
    endpoint = _idle_endpoint()
    get_redis().set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), redis_time() - 301)

    scheduler.autoscale_tick()

    assert _replica_state(endpoint) == ReplicaState.DRAINING


def test_a_silent_node_goes_offline_when_the_sweeps_alternate_between_workers_clocks_apart(
        settings, monkeypatch, django_capture_on_commit_callbacks):
    # Sweeps run on any worker. One whose clock is 30 s ahead of the last sweeper's read a gap in the sweeps (as if
    # PostgreSQL had been down) and gave every node time to beat again: with the workers taking turns, never judged.
    settings.NODE_HEARTBEAT_GRACE_S = 30
    node = make_node()
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()  # one worker: the node beats
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=60))

    _clock_moved(monkeypatch, 30)  # the next sweep, on a worker 30 s ahead
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()

    assert Node.objects.get(pk=node.pk).state == NodeState.OFFLINE


def test_a_worker_dropping_a_task_as_expired_on_a_clock_ahead_logs_an_error_and_metrics_show_it(monkeypatch, caplog):
    # Celery's `expires` is a time on beat's clock, judged by the worker's: a worker 30 s ahead dropped every run of
    # `sweep-stuck` (expires 10 s) unrun, saying so at INFO only.
    monkeypatch.setattr(clock._Checked, "at", float("-inf"))
    _clock_moved(monkeypatch, 30)

    task_revoked.send(sender=ping, request=None, terminated=False, signum=None, expired=True)

    errors = [record.getMessage() for record in caplog.records if record.levelno == logging.ERROR]
    assert len(errors) == 1 and "30.0 s ahead of Redis's (controlplane.ping dropped unrun as expired)" in errors[0]
    mine = f"worker:{socket.gethostname()}-{os.getpid()}"
    assert clock.recorded_skews()[mine] == pytest.approx(30, abs=1)
    metrics.refresh_fleet_gauges()
    shown = re.search(rf'^inferplane_clock_skew_seconds{{process="{re.escape(mine)}"}} (\S+)$', metrics.render().decode(),
                      re.MULTILINE)
    assert shown and float(shown.group(1)) == pytest.approx(30, abs=1)


def test_a_worker_within_a_second_of_redis_logs_nothing(caplog):
    assert abs(clock.check("worker")) < clock.SKEW_ERROR_S
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


def test_a_real_worker_compares_its_clock_with_redis_when_it_starts(celery_worker):
    wait_until(lambda: any(name.startswith("worker:") for name in clock.recorded_skews()), 60,
               message="the worker's clock check")


def test_a_worker_clock_past_a_running_calls_reservation_deadline_keeps_its_hold(monkeypatch, settings):
    # A call's hold on the caps and credit lapses at its deadline (its gateway died); the deadline was the gateway's
    # clock and the sweep judged it by the worker's: one a deadline's 15 minutes ahead let a caller spend it again.
    endpoint = _idle_endpoint()
    _call(endpoint, ended=False)

    _clock_moved(monkeypatch, settings.BILLING_RESERVATION_TTL_S + 60)
    assert sweeper.sweep_expired_reservations() == 0

    assert reads.reserved_now(endpoint.organization_id) == Decimal("0.01")


def test_a_gateway_clock_behind_holds_its_calls_reservations_their_whole_time(monkeypatch, settings):
    endpoint = _idle_endpoint()
    with monkeypatch.context() as gateway:
        _clock_moved(gateway, -settings.BILLING_RESERVATION_TTL_S - 60)
        _call(endpoint, ended=False)  # admitted
        monkeypatch.setattr(presence, "_extended", presence._Extended())
        monkeypatch.setattr(presence, "serving", {})
        presence.track("long", endpoint.organization_id, str(endpoint.pk), None)
        presence.serving["long"].since -= 120  # served for two minutes
        get_redis().zadd(redis_keys.deadlines_key(endpoint.organization_id), {"long": 1})

        async def beat():
            await presence._push_deadlines_on(get_async_redis())  # its deadline pushed on by the gateway's beat

        asyncio.run(beat())

    assert sweeper.sweep_expired_reservations() == 0
    assert reads.reserved_now(endpoint.organization_id) == Decimal("0.01")
    deadline = get_redis().zscore(redis_keys.deadlines_key(endpoint.organization_id), "long")
    assert deadline == pytest.approx(redis_time() + settings.BILLING_RESERVATION_TTL_S, abs=5)


def test_a_gateway_clock_ahead_counts_the_other_gateways_cold_start_places(monkeypatch):
    # An organisation's calls held for cold starts are bounded across gateways (`max_held_requests`); each place
    # lapsed at a time on the gateway's clock that took it, and a gateway 10 minutes ahead read the others' as lapsed.
    organization = OrganizationFactory()
    info = types.SimpleNamespace(id="e", name="m", organization_id=organization.pk, cold_start_timeout_s=60,
                                 max_held_requests=1)
    places = []

    async def take(request_id):
        places.append(await cold_start.take_place(info, organization.pk, request_id, call_token="c1"))

    async def give_up():
        for place in places:
            await cold_start.give_up(place)

    try:
        asyncio.run(take("first"))
        with monkeypatch.context() as gateway:
            _clock_moved(gateway, 600)  # another gateway
            with pytest.raises(errors.OpenAIError) as refused:
                asyncio.run(take("second"))
    finally:
        asyncio.run(give_up())

    assert refused.value.status == 429 and len(places) == 1


# --- the rate limits' minutes: Redis's, whichever gateway counts ---------------------------------------------------

REQUESTS_PER_MINUTE = 3


@pytest.fixture
def gateways(monkeypatch):
    """Gateway processes taking turns in this one (`_turn_of_gateway`), each beating as its turn begins: it reads its
    offset to Redis's clock, as a process does when it starts and on every beat after."""
    monkeypatch.setattr(presence, "serving", {})
    monkeypatch.setattr(presence, "unfinished", {})
    monkeypatch.setattr(presence, "_repair", presence._Repair())
    yield
    asyncio.run(presence.beat())  # NOTE: this process's offset read again on its own clock, for the tests after


def _way_to_another_minute() -> int:
    """Once 5 to 45 s into a minute (15 s of it left at least): 1 if a clock 40 s or 50 s ahead of Redis's is in
    another minute than Redis's, -1 if one behind is."""
    wait_until(lambda: 5 <= redis_time() % 60 <= 45, 45, message="a moment 5 to 45 s into a minute")
    return -1 if redis_time() % 60 < 30 else 1


def _limited_caller(endpoint) -> Caller:
    return Caller(organization_id=endpoint.organization_id, api_key_id=None, user_id=7, can_infer=True,
                  requests_per_minute=REQUESTS_PER_MINUTE, tokens_per_minute=None)


def _turn_of_gateway(monkeypatch, endpoint, *, clock_off_by_s: float, num_calls: int) -> tuple[int, float]:
    """A gateway whose clock is `clock_off_by_s` from Redis's beats, then makes `num_calls` calls of the limited
    caller: how many it admitted, and the `x-ratelimit-reset-requests` of its last answer (seconds)."""
    caller = _limited_caller(endpoint)
    replica_id = str(Replica.objects.get(endpoint=endpoint).pk)

    async def turn() -> tuple[int, RateLimitReport]:
        await presence.beat()
        num_admitted, report = 0, RateLimitReport()
        for _ in range(num_calls):
            report = RateLimitReport()
            try:
                admitted = await admission.admit(caller=caller, endpoint_id=str(endpoint.pk), report=report,
                                                 request_id=uuid.uuid4().hex, amount=Decimal("0.01"), num_tokens=20,
                                                 candidates=[replica_id])
            except errors.OpenAIError as refused:
                assert refused.status == 429
                continue
            num_admitted += 1
            await admission.finish(caller=caller, endpoint_id=str(endpoint.pk), admission=admitted,
                                   release=replica_id, num_tokens=20, cost=Decimal("0.001"))
        return num_admitted, report

    with monkeypatch.context() as gateway:
        _clock_moved(gateway, clock_off_by_s)
        num_admitted, report = asyncio.run(turn())
        reset = dict(report.headers())[b"x-ratelimit-reset-requests"].decode()
    return num_admitted, reset_s(reset)


def test_two_gateways_with_clocks_40_s_apart_count_a_keys_requests_in_one_minute(monkeypatch, gateways):
    # Each gateway took the minute from its own clock: two 40 s apart counted the same moment's calls in two minutes'
    # counters, so a key limited to 3 requests a minute had 3 admitted by each, and their reset headers disagreed.
    endpoint = _idle_endpoint()
    way = _way_to_another_minute()
    num_first, reset_first = _turn_of_gateway(monkeypatch, endpoint, clock_off_by_s=0, num_calls=3)
    num_second, reset_second = _turn_of_gateway(monkeypatch, endpoint, clock_off_by_s=40 * way, num_calls=3)

    assert (num_first, num_second) == (REQUESTS_PER_MINUTE, 0)
    assert reset_second == pytest.approx(reset_first, abs=1)
    assert reset_first == pytest.approx(60 - redis_time() % 60, abs=1)


def test_a_gateways_offset_to_redis_clock_holds_across_a_redis_restart(monkeypatch, gateways):
    # The offset is read again on every beat: a gateway whose clock stepped while Redis was down (NTP, a VM resumed)
    # counts in Redis's minute once Redis is back, as before it went.
    endpoint = _idle_endpoint()
    way = _way_to_another_minute()
    assert _turn_of_gateway(monkeypatch, endpoint, clock_off_by_s=40 * way, num_calls=2)[0] == 2

    embedded.stop_redis()
    try:
        with monkeypatch.context() as gateway, pytest.raises(redis.exceptions.ConnectionError):
            _clock_moved(gateway, 50 * way)
            asyncio.run(presence.beat())  # Redis down: the beat fails, the offset it had stands
    finally:
        embedded.ensure_redis()

    num_second, reset_second = _turn_of_gateway(monkeypatch, endpoint, clock_off_by_s=50 * way, num_calls=2)
    num_first, reset_first = _turn_of_gateway(monkeypatch, endpoint, clock_off_by_s=0, num_calls=2)

    assert (num_second, num_first) == (1, 0)  # 3 in Redis's minute, whichever gateway counted them
    assert reset_second == pytest.approx(reset_first, abs=1)


def test_a_gateway_clock_behind_stamps_its_endpoints_recent_traffic_in_redis_time(monkeypatch, gateways):
    # The tick lists endpoints with a request in the last day by Redis's clock; the gateway stamped them by its own.
    endpoint = _idle_endpoint()
    _turn_of_gateway(monkeypatch, endpoint, clock_off_by_s=-400, num_calls=1)

    asyncio.run(presence.beat())  # the next beat writes the endpoint's last request

    stamped = get_redis().zscore(redis_keys.RECENT_ENDPOINTS_KEY, str(endpoint.pk))
    assert stamped == pytest.approx(redis_time(), abs=5)


def test_a_gateway_clock_ahead_records_its_skew_for_metrics_and_logs_an_error(monkeypatch, caplog, gateways):
    # A gateway's usage rows and its calls' billing months follow its own clock: its skew is on `/metrics` as the
    # Celery processes' is, from the offset its beat reads (no other round trip), once a minute.
    monkeypatch.setattr(clock._Checked, "at", float("-inf"))
    monkeypatch.setattr(clock, "_offset", clock._Offset())
    mine = f"gateway:{socket.gethostname()}-{os.getpid()}"
    try:
        with monkeypatch.context() as gateway:
            _clock_moved(gateway, 30)
            asyncio.run(presence.beat())
            asyncio.run(presence.beat())  # within the minute: recorded once
        errors = [record.getMessage() for record in caplog.records if record.levelno == logging.ERROR]
        assert len(errors) == 1 and "this gateway's clock is 30.0 s ahead of Redis's" in errors[0]
        assert clock.recorded_skews()[mine] == pytest.approx(30, abs=1)
        metrics.refresh_fleet_gauges()
        # NOTE: the skew is measured against Redis's clock a round trip away: 29.998 on a loaded machine
        shown = re.search(rf'^inferplane_clock_skew_seconds{{process="{re.escape(mine)}"}} (\S+)$', metrics.render().decode(),
                          re.MULTILINE)
        assert shown and float(shown.group(1)) == pytest.approx(30, abs=1)
    finally:
        get_redis().hdel(redis_keys.CLOCK_SKEWS_KEY, mine)


def test_a_slow_reading_of_redis_clock_keeps_a_tighter_offset_and_a_contradicting_one_replaces_it(monkeypatch):
    monkeypatch.setattr(clock, "_offset", clock._Offset())
    clock.note_redis_time(100.0, 140.001, 100.002)  # 40 s behind Redis, read in 2 ms
    clock.note_redis_time(200.0, 240.5, 201.0)  # a stalled loop: read in 1 s, agreeing
    assert clock._offset.s == pytest.approx(40.0, abs=0.001)

    clock.note_redis_time(300.0, 300.001, 300.002)  # the clock stepped: Redis's and this one agree now
    assert clock._offset.s == pytest.approx(0.0, abs=0.001)
    assert clock.redis_now() == pytest.approx(time.time(), abs=0.01)


def test_a_step_of_this_process_clock_after_its_offset_was_read_moves_not_redis_clock(monkeypatch):
    # Before: `redis_now` added the offset to this process's wall clock, so a step (NTP, a VM resumed) moved Redis's
    # clock as this process read it by the whole step until its next beat read the offset again.
    monkeypatch.setattr(clock, "_offset", clock._Offset())

    async def beat() -> None:
        await clock.read_offset(get_async_redis())

    asyncio.run(beat())
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 600)  # stepped 10 minutes ahead
    assert clock.redis_now() == pytest.approx(redis_time(), abs=1)
    assert clock.redis_datetime().timestamp() == pytest.approx(redis_time(), abs=1)


@pytest.mark.skipif(not hasattr(time, "CLOCK_BOOTTIME"), reason="a platform without CLOCK_BOOTTIME (Linux's)")
def test_a_gateway_resumed_after_a_suspend_reads_redis_clock_as_it_is_not_behind_by_the_time_suspended(monkeypatch):
    # Before: `redis_now` added the offset to CLOCK_MONOTONIC, which stops while a VM is suspended: resumed after ten
    # minutes, the gateway read Redis's clock ten minutes behind until its next beat, its calls stamped that far back.
    monkeypatch.setattr(clock, "_offset", clock._Offset())
    clock.note_redis_time(1000.0, 1040.001, 1000.002)  # Redis 40 s ahead, read in 2 ms
    wall, boot, monotonic = time.time(), time.clock_gettime(time.CLOCK_BOOTTIME), time.monotonic()
    slept = [0.0]
    real_clock_gettime = time.clock_gettime

    def clock_gettime(clock_id):
        if clock_id == time.CLOCK_BOOTTIME:
            return boot + slept[0]
        return real_clock_gettime(clock_id)

    monkeypatch.setattr(time, "time", lambda: wall + slept[0])  # the wall clock, kept by NTP, counts the sleep
    monkeypatch.setattr(time, "clock_gettime", clock_gettime)
    monkeypatch.setattr(time, "monotonic", lambda: monotonic)  # CLOCK_MONOTONIC does not
    before = clock.redis_now()

    slept[0] = 600.0  # suspended for ten minutes, then resumed
    assert clock.redis_now() == pytest.approx(before + 600, abs=0.01)
    assert clock.redis_datetime().timestamp() == pytest.approx(wall + 600 + 40, abs=1)
