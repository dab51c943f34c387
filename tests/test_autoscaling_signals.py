"""LLM-aware autoscaling and scheduled floors: engine queues, KV-cache pressure, panic, pre-warm windows, keep-warm.

The decision function is pure (properties by hypothesis); its inputs are read from real Redis and
PostgreSQL (`read_load`), and every scale event carries them.
"""

from __future__ import annotations

import math
import re
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane import redis_keys
from controlplane.accounts.services import SYSTEM
from controlplane.redis_client import get_redis, redis_time
from endpoints import autoscaler, prewarm, scheduler
from endpoints.autoscaler import Load
from endpoints.fleet.services import create_join_token
from endpoints.models import Endpoint, EndpointEvent, Replica
from gpu_agent.protocol import ReplicaState, ReplicaStatus
from tests.factories import EndpointFactory
from tests.test_agent_api import beat, register
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db

# Monday 1 June 2026, 07:30 UTC = 09:30 in Paris (summer time).
MONDAY_0730_UTC = datetime(2026, 6, 1, 7, 30, tzinfo=UTC).timestamp()
OFFICE_HOURS = {"schedule": "0 9 * * 1-5", "timezone": "Europe/Paris", "duration_minutes": 600, "min_replicas": 2}


def busy(inflight, *, ready=1, engine_waiting=0, kv=0.0, surge=None, peak=None, capacity=None, now=MONDAY_0730_UTC):
    return Load(inflight, 0, now, peak if peak is not None else inflight, surge, ready, engine_waiting, kv, capacity)


def idle_for(seconds, now=MONDAY_0730_UTC):
    return Load(0, 0, now - seconds, 0)


# -- pre-warm windows and keep-warm --------------------------------------------------------------


def test_a_pre_warm_window_holds_its_floor_in_its_own_time_zone_and_lets_go_after():
    endpoint = EndpointFactory(min_replicas=0, max_replicas=4, idle_timeout_s=60, prewarm_windows=[OFFICE_HOURS])
    inside = autoscaler.decide(endpoint, idle_for(3600), now=MONDAY_0730_UTC)
    assert inside.desired == 2 and "pre-warm window" in inside.reason and "until 19:00" in inside.reason
    # 06:59 UTC is 08:59 in Paris: not open yet. 17:00 UTC is 19:00 in Paris: closed again.
    before = datetime(2026, 6, 1, 6, 59, tzinfo=UTC).timestamp()
    after = datetime(2026, 6, 1, 17, 0, tzinfo=UTC).timestamp()
    assert autoscaler.decide(endpoint, idle_for(3600, before), now=before).desired == 0
    assert autoscaler.decide(endpoint, idle_for(3600, after), now=after).desired == 0
    # Saturday: the schedule says weekdays only.
    saturday = datetime(2026, 6, 6, 7, 30, tzinfo=UTC).timestamp()
    assert autoscaler.decide(endpoint, idle_for(3600, saturday), now=saturday).desired == 0


def test_a_window_follows_daylight_saving_time():
    window = {"schedule": "0 9 * * *", "timezone": "America/New_York", "duration_minutes": 60, "min_replicas": 1}
    winter = datetime(2026, 1, 15, 14, 30, tzinfo=UTC)  # 09:30 EST
    summer = datetime(2026, 7, 15, 13, 30, tzinfo=UTC)  # 09:30 EDT
    assert prewarm.window_floor([window], winter).replicas == 1
    assert prewarm.window_floor([window], summer).replicas == 1
    assert prewarm.window_floor([window], summer + timedelta(hours=1)).replicas == 0


def test_keep_warm_after_a_cold_start_holds_one_replica_while_idle_then_lets_it_go():
    started = datetime.fromtimestamp(MONDAY_0730_UTC, UTC) - timedelta(seconds=100)
    endpoint = EndpointFactory(min_replicas=0, idle_timeout_s=60, keep_warm_after_cold_start_s=600,
                               last_cold_start_at=started)
    held = autoscaler.decide(endpoint, idle_for(90), now=MONDAY_0730_UTC)
    assert held.desired == 1 and "kept warm 500 s more after a cold start" in held.reason
    later = MONDAY_0730_UTC + 600
    assert autoscaler.decide(endpoint, idle_for(690, later), now=later).desired == 0


def test_a_replica_becoming_ready_starts_the_keep_warm_clock(django_capture_on_commit_callbacks):
    from endpoints.replicas import _announce_transition

    endpoint = EndpointFactory(keep_warm_after_cold_start_s=300)
    replica = Replica.objects.create(endpoint=endpoint, node=make_node(memory_mb=80_000), state=ReplicaState.READY)
    with django_capture_on_commit_callbacks(execute=False):
        _announce_transition(replica, ReplicaState.STARTING, ReplicaState.READY, None)
    endpoint.refresh_from_db()
    assert endpoint.last_cold_start_at is not None
    assert (timezone.now() - endpoint.last_cold_start_at).total_seconds() < 60


def test_a_replica_reported_ready_through_a_web_pod_whose_clock_is_behind_is_kept_warm_for_the_whole_window(
        django_capture_on_commit_callbacks, monkeypatch):
    """The keep-warm window is judged by the tick at Redis's clock; its start was stamped by the clock of the web pod
    that heard the READY: a web pod 15 minutes behind gave a 10-minute keep-warm none at all (the replica let go at
    the next idle tick, the tenant's next call a cold start again), one ahead gave it that much more."""
    from endpoints.replicas import apply_replica_report

    endpoint = EndpointFactory(min_replicas=0, idle_timeout_s=60, keep_warm_after_cold_start_s=600)
    node = make_node(memory_mb=80_000, advertise_host="127.0.0.1", engine_port_min=9000, engine_port_max=9100)
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING)
    real_now = timezone.now
    with monkeypatch.context() as web_pod, django_capture_on_commit_callbacks(execute=False):
        web_pod.setattr(timezone, "now", lambda: real_now() - timedelta(minutes=15))
        apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY,
                                                 address="http://127.0.0.1:9001"))
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.READY

    with django_capture_on_commit_callbacks(execute=False):
        decision = scheduler.reconcile_endpoint(str(endpoint.pk), Load(0, 0, None, 0), now=redis_time())

    assert decision.desired == 1 and "kept warm" in decision.reason, decision.reason
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.READY


def test_a_replica_woken_from_sleep_reported_ready_through_a_web_pod_whose_clock_is_behind_shows_its_real_wake_time(
        django_capture_on_commit_callbacks, monkeypatch):
    """A wake's seconds in the endpoint's events: `woken_at` is PostgreSQL's clock (the wake's), and the READY was
    judged by the web pod's own: one 15 minutes behind showed the tenant "woke READY after -880.0 s"."""
    from controlplane.clock import database_now
    from endpoints.models import EventKind
    from endpoints.replicas import apply_replica_report

    endpoint = EndpointFactory(min_replicas=0, idle_timeout_s=60)
    node = make_node(memory_mb=80_000, advertise_host="127.0.0.1", engine_port_min=9000, engine_port_max=9100)
    now = database_now()
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING,
                                     ready_at=now - timedelta(hours=1), woken_at=now - timedelta(seconds=20))
    real_now = timezone.now
    with monkeypatch.context() as web_pod, django_capture_on_commit_callbacks(execute=False):
        web_pod.setattr(timezone, "now", lambda: real_now() - timedelta(minutes=15))
        apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY,
                                                 address="http://127.0.0.1:9001"))

    event = EndpointEvent.objects.get(endpoint=endpoint, kind=EventKind.COLD_START)
    shown = re.search(r"woke READY after (-?[\d.]+) s", event.message)
    assert shown and 20 <= float(shown[1]) < 80 and 20 <= event.details["wake_s"] < 80, event.message


@pytest.mark.parametrize("failure", ["cluster", "connection"])
def test_a_replica_reported_ready_while_redis_cannot_tell_its_time_is_kept_warm_by_this_process_clock(
        django_capture_on_commit_callbacks, monkeypatch, failure):
    """The keep-warm window's start is stamped by Redis's clock, this process's own where Redis cannot be read. On
    Redis Cluster a cluster it cannot reach raises `RedisClusterException`, no `RedisError`: the READY's announcement
    raised after its commit (the agent's heartbeat a 500, the cold start's event and keep-warm window lost)."""
    import redis.exceptions

    from endpoints import replicas
    from endpoints.replicas import apply_replica_report

    error = (redis.exceptions.RedisClusterException("Redis Cluster cannot be connected") if failure == "cluster"
             else redis.exceptions.ConnectionError("refused"))

    def unreachable(*args, **kwargs):
        raise error

    endpoint = EndpointFactory(min_replicas=0, idle_timeout_s=60, keep_warm_after_cold_start_s=600)
    node = make_node(memory_mb=80_000, advertise_host="127.0.0.1", engine_port_min=9000, engine_port_max=9100)
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING)
    monkeypatch.setattr(replicas, "redis_time", unreachable)
    with django_capture_on_commit_callbacks(execute=False):
        apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY,
                                                 address="http://127.0.0.1:9001"))

    endpoint.refresh_from_db()
    assert endpoint.last_cold_start_at is not None
    assert abs((timezone.now() - endpoint.last_cold_start_at).total_seconds()) < 60
    assert EndpointEvent.objects.filter(endpoint=endpoint, kind="cold_start").exists()


def test_the_tick_raises_an_idle_serverless_endpoint_to_its_open_windows_floor(settings):
    always_open = {"schedule": "* * * * *", "timezone": "UTC", "duration_minutes": 5, "min_replicas": 2}
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=3, prewarm_windows=[always_open])
    make_node(memory_mb=80_000)
    assert str(endpoint.pk) in scheduler.active_endpoint_ids()
    scheduler.autoscale_tick()
    assert Replica.objects.filter(endpoint=endpoint).count() == 2
    event = EndpointEvent.objects.filter(endpoint=endpoint, message__startswith="Scale up 0 → 2").get()
    assert "pre-warm window" in event.message and event.details["inputs"]["floor"] == 2


def test_a_stored_window_whose_date_never_comes_never_opens_and_the_tick_still_scales_everyone_else():
    """Before, 30 February raised in every tick's decisions: no endpoint of any tenant scaled, even to zero."""
    never = {"schedule": "0 9 30 2 *", "timezone": "Europe/Paris", "duration_minutes": 600, "min_replicas": 2}
    broken = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=2)
    Endpoint.objects.filter(pk=broken.pk).update(prewarm_windows=[never])  # stored before such schedules were refused
    idle = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=1, idle_timeout_s=60)
    replica = Replica.objects.create(endpoint=idle, node=make_node(memory_mb=80_000), state=ReplicaState.READY,
                                     address="http://127.0.0.1:9", ready_at=timezone.now())
    get_redis().set(redis_keys.last_request_key(idle.organization_id, str(idle.pk)), time.time() - 120)
    broken.refresh_from_db()
    assert prewarm.window_floor(broken.prewarm_windows, datetime.now(UTC)).replicas == 0
    assert prewarm.next_openings(broken.prewarm_windows, datetime.now(UTC)) == [(never, None)]

    scheduler.autoscale_tick()
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.DRAINING
    assert not Replica.objects.filter(endpoint=broken).exists()


def test_a_stored_schedule_too_long_to_read_in_a_tick_never_opens_and_is_never_read(monkeypatch):
    """Ten windows of 90,000 listed minutes took croniter ~6 s a read: every tick ~30 s, for every tenant."""
    long_schedule = {"schedule": ",".join(["1"] * 90_000) + " * * * *", "timezone": "UTC", "duration_minutes": 60,
                     "min_replicas": 1}
    read = []
    monkeypatch.setattr(prewarm, "croniter", lambda *args, **kwargs: read.append(args) or pytest.fail("read"))

    assert prewarm.window_floor([long_schedule] * 10, datetime.now(UTC)).replicas == 0
    assert prewarm.next_openings([long_schedule], datetime.now(UTC)) == [(long_schedule, None)]
    assert read == []


# -- what the engines feel --------------------------------------------------------------------------


def test_an_engine_queue_asks_for_replicas_that_gateway_load_alone_would_not():
    endpoint = EndpointFactory(max_replicas=10, target_concurrency=8)
    # 14 in flight on 2 replicas fits a target of 8 each, but the engines queue 6 (their batches are full).
    calm = autoscaler.decide(endpoint, busy(14, ready=2), now=MONDAY_0730_UTC)
    queued = autoscaler.decide(endpoint, busy(14, ready=2, engine_waiting=6), now=MONDAY_0730_UTC)
    assert calm.desired == 2 and queued.desired == 3
    assert "engines queue 6" in queued.reason and queued.inputs["engine_waiting"] == 6


def test_an_engine_that_filled_up_below_the_target_sizes_the_endpoint_for_the_stable_window():
    endpoint = EndpointFactory(max_replicas=10, target_concurrency=8)
    # The engines queued at 4 sequences each (long prompts fill their KV cache): 4 is what a replica
    # holds, for the load now and for the window's peak, even once the queue is gone.
    learned = autoscaler.decide(endpoint, busy(12, ready=3, peak=16, capacity=4.0), now=MONDAY_0730_UTC)
    assert learned.desired == 4 and "engines hold 4.0 each" in learned.reason
    assert autoscaler.decide(endpoint, busy(12, ready=3, peak=16), now=MONDAY_0730_UTC).desired == 2


def test_a_surge_in_the_stable_window_lets_no_ready_replica_go():
    endpoint = EndpointFactory(max_replicas=20, target_concurrency=4)
    calm = autoscaler.decide(endpoint, busy(4, ready=5, peak=4), now=MONDAY_0730_UTC)
    assert calm.desired == 1 and not calm.inputs["panic"]
    surged = autoscaler.decide(endpoint, busy(4, ready=5, peak=12, surge=12), now=MONDAY_0730_UTC)
    assert surged.inputs["panic"] and surged.desired == 5
    assert "panic: load doubled to 12" in surged.reason


def outstanding(replica, count):
    """The gateways' count of requests sent to `replica` and not yet ended (`endpoints.gateway.traffic`)."""
    get_redis().set(redis_keys.outstanding_key(replica.endpoint.organization_id, str(replica.pk)), count)


def test_engine_signals_the_learned_capacity_and_surges_come_from_heartbeats_and_redis(settings):
    settings.AUTOSCALER_PANIC_WINDOW_S = 6
    endpoint = EndpointFactory(max_replicas=4)
    node = make_node(memory_mb=80_000)
    for running, waiting, kv in ((3, 3, 0.5), (5, 1, 0.9)):
        replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY, num_running=running,
                                         num_waiting=waiting, kv_cache_usage=kv)
        outstanding(replica, running + waiting)  # the gateways sent each engine what it runs and queues
    Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING, num_waiting=50, kv_cache_usage=1.0)
    now = time.time()
    samples = redis_keys.samples_key(endpoint.organization_id, str(endpoint.pk))
    # Concurrency 2 thirty seconds ago, 9 twenty seconds ago (a surge: it was 2 four seconds before), then 3.
    get_redis().zadd(samples, {f"{now - 30:.3f}:2": now - 30, f"{now - 26:.3f}:2": now - 26,
                               f"{now - 22:.3f}:9": now - 22, f"{now - 4:.3f}:3": now - 4})
    get_redis().set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), now)
    load = autoscaler.read_load([str(endpoint.pk)], now=now)[str(endpoint.pk)]
    assert (load.num_ready, load.engine_waiting) == (2, 4)
    assert load.kv_cache_usage == pytest.approx(0.7)
    assert load.peak_concurrency == 9 and load.surge == 9
    assert load.engine_capacity == pytest.approx(4.0)  # 8 running on 2 queueing replicas
    # Remembered for the stable window, after the queues are gone.
    Replica.objects.filter(endpoint=endpoint).update(num_waiting=0, kv_cache_usage=0.2)
    assert autoscaler.read_load([str(endpoint.pk)], now=now + 2)[str(endpoint.pk)].engine_capacity == pytest.approx(4.0)


# -- what a node may not make the autoscaler believe -------------------------------------------------


def test_a_node_lying_about_its_engine_queue_does_not_scale_a_victims_endpoint(client, django_capture_on_commit_callbacks):
    hostile = register(client, create_join_token(SYSTEM, name="h").plain, name="hostile",
                       gpu_memory_mb=200000, memory_mb=400000, num_cpus=64).json()
    victim = EndpointFactory(gpu_type="cpu", min_replicas=0, max_replicas=6, model_source="/models/tiny",
                             max_model_len=1024, max_num_seqs=4)
    # The victim called its endpoint a moment ago (nothing in flight now); its one replica lands on the hostile node.
    get_redis().set(redis_keys.last_request_key(victim.organization_id, str(victim.pk)), redis_time(get_redis()))
    scheduler.reconcile_endpoint(str(victim.pk))
    replica = Replica.objects.get(endpoint=victim)
    assert str(replica.node_id) == hostile["node_id"]
    lie = ReplicaStatus(str(replica.pk), ReplicaState.READY, address="http://127.0.0.1:20001", num_running=1,
                        num_waiting=2_000_000_000, kv_cache_usage=1.0)
    assert beat(client, hostile["node_secret"], [lie]).status_code == 200
    scheduler.reconcile_endpoint(str(victim.pk))
    live = Replica.objects.filter(endpoint=victim).exclude(state__in=[ReplicaState.STOPPED, ReplicaState.FAILED])
    assert live.count() == 1
    assert get_redis().get(redis_keys.capacity_key(victim.organization_id, str(victim.pk))) is None


def test_an_engine_report_past_the_gateways_count_teaches_no_capacity_and_queues_at_most_that_count():
    endpoint = EndpointFactory(max_replicas=10, target_concurrency=8)
    replica = Replica.objects.create(endpoint=endpoint, node=make_node(memory_mb=80_000), state=ReplicaState.READY,
                                     num_running=1, num_waiting=50, kv_cache_usage=1.0)
    now = time.time()
    get_redis().set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), now)
    capacity_key = redis_keys.capacity_key(endpoint.organization_id, str(endpoint.pk))
    # Nothing sent to it: an engine running nothing queues nothing and holds no KV cache.
    load = autoscaler.read_load([str(endpoint.pk)], now=now)[str(endpoint.pk)]
    assert (load.num_ready, load.engine_waiting, load.kv_cache_usage, load.engine_capacity) == (1, 0, 0.0, None)
    # Three sent to it: it queues at most 3 x 16 sequences (n at most 16 each) less the one it runs, and a report of
    # 51 is more than its calls (a lie, a stale report, or calls of n > 1) that teaches nothing.
    get_redis().zadd(redis_keys.inflight_key(endpoint.organization_id, str(endpoint.pk)),
                     {f"request-{n}": int(now) for n in range(3)})
    outstanding(replica, 3)
    load = autoscaler.read_load([str(endpoint.pk)], now=now + 1)[str(endpoint.pk)]
    assert (load.engine_waiting, load.kv_cache_usage, load.engine_capacity) == (47, 1.0, None)
    assert get_redis().get(capacity_key) is None
    # Bounded by what three calls can run, never by the two billion a node may claim.
    assert autoscaler.decide(endpoint, load, now=now + 1).desired <= 1 + -(-3 * 16 // 8)


def test_an_engine_saturated_by_calls_of_n_8_still_scales_up_on_its_queue():
    # vLLM runs each of n=8's sequences as a request: 4 calls run 16 sequences and queue 16 more, KV cache full. A
    # bound of one engine request per call dropped that queue, and the endpoint stayed at one replica.
    endpoint = EndpointFactory(max_replicas=10, target_concurrency=8)
    replica = Replica.objects.create(endpoint=endpoint, node=make_node(memory_mb=80_000), state=ReplicaState.READY,
                                     num_running=16, num_waiting=16, kv_cache_usage=0.99)
    now = time.time()
    get_redis().set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), now)
    get_redis().zadd(redis_keys.inflight_key(endpoint.organization_id, str(endpoint.pk)),
                     {f"request-{n}": int(now) for n in range(4)})
    outstanding(replica, 4)
    load = autoscaler.read_load([str(endpoint.pk)], now=now)[str(endpoint.pk)]
    assert load.engine_waiting == 16
    assert autoscaler.decide(endpoint, load, now=now).desired > 1


def test_an_honest_engine_queue_within_the_gateways_count_still_scales_up_and_teaches_capacity():
    endpoint = EndpointFactory(max_replicas=10, target_concurrency=8)
    node = make_node(memory_mb=80_000)
    for _ in range(2):
        # Each engine runs 4 (its KV cache is full) and queues 3 of the 7 the gateways sent it.
        replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY, num_running=4,
                                         num_waiting=3, kv_cache_usage=0.95)
        outstanding(replica, 7)
    now = time.time()
    get_redis().zadd(redis_keys.inflight_key(endpoint.organization_id, str(endpoint.pk)),
                     {f"request-{n}": int(now) for n in range(14)})
    get_redis().set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), now)
    load = autoscaler.read_load([str(endpoint.pk)], now=now)[str(endpoint.pk)]
    assert (load.num_ready, load.engine_waiting, load.engine_capacity) == (2, 6, pytest.approx(4.0))
    decision = autoscaler.decide(endpoint, load, now=now)
    assert decision.desired == 4 and "engines hold 4.0 each" in decision.reason  # 14 in flight at 4 each


def test_each_scale_event_records_the_inputs_of_its_decision():
    endpoint = EndpointFactory(gpu_type="l4", max_replicas=3, target_concurrency=2)
    make_node(memory_mb=80_000)
    scheduler.reconcile_endpoint(str(endpoint.pk), busy(3, ready=0, now=time.time()))
    event = EndpointEvent.objects.get(endpoint=endpoint, message__startswith="Scale up")
    assert {"in_flight", "waiting", "peak", "surge", "engine_waiting", "kv_cache_usage", "engine_capacity", "panic",
            "floor"} <= event.details["inputs"].keys()
    assert event.details["inputs"]["in_flight"] == 3


# -- properties of the decision ------------------------------------------------------------------------


loads = st.builds(
    Load,
    num_inflight=st.integers(0, 500), num_waiting=st.integers(0, 100),
    last_request_at=st.one_of(st.none(), st.floats(MONDAY_0730_UTC - 10_000, MONDAY_0730_UTC)),
    peak_concurrency=st.integers(0, 600), surge=st.one_of(st.none(), st.integers(0, 600)),
    num_ready=st.integers(0, 20), engine_waiting=st.integers(0, 200), kv_cache_usage=st.floats(0, 1),
    engine_capacity=st.one_of(st.none(), st.floats(1, 64)),
)
specs = st.fixed_dictionaries({
    "min_replicas": st.integers(0, 5), "max_replicas": st.integers(5, 40), "target_concurrency": st.integers(1, 64),
    "idle_timeout_s": st.integers(30, 3600),
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=specs, load=loads)
def test_decisions_stay_within_floor_and_max_and_never_fall_as_signals_rise(spec, load):
    endpoint = Endpoint(**spec, prewarm_windows=[], keep_warm_after_cold_start_s=0)
    decision = autoscaler.decide(endpoint, load, now=MONDAY_0730_UTC)
    assert spec["min_replicas"] <= decision.desired <= spec["max_replicas"]
    if load.concurrency:
        assert decision.desired >= min(math.ceil(load.concurrency / spec["target_concurrency"]), spec["max_replicas"])
    # More of any signal never asks for fewer replicas.
    for more in ({"num_inflight": load.num_inflight + 7}, {"engine_waiting": load.engine_waiting + 5},
                 {"peak_concurrency": load.peak_concurrency + 9},
                 {"engine_capacity": min(load.engine_capacity or 64.0, 2.0)}):
        heavier = Load(**{name: getattr(load, name) for name in Load.__dataclass_fields__} | more)
        if heavier.last_request_at is None and heavier.concurrency:
            continue
        assert autoscaler.decide(endpoint, heavier, now=MONDAY_0730_UTC).desired >= decision.desired, more


@settings(max_examples=200, deadline=None)
@given(schedule_hour=st.integers(0, 23), minutes=st.integers(1, 1440), at_hour=st.integers(0, 23),
       zone=st.sampled_from(["UTC", "Europe/Paris", "Asia/Kolkata", "America/Los_Angeles", "Australia/Lord_Howe"]))
def test_a_window_is_open_exactly_from_its_opening_for_its_duration(schedule_hour, minutes, at_hour, zone):
    window = {"schedule": f"0 {schedule_hour} * * *", "timezone": zone, "duration_minutes": minutes, "min_replicas": 3}
    now = datetime(2026, 3, 10, at_hour, 17, tzinfo=UTC)
    opened = prewarm._opened_at(window, now)
    floor = prewarm.window_floor([window], now).replicas
    assert floor == (3 if opened is not None else 0)
    if opened is not None:
        assert timedelta(0) <= now - opened < timedelta(minutes=minutes)
        assert opened.astimezone(opened.tzinfo).hour == schedule_hour


# -- the API and the console ----------------------------------------------------------------------------


VALID = {"name": "office-chat", "model_source": "hf:meta-llama/Llama-3.1-8B-Instruct", "gpu_type": "l4", "max_replicas": 3}


def test_pre_warm_windows_and_keep_warm_round_trip_through_the_api(owner_client):
    created = owner_client.post("/api/v1/endpoints/", VALID | {"prewarm_windows": [OFFICE_HOURS],
                                                               "keep_warm_after_cold_start_s": 900}, format="json")
    assert created.status_code == 201, created.json()
    body = owner_client.get(f"/api/v1/endpoints/{created.json()['id']}/").json()
    assert body["prewarm_windows"] == [OFFICE_HOURS] and body["keep_warm_after_cold_start_s"] == 900
    cleared = owner_client.patch(f"/api/v1/endpoints/{body['id']}/", {"prewarm_windows": []}, format="json")
    assert cleared.status_code == 200 and cleared.json()["prewarm_windows"] == []


@pytest.mark.parametrize(("windows", "message"), [
    ([OFFICE_HOURS | {"schedule": "every monday"}], "Window 1: schedule must be a five-field cron expression"),
    ([OFFICE_HOURS | {"schedule": "61 9 * * *"}], "Window 1: schedule must be a five-field cron expression"),
    ([OFFICE_HOURS | {"schedule": "0 9 30 2 *"}], "Window 1: schedule names a date that never comes"),
    ([OFFICE_HOURS, OFFICE_HOURS | {"schedule": "0 9 31 4,6 *"}], "Window 2: schedule names a date that never comes"),
    ([OFFICE_HOURS | {"timezone": "Mars/Olympus"}], "Window 1: timezone must be an IANA time zone name"),
    ([OFFICE_HOURS | {"duration_minutes": 0}], "Window 1: duration_minutes must be a whole number from 1 to 10080"),
    ([OFFICE_HOURS, OFFICE_HOURS | {"min_replicas": 9}], "Window 2: min_replicas is above max_replicas (3)"),
    ([{"schedule": "0 9 * * *"}], "Window 1: missing duration_minutes, min_replicas, timezone"),
    ([OFFICE_HOURS] * 11, "At most 10 windows"),
    ([OFFICE_HOURS | {"schedule": ",".join(["1"] * 5000) + " 9 * * *"}], "Window 1: schedule may be at most 200 characters"),
    ("0 9 * * *", "Must be a JSON list of windows"),
])
def test_bad_pre_warm_windows_are_a_400_naming_the_window_and_field(owner_client, windows, message):
    response = owner_client.post("/api/v1/endpoints/", VALID | {"prewarm_windows": windows}, format="json")
    assert response.status_code == 400
    assert any(message in text for text in response.json()["prewarm_windows"]), response.json()
    assert not Endpoint.objects.filter(name="office-chat").exists()
