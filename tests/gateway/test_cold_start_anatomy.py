"""A cold start's anatomy: the held request's answer says how long it waited, its usage row splits
the wait by phase (summing to it), and `/metrics` has a histogram per phase."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from django.utils import timezone

from billing.models import UsageRecord
from controlplane.redis_client import get_redis
from endpoints.gateway import anatomy
from endpoints.models import Replica
from endpoints.nodes.models import Node
from endpoints.nodes.notify import endpoint_ready_channel
from endpoints.replicas import apply_replica_report
from gpu_agent.protocol import ReplicaState, ReplicaStatus
from tests.conftest import start_web_server, wait_until
from tests.factories import EndpointFactory
from tests.gateway.conftest import held_chat, serve_endpoint

METRICS_TOKEN = "t" * 40
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_a_request_that_started_the_cold_start_sees_every_phase_in_order():
    replica = anatomy.ReplicaTimeline(placed_at=at(1), ready_at=at(10), download_s=4.0, engine_start_s=3.0)
    cold = anatomy.split(at(0), at(10.5), replica)
    assert cold.total_ms == 10_500
    assert cold.phases == {"queue": 1000, "placement": 2000, "download": 4000, "engine": 3000, "wake": 0, "first_token": 500}


def test_a_request_held_midway_counts_only_the_part_of_the_cold_start_it_waited_for():
    replica = anatomy.ReplicaTimeline(placed_at=at(0), ready_at=at(10), download_s=4.0, engine_start_s=3.0)
    cold = anatomy.split(at(5), at(11), replica)  # held while the weights were downloading
    assert cold.total_ms == 6000
    assert cold.phases == {"queue": 0, "placement": 0, "download": 2000, "engine": 3000, "wake": 0, "first_token": 1000}


def test_phases_always_sum_to_the_wait_even_when_the_agent_reports_more_than_the_replica_took():
    replica = anatomy.ReplicaTimeline(placed_at=at(1), ready_at=at(3), download_s=40.0, engine_start_s=30.0)
    cold = anatomy.split(at(0), at(4), replica)
    assert sum(cold.phases.values()) == cold.total_ms == 4000
    assert cold.phases["queue"] == 1000 and cold.phases["first_token"] == 1000


def test_a_replica_the_gateway_cannot_find_leaves_the_whole_wait_as_queueing():
    cold = anatomy.split(at(0), at(2), None)
    assert cold.phases == {"queue": 2000, "placement": 0, "download": 0, "engine": 0, "wake": 0, "first_token": 0}


def test_a_wake_from_sleep_is_recorded_as_a_wake_not_a_start():
    # Placed long ago; asleep; a request held at 100 s wakes it at 100.2 s, READY at 101 s.
    replica = anatomy.ReplicaTimeline(placed_at=at(0), ready_at=at(101), download_s=4.0, engine_start_s=3.0,
                                      woken_at=at(100.2))
    cold = anatomy.split(at(100), at(101.5), replica)
    assert cold.total_ms == 1500
    assert cold.phases == {"queue": 200, "placement": 0, "download": 0, "engine": 0, "wake": 800, "first_token": 500}


@pytest.mark.parametrize(("download_s", "engine_start_s"), [
    (float("nan"), 3.0), (4.0, float("inf")), (1e308, -1e308), (-5.0, float("-inf")),
])
def test_an_agents_odd_measure_stored_before_the_protocol_refused_it_splits_as_if_unknown(download_s, engine_start_s):
    replica = anatomy.ReplicaTimeline(placed_at=at(1), ready_at=at(10), download_s=download_s, engine_start_s=engine_start_s)
    cold = anatomy.split(at(0), at(10.5), replica)
    assert sum(cold.phases.values()) == cold.total_ms == 10_500 and cold.phases["queue"] == 1000


def test_a_held_answer_whose_replica_holds_non_finite_measures_is_answered_and_billed(
        gateway, tenant, start_mock_upstream):
    # Stored by an agent before the protocol refused them: the cold start's split raised past the usage row.
    cold = EndpointFactory(organization=tenant.org, max_model_len=2048)
    answer = held_chat(gateway, tenant.key, cold)
    ready = serve_endpoint(tenant.org, start_mock_upstream())
    now = timezone.now()
    Replica.objects.filter(endpoint=ready).update(endpoint=cold, created_at=now, ready_at=now, download_s=float("nan"),
                                                  engine_start_s=1e308)
    get_redis().publish(endpoint_ready_channel(cold.pk), "1")
    response = answer.result(60)
    assert response.status_code == 200, response.text
    row = wait_until(lambda: UsageRecord.objects.filter(endpoint=cold).first(), 30, message="the usage row")
    assert row.completion_tokens > 0 and sum(row.cold_start_phases.values()) == row.cold_start_ms


@pytest.fixture
def gateway_with_metrics(transactional_db, tmp_path, web_zygote):
    child, base_url = start_web_server(tmp_path, name="gateway", extra_env={"INFERPLANE_METRICS_TOKEN": METRICS_TOKEN},
                                       zygote=web_zygote)
    yield base_url
    child.stop()


def test_a_held_answer_carries_its_cold_start_and_its_usage_row_splits_it_by_phase(
        gateway_with_metrics, tenant, start_mock_upstream):
    cold = EndpointFactory(organization=tenant.org, max_model_len=2048)
    answer = held_chat(gateway_with_metrics, tenant.key, cold)
    ready = serve_endpoint(tenant.org, start_mock_upstream())
    now = timezone.now()
    Replica.objects.filter(endpoint=ready).update(endpoint=cold, created_at=now, ready_at=now, download_s=0.0,
                                                  engine_start_s=0.0)
    get_redis().publish(endpoint_ready_channel(cold.pk), "1")
    response = answer.result(60)
    assert response.status_code == 200, response.text
    waited_ms = int(response.headers["x-inferplane-cold-start-ms"])
    row = wait_until(lambda: UsageRecord.objects.filter(endpoint=cold).first(), 30, message="the usage row")
    assert row.cold_start_ms == waited_ms >= 0
    assert set(row.cold_start_phases) == set(anatomy.PHASES)
    assert sum(row.cold_start_phases.values()) == waited_ms
    assert row.cold_start_ms >= round(row.cold_start_s * 1000) - 1  # held until the first token, past READY

    metrics = httpx.get(f"{gateway_with_metrics}/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}).text
    for phase in anatomy.PHASES:
        assert f'inferplane_cold_start_phase_seconds_count{{phase="{phase}"}}' in metrics


def test_an_answer_from_a_ready_replica_has_no_cold_start(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    response = httpx.post(f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {tenant.key}"},
                          json={"model": endpoint.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})
    assert response.status_code == 200
    assert "x-inferplane-cold-start-ms" not in response.headers
    row = wait_until(lambda: UsageRecord.objects.filter(endpoint=endpoint).first(), 30, message="the usage row")
    assert row.cold_start_ms is None and row.cold_start_phases is None


@pytest.mark.django_db
def test_the_control_plane_keeps_the_agents_download_and_engine_start_times_once_heard():
    endpoint = EndpointFactory()
    node = Node.objects.create(name="n", gpu_type="l4", num_gpus=1, gpu_memory_mb=24_000, secret_lookup="0" * 12,
                               secret_digest="x", quantizations=["none"])
    replica = Replica.objects.create(endpoint=endpoint, node=node)
    apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.STARTING, download_s=1.5))
    apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.STARTING, download_s=1.5,
                                             engine_start_s=2.25))
    apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.STARTING))
    replica.refresh_from_db()
    assert (replica.download_s, replica.engine_start_s) == (1.5, 2.25)


def _hold_then_serve(base_url, tenant, start_mock_upstream, call):
    """Runs `call(endpoint_name)` in a thread, makes a replica READY once the gateway holds it; its result."""
    cold = EndpointFactory(organization=tenant.org, max_model_len=2048)
    result = {}

    def run():
        try:
            result["value"] = call(cold.name)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: get_redis().pubsub_numsub(endpoint_ready_channel(cold.pk))[0][1] == 1 or not thread.is_alive(),
               30, message="the request to be held")
    ready = serve_endpoint(tenant.org, start_mock_upstream())
    Replica.objects.filter(endpoint=ready).update(endpoint=cold)
    get_redis().publish(endpoint_ready_channel(cold.pk), "1")
    thread.join(60)
    assert "error" not in result, result
    return result["value"]


def test_the_openai_client_reads_a_held_answer_as_ever_with_the_cold_start_in_its_headers(
        gateway, tenant, start_mock_upstream):
    client = tenant.client(gateway, timeout=60)
    raw = _hold_then_serve(gateway, tenant, start_mock_upstream, lambda model: client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5))
    assert int(raw.headers["x-inferplane-cold-start-ms"]) >= 0
    assert raw.parse().choices[0].message.content == "tok tok tok tok tok"


def test_a_held_request_that_asks_for_progress_gets_whitespace_then_its_json(gateway, tenant, start_mock_upstream):
    def call(model):
        with httpx.stream("POST", f"{gateway}/v1/chat/completions", timeout=60,
                          headers={"authorization": f"Bearer {tenant.key}", "x-inferplane-progress": "1"},
                          json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}) as r:
            return r.status_code, r.headers.get("content-type"), [chunk for chunk in r.iter_bytes()]

    status, content_type, chunks = _hold_then_serve(gateway, tenant, start_mock_upstream, call)
    body = b"".join(chunks)
    assert status == 200 and content_type == "application/json"
    assert body.startswith(b" ")  # sent while held, before the replica was READY
    assert json.loads(body)["choices"][0]["message"]["content"] == "tok tok tok tok tok"
