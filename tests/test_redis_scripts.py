"""The gateway's pipelined script connection, against the real (embedded) Redis."""

import asyncio
import time
from decimal import Decimal

import pytest
from django.conf import settings

from controlplane import redis_scripts
from controlplane.redis_client import get_redis
from controlplane.redis_scripts import RedisError, Script, _encode, _parse

INCREMENT = Script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
SHAPES = Script("return {ARGV[1], tonumber(ARGV[2]), {ARGV[3]}, false}")
FAILS = Script("return redis.error_reply('ERR refused: ' .. ARGV[1])")


def test_many_concurrent_calls_share_one_connection_and_each_gets_its_own_reply():
    get_redis().script_flush()  # the first call falls back from EVALSHA to EVAL

    async def storm():
        return await asyncio.gather(*(SHAPES(keys=[], args=[f"r{n}", n, "é"]) for n in range(500)))

    replies = asyncio.run(storm())

    assert replies == [[f"r{n}", n, ["é"], None] for n in range(500)]


def test_an_error_reply_fails_only_its_own_call():
    async def mixed():
        return await asyncio.gather(INCREMENT(keys=["counter"], args=[2]), FAILS(keys=[], args=["no"]),
                                    INCREMENT(keys=["counter"], args=[3]), return_exceptions=True)

    first, refused, second = asyncio.run(mixed())

    assert (first, second) == (2, 5)
    assert isinstance(refused, RedisError) and "refused: no" in str(refused)


def test_a_dropped_connection_fails_the_calls_in_flight_and_the_next_call_reconnects():
    async def scenario():
        await INCREMENT(keys=["counter"], args=[1])
        in_flight = asyncio.ensure_future(INCREMENT(keys=["counter"], args=[10]))
        await asyncio.sleep(0)
        redis_scripts._connections.get()._protocol.transport.abort()  # the network drops
        with pytest.raises(ConnectionError):
            await in_flight
        after_drop = await INCREMENT(keys=["counter"], args=[1])
        get_redis().client_kill_filter(_type="normal", skipme=True)  # the server drops it
        dropped = redis_scripts._connections.get()._protocol
        deadline = time.monotonic() + 30
        while dropped.lost is None:  # this side sees the hang-up
            assert time.monotonic() < deadline, "the client never saw the server hang up"
            await asyncio.sleep(0.01)
        return after_drop, await INCREMENT(keys=["counter"], args=[1])

    assert asyncio.run(scenario()) == (2, 3)


def test_the_url_selects_the_database():
    get_redis().set("where", "here")
    assert settings.REDIS_URL.rsplit("/", 1)[-1] != "0"  # the test run's own database (tests/settings.py)

    assert asyncio.run(Script("return redis.call('GET', KEYS[1])")(keys=["where"], args=[])) == "here"


def test_replies_split_across_reads_are_put_together():
    reply = b"*3\r\n$5\r\nhello\r\n:42\r\n*1\r\n$-1\r\n"
    for cut in range(1, len(reply)):
        buffer = bytearray(reply[:cut])
        with pytest.raises(redis_scripts._Incomplete):
            _parse(buffer, 0)
    assert _parse(bytearray(reply), 0) == (["hello", 42, [None]], len(reply))
    assert _encode((b"EVALSHA", "abc", 2, 1.5)) == b"*4\r\n$7\r\nEVALSHA\r\n$3\r\nabc\r\n$1\r\n2\r\n$3\r\n1.5\r\n"


def test_an_evalsha_with_cached_key_encodings_is_byte_for_byte_the_generic_command():
    script = Script("return 1")
    keys = ["rl:{org:1}:req:key:2:1", "billing:{org:1}:settled:req_é", "gw:{org:1}:inflight:e"]
    # `1` and `True`, `1.0` and `1`, "1" and b"1" hash alike: the cache of encodings tells them apart
    args = [1, "two", 3.5, b"four", "cinq é", -6, 1.0, "1", b"1", 0]
    for encode in (redis_scripts._encode_evalsha, redis_scripts._encode_evalsha_small_args):
        for _ in range(2):  # the second time the keys' (and the small arguments') encodings come from the cache
            assert (encode(script._evalsha, keys, args) == _encode((b"EVALSHA", script.sha, len(keys), *keys, *args)))
        # what the generic encoding refuses, the EVALSHA's own refuses too
        for odd in (True, False, None, Decimal("1.5")):
            with pytest.raises(TypeError):
                encode(script._evalsha, keys, [*args, odd])


@pytest.mark.parametrize("reply, outage", [
    ("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.", True),
    ("BUSY Redis is busy running a script.", True),
    ("NOREPLICAS Not enough good replicas to write.", True),
    ("ERR Error running script (call to f_1): @user_script:5: -OOM command not allowed when used memory > 'maxmemory'.", True),
    ("WRONGTYPE Operation against a key holding the wrong kind of value", False),
    ("ERR Error running script (call to f_1): @user_script:5: attempt to compare nil with number", False),
])
def test_redis_replies_that_say_it_cannot_serve_now_are_outages_whichever_client_raised_them(reply, outage):
    # redis-py raises these as a plain ResponseError, which the gateway answered with a 500.
    from redis._parsers.base import BaseParser

    from controlplane.redis_scripts import RedisError, RedisUnavailable, _parse
    from endpoints.gateway import errors

    assert errors.is_outage(BaseParser.parse_error(reply)) is outage  # as redis-py builds it (no "ERR ")
    parsed, _ = _parse(bytearray(b"-" + reply.encode() + b"\r\n"), 0)
    assert isinstance(parsed, RedisUnavailable if outage else RedisError)
    assert errors.is_outage(parsed) is outage



def test_a_small_argument_cached_is_never_another_equal_values_bytes():
    """`0.0` and `-0.0` are equal and hash alike (as `1` and `1.0`, which `typed` keeps apart): the cache of encodings
    gave the second the first's bytes, so what Redis read hung on what was sent before. Equal values encode alike."""
    echo = Script("return ARGV[1]", small_args=True)
    script = Script("return 1")
    for first, second in ((0.0, -0.0), (-0.0, 0.0)):
        redis_scripts._key_bulk.cache_clear()
        for arg in (first, second):
            assert (redis_scripts._encode_evalsha_small_args(script._evalsha, [], [arg])
                    == redis_scripts._encode_evalsha(script._evalsha, [], [arg])
                    == _encode((b"EVALSHA", script.sha, 0, arg)))

    async def read(args):
        redis_scripts._key_bulk.cache_clear()
        return [await echo(keys=[], args=[arg]) for arg in args]

    assert asyncio.run(read([0.0, -0.0])) == asyncio.run(read([-0.0, 0.0]))[::-1] == asyncio.run(read([-0.0, -0.0]))
