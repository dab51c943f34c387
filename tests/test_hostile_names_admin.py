"""The Django admin shows staff a name stored before the name rule (`controlplane.text.name_problem`) as the console
does, its direction override escaped (`text.shown_name`): a key's and an organisation's name, in their lists and on
their pages, and an audit event's `target_repr` recorded before `ApiKey.__str__` escaped it."""

import re

import pytest

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import ApiKey, AuditEvent, Organization
from controlplane.accounts.services import Actor
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory

pytestmark = pytest.mark.django_db

SPOOFED = "\u202eyek-dorp"  # reads "prod-key"


@pytest.fixture
def spoofed():
    organization = OrganizationFactory()
    owner = UserFactory()
    MembershipFactory(organization=organization, user=owner, role="owner")
    key = create_api_key(Actor(user=owner), organization, name="ci", scopes=["inference"]).api_key
    ApiKey.objects.filter(pk=key.pk).update(name=SPOOFED)
    Organization.objects.filter(pk=organization.pk).update(name="Acme\u202eevil")
    # An event recorded before `ApiKey.__str__` escaped the name: it kept the override.
    event = AuditEvent.objects.get(action="api_key.create")
    AuditEvent.objects.filter(pk=event.pk).update(target_repr=f"{SPOOFED} ({key.display_prefix})")
    return organization, key, event


@pytest.mark.parametrize("page", ["keys", "key", "organizations", "organization", "events", "event"])
def test_the_django_admin_shows_a_name_from_before_the_rule_escaped(staff_client, spoofed, page):
    organization, key, event = spoofed
    path = {"keys": "controlplane/apikey/", "key": f"controlplane/apikey/{key.pk}/change/",
            "organizations": "controlplane/organization/", "organization": f"controlplane/organization/{organization.pk}/change/",
            "events": "controlplane/auditevent/", "event": f"controlplane/auditevent/{event.pk}/change/"}[page]
    answer = staff_client.get(f"/django-admin/{path}")
    assert answer.status_code == 200
    shown = answer.content.decode()
    assert "\u202e" not in shown
    assert ("Acme\\u202eevil" if page.startswith("organization") else "\\u202eyek-dorp") in shown


@pytest.mark.parametrize("email", ["spoof@ex\u202eample.test", "zw@exa\u200bmple.test"])
def test_staff_deactivate_a_user_whose_address_is_from_before_the_rule_without_retyping_it(staff_client, email):
    """The admin's user form checked the address it was not asked to change by the new rule (`normalize_email`): a user
    signed up with a format character in their address (allowed then) could not be deactivated, their keys kept."""
    from django.contrib.auth import get_user_model
    from django.urls import reverse

    user = UserFactory()
    get_user_model().objects.filter(pk=user.pk).update(email=email)
    joined = user.date_joined
    response = staff_client.post(reverse("admin:auth_user_change", args=[user.pk]), {
        "username": user.username, "email": email, "first_name": "", "last_name": "",
        "date_joined_0": joined.strftime("%Y-%m-%d"), "date_joined_1": joined.strftime("%H:%M:%S"),
    })  # is_active left out: unticked
    assert response.status_code == 302, re.findall(r'<ul class="errorlist[^>]*>.*?</ul>', response.content.decode())
    user.refresh_from_db()
    assert not user.is_active and user.email == email
    # A new address is still checked by the rule.
    refused = staff_client.post(reverse("admin:auth_user_change", args=[user.pk]), {
        "username": user.username, "email": "other@ex\u202eample.test", "first_name": "", "last_name": "",
        "date_joined_0": joined.strftime("%Y-%m-%d"), "date_joined_1": joined.strftime("%H:%M:%S"),
    })
    assert refused.status_code == 200 and "format characters" in refused.content.decode()


@pytest.mark.parametrize("page", ["change", "history"])
def test_the_django_admins_user_page_names_a_user_from_before_the_rule_escaped(staff_client, page):
    """Before: the user's page (its heading, its window title, its breadcrumbs) and its history's showed the username
    raw: a direction override in an address stored before `normalize_email` refused one showed staff another name."""
    from django.contrib.auth import get_user_model
    from django.urls import reverse

    user = UserFactory()
    get_user_model().objects.filter(pk=user.pk).update(username="\u202etset.elpmaxe@nimda")  # reads admin@example.test
    shown = staff_client.get(reverse(f"admin:auth_user_{page}", args=[user.pk])).content.decode()
    heading = re.search(r"<h[12]>(.*?)</h[12]>\s*(?:<h2>(.*?)</h2>)?", shown, re.S)
    title = re.search(r"<title>(.*?)</title>", shown, re.S).group(1)
    breadcrumbs = re.search(r'<div class="breadcrumbs">(.*?)</div>', shown, re.S).group(1)
    for part in (heading.group(0), title, breadcrumbs):
        assert "\u202e" not in part and "\\u202etset.elpmaxe@nimda" in part


@pytest.mark.parametrize("page", ["password_change", "delete"])
def test_the_django_admins_other_user_pages_name_a_user_from_before_the_rule_escaped(staff_client, page):
    """The user's password page (its heading and window title) and its delete page (its window title, breadcrumbs and
    the objects it deletes) showed the username raw after the change and history pages escaped it (the review of
    6e92b978): staff set the password of, or deleted, an account that read as another."""
    from django.contrib.auth import get_user_model
    from django.urls import reverse

    user = UserFactory()
    get_user_model().objects.filter(pk=user.pk).update(username="\u202etset.elpmaxe@nimda")  # reads admin@example.test
    shown = staff_client.get(reverse(f"admin:auth_user_{page}", args=[user.pk])).content.decode()
    assert "\u202e" not in shown and "\\u202etset.elpmaxe@nimda" in shown


def test_the_message_after_staff_delete_a_user_from_before_the_rule_names_it_escaped(staff_client):
    """'The user "..." was deleted successfully.' showed the username raw (the review of 6e92b978)."""
    from django.contrib.auth import get_user_model
    from django.urls import reverse

    user = UserFactory()
    get_user_model().objects.filter(pk=user.pk).update(username="\u202etset.elpmaxe@nimda")
    shown = staff_client.post(reverse("admin:auth_user_delete", args=[user.pk]), {"post": "yes"}, follow=True)
    page = shown.content.decode()
    assert "deleted successfully" in page and "\u202e" not in page and "\\u202etset.elpmaxe@nimda" in page
    assert not get_user_model().objects.get(pk=user.pk).is_active  # the row kept, tombstoned


def _messages_of(page: str) -> str:
    """The admin's messages on `page` (its `messagelist`)."""
    return re.search(r'<ul class="messagelist">(.*?)</ul>', page, re.S).group(1)


def test_the_django_admins_user_delete_page_names_a_user_from_before_the_rule_escaped(staff_client):
    """Before: the delete confirmation (its breadcrumbs, its question, its list of what goes with the user) showed the
    username raw: staff were asked to confirm deleting another name than the one they deleted."""
    from django.contrib.auth import get_user_model
    from django.urls import reverse

    user = UserFactory()
    get_user_model().objects.filter(pk=user.pk).update(username="\u202etset.elpmaxe@nimda")  # reads admin@example.test
    shown = staff_client.get(reverse("admin:auth_user_delete", args=[user.pk])).content.decode()

    breadcrumbs = re.search(r'<div class="breadcrumbs">(.*?)</div>', shown, re.S).group(1)
    question = re.search(r"<p>Are you sure(.*?)</p>", shown, re.S).group(1)
    deleted = re.search(r'<ul id="deleted-objects">(.*?)</ul>', shown, re.S).group(1)
    for part in (breadcrumbs, question, deleted):
        assert "\u202e" not in part and "\\u202etset.elpmaxe@nimda" in part, part
    assert "\u202e" not in shown


def test_the_django_admins_message_on_deleting_a_user_from_before_the_rule_names_them_escaped(staff_client):
    """Before: "The user “…” was deleted successfully." named the user raw."""
    from django.contrib.auth import get_user_model
    from django.urls import reverse

    user = UserFactory()
    get_user_model().objects.filter(pk=user.pk).update(username="\u202etset.elpmaxe@nimda")
    answer = staff_client.post(reverse("admin:auth_user_delete", args=[user.pk]), {"post": "yes"}, follow=True)

    said = _messages_of(answer.content.decode())
    assert "was deleted successfully" in said and "\\u202etset.elpmaxe@nimda" in said and "\u202e" not in said
    assert not get_user_model().objects.get(pk=user.pk).is_active  # the row kept, tombstoned


def test_the_django_admins_message_on_changing_a_user_from_before_the_rule_names_them_escaped(staff_client):
    """Before: "The user “…” was changed successfully." named the user raw. A username may hold an invisible letter
    (U+3164, a letter to Django's username rule, which `text.name_problem` refuses in a name): "adm\u3164in" read
    "admin" in the message."""
    from django.contrib.auth import get_user_model
    from django.urls import reverse

    user = UserFactory()
    get_user_model().objects.filter(pk=user.pk).update(username="adm\u3164in@example.test")
    user.refresh_from_db()
    joined = user.date_joined
    answer = staff_client.post(reverse("admin:auth_user_change", args=[user.pk]), {
        "username": user.username, "email": user.email, "first_name": "", "last_name": "",
        "date_joined_0": joined.strftime("%Y-%m-%d"), "date_joined_1": joined.strftime("%H:%M:%S"),
    }, follow=True)  # is_active left out: deactivated

    said = _messages_of(answer.content.decode())
    user.refresh_from_db()  # NOTE: Django's form stores it NFKC: U+3164 is then U+1160, as invisible
    assert not user.is_active and user.username == "adm\u1160in@example.test"
    assert "was changed successfully" in said and "adm\\u1160in@example.test" in said and "\u1160" not in said

