"""A tenant's audit log names staff's actions on its organisation as done by "Inferplane staff": no address, no IP
(a hostile tenant learnt whom to phish, and from where staff connect). Staff's own pages show everything."""

from __future__ import annotations

import pytest
from django.urls import reverse

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import AuditEvent, Plan, Role, Scope
from controlplane.accounts.serializers import STAFF_ACTOR
from controlplane.accounts.services import SYSTEM, Actor, save_plan
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
