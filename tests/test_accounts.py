import pytest
from django.contrib.auth import get_user_model

from controlplane.accounts.models import Membership
from controlplane.accounts.signup import mark_email_verified

pytestmark = pytest.mark.django_db


def test_home_links_to_sign_up_and_log_in(client):
    page = client.get("/").content.decode()
    assert 'href="/signup/"' in page and 'href="/login/"' in page


def test_login_page_renders_a_labelled_form(client):
    page = client.get("/login/").content.decode()
    assert '<label for="id_username">' in page and '<label for="id_password">' in page
    assert "csrfmiddlewaretoken" in page


def test_sign_up_creates_the_user_and_an_organisation_they_own(client):
    response = client.post(
        "/signup/", {"email": "Ada@Example.test", "password": "a long passphrase", "organization_name": "Analytical Engines"}
    )
    assert response.status_code == 302 and response["Location"] == "/verify-email/"
    user = get_user_model().objects.get(email="ada@example.test")
    membership = Membership.objects.get(user=user)
    assert membership.role == "owner" and membership.organization.slug == "analytical-engines"
    mark_email_verified(user)
    assert "Analytical Engines" in client.get("/console/").content.decode()


def test_sign_up_shows_field_errors_and_creates_nothing(client):
    response = client.post("/signup/", {"email": "not-an-email", "password": "123", "organization_name": ""})
    assert response.status_code == 200
    page = response.content.decode()
    assert page.count('class="error"') >= 3
    assert not get_user_model().objects.exists()


def test_log_in_and_out(client):
    from controlplane.accounts.signup import sign_up_user

    user, _ = sign_up_user(email="bob@example.test", password="a long passphrase", organization_name="Bob's")
    mark_email_verified(user)
    response = client.post("/login/", {"username": "bob@example.test", "password": "a long passphrase"})
    assert response.status_code == 302
    assert client.get("/console/").status_code == 200
    client.post("/logout/")
    assert client.get("/console/").status_code == 302


def test_console_requires_login(client):
    assert client.get("/console/")["Location"].startswith("/login/")
