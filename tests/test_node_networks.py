"""A stolen join token cannot turn the gateway into a proxy into our own network: a node's host must lie in the
networks the operator named for GPU nodes (`INFERPLANE_NODE_NETWORKS`) and never be the control plane's own
PostgreSQL or Redis; a node outside them is refused at registration, at each heartbeat and by the gateway."""

import ipaddress
import math
import socket
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.accounts.models import AuditEvent
from controlplane.accounts.services import SYSTEM
from endpoints.fleet.services import create_join_token, revoke_join_token
from endpoints.gateway.directory import _load_replicas
from endpoints.models import Replica
from endpoints.nodes import models as nodes_models
from endpoints.nodes.models import JoinToken, Node, advertise_host_problem, control_plane_service_addresses
from endpoints.scheduler import move_off_unreachable_nodes, reconcile_endpoint
from gpu_agent.protocol import (
    DEFAULT_ENGINE_PORT_MAX,
    DEFAULT_ENGINE_PORT_MIN,
    NODE_REFUSED,
    ReplicaState,
    ReplicaStatus,
)
from gpu_agent.runtime.agent import Agent
from gpu_agent.runtime.config import AgentConfig
from gpu_agent.runtime.control_plane import RegistrationRefused
from tests.factories import EndpointFactory
from tests.fleet.test_node_sandbox_fact import in_process_control_plane  # noqa: F401 (a fixture)
from tests.test_agent_api import beat, register

pytestmark = pytest.mark.django_db

FLEET = (ipaddress.ip_network("10.20.0.0/16"), ipaddress.ip_network("fd00:20::/64"))


@pytest.fixture
def production_networks(settings):
    settings.ALLOW_LOOPBACK_NODES = False
    settings.NODE_NETWORKS = FLEET
    return settings


@pytest.fixture
def service_addresses(settings):
    control_plane_service_addresses.cache_clear()
    yield settings
    control_plane_service_addresses.cache_clear()


def test_a_node_registering_from_an_internal_address_outside_the_node_networks_is_400_audited_and_spends_no_token(
    client, production_networks
):
    created = create_join_token(SYSTEM, name="stolen", max_uses=3)
    for host in ("10.0.5.5", "172.16.0.10", "192.168.1.1", "fd00:99::1", "8.8.8.8"):
        response = register(
            client,
            created.plain,
            name="mole",
            advertise_host=host,
            engine_port_min=6000,
            engine_port_max=6500,
        )
        assert response.status_code == 400, host
        assert response.json()["error"]["message"].startswith("invalid registration: advertise_host: "), host
        assert "INFERPLANE_NODE_NETWORKS" in response.json()["error"]["message"], host
    assert not Node.objects.exists()
    assert JoinToken.objects.get(pk=created.join_token.pk).num_uses == 0
    refused = AuditEvent.objects.filter(action="node.register_refused")
    assert refused.count() == 5
    assert {event.details["advertise_host"] for event in refused} == {
        "10.0.5.5",
        "172.16.0.10",
        "192.168.1.1",
        "fd00:99::1",
        "8.8.8.8",
    }
    assert {event.target_id for event in refused} == {str(created.join_token.pk)}
    # Inside the named networks, a node registers as before.
    for host in ("10.20.3.7", "fd00:20::7"):
        assert register(client, created.plain, name=host, advertise_host=host).status_code == 201, host


def test_a_refused_host_with_a_bogus_token_is_401_and_writes_no_audit_row(client, production_networks):
    response = register(client, "jt_000000000000_nope", advertise_host="10.0.5.5")
    assert response.status_code == 401 and "code" not in response.json()["error"]  # the token first: nobody's node
    assert not AuditEvent.objects.filter(action="node.register_refused").exists()


def test_a_node_on_the_control_planes_own_redis_or_database_address_is_refused_even_inside_the_networks(
    client, production_networks, service_addresses
):
    service_addresses.CELERY_BROKER_URL = "redis://10.20.0.9:6379/1"
    token = create_join_token(SYSTEM, name="stolen").plain
    response = register(
        client, token, name="redis", advertise_host="10.20.0.9", engine_port_min=6000, engine_port_max=6500
    )
    assert response.status_code == 400
    assert "control plane's own PostgreSQL or Redis" in response.json()["error"]["message"]
    assert register(client, token, name="next-door", advertise_host="10.20.0.10").status_code == 201


def test_the_gateway_never_routes_to_a_replica_on_a_node_outside_the_node_networks(
    client, production_networks
):
    production_networks.NODE_NETWORKS = (*FLEET, ipaddress.ip_network("10.99.0.0/16"))
    answer = register(client, create_join_token(SYSTEM, name="t").plain, advertise_host="10.99.0.7").json()
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)
    assert (
        beat(
            client,
            answer["node_secret"],
            [ReplicaStatus(str(replica.pk), ReplicaState.READY, address="http://10.99.0.7:20001")],
        ).status_code
        == 200
    )
    assert [info.id for info in _load_replicas(str(endpoint.pk))] == [str(replica.pk)]
    # The operator drops that network (it was an internal service's): the directory's next load leaves it out.
    production_networks.NODE_NETWORKS = FLEET
    assert _load_replicas(str(endpoint.pk)) == []


def test_a_node_outside_the_node_networks_has_its_heartbeats_refused_with_the_reason(
    client, production_networks
):
    production_networks.NODE_NETWORKS = (*FLEET, ipaddress.ip_network("10.99.0.0/16"))
    answer = register(client, create_join_token(SYSTEM, name="t").plain, advertise_host="10.99.0.7").json()
    assert beat(client, answer["node_secret"]).status_code == 200
    production_networks.NODE_NETWORKS = FLEET
    response = beat(client, answer["node_secret"])
    assert response.status_code == 401  # under the node's own secret: the agent stops its engines on this code
    message = response.json()["error"]["message"]
    assert "registered host or engine ports are refused" in message and "INFERPLANE_NODE_NETWORKS" in message
    assert response.json()["error"]["code"] == NODE_REFUSED
    again = register(client, create_join_token(SYSTEM, name="t2").plain, advertise_host="10.99.0.7")
    assert again.status_code == 400 and again.json()["error"]["code"] == NODE_REFUSED
    # A malformed secret or a join token refused says nothing of any node: no code, the agent keeps its engines serving.
    assert "code" not in beat(client, "nd_" + "x" * 40).json()["error"]
    assert "code" not in register(client, "jt_" + "x" * 40, advertise_host="10.20.0.7").json()["error"]


def test_the_local_stack_still_admits_its_loopback_agent_and_private_addresses_by_default(client, settings):
    # `make run`'s defaults (DEBUG): loopback nodes allowed, the private networks the node networks.
    assert settings.ALLOW_LOOPBACK_NODES
    token = create_join_token(SYSTEM, name="local").plain
    for host in ("127.0.0.1", "localhost", "10.0.3.7", "192.168.7.7", "fd00:1::7"):
        assert register(client, token, name=host, advertise_host=host).status_code == 201, host
    assert register(client, token, name="public", advertise_host="8.8.8.8").status_code == 400


def _ready_replica_on(client, secret, address):
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)
    assert (
        beat(
            client, secret, [ReplicaStatus(str(replica.pk), ReplicaState.READY, address=address)]
        ).status_code
        == 200
    )
    return endpoint, replica


def test_a_node_inside_the_networks_with_engine_ports_outside_the_platforms_is_400_and_never_routed_to(
    client, production_networks
):
    token = create_join_token(SYSTEM, name="stolen", max_uses=10).plain
    # A web pod's own :8000, a Redis Cluster peer, PostgreSQL behind PgBouncer, the kube API: all inside 10/8.
    for host, port in (
        ("10.20.1.2", 8000),
        ("10.20.0.12", 6379),
        ("10.20.0.22", 5432),
        ("10.20.0.1", 6443),
        ("10.20.0.3", DEFAULT_ENGINE_PORT_MAX + 1),
    ):
        response = register(
            client,
            token,
            name=f"mole-{port}",
            advertise_host=host,
            engine_port_min=port,
            engine_port_max=port,
        )
        assert response.status_code == 400, port
        message = response.json()["error"]["message"]
        assert message.startswith("invalid registration: engine_port_min: "), message
        assert f"{DEFAULT_ENGINE_PORT_MIN}-{DEFAULT_ENGINE_PORT_MAX}" in message
    assert not Node.objects.exists()
    assert AuditEvent.objects.filter(action="node.register_refused").count() == 5
    assert (
        register(
            client,
            token,
            name="gpu",
            advertise_host="10.20.1.2",
            engine_port_min=DEFAULT_ENGINE_PORT_MIN,
            engine_port_max=DEFAULT_ENGINE_PORT_MIN + 99,
        ).status_code
        == 201
    )


def test_the_gateway_never_routes_to_an_engine_port_outside_the_platforms_of_a_node_registered_before_the_rule(
    client, production_networks
):
    production_networks.ALLOW_LOOPBACK_NODES = True  # registered where any range was taken
    answer = register(
        client,
        create_join_token(SYSTEM, name="t").plain,
        advertise_host="10.20.1.2",
        engine_port_min=8000,
        engine_port_max=8000,
    ).json()
    endpoint, replica = _ready_replica_on(client, answer["node_secret"], "http://10.20.1.2:8000")
    assert [info.id for info in _load_replicas(str(endpoint.pk))] == [str(replica.pk)]
    production_networks.ALLOW_LOOPBACK_NODES = False
    assert _load_replicas(str(endpoint.pk)) == []
    # Nor is anything placed there, and its agent is told to register again (and refused, with the reason).
    assert not Node.objects.placeable()
    response = beat(client, answer["node_secret"])
    assert response.status_code == 401
    assert "20000-29999" in response.json()["error"]["message"]


@pytest.fixture
def flaky_dns(monkeypatch):
    """The cluster's resolver, down for `failures["left"]` lookups of the control plane's own names."""
    real = socket.getaddrinfo
    names = {"db.internal": "10.20.0.5", "redis.internal": "10.20.0.6"}
    failures = {"left": 0, "names": names}  # what each name resolves to, which a test may change

    def getaddrinfo(host, *args, **kwargs):
        if host not in names:
            return real(host, *args, **kwargs)
        if failures["left"]:
            failures["left"] -= 1
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (names[host], 0))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(nodes_models, "RESOLVE_RETRY_S", 0.0)
    monkeypatch.setitem(nodes_models._last_unresolved, "at", -math.inf)
    return failures


def test_a_dns_failure_at_first_use_refuses_nodes_until_the_names_resolve_and_is_not_kept(
    client, production_networks, service_addresses, flaky_dns
):
    service_addresses.DATABASE_URL = "postgres://u:p@db.internal:5432/db"
    service_addresses.REDIS_URL = service_addresses.CELERY_BROKER_URL = "redis://redis.internal:6379/0"
    flaky_dns["left"] = 2
    assert "could not be resolved" in advertise_host_problem("10.20.0.9")  # fails closed meanwhile
    token = create_join_token(SYSTEM, name="t").plain
    response = register(client, token, name="db", advertise_host="10.20.0.5")
    assert response.status_code == 503  # the agent retries: a DNS failure of ours refuses no node for good
    assert response["Retry-After"]
    assert not Node.objects.exists()
    # The resolver is back: looked up again, the database's address is refused and another is admitted.
    assert "control plane's own PostgreSQL or Redis" in advertise_host_problem("10.20.0.5")
    assert "control plane's own PostgreSQL or Redis" in advertise_host_problem("10.20.0.6")
    assert register(client, token, name="db", advertise_host="10.20.0.5").status_code == 400
    assert register(client, token, name="gpu", advertise_host="10.20.0.9").status_code == 201


def test_a_database_address_spelled_ipv4_mapped_is_refused_as_its_ipv4(
    client, production_networks, service_addresses
):
    service_addresses.DATABASE_URL = "postgres://u:p@[::ffff:10.20.0.5]:5432/db"
    assert "control plane's own PostgreSQL or Redis" in advertise_host_problem("10.20.0.5")
    assert "control plane's own PostgreSQL or Redis" in advertise_host_problem("::ffff:10.20.0.5")
    response = register(client, create_join_token(SYSTEM, name="t").plain, advertise_host="10.20.0.5")
    assert response.status_code == 400


def test_a_revoked_or_expired_token_refused_for_its_host_writes_no_audit_row(client, production_networks):
    revoked = create_join_token(SYSTEM, name="old", max_uses=1)
    revoke_join_token(SYSTEM, revoked.join_token)
    expired = create_join_token(SYSTEM, name="late", expires_at=timezone.now() - timedelta(minutes=1))
    for created in (revoked, expired):
        for number in range(20):
            response = register(client, created.plain, name=f"flood-{number}", advertise_host="8.8.8.8")
            assert response.status_code == 401 and "code" not in response.json()["error"]  # its host never judged
    assert not AuditEvent.objects.filter(action="node.register_refused").exists()
    assert register(client, revoked.plain, advertise_host="10.20.0.1").status_code == 401


def test_an_agent_whose_host_the_operator_refuses_since_it_registered_is_told_its_registration_is_refused(
    in_process_control_plane,  # noqa: F811
    production_networks,
    tmp_path,
):
    production_networks.NODE_NETWORKS = (*FLEET, ipaddress.ip_network("10.99.0.0/16"))
    token = create_join_token(SYSTEM, name="rack").plain
    config = AgentConfig(
        control_plane_url="http://testserver",
        join_token=token,
        data_dir=tmp_path / "agent",
        force_cpu=True,
        advertise_host="10.99.0.7",
    )
    agent = Agent(config, transport=in_process_control_plane)  # starts no engine: nothing is placed on it
    try:
        agent.heartbeat_once()  # registers, then beats
        assert Node.objects.get().advertise_host == "10.99.0.7"
        production_networks.NODE_NETWORKS = FLEET
        with pytest.raises(RegistrationRefused) as refused:
            agent.heartbeat_once()
        # The heartbeat's own refusal, under the node's secret: no registration tried (it would be refused so too).
        assert "registered host or engine ports are refused" in str(refused.value)
        assert "INFERPLANE_NODE_NETWORKS" in str(refused.value)
        assert refused.value.node_refused  # the one refusal on which the agent stops its engines
        assert Node.objects.count() == 1  # no second node
    finally:
        agent.shutdown()


def test_an_agent_whose_secret_and_join_token_are_both_refused_is_not_told_its_node_is_refused(
    in_process_control_plane,  # noqa: F811
    production_networks,
    tmp_path,
):
    """A restored database or another environment knows neither the node's secret nor its join token, whose one use
    is spent: refused, but not as a node, so its engines keep serving (`Agent.heartbeat_once`)."""
    created = create_join_token(SYSTEM, name="pool launch", max_uses=1)
    config = AgentConfig(control_plane_url="http://testserver", join_token=created.plain, data_dir=tmp_path / "agent",
                         force_cpu=True, advertise_host="10.20.0.7")
    agent = Agent(config, transport=in_process_control_plane)
    try:
        agent.heartbeat_once()
        Node.objects.all().delete()  # the database restored from before the node joined
        agent.control_plane._registered_at = -math.inf  # registered longer than `REREGISTER_MIN_INTERVAL_S` ago
        with pytest.raises(RegistrationRefused) as refused:
            agent.heartbeat_once()
        assert "used-up join token" in str(refused.value)
        assert not refused.value.node_refused  # before: any 400, 401 or 403 stopped every engine
    finally:
        agent.shutdown()


def test_after_a_failed_lookup_the_next_waits_a_moment_and_nodes_are_refused_meanwhile(
    production_networks, service_addresses, flaky_dns, monkeypatch
):
    # While DNS is down each heartbeat and directory load would otherwise wait out the resolver's timeout.
    monkeypatch.setattr(nodes_models, "RESOLVE_RETRY_S", 3600.0)
    service_addresses.DATABASE_URL = "postgres://u:p@db.internal:5432/db"
    flaky_dns["left"] = 1
    assert "could not be resolved" in advertise_host_problem("10.20.0.9")
    assert "could not be resolved" in advertise_host_problem("10.20.0.9")
    assert flaky_dns["left"] == 0
    monkeypatch.setattr(nodes_models, "RESOLVE_RETRY_S", 0.0)
    assert advertise_host_problem("10.20.0.9") == ""


def test_callers_queued_behind_a_failed_first_lookup_wait_for_it_and_do_not_look_up_again(
    production_networks, service_addresses, monkeypatch
):
    """Before, each caller waiting for the first look-up ran its own once it failed: 8 gateway threads judging
    admitted nodes in a fresh process, behind a resolver failing in 0.5 s, made 8 look-ups in a row (4 s)."""
    import threading
    import time

    service_addresses.DATABASE_URL = "postgres://u:p@db.internal:5432/db"
    service_addresses.REDIS_URL = service_addresses.CELERY_BROKER_URL = "redis://redis.internal:6379/0"
    monkeypatch.setitem(nodes_models._last_unresolved, "at", -math.inf)
    lookups = []

    def timing_out(host, *args, **kwargs):  # the resolver's timeout while the cluster's DNS is down
        lookups.append(host)
        time.sleep(0.5)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", timing_out)
    problems = []
    threads = [threading.Thread(target=lambda: problems.append(advertise_host_problem("10.20.0.9", admitting=False)))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(lookups) == 1
    assert problems == [""] * 8  # inside the networks: admitted nodes are kept meanwhile


def test_a_failover_moving_the_databases_name_to_another_ip_is_followed_within_the_ttl(
    client, production_networks, service_addresses, flaky_dns, monkeypatch
):
    """A managed database's failover: its name now resolves to the standby's IP, inside the node networks. Before, the
    name was resolved once per process: a node registered at the new IP was admitted (201), and the gateway routed
    tenants' prompts and engine keys to the database."""
    service_addresses.DATABASE_URL = "postgres://u:p@db.internal:5432/db"
    assert "control plane's own" in advertise_host_problem("10.20.0.5")
    assert advertise_host_problem("10.20.0.7") == ""
    flaky_dns["names"]["db.internal"] = "10.20.0.7"  # the failover
    assert advertise_host_problem("10.20.0.7") == ""  # the last answer, younger than the TTL
    monkeypatch.setattr(nodes_models, "SERVICE_ADDRESSES_TTL_S", 0.0, raising=False)  # the TTL passes
    assert "control plane's own" in advertise_host_problem("10.20.0.7")
    token = create_join_token(SYSTEM, name="t").plain
    assert register(client, token, name="standby", advertise_host="10.20.0.7").status_code == 400
    # The old primary is still ours (a replica now) for a while; then its address may serve a node again.
    assert "control plane's own" in advertise_host_problem("10.20.0.5")
    monkeypatch.setattr(nodes_models, "SERVICE_ADDRESSES_KEPT_S", 0.0, raising=False)
    assert advertise_host_problem("10.20.0.5") == ""
    # Unresolvable at a later look-up: the last good answer is kept (the database's address still refused), while
    # younger than SERVICE_ADDRESSES_KEPT_S (`test_a_partial_dns_failure_keeps_the_names_that_resolved_...`).
    monkeypatch.setattr(nodes_models, "SERVICE_ADDRESSES_KEPT_S", 3600.0)
    flaky_dns["left"] = 1
    assert advertise_host_problem("10.20.0.9") == ""
    assert "control plane's own" in advertise_host_problem("10.20.0.7")
    assert flaky_dns["left"] == 0


def test_a_dns_failure_after_the_first_lookup_fails_no_replica_and_keeps_refusing_the_last_good_addresses(
    client, production_networks, service_addresses, flaky_dns, monkeypatch
):
    """Before, one failed re-lookup after the TTL refused every host: the sweep failed every live replica fleet-wide,
    the directory routed to none, placement found no node."""
    service_addresses.DATABASE_URL = "postgres://u:p@db.internal:5432/db"
    service_addresses.REDIS_URL = service_addresses.CELERY_BROKER_URL = "redis://redis.internal:6379/0"
    answer = register(client, create_join_token(SYSTEM, name="t").plain, advertise_host="10.20.0.9").json()
    endpoint, replica = _ready_replica_on(client, answer["node_secret"], "http://10.20.0.9:20001")
    monkeypatch.setattr(nodes_models, "SERVICE_ADDRESSES_TTL_S", 0.0, raising=False)  # every call looks up again
    flaky_dns["left"] = 10**6  # the resolver is down from now on
    assert move_off_unreachable_nodes() == 0
    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY
    assert [info.id for info in _load_replicas(str(endpoint.pk))] == [str(replica.pk)]
    assert [node.advertise_host for node in Node.objects.placeable()] == ["10.20.0.9"]
    assert beat(client, answer["node_secret"]).status_code == 200
    # The last good answer still refuses the control plane's own addresses.
    assert "control plane's own PostgreSQL or Redis" in advertise_host_problem("10.20.0.5")
    assert register(client, create_join_token(SYSTEM, name="t2").plain, advertise_host="10.20.0.6").status_code == 400
    # A process that never resolved them refuses new nodes (fail closed) but judges no admitted one by it.
    control_plane_service_addresses.cache_clear()
    assert "could not be resolved" in advertise_host_problem("10.20.0.10")
    assert move_off_unreachable_nodes() == 0
    assert [info.id for info in _load_replicas(str(endpoint.pk))] == [str(replica.pk)]
    assert [node.advertise_host for node in Node.objects.placeable()] == ["10.20.0.9"]
    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY


def test_a_refused_nodes_agent_registering_again_at_every_back_off_writes_one_audit_row_an_hour(
    client, production_networks
):
    created = create_join_token(SYSTEM, name="rack")
    refused = AuditEvent.objects.filter(action="node.register_refused")
    for _ in range(30):  # half an hour of an agent backing off a minute at a time
        response = register(client, created.plain, name="gpu-7", advertise_host="10.99.0.7")
        assert response.status_code == 400
        assert "INFERPLANE_NODE_NETWORKS" in response.json()["error"]["message"]
    assert refused.count() == 1  # before: 30
    # Another host, or other ports, is another refusal, audited once too.
    for _ in range(3):
        register(client, created.plain, name="gpu-8", advertise_host="10.99.0.8")
        register(client, created.plain, name="gpu-7", advertise_host="10.99.0.7", engine_port_min=6000,
                 engine_port_max=6500)
    assert refused.count() == 3
    # An hour on, the same refusal is audited again.
    refused.update(created_at=timezone.now() - timedelta(minutes=61))
    register(client, created.plain, name="gpu-7", advertise_host="10.99.0.7")
    assert refused.count() == 4
    assert refused.filter(created_at__gt=timezone.now() - timedelta(minutes=1)).get().details["advertise_host"] == (
        "10.99.0.7")


def test_a_token_holder_trying_one_host_after_another_writes_a_bounded_number_of_audit_rows(
    client, production_networks
):
    created = create_join_token(SYSTEM, name="stolen")
    for number in range(120):
        response = register(client, created.plain, name="mole", advertise_host=f"10.98.0.{number + 1}")
        assert response.status_code == 400
    # `MAX_REFUSED_REGISTRATIONS_AUDITED` of the token's refusals an hour (before: one row a try, 120); the log says each,
    # and one row that the bound was reached.
    assert AuditEvent.objects.filter(action="node.register_refused").count() == 100
    assert AuditEvent.objects.filter(action="node.register_refusals_unaudited").count() == 1


def test_refusals_of_a_fleets_own_hosts_are_audited_past_the_bound_a_token_holders_decoys_reach(
    client, production_networks
):
    production_networks.NODE_NETWORKS = (*FLEET, ipaddress.ip_network("10.99.0.0/16"))
    created = create_join_token(SYSTEM, name="fleet")  # one token the whole fleet shares
    for number in range(3):
        assert register(client, created.plain, name=f"gpu-{number}", advertise_host=f"10.99.0.{number + 1}").status_code == 201
    production_networks.NODE_NETWORKS = FLEET  # the operator narrows the networks under the fleet
    for number in range(120):  # the token's holder spends the hour's bound on decoys first
        register(client, created.plain, name="mole", advertise_host=f"10.98.0.{number + 1}")
    for number in range(3):
        assert register(client, created.plain, name=f"gpu-{number}", advertise_host=f"10.99.0.{number + 1}").status_code == 400
    # A second machine's name on a host is audited too, up to a bound a host.
    for number in range(10):
        register(client, created.plain, name=f"other-{number}", advertise_host="10.99.0.1")
    refused = AuditEvent.objects.filter(action="node.register_refused", details__registered_host=True)
    # Before: none of the fleet's own refusals (the decoys had taken the token's 100), nor another machine's name.
    assert sorted(refused.values_list("details__advertise_host", flat=True)) == ["10.99.0.1"] * 5 + ["10.99.0.2", "10.99.0.3"]
    assert AuditEvent.objects.filter(action="node.register_refusals_unaudited").count() == 1


def test_decoys_outside_the_networks_hide_no_probe_of_the_control_planes_own_redis_or_the_metadata_service(
    client, production_networks, service_addresses
):
    """Before: 100 refusals on decoy hosts took the token's hour, and the probes that followed wrote no row naming
    their host; the one summary row named neither host nor reason."""
    service_addresses.CELERY_BROKER_URL = "redis://10.20.0.9:6379/1"
    created = create_join_token(SYSTEM, name="shared", max_uses=50)
    for number in range(101):
        assert register(client, created.plain, name="d", advertise_host=f"10.98.0.{number + 1}").status_code == 400
    for probe in ("10.20.0.9", "169.254.169.254"):
        assert register(client, created.plain, name="probe", advertise_host=probe).status_code == 400
        assert AuditEvent.objects.filter(action="node.register_refused", details__advertise_host=probe).exists()
    summary = AuditEvent.objects.get(action="node.register_refusals_unaudited")
    assert "INFERPLANE_NODE_NETWORKS" in summary.details["reason"]


def test_link_local_decoys_hide_no_probe_of_the_metadata_service(client, production_networks):
    """Before (a last read of the change): every link-local host had the same reason, so 100 refusals of 169.254.1.x
    spent that reason's hour and a probe of 169.254.169.254 wrote no row naming it."""
    created = create_join_token(SYSTEM, name="shared", max_uses=50)
    for number in range(101):
        assert register(client, created.plain, name="d", advertise_host=f"169.254.1.{number + 1}").status_code == 400
    for probe in ("169.254.169.254", "100.100.100.200"):
        answer = register(client, created.plain, name="probe", advertise_host=probe)
        assert answer.status_code == 400 and "metadata" in answer.content.decode()
        assert AuditEvent.objects.filter(action="node.register_refused", details__advertise_host=probe).exists()


def test_unresolved_dns_in_a_fresh_process_still_applies_the_node_networks_to_admitted_nodes(
    client, production_networks, service_addresses, flaky_dns
):
    """Only the comparison with the control plane's own addresses is skipped while they do not resolve. Before, with
    `admitting=False` an unresolved look-up returned "" at once: a fresh process (a rolling deploy) while the
    cluster's DNS was down judged a node outside the narrowed networks reachable, routed prompts there and placed on
    it."""
    service_addresses.DATABASE_URL = "postgres://u:p@db.internal:5432/db"
    service_addresses.REDIS_URL = service_addresses.CELERY_BROKER_URL = "redis://redis.internal:6379/0"
    answer = register(client, create_join_token(SYSTEM, name="t").plain, advertise_host="10.20.0.9").json()
    endpoint, replica = _ready_replica_on(client, answer["node_secret"], "http://10.20.0.9:20001")
    assert [info.id for info in _load_replicas(str(endpoint.pk))] == [str(replica.pk)]
    production_networks.NODE_NETWORKS = (ipaddress.ip_network("10.30.0.0/16"),)  # the operator narrows them
    control_plane_service_addresses.cache_clear()  # a fresh process, while the cluster's DNS is down
    flaky_dns["left"] = 10**6
    assert "outside the networks" in Node.objects.get().host_problem()
    assert _load_replicas(str(endpoint.pk)) == []
    assert Node.objects.placeable() == []
    assert "outside the networks" in advertise_host_problem("8.8.8.8", admitting=False)
    assert advertise_host_problem("10.30.0.9", admitting=False) == ""  # inside: kept, its host cannot be judged


def test_a_partial_dns_failure_keeps_the_names_that_resolved_and_a_stale_answer_admits_no_new_node(
    client, production_networks, service_addresses, flaky_dns, monkeypatch
):
    """Before, a look-up that failed on one name kept the previous answer whole (a failover of another name, seen in
    the same look-up, was discarded: a node at the new primary was admitted), and the last good answer was kept
    forever: with DNS down for days, new nodes were still admitted against it."""
    service_addresses.DATABASE_URL = "postgres://u:p@db.internal:5432/db"
    service_addresses.REDIS_URL = service_addresses.CELERY_BROKER_URL = "redis://redis.internal:6379/0"
    assert advertise_host_problem("10.20.0.7") == ""
    monkeypatch.setattr(nodes_models, "SERVICE_ADDRESSES_TTL_S", 0.0)
    flaky_dns["names"]["db.internal"] = "10.20.0.7"  # the database's failover, seen ...
    real = socket.getaddrinfo

    def redis_down(host, *args, **kwargs):  # ... while the name after it does not resolve
        if host == "redis.internal":
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", redis_down)
    assert "control plane's own" in advertise_host_problem("10.20.0.7")
    assert "control plane's own" in advertise_host_problem("10.20.0.6")  # redis's, kept
    token = create_join_token(SYSTEM, name="t").plain
    assert register(client, token, name="standby", advertise_host="10.20.0.7").status_code == 400
    answer = register(client, token, name="gpu", advertise_host="10.20.0.9")
    assert answer.status_code == 201
    # DNS down past SERVICE_ADDRESSES_KEPT_S: no new node is admitted; the admitted ones are judged, beat and routed.
    flaky_dns["left"] = 10**6
    monkeypatch.setattr(nodes_models, "SERVICE_ADDRESSES_KEPT_S", 0.0)
    assert "could not be resolved" in advertise_host_problem("10.20.0.10")
    response = register(client, token, name="late", advertise_host="10.20.0.10")
    assert response.status_code == 503
    assert Node.objects.get(name="gpu").host_problem() == ""
    assert "control plane's own" in advertise_host_problem("10.20.0.7", admitting=False)  # still kept
    assert beat(client, answer.json()["node_secret"], []).status_code == 200
