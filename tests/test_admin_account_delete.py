"""Staff deleting an account in the Django admin go through the same rule and the same service as the account's owner
deleting it (README, "Closing an organisation, deleting an account"): refused, with the organisation and what holds it
named, while it is the only owner of an open organisation others or live resources depend on; otherwise its row is
kept, deactivated and tombstoned, and an organisation of theirs that nothing depends on is closed with it."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth import get_user_model
from django.urls import reverse

from billing import credits
from billing.models import CreditKind
from controlplane.accounts.models import AuditEvent, Membership, Organization, Role
from controlplane.accounts.services import SYSTEM
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory, UserFactory

pytestmark = pytest.mark.django_db

User = get_user_model()


def _owner_of(organization, **user):
    owner = UserFactory(**user)
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    return owner


def _delete_page(user) -> str:
    return reverse("admin:auth_user_delete", args=[user.pk])


def _still_owns(user, organization) -> bool:
    user.refresh_from_db()
    organization.refresh_from_db()
    return (user.is_active and organization.closed_at is None
            and Membership.objects.filter(user=user, organization=organization, role=Role.OWNER).exists())


def test_staff_cannot_delete_the_only_owner_of_an_organisation_that_has_other_members(staff_client):
    acme = OrganizationFactory(name="Acme Labs", slug="acme-labs")
    alice = _owner_of(acme)
    MembershipFactory(organization=acme, user=UserFactory(), role=Role.MEMBER)

    page = staff_client.get(_delete_page(alice)).content.decode()
    answer = staff_client.post(_delete_page(alice), {"post": "yes"})

    assert "only owner of Acme Labs (slug acme-labs), which has other members" in page
    assert 'name="post"' not in page  # nothing to confirm
    assert answer.status_code == 200
    assert User.objects.filter(pk=alice.pk).exists() and _still_owns(alice, acme)
    assert not LogEntry.objects.filter(object_id=str(alice.pk), action_flag=DELETION).exists()


def test_staff_cannot_bulk_delete_the_only_owner_of_an_organisation_with_a_live_endpoint_nor_anyone_selected_with_them(
        staff_client):
    acme = OrganizationFactory(name="Acme Labs", slug="acme-labs")
    alice = _owner_of(acme)
    EndpointFactory(organization=acme)
    bob = UserFactory()

    selected = {"action": "delete_selected", "_selected_action": [alice.pk, bob.pk]}
    page = staff_client.post(reverse("admin:auth_user_changelist"), selected).content.decode()
    staff_client.post(reverse("admin:auth_user_changelist"), {**selected, "post": "yes"})

    assert "only owner of Acme Labs (slug acme-labs), which has endpoints" in page
    assert User.objects.filter(pk=alice.pk).exists() and _still_owns(alice, acme)
    bob.refresh_from_db()
    assert bob.is_active and bob.has_usable_password()
    assert not LogEntry.objects.filter(action_flag=DELETION).exists()


def test_staff_cannot_delete_the_only_owner_of_an_organisation_holding_purchased_credit(staff_client):
    acme = OrganizationFactory(name="Acme Labs", slug="acme-labs")
    alice = _owner_of(acme)
    credits.grant_credits(SYSTEM, acme, amount=Decimal("40.00"), kind=CreditKind.PURCHASED)

    page = staff_client.get(_delete_page(alice)).content.decode()
    staff_client.post(_delete_page(alice), {"post": "yes"})

    assert "40.00 USD of purchased credit remains on Acme Labs" in page
    assert _still_owns(alice, acme)


def test_a_refusal_that_arises_after_the_page_was_shown_is_judged_again_and_deletes_nothing(staff_client,
                                                                                          monkeypatch):
    # NOTE: the confirmation page judged before a member joined: the delete itself judges again, under the locks
    from controlplane.accounts import departures

    acme = OrganizationFactory(name="Acme Labs", slug="acme-labs")
    alice = _owner_of(acme)
    MembershipFactory(organization=acme, user=UserFactory(), role=Role.MEMBER)
    monkeypatch.setattr(departures, "account_deletion_refusals", lambda user: [])

    answer = staff_client.post(_delete_page(alice), {"post": "yes"}, follow=True)

    assert "only owner of Acme Labs" in answer.content.decode()
    assert _still_owns(alice, acme)
    assert not LogEntry.objects.filter(object_id=str(alice.pk), action_flag=DELETION).exists()


def test_staff_deleting_an_account_keep_its_row_tombstoned_and_close_its_organisation_that_nothing_depends_on(
        staff_client):
    alone = OrganizationFactory(name="Alone Co")
    alice = _owner_of(alone, username="alice@example.test", first_name="Alice")
    team = OrganizationFactory(name="Team")
    _owner_of(team)
    MembershipFactory(organization=team, user=alice, role=Role.MEMBER)
    AuditEvent.objects.create(organization=team, actor=alice, action="endpoint.create", target_repr="chat")

    answer = staff_client.post(_delete_page(alice), {"post": "yes"})

    assert answer.status_code == 302
    alice = User.objects.get(pk=alice.pk)  # the row stays
    assert not alice.is_active and not alice.has_usable_password()
    assert alice.email.startswith(f"deleted-{alice.pk}-") and alice.first_name == ""
    assert not Membership.objects.filter(user=alice).exists()
    assert Organization.objects.get(pk=alone.pk).closed_at is not None
    assert Organization.objects.get(pk=team.pk).closed_at is None
    assert AuditEvent.objects.get(organization=team, action="endpoint.create").actor == alice  # still attributed
    assert AuditEvent.objects.filter(organization=team, action="member.remove", details__reason="user.delete").exists()
    assert AuditEvent.objects.filter(action="user.delete", target_id=str(alice.pk)).exists()


def test_a_staff_account_staff_delete_loses_its_powers_with_it(staff_client):
    former = UserFactory(is_staff=True, is_superuser=True)

    staff_client.post(reverse("admin:auth_user_changelist"),
                      {"action": "delete_selected", "_selected_action": [former.pk], "post": "yes"})

    former.refresh_from_db()
    assert (former.is_active, former.is_staff, former.is_superuser) == (False, False, False)


def test_staff_cannot_delete_their_own_account_on_its_page_nor_in_a_bulk_delete(staff_client):
    # NOTE: (the review of the admin's delete) a lone operator deleting themselves left the admin to no one: their
    # powers and session ended with the account, and only a shell on the servers could make another superuser
    me = staff_client.staff
    bob = UserFactory()

    page = staff_client.get(_delete_page(me)).content.decode()
    staff_client.post(_delete_page(me), {"post": "yes"})
    staff_client.post(reverse("admin:auth_user_changelist"),
                      {"action": "delete_selected", "_selected_action": [me.pk, bob.pk], "post": "yes"})

    assert "your own account" in page and 'name="post"' not in page
    me.refresh_from_db()
    bob.refresh_from_db()
    assert (me.is_active, me.is_staff, me.is_superuser, me.has_usable_password()) == (True, True, True, True)
    assert bob.is_active and bob.has_usable_password()
    assert not LogEntry.objects.filter(action_flag=DELETION).exists()


def test_staff_cannot_delete_the_last_active_superuser(client):
    from django.contrib.auth.models import Permission

    from tests.factories import sign_in_staff

    operator = UserFactory(is_staff=True, is_superuser=False)
    operator.user_permissions.add(*Permission.objects.filter(codename__in=["view_user", "delete_user"]))
    sign_in_staff(client, operator)
    root = UserFactory(is_staff=True, is_superuser=True)
    UserFactory(is_staff=False, is_superuser=True)  # NOTE: no way into the admin (`StaffAdminSite.has_permission`)
    UserFactory(is_staff=True, is_superuser=True, is_active=False)

    page = client.get(_delete_page(root)).content.decode()
    client.post(_delete_page(root), {"post": "yes"})

    assert "No active superuser would remain" in page
    root.refresh_from_db()
    assert (root.is_active, root.is_superuser) == (True, True)


def test_the_delete_itself_judges_the_last_superuser_again_whatever_its_page_showed(rf):
    # NOTE: two superusers deleting each other at once: each page showed the other remaining
    from django.contrib import admin
    from django.db import transaction

    from controlplane.accounts import departures

    operator = UserFactory(is_staff=True, is_superuser=False)
    root = UserFactory(is_staff=True, is_superuser=True)
    request = rf.post("/")
    request.user = operator

    with pytest.raises(departures.AccountDeletionRefused, match="No active superuser would remain"), \
            transaction.atomic():
        admin.site._registry[User].delete_model(request, root)

    root.refresh_from_db()
    assert (root.is_active, root.is_superuser) == (True, True)
