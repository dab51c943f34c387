"""Made-up node secrets and join tokens on the public agent API cost one query at most, and a flood of them holds a
few lookups at once, never every thread and database connection."""

import asyncio
import ipaddress
import secrets
import threading
import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.accounts.models import AuditEvent
from controlplane.accounts.services import SYSTEM
from controlplane.credential_lookups import CredentialLookups, LookupsBusy
from endpoints.fleet import services
from endpoints.nodes.models import Node, control_plane_service_addresses
from gpu_agent.protocol import NODE_REFUSED, NODE_RETIRED
from tests.test_agent_api import beat, register

pytestmark = pytest.mark.django_db


def _bogus(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}"


class _PeakLookups:
    """Stands in for the node lookup (a slow query) and counts how many run at once."""

    def __init__(self):
        self.active = self.peak = self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, **_filters):
        with self._lock:
            self.active += 1
            self.calls += 1
            self.peak = max(self.peak, self.active)
        time.sleep(0.2)
        with self._lock:
            self.active -= 1
        return Node.objects.none()


@pytest.mark.parametrize(
    ("kind", "send"), [("nd", beat), ("jt", register)], ids=["node secret", "join token"]
)
def test_a_made_up_node_secret_or_join_token_sent_again_costs_no_query(client, kind, send):
    bogus = _bogus(kind)
    with CaptureQueriesContext(connection) as queries:
        statuses = [send(client, bogus).status_code for _ in range(10)]
    assert statuses == [401] * 10
    assert len(queries) == 1


def test_a_node_secret_issued_after_refusals_works_at_once_and_a_retired_one_stays_refused(client):
    for _ in range(3):
        assert beat(client, _bogus("nd")).status_code == 401
        assert register(client, _bogus("jt")).status_code == 401
    answer = register(client, services.create_join_token(SYSTEM, name="fresh").plain).json()
    assert beat(client, answer["node_secret"]).status_code == 200
    services.retire_node(SYSTEM, Node.objects.get(pk=answer["node_id"]), reason="test")
    assert beat(client, answer["node_secret"]).status_code == 401


def test_a_flood_of_made_up_node_secrets_runs_a_few_lookups_at_once(monkeypatch):
    lookups = _PeakLookups()
    monkeypatch.setattr(Node.objects, "filter", lookups)

    def one():
        with pytest.raises(services.AgentAuthError):
            services.authenticate_node(_bogus("nd"))

    threads = [threading.Thread(target=one) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert lookups.calls == 20
    assert lookups.peak <= services.MAX_AGENT_LOOKUPS


def test_a_flood_of_made_up_node_secrets_on_the_long_poll_runs_a_few_lookups_at_once(monkeypatch):
    lookups = _PeakLookups()
    monkeypatch.setattr(Node.objects, "filter", lookups)

    async def one():
        try:
            await services.authenticate_node_async(_bogus("nd"))
        except services.AgentAuthError:
            return "refused"

    async def flood():
        return await asyncio.gather(*(one() for _ in range(20)))

    assert asyncio.run(flood()) == ["refused"] * 20
    assert lookups.peak <= services.MAX_AGENT_LOOKUPS


def test_an_agent_waits_briefly_for_a_lookup_slot_then_gets_a_503_it_retries(client, monkeypatch):
    busy = CredentialLookups(max_concurrent=1, refused_for_s=60, wait_s=0.05)
    monkeypatch.setattr(services, "NODE_SECRET_LOOKUPS", busy)
    monkeypatch.setattr(services, "JOIN_TOKEN_LOOKUPS", busy)
    with busy.slots.held():  # another lookup holds the only slot
        heartbeat, registration = beat(client, _bogus("nd")), register(client, _bogus("jt"))
    assert heartbeat.status_code == registration.status_code == 503
    assert heartbeat["Retry-After"] == "1"
    assert "retry" in heartbeat.json()["error"]["message"]
    assert beat(client, _bogus("nd")).status_code == 401


@pytest.fixture
def node_networks(settings):
    settings.ALLOW_LOOPBACK_NODES = False
    settings.NODE_NETWORKS = (ipaddress.ip_network("10.20.0.0/16"),)
    control_plane_service_addresses.cache_clear()
    yield settings
    control_plane_service_addresses.cache_clear()


def test_busy_lookups_on_the_refused_paths_answer_503_to_retry_and_never_a_refusal_or_an_audit_row(
    client, monkeypatch, node_networks
):
    """A usable token's registration at a host the networks refuse, and a retired node's heartbeat, while strangers'
    made-up credentials hold every lookup slot: a 503 with Retry-After in the agent API's shape, no refusal code (none
    that would stop the engines, none that would make the agent register again), no audit row, no use of the token;
    once a slot is free, each is refused as it should be. (The reviewer's case, the token looked up after the host was
    judged: since the token is judged first, `register_node`, it held already; kept so.)"""
    created = services.create_join_token(SYSTEM, name="rack")
    retired = register(client, created.plain, advertise_host="10.20.0.8").json()
    services.retire_node(SYSTEM, Node.objects.get(pk=retired["node_id"]), reason="machine shut out")
    created = services.create_join_token(SYSTEM, name="rack-2")
    busy = CredentialLookups(max_concurrent=1, refused_for_s=60, wait_s=0.05)
    monkeypatch.setattr(services, "NODE_SECRET_LOOKUPS", busy)
    monkeypatch.setattr(services, "JOIN_TOKEN_LOOKUPS", busy)
    with busy.slots.held():
        answers = [register(client, created.plain, advertise_host="10.99.0.7"), beat(client, retired["node_secret"])]
    for answer in answers:
        assert answer.status_code == 503 and answer["Retry-After"] == "1"
        assert set(answer.json()["error"]) == {"message"} and "retry" in answer.json()["error"]["message"]
    assert not AuditEvent.objects.filter(action__startswith="node.register_refus").exists()
    created.join_token.refresh_from_db()
    assert created.join_token.num_uses == 0
    refused = register(client, created.plain, advertise_host="10.99.0.7")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == NODE_REFUSED
    assert AuditEvent.objects.filter(action="node.register_refused").count() == 1
    assert beat(client, retired["node_secret"]).json()["error"]["code"] == NODE_RETIRED


def test_a_node_that_beat_before_keeps_beating_while_made_up_secrets_hold_every_lookup_and_stops_once_retired(
        client, monkeypatch):
    """Before: every heartbeat of every node took a node-secret lookup slot, the same four a flood of made-up secrets
    on the public agent API takes: anyone sending them fast enough had the fleet's heartbeats refused (503) until its
    nodes were judged silent and their replicas, every tenant's, placed elsewhere or lost."""
    busy = CredentialLookups(max_concurrent=1, refused_for_s=60, wait_s=0.05)
    monkeypatch.setattr(services, "NODE_SECRET_LOOKUPS", busy)
    answer = register(client, services.create_join_token(SYSTEM, name="rack").plain).json()
    assert beat(client, answer["node_secret"]).status_code == 200

    with busy.slots.held():  # the flood's lookups hold every slot
        assert beat(client, answer["node_secret"]).status_code == 200
        assert beat(client, _bogus("nd")).status_code == 503
        services.retire_node(SYSTEM, Node.objects.get(pk=answer["node_id"]), reason="machine shut out")
        assert beat(client, answer["node_secret"]).json()["error"]["code"] == NODE_RETIRED


@pytest.mark.django_db(transaction=True)  # the long poll looks the node up on a worker thread's connection
def test_a_node_that_beat_before_is_let_on_the_long_poll_while_made_up_secrets_hold_every_lookup(client, monkeypatch):
    busy = CredentialLookups(max_concurrent=1, refused_for_s=60, wait_s=0.05)
    monkeypatch.setattr(services, "NODE_SECRET_LOOKUPS", busy)
    answer = register(client, services.create_join_token(SYSTEM, name="rack").plain).json()
    assert beat(client, answer["node_secret"]).status_code == 200

    async def during_the_flood():
        async with busy.slots.held_async():  # the flood's lookups hold every slot of the long poll's loop
            node = await services.authenticate_node_async(answer["node_secret"])
            with pytest.raises(LookupsBusy):
                await services.authenticate_node_async(_bogus("nd"))
        return node

    assert str(asyncio.run(during_the_flood()).pk) == answer["node_id"]


@pytest.mark.parametrize("beat_before", [True, False], ids=["beat through another process", "just registered"])
def test_a_node_known_to_another_web_process_keeps_beating_here_while_made_up_secrets_hold_every_lookup(
        client, monkeypatch, beat_before):
    """Before: a node secret was known only to the process it matched in: after a deploy or a scale-up of the web
    pods, every node's heartbeat was a stranger's in the new processes, and a flood of made-up secrets had the whole
    fleet refused (503) until the sweep judged it silent. Marked in Redis now, for every process."""
    answer = register(client, services.create_join_token(SYSTEM, name="rack").plain).json()
    if beat_before:
        assert beat(client, answer["node_secret"]).status_code == 200
    fresh = CredentialLookups(max_concurrent=1, refused_for_s=60, wait_s=0.05)  # a process that never saw the node
    monkeypatch.setattr(services, "NODE_SECRET_LOOKUPS", fresh)

    with fresh.slots.held():  # the flood's lookups hold every slot
        assert beat(client, answer["node_secret"]).status_code == 200
        assert beat(client, _bogus("nd")).status_code == 503  # a made-up secret still waits, then 503
