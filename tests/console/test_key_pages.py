"""The API keys page: create (secret shown once), scopes, expiry, revoke, last used."""

import pytest
from django.urls import reverse

from controlplane.accounts.keys import create_api_key, find_api_key
from controlplane.accounts.models import ApiKey, Role, Scope
from controlplane.accounts.services import Actor
from tests.factories import OrganizationFactory

pytestmark = pytest.mark.django_db


def test_creating_a_key_shows_its_secret_once(owner):
    response = owner.post(reverse("console:keys"), {"name": "ci", "scopes": [Scope.INFERENCE], "expires_in_days": "30"})
    assert response.status_code == 201
    secret = response.context["secret"]
    assert secret in response.content.decode() and "Copy" in response.content.decode()
    api_key = find_api_key(secret)
    assert api_key.name == "ci" and api_key.scopes == [Scope.INFERENCE] and api_key.expires_at is not None
    assert secret not in owner.get(reverse("console:keys")).content.decode()


def test_the_page_that_shows_a_new_key_is_never_stored_by_the_browser(owner, client):
    # Without `no-store` the browser kept it in its history: on a shared machine, Back after the owner logged out
    # showed the secret again. Every page and API answer of an account is the same.
    created = owner.post(reverse("console:keys"), {"name": "ci", "scopes": [Scope.INFERENCE], "expires_in_days": "30"})
    listed = owner.get(reverse("console:keys"))
    login_page = client.get(reverse("login"))

    for response in (created, listed, login_page):
        assert "no-store" in response["Cache-Control"] and "private" in response["Cache-Control"]


def test_key_list_shows_scopes_expiry_and_last_use(owner):
    created = create_api_key(Actor(user=owner.user), owner.organization, name="batch job", scopes=[Scope.MANAGE])
    find_api_key(created.plain)  # marks it used
    page = owner.get(reverse("console:keys")).content.decode()
    assert "batch job" in page and created.api_key.display_prefix in page
    assert "manage" in page and "Never" in page and "just now" in page


def test_key_list_shows_each_keys_limits_and_which_are_the_platform_default(owner, settings):
    settings.DEFAULT_KEY_REQUESTS_PER_MINUTE = 600
    settings.DEFAULT_KEY_TOKENS_PER_MINUTE = 50_000
    create_api_key(Actor(user=owner.user), owner.organization, name="own", scopes=[Scope.INFERENCE], requests_per_minute=10)
    page = owner.get(reverse("console:keys")).content.decode()
    assert "10 requests/min" in page and "600 requests/min" not in page
    assert '50000 tokens/min <span class="muted">(platform default)</span>' in page
    assert "Empty: the platform default, 600/min." in page and "Empty: the platform default, 50000/min." in page


def test_key_form_errors_are_inline(owner):
    response = owner.post(reverse("console:keys"), {"name": "", "requests_per_minute": "0"})
    page = response.content.decode()
    assert response.status_code == 400
    assert "This field may not be blank." in page
    assert "Ensure this value is greater than or equal to 1." in page
    assert not ApiKey.objects.exists()


def test_members_cannot_create_manage_keys(console_client_factory, org):
    member = console_client_factory(org, Role.MEMBER)
    response = member.post(reverse("console:keys"), {"name": "ops", "scopes": [Scope.MANAGE]})
    assert response.status_code == 400 and "Only owners and admins" in response.content.decode()


def test_viewer_cannot_create_or_revoke_keys(viewer, org):
    created = create_api_key(Actor(), org, name="k", scopes=[Scope.INFERENCE])
    assert viewer.post(reverse("console:keys"), {"name": "x", "scopes": [Scope.INFERENCE]}).status_code == 403
    assert viewer.post(reverse("console:key-revoke", args=[created.api_key.pk])).status_code == 403
    created.api_key.refresh_from_db()
    assert created.api_key.revoked_at is None
    assert "Create a key" not in viewer.get(reverse("console:keys")).content.decode()


def test_revoking_a_key_stops_it(owner):
    created = create_api_key(Actor(user=owner.user), owner.organization, name="old", scopes=[Scope.INFERENCE])
    owner.post(reverse("console:key-revoke", args=[created.api_key.pk]))
    assert find_api_key(created.plain) is None
    assert "Revoked" in owner.get(reverse("console:keys")).content.decode()


def test_another_organisations_key_is_a_404(owner):
    created = create_api_key(Actor(), OrganizationFactory(), name="theirs", scopes=[Scope.INFERENCE])
    assert owner.post(reverse("console:key-revoke", args=[created.api_key.pk])).status_code == 404
    created.api_key.refresh_from_db()
    assert created.api_key.revoked_at is None
    assert "theirs" not in owner.get(reverse("console:keys")).content.decode()


def test_a_key_gets_a_priority_range_from_the_form_and_the_list_shows_it(owner):
    refused = owner.post(reverse("console:keys"), {"name": "urgent", "scopes": [Scope.INFERENCE], "max_priority_boost": "100"})
    assert refused.status_code == 400 and "Ensure this value is less than or equal to 99." in refused.content.decode()
    created = owner.post(reverse("console:keys"), {"name": "urgent", "scopes": [Scope.INFERENCE], "max_priority_boost": "5"})
    assert created.status_code == 201 and find_api_key(created.context["secret"]).max_priority_boost == 5
    plain = owner.post(reverse("console:keys"), {"name": "plain", "scopes": [Scope.INFERENCE], "max_priority_boost": ""})
    assert plain.status_code == 201 and find_api_key(plain.context["secret"]).max_priority_boost is None
    assert "priority ±5" in owner.get(reverse("console:keys")).content.decode()


def test_key_list_shows_a_live_keys_expiry_and_an_expired_key_as_expired(owner):
    # Before: the template asked `key.is_usable`, which since the expiry is judged by PostgreSQL's clock takes the
    # time as an argument: a template cannot pass one, so it read as false and every key with an expiry was listed
    # dimmed and "Expired" the moment it was created.
    import datetime

    from django.utils import timezone
    live = create_api_key(Actor(user=owner.user), owner.organization, name="live-ci", scopes=[Scope.INFERENCE],
                          expires_at=timezone.now() + datetime.timedelta(days=30)).api_key
    gone = create_api_key(Actor(user=owner.user), owner.organization, name="gone-ci", scopes=[Scope.INFERENCE],
                          expires_at=timezone.now() + datetime.timedelta(days=1)).api_key
    ApiKey.objects.filter(pk=gone.pk).update(expires_at=timezone.now() - datetime.timedelta(minutes=1))

    page = owner.get(reverse("console:keys")).content.decode()

    rows = {name: page.split(name, 1)[0].rsplit("<tr", 1)[1] + page.split(name, 1)[1].split("</tr>", 1)[0]
            for name in ("live-ci", "gone-ci")}
    assert "Expired" not in rows["live-ci"] and "dimmed" not in rows["live-ci"]
    assert live.expires_at.strftime("%Y") in rows["live-ci"]
    assert "Expired" in rows["gone-ci"] and "dimmed" in rows["gone-ci"]
