"""The Django admin shows staff an address stored before `normalize_email` refused format characters escaped
(`text.shown_name`), as the console and the API show it: in an audit event's details (an accepted invitation's
`email`, an organisation's `owner`) and where it names the event's actor (an account's username is its address)."""

import re

import pytest
from django.contrib.auth import get_user_model

from controlplane.accounts.models import AuditEvent
from controlplane.accounts.services import Actor, record_audit
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory

pytestmark = pytest.mark.django_db

SPOOFED = "spoof@ex\u202eample.test"


@pytest.fixture
def event():
    organization = OrganizationFactory()
    user = UserFactory()
    MembershipFactory(organization=organization, user=user, role="owner")
    get_user_model().objects.filter(pk=user.pk).update(email=SPOOFED, username=SPOOFED)  # as sign-up stored it then
    user.refresh_from_db()
    return record_audit(Actor(user=user), organization, "invitation.accept", organization,
                        email=SPOOFED, role="member", nested={"owners": [SPOOFED]}, count=3, flag=True)


@pytest.mark.parametrize("page", ["events", "event"])
def test_the_django_admin_shows_an_address_from_before_the_rule_escaped(staff_client, event, page):
    path = "controlplane/auditevent/" if page == "events" else f"controlplane/auditevent/{event.pk}/change/"
    answer = staff_client.get(f"/django-admin/{path}")
    assert answer.status_code == 200
    shown = answer.content.decode()
    assert "\u202e" not in shown
    assert "spoof@ex\\u202eample.test" in shown
    if page == "event":  # numbers and booleans kept as they are
        assert "&quot;count&quot;: 3" in shown and "&quot;flag&quot;: true" in shown
    assert AuditEvent.objects.get(pk=event.pk).details["email"] == SPOOFED  # stored as it was


@pytest.mark.parametrize("page", ["users", "keys"])
def test_the_lists_naming_an_account_show_its_address_from_before_the_rule_escaped(staff_client, page):
    from controlplane.accounts.keys import create_api_key

    organization = OrganizationFactory()
    user = UserFactory()
    MembershipFactory(organization=organization, user=user, role="owner")
    create_api_key(Actor(user=user), organization, name="ci", scopes=["inference"])
    get_user_model().objects.filter(pk=user.pk).update(email=SPOOFED, username=SPOOFED)
    answer = staff_client.get(f"/django-admin/{'auth/user/' if page == 'users' else 'controlplane/apikey/'}")
    assert answer.status_code == 200
    # NOTE: the action checkbox's aria-label (Django's `action_checkbox`: `str(user)`) is read aloud, never laid out
    shown = re.sub(r' aria-label="[^"]*"', "", answer.content.decode())
    assert "\u202e" not in shown
    assert "spoof@ex\\u202eample.test" in shown
    # sorted and searched by the column as before
    assert staff_client.get(f"/django-admin/{'auth/user/' if page == 'users' else 'controlplane/apikey/'}",
                            {"o": "2", "q": "spoof"}).status_code == 200
