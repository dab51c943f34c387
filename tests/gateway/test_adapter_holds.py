"""Calls held while a LoRA adapter loads (`endpoints.gateway.adapter_hold`), against mock engines: held as a cold
start is, within the same bounds (the plan's `max_held_requests`, the process's), counted waiting, on the process's
one wait for the endpoint, and answered once a replica reports the adapter loaded; an adapter an engine refused is a
400 `adapter_failed` with the engine's reason at once, holding and billing nothing.

Before, an adapter call on a READY endpoint took no place (12 calls on a plan of 1: all held), each polled PostgreSQL
itself (5 commits/s idle, 140-185 with 12 held), and one naming a FAILED adapter was held the endpoint's whole cold
start timeout, then answered 503 "not loaded yet"."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from django.db import connection

from billing.models import UsageRecord
from controlplane.accounts.models import Plan
from controlplane.accounts.services import SYSTEM, save_plan, set_organization_plan
from controlplane.redis_client import get_redis
from controlplane.redis_keys import reservations_key, waiting_key
from endpoints.adapters import record_replica_adapters
from endpoints.models import Adapter, AdapterState, Replica
from gpu_agent.protocol import ReplicaState, ReplicaStatus
from tests.conftest import start_web_server
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

# NOTE: one organisation alone holds half of the process's places (`cold_start._may_hold_here`): two of four.
PROCESS_BOUND = 4


@pytest.fixture
def bounded_gateway(transactional_db, tmp_path, web_zygote):
    # NOTE: forked from the zygote of its settings (started anew, each paid the imports: ~1.4 s)
    child, base_url = start_web_server(tmp_path, name="gateway", zygote=web_zygote,
                                       extra_env={"INFERPLANE_MAX_HELD_REQUESTS_PER_PROCESS": str(PROCESS_BOUND)})
    yield base_url
    child.stop()


def _lora_endpoint(tenant, upstream, *, cold_start_timeout_s: int = 30, **adapter):
    endpoint = serve_endpoint(tenant.org, upstream, name="base", max_loras=2, max_lora_rank=16,
                              cold_start_timeout_s=cold_start_timeout_s)
    Adapter.objects.create(endpoint=endpoint, name="slow", source="hf:acme/slow", **adapter)  # no replica holds it
    return endpoint


def _call(base_url: str, tenant) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/chat/completions", headers={"authorization": f"Bearer {tenant.key}"},
                      json={"model": "base:slow", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5},
                      timeout=60)


def _calls_in_background(base_url: str, tenant, num_calls: int) -> tuple[list[threading.Thread], list[httpx.Response]]:
    answers: list[httpx.Response] = []

    def call():
        answers.append(_call(base_url, tenant))
        connection.close()

    threads = [threading.Thread(target=call, daemon=True) for _ in range(num_calls)]
    for thread in threads:
        thread.start()
    return threads, answers


def _report(endpoint, **status) -> None:
    """The endpoint's replica's agent reports its adapters (loaded, or refused)."""
    replica = Replica.objects.get(endpoint=endpoint)
    record_replica_adapters(replica.node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY, **status))


def _commits() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
        return cursor.fetchone()[0]


def _wait_until(condition, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_calls_held_for_an_adapter_take_the_plans_places_and_go_once_it_loads(
        bounded_gateway, tenant, start_mock_upstream):
    set_organization_plan(SYSTEM, tenant.org, save_plan(SYSTEM, Plan(name="one-held", max_held_requests=1)))
    upstream = start_mock_upstream()
    endpoint = _lora_endpoint(tenant, upstream)
    threads, answers = _calls_in_background(bounded_gateway, tenant, 5)
    _wait_until(lambda: len(answers) >= 4)  # before: all 5 held
    assert [(a.status_code, a.json()["error"]["code"]) for a in answers] == [(429, "rate_limit_exceeded")] * 4
    # counted waiting, as a cold start (its place is taken before admission, its waiting entry just after)
    _wait_until(lambda: get_redis().zcard(waiting_key(tenant.org.pk, str(endpoint.pk))) == 1)

    _report(endpoint, adapters=["slow"])
    for thread in threads:
        thread.join(30)
    assert sorted(a.status_code for a in answers) == [200, 429, 429, 429, 429]
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 1
    assert get_redis().zcard(waiting_key(tenant.org.pk, str(endpoint.pk))) == 0


def test_calls_held_for_an_adapter_count_against_the_processs_bound(bounded_gateway, tenant, start_mock_upstream):
    upstream = start_mock_upstream()
    endpoint = _lora_endpoint(tenant, upstream, cold_start_timeout_s=3)
    threads, answers = _calls_in_background(bounded_gateway, tenant, PROCESS_BOUND)
    _wait_until(lambda: len(answers) >= 2)  # before: all 4 held
    assert [(a.status_code, a.json()["error"]["code"]) for a in answers] == [(503, "no_capacity")] * 2
    for thread in threads:
        thread.join(30)
    assert sorted(a.json()["error"]["code"] for a in answers) == ["adapter_loading"] * 2 + ["no_capacity"] * 2
    assert Adapter.objects.get(endpoint=endpoint).last_requested_at is not None  # asked for


RATE_WINDOW_S = 2.0  # how long the database's commits are counted, idle and with the calls held


def test_calls_held_for_an_adapter_share_one_wait_and_leave_the_database_quiet(gateway, tenant, start_mock_upstream):
    upstream = start_mock_upstream()
    # NOTE: each rate over 2 s (3 s before): the bound (20 commits/s more held) is seven times below what the 12 held
    # calls cost before (140), and a hold that ends 6 s after its call's start (8 s before) still outlasts the window
    # (it ends 4 s in) by 2 s.
    _lora_endpoint(tenant, upstream, cold_start_timeout_s=6)
    time.sleep(1.0)
    before = _commits()
    time.sleep(RATE_WINDOW_S)
    idle_rate = (_commits() - before) / RATE_WINDOW_S
    threads, answers = _calls_in_background(gateway, tenant, 12)
    time.sleep(2.0)
    before = _commits()
    time.sleep(RATE_WINDOW_S)
    held_rate = (_commits() - before) / RATE_WINDOW_S
    assert not answers
    for thread in threads:
        thread.join(30)
    assert [a.json()["error"]["code"] for a in answers] == ["adapter_loading"] * 12
    # before: 140 commits/s more with the 12 held (each read the replicas and marked the adapter 4 times a second)
    assert held_rate - idle_rate < 20, (idle_rate, held_rate)


def test_a_call_naming_an_adapter_its_engine_refused_is_a_400_at_once_holding_and_billing_nothing(
        gateway, tenant, start_mock_upstream):
    upstream = start_mock_upstream()
    _lora_endpoint(tenant, upstream, cold_start_timeout_s=20, state=AdapterState.FAILED,
                   status_message="target modules do not match the base model")
    started = time.monotonic()
    answer = _call(gateway, tenant)
    took_s = time.monotonic() - started
    # before: held the endpoint's 20 s, then 503 adapter_loading with retry-after
    assert answer.status_code == 400 and took_s < 5, (answer.status_code, took_s)
    error = answer.json()["error"]
    assert error["code"] == "adapter_failed" and error["param"] == "model"
    assert "target modules do not match the base model" in error["message"]
    assert get_redis().hlen(reservations_key(tenant.org.pk)) == 0
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 0 and not UsageRecord.objects.exists()


def test_a_call_held_for_an_adapter_the_engine_then_refuses_is_a_400_once_it_is_reported(
        gateway, tenant, start_mock_upstream):
    upstream = start_mock_upstream()
    endpoint = _lora_endpoint(tenant, upstream, cold_start_timeout_s=30)
    threads, answers = _calls_in_background(gateway, tenant, 1)
    _wait_until(lambda: Adapter.objects.get(endpoint=endpoint).last_requested_at is not None)
    _report(endpoint, adapter_failures={"slow": "LoRA rank 64 is greater than max_lora_rank 16."})
    reported = time.monotonic()
    threads[0].join(30)
    assert answers[0].status_code == 400 and time.monotonic() - reported < 5  # before: held the 30 s, then a 503
    assert answers[0].json()["error"]["code"] == "adapter_failed"
    assert "greater than max_lora_rank" in answers[0].json()["error"]["message"]
    assert get_redis().hlen(reservations_key(tenant.org.pk)) == 0 and not UsageRecord.objects.exists()


HUB_DOWN = "cannot reach the Hub for hf:acme/slow (it answered 503) (tried again in 60 s)"


def test_a_call_during_a_failure_its_agent_tries_again_is_held_and_served_once_the_retry_loads_it(
        gateway, tenant, start_mock_upstream):
    upstream = start_mock_upstream()
    endpoint = _lora_endpoint(tenant, upstream, cold_start_timeout_s=30)
    _report(endpoint, adapter_failures={"slow": HUB_DOWN}, adapter_failures_retried=["slow"])
    adapter = Adapter.objects.get(endpoint=endpoint)
    assert (adapter.state, adapter.failure_retried) == (AdapterState.FAILED, True)
    threads, answers = _calls_in_background(gateway, tenant, 1)
    _wait_until(lambda: get_redis().zcard(waiting_key(tenant.org.pk, str(endpoint.pk))) == 1)
    assert not answers  # before: a 400 adapter_failed at once, which SDKs do not retry
    _report(endpoint, adapters=["slow"])
    threads[0].join(30)
    assert answers[0].status_code == 200, answers[0].text
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 1


def test_a_call_during_a_failure_its_agent_tries_again_is_a_503_to_retry_once_its_hold_times_out(
        gateway, tenant, start_mock_upstream):
    upstream = start_mock_upstream()
    # NOTE: a hold of 2 s (3 before): the one call is held, nothing races its end
    endpoint = _lora_endpoint(tenant, upstream, cold_start_timeout_s=2)
    _report(endpoint, adapter_failures={"slow": HUB_DOWN}, adapter_failures_retried=["slow"])
    answer = _call(gateway, tenant)
    # before: 400 adapter_failed
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "adapter_loading", answer.text
    assert answer.headers["retry-after"]
    assert get_redis().hlen(reservations_key(tenant.org.pk)) == 0 and not UsageRecord.objects.exists()


def test_a_standing_refusal_after_a_failure_tried_again_is_a_400_and_an_older_agents_failure_stands(
        gateway, tenant, start_mock_upstream):
    upstream = start_mock_upstream()
    endpoint = _lora_endpoint(tenant, upstream, cold_start_timeout_s=30)
    _report(endpoint, adapter_failures={"slow": HUB_DOWN}, adapter_failures_retried=["slow"])
    threads, answers = _calls_in_background(gateway, tenant, 1)
    _wait_until(lambda: get_redis().zcard(waiting_key(tenant.org.pk, str(endpoint.pk))) == 1)
    # the retry fetched the files and the engine refused them: the held call is refused at once
    _report(endpoint, adapter_failures={"slow": "LoRA rank 64 is greater than max_lora_rank 16."})
    reported = time.monotonic()
    threads[0].join(30)
    assert answers[0].status_code == 400 and time.monotonic() - reported < 5
    assert answers[0].json()["error"]["code"] == "adapter_failed"
    assert Adapter.objects.get(endpoint=endpoint).failure_retried is False
    # an older agent names no failure it tries again: its failures stand, as they did
    replica = Replica.objects.get(endpoint=endpoint)
    report = ReplicaStatus.from_dict({"replica_id": str(replica.pk), "state": "READY",
                                      "adapter_failures": {"slow": "not a LoRA adapter"}})
    record_replica_adapters(replica.node, report)
    answer = _call(gateway, tenant)
    assert answer.status_code == 400 and "not a LoRA adapter" in answer.json()["error"]["message"]
