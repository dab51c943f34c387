"""The session path's origin check (`auth._from_another_origin`) on requests a hostile client shapes itself."""

from __future__ import annotations

import asyncio

import pytest
from django.conf import settings

from endpoints.gateway import auth
from endpoints.gateway.errors import OpenAIError

# Any values: the origin check runs before the session or the CSRF pair is looked at.
SESSION_HEADERS = {"cookie": f"{settings.SESSION_COOKIE_NAME}=s; {settings.CSRF_COOKIE_NAME}=c", "x-csrftoken": "c"}


@pytest.mark.parametrize("origin", ["https://evil.example", "null"])
def test_a_session_call_with_an_origin_and_no_host_is_refused_not_a_500(origin):
    # Before: HTTP/1.0 allows a request without `Host`, and Django's check then read the WSGI `SERVER_NAME` of the
    # request the check builds, which it lacks: a KeyError, a 500 with its traceback logged as an ERROR, for anyone
    # without a session (on `/v1/files`, Django's own 500 page).
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(auth.caller_from_session(SESSION_HEADERS | {"origin": origin}))
    assert refused.value.status == 403 and refused.value.code == "cross_origin_session"


def test_the_consoles_own_origin_behind_the_ingress_is_not_another_origin(settings):
    settings.ALLOWED_HOSTS = ["inferplane.example.com", "localhost"]
    settings.CSRF_TRUSTED_ORIGINS = []
    console = {"origin": "https://inferplane.example.com", "host": "inferplane.example.com"}
    assert not auth._from_another_origin(console | {"x-forwarded-proto": "https"})
    assert auth._from_another_origin(console)  # over plain HTTP, as Django's forms judge it
    assert auth._from_another_origin(console | {"x-forwarded-proto": "https", "origin": "https://evil.example"})
    assert auth._from_another_origin({"origin": "https://evil.example", "host": "evil.example"})  # not allowed
    settings.CSRF_TRUSTED_ORIGINS = ["https://inferplane.example.com"]
    assert not auth._from_another_origin({"origin": "https://inferplane.example.com"})  # no `Host`: trusted alone
