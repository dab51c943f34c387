"""The address a request comes from (per-address throttles, the audit log) is the one the web server took
from proxies it trusts (`FORWARDED_ALLOW_IPS`): a client that writes X-Forwarded-For itself changes
nothing, and behind a trusted proxy the client is the right-most hop that proxy added."""

from __future__ import annotations

import httpx
import pytest
from django.urls import reverse

from controlplane.accounts import throttle
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import AuditEvent, Role, Scope
from controlplane.accounts.services import Actor
from tests.conftest import start_web_server
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory


def _assert_throttled(response) -> None:
    assert response.status_code == 429
    assert int(response["Retry-After"]) >= 1


@pytest.mark.django_db
def test_an_address_writing_x_forwarded_for_still_meets_its_login_limit(client):
    limit = next(limit for limit in throttle.LOGIN if limit.per == "ip")
    for attempt in range(limit.num_attempts):
        client.post(reverse("login"), {"username": f"user{attempt}@example.test", "password": "guess"},
                    REMOTE_ADDR="10.9.8.7", HTTP_X_FORWARDED_FOR=f"198.51.100.{attempt}")
    _assert_throttled(client.post(reverse("login"), {"username": "fresh@example.test", "password": "guess"},
                                  REMOTE_ADDR="10.9.8.7", HTTP_X_FORWARDED_FOR="198.51.100.250, 203.0.113.1"))


@pytest.mark.django_db
def test_the_audit_log_records_the_servers_client_address_not_the_header(owner_client):
    owner_client.post("/api/v1/keys/", {"name": "k", "scopes": ["inference"]}, format="json",
                      REMOTE_ADDR="203.0.113.7", HTTP_X_FORWARDED_FOR="198.51.100.66")
    assert AuditEvent.objects.filter(action="api_key.create").latest("created_at").source_ip == "203.0.113.7"


def _manage_key() -> str:
    organization, user = OrganizationFactory(), UserFactory()
    MembershipFactory(organization=organization, user=user, role=Role.OWNER)
    return create_api_key(Actor(user=user), organization, name="ops", scopes=[Scope.MANAGE]).plain


def _create_key_through(base_url: str, key: str, forwarded_for: str) -> str:
    """Creates an API key through the real web server; the address its audit event records."""
    response = httpx.post(f"{base_url}/api/v1/keys/", json={"name": "from-afar", "scopes": ["manage"]},
                          headers={"Authorization": f"Bearer {key}", "X-Forwarded-For": forwarded_for}, timeout=30)
    assert response.status_code == 201, response.text
    return AuditEvent.objects.filter(action="api_key.create").latest("created_at").source_ip


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("trusted", "forwarded_for", "recorded"), [
    # This test's client (loopback) is no trusted proxy: its X-Forwarded-For is ignored.
    ("192.0.2.10", "198.51.100.7", "127.0.0.1"),
    # Behind a trusted proxy: the hop it added (right-most), not what the client wrote before it.
    ("127.0.0.1,::1", "198.51.100.7, 203.0.113.9", "203.0.113.9"),
    # Two trusted proxies in a row: the right-most hop that is not one of them.
    ("127.0.0.1,10.0.0.0/8", "198.51.100.7, 203.0.113.9, 10.1.2.3", "203.0.113.9"),
])
def test_through_the_web_server_only_trusted_proxies_name_the_client(transactional_db, tmp_path, trusted,
                                                                      forwarded_for, recorded):
    key = _manage_key()
    child, base_url = start_web_server(tmp_path, extra_env={"FORWARDED_ALLOW_IPS": trusted})
    try:
        assert _create_key_through(base_url, key, forwarded_for) == recorded
    finally:
        child.stop()
