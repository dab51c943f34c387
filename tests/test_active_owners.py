"""An organisation keeps an owner who can sign in (README, "Last owner"): a deactivated account's owner role (a deleted
account is deactivated too) never counts as the owner that must remain, whether an owner steps down, leaves, deletes
their account, or staff delete it in the Django admin."""

from __future__ import annotations

import pytest
from django.urls import reverse

from controlplane.accounts.models import Membership, Organization, Role
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, signed_in_api_client

pytestmark = pytest.mark.django_db

PASSWORD = "correct horse battery"  # UserFactory's


def _acme_with_a_deactivated_co_owner():
    """Acme Labs: Alice, an owner, and a second owner whose account staff deactivated."""
    acme = OrganizationFactory(name="Acme Labs", slug="acme-labs")
    alice = UserFactory()
    alices = MembershipFactory(organization=acme, user=alice, role=Role.OWNER)
    MembershipFactory(organization=acme, user=UserFactory(is_active=False), role=Role.OWNER)
    return acme, alice, alices


def _still_owns(user, organization) -> bool:
    user.refresh_from_db()
    return (user.is_active and Organization.objects.get(pk=organization.pk).closed_at is None
            and Membership.objects.filter(user=user, organization=organization, role=Role.OWNER).exists())


def test_an_owner_cannot_step_down_while_the_only_other_owner_is_deactivated():
    acme, alice, alices = _acme_with_a_deactivated_co_owner()

    answer = signed_in_api_client(alice).patch(f"/api/v1/members/{alices.pk}/", {"role": Role.ADMIN}, format="json")

    assert answer.status_code == 400, answer.content
    assert "owner who can sign in" in answer.json()["role"][0]
    assert _still_owns(alice, acme)


def test_an_owner_cannot_remove_themselves_while_the_only_other_owner_is_deactivated():
    acme, alice, alices = _acme_with_a_deactivated_co_owner()

    answer = signed_in_api_client(alice).delete(f"/api/v1/members/{alices.pk}/")

    assert answer.status_code == 400, answer.content
    assert _still_owns(alice, acme)


def test_an_owner_cannot_delete_their_account_while_the_only_other_owner_is_deactivated():
    acme, alice, _ = _acme_with_a_deactivated_co_owner()

    answer = signed_in_api_client(alice).post("/api/v1/account/delete/", {"password": PASSWORD}, format="json")

    assert answer.status_code == 400, answer.content
    assert "only owner of Acme Labs" in answer.json()["non_field_errors"][0]
    assert _still_owns(alice, acme)


def test_staff_cannot_delete_an_owner_whose_only_co_owner_is_deactivated(staff_client):
    acme, alice, _ = _acme_with_a_deactivated_co_owner()
    delete_page = reverse("admin:auth_user_delete", args=[alice.pk])

    page = staff_client.get(delete_page).content.decode()
    staff_client.post(delete_page, {"post": "yes"})

    assert "only owner of Acme Labs (slug acme-labs), which has other members" in page
    assert 'name="post"' not in page
    assert _still_owns(alice, acme)


def test_an_owner_still_steps_down_beside_an_active_co_owner():
    acme, alice, alices = _acme_with_a_deactivated_co_owner()
    MembershipFactory(organization=acme, user=UserFactory(), role=Role.OWNER)

    answer = signed_in_api_client(alice).patch(f"/api/v1/members/{alices.pk}/", {"role": Role.ADMIN}, format="json")

    assert answer.status_code == 200, answer.content
    assert Membership.objects.get(pk=alices.pk).role == Role.ADMIN


def test_staff_delete_both_deactivated_owners_of_an_organisation_one_after_the_other(staff_client):
    # NOTE: a deactivated owner's departure takes no owner who can sign in away: counting only active owners there too,
    # each was refused for the other ("other members"), for ever, and nothing but a shell could end either
    acme = OrganizationFactory(name="Acme Labs", slug="acme-labs")
    first, second = UserFactory(is_active=False), UserFactory(is_active=False)
    for user in (first, second):
        MembershipFactory(organization=acme, user=user, role=Role.OWNER)

    for user in (first, second):
        staff_client.post(reverse("admin:auth_user_delete", args=[user.pk]), {"post": "yes"})

    assert not Membership.objects.filter(organization=acme).exists()
    assert Organization.objects.get(pk=acme.pk).closed_at is not None


def test_staff_deleting_a_deactivated_owner_beside_a_deactivated_co_owner_closes_nothing_and_leaves_the_co_owner_its_owner(
        staff_client):
    acme = OrganizationFactory(name="Acme Labs", slug="acme-labs")
    first, second = UserFactory(is_active=False), UserFactory(is_active=False)
    for user in (first, second):
        MembershipFactory(organization=acme, user=user, role=Role.OWNER)

    staff_client.post(reverse("admin:auth_user_delete", args=[first.pk]), {"post": "yes"})

    assert list(Membership.objects.filter(organization=acme).values_list("user_id", "role")) == [
        (second.pk, Role.OWNER)]
    assert Organization.objects.get(pk=acme.pk).closed_at is None
