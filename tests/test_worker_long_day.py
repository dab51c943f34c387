"""A worker's long day: what its tasks leave behind in Redis does not grow with every run or every endpoint ever used.

Measured by running each beat task's real function many times in one process (as a long-lived worker does), on real
PostgreSQL and Redis: file descriptors, threads, PostgreSQL sessions, Redis clients and keys without a TTL."""

from __future__ import annotations

import uuid

import pytest

from controlplane import redis_keys
from controlplane.redis_client import get_redis, redis_time
from endpoints import scheduler
from endpoints.gateway import traffic

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
