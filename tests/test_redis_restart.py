"""Redis is a cache of traffic state: losing it never reads as "idle" and never drains replicas."""

import time

import pytest

from controlplane import redis_keys
from controlplane.redis_client import get_redis
from endpoints import scheduler
from endpoints.models import Replica
from gpu_agent.protocol import ReplicaState
from tests.conftest import free_port
from tests.factories import OrganizationFactory
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db


def test_a_redis_flush_does_not_scale_down_a_replica_inside_its_idle_timeout():
    endpoint = serve_endpoint(OrganizationFactory(), f"http://127.0.0.1:{free_port()}", min_replicas=0, idle_timeout_s=300)
    redis = get_redis()
    redis.set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), time.time() - 10)
    scheduler.autoscale_tick()
    redis.flushdb()  # a Redis restart without persistence: last-request times are gone

    scheduler.autoscale_tick()

    assert Replica.objects.get(endpoint=endpoint).state == ReplicaState.READY
    # The unknown time was taken as "a request now": the idle countdown starts again from the flush.
    assert time.time() - float(redis.get(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)))) < 60


def test_an_endpoint_still_scales_to_zero_once_its_idle_timeout_passes_after_a_flush():
    endpoint = serve_endpoint(OrganizationFactory(), f"http://127.0.0.1:{free_port()}", min_replicas=0, idle_timeout_s=300)
    redis = get_redis()
    redis.flushdb()
    scheduler.autoscale_tick()
    assert Replica.objects.get(endpoint=endpoint).state == ReplicaState.READY

    redis.set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), time.time() - 301)
    scheduler.autoscale_tick()

    assert Replica.objects.get(endpoint=endpoint).state == ReplicaState.DRAINING


def test_the_embedded_redis_keeps_its_data_across_a_restart():
    from tests.outages import restart_redis

    redis = get_redis()
    redis.set("persisted", "yes")
    assert redis.config_get("appendfsync") == {"appendfsync": "everysec"}
    restart_redis()
    assert get_redis().get("persisted") == "yes"
