"""The process's Redis circuit (`controlplane.redis_circuit`): open at a silent Redis's first timeout, every call
refused at once meanwhile, closed by its probe within a second of Redis answering; a process with no event loop (a
Celery worker) is never shut out by it."""

import asyncio
import time

import pytest
from django.test import override_settings

from controlplane.redis_circuit import circuit
from controlplane.redis_client import RedisSilent, get_redis
from controlplane.redis_scripts import RedisTimeout, Script
from tests.outages import BlackholingRedisProxy

ECHO = Script("return ARGV[1]")


@pytest.fixture
def proxy():
    proxy = BlackholingRedisProxy()
    with override_settings(REDIS_URL=proxy.url, REDIS_TIMEOUT_S=0.5):
        yield proxy
    proxy.close()
    circuit.close()


def test_a_silent_redis_costs_one_timeout_then_calls_fail_at_once_and_flow_within_a_second_of_its_answer(proxy):
    async def scenario():
        assert await ECHO(keys=["k"], args=["before"]) == "before"
        proxy.blackhole()
        started = time.monotonic()
        with pytest.raises(RedisTimeout):
            await ECHO(keys=["k"], args=["silent"])
        assert 0.4 < time.monotonic() - started < 2
        for _ in range(5):
            started = time.monotonic()
            with pytest.raises(RedisTimeout):
                await ECHO(keys=["k"], args=["refused"])
            assert time.monotonic() - started < 0.05
            await asyncio.sleep(0.1)
        proxy.heal()
        healed = time.monotonic()
        while True:
            try:
                assert await ECHO(keys=["k"], args=["after"]) == "after"
                break
            except RedisTimeout:
                assert time.monotonic() - healed < 1.0, "not answered within a second of Redis answering"
                await asyncio.sleep(0.02)

    asyncio.run(scenario())


def test_a_caller_without_an_event_loop_is_never_shut_out_by_an_open_circuit_with_no_probe():
    circuit.trip(TimeoutError("a reply overdue"))
    try:
        assert get_redis().ping()  # a Celery worker's: no loop to probe on, so its own call is the probe
    finally:
        circuit.close()


def test_a_caller_without_an_event_loop_is_refused_while_a_probe_runs(proxy):
    def ping_in_a_thread() -> float:
        started = time.monotonic()
        with pytest.raises(RedisSilent):
            get_redis().ping()
        return time.monotonic() - started

    async def scenario():
        proxy.blackhole()
        with pytest.raises(RedisTimeout):
            await ECHO(keys=["k"], args=["silent"])
        with pytest.raises(RedisTimeout):
            await ECHO(keys=["k"], args=["refused"])  # starts the probe, on this loop
        assert await asyncio.to_thread(ping_in_a_thread) < 0.05

    asyncio.run(scenario())
