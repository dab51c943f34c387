"""A tenant's audit log names staff's actions on its organisation as done by "Inferplane staff": no address, no IP
(a hostile tenant learnt whom to phish, and from where staff connect). Staff's own pages show everything."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.urls import reverse

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import AuditEvent, Plan, Role, Scope
from controlplane.accounts.serializers import STAFF_ACTOR
from controlplane.accounts.services import SYSTEM, Actor, record_audit, save_plan
from tests.factories import MembershipFactory, UserFactory, signed_in_api_client
from tests.test_admin_stale_edits import _as_shown

pytestmark = pytest.mark.django_db

STAFF_IP = "198.51.100.9"


def _tenant_reads(client, action: str, target: str = "") -> dict:
    events = client.get("/api/v1/audit-log/").json()["results"]
    return next(event for event in events if event["action"] == action and event["target_repr"].startswith(target))


def test_a_plan_staff_set_in_the_admin_reads_as_inferplane_staff_in_the_tenants_audit_log(org, member_client_factory,
                                                                                          staff_client):
    plan = save_plan(SYSTEM, Plan(name="team", max_endpoints=10, max_replicas=8, max_min_replicas=2,
                                  max_held_requests=64, max_file_bytes=1 << 20))
    url = reverse("admin:controlplane_organization_change", args=[org.pk])
    response = staff_client.post(url, {**_as_shown(staff_client, url), "plan": [str(plan.pk)]}, REMOTE_ADDR=STAFF_IP)
    assert response.status_code == 302, response.content.decode()[:2000]
    tenant = member_client_factory(org, Role.ADMIN)

    page = tenant.get("/api/v1/audit-log/").content.decode()
    event = _tenant_reads(tenant, "organization.plan")

    assert (event["actor"], event["source_ip"], event["api_key"]) == (STAFF_ACTOR, None, None)
    assert event["details"] == {"before": None, "after": "team"}
    assert staff_client.staff.email not in page and STAFF_IP not in page
    # staff still read who it was, and from where
    recorded = AuditEvent.objects.get(action="organization.plan")
    assert (recorded.actor, recorded.source_ip) == (staff_client.staff, STAFF_IP)
    assert staff_client.staff.email in staff_client.get(reverse("admin:controlplane_auditevent_changelist")).content.decode()


def test_a_key_staff_revoked_as_the_platform_reads_as_inferplane_staff(org, member_client_factory, staff_client):
    owner = MembershipFactory(organization=org, role=Role.OWNER).user
    key = create_api_key(Actor(user=owner), org, name="leaked", scopes=[Scope.INFERENCE]).api_key
    response = staff_client.post(reverse("admin:controlplane_apikey_changelist"),
                                 {"action": "revoke", "_selected_action": [str(key.pk)]}, REMOTE_ADDR=STAFF_IP)
    assert response.status_code == 302
    tenant = member_client_factory(org, Role.ADMIN)

    event = _tenant_reads(tenant, "api_key.revoke")

    assert (event["actor"], event["source_ip"]) == (STAFF_ACTOR, None)


def test_a_staff_account_that_is_a_member_reads_as_itself_for_what_it_did_as_a_member(org, member_client_factory):
    staff_member = UserFactory(is_staff=True)
    MembershipFactory(organization=org, user=staff_member, role=Role.OWNER)
    own = signed_in_api_client(staff_member)
    assert own.post("/api/v1/keys/", {"name": "mine", "scopes": ["inference"]}, format="json",
                    REMOTE_ADDR="203.0.113.7").status_code == 201
    tenant = member_client_factory(org, Role.ADMIN)

    event = _tenant_reads(tenant, "api_key.create", target="mine")

    assert (event["actor"], event["source_ip"]) == (staff_member.email, "203.0.113.7")


def _migrate_controlplane_to_its_last() -> None:
    """The accounts app's migrations up to the marking's, not yet applied, as `migrate` runs them, on this thread's own
    connection. NOTE: up to it, not to the app's last: those after it stay applied (their rows kept, `_MARKING`)."""
    try:
        executor = MigrationExecutor(connection)
        executor.migrate([("controlplane", _MARKING[-1])])
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_the_audit_log_is_read_and_written_while_the_events_staff_caused_before_are_marked(org):
    # Before, the column was added and the earlier events marked in one transaction: the table's ACCESS EXCLUSIVE lock,
    # taken to add the column, was held through the marking's UPDATE, however long it ran (or waited on a row another
    # transaction held), and every audited write and every read of an audit log waited behind it.
    staff = UserFactory(is_staff=True)
    event = record_audit(Actor(user=staff), org, "organization.plan", org)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE controlplane_auditevent DROP COLUMN by_staff")
        cursor.execute("DELETE FROM django_migrations WHERE app = 'controlplane' AND name = ANY(%s)", [list(_MARKING)])
        # NOTE: the marking made as slow as a large table's: each row it updates waits for a lock this test holds
        cursor.execute(f"CREATE FUNCTION slow_marking() RETURNS trigger AS $$ BEGIN PERFORM pg_advisory_xact_lock("
                       f"{SLOW_MARKING_LOCK}); RETURN NEW; END $$ LANGUAGE plpgsql")
        cursor.execute("CREATE TRIGGER slow_marking BEFORE UPDATE ON controlplane_auditevent FOR EACH ROW "
                       "EXECUTE FUNCTION slow_marking()")
    holder, reader = (connection.get_new_connection(connection.get_connection_params()) for _ in range(2))
    holder.autocommit, reader.autocommit = False, True
    migrating = threading.Thread(target=_migrate_controlplane_to_its_last)
    try:
        with holder.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [SLOW_MARKING_LOCK])
        migrating.start()
        deadline = time.monotonic() + 10
        while not _marking_waits(reader) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _marking_waits(reader), "the marking never began"

        with reader.transaction(), reader.cursor() as cursor:  # a tenant reading its audit log
            cursor.execute("SET LOCAL lock_timeout = '500ms'")
            cursor.execute("SELECT count(*) FROM controlplane_auditevent WHERE organization_id = %s", [org.pk])
            assert cursor.fetchone() == (1,)
    finally:
        holder.rollback()
        if migrating.ident is not None:
            migrating.join(timeout=30)
        holder.close()
        reader.close()
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS slow_marking ON controlplane_auditevent")
            cursor.execute("DROP FUNCTION IF EXISTS slow_marking()")
    event.refresh_from_db()
    assert event.by_staff


SLOW_MARKING_LOCK = 20_020
# The column's migration and the marking's: run again by the test, those after them left applied (a later migration
# of the app run again found its own change made, and failed, leaving it unrecorded for the next run)
_MARKING = ("0020_audit_by_staff", "0021_mark_staff_audit_events")


def _marking_waits(other) -> bool:
    with other.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = "
                       "current_database() AND query LIKE '%%UPDATE controlplane_auditevent%%'")
        return cursor.fetchone()[0] > 0
