"""A session whose chosen organisation is no longer its user's (removed by an admin, or the organisation deleted)
acts in none until they choose again: `/api/` and the playground answer 403, the console shows the chooser. Before,
it fell back to the user's first other membership: the next key, endpoint, batch or billed playground call was made
in another organisation without a word."""

from __future__ import annotations

import asyncio
import json

import pytest
from django.conf import settings
from django.middleware.csrf import _get_new_csrf_string
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from controlplane.accounts.models import ApiKey, Membership, Role
from controlplane.accounts.tenancy import NO_LONGER_MEMBER, NOT_CHOSEN, SESSION_KEY
from endpoints.gateway.auth import authenticate
from endpoints.gateway.errors import OpenAIError
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def two_organisations():
    """A user who owns "Other" and is a member of "Chosen", the organisation their session chose."""
    user = UserFactory()
    other = OrganizationFactory(name="Other")
    MembershipFactory(organization=other, user=user, role=Role.OWNER)
    chosen = OrganizationFactory(name="Chosen")
    MembershipFactory(organization=chosen, user=user, role=Role.MEMBER)
    return user, chosen, other


def _session(client, user, organization) -> None:
    client.force_login(user)
    session = client.session
    session[SESSION_KEY] = organization.pk
    session.save()


def _removed(user, organization) -> None:
    Membership.objects.filter(user=user, organization=organization).delete()


def _playground(client) -> tuple[int, dict | None]:
    """What the gateway's playground path answers this client's session: (status, error body)."""
    csrf = _get_new_csrf_string()
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    headers = {"cookie": f"{settings.SESSION_COOKIE_NAME}={session}; {settings.CSRF_COOKIE_NAME}={csrf}",
               "x-csrftoken": csrf}
    try:
        caller = asyncio.run(authenticate(headers))
    except OpenAIError as exc:
        return exc.status, json.loads(exc.body())
    return 200, {"organization_id": caller.organization_id}


def test_api_refuses_a_session_removed_from_its_chosen_organisation(two_organisations):
    user, chosen, other = two_organisations
    client = APIClient()
    _session(client, user, chosen)
    assert client.get("/api/v1/organization/").json()["id"] == chosen.pk

    _removed(user, chosen)
    minted = client.post("/api/v1/keys/", {"name": "ci", "scopes": ["inference"]}, format="json")
    # Before: 201, a key minted in "Other".
    assert minted.status_code == 403
    assert minted.json() == {"detail": NO_LONGER_MEMBER}
    assert not ApiKey.objects.filter(organization=other).exists()
    current = client.get("/api/v1/organization/")
    assert current.status_code == 403 and "no longer a member" in current.json()["detail"]


def test_api_refuses_a_session_whose_chosen_organisation_was_deleted(two_organisations):
    user, chosen, other = two_organisations
    client = APIClient()
    _session(client, user, chosen)
    chosen.delete()
    response = client.get("/api/v1/keys/")
    assert response.status_code == 403 and response.json() == {"detail": NO_LONGER_MEMBER}


def test_console_shows_the_chooser_and_acts_in_no_other_organisation(two_organisations):
    user, chosen, other = two_organisations
    client = Client()
    _session(client, user, chosen)
    _removed(user, chosen)

    page = client.get(reverse("console:dashboard"))
    # Before: 200, the dashboard of "Other".
    assert page.status_code == 403
    text = page.content.decode()
    assert "no longer a member" in text and 'action="{}"'.format(reverse("switch-organization")) in text
    assert f'<option value="{other.pk}">Other</option>' in text
    created = client.post(reverse("console:keys"), {"name": "ci", "scopes": ["inference"], "expires_in_days": ""})
    assert created.status_code == 403
    assert not ApiKey.objects.filter(organization=other).exists()

    # Choosing an organisation of theirs ends it.
    assert client.post(reverse("switch-organization"), {"organization": other.pk}).status_code == 302
    assert client.get(reverse("console:dashboard")).status_code == 200
    assert client.session[SESSION_KEY] == other.pk


def test_console_and_api_answer_a_user_left_in_no_organisation_with_no_loop(two_organisations):
    user, chosen, other = two_organisations
    client = Client()
    _session(client, user, chosen)
    _removed(user, chosen)
    _removed(user, other)
    page = client.get(reverse("console:dashboard"))
    assert page.status_code == 403 and "not a member of any other organisation" in page.content.decode()
    assert client.get("/api/v1/keys/").status_code == 403


def _unchosen(client) -> None:
    """As a session signed in before sign-ins chose an organisation (or while its user was in none) is."""
    session = client.session
    del session[SESSION_KEY]
    session.save()


def test_a_session_that_never_chose_acts_in_the_first_organisation(two_organisations):
    user, chosen, other = two_organisations
    client = APIClient()
    client.force_login(user)
    _unchosen(client)
    assert client.get("/api/v1/organization/").json()["id"] == other.pk
    assert _playground(client) == (200, {"organization_id": other.pk})


def test_a_session_signed_in_before_sign_ins_chose_is_pinned_by_its_next_request_so_a_removal_moves_it_nowhere(
        two_organisations):
    user, chosen, other = two_organisations
    client = APIClient()
    client.force_login(user)
    _unchosen(client)
    assert client.get("/api/v1/organization/").json()["id"] == other.pk  # "Other" is the first membership

    _removed(user, other)
    minted = client.post("/api/v1/keys/", {"name": "ci", "scopes": ["inference"]}, format="json")
    # Before: 201, a key minted in "Chosen" without a word (the session followed the first membership).
    assert minted.status_code == 403 and minted.json() == {"detail": NO_LONGER_MEMBER}
    assert not ApiKey.objects.filter(organization=chosen).exists()
    assert _playground(client)[0] == 403


def test_a_session_signed_in_with_no_organisation_is_pinned_to_the_one_it_joins_elsewhere(two_organisations):
    user, chosen, other = two_organisations
    Membership.objects.filter(user=user).delete()
    client = Client()
    client.force_login(user)  # in no organisation: nothing to choose
    assert SESSION_KEY not in client.session
    assert client.get(reverse("console:dashboard")).status_code == 403
    MembershipFactory(organization=chosen, user=user, role=Role.MEMBER)  # accepted in another browser
    assert client.get(reverse("console:dashboard")).status_code == 200
    MembershipFactory(organization=other, user=user, role=Role.OWNER)

    _removed(user, chosen)
    page = client.get(reverse("console:dashboard"))
    # Before: 200, the dashboard of "Other".
    assert page.status_code == 403 and "no longer a member" in page.content.decode()


def test_the_playground_acts_in_no_organisation_for_a_session_that_never_chose(two_organisations):
    user, chosen, other = two_organisations
    client = Client()
    client.force_login(user)
    _unchosen(client)
    status, body = _playground(client)
    # Before: 200, the call made (and billed) in the first membership's organisation, whichever it was by then.
    assert status == 403
    assert body["error"] == {"message": NOT_CHOSEN, "type": "permission_error", "param": None,
                             "code": "insufficient_permissions"}
    assert client.get(reverse("console:dashboard")).status_code == 200  # the console pins the first
    assert _playground(client) == (200, {"organization_id": other.pk})


def test_a_sign_in_chooses_the_first_organisation_so_a_removal_from_it_moves_the_session_nowhere(two_organisations):
    user, chosen, other = two_organisations
    client = APIClient()
    client.force_login(user)
    assert client.session[SESSION_KEY] == other.pk  # "Other" is the first membership
    _removed(user, other)
    minted = client.post("/api/v1/keys/", {"name": "ci", "scopes": ["inference"]}, format="json")
    # Before: 201, a key minted in "Chosen", where the user never chose to act.
    assert minted.status_code == 403 and minted.json() == {"detail": NO_LONGER_MEMBER}
    assert not ApiKey.objects.filter(organization=chosen).exists()
    assert _playground(client)[0] == 403


def test_playground_refuses_a_session_removed_from_its_chosen_organisation(two_organisations):
    user, chosen, other = two_organisations
    client = Client()
    _session(client, user, chosen)
    assert _playground(client) == (200, {"organization_id": chosen.pk})

    _removed(user, chosen)
    status, body = _playground(client)
    # Before: 200, the call made (and billed) in "Other".
    assert status == 403
    assert body["error"]["type"] == "permission_error" and body["error"]["message"] == NO_LONGER_MEMBER

    client.post(reverse("switch-organization"), {"organization": other.pk})
    assert _playground(client) == (200, {"organization_id": other.pk})


def test_files_and_batches_on_v1_refuse_a_session_removed_from_its_chosen_organisation_in_openais_shape(
        two_organisations):
    user, chosen, other = two_organisations
    client = Client()
    _session(client, user, chosen)
    csrf = _get_new_csrf_string()
    client.cookies[settings.CSRF_COOKIE_NAME] = csrf
    assert client.get("/v1/batches", HTTP_X_CSRFTOKEN=csrf).status_code == 200

    _removed(user, chosen)
    listed = client.get("/v1/batches", HTTP_X_CSRFTOKEN=csrf)
    # Before: 200, the batches of "Other".
    assert listed.status_code == 403
    assert listed.json()["error"] == {"message": NO_LONGER_MEMBER, "type": "permission_error", "param": None,
                                      "code": "insufficient_permissions"}
