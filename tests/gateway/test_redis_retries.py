"""A gateway's beat whose reply redis-py's retry sent again reads Redis as it was before the beat.

The shared async client retries a pipeline once after a connection error (`controlplane.redis_client`): Redis ran the
beat's pipeline, the connection dropped before its reply was read, and redis-py sent it again. Its `SET ... GET` of the
alive key then read the first run's write: a key Redis had forgotten read as alive.
"""

import asyncio

import pytest
import redis.asyncio.client
import redis.exceptions

from controlplane import redis_keys
from controlplane.redis_client import get_redis
from endpoints.gateway import presence, traffic

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_beat_whose_reply_is_lost_after_redis_forgot_its_alive_key_reconciles_as_forgotten(
        gateway_alone, monkeypatch):
    alive = redis_keys.gateway_alive_key(traffic.gateway_id())
    reconcile, modes = presence._reconcile, []

    async def noting_its_mode(gateway, *, forgotten=False, **others):
        modes.append(forgotten)
        return await reconcile(gateway, forgotten=forgotten, **others)

    monkeypatch.setattr(presence, "_reconcile", noting_its_mode)
    get_redis().delete(alive)
    asyncio.run(presence.beat(web=True))  # alive, and reconciled at once
    assert get_redis().exists(alive) and modes == [True]

    get_redis().delete(alive)  # Redis forgets it
    execute_pipeline, lost = redis.asyncio.client.Pipeline._execute_pipeline, []

    async def reply_lost(self, connection, commands, raise_on_error):
        reply = await execute_pipeline(self, connection, commands, raise_on_error)
        if not lost and commands[0][0][:2] == ("SET", alive):
            lost.append(1)
            raise redis.exceptions.ConnectionError("Connection reset by peer")
        return reply

    monkeypatch.setattr(redis.asyncio.client.Pipeline, "_execute_pipeline", reply_lost)
    asyncio.run(presence.beat(web=True))
    assert lost

    assert get_redis().exists(alive)
    assert modes == [True, True]  # what it serves put back at once, as after any forgetting
