"""A request's two Redis round trips: admission changes nothing unless every check passes, and
finishing undoes exactly what admission did."""

import asyncio
from decimal import Decimal

import pytest

from billing.quota import reads
from billing.quota.counters import QuotaExceeded
from billing.services import set_spend_cap
from controlplane import redis_keys
from controlplane.accounts.services import SYSTEM
from controlplane.redis_client import get_redis
from endpoints.gateway import admission, errors, limits
from endpoints.gateway.auth import Caller
from tests.factories import OrganizationFactory

# NOTE: a missing spend counter is rebuilt in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

ENDPOINT = "0b7a1d7e-0000-4000-8000-000000000001"
REPLICAS = ["replica-a", "replica-b"]


def _caller(organization, *, requests_per_minute=None, tokens_per_minute=None) -> Caller:
    return Caller(organization_id=organization.pk, api_key_id=None, user_id=7, can_infer=True,
                  requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute)


def _admit(caller, request_id, amount="0.01", candidates=REPLICAS, num_tokens=20):
    return admission.admit(caller=caller, endpoint_id=ENDPOINT, request_id=request_id, amount=Decimal(amount),
                           num_tokens=num_tokens, candidates=candidates)


def _state(caller):
    redis = get_redis()
    window = limits.Window.now(caller.organization_id, caller.limit_subject, caller.requests_per_minute, caller.tokens_per_minute)
    return {
        "in_flight": redis.zcard(redis_keys.inflight_key(caller.organization_id, ENDPOINT)),
        "waiting": redis.zcard(redis_keys.waiting_key(caller.organization_id, ENDPOINT)),
        "outstanding": [int(redis.get(redis_keys.outstanding_key(caller.organization_id, r)) or 0) for r in REPLICAS],
        "requests_this_minute": int(redis.get(window.requests_key) or 0),
        "tokens_this_minute": int(redis.get(window.tokens_key) or 0),
        "reserved": reads.reserved_now(caller.organization_id),
    }


def test_admission_counts_reserves_and_picks_the_least_outstanding_replica_and_finish_undoes_it():
    caller = _caller(OrganizationFactory(), requests_per_minute=100, tokens_per_minute=10_000)

    async def scenario():
        first = await _admit(caller, "r1")
        second = await _admit(caller, "r2")
        during = _state(caller)
        await admission.finish(caller=caller, endpoint_id=ENDPOINT, admission=first, release=REPLICAS[first.picked],
                               num_tokens=30, cost=Decimal("0.002"))
        return first, second, during

    first, second, during = asyncio.run(scenario())

    assert {first.picked, second.picked} == {0, 1}  # the second goes to the replica the first left idle
    assert during == {"in_flight": 2, "waiting": 0, "outstanding": [1, 1], "requests_this_minute": 2,
                      "tokens_this_minute": 40, "reserved": Decimal("0.02")}  # both worst cases reserved
    after = _state(caller)
    assert after["in_flight"] == 1 and sorted(after["outstanding"]) == [0, 1]
    # the first's 30 tokens used (it had reserved 20), the second's 20 still reserved
    assert (after["tokens_this_minute"], after["reserved"]) == (50, Decimal("0.01"))
    assert reads.counted_spend(caller.organization_id) == Decimal("0.002")


def test_a_rate_limited_request_reserves_nothing_and_a_refused_one_counts_no_request():
    organization = OrganizationFactory()
    set_spend_cap(SYSTEM, organization, spend_cap=Decimal("0.05"))
    caller = _caller(organization, requests_per_minute=2)

    async def scenario():
        await _admit(caller, "ok-1")
        with pytest.raises(QuotaExceeded):
            await _admit(caller, "too-dear", amount="1.00")
        after_refusal = _state(caller)
        await _admit(caller, "ok-2")
        with pytest.raises(errors.OpenAIError) as limited:
            await _admit(caller, "over-the-limit")
        return after_refusal, limited.value

    after_refusal, limited = asyncio.run(scenario())

    assert after_refusal["requests_this_minute"] == 1 and after_refusal["in_flight"] == 1
    assert limited.status == 429 and int(limited.headers["retry-after"]) >= 1
    assert _state(caller) | {"outstanding": None} == {
        "in_flight": 2, "waiting": 0, "outstanding": None, "requests_this_minute": 2, "tokens_this_minute": 40,
        "reserved": Decimal("0.02"),  # the two admitted requests' worst cases, and nothing of the refused ones
    }


def test_without_ready_replicas_the_request_waits_and_holds_no_replica():
    caller = _caller(OrganizationFactory())

    admitted = asyncio.run(_admit(caller, "cold", candidates=[]))

    assert admitted.picked is None
    assert _state(caller)["waiting"] == 1 and _state(caller)["in_flight"] == 0
    asyncio.run(admission.finish(caller=caller, endpoint_id=ENDPOINT, admission=admitted, release=None, num_tokens=0,
                                 cost=Decimal(0)))
    assert _state(caller)["waiting"] == 0 and reads.reserved_now(caller.organization_id) == 0


def test_concurrent_requests_reserve_their_worst_case_tokens_and_never_exceed_tokens_per_minute():
    caller = _caller(OrganizationFactory(), tokens_per_minute=10_000)

    async def scenario():
        outcomes = await asyncio.gather(*(_admit(caller, f"r{i}", num_tokens=3_000) for i in range(12)),
                                        return_exceptions=True)
        admitted = [o for o in outcomes if isinstance(o, admission.Admission)]
        refused = [o for o in outcomes if isinstance(o, errors.OpenAIError)]
        during = _state(caller)["tokens_this_minute"]
        # one ends having used 1,000 of its 3,000: the rest goes back, and one more fits
        await admission.finish(caller=caller, endpoint_id=ENDPOINT, admission=admitted[0], release=None,
                               num_tokens=1_000, cost=Decimal(0))
        late = await _admit(caller, "late", num_tokens=3_000)
        return admitted, refused, during, late

    admitted, refused, during, late = asyncio.run(scenario())

    assert (len(admitted), len(refused)) == (3, 9)
    assert during == 9_000
    assert {r.status for r in refused} == {429} and "10000 tokens per minute" in refused[0].message
    assert late.picked is not None and _state(caller)["tokens_this_minute"] == 10_000


def test_a_request_larger_than_a_whole_minute_of_tokens_is_refused_with_the_reason():
    caller = _caller(OrganizationFactory(), tokens_per_minute=1_000)

    with pytest.raises(errors.OpenAIError) as refused:
        asyncio.run(_admit(caller, "huge", num_tokens=4_096))

    # NOTE: it was a 429 with retry-after 60, which no retry could ever pass; then a 400 `request_too_large`, not
    # OpenAI's shape. OpenAI's 429 of type `tokens` now, with no retry-after, and its own class (the batch runner's
    # cue that no retry admits it)
    assert isinstance(refused.value, errors.RequestTooLarge)
    assert refused.value.status == 429 and refused.value.message.startswith(
        "Request too large for this API key on tokens per min (TPM): Limit 1000, Requested 4096.")
    assert (refused.value.type, refused.value.code, refused.value.param) == ("tokens", "rate_limit_exceeded", None)
    assert "retry-after" not in refused.value.headers
    assert _state(caller)["tokens_this_minute"] == 0 and _state(caller)["in_flight"] == 0


def test_a_caller_without_limits_of_its_own_gets_the_platform_defaults(settings):
    settings.DEFAULT_KEY_REQUESTS_PER_MINUTE = 3
    settings.DEFAULT_KEY_TOKENS_PER_MINUTE = 100
    caller = _caller(OrganizationFactory())  # no requests_per_minute, no tokens_per_minute

    async def scenario():
        for i in range(3):
            await _admit(caller, f"ok-{i}", num_tokens=10)
        with pytest.raises(errors.OpenAIError) as too_many:
            await _admit(caller, "fourth", num_tokens=10)
        return too_many.value

    refused = asyncio.run(scenario())

    assert refused.status == 429 and "3 requests per minute" in refused.message
    assert _state(caller)["tokens_this_minute"] == 30


def test_every_counter_admission_writes_expires_and_none_is_left_below_zero_or_without_a_ttl():
    # The scripts set a minute's counter's TTL only when its INCR creates it, and take a replica's outstanding
    # counter down without reading it first: a counter must still always expire, and a release of a counter
    # Redis lost (or one at zero) must not leave a negative key, or a key without a TTL, behind.
    caller = _caller(OrganizationFactory(), requests_per_minute=100, tokens_per_minute=10_000)
    redis = get_redis()
    counters = [redis_keys.outstanding_key(caller.organization_id, r) for r in REPLICAS]

    async def scenario():
        admitted = [await _admit(caller, f"ttl-{number}") for number in range(3)]
        window = admitted[-1].window  # the minute the last was counted in
        ttls = [redis.ttl(key) for key in (window.requests_key, window.tokens_key, *counters)]
        for one in admitted:
            redis.delete(*counters)  # Redis lost them (a failover to an empty replica)
            await admission.finish(caller=caller, endpoint_id=ENDPOINT, admission=one, release=REPLICAS[one.picked],
                                   num_tokens=10, cost=Decimal("0.001"), fresh_id=True)
        return window, ttls

    window, ttls = asyncio.run(scenario())

    assert all(0 < ttl <= max(limits.WINDOW_TTL_S, 3600) for ttl in ttls), ttls
    assert [redis.exists(key) for key in counters] == [0, 0]  # released from nothing: no key, not -1
    assert 0 < redis.ttl(window.requests_key) <= limits.WINDOW_TTL_S
    assert 0 < redis.ttl(window.tokens_key) <= limits.WINDOW_TTL_S
    assert reads.reserved_now(caller.organization_id) == 0
