"""Gateways beat: a dead one's requests stop counting within seconds, and a live one puts back
what Redis forgot."""

import threading

import httpx
import pytest

from controlplane import redis_keys
from controlplane.redis_client import get_redis
from endpoints import scheduler
from endpoints.models import Replica
from gpu_agent.protocol import ReplicaState
from tests.conftest import start_web_server, wait_until
from tests.gateway.conftest import serve_endpoint
from tests.gateway.load import MESSAGES

pytestmark = pytest.mark.django_db(transaction=True)


def start_streams(gateway: str, key: str, model: str, count: int, max_tokens: int = 150) -> list[threading.Thread]:
    def stream():
        try:
            with httpx.stream("POST", f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": model, "messages": MESSAGES, "stream": True, "max_tokens": max_tokens},
                              timeout=60) as response:
                for _ in response.iter_lines():
                    pass
        except httpx.HTTPError:
            pass  # the gateway was killed under it

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def counts(endpoint, replica) -> tuple[int, int]:
    redis = get_redis()
    org = endpoint.organization_id
    return redis.zcard(redis_keys.inflight_key(org, str(endpoint.pk))), int(redis.get(redis_keys.outstanding_key(org, str(replica.pk))) or 0)


def test_a_killed_gateways_requests_stop_counting_within_seconds_and_the_endpoint_scales_to_zero(
        tenant, start_mock_upstream, tmp_path):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=200), min_replicas=0, idle_timeout_s=1)
    replica = Replica.objects.get(endpoint=endpoint)
    child, gateway = start_web_server(tmp_path, name="gateway")
    try:
        start_streams(gateway, tenant.key, endpoint.name, 3)
        wait_until(lambda: counts(endpoint, replica) == (3, 3), 30, message="three streams in flight")
        child.kill()

        def swept():
            scheduler.autoscale_tick()
            return counts(endpoint, replica) == (0, 0)

        wait_until(swept, 20, interval_s=0.5, message="the dead gateway's requests released")
        wait_until(lambda: scheduler.autoscale_tick() is not None and Replica.objects.get(pk=replica.pk).state
                   == ReplicaState.DRAINING, 20, interval_s=0.5, message="scale to zero")
    finally:
        child.stop()


def test_a_live_gateway_puts_back_its_requests_after_redis_forgets_them_and_releases_them_once(
        tenant, start_mock_upstream, tmp_path):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=100))
    replica = Replica.objects.get(endpoint=endpoint)
    child, gateway = start_web_server(tmp_path, name="gateway")
    try:
        streams = start_streams(gateway, tenant.key, endpoint.name, 2, max_tokens=80)
        wait_until(lambda: counts(endpoint, replica) == (2, 2), 30, message="two streams in flight")
        get_redis().flushdb()  # Redis restarted without persistence
        assert counts(endpoint, replica) == (0, 0)
        wait_until(lambda: counts(endpoint, replica) == (2, 2), 10, message="the gateway to put its requests back")
        for thread in streams:
            thread.join(60)
        wait_until(lambda: counts(endpoint, replica) == (0, 0), 10, message="both released once, never below zero")
    finally:
        child.stop()
