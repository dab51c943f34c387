"""`/metrics` lists every tenant's endpoints and traffic: only a scraper with the metrics token reads it,
and its series name endpoints by id, so two organisations' `chat` endpoints never merge."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Role, Scope
from controlplane.accounts.services import Actor
from tests.conftest import REPO_ROOT, start_web_server, wait_until
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory
from tests.gateway import conftest as gateway_fixtures
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "scrape-" + "Zq8v" * 10
MESSAGES = [{"role": "user", "content": "Hello"}]

start_mock_upstream = gateway_fixtures.start_mock_upstream


@pytest.fixture
def monitored_gateway(transactional_db, tmp_path, web_zygote):
    """A real web process (uvicorn, the project's ASGI app) with a metrics token configured."""
    child, base_url = start_web_server(tmp_path, name="gateway", extra_env={"INFERPLANE_METRICS_TOKEN": TOKEN},
                                       zygote=web_zygote)
    yield base_url
    child.stop()


def _organisation_with_key():
    organization = OrganizationFactory()
    user = UserFactory()
    MembershipFactory(organization=organization, user=user, role=Role.OWNER)
    created = create_api_key(Actor(user=user), organization, name="test", scopes=[Scope.INFERENCE])
    return organization, created.plain


def _scrape(base_url: str, **headers) -> httpx.Response:
    return httpx.get(f"{base_url}/metrics", headers=headers, timeout=30)


def _samples(text: str) -> list:
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.startswith("inferplane_")]


def test_metrics_without_a_token_answer_401_and_show_nothing(monitored_gateway, start_mock_upstream):
    organization, _ = _organisation_with_key()
    serve_endpoint(organization, start_mock_upstream(), name="secret-project")
    response = _scrape(monitored_gateway)
    assert response.status_code == 401
    assert response.content == b""
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("authorization", [
    f"Bearer {TOKEN[:-1]}",
    f"Bearer {TOKEN}x",
    "Bearer",
    f"Basic {TOKEN}",
    TOKEN,
])
def test_metrics_with_a_wrong_token_answer_401(monitored_gateway, authorization):
    response = _scrape(monitored_gateway, Authorization=authorization)
    assert response.status_code == 401
    assert response.content == b""


def test_two_organisations_chat_endpoints_are_two_series_named_only_in_the_info_series(
    monitored_gateway, start_mock_upstream,
):
    upstream = start_mock_upstream()
    served = []
    for num_requests in (1, 2):
        organization, key = _organisation_with_key()
        endpoint = serve_endpoint(organization, upstream, name="chat")
        client = openai.OpenAI(base_url=f"{monitored_gateway}/v1", api_key=key, max_retries=0)
        for _ in range(num_requests):
            client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=2)
        served.append((str(endpoint.pk), str(organization.pk), num_requests))

    def counted_all():
        # A request is counted just after its response: wait for the last one.
        response = _scrape(monitored_gateway, Authorization=f"Bearer {TOKEN}")
        assert response.status_code == 200
        samples = _samples(response.text)
        requests_ok = {(s.labels["endpoint_id"], s.labels["organization_id"], int(s.value))
                       for s in samples if s.name == "inferplane_requests_total" and s.labels["status"] == "ok"}
        return samples if requests_ok == set(served) else None

    samples = wait_until(counted_all, 10, message="two series, one per organisation's chat endpoint")
    names = {(s.labels["endpoint_id"], s.labels["organization_id"], s.labels["name"])
             for s in samples if s.name == "inferplane_endpoint_info"}
    assert names == {(endpoint_id, organization_id, "chat") for endpoint_id, organization_id, _ in served}
    for sample in samples:
        if sample.name not in {"inferplane_endpoint_info", "inferplane_node_info"}:
            assert "name" not in sample.labels and "endpoint" not in sample.labels, sample
            assert "chat" not in sample.labels.values(), sample
    replicas = {s.labels["endpoint_id"] for s in samples if s.name == "inferplane_replicas"}
    assert replicas == {endpoint_id for endpoint_id, _, _ in served}


def test_nodes_are_labelled_by_id_and_named_only_in_the_node_info_series(monitored_gateway, start_mock_upstream):
    from endpoints.models import Replica

    organization, _ = _organisation_with_key()
    node = Replica.objects.get(endpoint=serve_endpoint(organization, start_mock_upstream())).node
    node.last_status = {"gpus": [{"index": 0, "utilization_percent": 50}]}
    node.save(update_fields=["last_status"])
    samples = _samples(_scrape(monitored_gateway, Authorization=f"Bearer {TOKEN}").text)
    utilization = [(s.labels, s.value) for s in samples if s.name == "inferplane_node_gpu_utilization"]
    assert utilization == [({"node_id": str(node.pk), "gpu": "0"}, 0.5)]
    info = [s.labels for s in samples if s.name == "inferplane_node_info"]
    assert info == [{"node_id": str(node.pk), "name": node.name}]


def _get_in_process(path: str, *, client: tuple[str, int], headers: dict | None = None) -> httpx.Response:
    """One request to the project's ASGI application in this process, from the given client address."""
    from controlplane.asgi import application

    async def get():
        transport = httpx.ASGITransport(app=application, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            return await http.get(path, headers=headers or {})

    return asyncio.run(get())


def test_without_a_configured_token_production_answers_metrics_with_the_ordinary_404(settings):
    settings.DEBUG, settings.METRICS_TOKEN = False, ""
    for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": f"Bearer {TOKEN}"}):
        response = _get_in_process("/metrics", client=("127.0.0.1", 40000), headers=headers)
        assert response.status_code == 404
        assert b"inferplane_" not in response.content
        assert b"Page not found" in response.content  # the site's own page, as for any unknown address


def test_debugging_without_a_token_serves_metrics_only_to_a_direct_loopback_client(settings):
    settings.DEBUG, settings.METRICS_TOKEN = True, ""
    assert _get_in_process("/metrics", client=("127.0.0.1", 40000)).status_code == 200
    assert _get_in_process("/metrics", client=("::1", 40000)).status_code == 200
    assert _get_in_process("/metrics", client=("10.1.2.3", 40000)).status_code == 404
    proxied = {"X-Forwarded-For": "203.0.113.7"}
    assert _get_in_process("/metrics", client=("127.0.0.1", 40000), headers=proxied).status_code == 404


def test_a_configured_token_is_required_even_on_loopback_when_debugging(settings):
    settings.DEBUG, settings.METRICS_TOKEN = True, TOKEN
    assert _get_in_process("/metrics", client=("127.0.0.1", 40000)).status_code == 401
    authorized = _get_in_process("/metrics", client=("10.1.2.3", 40000), headers={"Authorization": f"Bearer {TOKEN}"})
    assert authorized.status_code == 200
    assert b"inferplane_requests_total" in authorized.content


def test_production_refuses_a_short_metrics_token():
    environment = {
        "PATH": os.environ["PATH"], "DJANGO_SETTINGS_MODULE": "controlplane.settings", "DJANGO_DEBUG": "0",
        "DJANGO_SECRET_KEY": "k3y-" + "x9Q!z" * 12,
        "INFERPLANE_ENCRYPTION_KEYS": "YnVpbGQtdGltZS1wbGFjZWhvbGRlci1uZXZlci11c2U=",
        "ALLOWED_HOSTS": "inferplane.example.com",
        "DATABASE_URL": "postgresql://u:p@db.internal:5432/inferplane", "REDIS_URL": "redis://redis.internal:6379/0",
        "INFERPLANE_NODE_NETWORKS": "10.20.0.0/16",
        "INFERPLANE_METRICS_TOKEN": "short",
    }
    result = subprocess.run([sys.executable, "manage.py", "check"], cwd=REPO_ROOT, env=environment,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "INFERPLANE_METRICS_TOKEN must be at least 32 characters" in result.stderr
