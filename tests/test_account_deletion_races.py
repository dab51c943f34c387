"""What happens to an address while its account is being deleted (README, "What a deleted account leaves behind"): an
invitation to it, or the account's acceptance of one, either commits before the deletion, which then ends it, or waits
for the deletion and finds the account gone. Before, each could commit in the middle of the deletion: an invitation
stayed pending to the departed person's address (for whoever held it next), or the tombstoned account stayed a member."""

from __future__ import annotations

import threading

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db import connection, transaction

from controlplane.accounts import admin as accounts_admin
from controlplane.accounts import invitations, keys
from controlplane.accounts.models import AuditEvent, Invitation, Membership, Organization, Role
from controlplane.accounts.services import Actor
from endpoints import closing
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, signed_in_api_client
from tests.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "correct horse battery"  # UserFactory's
ADDRESS = "alice.liddell@example.test"


def _alice():
    user = UserFactory(username=ADDRESS)
    MembershipFactory(organization=OrganizationFactory(name="Alice Co"), user=user, role=Role.OWNER)
    return user


def _team():
    team = OrganizationFactory(name="Team")
    owner = UserFactory()
    MembershipFactory(organization=team, user=owner, role=Role.OWNER)
    return team, owner


def _delete(user) -> None:
    answer = signed_in_api_client(user).post("/api/v1/account/delete/", {"password": PASSWORD}, format="json")
    assert answer.status_code == 204, answer.content


def _waiting_on_a_lock() -> int:
    """How many of the test database's sessions wait for a lock now (as `tests/test_roles.py` asks)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                       "AND datname = current_database()")
        return cursor.fetchone()[0]


def _in_a_thread(work, outcomes: list) -> threading.Thread:
    def run():
        try:
            outcomes.append(work())
        except Exception as exc:  # noqa: BLE001 - the test judges it
            outcomes.append(exc)
        finally:
            connection.close()

    return threading.Thread(target=run)


def _meanwhile(thread: threading.Thread) -> None:
    """Starts `thread` once, and waits until it ended or waits on a lock."""
    if thread.ident is None:
        thread.start()
        wait_until(lambda: not thread.is_alive() or _waiting_on_a_lock(), 60, message="the other work to wait or end")


def test_an_invitation_sent_while_the_account_is_being_deleted_is_revoked_with_it_or_sent_once_it_is_gone(
        monkeypatch):
    alice = _alice()
    team, owner = _team()
    outcomes: list = []
    inviting = _in_a_thread(lambda: invitations.invite_member(
        Actor(user=owner), Organization.objects.get(pk=team.pk), email=ADDRESS, role=Role.OWNER), outcomes)
    record_audit = closing.record_audit

    def invite_as_the_deletion_ends(actor, organization, action, *args, **kwargs):
        if action == "user.delete":  # NOTE: its last write: everything it revokes and rewrites is done
            _meanwhile(inviting)
        return record_audit(actor, organization, action, *args, **kwargs)

    monkeypatch.setattr(closing, "record_audit", invite_as_the_deletion_ends)
    _delete(alice)
    inviting.join(timeout=60)

    assert len(outcomes) == 1 and isinstance(outcomes[0], Invitation), outcomes
    deleted = AuditEvent.objects.get(action="user.delete", target_id=str(alice.pk))
    sent = AuditEvent.objects.get(organization=team, action="invitation.create")
    invitation = Invitation.objects.get(organization=team)
    # revoked with the account, or sent to an address that belonged to nobody any more
    assert invitation.revoked_at is not None or sent.pk > deleted.pk


def test_an_invitation_accepted_while_the_account_is_being_deleted_leaves_no_member_behind(monkeypatch):
    alice = _alice()
    team, owner = _team()
    invitation = invitations.invite_member(Actor(user=owner), team, email=ADDRESS, role=Role.OWNER)
    outcomes: list = []
    accepting = _in_a_thread(lambda: invitations.accept_invitation(Actor(user=alice), invitation), outcomes)
    revoke_api_keys_of = keys.revoke_api_keys_of

    def accept_once_the_memberships_ended(actor, user, **kwargs):
        if "organization" not in kwargs:  # NOTE: the deletion's own call, once every membership it saw ended
            _meanwhile(accepting)
        return revoke_api_keys_of(actor, user, **kwargs)

    monkeypatch.setattr(keys, "revoke_api_keys_of", accept_once_the_memberships_ended)
    _delete(alice)
    accepting.join(timeout=60)

    assert len(outcomes) == 1 and isinstance(outcomes[0], invitations.InvitationRefused), outcomes
    assert not Membership.objects.filter(user_id=alice.pk).exists()
    assert list(Membership.objects.filter(organization=team).values_list("user_id", flat=True)) == [owner.pk]


def test_staff_deleting_two_superusers_at_once_one_in_a_bulk_delete_both_end_without_a_deadlock(monkeypatch, rf):
    # NOTE: a single delete holds the active superusers' rows, then the account's; the bulk delete held its accounts'
    # rows first, then the superusers': each waited on the other and PostgreSQL failed one (a 500).
    operator = UserFactory(is_staff=True, is_superuser=True)
    first, second = UserFactory(is_staff=True, is_superuser=True), UserFactory(is_staff=True, is_superuser=True)
    users = admin.site._registry[get_user_model()]
    request = rf.post("/")
    request.user = operator
    outcomes: list = []

    def delete_first():
        with transaction.atomic():
            users.delete_model(request, get_user_model().objects.get(pk=first.pk))

    deleting = _in_a_thread(delete_first, outcomes)
    staff_refusals = accounts_admin._staff_refusals

    def delete_the_first_meanwhile(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            _meanwhile(deleting)
        return staff_refusals(*args, **kwargs)

    monkeypatch.setattr(accounts_admin, "_staff_refusals", delete_the_first_meanwhile)
    with transaction.atomic():
        users.delete_queryset(request, get_user_model().objects.filter(pk=second.pk))
    deleting.join(timeout=60)

    assert outcomes == [None]
    assert not get_user_model().objects.filter(pk__in=[first.pk, second.pk], is_active=True).exists()
