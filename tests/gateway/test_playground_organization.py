"""The playground's calls act in the organisation its page was shown for, or not at all: a page left open on A's
endpoint, sent from after the session switched to B in another tab, is refused by the live gateway (OpenAI's
shape, nothing run or charged), never run in B or on B's endpoint of the same name."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from django.conf import settings
from django.middleware.csrf import _get_new_csrf_string
from django.test import Client
from django.urls import reverse

from billing.models import UsageRecord
from controlplane.accounts.models import Role
from endpoints.gateway.auth import PAGE_ORGANIZATION_HEADER
from tests.conftest import wait_until
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "shared-name"


def _send(gateway: str, client: Client, **extra_headers: str) -> httpx.Response:
    """The playground's call to /v1 as this client's session: its cookie, the CSRF double-submit token and any header
    the page adds."""
    csrf = _get_new_csrf_string()
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    headers = {"cookie": f"{settings.SESSION_COOKIE_NAME}={session}; {settings.CSRF_COOKIE_NAME}={csrf}",
               "x-csrftoken": csrf} | extra_headers
    return httpx.post(f"{gateway}/v1/chat/completions", headers=headers, timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})


def _page_organization(client: Client, endpoint) -> str:
    """The organisation the endpoint page's playground names (what `playground.js` sends)."""
    page = client.get(reverse("console:endpoint", args=[endpoint.pk]))
    assert page.status_code == 200
    return re.search(r'id="playground"[^>]*data-organization="(\d+)"', page.content.decode(), re.S).group(1)


@pytest.fixture
def two_tabs(gateway, start_mock_upstream):
    """A member of A and B, each with an endpoint named `MODEL`, signed in with A chosen."""
    first, second = OrganizationFactory(name="A"), OrganizationFactory(name="B")
    user = UserFactory()
    for organization in (first, second):
        MembershipFactory(organization=organization, user=user, role=Role.MEMBER)
    endpoints = [serve_endpoint(organization, start_mock_upstream(), name=MODEL) for organization in (first, second)]
    client = Client()
    client.force_login(user)
    assert client.post(reverse("switch-organization"), {"organization": first.pk}).status_code == 302
    return client, (first, second), endpoints


def test_a_playground_sent_after_a_switch_in_another_tab_is_refused_and_charges_nothing(gateway, two_tabs):
    client, (first, second), (first_endpoint, _) = two_tabs
    shown_for = _page_organization(client, first_endpoint)  # tab 1: A's endpoint page
    assert shown_for == str(first.pk)
    client.post(reverse("switch-organization"), {"organization": second.pk})  # tab 2: switches to B

    refused = _send(gateway, client, **{PAGE_ORGANIZATION_HEADER: shown_for})
    # Before: 200, the call run (and billed) in B, on B's endpoint of the same name.
    assert refused.status_code == 409, refused.text
    assert refused.headers["x-should-retry"] == "false"
    error = refused.json()["error"]
    assert error["code"] == "organization_switched" and error["type"] == "invalid_request_error"
    assert "another organisation" in error["message"] and "Nothing was run or charged" in error["message"]
    time.sleep(1)
    assert not UsageRecord.objects.exists()


def test_a_playground_sent_in_the_organisation_its_page_was_shown_for_runs_there(gateway, two_tabs):
    client, (first, second), (_, second_endpoint) = two_tabs
    client.post(reverse("switch-organization"), {"organization": second.pk})
    shown_for = _page_organization(client, second_endpoint)
    assert shown_for == str(second.pk)

    answered = _send(gateway, client, **{PAGE_ORGANIZATION_HEADER: shown_for})
    assert answered.status_code == 200, answered.text
    row = wait_until(lambda: UsageRecord.objects.first(), 15, message="the usage row")
    assert row.organization_id == second.pk and row.endpoint_id == second_endpoint.pk


def test_a_session_call_naming_no_page_acts_in_the_sessions_organisation_as_before(gateway, two_tabs):
    client, (first, second), (first_endpoint, _) = two_tabs
    answered = _send(gateway, client)  # curl with a session, a page cached from before the header
    assert answered.status_code == 200, answered.text
    row = wait_until(lambda: UsageRecord.objects.first(), 15, message="the usage row")
    assert row.organization_id == first.pk and row.endpoint_id == first_endpoint.pk
