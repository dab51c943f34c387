"""A call to an endpoint backing off after failures past its cold-start timeout (up to an hour, `REPLICA_RETRY_MAX_S`),
with no replica starting, is told at once with the reason and Retry-After, not held its whole cold-start timeout."""
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from controlplane import redis_keys
from controlplane.redis_client import get_redis
from endpoints.gateway.directory import _endpoint_info
from endpoints.models import Endpoint, Replica
from endpoints.nodes.models import Node
from gpu_agent.protocol import ReplicaState
from tests.gateway.conftest import serve_endpoint
from tests.gateway.test_endpoint_standing import HOLD_S, call

pytestmark = pytest.mark.django_db(transaction=True)

REASON = "replica failed (engine exited with code 1); retrying in 1920 s"


def backing_off(tenant, seconds=1920):
    return serve_endpoint(tenant.org, cold_start_timeout_s=HOLD_S, min_replicas=1, num_failures_since_ready=7,
                          next_attempt_at=timezone.now() + timedelta(seconds=seconds), status_message=REASON)


def test_a_call_to_an_endpoint_backing_off_for_half_an_hour_is_told_at_once(gateway, tenant):
    # Before: held past the client's 30 s timeout (its cold-start timeout is 600 s), then 503 "no replica became ready".
    endpoint = backing_off(tenant)
    try:
        response = call(gateway, tenant, endpoint)  # the client's timeout: 30 s
    except httpx.ReadTimeout:
        pytest.fail("held 30 s+ (its cold-start timeout is 600 s) though no replica can start for 32 minutes")
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "endpoint_backing_off" and error["type"] == "server_error"
    assert REASON in error["message"]
    assert 1800 < int(response.headers["retry-after"]) <= 1920
    assert get_redis().zcard(redis_keys.waiting_key(endpoint.organization_id, str(endpoint.pk))) == 0  # never held


def test_an_endpoint_backing_off_with_a_replica_starting_or_briefly_is_not_refused(tenant):
    endpoint = backing_off(tenant)
    Replica.objects.create(endpoint=endpoint, node=Node.objects.get(), state=ReplicaState.STARTING)
    assert _endpoint_info(Endpoint.objects.select_related("organization__plan").get(pk=endpoint.pk)).backing_off_until == 0
    short = backing_off(tenant, seconds=60)  # within its cold-start timeout: held as any cold start
    info = _endpoint_info(Endpoint.objects.select_related("organization__plan").get(pk=short.pk))
    assert 0 < info.backing_off_until - timezone.now().timestamp() < info.cold_start_timeout_s


def test_a_call_held_through_a_short_back_off_that_no_replica_ends_is_told_the_failure_it_waited_on(gateway, tenant):
    # A back-off within the cold-start timeout holds the call (the retry may succeed). Before, when no replica came
    # the 503 said only "No replica of 'x' became ready within 4 s.": the reason, on the endpoint for minutes (a model
    # path that does not exist, a Hub out of reach), was never told to the client who waited on it.
    reason = "replica failed (fetching weights from /models/missing failed: model directory does not exist); retrying in 2 s"
    endpoint = serve_endpoint(tenant.org, cold_start_timeout_s=4, num_failures_since_ready=1,
                              next_attempt_at=timezone.now() + timedelta(seconds=2), status_message=reason)
    response = call(gateway, tenant, endpoint)
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert "became ready within 4 s" in message
    assert reason in message
