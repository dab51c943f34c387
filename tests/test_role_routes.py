"""Every route of the URLconf, for each role of the caller's own organisation and for nobody signed in: a viewer
changes nothing anywhere (every state-changing method of every `/api/`, `/v1` and console route is refused), a member
none of what only admins may do, an organisation's owner who is not staff none of the fleet's pages, and a caller
with no credentials gets a 401 (the API) or the log-in (the console); never a 2xx where refused, never a 5xx, and the
organisation's objects are left as they were.

The routes are read from the URLconf itself (`test_cross_tenant_routes.routes_of`): a new route without a role check
fails here until it refuses a viewer, or is named below as one that acts on the caller's own account.
"""

from __future__ import annotations

import pytest
from django.conf import settings as django_settings
from django.contrib.auth import get_user
from django.middleware.csrf import _get_new_csrf_string
from django.urls import get_resolver, reverse
from rest_framework.test import APIClient

from billing.models import BillingAccount
from controlplane.accounts.models import Organization, Role
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, sign_in_staff
from tests.test_cross_tenant_routes import (
    caller_of,
    concrete_path,
    routes_of,
    seed_fleet,
    seed_organisation,
    state_of,
)

pytestmark = pytest.mark.django_db

WRITES = ("post", "put", "patch", "delete")
# Routes that act on the caller's own account (or nobody's), not on an organisation: any role may post to them.
ACCOUNT_ROUTES = (
    "signup/", "verify-email/", "invitations/<str:token>/", "login/", "logout/", "password-reset/", "reset/",
    "password-change/", "org/switch/", "account/", "api/v1/account/",
    # a new organisation of the caller's own, whatever their role in this one (`accounts.organizations`)
    "org/new/", "api/v1/organizations/",
)
# Routes that are no organisation's: the agent's (a node's secret), Stripe's webhook (its signature), Django's admin
# (staff, `test_staff_second_factor.py`), health checks and the schema.
NOBODYS_ROUTES = ("agent/v1/", "api/v1/billing/stripe/webhook", "django-admin/", "healthz", "readyz", "api/schema/",
                  "api/docs/")
# What only owners may write (README, "Closing an organisation"): an admin is refused these too.
OWNER_WRITES = ("api/v1/organization/close/", "console/organization/close/")
# What only owners and admins may write (README, "Accounts, sessions and roles"): a member is refused these.
ADMIN_WRITES = (
    "api/v1/credentials/", "api/v1/members/", "api/v1/invitations/", "api/v1/billing/",
    "console/credentials/", "console/members/", "console/invitations/", "console/billing/",
    *OWNER_WRITES,
)
# The fleet: staff's alone, a 404 to everyone else.
STAFF_ROUTES = ("api/v1/fleet/", "console/fleet/")
# A route a catch-all of the gateway answers: its `/v1` 404 for an unknown path.
CATCH_ALL = "v1/.*$"


def organisation_routes() -> list[str]:
    routes = list(routes_of(get_resolver().url_patterns))
    return [r for r in routes if r and r != CATCH_ALL and not r.startswith(ACCOUNT_ROUTES + NOBODYS_ROUTES)]


def whole_state_of(organization) -> list:
    account = BillingAccount.objects.for_organization(organization)
    return [*state_of(organization), account.spend_cap, Organization.objects.get(pk=organization.pk).name]


def _status(client, method: str, path: str) -> int:
    return getattr(client, method)(path, {}, format="json").status_code


def _refusals(client, routes, ids, *, allowed) -> dict[str, int]:
    wrong = {}
    for route in routes:
        path = concrete_path(route, ids)
        for method in WRITES:
            status = _status(client, method, path)
            if status not in allowed:
                wrong[f"{method.upper()} {route}"] = status
    return wrong


def _with_the_playgrounds_csrf_pair(client):
    """A session's `/v1` call as the playground sends it (the CSRF double-submit pair): without it `/v1` takes no
    session at all, a 401 that would say nothing of the viewer's role."""
    token = _get_new_csrf_string()
    client.cookies[django_settings.CSRF_COOKIE_NAME] = token
    client.credentials(HTTP_X_CSRFTOKEN=token)
    return client


# NOTE: transactional: `/v1` looks a key up in a worker thread, on its own connection, which sees only what is
# committed; in a test's transaction the key is unknown there (a 401), and refused from then on on `/api/` too.
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("with_key", [False, True], ids=["signed in", "with a key"])
def test_a_viewer_changes_nothing_on_any_route(settings, with_key):
    settings.DEBUG = False
    ours = OrganizationFactory()
    ids = seed_organisation(ours) | seed_fleet()
    client = caller_of(ours, Role.VIEWER, with_key=with_key)
    if not with_key:
        _with_the_playgrounds_csrf_pair(client)
    before = whole_state_of(ours)
    routes = [r for r in organisation_routes() if not (with_key and r.startswith("console/"))]

    # NOTE: 405 where the route takes no such method; 404 only on the fleet's routes (staff's, hidden from others).
    wrong = _refusals(client, [r for r in routes if not r.startswith(STAFF_ROUTES)], ids, allowed={403, 405})
    wrong |= _refusals(client, [r for r in routes if r.startswith(STAFF_ROUTES)], ids, allowed={404, 405})

    assert wrong == {}, wrong
    assert whole_state_of(ours) == before


@pytest.mark.parametrize("with_key", [False, True], ids=["signed in", "with a key"])
def test_a_member_does_none_of_what_only_admins_may_do(settings, with_key):
    settings.DEBUG = False
    ours = OrganizationFactory()
    ids = seed_organisation(ours)
    client = caller_of(ours, Role.MEMBER, with_key=with_key)
    before = whole_state_of(ours)
    routes = [r for r in organisation_routes() if r.startswith(ADMIN_WRITES)
              and not (with_key and r.startswith("console/"))]
    assert routes

    assert _refusals(client, routes, ids, allowed={403, 405}) == {}
    assert whole_state_of(ours) == before


@pytest.mark.parametrize("with_key", [False, True], ids=["signed in", "with a key"])
def test_an_admin_does_none_of_what_only_owners_may_do(settings, with_key):
    settings.DEBUG = False
    ours = OrganizationFactory()
    ids = seed_organisation(ours)
    client = caller_of(ours, Role.ADMIN, with_key=with_key)
    before = whole_state_of(ours)
    routes = [r for r in organisation_routes() if r.startswith(OWNER_WRITES)
              and not (with_key and r.startswith("console/"))]
    assert routes

    assert _refusals(client, routes, ids, allowed={403, 405}) == {}
    assert whole_state_of(ours) == before
    assert Organization.objects.get(pk=ours.pk).closed_at is None


@pytest.mark.parametrize("with_key", [False, True], ids=["signed in", "with a key"])
def test_an_organisations_owner_who_is_not_staff_finds_no_fleet_route(settings, with_key):
    settings.DEBUG = False
    ours = OrganizationFactory()
    ids = seed_organisation(ours) | seed_fleet()
    client = caller_of(ours, Role.OWNER, with_key=with_key)
    routes = [r for r in organisation_routes() if r.startswith(STAFF_ROUTES)
              and not (with_key and r.startswith("console/"))]
    assert routes
    wrong = _refusals(client, routes, ids, allowed={404, 405})
    for route in routes:
        status = client.get(concrete_path(route, ids)).status_code
        if status != 404:
            wrong[f"GET {route}"] = status
    assert wrong == {}, wrong


def test_the_fleet_routes_hidden_from_an_owner_answer_staff_with_their_objects(settings):
    # NOTE: the control of the test above: a 404 to everyone, staff too, would be the answer of a route whose fixture
    # object is missing, and that test would pass whatever the route let a non-staff owner do.
    settings.DEBUG = False
    ids = seed_organisation(OrganizationFactory()) | seed_fleet()
    staff = UserFactory(is_staff=True)
    MembershipFactory(organization=OrganizationFactory(), user=staff, role=Role.OWNER)
    client = APIClient(raise_request_exception=False)
    sign_in_staff(client, staff)
    routes = [r for r in organisation_routes() if r.startswith(STAFF_ROUTES)]
    answers = {route: client.get(concrete_path(route, ids)).status_code for route in routes}
    assert routes and {route: status for route, status in answers.items() if status not in (200, 405)} == {}


def test_nobody_signed_in_gets_a_401_from_the_api_and_the_log_in_from_the_console(settings):
    settings.DEBUG = False
    ours = OrganizationFactory()
    MembershipFactory(organization=ours, user=UserFactory(), role=Role.OWNER)
    ids = seed_organisation(ours) | seed_fleet()
    before = whole_state_of(ours)
    client = APIClient(raise_request_exception=False)
    wrong = {}
    for route in organisation_routes():
        path = concrete_path(route, ids)
        for method in ("get", *WRITES):
            response = getattr(client, method)(path, {}, format="json")
            if route.startswith("console/"):
                expected = response.status_code == 302 and response["Location"].startswith("/login/")
            elif route.startswith("api/v1/fleet/"):
                expected = response.status_code in (401, 404, 405)
            else:
                expected = response.status_code in (401, 405)
            if not expected:
                wrong[f"{method.upper()} {route}"] = response.status_code
    assert wrong == {}, wrong
    assert whole_state_of(ours) == before


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("with_key", [False, True], ids=["signed in", "with a key"])
@pytest.mark.parametrize("role", [Role.OWNER, Role.ADMIN, Role.MEMBER])
def test_no_route_answers_an_empty_write_of_any_role_with_a_5xx(settings, role, with_key):
    settings.DEBUG = False
    ours = OrganizationFactory()
    ids = seed_organisation(ours) | seed_fleet()
    client = caller_of(ours, role, with_key=with_key)
    if not with_key:
        _with_the_playgrounds_csrf_pair(client)
    failures = {}
    for route in [r for r in organisation_routes() if not (with_key and r.startswith("console/"))]:
        for method in WRITES:
            status = _status(client, method, concrete_path(route, ids))
            # NOTE: the billing portal's 503 is its documented answer where Stripe is not configured
            if status >= 500 and not (route == "api/v1/billing/portal/" and status == 503):
                failures[f"{method.upper()} {route}"] = status
    assert failures == {}


def test_no_console_route_acts_on_a_post_from_a_page_of_the_organisation_switched_away_from(settings):
    settings.DEBUG = False
    shown, now = OrganizationFactory(), OrganizationFactory()
    ids = seed_organisation(now)
    client = caller_of(now, Role.OWNER, with_key=False)  # the session acts in `now`
    MembershipFactory(organization=shown, user=get_user(client), role=Role.OWNER)
    before = [whole_state_of(shown), whole_state_of(now)]
    acted = {}
    # NOTE: 302: the refusal, back to the page (a form that went on would answer its empty post with a 400)
    for route in [r for r in organisation_routes() if r.startswith("console/") and not r.startswith(STAFF_ROUTES)]:
        # NOTE: in the query too: the batch form, which posts a file, is checked there before its body is read
        path = f"{concrete_path(route, ids)}?page_organization={shown.pk}"
        response = client.post(path, {"page_organization": str(shown.pk)})
        # NOTE: the refusal's 302 is to the page it came from (no Referer here: the dashboard), never the log-in's: a
        # session that was not signed in would have passed with every route untried
        if response.status_code not in (302, 405) or (response.status_code == 302
                                                      and response["Location"] != reverse("console:dashboard")):
            acted[route] = (response.status_code, response.get("Location"))
    assert acted == {}
    assert [whole_state_of(shown), whole_state_of(now)] == before
