"""What a refused agent does, by the refusal's `error.code` (`gpu_agent.protocol`: `NODE_REFUSED`, `NODE_UNKNOWN`):
it registers again only when the control plane says a node secret arrived and names no node, and stops its engines only
when the control plane that refuses the node knows its secret or its join token."""

from __future__ import annotations

import ipaddress

import httpx
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane import tokens
from controlplane.accounts.services import SYSTEM
from endpoints.fleet import services
from endpoints.fleet.services import create_join_token, retire_node, revoke_join_token
from endpoints.nodes.models import Node, control_plane_service_addresses
from gpu_agent.protocol import NODE_REFUSED, NODE_RETIRED, NODE_UNKNOWN
from gpu_agent.runtime import control_plane
from gpu_agent.runtime.agent import Agent
from gpu_agent.runtime.config import AgentConfig
from gpu_agent.runtime.control_plane import HeartbeatUnauthorized, RegistrationRefused
from tests.fleet.test_node_sandbox_fact import in_process_control_plane  # noqa: F401 (a fixture)
from tests.test_agent_api import beat, register

pytestmark = pytest.mark.django_db


@pytest.fixture
def production_networks(settings):
    settings.ALLOW_LOOPBACK_NODES = False
    settings.NODE_NETWORKS = (ipaddress.ip_network("10.20.0.0/16"),)
    control_plane_service_addresses.cache_clear()
    yield settings
    control_plane_service_addresses.cache_clear()


class DropAuthorization(httpx.BaseTransport):
    """A proxy in front of the control plane that, while `drop`, strips `Authorization`."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner, self.drop = inner, False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.drop and "authorization" in request.headers:
            del request.headers["authorization"]
        return self.inner.handle_request(request)


def _agent(transport, token: str, tmp_path, **config) -> Agent:
    config = AgentConfig(control_plane_url="http://testserver", join_token=token, data_dir=tmp_path / "agent",
                         force_cpu=True, **config)
    return Agent(config, transport=transport)


def test_a_heartbeat_401_says_node_unknown_only_when_a_node_secret_arrived_and_names_no_node(client, agent_secret):
    missing = client.post("/agent/v1/heartbeat", {}, content_type="application/json")
    assert missing.status_code == 401 and "code" not in missing.json()["error"]
    never_issued = tokens.issue_token(Node.SECRET_KIND).plain
    for _ in range(2):  # the second answered from the refused secrets, without a query
        unknown = beat(client, never_issued)
        assert unknown.status_code == 401 and unknown.json()["error"]["code"] == NODE_UNKNOWN
    assert "code" not in beat(client, "not a secret").json()["error"]
    assert beat(client, agent_secret).status_code == 200
    watch = client.post("/agent/v1/watch", HTTP_AUTHORIZATION=f"Bearer {tokens.issue_token(Node.SECRET_KIND).plain}")
    assert watch.status_code == 401 and watch.json()["error"]["code"] == NODE_UNKNOWN


def test_a_retired_nodes_very_secret_is_told_node_retired_and_nothing_else_is(client):
    """Before: a retired node's secret was answered `NODE_UNKNOWN`, on which its agent registered again (its join token
    revoked: refused without a code), and its engines ran on. The hash of its secret is kept, never the secret."""
    created = create_join_token(SYSTEM, name="t")
    answer = register(client, created.plain).json()
    secret, node = answer["node_secret"], Node.objects.get(pk=answer["node_id"])
    digest = node.secret_digest
    retire_node(SYSTEM, node, reason="machine shut out")
    retire_node(SYSTEM, node, reason="retired again")  # keeps the hash kept the first time
    node.refresh_from_db()
    assert node.secret_digest == "" and node.retired_secret_digest == digest == tokens.hash_token(secret)
    assert secret not in str(Node.objects.filter(pk=node.pk).values().get())
    for _ in range(2):  # sent again, answered so again: never remembered as an unknown secret
        retired = beat(client, secret)
        assert retired.status_code == 401 and retired.json()["error"]["code"] == NODE_RETIRED
    # Another secret under the retired node's lookup (a guess, another environment's) is only unknown.
    kind, lookup, _rest = secret.split("_", 2)
    guessed = f"{kind}_{lookup}_{tokens.issue_token(Node.SECRET_KIND).plain.split('_', 2)[2]}"
    assert beat(client, guessed).json()["error"]["code"] == NODE_UNKNOWN
    assert "code" not in client.post("/agent/v1/heartbeat", {}, content_type="application/json").json()["error"]


def test_an_agent_of_a_retired_node_is_told_so_and_never_registers_again(in_process_control_plane, tmp_path,  # noqa: F811
                                                                          monkeypatch):
    """Against the real control plane: retired under a join token another node shares (left open), its agent does not
    join again as a new node (before: told `NODE_UNKNOWN`, it registered again at once, `tests/agent/test_agent_loop.py`
    says what it does then)."""
    monkeypatch.setattr(control_plane, "REREGISTER_MIN_INTERVAL_S", 0.0)
    created = create_join_token(SYSTEM, name="fleet")
    _agent(in_process_control_plane, created.plain, tmp_path / "other").control_plane.register()  # the fleet's other
    agent = _agent(in_process_control_plane, created.plain, tmp_path)
    try:
        agent.heartbeat_once()
        retire_node(SYSTEM, Node.objects.get(pk=agent.control_plane.node_id), reason="machine shut out")
        for _ in range(2):
            with pytest.raises(RegistrationRefused) as refused:
                agent.heartbeat_once()
            assert refused.value.node_retired and not refused.value.node_refused
        assert Node.objects.filter(join_token=created.join_token).count() == 2  # no new node
    finally:
        agent.shutdown()


def test_an_agent_told_retired_never_registers_again_when_an_older_web_pod_calls_it_unknown_even_restarted(
    in_process_control_plane, tmp_path, monkeypatch  # noqa: F811
):
    """A rolling deploy: a web pod older than protocol 5 answers a retired node's secret `NODE_UNKNOWN`. Before, the
    agent (told `NODE_RETIRED` a moment ago by a new pod) registered again under the fleet's shared token, left open:
    a new node, placed on."""
    monkeypatch.setattr(control_plane, "REREGISTER_MIN_INTERVAL_S", 0.0)
    created = create_join_token(SYSTEM, name="fleet")
    _agent(in_process_control_plane, created.plain, tmp_path / "other").control_plane.register()  # the fleet's other
    agent = _agent(in_process_control_plane, created.plain, tmp_path)
    try:
        agent.heartbeat_once()
        node = Node.objects.get(pk=agent.control_plane.node_id)
        retire_node(SYSTEM, node, reason="machine shut out")
        with pytest.raises(RegistrationRefused) as refused:
            agent.heartbeat_once()
        assert refused.value.node_retired
    finally:
        agent.shutdown()
    # The old pod knows no retired secret's hash: to it, the secret is only unknown.
    Node.objects.filter(pk=node.pk).update(retired_secret_digest="")
    services.RETIRED_NODE_SECRETS.clear()
    restarted = _agent(in_process_control_plane, created.plain, tmp_path)  # a restart: what it knows is in node.json
    try:
        for _ in range(2):
            with pytest.raises(RegistrationRefused) as refused:
                restarted.heartbeat_once()
            assert refused.value.node_retired and not refused.value.node_refused
        assert Node.objects.filter(join_token=created.join_token).count() == 2  # no new node
    finally:
        restarted.shutdown()


@pytest.mark.django_db(transaction=True)  # NOTE: the watch looks the secret up in a worker thread of its own
def test_a_retired_nodes_watch_is_told_node_retired(client):
    answer = register(client, create_join_token(SYSTEM, name="t").plain).json()
    retire_node(SYSTEM, Node.objects.get(pk=answer["node_id"]), reason="machine shut out")
    watch = client.post("/agent/v1/watch", HTTP_AUTHORIZATION=f"Bearer {answer['node_secret']}")
    assert watch.status_code == 401 and watch.json()["error"]["code"] == NODE_RETIRED


def test_a_retired_nodes_secret_sent_again_is_answered_node_retired_without_a_query(client):
    """Before, each heartbeat (and watch) under a retired node's secret looked the node up again: one query a back-off
    of its agent, or of anyone replaying its secret."""
    answer = register(client, create_join_token(SYSTEM, name="t").plain).json()
    retire_node(SYSTEM, Node.objects.get(pk=answer["node_id"]), reason="machine shut out")
    assert beat(client, answer["node_secret"]).json()["error"]["code"] == NODE_RETIRED  # looked up once
    with CaptureQueriesContext(connection) as queries:
        for _ in range(3):
            retired = beat(client, answer["node_secret"])
            assert retired.status_code == 401 and retired.json()["error"]["code"] == NODE_RETIRED
    assert [query["sql"] for query in queries.captured_queries] == []


@pytest.fixture
def agent_secret(client):
    return register(client, create_join_token(SYSTEM, name="t").plain).json()["node_secret"]


def test_a_proxy_dropping_authorization_makes_no_new_node_and_leaves_the_agent_its_own(
    in_process_control_plane, tmp_path  # noqa: F811
):
    """Before: the agent registered again on any 401; under a fleet's shared token 5 heartbeats through the proxy made
    6 nodes, and once the proxy was fixed the agent beat as the newest, empty one, told to run nothing."""
    created = create_join_token(SYSTEM, name="fleet")  # a fleet's shared, multi-use token
    transport = DropAuthorization(in_process_control_plane)
    agent = _agent(transport, created.plain, tmp_path)
    stopped = []
    agent.replicas.stop_unasked = lambda: stopped.append(1) or 0
    try:
        agent.heartbeat_once()
        first = agent.control_plane.node_id
        transport.drop = True
        for _ in range(5):
            with pytest.raises(HeartbeatUnauthorized):  # an httpx.HTTPError: the loop backs off and retries
                agent.heartbeat_once()
        assert Node.objects.count() == 1 and agent.control_plane.node_id == first
        transport.drop = False  # the proxy put right
        agent.heartbeat_once()
        assert agent.control_plane.node_id == first and stopped == []
    finally:
        agent.shutdown()


def test_a_node_the_control_plane_forgot_registers_again_at_most_once_a_minute(
    in_process_control_plane, tmp_path, monkeypatch  # noqa: F811
):
    created = create_join_token(SYSTEM, name="fleet")
    agent = _agent(in_process_control_plane, created.plain, tmp_path)
    try:
        agent.heartbeat_once()
        Node.objects.all().delete()  # forgotten: the next heartbeat's secret names no node
        monkeypatch.setattr(agent.control_plane, "_registered_at", -1e9)  # registered long ago
        agent.heartbeat_once()
        assert Node.objects.count() == 1 and agent.control_plane.node_id == str(Node.objects.get().pk)
        Node.objects.all().delete()  # forgotten again within the minute: retried, not registered again
        with pytest.raises(HeartbeatUnauthorized):
            agent.heartbeat_once()
        assert not Node.objects.exists()
        monkeypatch.setattr(control_plane, "REREGISTER_MIN_INTERVAL_S", 0.0)
        agent.heartbeat_once()
        assert Node.objects.count() == 1
    finally:
        agent.shutdown()


def test_a_registration_whose_token_admits_nobody_here_is_not_told_its_node_is_refused(client, production_networks):
    """Before: the host was judged before the token, and a bogus or revoked token at a host outside these networks got
    400 `node_refused`, on which an agent stops every engine."""
    bogus = register(client, "jt_" + "x" * 40, advertise_host="10.99.0.7")
    assert bogus.status_code == 401 and "code" not in bogus.json()["error"]
    created = create_join_token(SYSTEM, name="t")
    revoke_join_token(SYSTEM, created.join_token)
    revoked = register(client, created.plain, advertise_host="10.99.0.7")
    assert revoked.status_code == 401 and "code" not in revoked.json()["error"]
    usable = register(client, create_join_token(SYSTEM, name="u").plain, advertise_host="10.99.0.7")
    assert usable.status_code == 400 and usable.json()["error"]["code"] == NODE_REFUSED


def test_an_agent_pointed_at_another_environment_keeps_its_engines(
    in_process_control_plane, production_networks, tmp_path  # noqa: F811
):
    """Before: a control plane that knew neither the node's secret nor its spent one-use token, its node networks
    another's, answered `node_refused` and the agent stopped every engine."""
    created = create_join_token(SYSTEM, name="pool launch", max_uses=1)
    agent = _agent(in_process_control_plane, created.plain, tmp_path, advertise_host="10.20.0.7")
    stopped = []
    agent.replicas.stop_unasked = lambda: stopped.append(1) or 0
    try:
        agent.heartbeat_once()
        Node.objects.all().delete()
        production_networks.NODE_NETWORKS = (ipaddress.ip_network("10.30.0.0/16"),)
        control_plane_service_addresses.cache_clear()
        agent.control_plane._registered_at = -1e9
        with pytest.raises(RegistrationRefused) as refused:
            agent.heartbeat_once()
        assert not refused.value.node_refused and stopped == []
    finally:
        agent.shutdown()
