"""Role changes, removals and invitations queue on their organisation's row (NO KEY UPDATE), which never holds off
the usage ledger: a usage row's foreign-key check (FOR KEY SHARE on that row) goes on meanwhile."""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from billing.models import UsageRecord, UsageStatus
from controlplane.accounts import invitations, members, services
from controlplane.accounts.models import Membership, Role
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory, UserFactory

WRITES = {
    "demote": "member.change_role",
    "remove": "member.remove",
    "invite": "invitation.create",
    "revoke_invitation": "invitation.revoke",
    "accept_invitation": "invitation.accept",
}


def _write_a_usage_row(endpoint, refusals: list[BaseException]) -> None:
    """In a connection of its own, as the ledger writer's: a lock it would wait on for 2 s fails it instead."""
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '2s'")
            now = timezone.now()
            UsageRecord.objects.create(
                request_id=f"req-{endpoint.pk}-while-held",
                organization_id=endpoint.organization_id,
                endpoint=endpoint,
                prompt_tokens=1,
                completion_tokens=1,
                cost=Decimal("0.000001"),
                started_at=now,
                finished_at=now,
                status=UsageStatus.OK,
            )
    except OperationalError as exc:
        refusals.append(exc)
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("write", list(WRITES))
def test_a_usage_row_of_the_organisation_is_written_while_a_member_change_holds_its_row(monkeypatch, write):
    """The organisation's row was locked FOR UPDATE, which conflicts with the foreign-key checks of every usage row
    of that organisation: the ledger's shared batch waited for a whole demotion (16 s with 2,000 keys to walk)."""
    organization = OrganizationFactory()
    endpoint = EndpointFactory(organization=organization)
    owner, admin = UserFactory(), UserFactory()
    invitee = UserFactory(username="new@example.test")
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    seat = MembershipFactory(organization=organization, user=admin, role=Role.ADMIN)
    pending = invitations.invite_member(
        services.Actor(user=admin), organization, email=invitee.email, role=Role.MEMBER
    )
    refusals: list[BaseException] = []
    written = []

    def record_audit_after_writing_a_usage_row(record_audit):
        def record(actor, organization, action, *args, **kwargs):
            if action == WRITES[write] and not written:  # the organisation's row is held here
                writing = threading.Thread(target=_write_a_usage_row, args=(endpoint, refusals))
                writing.start()
                writing.join(timeout=60)
                written.append(action)
            return record_audit(actor, organization, action, *args, **kwargs)

        return record

    monkeypatch.setattr(members, "record_audit", record_audit_after_writing_a_usage_row(members.record_audit))
    monkeypatch.setattr(
        invitations, "record_audit", record_audit_after_writing_a_usage_row(invitations.record_audit)
    )
    owner_acts = services.Actor(user=owner)
    if write == "demote":
        members.change_member_role(owner_acts, Membership.objects.get(pk=seat.pk), role=Role.MEMBER)
    elif write == "remove":
        members.remove_member(owner_acts, Membership.objects.get(pk=seat.pk))
    elif write == "invite":
        invitations.invite_member(owner_acts, organization, email="other@example.test", role=Role.MEMBER)
    elif write == "revoke_invitation":
        invitations.revoke_invitation(owner_acts, pending)
    else:
        invitations.accept_invitation(services.Actor(user=invitee), pending)

    assert written == [WRITES[write]]
    assert refusals == []
    assert UsageRecord.objects.filter(organization=organization).count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_usage_row_of_the_organisation_is_written_while_a_scale_up_holds_its_row():
    """`quotas.lock_organization` (a placement's quota check) took FOR UPDATE: every usage row of that organisation
    waited for the placement's commit."""
    from endpoints import quotas

    endpoint = EndpointFactory()
    refusals: list[BaseException] = []
    with transaction.atomic():
        quotas.lock_organization(endpoint.organization_id)
        writing = threading.Thread(target=_write_a_usage_row, args=(endpoint, refusals))
        writing.start()
        writing.join(timeout=60)
    assert refusals == []
    assert UsageRecord.objects.filter(request_id=f"req-{endpoint.pk}-while-held").exists()
