"""Engines are closed to everyone but the gateway: each replica has its own key, and the gateway
sends prompts only to addresses on the node's registered host and engine ports."""

import httpx
import pytest

from controlplane import secrets as secrets_at_rest
from endpoints.models import Replica
from tests.conftest import wait_until
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]


def _stats(address: str, key: str) -> int:
    return httpx.get(f"{address}/_stats", headers={"Authorization": f"Bearer {key}"}, timeout=5).json()["num_requests"]


def _set_engine_key(replica: Replica, key: str) -> None:
    Replica.objects.filter(pk=replica.pk).update(encrypted_engine_key=secrets_at_rest.encrypt(key))


def test_an_engine_refuses_a_direct_call_without_its_key_and_the_gateway_sends_it(gateway, tenant, start_mock_upstream):
    upstream = start_mock_upstream(engine_key="the-replica-key")
    body = {"model": "x", "messages": MESSAGES, "max_tokens": 2}
    assert httpx.post(f"{upstream}/v1/chat/completions", json=body, timeout=5).status_code == 401
    assert httpx.post(f"{upstream}/invocations", json=body, timeout=5).status_code == 401
    wrong = httpx.post(f"{upstream}/v1/chat/completions", json=body, headers={"Authorization": "Bearer guess"}, timeout=5)
    assert wrong.status_code == 401
    endpoint = serve_endpoint(tenant.org, upstream)
    _set_engine_key(endpoint.replicas.get(), "the-replica-key")
    answer = tenant.client(gateway).chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=2)
    assert answer.usage.completion_tokens == 2
    assert _stats(upstream, "the-replica-key") == 1  # only the gateway's call got through


def test_an_engine_that_refuses_the_gateways_key_is_a_replica_failure_not_the_clients(gateway, tenant, start_mock_upstream):
    upstream = start_mock_upstream(engine_key="another-key")
    endpoint = serve_endpoint(tenant.org, upstream, cold_start_timeout_s=2)
    response = httpx.post(f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                          json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 2}, timeout=30)
    assert response.status_code in (502, 503)
    assert response.json()["error"]["type"] != "authentication_error"


def test_the_gateway_never_sends_a_prompt_to_an_address_outside_the_nodes_engine_ports(gateway, tenant, start_mock_upstream):
    honest = start_mock_upstream(engine_key="k")
    rogue = start_mock_upstream(engine_key="k")
    honest_port = int(honest.rsplit(":", 1)[1])
    # The node registered exactly the honest engine's port; a row pointing elsewhere (written before
    # the check existed, or by hand) must still never receive a prompt.
    endpoint = serve_endpoint(tenant.org, honest, rogue, node_ports=(honest_port, honest_port))
    for replica in endpoint.replicas.all():
        _set_engine_key(replica, "k")
    client = tenant.client(gateway)
    for _ in range(8):
        assert client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=1).usage.completion_tokens == 1
    wait_until(lambda: _stats(honest, "k") == 8, 10, message="all eight calls on the honest engine")
    assert _stats(rogue, "k") == 0
