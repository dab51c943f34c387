"""An endpoint FAILED while a replica of it still serves: that replica drains when idle, as any endpoint's does; and
failures of extra replicas, of varied reasons, do not fail an endpoint whose replica serves (they back off)."""
import time

import pytest
from django.conf import settings
from django.utils import timezone

from controlplane import redis_keys
from controlplane.redis_client import get_redis
from endpoints import scheduler
from endpoints.models import Endpoint, Replica
from endpoints.replicas import REPLICA_RETRY_MAX_S, max_failures_since_ready, record_replica_failure
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db

# Scale-up replicas failing for varied reasons (start timeouts on a slow node, an engine crash under load...).
VARIED_REASONS = ["did not become READY within 900 s", "engine exited with code -9", "weights download failed: 503"]


def serving_replica(**fields):
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=3, idle_timeout_s=3, **fields)
    replica = Replica.objects.create(endpoint=endpoint, node=make_node(memory_mb=80_000), state=ReplicaState.READY,
                                     address="http://127.0.0.1:9", ready_at=timezone.now())
    return endpoint, replica


@pytest.mark.parametrize("failed", [False, True])
def test_an_idle_endpoint_scales_to_zero_even_when_failed(failed):
    # Before: the FAILED case stayed READY (the tick skipped every failed endpoint), an hour idle on its GPU.
    endpoint, replica = serving_replica()
    if failed:
        # e.g. weights pushed to an unpinned repository after the first replica loaded: new replicas crash alike
        for _ in range(settings.REPLICA_MAX_IDENTICAL_FAILURES):
            record_replica_failure(endpoint.pk, "engine exited with code 1")
        assert Endpoint.objects.get(pk=endpoint.pk).failed_at is not None
    get_redis().set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), time.time() - 3600)
    scheduler.autoscale_tick()
    assert Replica.objects.get(pk=replica.pk).state != ReplicaState.READY, "idle an hour, its GPU is still held"


def test_varied_failures_of_extra_replicas_do_not_fail_an_endpoint_that_serves():
    # Before: the 8th failure set the endpoint FAILED though its first replica served all along.
    endpoint, _replica = serving_replica()
    for n in range(max_failures_since_ready() + 2):
        record_replica_failure(endpoint.pk, VARIED_REASONS[n % 3])
    endpoint.refresh_from_db()
    assert endpoint.failed_at is None
    assert endpoint.num_scale_up_failures == max_failures_since_ready() + 2 and endpoint.num_failures_since_ready == 0
    # it backs off, at most an hour
    assert 0 < (endpoint.next_attempt_at - timezone.now()).total_seconds() <= REPLICA_RETRY_MAX_S


def test_varied_failures_with_no_replica_serving_still_fail_the_endpoint():
    endpoint = EndpointFactory(gpu_type="l4")
    for n in range(max_failures_since_ready()):
        record_replica_failure(endpoint.pk, VARIED_REASONS[n % 3])
    assert Endpoint.objects.get(pk=endpoint.pk).failed_at is not None
