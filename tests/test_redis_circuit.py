"""The process's Redis circuit (`controlplane.redis_circuit`): open at a silent Redis's first timeout, every call
refused at once meanwhile, closed by its probe within a second of Redis answering, whatever loop or thread calls (a
Celery worker's, with no loop or loops that end with their call, is never shut out by it)."""

import asyncio
import os
import threading
import time

import pytest
from django.test import override_settings

from controlplane.redis_circuit import circuit
from controlplane.redis_client import RedisSilent, get_async_redis, get_redis
from controlplane.redis_scripts import RedisTimeout, Script
from controlplane.worker_threads import run_briefly
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


def _answered_within_a_second_of_its_answer(call) -> None:
    healed = time.monotonic()
    while True:
        try:
            call()
            return
        except (RedisTimeout, RedisSilent):
            assert time.monotonic() - healed < 1, "refused by a Redis that answers"
            time.sleep(0.02)


def test_a_caller_without_an_event_loop_is_never_shut_out_by_an_open_circuit():
    circuit.trip(TimeoutError("a reply overdue"))  # Redis answers: it was one slow reply
    try:
        _answered_within_a_second_of_its_answer(lambda: get_redis().ping())  # a Celery worker's: no loop at all
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


def test_a_short_lived_event_loop_reaches_redis_again_once_it_answers():
    """A Celery worker's batch run asks Redis from loops of its own that end with their call (`run_briefly`): a
    circuit opened there was never closed, as each loop's probe ended with it, unstarted, and every run of that worker
    was refused for as long as the worker lived, Redis answering all along."""
    async def ping():
        return await get_async_redis().ping()

    circuit.trip(TimeoutError("a reply overdue"))
    try:
        _answered_within_a_second_of_its_answer(lambda: run_briefly(ECHO(keys=["k"], args=["brief"])))
        circuit.trip(TimeoutError("a reply overdue"))
        _answered_within_a_second_of_its_answer(lambda: run_briefly(ping()))
    finally:
        circuit.close()


def test_a_child_forked_while_a_thread_holds_the_circuits_lock_is_not_stuck_on_it():
    """A fork copies the lock held by a parent's thread that the child does not have: the child takes a fresh one."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with circuit._lock:
            held.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(5)
    try:
        pid = os.fork()
        if pid == 0:  # the child: the lock must be free here
            os._exit(0 if circuit._lock.acquire(timeout=2) else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join()
    assert os.waitstatus_to_exitcode(status) == 0
