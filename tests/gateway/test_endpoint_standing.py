"""Calls to an endpoint that cannot start are told so at once; a client that asks to wait for capacity is held."""

import threading

import httpx
import openai
import pytest
from django.utils import timezone

from controlplane import redis_keys
from controlplane.redis_client import get_redis
from endpoints.models import Endpoint, Replica
from endpoints.nodes.models import Node
from gpu_agent.protocol import ReplicaState
from tests.conftest import wait_until
from tests.gateway.conftest import counting_openai_client, serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]
NO_ROOM = "waiting for capacity: no l4 node has 2816 MB of GPU memory free now"
# Long enough that a held call would outlast the client's own timeout: only a fast answer passes.
HOLD_S = 600


def call(gateway, tenant, endpoint, **headers):
    return httpx.post(f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}", **headers},
                      json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 2}, timeout=30)


def test_a_call_to_a_failed_endpoint_fails_at_once_with_the_reason(gateway, tenant):
    reason = "failed: max_model_len 4096 is above this model's context of 2048 tokens (its config.json)"
    endpoint = serve_endpoint(tenant.org, cold_start_timeout_s=HOLD_S, min_replicas=1,
                              failed_at=timezone.now(), status_message=reason)
    response = call(gateway, tenant, endpoint)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "endpoint_failed" and error["type"] == "server_error"
    assert reason.removeprefix("failed: ") in error["message"]  # once: "has failed … : max_model_len …"
    assert int(response.headers["retry-after"]) > 0
    assert get_redis().zcard(redis_keys.waiting_key(endpoint.organization_id, str(endpoint.pk))) == 0  # never held


def test_a_failed_endpoints_503_reads_once_and_names_the_ways_to_try_again(gateway, tenant):
    # Before: "has failed and is not starting replicas: failed: fetching weights ... Change its configuration or resume
    # it": the endpoint's status ("failed: ...") repeated the word, and "resume" named neither the console's Retry
    # button nor the API call.
    cause = "fetching weights from /models/missing failed: model directory /models/missing does not exist"
    endpoint = serve_endpoint(tenant.org, cold_start_timeout_s=HOLD_S, min_replicas=1,
                              failed_at=timezone.now(), status_message=f"failed: {cause}")
    message = call(gateway, tenant, endpoint).json()["error"]["message"]
    assert f"is not starting replicas: {cause}." in message
    assert "Retry" in message and f"/api/v1/endpoints/{endpoint.pk}/resume/" in message


def test_a_call_to_an_endpoint_waiting_for_capacity_fails_fast_with_retry_after_and_the_reason(gateway, tenant):
    endpoint = serve_endpoint(tenant.org, cold_start_timeout_s=HOLD_S, min_replicas=1,
                              waiting_for_capacity=True, status_message=NO_ROOM)
    response = call(gateway, tenant, endpoint)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "capacity_unavailable"
    assert NO_ROOM in error["message"] and "X-Inferplane-Wait-For-Capacity" in error["message"]
    # The soonest another try could see room: the scheduler's next tick, and this gateway's view catching up.
    assert 1 <= int(response.headers["retry-after"]) <= 10
    assert response.headers["x-should-retry"] == "false"


def test_the_official_client_is_told_of_no_capacity_at_once_instead_of_sleeping_to_retry(gateway, tenant, monkeypatch):
    endpoint = serve_endpoint(tenant.org, cold_start_timeout_s=HOLD_S, min_replicas=1,
                              waiting_for_capacity=True, status_message=NO_ROOM)
    client, sent, slept = counting_openai_client(f"{gateway}/v1", tenant.key, monkeypatch)
    with pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=2)
    assert raised.value.status_code == 503 and raised.value.code == "capacity_unavailable"
    assert NO_ROOM in raised.value.message
    # Before: `Retry-After: 30`, honoured by the client: two sleeps of 30 s, then the same 503.
    assert len(sent) == 1 and slept == []


def test_a_client_that_asks_to_wait_for_capacity_is_held_until_a_replica_is_ready(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, cold_start_timeout_s=HOLD_S, min_replicas=1,
                              waiting_for_capacity=True, status_message=NO_ROOM)
    answers = []
    thread = threading.Thread(
        target=lambda: answers.append(call(gateway, tenant, endpoint, **{"X-Inferplane-Wait-For-Capacity": "true"})),
    )
    thread.start()
    wait_until(lambda: get_redis().zcard(redis_keys.waiting_key(endpoint.organization_id, str(endpoint.pk))) == 1, 20, message="the call to be held")
    Replica.objects.create(endpoint=endpoint, node=Node.objects.get(), state=ReplicaState.READY,
                           address=start_mock_upstream(), ready_at=timezone.now())
    thread.join(timeout=60)
    [response] = answers
    assert response.status_code == 200, response.text
    assert response.json()["choices"]


def test_a_held_call_is_told_when_its_wake_finds_no_capacity(rewaking_gateway, tenant):
    gateway = rewaking_gateway
    endpoint = serve_endpoint(tenant.org, cold_start_timeout_s=HOLD_S)  # scaled to zero: the call wakes it
    answers = []
    thread = threading.Thread(target=lambda: answers.append(call(gateway, tenant, endpoint)))
    thread.start()
    wait_until(lambda: get_redis().zcard(redis_keys.waiting_key(endpoint.organization_id, str(endpoint.pk))) == 1, 20, message="the call to be held")
    # What the woken reconcile records when no node has room.
    Endpoint.objects.filter(pk=endpoint.pk).update(waiting_for_capacity=True, status_message=NO_ROOM)
    thread.join(timeout=60)
    [response] = answers
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "capacity_unavailable" and NO_ROOM in response.json()["error"]["message"]
