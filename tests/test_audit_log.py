import pytest

from controlplane.accounts.models import AuditEvent, Role

pytestmark = pytest.mark.django_db


def test_every_mutating_action_is_audited_with_actor_target_and_ip(owner_client):
    endpoint = owner_client.post(
        "/api/v1/endpoints/", {"name": "a", "model_source": "hf:o/m", "gpu_type": "l4"}, format="json",
        REMOTE_ADDR="203.0.113.7",
    ).json()
    owner_client.patch(f"/api/v1/endpoints/{endpoint['id']}/", {"max_replicas": 2}, format="json")
    owner_client.post(f"/api/v1/endpoints/{endpoint['id']}/pause/")
    owner_client.post(f"/api/v1/endpoints/{endpoint['id']}/resume/")
    key = owner_client.post("/api/v1/keys/", {"name": "k", "scopes": ["inference"]}, format="json").json()
    owner_client.post(f"/api/v1/keys/{key['api_key']['id']}/revoke/")
    owner_client.delete(f"/api/v1/endpoints/{endpoint['id']}/")

    actions = list(
        AuditEvent.objects.filter(organization=owner_client.organization).order_by("created_at").values_list("action", flat=True)
    )
    assert actions[-7:] == [
        "endpoint.create", "endpoint.update", "endpoint.pause", "endpoint.resume",
        "api_key.create", "api_key.revoke", "endpoint.delete",
    ]
    created = AuditEvent.objects.get(action="endpoint.create")
    assert created.actor == owner_client.user
    assert created.api_key.organization == owner_client.organization
    assert created.target_id == endpoint["id"] and created.target_repr == "a"
    assert created.source_ip == "203.0.113.7"
    update = AuditEvent.objects.get(action="endpoint.update")
    assert update.details == {"changes": {"max_replicas": 2}}


def test_reads_and_refused_writes_are_not_audited(org, member_client_factory):
    viewer = member_client_factory(org, Role.VIEWER)
    before = AuditEvent.objects.count()
    viewer.get("/api/v1/endpoints/")
    viewer.post("/api/v1/endpoints/", {"name": "a", "model_source": "hf:o/m", "gpu_type": "l4"}, format="json")
    assert AuditEvent.objects.count() == before


def test_admins_read_the_audit_log_and_members_do_not(org, member_client_factory):
    admin = member_client_factory(org, Role.ADMIN)
    member = member_client_factory(org, Role.MEMBER)
    assert admin.get("/api/v1/audit-log/").status_code == 200
    assert len(admin.get("/api/v1/audit-log/").json()["results"]) >= 2
    assert member.get("/api/v1/audit-log/").status_code == 403


def test_members_and_roles_are_managed_by_admins_and_an_owner_always_remains(org, member_client_factory):
    from tests.factories import UserFactory, signed_in_api_client

    owner = signed_in_api_client(member_client_factory(org, Role.OWNER).user)
    member = signed_in_api_client(member_client_factory(org, Role.MEMBER).user)

    newcomer = UserFactory()
    assert member.post("/api/v1/invitations/", {"email": newcomer.email, "role": "viewer"}, format="json").status_code == 403
    invited = owner.post("/api/v1/invitations/", {"email": newcomer.email, "role": "viewer"}, format="json")
    assert invited.status_code == 201 and invited.json()["role"] == "viewer"
    assert owner.post("/api/v1/members/", {"email": newcomer.email, "role": "viewer"}, format="json").status_code == 405
    owner_membership = org.memberships.get(user=owner.user)
    demoted = owner.patch(f"/api/v1/members/{owner_membership.pk}/", {"role": "admin"}, format="json")
    assert demoted.status_code == 400 and "owner" in demoted.json()["role"][0]
    assert owner.delete(f"/api/v1/members/{owner_membership.pk}/").status_code == 400
    assert AuditEvent.objects.filter(action="invitation.create", organization=org).exists()
