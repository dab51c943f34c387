"""Prefix-aware replica choice: requests that share a long prompt prefix go to the replica most likely to
hold it in its cache, consistently over gateways, never more than the margin above the least-loaded
replica, and toward the replica that reported cache hits for it."""

import asyncio
import random
from decimal import Decimal

import httpx
import pytest

from controlplane.redis_client import get_redis
from controlplane.redis_keys import outstanding_key
from endpoints.gateway import admission, routing
from endpoints.gateway.auth import Caller
from tests.conftest import wait_until
from tests.factories import OrganizationFactory
from tests.gateway.conftest import serve_endpoint

SYSTEM = "You are a careful assistant for the Inferplane support desk. " * 8  # ~480 characters
ENDPOINT = "0b7a1d7e-0000-4000-8000-0000000000f1"


def _chat(system: str, question: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


# --- the routing function ---------------------------------------------------------------------
def test_a_message_of_many_parts_is_read_only_as_far_as_its_prefix(monkeypatch):
    # Every part of a message was dumped to JSON for a key that reads its first characters: 600,000 image parts
    # took ~1.7 s of the event loop.
    image = {"type": "image_url", "image_url": {"url": "https://example.test/x.png"}}
    payload = {"model": "m", "messages": [{"role": "user", "content": [image] * 200_000}]}
    dumped = []
    real_dumps = routing.json.dumps
    monkeypatch.setattr(routing.json, "dumps", lambda *args, **kwargs: dumped.append(1) or real_dumps(*args, **kwargs))

    key = routing.prefix_key("chat", payload)

    assert key is not None and len(dumped) <= routing.PREFIX_CHARS
    monkeypatch.setattr(routing.json, "dumps", real_dumps)
    assert key == routing.prefix_key("chat", {"model": "m", "messages": [{"role": "user", "content": [image] * 100}]})


class CountedToken(int):
    """A token id that counts its own reading as text."""

    read: list = []

    def __str__(self):
        self.read.append(1)
        return int.__repr__(self)


def test_a_completions_prompt_of_token_ids_is_read_only_as_far_as_its_prefix():
    # Every id of the prompt was written out as text for a key that reads its first 256 characters: 500,000 ids (an
    # 8 MiB body, admitted whatever the endpoint's context) held the gateway's event loop ~0.2 s, every tenant's calls on
    # that process waiting, at each such request.
    CountedToken.read.clear()
    prompt = [CountedToken(1000 + i % 500) for i in range(200_000)]

    key = routing.prefix_key("completion", {"model": "m", "prompt": prompt})

    assert key is not None and len(CountedToken.read) <= routing.PREFIX_CHARS
    assert key == routing.prefix_key("completion", {"model": "m", "prompt": [1000 + i for i in range(400)]})
    assert key == routing.prefix_key("completion", {"model": "m", "prompt": [[1000 + i % 500 for i in range(9000)]]})


def test_chats_sharing_a_system_prompt_share_a_prefix_key_and_short_prompts_have_none():
    first = routing.prefix_key("chat", _chat(SYSTEM, "How do I rotate a key?"))
    assert first == routing.prefix_key("chat", _chat(SYSTEM, "Why was I billed twice?"))
    assert first != routing.prefix_key("chat", _chat(SYSTEM.upper(), "How do I rotate a key?"))
    assert routing.prefix_key("chat", _chat("Be brief.", "Hi")) is None
    parts = {"model": "m", "messages": [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}]}
    assert routing.prefix_key("chat", parts) == routing.prefix_key("chat", {"model": "m", "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "anything"}]})
    long_prompt = "def handler(event):\n" * 40
    assert routing.prefix_key("completion", {"prompt": long_prompt + "a"}) == routing.prefix_key(
        "completion", {"prompt": [long_prompt + "b", "other"]})
    assert routing.prefix_key("completion", {"prompt": "short"}) is None
    assert routing.prefix_key("embedding", {"input": long_prompt}) is None


def test_every_gateway_ranks_the_replicas_the_same_way_whatever_order_it_lists_them_in():
    replicas = [f"replica-{i}" for i in range(5)]
    for n in range(50):
        key = f"prefix-{n}"
        ranked = [replicas[i] for i in routing.preference(key, replicas)]
        shuffled = random.Random(n).sample(replicas, len(replicas))
        assert [shuffled[i] for i in routing.preference(key, shuffled)] == ranked


def test_a_replica_leaving_or_joining_moves_only_the_prefixes_it_ranks_first():
    replicas = [f"replica-{i}" for i in range(4)]
    keys = [f"prefix-{n}" for n in range(400)]

    def first_choice(candidates):
        return {key: candidates[routing.preference(key, candidates)[0]] for key in keys}

    before = first_choice(replicas)
    after_leave = first_choice(replicas[:3])
    assert all(after_leave[k] == before[k] for k in keys if before[k] != "replica-3")
    after_join = first_choice(replicas + ["replica-4"])
    moved = [k for k in keys if after_join[k] != before[k]]
    assert all(after_join[k] == "replica-4" for k in moved)
    assert 40 < len(moved) < 140  # about a fifth of the prefixes move to the newcomer
    assert min(list(before.values()).count(r) for r in replicas) > 60  # spread over all replicas


def test_replicas_in_prefer_rank_first_and_without_a_prefix_only_they_are_ranked():
    replicas = ["a", "b", "c", "d"]
    for n in range(30):
        order = routing.preference(f"k{n}", replicas, prefer=frozenset({"c", "a"}))
        assert sorted(replicas[i] for i in order[:2]) == ["a", "c"] and len(order) == 4
    assert routing.preference(None, replicas) == []
    assert [replicas[i] for i in routing.preference(None, replicas, prefer=frozenset({"d"}))] == ["d"]
    route = routing.route(1, ENDPOINT, "k1", replicas, margin=2, prefer=frozenset({"b"}))
    assert route.num_preferred == 1 and replicas[route.order[0]] == "b"


def test_the_choice_never_exceeds_the_least_loaded_by_more_than_the_margin_and_falls_back_to_it():
    rng = random.Random(7)
    for _ in range(500):
        counts = [rng.randint(0, 12) for _ in range(rng.randint(1, 5))]
        margin = rng.randint(0, 4)
        key = rng.choice([None, f"k{rng.randint(0, 9)}"])
        route = routing.route(1, ENDPOINT, key, [f"r{i}" for i in range(len(counts))], margin=margin)
        chosen = routing.choose(route, counts)
        assert counts[chosen] <= min(counts) + margin
        if key is None:
            assert counts[chosen] == min(counts)  # no shared prefix: least outstanding, as before
        else:
            first = route.order[0]
            assert chosen == first or counts[first] > min(counts) + margin


# --- the pick in the admission script, on real Redis --------------------------------------------
pytestmark_db = pytest.mark.django_db(transaction=True)


def _caller(organization) -> Caller:
    return Caller(organization_id=organization.pk, api_key_id=None, user_id=7, can_infer=True,
                  requests_per_minute=None, tokens_per_minute=None)


async def _admit(caller, request_id, candidates, *, key, margin, prefer=frozenset()):
    return await admission.admit(caller=caller, endpoint_id=ENDPOINT, request_id=request_id, amount=Decimal("0.001"),
                                 num_tokens=10, candidates=candidates, prefix_key=key, margin=margin, prefer=prefer)


@pytestmark_db
def test_the_admission_script_chooses_exactly_what_the_routing_rule_says():
    caller = _caller(OrganizationFactory())
    redis = get_redis()
    rng = random.Random(11)

    async def scenario():
        for n in range(60):
            replicas = [f"rep-{n}-{i}" for i in range(rng.randint(1, 4))]
            counts = [rng.randint(0, 6) for _ in replicas]
            for replica, count in zip(replicas, counts, strict=True):
                redis.set(outstanding_key(caller.organization_id, replica), count)
            key, margin = rng.choice([None, f"key-{n}"]), rng.randint(0, 3)
            prefer = frozenset(rng.sample(replicas, rng.randint(0, len(replicas))))
            hinted = rng.choice([None, *range(len(replicas))])
            route = routing.route(caller.organization_id, ENDPOINT, key, replicas, margin=margin, prefer=prefer)
            if hinted is not None and key is not None:
                redis.set(route.hint_key, outstanding_key(caller.organization_id, replicas[hinted]))
            else:
                hinted = None
            admitted = await _admit(caller, f"req-{n}", replicas, key=key, margin=margin, prefer=prefer)
            assert admitted.picked == routing.choose(route, counts, hinted), (counts, route, hinted)
            assert int(redis.get(outstanding_key(caller.organization_id, replicas[admitted.picked]))) == (
                counts[admitted.picked] + 1)

    asyncio.run(scenario())


@pytestmark_db
def test_a_replica_that_reports_cache_hits_for_a_prefix_gets_the_prefix_next_time():
    caller = _caller(OrganizationFactory())
    replicas = ["hit-a", "hit-b", "hit-c"]
    key = routing.prefix_key("chat", _chat(SYSTEM, "q"))
    ranked_first = routing.preference(key, replicas)[0]
    other = routing.preference(key, replicas)[1]

    async def scenario():
        first = await _admit(caller, "learn-1", replicas, key=key, margin=4)
        # it was served elsewhere (a retry) and that replica reported cached tokens
        await admission.finish(caller=caller, endpoint_id=ENDPOINT, admission=first, release=replicas[first.picked],
                               num_tokens=10, cost=Decimal(0), served_by=replicas[other], cached_tokens=96)
        second = await _admit(caller, "learn-2", replicas, key=key, margin=4)
        # a miss teaches nothing
        await admission.finish(caller=caller, endpoint_id=ENDPOINT, admission=second, release=replicas[second.picked],
                               num_tokens=10, cost=Decimal(0), served_by=replicas[ranked_first], cached_tokens=0)
        third = await _admit(caller, "learn-3", replicas, key=key, margin=4)
        return first.picked, second.picked, third.picked

    assert asyncio.run(scenario()) == (ranked_first, other, other)
    assert 0 < get_redis().ttl(routing.hint_key(caller.organization_id, ENDPOINT, key)) <= routing.HINT_TTL_S


# --- through the gateway, two upstream replicas --------------------------------------------------
def _wait_until_finished(organization_id: int, replica_ids: list[str]) -> None:
    wait_until(lambda: all(int(get_redis().get(outstanding_key(organization_id, r)) or 0) == 0 for r in replica_ids),
               30, message="the requests to end in Redis")


def _num_requests(address: str) -> int:
    return httpx.get(f"{address}/_stats", timeout=5).json()["num_requests"]


@pytestmark_db
def test_chats_sharing_a_prefix_land_on_one_replica_and_spill_over_when_it_is_loaded_past_the_margin(
        gateway, tenant, start_mock_upstream):
    upstreams = [start_mock_upstream(prefix_cache=True), start_mock_upstream(prefix_cache=True)]
    endpoint = serve_endpoint(tenant.org, *upstreams, target_concurrency=2)
    replica_ids = {r.address: str(r.pk) for r in endpoint.replicas.all()}
    ids = [replica_ids[a] for a in upstreams]
    # two system prompts that the hash sends to different replicas
    systems = {}
    for n in range(50):
        system = f"Support policy revision {n}. " + SYSTEM
        systems.setdefault(routing.preference(routing.prefix_key("chat", _chat(system, "q")), ids)[0], system)
    assert len(systems) == 2
    client = tenant.client(gateway)

    def ask(system: str, question: str):
        return client.chat.completions.create(model=endpoint.name, max_tokens=4, messages=_chat(system, question)["messages"])

    answers = [ask(systems[index], f"question {n}") for n in range(3) for index in (0, 1)]
    assert [_num_requests(a) for a in upstreams] == [3, 3]
    # every request after a group's first was served from its replica's cache, and the client is told so
    assert [a.usage.prompt_tokens_details.cached_tokens > 0 for a in answers] == [False, False] + [True] * 4

    # replica 0 is busy (3 outstanding requests from other gateways): more than least-loaded + 2
    _wait_until_finished(tenant.org.pk, ids)  # a request ends in Redis just after its answer
    get_redis().set(outstanding_key(tenant.org.pk, ids[0]), 3)
    ask(systems[0], "while it is busy")
    assert [_num_requests(a) for a in upstreams] == [3, 4]
    _wait_until_finished(tenant.org.pk, ids[1:])
    get_redis().set(outstanding_key(tenant.org.pk, ids[0]), 2)  # within the margin again
    ask(systems[0], "once it is less busy")
    assert [_num_requests(a) for a in upstreams] == [4, 4]
