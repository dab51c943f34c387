"""The process's shared pub/sub listener: one subscription per channel however many wait, dropped with
the last waiter, and a lost connection that comes back subscribed."""

import asyncio
import time

from django.conf import settings

from controlplane.pubsub import Listener
from controlplane.redis_client import get_redis


async def _until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _num_subscribers(channel: str) -> int:
    return get_redis().pubsub_numsub(channel)[0][1]


def test_many_waiters_share_one_subscription_and_each_gets_the_message():
    async def scenario():
        listener = Listener(settings.REDIS_URL)
        got = []

        async def waiter():
            async with listener.subscribe("test:shared") as signal:
                await _until(lambda: _num_subscribers("test:shared") == 1)
                await started.wait()
                got.append(await signal.wait(10))

        started = asyncio.Event()
        tasks = [asyncio.create_task(waiter()) for _ in range(50)]
        await _until(lambda: listener.num_waiters == 50 and _num_subscribers("test:shared") >= 1)
        subscribers = _num_subscribers("test:shared")
        started.set()  # a message that arrives before a waiter waits is kept for it: no pause needed
        get_redis().publish("test:shared", "1")
        await asyncio.gather(*tasks)
        await _until(lambda: _num_subscribers("test:shared") == 0)
        return subscribers, got, listener.num_channels

    subscribers, got, num_channels = asyncio.run(scenario())

    assert subscribers == 1
    assert got == [True] * 50
    assert num_channels == 0


def test_a_lost_connection_comes_back_subscribed():
    async def scenario():
        listener = Listener(settings.REDIS_URL)
        async with listener.subscribe("test:reconnect") as signal:
            await _until(lambda: _num_subscribers("test:reconnect") == 1)
            get_redis().client_kill_filter(_type="pubsub")
            await _until(lambda: _num_subscribers("test:reconnect") == 0)
            await _until(lambda: _num_subscribers("test:reconnect") == 1)
            await signal.wait(0)  # a wake-up after the reconnect ("look again") is allowed
            get_redis().publish("test:reconnect", "1")
            return await signal.wait(10)

    assert asyncio.run(scenario()) is True
