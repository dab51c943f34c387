"""A session's writes need its CSRF token (console forms, `/api/v1` and an invitation's page alike), a logged-out
session is nobody, a log-in issues a new session id and goes nowhere off the site, and an API key opens no console
page. Routes are read from the URLconf and the schema, so a new one is covered."""

from __future__ import annotations

import pytest
from django.conf import settings as django_settings
from django.test import Client
from rest_framework.test import APIClient

from controlplane.accounts import invitations
from controlplane.accounts.models import Invitation, Membership, Role
from controlplane.accounts.services import Actor
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, signed_in_with_the_password
from tests.test_cross_tenant_routes import caller_of, concrete_path, routes_of, seed_organisation, state_of

pytestmark = pytest.mark.django_db

# Console routes a signed-in member may post to (the staff-only fleet pages are a 404 to them before any check).
CONSOLE_PREFIXES = ("console/", "org/switch/", "org/new/", "password-change/", "logout/", "verify-email/resend/")


# What `{id}` names in the schema's paths, by their start.
ID_KINDS = [
    ("/api/v1/endpoints/{endpoint_pk}/adapters/", "adapter"),
    ("/api/v1/endpoints/", "endpoint"),
    ("/api/v1/credentials/", "credential"),
    ("/api/v1/keys/", "key"),
    ("/api/v1/members/", "member"),
    ("/api/v1/invitations/", "invitation"),
]


def _console_routes() -> list[str]:
    from django.urls import get_resolver

    return [
        route
        for route in routes_of(get_resolver().url_patterns)
        if route.startswith(CONSOLE_PREFIXES) and not route.startswith("console/fleet/")
    ]


def _signed_in(organization, *, enforce_csrf_checks: bool) -> Client:
    client = caller_of(organization, Role.OWNER, with_key=False)
    client.handler.enforce_csrf_checks = enforce_csrf_checks
    return client


def test_every_console_post_without_its_csrf_token_is_refused_and_changes_nothing(settings):
    settings.DEBUG = False
    organization = OrganizationFactory()
    ids = seed_organisation(organization)
    client = _signed_in(organization, enforce_csrf_checks=True)
    before = state_of(organization)

    answers = {
        route: client.post(
            concrete_path(route, ids), {"name": "x", "role": "viewer", "spend_cap": "0"}
        ).status_code
        for route in _console_routes()
    }

    assert {route: status for route, status in answers.items() if status != 403} == {}
    assert state_of(organization) == before


def test_every_api_write_in_a_session_without_its_csrf_token_is_a_403_that_says_so(settings):
    settings.DEBUG = False
    organization = OrganizationFactory()
    ids = seed_organisation(organization)
    client = _signed_in(organization, enforce_csrf_checks=True)
    paths = client.get("/api/schema/", {"format": "json"}).json()["paths"]
    before = state_of(organization)
    answers = {}

    for path, operations in paths.items():
        kind = next((kind for prefix, kind in ID_KINDS if path.startswith(prefix)), None)
        concrete = path.replace("{endpoint_pk}", ids["endpoint"]).replace("{key_id}", ids["key"])
        for method in {"post", "put", "patch", "delete"} & set(operations):
            response = getattr(client, method)(
                concrete.replace("{id}", ids[kind] if kind else ""), {}, format="json"
            )
            answers[f"{method.upper()} {path}"] = (
                response.status_code,
                response.json().get("detail", "")[:11],
            )

    assert len(answers) > 15
    assert {name: answer for name, answer in answers.items() if answer != (403, "CSRF Failed")} == {}
    assert state_of(organization) == before


def test_a_session_signed_out_is_nobody_on_the_console_and_the_api(settings):
    user = UserFactory()
    organization = OrganizationFactory()
    MembershipFactory(organization=organization, user=user, role=Role.OWNER)
    browser = signed_in_with_the_password(user)
    cookie = browser.cookies[django_settings.SESSION_COOKIE_NAME].value
    assert browser.get("/api/v1/organization/").status_code == 200

    browser.post("/logout/")
    replayed = APIClient()
    replayed.cookies[django_settings.SESSION_COOKIE_NAME] = cookie

    assert replayed.get("/api/v1/organization/").status_code in (401, 403)
    assert replayed.get("/console/keys/").status_code == 302


def test_an_api_key_opens_no_console_page_and_changes_nothing(settings):
    settings.DEBUG = False
    organization = OrganizationFactory()
    ids = seed_organisation(organization)
    client = caller_of(organization, Role.OWNER, with_key=True)
    before = state_of(organization)
    answers = {}

    for route in [route for route in _console_routes() if route != "logout/"]:  # a key has no session to end
        for method in ("get", "post"):
            response = getattr(client, method)(concrete_path(route, ids))
            answers[f"{method.upper()} {route}"] = (
                response.status_code,
                response.get("Location", "").split("?")[0],
            )

    assert {
        name: answer
        for name, answer in answers.items()
        if answer[0] not in (302, 403, 405) or answer[0] == 302 and answer[1] != "/login/"
    } == {}
    assert state_of(organization) == before


def test_accepting_an_invitation_needs_the_pages_csrf_token(settings):
    """A guard (it held before): a page elsewhere cannot make a signed-in invitee join an organisation."""
    organization = OrganizationFactory()
    owner, invitee = UserFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    invitation = invitations.invite_member(Actor(user=owner), organization, email=invitee.email, role=Role.ADMIN)
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(invitee)
    path = f"/invitations/{invitations.invitation_token(invitation)}/"

    assert browser.post(path).status_code == 403
    assert not Membership.objects.filter(organization=organization, user=invitee).exists()
    page = browser.get(path)
    token = page.content.decode().split('name="csrfmiddlewaretoken" value="')[1].split('"')[0]
    assert browser.post(path, {"csrfmiddlewaretoken": token}).status_code == 302
    assert Invitation.objects.get(pk=invitation.pk).accepted_by == invitee


@pytest.mark.parametrize("next_url", ["https://evil.example/", "//evil.example/", "/\\evil.example/", "\\\\evil.example",
                                      "https:evil.example", " //evil.example", "///evil.example",
                                      "https://testserver@evil.example/", "javascript:alert(1)"])
def test_a_log_in_whose_next_leaves_the_site_leads_to_the_console_on_a_new_session_id(settings, next_url):
    """A guard (it held before): no open redirect from `next=`, signed in or not, and no session fixation (the
    session id a visitor had before logging in names nobody after)."""
    settings.DEBUG = False
    user = UserFactory()
    MembershipFactory(organization=OrganizationFactory(), user=user, role=Role.OWNER)
    browser = Client()
    browser.get("/login/")
    session = browser.session
    session.save()
    before = session.session_key

    logged_in = browser.post("/login/", {"username": user.email, "password": "correct horse battery", "next": next_url})

    assert (logged_in.status_code, logged_in["Location"]) == (302, "/console/")
    assert browser.cookies[django_settings.SESSION_COOKIE_NAME].value != before
    again = browser.get("/login/", {"next": next_url})
    assert (again.status_code, again["Location"]) == (302, "/console/")
    fixated = Client()
    fixated.cookies[django_settings.SESSION_COOKIE_NAME] = before
    assert fixated.get("/api/v1/organization/").status_code in (401, 403)


@pytest.mark.parametrize("path", ["/login/", "/console/", "/api/v1/organization/"])
def test_a_session_cookie_holding_an_escaped_nul_is_nobody_not_a_500(path):
    """A quoted cookie's octal escape (`"\\000…"`) unquotes to a NUL, which PostgreSQL refuses: a 500 on every page
    before, the session store now takes only ids Django issues."""
    client = Client(raise_request_exception=False)

    response = client.get(path, HTTP_COOKIE=f'{django_settings.SESSION_COOKIE_NAME}="\\000{"a" * 31}"')

    assert response.status_code in (200, 302, 401, 403), response.status_code
