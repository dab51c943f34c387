"""No live account or invitation may take an address at the domain a deleted account's address has
(`backends.TOMBSTONE_DOMAIN`, `erasure.tombstone_address`): sign-up, invitations and staff's change of an address
refuse it, a field error on the API and a form error in the console, so no live account ever looks like an erased
one (`erasure.is_erased`)."""

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.urls import reverse

from controlplane.accounts.models import Invitation, Organization, Role
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, signed_in_api_client

pytestmark = pytest.mark.django_db

User = get_user_model()
TOMBSTONE_SPELLINGS = ["deleted-7-0a1b2c3d@deleted.invalid", "Deleted-7-0A1B2C3D@DELETED.INVALID",
                       "ada@mail.deleted.invalid", "ada@\uff44eleted.invalid"]


@pytest.mark.parametrize("email", TOMBSTONE_SPELLINGS)
def test_sign_up_refuses_an_address_at_the_tombstone_domain_with_a_form_error(client, email):
    answer = client.post("/signup/", {"email": email, "password": "a long passphrase 1",
                                      "organization_name": "Acme"})

    assert answer.status_code == 200
    assert "reserved for deleted accounts" in answer.content.decode()
    assert not User.objects.exists() and not Organization.objects.exists() and mail.outbox == []


@pytest.mark.parametrize("email", TOMBSTONE_SPELLINGS)
def test_an_invitation_to_the_tombstone_domain_is_a_field_error_and_nobody_is_invited(org, member_client_factory,
                                                                                      email):
    owner = signed_in_api_client(member_client_factory(org, Role.OWNER).user)

    refused = owner.post("/api/v1/invitations/", {"email": email, "role": "admin"}, format="json")

    assert refused.status_code == 400 and list(refused.json()) == ["email"]
    assert not Invitation.objects.exists() and mail.outbox == []


def test_the_console_refuses_an_invitation_to_the_tombstone_domain_next_to_the_field(org, member_client_factory):
    console = signed_in_api_client(member_client_factory(org, Role.OWNER).user)

    page = console.post(reverse("console:members"), {"email": "deleted-1-00000000@deleted.invalid",
                                                     "role": Role.MEMBER})

    assert page.status_code == 400 and "reserved for deleted accounts" in page.content.decode()
    assert not Invitation.objects.exists()


def test_staff_cannot_change_an_accounts_address_to_the_tombstone_domain(staff_client):
    ada = UserFactory(username="ada@example.test")
    MembershipFactory(organization=OrganizationFactory(), user=ada)
    lookalike = f"deleted-{ada.pk}-00000000@deleted.invalid"

    page = staff_client.post(reverse("admin:auth_user_change", args=[ada.pk]), {
        "username": ada.username, "email": lookalike, "is_active": "on",
        "date_joined_0": f"{ada.date_joined:%Y-%m-%d}", "date_joined_1": f"{ada.date_joined:%H:%M:%S}"})

    assert page.status_code == 200 and "reserved for deleted accounts" in page.content.decode()
    assert User.objects.get(pk=ada.pk).email == "ada@example.test"


def test_an_address_that_only_contains_the_tombstone_domain_is_still_accepted(client):
    client.post("/signup/", {"email": "ada@deleted.invalid.example.test", "password": "a long passphrase 1",
                             "organization_name": "Acme"})

    assert User.objects.filter(email="ada@deleted.invalid.example.test").exists()
