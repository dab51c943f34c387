"""Another organisation's objects are invisible: 404 on every verb of every route, never 403."""

import pytest

from controlplane.accounts.models import ApiKey, AuditEvent
from endpoints.models import Endpoint
from tests.factories import EndpointFactory, OrganizationFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def foreign(member_client_factory):
    other_org = OrganizationFactory()
    member_client_factory(other_org)
    endpoint = EndpointFactory(organization=other_org)
    key = ApiKey.objects.filter(organization=other_org).first()
    member = other_org.memberships.first()
    return {"endpoint": endpoint, "key": key, "member": member}


def test_every_endpoint_route_hides_other_tenants(owner_client, foreign):
    url = f"/api/v1/endpoints/{foreign['endpoint'].pk}/"
    calls = [
        ("get", url, None), ("patch", url, {"max_replicas": 5}), ("delete", url, None),
        ("post", url + "pause/", None), ("post", url + "resume/", None), ("get", url + "events/", None),
    ]
    for method, path, data in calls:
        response = getattr(owner_client, method)(path, data, format="json")
        assert response.status_code == 404, (method, path, response.status_code)
    assert owner_client.get("/api/v1/endpoints/").json()["results"] == []
    endpoint = Endpoint.objects.get(pk=foreign["endpoint"].pk)
    assert endpoint.deleted_at is None and endpoint.paused_at is None and endpoint.max_replicas == 1


def test_every_key_member_and_audit_route_hides_other_tenants(owner_client, foreign):
    key_url = f"/api/v1/keys/{foreign['key'].pk}/"
    assert owner_client.get(key_url).status_code == 404
    assert owner_client.post(key_url + "revoke/").status_code == 404
    assert ApiKey.objects.get(pk=foreign["key"].pk).revoked_at is None
    member_url = f"/api/v1/members/{foreign['member'].pk}/"
    assert owner_client.patch(member_url, {"role": "viewer"}, format="json").status_code == 404
    assert owner_client.delete(member_url).status_code == 404
    event = AuditEvent.objects.filter(organization=foreign["endpoint"].organization).first()
    if event is not None:
        assert owner_client.get(f"/api/v1/audit-log/{event.pk}/").status_code == 404
    listed = owner_client.get("/api/v1/audit-log/").json()["results"]
    assert all(e["id"] != getattr(event, "pk", None) for e in listed)


def test_a_session_user_acts_in_the_organisation_chosen_in_the_console(client, member_client_factory):
    first, second = OrganizationFactory(), OrganizationFactory()
    api = member_client_factory(first)
    from controlplane.accounts.models import Membership

    Membership.objects.create(organization=second, user=api.user, role="owner")
    EndpointFactory(organization=second, name="in-second")
    client.force_login(api.user)
    assert client.get("/api/v1/endpoints/").json()["results"] == []
    client.post("/org/switch/", {"organization": second.pk})
    assert [e["name"] for e in client.get("/api/v1/endpoints/").json()["results"]] == ["in-second"]
    # Switching to an organisation one is not a member of changes nothing.
    client.post("/org/switch/", {"organization": OrganizationFactory().pk})
    assert [e["name"] for e in client.get("/api/v1/endpoints/").json()["results"]] == ["in-second"]
