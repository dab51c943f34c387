"""A call's entry in its gateway's requests hash, and what its finish gives back without it.

A finish whose entry is gone (released by the sweeper, or lost with Redis's memory, put back or not) leaves the
minute's token counter at what the call used, never more or less, and gives back once however often it is sent (or
ended by its gateway's beat, its finish having missed Redis); a new
call under an earlier try's request id (a batch line tried again) is admitted or refused on its own merits, and the
earlier try's end frees none of its slot; a new call under the id of a live one is refused, never let free the live
one's slot. Every ending gives back the tokens its call reserved and did not use: an admission whose reply was lost, and
two tries whose ends both missed Redis before a beat. A cold start's place in line is a call's, not a request id's.
The scenarios run on the suite's Redis here, and on a Redis Cluster in
tests/test_redis_cluster.py."""

from __future__ import annotations

import asyncio
import os
import types
from datetime import UTC, datetime
from decimal import Decimal

import pytest
import redis
from redis.cluster import RedisCluster

from controlplane import redis_keys
from controlplane.redis_client import get_redis
from endpoints.gateway import admission, cold_start, errors, limits, presence, traffic
from endpoints.gateway.auth import Caller
from endpoints.gateway.call import InferenceCall
from endpoints.gateway.tally import UsageTally
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
        first = await admit(caller, endpoint, "batch-line-8")
        presence.end_later(organization.pk, "batch-line-8", call_token=first.call_token)  # its finish met Redis down
        try:
            await admit(caller, endpoint, "batch-line-8")
        except errors.OpenAIError as exc:
            return f"{exc.status} {exc.message}"
        return "admitted"

    return asyncio.run(scenario())


def two_live_calls_under_one_request_id() -> dict:
    """A call admitted and still running; a second call under its request id (a batch line's try while the earlier
    one still runs) in the same gateway process."""
    caller, endpoint = a_caller()
    org = caller.organization_id

    async def scenario():
        first = await admit(caller, endpoint, "line-live")
        track(caller, endpoint, "line-live", first)
        try:
            await admit(caller, endpoint, "line-live")
            refused = None
        except errors.OpenAIError as exc:
            refused = (exc.status, exc.code, exc.headers.get("retry-after"))
        during = {"counted": counted(first.window), "outstanding": sum(outstanding(org)),
                  "in_flight": in_flight(org, endpoint), "tracked": presence.serving["line-live"].call_token}
        presence.untrack("line-live")
        await finish(caller, endpoint, first)
        return {"first": first, "refused": refused, "during": during, "after": counted(first.window),
                "outstanding": outstanding(org), "in_flight": in_flight(org, endpoint)}

    return asyncio.run(scenario())


def two_tries_whose_ends_missed_redis_before_a_beat() -> dict:
    """A batch line's try whose finish missed Redis, its next try admitted (the first's entry released) whose finish
    missed Redis too, both before their gateway's next beat."""
    caller, endpoint = a_caller()
    org = caller.organization_id

    async def scenario():
        await presence.beat(web=True)
        for _ in range(2):
            admitted = await admit(caller, endpoint, "line-9")
            presence.end_later(org, "line-9", call_token=admitted.call_token,
                               give_back=admitted.window.give_back_keys_and_args(USED, admitted.call_token))
        await presence.beat(web=True)
        return {"counted": counted(admitted.window), "outstanding": outstanding(org),
                "in_flight": in_flight(org, endpoint), "unfinished": dict(presence.unfinished)}

    return asyncio.run(scenario())


def admission_whose_reply_was_lost(monkeypatch) -> dict:
    """An admission whose script ran and whose reply was lost (Redis went away); the gateway's next beat ends the call,
    and the line's next try is admitted."""
    caller, endpoint = a_caller()
    org = caller.organization_id
    admit_script = admission._ADMIT

    async def ran_then_lost(**parts):
        reply = await admit_script(**parts)
        if reply[0] != "ok":  # the billing counters rebuilt first
            return reply
        raise redis.exceptions.ConnectionError("Connection closed by server.")

    async def scenario():
        await presence.beat(web=True)
        window = limits.Window.now(org, caller.limit_subject, caller.requests_per_minute, caller.tokens_per_minute)
        with monkeypatch.context() as patched:
            patched.setattr(admission, "_ADMIT", ran_then_lost)
            with pytest.raises(redis.exceptions.ConnectionError):
                await admit(caller, endpoint, "line-lost")
        during = counted(window)
        await presence.beat(web=True)
        after = {"counted": counted(window), "outstanding": outstanding(org), "in_flight": in_flight(org, endpoint),
                 "unfinished": dict(presence.unfinished)}
        await finish(caller, endpoint, await admit(caller, endpoint, "line-lost"))
        return {"during": during, "after": after, "next_try": counted(window)}

    return asyncio.run(scenario())


def call_cancelled_before_its_settlement() -> dict:
    """A stream that used `USED` tokens, cancelled as it ends (its loop ending: a batch run's) before its settlement;
    its gateway's next beat ends it."""
    caller, endpoint = a_caller()
    org = caller.organization_id

    async def cancelled_send(message):
        raise asyncio.CancelledError

    async def scenario():
        await presence.beat(web=True)
        admitted = await admit(caller, endpoint, "cancelled")
        usage = UsageTally()
        usage.take_totals({"prompt_tokens": USED - 10, "completion_tokens": 10})
        call = InferenceCall(request_id="cancelled", request=types.SimpleNamespace(stream=True, progress=False),
                             caller=caller, endpoint=types.SimpleNamespace(id=endpoint), client=None, receive=None,
                             send=cancelled_send, started_at=datetime.now(UTC), usage=usage, response_started=True,
                             call_token=admitted.call_token)
        with pytest.raises(asyncio.CancelledError):
            await call._finish(admitted)
        during = counted(admitted.window)
        await presence.beat(web=True)
        return {"during": during, "after": counted(admitted.window), "outstanding": outstanding(org),
                "in_flight": in_flight(org, endpoint), "unfinished": dict(presence.unfinished)}

    return asyncio.run(scenario())


def two_tries_waiting_for_a_cold_start() -> dict:
    """Two tries of one request id (a batch line's) waiting for a cold start, under a quota of one held request."""
    organization = OrganizationFactory()
    info = types.SimpleNamespace(id="e", name="m", organization_id=organization.pk, cold_start_timeout_s=60,
                                 max_held_requests=1)

    async def scenario():
        first = await cold_start.take_place(info, organization.pk, "line-cold", call_token=traffic.new_call_token())
        try:
            await cold_start.take_place(info, organization.pk, "line-cold", call_token=traffic.new_call_token())
            second = "taken"
        except errors.OpenAIError as exc:
            second = exc.status
        await cold_start.give_up(first)
        after = get_redis().zcard(redis_keys.held_key(organization.pk))
        return {"second": second, "after_first_gave_up": after}

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


def check_two_live_calls_under_one_request_id(seen: dict) -> None:
    assert seen["refused"] == (503, "request_in_progress", "5")
    # the running call keeps its slot, its reservation and its place in this process
    assert seen["during"] == {"counted": (1, RESERVED), "outstanding": 1, "in_flight": 1,
                              "tracked": seen["first"].call_token}
    assert seen["after"] == (1, USED) and seen["outstanding"] == [0, 0] and seen["in_flight"] == 0


def check_two_tries_whose_ends_missed_redis_before_a_beat(seen: dict) -> None:
    assert seen["counted"] == (2, 2 * USED)  # each try's reservation replaced by its use
    assert seen["outstanding"] == [0, 0] and seen["in_flight"] == 0 and seen["unfinished"] == {}


def check_admission_whose_reply_was_lost(seen: dict) -> None:
    assert seen["during"] == (1, RESERVED)
    # its reservation given back whole by the beat, its entry released
    assert seen["after"] == {"counted": (1, 0), "outstanding": [0, 0], "in_flight": 0, "unfinished": {}}
    assert seen["next_try"] == (2, USED)


def check_call_cancelled_before_its_settlement(seen: dict) -> None:
    assert seen["during"] == (1, RESERVED)
    assert seen["after"] == (1, USED)  # its reservation replaced by what it used
    assert seen["outstanding"] == [0, 0] and seen["in_flight"] == 0 and seen["unfinished"] == {}


def check_two_tries_waiting_for_a_cold_start(seen: dict) -> None:
    assert seen["second"] == 429  # a place of its own, and the quota's one is taken
    assert seen["after_first_gave_up"] == 0


def test_a_finish_whose_entry_the_sweeper_released_counts_the_tokens_it_used_once():
    check_swept_then_finished(swept_then_finished())


def test_a_finish_whose_admission_redis_lost_counts_the_tokens_it_used_put_back_or_not(gateway_alone):
    check_lost_with_redis_memory_then_finished(lost_with_redis_memory_then_finished())


def test_a_finish_that_missed_redis_has_its_unused_tokens_given_back_once_by_the_next_beat(gateway_alone):
    check_finishes_that_missed_redis(finishes_that_missed_redis())


def test_a_new_call_under_an_earlier_tries_request_id_counts_on_its_own_and_keeps_its_slot(gateway_alone):
    check_request_id_used_again(request_id_used_again())


def test_a_new_call_under_an_earlier_tries_request_id_is_refused_past_the_limit(gateway_alone):
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


def test_a_new_call_under_a_live_calls_request_id_is_refused_and_frees_none_of_its_slot(gateway_alone):
    check_two_live_calls_under_one_request_id(two_live_calls_under_one_request_id())


def test_two_tries_whose_ends_missed_redis_before_a_beat_each_give_back_their_unused_tokens(gateway_alone):
    check_two_tries_whose_ends_missed_redis_before_a_beat(two_tries_whose_ends_missed_redis_before_a_beat())


def test_an_admission_whose_reply_was_lost_gives_its_reservation_back_at_the_next_beat(gateway_alone, monkeypatch):
    check_admission_whose_reply_was_lost(admission_whose_reply_was_lost(monkeypatch))


def test_a_call_cancelled_before_its_settlement_gives_back_its_unused_tokens_at_the_next_beat(gateway_alone):
    check_call_cancelled_before_its_settlement(call_cancelled_before_its_settlement())


def test_two_tries_of_one_request_id_never_share_a_place_waiting_for_a_cold_start():
    check_two_tries_waiting_for_a_cold_start(two_tries_waiting_for_a_cold_start())


def test_the_beat_drops_the_progress_of_the_ended_calls_whose_row_is_journaled_and_only_theirs(gateway_alone, monkeypatch):
    monkeypatch.setattr(presence, "unfinished_journaled", set())
    caller, endpoint = a_caller()
    org = caller.organization_id
    progress_key = redis_keys.progress_key(org)

    async def scenario():
        await presence.beat(web=True)
        for request_id, journaled in (("journaled", True), ("billed-from-progress", False)):
            admitted = await admit(caller, endpoint, request_id)
            get_redis().hset(progress_key, request_id, "{}")  # as its beats recorded it
            presence.end_later(org, request_id, call_token=admitted.call_token, row_journaled=journaled)
        await presence.beat(web=True)
        return sorted(get_redis().hkeys(progress_key))

    # the journaled row bills its call; the other's progress is the sweeper's to bill from
    assert asyncio.run(scenario()) == ["billed-from-progress"]
