"""The gateway's console-session path (the playground) checks the session hash as Django does:
a password change or reset ends every other session on /v1 as on the console."""

from __future__ import annotations

import asyncio

import pytest
from django.conf import settings
from django.core import mail
from django.middleware.csrf import _get_new_csrf_string
from django.test import Client
from django.urls import reverse

from controlplane.accounts.models import Role
from endpoints.gateway.auth import authenticate
from endpoints.gateway.errors import OpenAIError
from tests.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "correct horse battery"
NEW_PASSWORD = "a brand new passphrase"


def _gateway_headers(client: Client) -> dict[str, str]:
    """What the playground sends to /v1: the session cookie and the CSRF double-submit token."""
    csrf = _get_new_csrf_string()
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    return {"cookie": f"{settings.SESSION_COOKIE_NAME}={session}; {settings.CSRF_COOKIE_NAME}={csrf}", "x-csrftoken": csrf}


def _v1_status(client: Client) -> int:
    try:
        asyncio.run(authenticate(_gateway_headers(client)))
    except OpenAIError as exc:
        return exc.status
    return 200


def _logged_in(user) -> Client:
    client = Client()
    assert client.login(username=user.username, password=PASSWORD)
    return client


@pytest.fixture
def member():
    user = UserFactory(username="member@example.test")
    MembershipFactory(user=user, role=Role.MEMBER)
    return user


def test_a_password_change_ends_the_other_sessions_on_v1_and_on_the_console(member):
    old_session, current_session = _logged_in(member), _logged_in(member)
    assert _v1_status(old_session) == 200

    response = current_session.post(reverse("password_change"), {
        "old_password": PASSWORD, "new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD})
    assert response.status_code == 302 and response.url == reverse("password_change_done")

    assert _v1_status(old_session) == 401
    response = old_session.get(reverse("console:dashboard"))
    assert response.status_code == 302 and response.url.startswith(reverse("login"))
    # The session that changed the password stays signed in, on both.
    assert _v1_status(current_session) == 200
    assert current_session.get(reverse("console:dashboard")).status_code == 200


def test_a_password_reset_ends_every_session(member):
    signed_in = _logged_in(member)
    assert _v1_status(signed_in) == 200

    anonymous = Client()
    anonymous.post(reverse("password_reset"), {"email": member.email})
    link = next(line.strip() for line in mail.outbox[-1].body.splitlines() if "/reset/" in line)
    form_url = anonymous.get(link, follow=True).redirect_chain[-1][0]
    response = anonymous.post(form_url, {"new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD})
    assert response.status_code == 302 and response.url == reverse("password_reset_complete")

    assert _v1_status(signed_in) == 401
    assert signed_in.get(reverse("console:dashboard")).status_code == 302


def test_an_unverified_account_cannot_infer_from_the_playground(member):
    from controlplane.accounts.models import EmailVerification

    client = _logged_in(member)
    EmailVerification.objects.filter(user=member).delete()
    assert _v1_status(client) == 401


def test_a_viewer_cannot_infer_from_the_playground(member):
    client = _logged_in(member)
    member.memberships.update(role=Role.VIEWER)
    assert _v1_status(client) == 403
