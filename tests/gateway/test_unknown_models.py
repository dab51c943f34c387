"""Model names the caller makes up: counted against its key's limit, remembered in a small bounded cache apart from
the endpoints that exist, looked up a few at a time, and never looked up at all when no model could bear them."""

import asyncio
import json
import secrets

import httpx
import pytest

from controlplane import access_log, credential_lookups
from controlplane.accounts.models import ApiKey
from endpoints.gateway import directory
from endpoints.gateway.app import Gateway
from endpoints.gateway.request import MAX_MODEL_NAME
from tests.factories import EndpointFactory, OrganizationFactory
from tests.gateway.conftest import serve_endpoint
from tests.gateway.slots import every_slot_held

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def endpoint_loads(monkeypatch):
    """The endpoint names the gateway looks up in PostgreSQL (in this process), with empty caches."""
    loads = []
    real = directory._endpoints._load

    async def counted(organization_id, name):
        loads.append(name)
        return await real(organization_id, name)

    monkeypatch.setattr(directory._endpoints, "_load", counted)
    directory._endpoints.clear()
    directory._unknown_endpoints.clear()
    yield loads
    directory._endpoints.clear()
    directory._unknown_endpoints.clear()


def test_unknown_models_count_against_the_keys_requests_per_minute(gateway, tenant, start_mock_upstream):
    # Unknown names were counted against no limit: one key could send them as fast as the gateway answered, each a
    # PostgreSQL query, each kept in the cache.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    ApiKey.objects.filter(pk=tenant.api_key.pk).update(requests_per_minute=3)
    with httpx.Client(
        base_url=gateway, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=60
    ) as client:
        unknown = client.post("/v1/chat/completions", json={"model": "no-such-model", "messages": MESSAGES})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        assert unknown.headers["x-ratelimit-remaining-requests"] == "2"
        # the real model still answers while the key is within its limit, counted once
        known = client.post(
            "/v1/chat/completions", json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 2}
        )
        assert known.status_code == 200, known.text
        assert known.headers["x-ratelimit-remaining-requests"] == "1"
        retrieved = client.get(f"/v1/models/{secrets.token_hex(8)}")
        assert retrieved.status_code == 404 and retrieved.headers["x-ratelimit-remaining-requests"] == "0"

        for made_up in (
            client.get(f"/v1/models/{secrets.token_hex(8)}"),
            client.post("/v1/chat/completions", json={"model": secrets.token_hex(8), "messages": MESSAGES}),
        ):
            assert made_up.status_code == 429, made_up.text
            assert made_up.json()["error"]["code"] == "rate_limit_exceeded"
            assert int(made_up.headers["retry-after"]) >= 1


def test_unknown_names_are_remembered_apart_in_a_bounded_cache(endpoint_loads, monkeypatch):
    # Each unknown (organisation, name) stayed in the endpoint cache, up to 100,000 of them of up to 8 KB each: a
    # stream of made-up names grew the web pod's memory until it was killed, every tenant's calls with it.
    monkeypatch.setattr(directory._unknown_endpoints, "max_entries", 50)
    # None is over meanwhile, however slow the machine: the bound drops them here, not their time being up.
    monkeypatch.setattr(directory._unknown_endpoints, "_ttl_s", 600)
    endpoint = EndpointFactory(name="support-chat")
    organization_id = endpoint.organization_id

    async def scenario():
        found = await directory.find_endpoint(organization_id, "support-chat")
        missing = [await directory.find_endpoint(organization_id, f"made-up-{index}") for index in range(200)]
        again = [await directory.find_endpoint(organization_id, "made-up-199") for _ in range(5)]
        return found, missing, again

    found, missing, again = asyncio.run(scenario())

    assert found.name == "support-chat" and missing == [None] * 200 and again == [None] * 5
    assert list(directory._endpoints.entries) == [(organization_id, "support-chat")]
    assert len(directory._unknown_endpoints) == 50
    assert endpoint_loads.count("made-up-199") == 1  # sent again: no query


def test_an_endpoint_created_after_its_name_was_unknown_is_found_once_that_expires(
    endpoint_loads, monkeypatch
):
    monkeypatch.setattr(directory._unknown_endpoints, "_ttl_s", 0.2)
    organization_id = EndpointFactory(name="other").organization_id

    async def before():
        return await directory.find_endpoint(organization_id, "new-model")

    assert asyncio.run(before()) is None
    EndpointFactory(organization_id=organization_id, name="new-model")

    async def after():
        await asyncio.sleep(0.3)
        return await directory.find_endpoint(organization_id, "new-model")

    assert asyncio.run(after()).name == "new-model"


def test_made_up_names_are_looked_up_a_few_at_a_time(endpoint_loads, monkeypatch):
    # A flood of new names took a worker thread and a PostgreSQL connection each, up to the pool's 32 per process.
    running, peak = [0], [0]

    async def slow(organization_id, name):
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(0.02)
        running[0] -= 1

    monkeypatch.setattr(directory._endpoints, "_load", slow)

    async def flood(num_organizations: int):
        return await asyncio.gather(*(directory.find_endpoint(index % num_organizations + 1, f"made-up-{index}")
                                      for index in range(40)))

    assert asyncio.run(flood(4)) == [None] * 40
    assert peak[0] == directory.MAX_ENDPOINT_LOOKUPS
    # one organisation's names take half the slots at most: the others' first lookups never wait behind them
    peak[0] = 0
    directory._unknown_endpoints.clear()
    assert asyncio.run(flood(1)) == [None] * 40
    assert peak[0] == directory.MAX_ENDPOINT_LOOKUPS // 2


@pytest.mark.parametrize("name", ["\x00", "bad\x00name", "tab\tname", "a" * (MAX_MODEL_NAME + 1)])
def test_retrieving_a_name_no_model_could_bear_is_not_found_without_a_lookup(endpoint_loads, tenant, name):
    # `GET /v1/models/%00` was looked up: PostgreSQL refused the NUL, a 500 and a traceback each time; and a name of
    # any length was looked up and cached (a body's `model` is capped at `MAX_MODEL_NAME`).
    access_log.prepare()
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "path": f"/v1/models/{name}",
        "method": "GET",
        "client": ("203.0.113.9", 4000),
        "headers": [(b"authorization", f"Bearer {tenant.key}".encode())],
    }
    asyncio.run(Gateway(fallback=None)._handle(scope, receive, send))

    error = json.loads(sent[1]["body"])["error"]
    assert (sent[0]["status"], error["code"], error["param"]) == (404, "model_not_found", "model")
    assert error["message"].isprintable() and len(error["message"]) < 200
    assert endpoint_loads == []


def test_a_key_past_its_limit_is_refused_before_any_name_is_looked_up(endpoint_loads, tenant):
    # A key already past its requests per minute still cost a PostgreSQL query for each new name it made up, before
    # its 429 (`refuse_unknown_model` counted it after the lookup).
    access_log.prepare()
    ApiKey.objects.filter(pk=tenant.api_key.pk).update(requests_per_minute=1)
    endpoint = EndpointFactory(organization=tenant.org, name="support-chat")
    gateway = Gateway(fallback=None)

    async def call(method, path, payload=None):
        sent = []
        body = json.dumps(payload).encode() if payload is not None else b""

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "path": path, "method": method, "client": ("203.0.113.9", 4000),
                 "headers": [(b"authorization", f"Bearer {tenant.key}".encode()),
                             (b"content-type", b"application/json")]}
        await gateway._handle(scope, receive, send)
        return sent[0]["status"], dict(sent[0]["headers"]), json.loads(sent[1]["body"])

    async def scenario():
        known = await call("GET", f"/v1/models/{endpoint.name}")  # looked up and cached; retrieving counts nothing
        first = await call("GET", "/v1/models/first-made-up")  # within the limit: looked up, counted, a 404
        cached = await call("GET", f"/v1/models/{endpoint.name}")  # past the limit, a cached name still answers
        made_up = [await call("GET", f"/v1/models/{secrets.token_hex(8)}"),
                   await call("POST", "/v1/chat/completions", {"model": secrets.token_hex(8), "messages": MESSAGES}),
                   await call("POST", "/v1/chat/completions",
                              {"model": f"{endpoint.name}:{secrets.token_hex(4)}", "messages": MESSAGES})]
        return first, known, cached, made_up

    first, known, cached, made_up = asyncio.run(scenario())

    assert first[0] == 404 and first[1][b"x-ratelimit-remaining-requests"] == b"0"
    assert known[0] == cached[0] == 200
    for status, headers, answer in made_up:
        assert status == 429, answer
        assert answer["error"]["code"] == "rate_limit_exceeded" and answer["error"]["type"] == "requests"
        assert int(headers[b"retry-after"]) >= 1
        assert headers[b"x-ratelimit-limit-requests"] == b"1" and headers[b"x-ratelimit-remaining-requests"] == b"0"
    assert endpoint_loads == ["support-chat", "first-made-up"]


def test_a_name_never_seen_waits_briefly_for_a_lookup_slot_then_gets_a_503(endpoint_loads, caplog):
    # NOTE: the endpoint cache's bound on lookups (`MAX_ENDPOINT_LOOKUPS`) had no wait limit: behind a flood of made-up
    # names (any key may send them, from as many organisations as sign-up allows), every tenant's first call to an
    # endpoint not yet cached queued for as long as the flood lasted, never the 503 with Retry-After a key lookup gets.
    from controlplane.credential_lookups import WAIT_S
    from endpoints.gateway import errors

    async def scenario():
        async with every_slot_held(directory._endpoints._load_slots):
            return await asyncio.wait_for(directory.find_endpoint(1, "never-seen"), WAIT_S + 3)

    caplog.set_level("INFO")
    with pytest.raises(errors.OpenAIError) as refused:
        asyncio.run(scenario())
    assert refused.value.status == 503 and refused.value.headers["retry-after"] == "1"
    assert refused.value.code == "service_unavailable"
    assert endpoint_loads == []
    assert not [record for record in caplog.records if record.levelno >= 30]  # a flood's refusals log nothing
    # not remembered as unknown (it was never looked up): once a slot is free it is looked up, and then remembered
    assert (1, "never-seen") not in directory._unknown_endpoints

    async def again():
        return [await directory.find_endpoint(1, "never-seen") for _ in range(3)]

    assert asyncio.run(again()) == [None] * 3
    assert endpoint_loads == ["never-seen"]


def test_an_endpoint_cached_but_stale_is_served_while_every_lookup_slot_is_taken(endpoint_loads, monkeypatch):
    # An endpoint already cached, even past its stale grace, is reloaded without a slot: a flood of made-up names never
    # refuses a known model's call.
    endpoint = EndpointFactory(name="support-chat")
    organization_id = endpoint.organization_id

    async def scenario():
        assert (await directory.find_endpoint(organization_id, "support-chat")).name == "support-chat"
        key = (organization_id, "support-chat")
        started, value = directory._endpoints.entries[key]
        directory._endpoints.entries[key] = (started - 3600, value)  # long past its TTL and stale grace
        async with every_slot_held(directory._endpoints._load_slots):
            return await asyncio.wait_for(directory.find_endpoint(organization_id, "support-chat"), 1)

    assert asyncio.run(scenario()).name == "support-chat"
    assert endpoint_loads == ["support-chat", "support-chat"]


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_call_naming_a_model_never_seen_while_every_lookup_slot_is_taken_gets_openais_503(
        endpoint_loads, tenant, method):
    # What the client reads of it: OpenAI's shape, `retry-after` (the openai clients retry it), the call logged as a
    # 503, never a 500 nor a call held for as long as the flood lasts.
    access_log.prepare()
    sent = []

    async def receive():
        body = json.dumps({"model": "never-seen", "messages": MESSAGES}).encode() if method == "POST" else b""
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "path": "/v1/models/never-seen" if method == "GET" else "/v1/chat/completions",
        "method": method,
        "client": ("203.0.113.9", 4000),
        "headers": [(b"authorization", f"Bearer {tenant.key}".encode()), (b"content-type", b"application/json")],
    }

    async def scenario():
        async with every_slot_held(directory._endpoints._load_slots):
            await asyncio.wait_for(Gateway(fallback=None)._handle(scope, receive, send), credential_lookups.WAIT_S + 3)

    asyncio.run(scenario())
    headers = dict(sent[0]["headers"])
    error = json.loads(sent[1]["body"])["error"]
    assert (sent[0]["status"], error["type"], error["code"]) == (503, "server_error", "service_unavailable")
    assert headers[b"retry-after"] == b"1"
    assert endpoint_loads == []


def test_one_organisations_flood_of_made_up_names_never_holds_back_another_organisations_first_call(endpoint_loads,
                                                                                                     monkeypatch):
    # NOTE: the endpoint lookups' slots were a plain semaphore: one organisation's keys sending made-up model names
    # (each within its key's requests per minute, a thousand keys each) took all four, and another organisation's
    # first call to its own endpoint (a new one, a gateway just started) waited 2 s and got a 503, for as long as the
    # flood lasted. Each lookup's organisation is known (the key's): the slots are shared fairly between them.
    endpoint = EndpointFactory(name="support-chat")
    flooding = OrganizationFactory()
    counted = directory._endpoints._load

    async def scenario():
        release = asyncio.Event()

        async def load(organization_id, name):
            if organization_id == flooding.pk:
                await release.wait()  # a slow lookup, as under a flood PostgreSQL's are
            return await counted(organization_id, name)

        monkeypatch.setattr(directory._endpoints, "_load", load)
        flood = [asyncio.ensure_future(directory.find_endpoint(flooding.pk, f"made-up-{n}")) for n in range(20)]
        await asyncio.sleep(0.2)
        try:
            return await asyncio.wait_for(directory.find_endpoint(endpoint.organization_id, "support-chat"), 1)
        finally:
            release.set()
            await asyncio.gather(*flood, return_exceptions=True)

    found = asyncio.run(scenario())
    assert found is not None and found.name == "support-chat"
