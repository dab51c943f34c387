"""Callers of a live web process (`tests.conftest.start_web_server`) as the web-process tests play them: a signed-in
console user and a GPU node's agent, over HTTP."""

from __future__ import annotations

import secrets

import httpx

from controlplane.accounts.models import Role
from controlplane.accounts.services import SYSTEM
from endpoints.fleet.services import create_join_token
from gpu_agent.protocol import Heartbeat
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory, UserFactory

REGISTRATION = {
    "name": "gpu-1",
    "gpu_type": "cpu",
    "num_gpus": 0,
    "gpu_memory_mb": 8192,
    "num_cpus": 2,
    "memory_mb": 24000,
    "agent_version": "0.1.0",
    "supported_quantizations": ["none"],
}


def signed_in_owner(client):
    """A signed-in owner's cookies (from Django's test `client`, for any HTTP client) and one endpoint of theirs."""
    organization = OrganizationFactory()
    user = UserFactory()
    MembershipFactory(organization=organization, user=user, role=Role.OWNER)
    endpoint = EndpointFactory(organization=organization, name="mine")
    client.force_login(user)
    return {name: morsel.value for name, morsel in client.cookies.items()}, endpoint


def registered_agent(base_url: str, *, join_token_name: str) -> tuple[str, dict]:
    """A node registered with the web process at `base_url` through a new join token: its secret and the body of a
    heartbeat with no replicas."""
    token = create_join_token(SYSTEM, name=join_token_name).plain
    secret = httpx.post(f"{base_url}/agent/v1/register", json=REGISTRATION | {"join_token": token}).json()[
        "node_secret"
    ]
    beat = Heartbeat(
        agent_version="0.1.0", num_cpus=2, memory_mb=24000, memory_used_mb=1000, replicas=[]
    ).to_dict()
    return secret, beat


def bogus_node_secret() -> str:
    """A node secret of the right shape that no node holds (anyone may send one: no credentials needed)."""
    return f"nd_{secrets.token_hex(6)}_{secrets.token_urlsafe(32)[:43]}"


def heartbeat_with_a_bogus_secret(web: str, *, timeout: float) -> httpx.Response:
    """An agent heartbeat to the web server at `web` under `bogus_node_secret` (what any stranger can send)."""
    return httpx.post(f"{web}/agent/v1/heartbeat", json={},
                      headers={"authorization": f"Bearer {bogus_node_secret()}"}, timeout=timeout)
