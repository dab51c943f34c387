"""The process's shared pub/sub listener: one subscription per channel however many wait, dropped with
the last waiter, and a lost connection that comes back subscribed."""

import asyncio
import time

from django.conf import settings

from controlplane import pubsub as pubsub_module
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


def test_a_reader_cancelled_as_one_of_its_reads_finishes_still_ends():
    """A loop's end (`asyncio.run`: a batch run's slice, a test; the server's shutdown) cancels the reader once and
    waits for it. Before, a cancellation that came as a read's answer came was dropped (Python 3.11's
    `asyncio.wait_for`, which redis-py reads through): the reader read on, and the loop's end waited for it for good."""
    dropped = []

    async def scenario() -> bool:
        reading = asyncio.Event()
        listener = Listener(settings.REDIS_URL)
        async with listener.subscribe("test:cancelled"):
            await _until(lambda: _num_subscribers("test:cancelled") == 1)
            pubsub, reader = listener._pubsub, listener._reader
            read = pubsub.get_message

            async def read_dropping_a_cancellation(**kwargs):
                if not dropped:
                    reading.set()
                    try:
                        await asyncio.sleep(10)  # the read's answer on its way as the loop ends
                    except asyncio.CancelledError:
                        dropped.append(True)  # as 3.11's `wait_for` does when what it waits for is done
                        return None
                return await read(**kwargs)

            pubsub.get_message = read_dropping_a_cancellation
            await asyncio.wait_for(reading.wait(), pubsub_module.READ_TIMEOUT_S + 10)  # its read under way ends first
            reader.cancel()
            done, _ = await asyncio.wait({reader}, timeout=3)
            while not reader.done():  # not left reading into the next test
                reader.cancel()
                await asyncio.wait({reader}, timeout=1)
            return bool(done)

    assert asyncio.run(scenario()), "the reader went on after its cancellation"
    assert dropped
