"""A call for an endpoint whose replica sleeps (vLLM sleep mode) is held, the replica woken, and the call
goes through; its cold-start anatomy says "wake", not a start. Live gateway, real PostgreSQL and Redis;
the agent's part (its report of READY once `/wake_up` answered) and the wake task (a reconcile) are played
here, as in the other hold tests."""

from __future__ import annotations

import time

from billing.models import UsageRecord
from controlplane.redis_client import get_redis
from controlplane.redis_keys import wake_key
from endpoints import scheduler
from endpoints.autoscaler import Load
from endpoints.models import Replica
from endpoints.replicas import apply_replica_report
from gpu_agent.protocol import ReplicaState, ReplicaStatus
from tests.conftest import wait_until
from tests.gateway.conftest import held_chat, serve_endpoint

ENGINE_WAKE_S = 0.3  # how long the stand-in engine takes to answer /wake_up


def test_a_call_to_a_sleeping_endpoint_is_held_wakes_its_replica_and_goes_through(
        gateway, tenant, start_mock_upstream, settings):
    settings.SLEEP_MODE = True
    address = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, address, idle_action="sleep")
    replica = Replica.objects.get(endpoint=endpoint)
    node = replica.node
    scheduler.reconcile_endpoint(str(endpoint.pk), Load(0, 0, time.time() - 3600, 0))  # idle: it sleeps
    replica.refresh_from_db()
    assert replica.state == ReplicaState.SLEEPING

    answer = held_chat(gateway, tenant.key, endpoint)  # held, not routed to the sleeping engine
    wait_until(lambda: get_redis().exists(wake_key(str(endpoint.pk))), 10, message="the gateway's wake")

    # The wake task: a reconcile reading the held call as load, which wakes the sleeper rather than placing one.
    scheduler.reconcile_endpoint(str(endpoint.pk))
    assert list(Replica.objects.filter(endpoint=endpoint).values_list("state", flat=True)) == [ReplicaState.STARTING]
    time.sleep(ENGINE_WAKE_S)
    apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY, address=address))
    response = answer.result(60)
    assert response.status_code == 200, response.text
    waited_ms = int(response.headers["x-inferplane-cold-start-ms"])
    row = wait_until(lambda: UsageRecord.objects.filter(endpoint=endpoint).first(), 30, message="the usage row")
    phases = row.cold_start_phases
    assert sum(phases.values()) == row.cold_start_ms == waited_ms
    assert phases["wake"] >= ENGINE_WAKE_S * 1000 - 50, phases
    assert phases["placement"] == phases["download"] == phases["engine"] == 0, phases
