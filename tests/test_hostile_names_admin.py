"""The Django admin shows staff a name stored before the name rule (`controlplane.text.name_problem`) as the console
does, its direction override escaped (`text.shown_name`): a key's and an organisation's name, in their lists and on
their pages, and an audit event's `target_repr` recorded before `ApiKey.__str__` escaped it."""

import pytest
from django.test import Client

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import ApiKey, AuditEvent, Organization
from controlplane.accounts.services import Actor
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, sign_in_staff

pytestmark = pytest.mark.django_db

SPOOFED = "\u202eyek-dorp"  # reads "prod-key"


@pytest.fixture
def staff_client():
    client = Client()
    sign_in_staff(client, UserFactory(is_staff=True, is_superuser=True))
    return client


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
