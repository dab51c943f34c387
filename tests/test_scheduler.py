"""Autoscaling decisions, reconciling, the tick lock and the sweeper, on rows (no processes)."""

import threading
import time
from datetime import timedelta

import pytest
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from controlplane import redis_keys
from controlplane.accounts.models import Organization
from controlplane.redis_client import get_redis
from controlplane.redis_keys import TICK_LOCK_KEY
from endpoints import autoscaler, scheduler
from endpoints.autoscaler import Load
from endpoints.fleet.services import desired_replicas, record_heartbeat
from endpoints.models import EndpointEvent, Replica
from endpoints.nodes.models import Node, NodeSweep
from gpu_agent.protocol import Heartbeat, NodeState, ReplicaState
from tests.factories import EndpointFactory
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db

NOW = 1_000_000.0


def load(inflight=0, waiting=0, last=None, peak=None):
    return Load(inflight, waiting, last, peak if peak is not None else inflight + waiting)


@pytest.mark.parametrize(
    "spec, current_load, desired",
    [
        ({"min_replicas": 0, "idle_timeout_s": 60}, load(), 0),
        ({"min_replicas": 0, "idle_timeout_s": 60}, load(last=NOW - 61), 0),
        ({"min_replicas": 0, "idle_timeout_s": 60}, load(last=NOW - 10), 1),  # recently used: keep one warm
        ({"min_replicas": 0, "target_concurrency": 4}, load(waiting=1, last=NOW), 1),  # a cold request wakes it
        ({"min_replicas": 0, "max_replicas": 10, "target_concurrency": 4}, load(inflight=9, waiting=4, last=NOW), 4),
        ({"min_replicas": 0, "max_replicas": 3, "target_concurrency": 1}, load(inflight=9, last=NOW), 3),  # bounded
        ({"min_replicas": 2, "max_replicas": 5, "idle_timeout_s": 60}, load(last=NOW - 600), 2),
        # scale down waits for the stable window's peak
        ({"min_replicas": 0, "max_replicas": 10, "target_concurrency": 2}, load(inflight=1, last=NOW, peak=8), 4),
    ],
)
def test_decides_replicas_from_load(spec, current_load, desired):
    endpoint = EndpointFactory(**({"max_replicas": 4} | spec))
    decision = autoscaler.decide(endpoint, current_load, now=NOW)
    assert decision.desired == desired, decision.reason


def test_paused_endpoints_want_nothing():
    endpoint = EndpointFactory(min_replicas=2, max_replicas=2, paused_at=timezone.now())
    assert autoscaler.decide(endpoint, load(inflight=5, last=NOW), now=NOW).desired == 0


def test_load_comes_from_the_gateways_redis_state_and_ignores_stale_entries():

    endpoint = EndpointFactory()
    redis = get_redis()
    redis.zadd(redis_keys.inflight_key(endpoint.organization_id, str(endpoint.pk)), {"a": time.time(), "b": time.time(), "ghost": time.time() - 7200})
    redis.zadd(redis_keys.waiting_key(endpoint.organization_id, str(endpoint.pk)), {"c": time.time()})
    redis.set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), time.time())
    current = autoscaler.read_load([str(endpoint.pk)])[str(endpoint.pk)]
    assert (current.num_inflight, current.num_waiting, current.peak_concurrency) == (2, 1, 3)


def test_a_call_whose_count_was_released_meanwhile_keeps_its_endpoint_from_reading_as_idle():
    # A stream in flight for longer than the idle timeout, its gateway's beats stopped for a few seconds (a stall, a
    # Redis failover): the sweep released its count, and in the same tick the endpoint read as idle since the call
    # began: scaled to zero, its replica drained under the live stream (its gateway put the count back a second later).
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=1, idle_timeout_s=300)
    replica = Replica.objects.create(endpoint=endpoint, node=make_node(memory_mb=80_000), state=ReplicaState.READY,
                                     address="http://127.0.0.1:9", ready_at=timezone.now())
    endpoint_id, now, redis = str(endpoint.pk), time.time(), get_redis()
    inflight = redis_keys.inflight_key(endpoint.organization_id, endpoint_id)
    redis.zadd(inflight, {"long-stream": now - 400})
    redis.set(redis_keys.last_request_key(endpoint.organization_id, endpoint_id), now - 400)
    autoscaler.read_load([endpoint_id], now=now - 2)  # the tick before: the stream in flight
    redis.zrem(inflight, "long-stream")  # released with its gateway's requests

    current = autoscaler.read_load([endpoint_id], now=now)[endpoint_id]
    scheduler.reconcile_endpoint(endpoint_id, current)

    assert current.concurrency == 0 and current.idle_since == pytest.approx(now - 2, abs=0.01)
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.READY
    later = autoscaler.read_load([endpoint_id], now=now + 300)[endpoint_id]  # idle the whole timeout since
    scheduler.reconcile_endpoint(endpoint_id, later)
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.DRAINING


def test_reconcile_scales_up_and_down_and_logs_each_decision():
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=3, target_concurrency=1)
    make_node(memory_mb=80_000)
    make_node(memory_mb=80_000)
    scheduler.reconcile_endpoint(str(endpoint.pk), load(inflight=3, last=time.time()))
    assert Replica.objects.filter(endpoint=endpoint, state="PENDING").count() == 3
    Replica.objects.filter(endpoint=endpoint).update(state=ReplicaState.READY)
    scheduler.reconcile_endpoint(str(endpoint.pk), load(inflight=1, last=time.time()))
    assert Replica.objects.filter(endpoint=endpoint, state="READY").count() == 1
    assert Replica.objects.filter(endpoint=endpoint, state="DRAINING").count() == 2
    messages = list(EndpointEvent.objects.filter(endpoint=endpoint, kind="scale").values_list("message", flat=True))
    assert any(m.startswith("Scale up 0 → 3") for m in messages) and any(m.startswith("Scale down 3 → 1") for m in messages)


def test_without_capacity_the_endpoint_says_why():
    endpoint = EndpointFactory(gpu_type="a100-80gb", min_replicas=1)
    scheduler.reconcile_endpoint(str(endpoint.pk), load())
    endpoint.refresh_from_db()
    assert endpoint.status_message == "waiting for capacity: no READY node of GPU type a100-80gb"
    make_node(gpu_type="a100-80gb", memory_mb=80_000)
    scheduler.reconcile_endpoint(str(endpoint.pk), load())
    endpoint.refresh_from_db()
    assert endpoint.status_message == "" and endpoint.replicas.count() == 1


def test_a_second_overlapping_tick_does_nothing():
    EndpointFactory(min_replicas=1)
    get_redis().set(TICK_LOCK_KEY, "1", ex=10)
    assert scheduler.autoscale_tick() == 0
    assert not Replica.objects.exists()
    get_redis().delete(TICK_LOCK_KEY)
    make_node(memory_mb=80_000)
    assert scheduler.autoscale_tick() == 1
    assert Replica.objects.count() == 1


def test_a_tick_that_outlived_its_lock_leaves_the_next_ticks_lock_alone(monkeypatch):
    # A tick slower than its lock's expiry (a slow database, a stalled worker): the lock expired, the next beat's
    # tick took it, and the slow tick's end deleted it, so a third tick ran beside the second.
    EndpointFactory(min_replicas=1)
    redis = get_redis()

    def slow_sweep():
        redis.delete(TICK_LOCK_KEY)  # expired meanwhile
        redis.set(TICK_LOCK_KEY, "the next tick", ex=10)

    monkeypatch.setattr(scheduler.presence, "sweep_dead_gateways", slow_sweep)
    scheduler.autoscale_tick()

    assert redis.get(TICK_LOCK_KEY) in ("the next tick", b"the next tick")
    assert scheduler.autoscale_tick() == 0  # the next tick holds it: a third does nothing


def test_an_endpoint_whose_decision_fails_does_not_stop_the_tick_for_the_others(monkeypatch, caplog):
    broken = EndpointFactory(gpu_type="l4", min_replicas=1)
    idle = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=1, idle_timeout_s=60)
    replica = Replica.objects.create(endpoint=idle, node=make_node(memory_mb=80_000), state=ReplicaState.READY,
                                     address="http://127.0.0.1:9", ready_at=timezone.now())
    get_redis().set(redis_keys.last_request_key(idle.organization_id, str(idle.pk)), time.time() - 120)
    decide = autoscaler.decide

    def decide_or_fail(endpoint, *args, **kwargs):
        if endpoint.pk == broken.pk:
            raise RuntimeError("a bug in one endpoint's decision")
        return decide(endpoint, *args, **kwargs)

    monkeypatch.setattr(autoscaler, "decide", decide_or_fail)
    scheduler.autoscale_tick()
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.DRAINING
    assert f"deciding for endpoint {broken.pk} failed" in caplog.text


def test_the_tick_looks_only_at_active_endpoints():
    idle = EndpointFactory(min_replicas=0)
    floored = EndpointFactory(min_replicas=1)
    busy = EndpointFactory(min_replicas=0)

    get_redis().zadd(redis_keys.RECENT_ENDPOINTS_KEY, {str(busy.pk): time.time()})
    assert set(scheduler.active_endpoint_ids()) == {str(floored.pk), str(busy.pk)}
    assert str(idle.pk) not in scheduler.active_endpoint_ids()


def _a_ready_replica_on_a_silent_node(seconds: float):
    """An endpoint's one replica, READY on a node whose last heartbeat is `seconds` old."""
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1)
    silent = make_node(memory_mb=80_000)
    scheduler.reconcile_endpoint(str(endpoint.pk), load())
    replica = Replica.objects.get(endpoint=endpoint)
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.READY)
    Node.objects.filter(pk=silent.pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=seconds))
    return endpoint, silent, replica


def test_a_silent_node_goes_offline_and_its_replicas_fail_and_are_replaced_elsewhere(settings, django_capture_on_commit_callbacks):
    settings.NODE_HEARTBEAT_GRACE_S = 30
    endpoint, silent, replica = _a_ready_replica_on_a_silent_node(31)
    healthy = make_node(memory_mb=80_000)
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    silent.refresh_from_db()
    replica.refresh_from_db()
    assert silent.state == NodeState.OFFLINE
    assert replica.state == "FAILED" and "stopped sending heartbeats" in replica.failure_reason
    scheduler.reconcile_endpoint(str(endpoint.pk), load())
    replacement = Replica.objects.get(endpoint=endpoint, state="PENDING")
    assert replacement.node == healthy
    # The node comes back: it is told to run nothing it had, so its stale replica stops.
    assert desired_replicas(silent) == []


def test_the_event_log_names_a_failed_replicas_state_as_the_console_shows_it(settings, django_capture_on_commit_callbacks):
    # Seen on `make run` after `make stop`: "Replica 8611126e ReplicaState.FAILED: its node stopped sending heartbeats".
    settings.NODE_HEARTBEAT_GRACE_S = 30
    endpoint, silent, replica = _a_ready_replica_on_a_silent_node(31)
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    [event] = EndpointEvent.objects.filter(endpoint=endpoint, kind="failure")
    assert event.message == f"Replica {str(replica.pk)[:8]} FAILED: its node stopped sending heartbeats"


def test_a_node_whose_host_the_gateway_now_refuses_takes_no_replicas_and_its_replicas_move(
        settings, django_capture_on_commit_callbacks):
    # Registered on loopback where the local stack allowed it (or before the rule); the deployment now refuses it,
    # so the gateway never routes to its engines: its replicas failed there and were placed there again, forever.
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1)
    refused = make_node(memory_mb=40_000, advertise_host="127.0.0.1")
    scheduler.reconcile_endpoint(str(endpoint.pk), load())
    replica = Replica.objects.get(endpoint=endpoint)
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.READY)
    settings.ALLOW_LOOPBACK_NODES = False
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    replica.refresh_from_db()
    assert replica.state == "FAILED" and replica.failure_reason == "its node's registered host is not one the gateway may reach"
    scheduler.reconcile_endpoint(str(endpoint.pk), load())
    assert not Replica.objects.filter(endpoint=endpoint, state="PENDING").exists()
    endpoint.refresh_from_db()
    assert endpoint.status_message == "waiting for capacity: no READY node of GPU type l4 the gateway may reach"
    # Best fit would pick the refused node (it fits more snugly): placement skips it.
    reachable = make_node(memory_mb=80_000, advertise_host="10.0.3.7")
    scheduler.reconcile_endpoint(str(endpoint.pk), load())
    assert Replica.objects.get(endpoint=endpoint, state="PENDING").node == reachable
    assert desired_replicas(refused) == []


def test_a_worker_whose_clock_runs_ahead_takes_no_beating_node_offline(settings, monkeypatch, django_capture_on_commit_callbacks):
    # Heartbeats were stamped by the web pod's clock and judged by the worker's: a worker ~25 s ahead took every node
    # OFFLINE at every sweep (their replicas failed and replaced), and a web pod ahead kept dead ones alive as long.
    settings.NODE_HEARTBEAT_GRACE_S = 30
    node = make_node(memory_mb=80_000)
    record_heartbeat(node, Heartbeat(agent_version="0.1.0", num_cpus=2, memory_mb=24000, memory_used_mb=1000))
    ahead = timezone.now() + timedelta(seconds=60)
    monkeypatch.setattr(timezone, "now", lambda: ahead)  # the worker's clock

    with django_capture_on_commit_callbacks(execute=False):
        scheduler._sweep()

    assert Node.objects.get(pk=node.pk).state == NodeState.READY


@pytest.mark.parametrize("held", [NodeState.CORDONED, NodeState.DRAINING, NodeState.READY])
def test_a_node_that_falls_silent_comes_back_as_staff_left_it(settings, held, django_capture_on_commit_callbacks):
    """A cordon or a drain is staff's decision; a node (its agent hostile, or only unlucky) that stays
    silent past the grace period must not come back READY and take new replicas and their credentials."""
    from endpoints.fleet.services import record_heartbeat
    from gpu_agent.protocol import Heartbeat

    settings.NODE_HEARTBEAT_GRACE_S = 30
    node = make_node(memory_mb=80_000)
    Node.objects.filter(pk=node.pk).update(state=held, last_heartbeat_at=timezone.now() - timedelta(seconds=31))
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    node.refresh_from_db()
    assert node.state == NodeState.OFFLINE
    answer = record_heartbeat(node, Heartbeat(agent_version="0.1.0", num_cpus=2, memory_mb=24_000, memory_used_mb=1_000))
    node.refresh_from_db()
    assert node.state == held and answer.node_state == held
    assert node.state_before_offline == ""


def test_a_replica_starting_too_long_fails_with_the_reason(settings, django_capture_on_commit_callbacks):
    settings.REPLICA_START_TIMEOUT_S = 60
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1)
    make_node(memory_mb=80_000)
    scheduler.reconcile_endpoint(str(endpoint.pk), load())
    Replica.objects.update(state=ReplicaState.STARTING, created_at=timezone.now() - timedelta(seconds=61))
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    replica = Replica.objects.get(endpoint=endpoint)
    assert replica.state == "FAILED" and replica.failure_reason == "did not become READY within 60 s"


def test_a_long_ready_replica_whose_engine_crashed_gets_its_whole_start_timeout_to_restart(
        settings, django_capture_on_commit_callbacks):
    # The agent restarts a crashed engine itself (its weights cached) and reports the replica STARTING. The stuck
    # sweep timed a STARTING replica from its creation: one READY for longer than the timeout failed at the next sweep
    # as "did not become READY within 900 s", its restart thrown away, counted as a failure of its endpoint.
    from endpoints.replicas import apply_replica_report
    from gpu_agent.protocol import ReplicaStatus

    settings.REPLICA_START_TIMEOUT_S = 60
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1)
    node = make_node(memory_mb=80_000)
    scheduler.reconcile_endpoint(str(endpoint.pk), load())
    an_hour_ago = timezone.now() - timedelta(hours=1)
    Replica.objects.update(state=ReplicaState.READY, created_at=an_hour_ago, ready_at=an_hour_ago,
                           state_changed_at=an_hour_ago)
    replica = Replica.objects.get(endpoint=endpoint)

    apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.STARTING, num_restarts=1,
                                             failure_reason="engine exited with code -9"))
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()

    replica.refresh_from_db()
    assert (replica.state, replica.failure_reason) == (ReplicaState.STARTING, "")
    Replica.objects.update(state_changed_at=timezone.now() - timedelta(seconds=61))  # the restart never came up
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    replica.refresh_from_db()
    assert (replica.state, replica.failure_reason) == (ReplicaState.FAILED, "did not become READY within 60 s")


@pytest.mark.django_db(transaction=True)
def test_no_reader_sees_an_offline_node_whose_replicas_still_look_ready(settings, monkeypatch):
    # Found by the scaling test on a busy machine: the node's OFFLINE was committed before its replicas failed,
    # so a reader in between (the gateway's replica list, the console, a test) saw it OFFLINE and them READY.
    settings.NODE_HEARTBEAT_GRACE_S = 30
    endpoint, silent, replica = _a_ready_replica_on_a_silent_node(31)
    seen = []

    def read_elsewhere():
        # Another connection, as another process would read, while the sweep is between its writes.
        try:
            seen.append((Node.objects.get(pk=silent.pk).state, Replica.objects.get(pk=replica.pk).state))
        finally:
            connection.close()

    real_fail_replica = scheduler.fail_replica

    def fail_replica(*args, **kwargs):
        reader = threading.Thread(target=read_elsewhere)
        reader.start()
        reader.join()
        return real_fail_replica(*args, **kwargs)

    monkeypatch.setattr(scheduler, "fail_replica", fail_replica)
    scheduler.sweep_stuck()
    assert seen and all(not (node == NodeState.OFFLINE and state == ReplicaState.READY) for node, state in seen), seen
    replica.refresh_from_db()
    assert replica.state == ReplicaState.FAILED


def _two_silent_nodes(seconds: float, *, swept_ago: float):
    """Two nodes, each with a READY replica, whose last heartbeats are `seconds` old; the last sweep `swept_ago`."""
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=2, max_replicas=2)
    nodes = [make_node(memory_mb=80_000), make_node(memory_mb=80_000)]
    scheduler.reconcile_endpoint(str(endpoint.pk), load())
    Replica.objects.filter(endpoint=endpoint).update(state=ReplicaState.READY)
    Node.objects.filter(pk__in=[node.pk for node in nodes]).update(last_heartbeat_at=timezone.now() - timedelta(seconds=seconds))
    NodeSweep.objects.update_or_create(pk=NodeSweep.ROW, defaults={"swept_at": timezone.now() - timedelta(seconds=swept_ago)})
    return endpoint, nodes


def _nodes_silent_since_an_outage(seconds: float):
    """PostgreSQL was down `seconds` (no heartbeat could be written, the sweeps could not read it either) and came
    back a moment ago; the agents are still backing off."""
    return _two_silent_nodes(seconds, swept_ago=seconds)


def test_a_database_outage_longer_than_the_grace_period_takes_no_node_offline(settings, django_capture_on_commit_callbacks):
    # Every agent's heartbeats failed while PostgreSQL was down, and each backed off (up to 60 s): the first sweep
    # after it came back took the whole fleet OFFLINE and failed every replica, every tenant cold again.
    settings.NODE_HEARTBEAT_GRACE_S = 30
    endpoint, nodes = _nodes_silent_since_an_outage(45)

    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
        scheduler.sweep_stuck()  # the next one, too: the agents still have time to beat again

    assert set(Node.objects.filter(pk__in=[node.pk for node in nodes]).values_list("state", flat=True)) == {NodeState.READY}
    assert set(Replica.objects.filter(endpoint=endpoint).values_list("state", flat=True)) == {ReplicaState.READY}


def test_a_database_outage_during_which_redis_lost_its_memory_takes_no_node_offline(settings,
                                                                                     django_capture_on_commit_callbacks):
    # When the sweeps last ended was kept in Redis: restarted without its data during the outage, it read as no gap.
    # The first agent to beat again ended the whole-fleet hold, and one still in its backoff went OFFLINE, its
    # replicas FAILED.
    settings.NODE_HEARTBEAT_GRACE_S = 30
    endpoint, (beating, backing_off) = _nodes_silent_since_an_outage(45)
    get_redis().flushdb()  # Redis restarted without its data while PostgreSQL was down
    Node.objects.filter(pk=beating.pk).update(last_heartbeat_at=timezone.now())  # its agent's retry came first

    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()

    assert Node.objects.get(pk=backing_off.pk).state == NodeState.READY
    assert set(Replica.objects.filter(endpoint=endpoint).values_list("state", flat=True)) == {ReplicaState.READY}


def test_a_node_still_silent_once_agents_had_time_to_beat_again_goes_offline(settings, django_capture_on_commit_callbacks):
    settings.NODE_HEARTBEAT_GRACE_S = 30
    _, nodes = _nodes_silent_since_an_outage(45)
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    beating, dead = nodes
    Node.objects.filter(pk=beating.pk).update(last_heartbeat_at=timezone.now())
    redis = get_redis()
    redis.set(redis_keys.LISTENING_SINCE_KEY,
              float(redis.get(redis_keys.LISTENING_SINCE_KEY)) - settings.NODE_HEARTBEAT_RETRY_S - settings.NODE_HEARTBEAT_GRACE_S)

    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()

    assert Node.objects.get(pk=beating.pk).state == NodeState.READY
    assert Node.objects.get(pk=dead.pk).state == NodeState.OFFLINE


def _web_beats_stopped(seconds_ago: float) -> None:
    """Web processes beat (`presence.beat`) until `seconds_ago`, as the sweeps saw; none since."""
    redis = get_redis()
    redis.set(redis_keys.WEB_BEATS_KEY, 500)
    redis.hset(redis_keys.WEB_BEATS_SEEN_KEY, mapping={"beats": 500, "at": time.time() - seconds_ago})


def _nodes_silent_while_the_web_tier_is_down(seconds: float):
    """Two nodes with a READY replica each, unheard for `seconds` because every web pod is down (a bad deploy
    crash-looping, say): the sweeps themselves ran all along."""
    endpoint, nodes = _two_silent_nodes(seconds, swept_ago=5)
    _web_beats_stopped(seconds)
    return endpoint, nodes


def test_the_web_tier_down_takes_no_node_offline_and_its_return_gives_agents_time_to_beat(settings, django_capture_on_commit_callbacks):
    # The agents' heartbeats go to the web tier. With every web pod down past the grace period, the sweeps (on the
    # worker, PostgreSQL fine) found every node silent: the whole fleet OFFLINE, every replica failed, every tenant
    # cold again once the web tier came back.
    settings.NODE_HEARTBEAT_GRACE_S = 30
    endpoint, nodes = _nodes_silent_while_the_web_tier_is_down(300)

    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    assert set(Node.objects.filter(pk__in=[node.pk for node in nodes]).values_list("state", flat=True)) == {NodeState.READY}
    assert set(Replica.objects.filter(endpoint=endpoint).values_list("state", flat=True)) == {ReplicaState.READY}

    # A web process beats again: one agent beats at once, the other never does.
    get_redis().incr(redis_keys.WEB_BEATS_KEY)
    beating, dead = nodes
    Node.objects.filter(pk=beating.pk).update(last_heartbeat_at=timezone.now())
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    assert Node.objects.get(pk=dead.pk).state == NodeState.READY, "its agent has its retry and grace to beat again"

    redis = get_redis()
    redis.set(redis_keys.LISTENING_SINCE_KEY,
              float(redis.get(redis_keys.LISTENING_SINCE_KEY)) - settings.NODE_HEARTBEAT_RETRY_S - settings.NODE_HEARTBEAT_GRACE_S)
    redis.incr(redis_keys.WEB_BEATS_KEY)
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    assert Node.objects.get(pk=beating.pk).state == NodeState.READY
    assert Node.objects.get(pk=dead.pk).state == NodeState.OFFLINE


def test_a_silent_node_goes_offline_while_the_web_tier_beats(settings, django_capture_on_commit_callbacks):
    settings.NODE_HEARTBEAT_GRACE_S = 30
    _, nodes = _nodes_silent_while_the_web_tier_is_down(45)
    get_redis().incr(redis_keys.WEB_BEATS_KEY)  # it was never down: its count moved since the last sweep
    make_node(memory_mb=80_000)  # and a third node is heard (every node silent at once is held: the next test)
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    assert set(Node.objects.filter(pk__in=[node.pk for node in nodes]).values_list("state", flat=True)) == {NodeState.OFFLINE}


def test_every_node_silent_at_once_while_the_web_tier_beats_takes_no_node_offline(settings, django_capture_on_commit_callbacks):
    # The web tier up but refusing heartbeats (a bad deploy whose heartbeat view fails; a network policy cutting the
    # nodes off from the web pods): web processes beat, every agent's heartbeat fails, and the sweeps took the whole
    # fleet OFFLINE and failed every replica, every tenant cold once the fault was fixed.
    settings.NODE_HEARTBEAT_GRACE_S = 30
    settings.NODE_FLEET_SILENCE_HOLD_S = 600
    endpoint, nodes = _two_silent_nodes(45, swept_ago=5)
    # The agents beat at staggered times: the second was last heard a few seconds after the first.
    Node.objects.filter(pk=nodes[1].pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=27))
    get_redis().incr(redis_keys.WEB_BEATS_KEY)

    for _ in range(2):
        with django_capture_on_commit_callbacks(execute=False):
            scheduler.sweep_stuck()
        get_redis().incr(redis_keys.WEB_BEATS_KEY)
    assert set(Node.objects.filter(pk__in=[node.pk for node in nodes]).values_list("state", flat=True)) == {NodeState.READY}
    assert set(Replica.objects.filter(endpoint=endpoint).values_list("state", flat=True)) == {ReplicaState.READY}

    # Bounded: a fleet truly lost is judged once the hold has passed, so that its endpoints are placed again.
    redis = get_redis()
    redis.set(redis_keys.FLEET_SILENT_SINCE_KEY, float(redis.get(redis_keys.FLEET_SILENT_SINCE_KEY)) - 601)
    Node.objects.filter(pk=nodes[1].pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=45))
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    assert set(Node.objects.filter(pk__in=[node.pk for node in nodes]).values_list("state", flat=True)) == {NodeState.OFFLINE}


def test_a_second_fleet_silence_after_one_that_healed_is_held_again(settings, django_capture_on_commit_callbacks):
    # The first silence's start stayed in Redis once every node beat again: a second one, an hour later, was judged
    # at once, the whole fleet taken OFFLINE (the review of this change).
    settings.NODE_HEARTBEAT_GRACE_S = 30
    settings.NODE_FLEET_SILENCE_HOLD_S = 600
    _, nodes = _two_silent_nodes(45, swept_ago=5)
    ids = [node.pk for node in nodes]
    get_redis().incr(redis_keys.WEB_BEATS_KEY)
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    Node.objects.filter(pk__in=ids).update(last_heartbeat_at=timezone.now())  # the fault is fixed: every node beats
    get_redis().incr(redis_keys.WEB_BEATS_KEY)
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    redis = get_redis()
    if redis.get(redis_keys.FLEET_SILENT_SINCE_KEY) is not None:  # an hour passes
        redis.set(redis_keys.FLEET_SILENT_SINCE_KEY, float(redis.get(redis_keys.FLEET_SILENT_SINCE_KEY)) - 3600)

    Node.objects.filter(pk__in=ids).update(last_heartbeat_at=timezone.now() - timedelta(seconds=45))  # again
    get_redis().incr(redis_keys.WEB_BEATS_KEY)
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    assert set(Node.objects.filter(pk__in=ids).values_list("state", flat=True)) == {NodeState.READY}


def test_one_node_silent_among_beating_ones_goes_offline_at_once(settings, django_capture_on_commit_callbacks):
    settings.NODE_HEARTBEAT_GRACE_S = 30
    _, (beating, dead) = _two_silent_nodes(45, swept_ago=5)
    Node.objects.filter(pk=beating.pk).update(last_heartbeat_at=timezone.now())
    get_redis().incr(redis_keys.WEB_BEATS_KEY)
    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()
    assert Node.objects.get(pk=beating.pk).state == NodeState.READY
    assert Node.objects.get(pk=dead.pk).state == NodeState.OFFLINE


def test_a_web_process_beat_counts_for_the_sweeps():
    import asyncio

    from endpoints.gateway import presence

    asyncio.run(presence.beat(web=True))
    asyncio.run(presence.beat(web=True))
    asyncio.run(presence.beat())  # a batch worker's: its lines say nothing of who hears the agents
    assert get_redis().get(redis_keys.WEB_BEATS_KEY) == "2"
    assert not scheduler.web_tier_silent(get_redis(), time.time())


def test_redis_emptied_does_not_slow_node_failure_down(settings, django_capture_on_commit_callbacks):
    settings.NODE_HEARTBEAT_GRACE_S = 30
    node = make_node(memory_mb=80_000)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=31))
    get_redis().flushdb()

    with django_capture_on_commit_callbacks(execute=False):
        scheduler.sweep_stuck()

    assert Node.objects.get(pk=node.pk).state == NodeState.OFFLINE


@pytest.mark.django_db(transaction=True)
def test_a_scale_up_whose_organisation_is_held_by_a_key_revocation_skips_this_tick_and_places_at_the_next():
    """The tick reconciles every endpoint in turn, and a scale-up waited for its organisation's row: behind one
    tenant's key revocation (12 s with 3,000 minted keys to walk), every tenant's scale-up waited."""
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1, max_replicas=1)
    make_node(memory_mb=80_000)
    held, release = threading.Event(), threading.Event()

    def hold_the_organisation_as_a_revocation_does():
        try:
            with transaction.atomic():
                Organization.objects.select_for_update(no_key=True).filter(pk=endpoint.organization_id).first()
                held.set()
                release.wait(timeout=60)
        finally:
            connection.close()

    holding = threading.Thread(target=hold_the_organisation_as_a_revocation_does)
    holding.start()
    try:
        held.wait(timeout=60)
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '2s'")  # a wait on the row fails the test instead
        scheduler.reconcile_endpoint(str(endpoint.pk), load(), in_a_tick=True)
        assert not endpoint.replicas.exists()
        # The endpoint's own task (a request waking it) waits for the row instead of leaving the wake to the next
        # tick: with the row still held, its wait is the lock's timeout.
        with pytest.raises(OperationalError, match="lock timeout"), transaction.atomic():
            scheduler.reconcile_endpoint(str(endpoint.pk), load())
    finally:
        release.set()
        holding.join(timeout=60)
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")

    scheduler.reconcile_endpoint(str(endpoint.pk), load())
    assert endpoint.replicas.count() == 1
