"""A worker's long day: what its tasks leave behind in Redis does not grow with every run or every endpoint ever used.

Measured by running each beat task's real function many times in one process (as a long-lived worker does), on real
PostgreSQL and Redis: file descriptors, threads, PostgreSQL sessions, Redis clients and keys without a TTL."""

from __future__ import annotations

import uuid

import pytest
from django.db import OperationalError
from django.utils import timezone

from controlplane import redis_keys
from controlplane.redis_client import get_redis, redis_time
from endpoints import scheduler
from endpoints.gateway import traffic
from endpoints.models import Endpoint
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db


def test_the_autoscale_tick_forgets_endpoints_whose_last_request_is_past_the_window():
    # Before, the gateways' beats added every endpoint they served to `gw:recent_endpoints` and nothing took one out:
    # the set held every endpoint ever called, deleted ones too, for the life of Redis.
    redis, now = get_redis(), redis_time()
    long_ago = {str(uuid.uuid4()): now - traffic.RECENT_WINDOW_S - 60 - index for index in range(50)}
    an_hour_ago = str(uuid.uuid4())
    redis.zadd(redis_keys.RECENT_ENDPOINTS_KEY, long_ago | {an_hour_ago: now - 3600})

    scheduler.autoscale_tick()

    assert redis.zrange(redis_keys.RECENT_ENDPOINTS_KEY, 0, -1) == [an_hour_ago]


def test_a_deleted_endpoint_past_the_window_loses_its_last_request_time_and_a_live_one_keeps_it():
    # Before, the gateways' scripts set `gw:{org}:last_request:<endpoint>` without a TTL and nothing deleted it: one key
    # for every endpoint ever called, deleted ones too, for the life of Redis.
    redis, now = get_redis(), redis_time()
    deleted = [EndpointFactory(deleted_at=timezone.now()) for _ in range(3)]
    live = EndpointFactory()
    for endpoint in [*deleted, live]:
        redis.set(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)), now - 2 * 86400)
        redis.zadd(redis_keys.RECENT_ENDPOINTS_KEY, {str(endpoint.pk): now - 2 * 86400})

    scheduler.autoscale_tick()

    assert redis.zcard(redis_keys.RECENT_ENDPOINTS_KEY) == 0
    assert [
        redis.exists(redis_keys.last_request_key(endpoint.organization_id, str(endpoint.pk)))
        for endpoint in [*deleted, live]
    ] == [0, 0, 0, 1]


def test_a_tick_takes_out_a_bounded_number_of_endpoints_past_the_window(monkeypatch):
    # the first tick after a long time without may find every endpoint ever called past the window
    monkeypatch.setattr(scheduler, "FORGET_PAST_RECENT_BATCH", 20)
    redis, now = get_redis(), redis_time()
    redis.zadd(
        redis_keys.RECENT_ENDPOINTS_KEY, {str(uuid.uuid4()): now - 2 * 86400 - index for index in range(50)}
    )

    assert [scheduler.forget_past_recent_endpoints(now) for _ in range(4)] == [20, 20, 10, 0]
    assert redis.zcard(redis_keys.RECENT_ENDPOINTS_KEY) == 0


def test_a_tick_cut_before_it_dropped_a_deleted_endpoints_last_request_leaves_it_to_the_next_tick(
    monkeypatch,
):
    # Before, the endpoint was taken out of the set first: a tick cut before the deletes (here PostgreSQL gone when
    # asked which endpoints were deleted) left the deleted endpoint's last request in Redis for ever, no TTL.
    redis, now = get_redis(), redis_time()
    gone = EndpointFactory(deleted_at=timezone.now())
    key = redis_keys.last_request_key(gone.organization_id, str(gone.pk))
    redis.set(key, now - 2 * 86400)
    redis.zadd(redis_keys.RECENT_ENDPOINTS_KEY, {str(gone.pk): now - 2 * 86400})

    with monkeypatch.context() as patch:

        def cut(*args, **kwargs):
            raise OperationalError("server closed the connection unexpectedly")

        patch.setattr(Endpoint.objects, "filter", cut)
        with pytest.raises(OperationalError):
            scheduler.forget_past_recent_endpoints(now)
    scheduler.autoscale_tick()

    assert redis.zscore(redis_keys.RECENT_ENDPOINTS_KEY, str(gone.pk)) is None
    assert not redis.exists(key)


def test_an_endpoint_called_again_between_the_read_and_the_removal_stays_in_the_set():
    # The set is read first, then taken out of in a script that checks each one's time again: a beat's newer time
    # (ZADD GT) in between keeps the endpoint.
    redis, now = get_redis(), redis_time()
    called_again, quiet = str(uuid.uuid4()), str(uuid.uuid4())
    redis.zadd(redis_keys.RECENT_ENDPOINTS_KEY, {called_again: now - 2 * 86400, quiet: now - 2 * 86400})
    redis.zadd(redis_keys.RECENT_ENDPOINTS_KEY, {called_again: now}, gt=True)

    assert (
        scheduler._TAKE_PAST_RECENT.run_sync(
            keys=[redis_keys.RECENT_ENDPOINTS_KEY], args=[now - traffic.RECENT_WINDOW_S, called_again, quiet]
        )
        == 1
    )
    assert redis.zrange(redis_keys.RECENT_ENDPOINTS_KEY, 0, -1) == [called_again]
