"""A call's entry in its gateway's requests hash, and what its finish gives back without it.

A finish whose entry is gone (released by the sweeper, or lost with Redis's memory, put back or not) leaves the
minute's token counter at what the call used, never more or less, and gives back once however often it is sent (or
ended by its gateway's beat, its finish having missed Redis); a new
call under an earlier try's request id (a batch line tried again) is admitted or refused on its own merits, and the
earlier try's end frees none of its slot. The scenarios run on the suite's Redis here, and on a Redis Cluster in
tests/test_redis_cluster.py."""

from __future__ import annotations

import asyncio
import os
from decimal import Decimal

import pytest
from redis.cluster import RedisCluster

from controlplane import redis_keys
from controlplane.redis_client import get_redis
from endpoints.gateway import admission, errors, limits, presence, traffic
from endpoints.gateway.auth import Caller
from tests.factories import EndpointFactory, OrganizationFactory

# NOTE: admission rebuilds counters in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

REPLICAS = ["replica-a", "replica-b"]
RESERVED = 300  # each call's worst-case tokens, reserved at admission
USED = 100  # the tokens each used


def _caller(organization_id: int, *, requests_per_minute: int = 100) -> Caller:
    return Caller(organization_id=organization_id, api_key_id=None, user_id=9, can_infer=True,
                  requests_per_minute=requests_per_minute, tokens_per_minute=10_000)


def a_caller() -> tuple[Caller, str]:
    organization = OrganizationFactory()
    return _caller(organization.pk), str(EndpointFactory(organization=organization).pk)


def counted(window: limits.Window) -> tuple[int, int]:
    """The minute's requests and tokens as its counters hold them."""
    redis = get_redis()
    return int(redis.get(window.requests_key) or 0), int(redis.get(window.tokens_key) or 0)


def outstanding(organization_id: int) -> list[int]:
    return [int(get_redis().get(redis_keys.outstanding_key(organization_id, r)) or 0) for r in REPLICAS]


def in_flight(organization_id: int, endpoint: str) -> int:
    return get_redis().zcard(redis_keys.inflight_key(organization_id, endpoint))


async def admit(caller: Caller, endpoint: str, request_id: str, *, num_tokens: int = RESERVED) -> admission.Admission:
    return await admission.admit(caller=caller, endpoint_id=endpoint, request_id=request_id, amount=Decimal("0.01"),
                                 num_tokens=num_tokens, candidates=REPLICAS)


async def finish(caller: Caller, endpoint: str, admitted: admission.Admission) -> None:
    await admission.finish(caller=caller, endpoint_id=endpoint, admission=admitted,
                           release=REPLICAS[admitted.picked], num_tokens=USED, cost=Decimal("0.001"))


def track(caller: Caller, endpoint: str, request_id: str, admitted: admission.Admission) -> None:
    presence.track(request_id, caller.organization_id, endpoint, REPLICAS[admitted.picked], admitted.reservation,
                   call_token=admitted.call_token)


def every_key() -> list[str]:
    """Every key Redis holds (on every node of a Redis Cluster)."""
    redis = get_redis()
    return redis.keys("*", target_nodes=RedisCluster.PRIMARIES) if isinstance(redis, RedisCluster) else redis.keys("*")


def redis_state() -> list:
    """What Redis holds now, as its last fsync (or the replica's last replicated write) would keep it."""
    redis = get_redis()
    return [(key, redis.dump(key), redis.pttl(key)) for key in every_key()]


def come_back_as(state: list) -> None:
    """Redis restarts from `state`: the writes since are lost."""
    redis = get_redis()
    for key in every_key():
        redis.delete(key)
    for key, value, ttl in state:
        if value is not None:
            redis.restore(key, max(ttl, 0), value, replace=True)


# --- the scenarios (each returns what the test asserts) ---

def swept_then_finished() -> dict:
    """A call's entry released by the sweeper (its gateway froze past its alive key), then its finish, sent twice."""
    caller, endpoint = a_caller()
    org = caller.organization_id

    async def scenario():
        admitted = await admit(caller, endpoint, "swept")
        during = counted(admitted.window)
        swept = presence.release_requests(traffic.gateway_requests_key(org), only_if_dead=False)
        await finish(caller, endpoint, admitted)
        await finish(caller, endpoint, admitted)  # the same finish sent again (a client's retry after a lost reply)
        return {"during": during, "swept": swept, "after": counted(admitted.window), "outstanding": outstanding(org),
                "in_flight": in_flight(org, endpoint)}

    return asyncio.run(scenario())


def lost_with_redis_memory_then_finished() -> dict:
    """Two calls admitted in the moment Redis lost (back in the past); a third admitted after. The first ends before
    its gateway puts its entry back, the second after."""
    caller, endpoint = a_caller()
    org = caller.organization_id

    async def scenario():
        await presence.beat(web=True)
        state = redis_state()
        first, second = await admit(caller, endpoint, "first"), await admit(caller, endpoint, "second")
        track(caller, endpoint, "first", first)
        track(caller, endpoint, "second", second)
        come_back_as(state)  # both admissions are lost; both calls run on
        requests = get_redis().hgetall(traffic.gateway_requests_key(org))
        lost = {"entries": sorted(requests), "counted": counted(first.window)}
        third = await admit(caller, endpoint, "third")
        presence.untrack("first")
        await finish(caller, endpoint, first)  # its entry gone, not yet put back
        for _ in range(presence.RECONCILE_EVERY_BEATS):
            await presence.beat(web=True)
        put_back = get_redis().hexists(traffic.gateway_requests_key(org), "second")
        presence.untrack("second")
        await finish(caller, endpoint, second)  # its entry put back, without its reservation
        await finish(caller, endpoint, second)  # sent again
        after = counted(third.window)
        await finish(caller, endpoint, third)
        return {"lost": lost, "put_back": put_back, "after": after, "all_ended": counted(third.window),
                "outstanding": outstanding(org), "in_flight": in_flight(org, endpoint)}

    return asyncio.run(scenario())


def finishes_that_missed_redis() -> dict:
    """Two calls whose finish failed (Redis unreachable): one whose finish never ran, one whose finish ran and whose
    reply was lost; their gateway's next beat ends both."""
    caller, endpoint = a_caller()
    org = caller.organization_id

    async def scenario():
        await presence.beat(web=True)
        missed, lost_reply = await admit(caller, endpoint, "missed"), await admit(caller, endpoint, "reply-lost")
        await finish(caller, endpoint, lost_reply)
        for request_id, admitted in (("missed", missed), ("reply-lost", lost_reply)):
            presence.end_later(org, request_id, call_token=admitted.call_token,
                               give_back=admitted.window.give_back_keys_and_args(USED, admitted.call_token))
        during = counted(missed.window)
        await presence.beat(web=True)
        return {"during": during, "after": counted(missed.window), "outstanding": outstanding(org),
                "in_flight": in_flight(org, endpoint), "unfinished": dict(presence.unfinished)}

    return asyncio.run(scenario())


def request_id_used_again() -> dict:
    """A batch line's try admitted, its end not reaching Redis (its entry left); its next try, under the same request
    id, admitted; then the first try's end is retried, and finally the second ends."""
    caller, endpoint = a_caller()
    org = caller.organization_id

    async def scenario():
        await presence.beat(web=True)
        first = await admit(caller, endpoint, "batch-line-7")
        presence.end_later(org, "batch-line-7", call_token=first.call_token)  # its finish met Redis down
        second = await admit(caller, endpoint, "batch-line-7")
        during = {"counted": counted(second.window), "outstanding": sum(outstanding(org)),
                  "in_flight": in_flight(org, endpoint)}
        await finish(caller, endpoint, first)  # the first try's finish after all (its retry, late)
        await presence.beat(web=True)  # and its end, as the beat ends a call whose finish missed Redis
        mine = get_redis().hget(traffic.gateway_requests_key(org), "batch-line-7")
        after_first = {"counted": counted(second.window), "outstanding": outstanding(org),
                       "in_flight": in_flight(org, endpoint), "entry": mine, "unfinished": dict(presence.unfinished)}
        await finish(caller, endpoint, second)
        return {"first": first, "second": second, "during": during, "after_first": after_first,
                "after": counted(second.window), "outstanding": outstanding(org),
                "in_flight": in_flight(org, endpoint)}

    return asyncio.run(scenario())


def request_id_used_again_past_the_limit() -> str:
    """The same, under a limit of one request a minute: the second try is refused, as any second call would be."""
    organization = OrganizationFactory()
    caller, endpoint = _caller(organization.pk, requests_per_minute=1), str(EndpointFactory(organization=organization).pk)

    async def scenario():
        await admit(caller, endpoint, "batch-line-8")
        try:
            await admit(caller, endpoint, "batch-line-8")
        except errors.OpenAIError as exc:
            return f"{exc.status} {exc.message}"
        return "admitted"

    return asyncio.run(scenario())


# --- the checks, shared with the Redis Cluster's tests ---

def check_swept_then_finished(seen: dict) -> None:
    assert seen["during"] == (1, RESERVED) and seen["swept"] == 1
    assert seen["after"] == (1, USED)  # its reservation replaced by its use, once
    assert seen["outstanding"] == [0, 0] and seen["in_flight"] == 0


def check_lost_with_redis_memory_then_finished(seen: dict) -> None:
    assert seen["lost"] == {"entries": [], "counted": (0, 0)} and seen["put_back"]
    # the third's reservation and what the two lost calls used: neither gave back a reservation Redis did not hold
    assert seen["after"][1] == RESERVED + 2 * USED
    assert seen["all_ended"][1] == 3 * USED
    assert seen["outstanding"] == [0, 0] and seen["in_flight"] == 0


def check_finishes_that_missed_redis(seen: dict) -> None:
    assert seen["during"] == (2, RESERVED + USED)
    assert seen["after"] == (2, 2 * USED)  # each reservation replaced by its use, once
    assert seen["outstanding"] == [0, 0] and seen["in_flight"] == 0 and seen["unfinished"] == {}


def check_request_id_used_again(seen: dict) -> None:
    assert seen["first"].call_token != seen["second"].call_token
    # the second try counted as a call of its own; the first's leftover released as it was let go, and its
    # reservation left to its end
    assert seen["during"] == {"counted": (2, 2 * RESERVED), "outstanding": 1, "in_flight": 1}
    after_first = seen["after_first"]
    assert after_first["counted"] == (2, USED + RESERVED)  # the first's reservation replaced by its use, once
    assert sum(after_first["outstanding"]) == 1 and after_first["in_flight"] == 1  # the second's slot still its own
    assert after_first["unfinished"] == {}
    assert after_first["entry"] is not None and after_first["entry"].endswith(f"|{seen['second'].call_token}")
    assert seen["after"] == (2, 2 * USED)
    assert seen["outstanding"] == [0, 0] and seen["in_flight"] == 0


def test_a_finish_whose_entry_the_sweeper_released_counts_the_tokens_it_used_once():
    check_swept_then_finished(swept_then_finished())


def test_a_finish_whose_admission_redis_lost_counts_the_tokens_it_used_put_back_or_not(gateway_alone):
    check_lost_with_redis_memory_then_finished(lost_with_redis_memory_then_finished())


def test_a_finish_that_missed_redis_has_its_unused_tokens_given_back_once_by_the_next_beat(gateway_alone):
    check_finishes_that_missed_redis(finishes_that_missed_redis())


def test_a_new_call_under_an_earlier_tries_request_id_counts_on_its_own_and_keeps_its_slot(gateway_alone):
    check_request_id_used_again(request_id_used_again())


def test_a_new_call_under_an_earlier_tries_request_id_is_refused_past_the_limit():
    assert request_id_used_again_past_the_limit().startswith("429 Rate limit reached: 1 requests per minute")


def test_each_call_has_a_token_of_its_own_and_a_forked_gateways_calls_never_take_its_parents():
    tokens = [traffic.new_call_token() for _ in range(10_000)]
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # a gateway process forked from this one (`controlplane.serve`'s workers)
        os.write(write, traffic.new_call_token().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    childs_first = os.read(read, 100).decode()
    os.close(read)
    parents_next = traffic.new_call_token()
    assert len(set(tokens)) == len(tokens) and not any("|" in token for token in tokens)  # entries split on '|'
    assert childs_first and childs_first != parents_next and childs_first not in tokens
