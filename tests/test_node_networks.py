"""A stolen join token cannot turn the gateway into a proxy into our own network: a node's host must lie in the
networks the operator named for GPU nodes (`INFERPLANE_NODE_NETWORKS`) and never be the control plane's own
PostgreSQL or Redis; a node outside them is refused at registration, at each heartbeat and by the gateway."""

import ipaddress

import pytest

from controlplane.accounts.models import AuditEvent
from controlplane.accounts.services import SYSTEM
from endpoints.fleet.services import create_join_token
from endpoints.gateway.directory import _load_replicas
from endpoints.models import Replica
from endpoints.nodes.models import JoinToken, Node, control_plane_service_addresses
from endpoints.scheduler import reconcile_endpoint
from gpu_agent.protocol import ReplicaState, ReplicaStatus
from tests.factories import EndpointFactory
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


def test_a_refused_host_with_a_bogus_token_is_400_and_writes_no_audit_row(client, production_networks):
    response = register(client, "jt_000000000000_nope", advertise_host="10.0.5.5")
    assert response.status_code == 400
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
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "registered host is refused" in message and "INFERPLANE_NODE_NETWORKS" in message


def test_the_local_stack_still_admits_its_loopback_agent_and_private_addresses_by_default(client, settings):
    # `make run`'s defaults (DEBUG): loopback nodes allowed, the private networks the node networks.
    assert settings.ALLOW_LOOPBACK_NODES
    token = create_join_token(SYSTEM, name="local").plain
    for host in ("127.0.0.1", "localhost", "10.0.3.7", "192.168.7.7", "fd00:1::7"):
        assert register(client, token, name=host, advertise_host=host).status_code == 201, host
    assert register(client, token, name="public", advertise_host="8.8.8.8").status_code == 400
