"""A deleted account stays deleted in the Django admin (README, "What a deleted account leaves behind"): its page is
read-only, its password page refused, and a change form staff opened before the deletion and sent after it writes
nothing back: not the address, not the name, not `is_active`."""

from __future__ import annotations

import copy

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse

from controlplane.accounts.admin import UserAdmin
from controlplane.accounts.erasure import is_erased
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, signed_in_api_client

pytestmark = pytest.mark.django_db

User = get_user_model()
PASSWORD = "correct horse battery"  # UserFactory's
ADDRESS = "alice.liddell@example.test"
SURNAME = "Liddellson"


def _alice():
    user = UserFactory(username=ADDRESS, first_name="Alice", last_name=SURNAME)
    MembershipFactory(organization=OrganizationFactory(name="Alice Co"), user=user)
    return user


def _change_page(user) -> str:
    return reverse("admin:auth_user_change", args=[user.pk])


def _form_as_shown(user) -> dict:
    """What the account's change form sends, as the page showed it."""
    return {"username": user.username, "email": user.email, "first_name": user.first_name,
            "last_name": user.last_name, "is_active": "on", "date_joined_0": f"{user.date_joined:%Y-%m-%d}",
            "date_joined_1": f"{user.date_joined:%H:%M:%S}"}


def _delete(user) -> None:
    answer = signed_in_api_client(user).post("/api/v1/account/delete/", {"password": PASSWORD}, format="json")
    assert answer.status_code == 204, answer.content


def _still_erased(user) -> bool:
    user = User.objects.get(pk=user.pk)
    return (is_erased(user) and user.username == user.email and (user.first_name, user.last_name) == ("", "")
            and not user.is_active and not User.objects.filter(email__iexact=ADDRESS).exists())


def test_a_change_form_opened_before_the_account_was_deleted_and_sent_after_writes_nothing_back(staff_client):
    alice = _alice()
    assert ADDRESS in staff_client.get(_change_page(alice)).content.decode()
    sent = _form_as_shown(alice)

    _delete(alice)
    answer = staff_client.post(_change_page(alice), sent, follow=True)

    assert answer.status_code == 200
    assert "This account was deleted: its page is read-only" in answer.content.decode()
    assert _still_erased(alice)


def test_a_deletion_that_commits_after_the_form_read_the_account_is_seen_as_it_is_saved(staff_client, monkeypatch):
    # NOTE: the page's view read the account before its deletion committed (nothing held it), then saved the form
    alice = _alice()
    read_before = User.objects.get(pk=alice.pk)
    sent = _form_as_shown(alice)
    _delete(alice)
    monkeypatch.setattr(UserAdmin, "get_object", lambda self, request, object_id, from_field=None:
                        copy.deepcopy(read_before))

    answer = staff_client.post(_change_page(alice), sent, follow=True)

    assert "This account was deleted: its page is read-only" in answer.content.decode()
    assert _still_erased(alice)


def test_a_deleted_accounts_page_is_read_only_and_no_password_can_be_set_on_it(staff_client):
    alice = _alice()
    _delete(alice)

    page = staff_client.get(_change_page(alice))
    password = staff_client.post(reverse("admin:auth_user_password_change", args=[alice.pk]),
                                 {"password1": "a new good passphrase", "password2": "a new good passphrase"})

    assert page.status_code == 200 and 'name="email"' not in page.content.decode()
    assert password.status_code == 403
    assert not User.objects.get(pk=alice.pk).has_usable_password()
    assert _still_erased(alice)


def test_staff_still_change_an_account_that_is_not_deleted(staff_client):
    alice = _alice()

    answer = staff_client.post(_change_page(alice), {**_form_as_shown(alice), "first_name": "Alicia"})

    assert answer.status_code == 302, answer.content.decode()[:2000]
    assert User.objects.get(pk=alice.pk).first_name == "Alicia"


def test_an_active_account_whose_address_only_looks_like_its_tombstone_is_still_changed_by_staff(staff_client):
    # NOTE: sign-up refuses no domain, and ids are sequential: an address shaped as the account's own tombstone made
    # its page read-only, and staff could not deactivate it there
    alice = _alice()
    lookalike = f"deleted-{alice.pk}-0000@deleted.invalid"
    User.objects.filter(pk=alice.pk).update(username=lookalike, email=lookalike)
    alice.refresh_from_db()

    answer = staff_client.post(_change_page(alice), {**_form_as_shown(alice), "is_active": ""})

    assert answer.status_code == 302, answer.content.decode()[:2000]
    assert not User.objects.get(pk=alice.pk).is_active
