"""A cold call to an endpoint whose organisation started as many replicas as it may this hour
(`endpoints.quota_room.ReplicaStarts`) is refused at once with OpenAI's error shape, a 429 saying why: held, it waited
its whole cold-start timeout (a held place, a reservation) for a replica none would place."""

import threading

import httpx
import pytest

from controlplane import redis_keys
from controlplane.redis_client import get_redis
from endpoints.gateway.directory import _endpoint_info
from endpoints.models import Endpoint, Replica
from endpoints.nodes.models import Node
from endpoints.quota_room import ReplicaStarts
from gpu_agent.protocol import ReplicaState
from tests.conftest import wait_until
from tests.gateway.conftest import held_chat, serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

SPENT = ("waiting for quota: replica starts an hour: an organisation without a payment method starts at most 6 "
         "replicas an hour; add one on the billing page to start more")
# Long enough that a held call would outlast the client's own timeout: only a fast answer passes.
HOLD_S = 600


def call(gateway, tenant, endpoint, **headers):
    return httpx.post(f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}", **headers},
                      json={"model": endpoint.name, "messages": [{"role": "user", "content": "Hello"}],
                            "max_tokens": 2}, timeout=30)


def assert_refused_for_starts(response):
    assert response.status_code == 429
    error = response.json()["error"]
    assert error["code"] == "replica_starts_exceeded" and error["type"] == "requests"
    assert "starts at most 6 replicas an hour; add one on the billing page" in error["message"]
    assert response.headers["x-should-retry"] == "false" and int(response.headers["retry-after"]) > 0


def test_a_cold_call_to_an_endpoint_out_of_starts_is_refused_at_once_and_never_held(gateway, tenant):
    endpoint = serve_endpoint(tenant.org, cold_start_timeout_s=HOLD_S, status_message=SPENT)
    for headers in ({}, {"X-Inferplane-Wait-For-Capacity": "true"}):  # waiting for capacity brings no start either
        assert_refused_for_starts(call(gateway, tenant, endpoint, **headers))
    assert get_redis().zcard(redis_keys.waiting_key(endpoint.organization_id, str(endpoint.pk))) == 0


def test_a_held_call_is_told_when_its_wake_finds_its_organisations_starts_spent(rewaking_gateway, tenant):
    gateway = rewaking_gateway
    endpoint = serve_endpoint(tenant.org, cold_start_timeout_s=HOLD_S)  # scaled to zero: the call wakes it
    answers = []
    thread = threading.Thread(target=lambda: answers.append(call(gateway, tenant, endpoint)))
    thread.start()
    wait_until(lambda: get_redis().zcard(redis_keys.waiting_key(endpoint.organization_id, str(endpoint.pk))) == 1,
               20, message="the call to be held")
    Endpoint.objects.filter(pk=endpoint.pk).update(status_message=SPENT)  # what the woken reconcile records
    thread.join(timeout=60)
    [response] = answers
    assert_refused_for_starts(response)


def test_a_cold_call_of_an_organisation_on_hold_is_the_402_every_call_of_its_gets_not_a_429(gateway, tenant):
    """An organisation on hold (an unpaid invoice, a disputed payment) starts no replica; its cold call is a 402 as
    its warm ones are, not a 429 its clients would read as a rate to wait out."""
    on_hold = ReplicaStarts(0, 0, without_card=False, on_hold=True).refusal()
    endpoint = serve_endpoint(tenant.org, cold_start_timeout_s=HOLD_S, status_message=f"waiting for quota: {on_hold}")
    response = call(gateway, tenant, endpoint)
    assert response.status_code == 402
    error = response.json()["error"]
    assert error["code"] == "insufficient_quota" and error["type"] == "insufficient_quota"
    assert "stopped for an unpaid invoice or a disputed payment" in error["message"]
    assert "waiting for quota" not in error["message"] and "replica starts an hour" not in error["message"]
    assert get_redis().zcard(redis_keys.waiting_key(endpoint.organization_id, str(endpoint.pk))) == 0


def test_a_cold_call_waits_for_the_replica_already_starting_when_only_a_further_one_was_refused_its_start(gateway, tenant):
    """A wake that placed one replica (the organisation's last start of the hour) and was refused the next (the load
    asked for two) says so on the endpoint; the call that woke it, and every cold call after it, is held for the one
    starting, as a capacity refusal with a replica starting holds them. Before, each got the 429 at once, and no call
    reached the replica its own wake had started."""
    endpoint = serve_endpoint(tenant.org, cold_start_timeout_s=3, status_message=SPENT)
    Replica.objects.create(endpoint=endpoint, node=Node.objects.get(), state=ReplicaState.STARTING)
    info = _endpoint_info(Endpoint.objects.select_related("organization__plan").get(pk=endpoint.pk))
    assert not info.starts_refused
    answer = held_chat(gateway, tenant.key, endpoint)  # held, not refused
    response = answer.result(timeout=60)  # the replica never comes up here: the cold-start timeout's 503
    assert response.status_code == 503 and response.json()["error"]["code"] != "replica_starts_exceeded"
