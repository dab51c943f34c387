"""What a deleted account leaves behind (README, "Closing an organisation, deleting an account"): its address and name
are in no row and no Redis key afterwards, the records it took part in still name it by id, and nothing sent to its
address can be taken up by whoever signs up with that address later."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.apps import apps
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.auth import get_user_model
from django.db import DatabaseError, models
from django.db.models import F
from django.test import Client
from django.urls import reverse
from django_otp.plugins.otp_static.models import StaticDevice
from django_otp.plugins.otp_totp.models import TOTPDevice

from controlplane.accounts import departures, invitations
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import AuditEvent, EmailVerification, Invitation, Membership, Role, Scope
from controlplane.accounts.services import Actor, create_organization
from controlplane.accounts.signup import sign_up_user
from controlplane.redis_client import as_text, get_redis
from tests.factories import (
    MembershipFactory,
    OrganizationFactory,
    UserFactory,
    sign_in_staff,
    signed_in_api_client,
    staff_member,
)

pytestmark = pytest.mark.django_db

DELETE_ACCOUNT = "/api/v1/account/delete/"
PASSWORD = "correct horse battery"  # UserFactory's
ADDRESS = "alice.liddell@example.test"
SURNAME = "Liddellson"


def _rows_naming(text: str) -> list[str]:
    """Every row of every table (text and JSON columns) that holds `text`, case-insensitive, as `model.field=pk`."""
    found = []
    for model in apps.get_models():
        if not model._meta.managed or model._meta.proxy:
            continue
        for field in model._meta.concrete_fields:
            if isinstance(field, (models.CharField, models.TextField, models.JSONField)):
                for pk in model._default_manager.filter(**{f"{field.name}__icontains": text}).values_list(
                        "pk", flat=True):
                    found.append(f"{model._meta.label}.{field.name}={pk}")
    return found


def _redis_keys_naming(text: str) -> list[str]:
    return [as_text(key) for key in get_redis().scan_iter(match="*") if text.lower() in as_text(key).lower()]


def _alice():
    user = UserFactory(username=ADDRESS, first_name="Alice", last_name=SURNAME)
    MembershipFactory(organization=OrganizationFactory(name="Alice Co"), user=user, role=Role.OWNER)
    return user


def _owner_of(organization):
    owner = UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    return owner


def _delete(user):
    answer = signed_in_api_client(user).post(DELETE_ACCOUNT, {"password": PASSWORD}, format="json")
    assert answer.status_code == 204, answer.content


def test_no_row_keeps_a_deleted_users_address_or_name_and_the_audit_trail_still_names_them_by_id():
    alice = _alice()
    # a team she joined, by invitation (its owner's audit log: invitation.create, .accept, member.add, member.remove)
    team = OrganizationFactory(name="Team")
    team_owner = _owner_of(team)
    invitation = invitations.invite_member(Actor(user=team_owner), team, email=ADDRESS.upper(), role=Role.ADMIN)
    invitations.accept_invitation(Actor(user=alice), invitation)
    # a key she made there, and an invitation she sent from it (revoked with her)
    create_api_key(Actor(user=alice), team, name="alice's laptop", scopes=[Scope.INFERENCE])
    invitations.invite_member(Actor(user=alice), team, email="friend@example.test", role=Role.MEMBER)
    # an operator's edit of her account in the Django admin ("Recent actions")
    operator = staff_member()
    LogEntry.objects.log_actions(operator.pk, [alice], CHANGE, change_message="Changed first name.")
    assert _rows_naming(ADDRESS) and _rows_naming(SURNAME)  # NOTE: the scan finds them while she is here

    _delete(alice)

    assert _rows_naming(ADDRESS) == []
    assert _rows_naming(SURNAME) == []
    assert _redis_keys_naming(ADDRESS) == []
    # the trail is intact: each event she took part in is still there, and names her account by its id
    tombstone = get_user_model().objects.get(pk=alice.pk).email
    team_events = AuditEvent.objects.filter(organization=team)
    assert set(team_events.values_list("action", flat=True)) >= {
        "invitation.create", "invitation.accept", "member.add", "member.remove", "api_key.create", "api_key.revoke"}
    accept = team_events.get(action="invitation.accept")
    assert accept.actor_id == alice.pk and accept.details["email"] == tombstone
    assert team_events.get(action="member.remove").details["email"] == tombstone
    assert tombstone in team_events.get(action="member.add").target_repr
    entry = LogEntry.objects.get(object_id=str(alice.pk), content_type__model="user")
    assert entry.object_repr == tombstone and entry.user_id == operator.pk


def test_the_admins_recent_actions_show_the_tombstone_not_the_deleted_users_address():
    alice = _alice()
    operator = staff_member()
    LogEntry.objects.log_actions(operator.pk, [alice], CHANGE, change_message="Changed first name.")
    admin = Client()
    sign_in_staff(admin, operator)
    assert ADDRESS in admin.get("/django-admin/").content.decode()

    _delete(alice)

    page = admin.get("/django-admin/").content.decode()
    assert ADDRESS not in page
    assert get_user_model().objects.get(pk=alice.pk).email in page


def test_an_invitation_pending_to_a_deleted_users_address_ends_with_the_account():
    alice = _alice()
    team = OrganizationFactory(name="Team")
    team_owner = _owner_of(team)
    invitation = invitations.invite_member(Actor(user=team_owner), team, email=ADDRESS, role=Role.OWNER)

    _delete(alice)

    invitation.refresh_from_db()
    assert invitation.revoked_at is not None and invitation.email != ADDRESS
    assert AuditEvent.objects.filter(organization=team, action="invitation.revoke", target_id=str(invitation.pk),
                                     details__reason="user.delete").exists()
    # whoever holds the address next signs up, verifies it, and is offered nothing: the link's invitation is ended
    newcomer = sign_up_user(email=ADDRESS, password="another good passphrase", organization_name="Next")
    newcomer = get_user_model().objects.get(email=ADDRESS)
    EmailVerification.objects.update_or_create(user=newcomer, defaults={"email": ADDRESS})
    assert invitations.invitation_refusal(invitation, newcomer) is not None
    with pytest.raises(Exception):  # noqa: B017,PT011 - refused, whichever way the service says it
        invitations.accept_invitation(Actor(user=newcomer), invitation)
    assert not Membership.objects.filter(organization=team, user=newcomer).exists()
    assert Invitation.objects.for_org(team).pending().count() == 0


def test_a_former_staff_members_second_factor_secrets_and_recovery_codes_go_with_their_account():
    alice = _alice()
    TOTPDevice.objects.create(user=alice, name="phone", confirmed=True)
    recovery = StaticDevice.objects.create(user=alice, name="recovery codes", confirmed=True)
    recovery.token_set.create(token="0123456789")  # noqa: S106

    _delete(alice)

    assert not TOTPDevice.objects.filter(user_id=alice.pk).exists()
    assert not StaticDevice.objects.filter(user_id=alice.pk).exists()


def test_an_account_staff_delete_in_the_admin_leaves_its_address_in_no_record_and_no_invitation_pending_to_it(
        staff_client):
    alice = _alice()
    team = OrganizationFactory(name="Team")
    team_owner = _owner_of(team)
    accepted = invitations.invite_member(Actor(user=team_owner), team, email=ADDRESS, role=Role.MEMBER)
    invitations.accept_invitation(Actor(user=alice), accepted)
    elsewhere = OrganizationFactory(name="Elsewhere")
    pending = invitations.invite_member(Actor(user=_owner_of(elsewhere)), elsewhere, email=ADDRESS, role=Role.OWNER)

    answer = staff_client.post(reverse("admin:auth_user_delete", args=[alice.pk]), {"post": "yes"})

    assert answer.status_code == 302
    assert not get_user_model().objects.get(pk=alice.pk).is_active  # the row kept (`closing.end_account`)
    assert _rows_naming(ADDRESS) == []
    deleted = LogEntry.objects.get(object_id=str(alice.pk), action_flag=DELETION)
    assert deleted.object_repr.startswith(f"deleted-{alice.pk}-")  # still names the account, by its id
    assert Invitation.objects.get(pk=pending.pk).revoked_at is not None
    assert AuditEvent.objects.get(organization=team, action="member.add").target_repr.startswith(
        f"deleted-{alice.pk}-")


def test_another_persons_address_that_holds_the_deleted_one_is_left_as_it_is():
    alice = _alice()
    team = OrganizationFactory(name="Team")
    team_owner = _owner_of(team)
    for address in (ADDRESS, f"mr.{ADDRESS}", f"{ADDRESS}.example"):
        invitations.invite_member(Actor(user=team_owner), team, email=address, role=Role.MEMBER)

    _delete(alice)

    events = AuditEvent.objects.filter(organization=team, action="invitation.create")
    assert sorted(event.details["email"] for event in events if "deleted" not in event.details["email"]) == [
        f"{ADDRESS}.example", f"mr.{ADDRESS}"]
    assert set(Invitation.objects.filter(organization=team).exclude(email__startswith="deleted-").values_list(
        "email", flat=True)) == {f"{ADDRESS}.example", f"mr.{ADDRESS}"}
    assert _rows_naming(f"mr.{ADDRESS}") and _rows_naming(f"{ADDRESS}.example")


def test_another_persons_address_that_ends_with_the_deleted_one_after_an_apostrophe_is_left_as_it_is():
    # NOTE: `'`, `{` and `}` are letters of an address's local part (RFC 5322's atext, Django's check passes them):
    # deleting `brien@…` rewrote `o'brien@…`, another person's, to `o'deleted-…` in every record naming it.
    brien = UserFactory(username="brien@example.test")
    MembershipFactory(organization=OrganizationFactory(name="Brien Co"), user=brien, role=Role.OWNER)
    team = OrganizationFactory(name="Team")
    team_owner = _owner_of(team)
    others = ["o'brien@example.test", "{brien@example.test", "a}brien@example.test"]
    for address in others:
        invitations.invite_member(Actor(user=team_owner), team, email=address, role=Role.MEMBER)
    LogEntry.objects.log_actions(staff_member().pk, list(Invitation.objects.filter(organization=team)), CHANGE,
                                 change_message="Changed role.")

    _delete(brien)

    events = AuditEvent.objects.filter(organization=team, action="invitation.create")
    assert sorted(event.details["email"] for event in events) == sorted(others)
    assert sorted(event.target_repr.split(" ")[0] for event in events) == sorted(others)
    assert sorted(Invitation.objects.filter(organization=team).values_list("email", flat=True)) == sorted(others)
    assert not LogEntry.objects.filter(object_repr__contains="deleted-").exists()


def test_a_former_holders_records_are_not_pinned_on_the_next_holder_of_the_address_when_they_delete_theirs():
    # NOTE: an account deleted before erasure existed kept its address in the records (its row alone was
    # tombstoned). Whoever signed up with the address next and deleted their account then had the former holder's
    # invitation and its events (years before they joined) rewritten to their own tombstone: the trail named the
    # wrong account by id.
    former = UserFactory(username=ADDRESS)
    team = OrganizationFactory(name="Team")
    team_owner = _owner_of(team)
    old = invitations.invite_member(Actor(user=team_owner), team, email=ADDRESS, role=Role.ADMIN)
    invitations.accept_invitation(Actor(user=former), old)
    operator = staff_member()
    LogEntry.objects.log_actions(operator.pk, [old], CHANGE, change_message="Changed role.")
    # the release before: the row alone tombstoned, the account deactivated
    get_user_model().objects.filter(pk=former.pk).update(
        username=f"deleted-{former.pk}-0000@deleted.invalid", email=f"deleted-{former.pk}-0000@deleted.invalid",
        is_active=False)
    AuditEvent.objects.create(actor=former, action="user.delete", target_type="User", target_id=str(former.pk),
                              target_repr=f"deleted-{former.pk}-0000@deleted.invalid")
    AuditEvent.objects.filter(organization=team).update(created_at=F("created_at") - timedelta(days=400))
    Invitation.objects.filter(pk=old.pk).update(created_at=F("created_at") - timedelta(days=400),
                                                accepted_at=F("accepted_at") - timedelta(days=400))
    AuditEvent.objects.filter(action="user.delete").update(created_at=F("created_at") - timedelta(days=300))
    LogEntry.objects.update(action_time=F("action_time") - timedelta(days=400))
    # an invitation to the address the former holder never took up, before the next holder joined
    later = OrganizationFactory(name="Later")
    unused = invitations.invite_member(Actor(user=_owner_of(later)), later, email=ADDRESS, role=Role.MEMBER)
    Invitation.objects.filter(pk=unused.pk).update(created_at=F("created_at") - timedelta(days=350))
    AuditEvent.objects.filter(organization=later).update(created_at=F("created_at") - timedelta(days=350))
    sign_up_user(email=ADDRESS, password=PASSWORD, organization_name="Next")
    nextholder = get_user_model().objects.get(email=ADDRESS)
    EmailVerification.objects.update_or_create(user=nextholder, defaults={"email": ADDRESS})

    _delete(nextholder)

    tombstone = get_user_model().objects.get(pk=nextholder.pk).email
    assert tombstone.startswith(f"deleted-{nextholder.pk}-")
    assert Invitation.objects.get(pk=old.pk).email == ADDRESS
    assert not AuditEvent.objects.filter(organization=team, target_repr__contains=tombstone).exists()
    assert not AuditEvent.objects.filter(organization=team, details__icontains=tombstone).exists()
    assert LogEntry.objects.get(object_id=str(old.pk)).object_repr.startswith(ADDRESS)


def test_an_admin_bulk_delete_that_fails_half_way_erases_nothing(staff_client, monkeypatch):
    # NOTE: `delete_selected` runs outside a transaction (the admin's delete page runs in one): the erasure was
    # committed and a later account's failed (PostgreSQL restarting), leaving an account that still had its
    # address, its invitations rewritten to a tombstone and those pending to it revoked.
    alice = _alice()
    later = UserFactory()
    team = OrganizationFactory(name="Team")
    pending = invitations.invite_member(Actor(user=_owner_of(team)), team, email=ADDRESS, role=Role.MEMBER)
    registered = departures._deletion()

    def lost(actor, user):
        if user.pk == later.pk:
            raise DatabaseError("server closed the connection unexpectedly")
        registered.end(actor, user)

    monkeypatch.setattr(departures, "_registered", [departures.AccountDeletion(registered.refusals, lost)])
    with pytest.raises(DatabaseError):
        staff_client.post(reverse("admin:auth_user_changelist"),
                          {"action": "delete_selected", "_selected_action": [alice.pk, later.pk], "post": "yes"})

    assert get_user_model().objects.get(pk=alice.pk).email == ADDRESS
    pending.refresh_from_db()
    assert pending.email == ADDRESS and pending.revoked_at is None
    assert AuditEvent.objects.get(organization=team, action="invitation.create").details["email"] == ADDRESS
    assert not LogEntry.objects.filter(action_flag=DELETION).exists()


def test_an_address_staff_changed_goes_too_but_not_from_what_its_next_holder_did_with_it(staff_client):
    # NOTE: nothing remembered an address staff changed (username and address both, as the account signs in with
    # it): a deleted account left it in its organisations' audit logs (`organization.create`'s owner).
    alice = _alice()
    own = create_organization(Actor(user=alice), name="Own", owner=alice)
    answer = staff_client.post(reverse("admin:auth_user_change", args=[alice.pk]), {
        "username": "alice@elsewhere.test", "email": "alice@elsewhere.test", "first_name": "Alice",
        "last_name": SURNAME, "is_active": "on", "date_joined_0": f"{alice.date_joined:%Y-%m-%d}",
        "date_joined_1": f"{alice.date_joined:%H:%M:%S}"})
    assert answer.status_code == 302, answer.content.decode()[:2000]
    assert get_user_model().objects.get(pk=alice.pk).email == "alice@elsewhere.test"
    # the old address is free: someone else signs up with it and makes an organisation
    sign_up_user(email=ADDRESS, password="another good passphrase", organization_name="Carol Co")
    carol = get_user_model().objects.get(email=ADDRESS)

    _delete(get_user_model().objects.get(pk=alice.pk))

    tombstone = get_user_model().objects.get(pk=alice.pk).email
    assert AuditEvent.objects.get(organization=own, action="organization.create").details["owner"] == tombstone
    assert _rows_naming("alice@elsewhere.test") == []
    carols = AuditEvent.objects.get(organization__memberships__user=carol, action="organization.create")
    assert carols.details["owner"] == ADDRESS
