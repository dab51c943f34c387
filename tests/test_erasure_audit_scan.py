"""An account's deletion reads the audit events that name it through indexes, not the whole audit log (README, "What a
deleted account leaves behind"): it runs under its organisations' row locks and its own, which every change of those
organisations' members, keys and invitations waits for, so its reads must not grow with every organisation's events."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import F

from controlplane.accounts.models import AuditEvent, Role
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, signed_in_api_client

pytestmark = pytest.mark.django_db

ADDRESS = "alice.liddell@example.test"
# NOTE: as many as make PostgreSQL prefer the indexes to a scan (at 20,000 a scan is cheaper, and it is right)
NUM_OTHER_EVENTS = 80_000


def _audit_rows_read() -> int:
    """Rows of the audit table this transaction has read so far, by scans and index scans together."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables "
                       "WHERE relname = %s", [AuditEvent._meta.db_table])
        row = cursor.fetchone()
    return row[0] if row else 0


def test_deleting_a_long_standing_account_reads_the_events_that_name_it_not_every_organisations():
    alice = UserFactory(username=ADDRESS)
    MembershipFactory(organization=OrganizationFactory(name="Alice Co"), user=alice, role=Role.OWNER)
    get_user_model().objects.filter(pk=alice.pk).update(date_joined=F("date_joined") - timedelta(days=730))
    team = OrganizationFactory(name="Team")
    AuditEvent.objects.create(organization=team, action="member.add", target_type="Membership", target_id="1",
                              target_repr=f"{ADDRESS} in team as member", details={"email": ADDRESS})
    # two years of other organisations' events, each naming someone else, at one of 50 domains
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO controlplane_auditevent (action, target_type, target_id, target_repr, details, created_at) "
            "SELECT 'member.add', 'Membership', g::text, 'user' || g || '@example' || mod(g, 50) || '.test in acme as member', "
            "jsonb_build_object('email', 'user' || g || '@example' || mod(g, 50) || '.test', 'role', 'member'), "
            "now() - g * interval '5 minutes' FROM generate_series(1, %s) AS g", [NUM_OTHER_EVENTS])
        cursor.execute(f"ANALYZE {AuditEvent._meta.db_table}")
    before = _audit_rows_read()

    answer = signed_in_api_client(alice).post("/api/v1/account/delete/", {"password": "correct horse battery"},
                                              format="json")

    assert answer.status_code == 204, answer.content
    rows_read = _audit_rows_read() - before
    assert rows_read < 1_000, f"the deletion read {rows_read} audit events"
    named = AuditEvent.objects.get(organization=team, action="member.add")
    assert ADDRESS not in named.target_repr and ADDRESS not in named.details["email"]
