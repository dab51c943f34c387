"""A form or multipart body in a charset other than UTF-8 (or its ASCII and Latin-1 subsets) is a 400 wherever it is
sent, before anything decodes it (`controlplane.request_charset`): the console's plain 400 page, DRF's `{"detail"}`
on `/api/` (`/v1/files`: `tests/batches/test_files_api.py`). The charsets clients really send still log in."""

from __future__ import annotations

from urllib.parse import quote_from_bytes

import pytest
from django.test import Client

from controlplane.accounts.signup import mark_email_verified, sign_up_user

pytestmark = pytest.mark.django_db

FORM = "application/x-www-form-urlencoded"
MULTIPART = "multipart/form-data; boundary=XyZ"


@pytest.mark.parametrize("charset", ["punycode", "utf-7"])
@pytest.mark.parametrize("path", ["/login/", "/password-reset/", "/signup/"])
@pytest.mark.parametrize("kind", [FORM, MULTIPART])
def test_an_anonymous_console_post_in_another_charset_is_the_plain_400_page(path, kind, charset, settings):
    """Multipart `charset=punycode`: Django's `request.POST` (read by the CSRF check, then the form) raised
    `UnicodeError` whatever the error handler, a 500 on every console form, anonymous log-in included; `utf-7`: a lone
    surrogate in the e-mail, a 500 on the sign-up and password-reset forms. Urlencoded: Django's own `BadRequest`, then
    its 400 view's CSRF check read `request.POST` again and raised it out of the handler."""
    settings.DEBUG = False
    client = Client(raise_request_exception=False, enforce_csrf_checks=True)
    client.get(path)
    token = client.cookies["csrftoken"].value if "csrftoken" in client.cookies else ""
    value = b"\xff\xfe" if charset == "punycode" else b"+2AA-"  # NOTE: utf-7 decodes `+2AA-` to a lone surrogate
    if kind == MULTIPART:
        body = b'--XyZ\r\nContent-Disposition: form-data; name="email"\r\n\r\n' + value + b"\r\n--XyZ--\r\n"
    else:
        body = b"email=" + quote_from_bytes(value).encode() + b"&username=%FF"

    response = client.generic("POST", path, body, content_type=f"{kind}; charset={charset}", HTTP_X_CSRFTOKEN=token)

    assert response.status_code == 400, response.status_code
    assert response["Content-Type"].startswith("text/html") and b"Bad Request" in response.content
    assert "Content-Security-Policy" in response and "no-store" in response["Cache-Control"]


@pytest.mark.parametrize("body", [
    b"name=k&scopes=%2B2AA-",   # a choice echoed ("\ud800" is not a valid choice)
    b"name=k&%2B2AA-=1",        # an unknown field's name echoed
], ids=["choice", "unknown_field"])
def test_an_api_form_in_utf7_holding_a_lone_surrogate_is_a_400_not_a_500(owner_client, settings, body):
    """`charset=utf-7` decodes `+2AA-` to a lone surrogate, past the JSON parser's refusal: the 400 echoing it made
    DRF's JSONRenderer raise, a 500."""
    settings.DEBUG = False
    owner_client.raise_request_exception = False

    response = owner_client.generic("POST", "/api/v1/keys/", body, content_type=f"{FORM}; charset=utf-7")

    assert response.status_code == 400, response.status_code
    assert "charset" in response.json()["detail"]


def test_an_api_multipart_body_in_utf7_is_a_400_not_a_500(owner_client, settings):
    settings.DEBUG = False
    owner_client.raise_request_exception = False
    body = (b'--XyZ\r\nContent-Disposition: form-data; name="name"\r\n\r\nk\r\n'
            b'--XyZ\r\nContent-Disposition: form-data; name="scopes"\r\n\r\n+2AA-\r\n--XyZ--\r\n')

    response = owner_client.generic("POST", "/api/v1/keys/", body, content_type=f"{MULTIPART}; charset=utf-7")

    assert response.status_code == 400, response.status_code
    assert "charset" in response.json()["detail"]


TAKEN = [None, "UTF-8", "utf8", '"utf-8"', "us-ascii", "ISO-8859-1", "latin1"]


@pytest.mark.parametrize("charset", TAKEN)
def test_an_api_form_in_a_charset_clients_send_is_taken(owner_client, charset):
    kind = FORM if charset is None else f"{FORM}; charset={charset}"

    response = owner_client.generic("POST", "/api/v1/keys/", b"name=k%C3%A9", content_type=kind)

    assert response.status_code == 201, (response.status_code, response.content[:200])


@pytest.mark.parametrize("charset", TAKEN)
def test_a_multipart_log_in_in_a_charset_clients_send_still_works(client, charset):
    user = sign_up_user(email="bob@example.test", password="a long passphrase", organization_name="Bob's")
    mark_email_verified(user)
    kind = MULTIPART if charset is None else f"{MULTIPART}; charset={charset}"
    body = (b'--XyZ\r\nContent-Disposition: form-data; name="username"\r\n\r\nbob@example.test\r\n'
            b'--XyZ\r\nContent-Disposition: form-data; name="password"\r\n\r\na long passphrase\r\n--XyZ--\r\n')

    response = client.generic("POST", "/login/", body, content_type=kind)

    assert response.status_code == 302, response.status_code


WILDCARD_PART = (b'--XyZ\r\nContent-Disposition: form-data; name="name"\r\n\r\nk\xff\xfe+2AA-\r\n--XyZ--\r\n')


@pytest.mark.parametrize("content_type,body", [
    ("multipart/*; boundary=XyZ; charset=punycode", WILDCARD_PART),
    ("multipart/*; boundary=XyZ; charset=utf-7", WILDCARD_PART),
    ("*/x-www-form-urlencoded; charset=punycode", b"name=k%FF%FE"),
    ("*/x-www-form-urlencoded; charset=utf-7", b"name=k%2B2AA-"),
    ("*/x-www-form-urlencoded; charset=utf-7", b"name=k&%2B2AA-=1"),
], ids=["mp-punycode", "mp-utf7", "form-punycode", "form-utf7-value", "form-utf7-field"])
def test_a_wildcard_form_type_in_another_charset_is_a_400_not_a_500(owner_client, settings, content_type, body):
    """DRF matches a wildcard in the request's type to its form parsers, which decode with the charset named. Before:
    the middleware matched the form types exactly and let these through: a 500 (a review's finding)."""
    settings.DEBUG = False
    owner_client.raise_request_exception = False
    response = owner_client.generic("POST", "/api/v1/keys/", body, content_type=content_type)
    assert response.status_code == 400, (response.status_code, response.content[:300])
