"""The shared Redis connections: one sync client per process, one async client per event loop."""

from __future__ import annotations

import asyncio
import functools

import redis
import redis.asyncio
from django.conf import settings


@functools.cache
def get_redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, decode_responses=True, health_check_interval=30)


POOL_WAIT_S = 10
_async_clients: dict[int, redis.asyncio.Redis] = {}


def get_async_redis() -> redis.asyncio.Redis:
    # NOTE: an asyncio connection pool belongs to the loop that created it.
    loop_id = id(asyncio.get_running_loop())
    client = _async_clients.get(loop_id)
    if client is None:
        # NOTE: a burst beyond the pool waits for a free connection instead of failing; nothing holds
        # one for long (pub/sub waiters share `controlplane.pubsub`'s own connection).
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            settings.REDIS_URL, decode_responses=True, max_connections=settings.REDIS_MAX_CONNECTIONS,
            timeout=POOL_WAIT_S)
        client = redis.asyncio.Redis(connection_pool=pool)
        _async_clients[loop_id] = client
    return client
