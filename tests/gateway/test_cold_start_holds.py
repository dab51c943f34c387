"""Requests held for cold starts are bounded (per organisation, per process) and share one pub/sub
subscription per endpoint, so one tenant's held streams never break another tenant's cold start or
the agents' long polls."""

from __future__ import annotations

import asyncio
import threading
import types

import httpx
import pytest
from django.utils import timezone

from controlplane import tokens
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Plan, Scope
from controlplane.accounts.services import SYSTEM, Actor, save_plan, set_organization_plan
from controlplane.redis_client import get_redis
from controlplane.redis_keys import endpoint_held_key, held_key
from endpoints.gateway import errors
from endpoints.models import Replica
from endpoints.nodes.models import Node
from endpoints.nodes.notify import endpoint_ready_channel, node_channel
from gpu_agent.protocol import NodeState
from tests.conftest import start_web_server, wait_until
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]


class HeldStreams:
    """`num` streaming requests, held by the gateway, from a thread of their own until `release()`."""

    def __init__(self, base_url: str, key: str, model: str, num: int):
        self.base_url, self.key, self.model, self.num = base_url, key, model, num
        self.num_held = 0
        self.failures: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()

    async def _main(self):
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        limits = httpx.Limits(max_connections=self.num + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=60, limits=limits) as client:
            await asyncio.gather(*(self._hold(client) for _ in range(self.num)))

    async def _hold(self, client: httpx.AsyncClient):
        body = {"model": self.model, "messages": MESSAGES, "max_tokens": 5, "stream": True}
        headers = {"authorization": f"Bearer {self.key}"}
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                self.failures.append(f"{response.status_code} {(await response.aread())[:200]!r}")
                return
            # NOTE: the iterator stays referenced while held: collecting it would close the stream.
            chunks = response.aiter_bytes()
            first = await anext(chunks)
            if not first.startswith(b": "):  # a progress comment: the gateway holds it
                self.failures.append(first[:200].decode(errors="replace"))
                return
            self.num_held += 1
            await self._stop.wait()
            await chunks.aclose()

    def release(self):
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def _tenant():
    membership = MembershipFactory(role="owner")
    key = create_api_key(Actor(user=membership.user), membership.organization, name="k", scopes=[Scope.INFERENCE])
    return membership.organization, key.plain


def _node_with_secret() -> tuple[Node, str]:
    issued = tokens.issue_token(Node.SECRET_KIND)
    node = Node.objects.create(name="watcher", gpu_type="l4", num_gpus=1, gpu_memory_mb=24_000, secret_lookup=issued.lookup,
                               secret_digest=issued.digest, state=NodeState.READY, quantizations=["none"],
                               last_heartbeat_at=timezone.now())
    return node, issued.plain


def _in_thread(call):
    result = {}

    def run():
        try:
            result["response"] = call()
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


@pytest.fixture
def small_pool_gateway(transactional_db, tmp_path):
    """A gateway whose shared Redis pool holds 8 connections: 40 held streams would each have taken one."""
    child, base_url = start_web_server(tmp_path, name="gateway", extra_env={
        "INFERPLANE_REDIS_MAX_CONNECTIONS": "8", "INFERPLANE_DEFAULT_MAX_HELD_REQUESTS": "1000"})
    yield base_url
    child.stop()


def test_many_held_streams_share_one_subscription_and_other_tenants_cold_starts_and_agent_watches_still_work(
        small_pool_gateway, start_mock_upstream):
    hoarder_org, hoarder_key = _tenant()
    hoarded = EndpointFactory(organization=hoarder_org, max_model_len=2048)  # never gets a replica
    held = HeldStreams(small_pool_gateway, hoarder_key, hoarded.name, 40)
    try:
        wait_until(lambda: held.num_held == 40 or held.failures, 90, message="forty held streams")
        assert held.failures == [] and held.num_held == 40
        assert get_redis().pubsub_numsub(endpoint_ready_channel(hoarded.pk)) == [(endpoint_ready_channel(hoarded.pk), 1)]

        # An agent's long poll answers at once when its node's replicas change.
        node, secret = _node_with_secret()
        watch, watched = _in_thread(lambda: httpx.post(f"{small_pool_gateway}/agent/v1/watch",
                                                       headers={"authorization": f"Bearer {secret}"}, timeout=60))
        wait_until(lambda: get_redis().pubsub_numsub(node_channel(node.pk))[0][1] == 1 or not watch.is_alive(), 30,
                   message="the watch to subscribe")
        get_redis().publish(node_channel(node.pk), "1")
        watch.join(30)
        assert watched["response"].status_code == 200 and watched["response"].json() == {"changed": True}

        # Another tenant's cold start is served as soon as its replica is READY.
        other_org, other_key = _tenant()
        cold = EndpointFactory(organization=other_org, max_model_len=2048)
        call, called = _in_thread(lambda: httpx.post(
            f"{small_pool_gateway}/v1/chat/completions", headers={"authorization": f"Bearer {other_key}"},
            json={"model": cold.name, "messages": MESSAGES, "max_tokens": 5}, timeout=60))
        wait_until(lambda: get_redis().pubsub_numsub(endpoint_ready_channel(cold.pk))[0][1] == 1 or not call.is_alive(),
                   30, message="the cold request to wait")
        ready = serve_endpoint(other_org, start_mock_upstream())  # a READY replica, on a node of its own
        Replica.objects.filter(endpoint=ready).update(endpoint=cold)
        get_redis().publish(endpoint_ready_channel(cold.pk), "1")
        call.join(60)
        assert called["response"].status_code == 200, called
        assert called["response"].json()["choices"][0]["message"]["content"] == "tok tok tok tok tok"
    finally:
        held.release()
    wait_until(lambda: get_redis().pubsub_numsub(endpoint_ready_channel(hoarded.pk))[0][1] == 0, 30,
               message="the subscription to end with its last waiter")


@pytest.fixture
def bounded_gateway(transactional_db, tmp_path):
    child, base_url = start_web_server(tmp_path, name="gateway", extra_env={"INFERPLANE_MAX_HELD_REQUESTS_PER_PROCESS": "6"})
    yield base_url
    child.stop()


def test_held_requests_past_the_organisations_quota_get_a_429_and_past_the_process_bound_a_503(bounded_gateway):
    # Six places: the first organisation takes three (each while it held fewer than were free), the second two (of
    # three free); the second's third finds one free and is refused, that place kept for an organisation holding none.
    small_org, small_key = _tenant()
    plan = save_plan(SYSTEM, Plan(name="tiny", max_held_requests=3))
    set_organization_plan(SYSTEM, small_org, plan)
    small = EndpointFactory(organization=small_org, max_model_len=2048)
    other_org, other_key = _tenant()
    other = EndpointFactory(organization=other_org, max_model_len=2048)
    held_small = HeldStreams(bounded_gateway, small_key, small.name, 3)
    wait_until(lambda: held_small.num_held == 3 or held_small.failures, 60, message="three held streams")
    held_other = HeldStreams(bounded_gateway, other_key, other.name, 2)

    def call(key, model):
        return httpx.post(f"{bounded_gateway}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                          json={"model": model, "messages": MESSAGES, "max_tokens": 5}, timeout=30)

    try:
        wait_until(lambda: held_small.num_held + held_other.num_held == 5 or held_small.failures or held_other.failures,
                   60, message="five held streams")
        assert held_small.failures == held_other.failures == []
        over_quota = call(small_key, small.name)
        over_process = call(other_key, other.name)
    finally:
        held_small.release()
        held_other.release()

    assert over_quota.status_code == 429
    assert over_quota.json()["error"]["code"] == "rate_limit_exceeded"
    assert "3 requests waiting for cold starts (quota max_held_requests)" in over_quota.json()["error"]["message"]
    assert over_process.status_code == 503 and int(over_process.headers["retry-after"]) >= 1
    assert over_process.json()["error"]["code"] == "no_capacity"
    assert get_redis().zcard(held_key(small_org.pk)) == 0 or wait_until(
        lambda: get_redis().zcard(held_key(small_org.pk)) == 0, 30, message="places given up")


def test_a_process_that_held_requests_gives_every_place_back(bounded_gateway):
    org, key = _tenant()
    endpoint = EndpointFactory(organization=org, max_model_len=2048)
    # alone, an organisation holds three of the six places (each taken while it held fewer than were free)
    held = HeldStreams(bounded_gateway, key, endpoint.name, 3)
    wait_until(lambda: held.num_held == 3 or held.failures, 60, message="three held streams")
    held.release()
    wait_until(lambda: get_redis().zcard(held_key(org.pk)) == 0, 30, message="places given up")
    # the process's places are free again, its share with them: three more can wait
    again = HeldStreams(bounded_gateway, key, endpoint.name, 3)
    try:
        wait_until(lambda: again.num_held == 3 or again.failures, 60, message="three held streams again")
        assert again.failures == []
    finally:
        again.release()


def test_one_organisation_flooding_cold_starts_never_takes_the_places_another_organisations_cold_start_needs(
        bounded_gateway):
    # Before: the process's places were first come, first served: one tenant waking its model with as many requests as
    # the process holds took every place, and another tenant's first request was a 503 until the flood was served.
    noisy_org, noisy_key = _tenant()
    noisy = EndpointFactory(organization=noisy_org, max_model_len=2048)
    quiet_org, quiet_key = _tenant()
    quiet = EndpointFactory(organization=quiet_org, max_model_len=2048)
    flood = HeldStreams(bounded_gateway, noisy_key, noisy.name, 12)
    try:
        wait_until(lambda: flood.num_held + len(flood.failures) == 12, 60, message="the flood held or refused")
        quiet_held = HeldStreams(bounded_gateway, quiet_key, quiet.name, 1)
        try:
            wait_until(lambda: quiet_held.num_held == 1 or quiet_held.failures, 60, message="the quiet request")
            assert quiet_held.failures == [] and quiet_held.num_held == 1
        finally:
            quiet_held.release()
    finally:
        flood.release()
    assert flood.num_held == 3  # half the process's six places, no more
    assert len(flood.failures) == 9 and all(failure.startswith("503 ") for failure in flood.failures)


def test_a_burst_at_a_cold_endpoint_holds_no_more_than_the_endpoints_bound_and_refuses_the_rest_at_once(
        tenant, monkeypatch):
    # Before, the endpoint's bound was read (its waiting set's count) and the call counted there only later, at its
    # admission: twelve calls arriving together each read 0 waiting and all twelve were held past a bound of 3.
    from controlplane.asgi import application
    from endpoints.gateway import cold_start

    monkeypatch.setattr(cold_start, "MAX_WAITING_PER_ENDPOINT", 3)
    endpoint = EndpointFactory(organization=tenant.org, max_model_len=2048, cold_start_timeout_s=4)  # never served

    async def burst() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=application, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as http:
            return await asyncio.gather(*(
                http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                          json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 5})
                for _ in range(12)))

    responses = asyncio.run(asyncio.wait_for(burst(), 60))

    assert all(r.status_code == 503 and int(r.headers["retry-after"]) >= 1 for r in responses), responses
    messages = [r.json()["error"]["message"] for r in responses]
    held = [m for m in messages if "became ready within 4 s" in m]
    refused = [m for m in messages if m == f"Too many requests are waiting for '{endpoint.name}' to start."]
    assert (len(held), len(refused)) == (3, 9), messages
    # every place given up, once
    assert get_redis().zcard(held_key(tenant.org.pk)) == get_redis().zcard(
        endpoint_held_key(tenant.org.pk, str(endpoint.pk))) == 0


def test_a_short_cold_start_held_after_a_long_one_never_lets_the_quota_forget_the_long_ones_place(monkeypatch):
    # Before, each place set its organisation's held set to expire with it: a place of 1 s taken after one of 300 s
    # expired the whole set a second later, the 300 s call still waiting, and the quota no longer counted it (three
    # held on a quota of two).
    from endpoints.gateway import cold_start

    monkeypatch.setattr(cold_start, "PLACE_GRACE_S", 0)
    org = OrganizationFactory().pk
    slow, quick = (types.SimpleNamespace(id=name, name=name, organization_id=org, cold_start_timeout_s=timeout_s,
                                         max_held_requests=2) for name, timeout_s in (("slow", 300), ("quick", 1)))

    async def scenario() -> list[int]:
        places, statuses = [], []
        try:
            for endpoint, request_id, wait_s in ((slow, "a", 0), (quick, "b", 2.2), (slow, "c", 0), (slow, "d", 0)):
                try:
                    places.append(await cold_start.take_place(endpoint, org, request_id, call_token="t"))
                    statuses.append(200)
                except errors.OpenAIError as exc:
                    statuses.append(exc.status)
                await asyncio.sleep(wait_s)  # the quick one's place lapses; the slow call still waits
        finally:
            for place in places:
                await cold_start.give_up(place)
        return statuses

    assert asyncio.run(scenario()) == [200, 200, 200, 429]


def test_requests_held_while_redis_loses_its_memory_still_count_against_the_organisations_quota(bounded_gateway):
    # Before, a flush (a restart without persistence) dropped the held sets, and the calls still held were counted
    # nowhere again: the organisation held three more on its quota of three for the rest of their cold start.
    org, key = _tenant()
    set_organization_plan(SYSTEM, org, save_plan(SYSTEM, Plan(name="tiny", max_held_requests=3)))
    endpoint = EndpointFactory(organization=org, max_model_len=2048)
    held = HeldStreams(bounded_gateway, key, endpoint.name, 3)
    try:
        wait_until(lambda: held.num_held == 3 or held.failures, 60, message="three held streams")
        assert held.failures == []
        get_redis().flushall()  # a restart without persistence
        wait_until(lambda: get_redis().zcard(held_key(org.pk)) == 3, 15, message="the held calls' places put back")
        over_quota = httpx.post(f"{bounded_gateway}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 5}, timeout=30)
    finally:
        held.release()

    assert over_quota.status_code == 429, over_quota.text
    assert "3 requests waiting for cold starts (quota max_held_requests)" in over_quota.json()["error"]["message"]
    wait_until(lambda: get_redis().zcard(held_key(org.pk)) == 0, 30, message="places given up")
    assert get_redis().zcard(endpoint_held_key(org.pk, str(endpoint.pk))) == 0
