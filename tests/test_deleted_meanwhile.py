"""A write racing a delete: the write looked the row up, the delete committed, then the write ran. Each is a 404, as
for an id that never was, with nothing written on the deleted row (a member pausing or resuming an endpoint while an
owner deletes it or closes the organisation: `endpoints.closing`; an admin changing the role of a member who left)."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.test import Client

from controlplane.accounts import members
from controlplane.accounts.models import AuditEvent, Membership, Role
from controlplane.accounts.services import Actor
from controlplane.accounts.tenancy import SESSION_KEY
from endpoints import adapters as adapter_services
from endpoints import api as endpoint_api
from endpoints import closing, services
from endpoints import credentials as credential_services
from endpoints import views as endpoint_views
from endpoints.models import Adapter, Endpoint, ModelCredential
from tests.factories import EndpointFactory, MembershipFactory, signed_in_api_client

pytestmark = pytest.mark.django_db(transaction=True)


def _in_another_connection(work) -> None:
    """`work` run and committed in another connection, as another request that ran between this one's lookup and its
    write."""
    failures = []

    def run():
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            failures.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(20)
    assert not thread.is_alive() and not failures, failures


def _console(user, organization) -> Client:
    console = Client(raise_request_exception=False)
    console.force_login(user)
    session = console.session
    session[SESSION_KEY] = organization.pk
    session.save()
    return console


@pytest.mark.parametrize("action", ["pause", "resume"])
def test_pausing_or_resuming_an_endpoint_deleted_meanwhile_is_a_404_and_leaves_it_deleted(owner_client, monkeypatch,
                                                                                         action):
    """Before: the write changed the deleted endpoint's row (a resume asked the scheduler to reconcile it, an audit
    event said it was resumed), then the answer's re-read found no live endpoint: a 500."""
    endpoint = EndpointFactory(organization=owner_client.organization)
    if action == "resume":
        services.pause_endpoint(Actor(), endpoint)
    looked_up = endpoint_api.EndpointViewSet.get_object

    def look_up_then_lose_the_race(view):
        found = looked_up(view)
        _in_another_connection(lambda: services.delete_endpoint(Actor(), Endpoint.objects.get(pk=found.pk)))
        return found

    monkeypatch.setattr(endpoint_api.EndpointViewSet, "get_object", look_up_then_lose_the_race)
    response = owner_client.post(f"/api/v1/endpoints/{endpoint.pk}/{action}/")

    assert response.status_code == 404, response.content
    endpoint.refresh_from_db()
    assert endpoint.deleted_at is not None
    assert (endpoint.paused_at is not None) == (action == "resume")
    assert not AuditEvent.objects.filter(action=f"endpoint.{action}", created_at__gte=endpoint.deleted_at).exists()


@pytest.mark.parametrize("action", ["pause", "resume"])
def test_pausing_or_resuming_an_endpoint_deleted_meanwhile_in_the_console_is_a_404(org, owner_client, monkeypatch,
                                                                                  action):
    """Before: the console resumed the deleted endpoint (its scheduler asked to reconcile it, the log saying
    "resumed") and sent the member to its page, a 404."""
    endpoint = EndpointFactory(organization=org)
    if action == "resume":
        services.pause_endpoint(Actor(), endpoint)
    looked_up = endpoint_views._endpoint_or_404

    def look_up_then_lose_the_race(request, pk):
        found = looked_up(request, pk)
        _in_another_connection(lambda: services.delete_endpoint(Actor(), Endpoint.objects.get(pk=found.pk)))
        return found

    monkeypatch.setattr(endpoint_views, "_endpoint_or_404", look_up_then_lose_the_race)
    response = _console(owner_client.user, org).post(f"/console/endpoints/{endpoint.pk}/{action}/")

    assert response.status_code == 404
    endpoint.refresh_from_db()
    assert endpoint.deleted_at is not None
    assert (endpoint.paused_at is not None) == (action == "resume")
    assert not AuditEvent.objects.filter(action=f"endpoint.{action}", created_at__gte=endpoint.deleted_at).exists()


@pytest.mark.parametrize("action", ["pause", "resume"])
def test_an_endpoint_deleted_once_paused_or_resumed_is_a_404_not_a_500(owner_client, monkeypatch, action):
    """The delete committed after the write, before the answer read the endpoint again: that read was a `.get`, a 500."""
    endpoint = EndpointFactory(organization=owner_client.organization)
    if action == "resume":
        services.pause_endpoint(Actor(), endpoint)
    write = getattr(services, f"{action}_endpoint")

    def write_then_lose_the_race(actor, found):
        written = write(actor, found)
        _in_another_connection(lambda: services.delete_endpoint(Actor(), Endpoint.objects.get(pk=found.pk)))
        return written

    monkeypatch.setattr(services, f"{action}_endpoint", write_then_lose_the_race)
    response = owner_client.post(f"/api/v1/endpoints/{endpoint.pk}/{action}/")

    assert response.status_code == 404, response.content
    assert Endpoint.objects.get(pk=endpoint.pk).deleted_at is not None


@pytest.mark.parametrize("surface", ["api role", "api remove", "console role", "console remove"])
def test_changing_or_removing_a_member_who_left_meanwhile_is_a_404(org, monkeypatch, surface):
    """The view found the membership, the member left meanwhile (here their account deleted; another admin's removal
    alike), then the change read it again under the organisation's lock with `.get`: DoesNotExist, a 500."""
    owner, leaving = MembershipFactory(organization=org, role=Role.OWNER), MembershipFactory(organization=org, role=Role.ADMIN)
    lock, raced = members.lock_organizations, []

    def leave_then_lock(organization_ids):
        if not raced:
            raced.append(True)
            _in_another_connection(lambda: members.leave_organization(
                Actor(), Membership.objects.get(pk=leaving.pk), reason="user.delete"))
        return lock(organization_ids)

    monkeypatch.setattr(members, "lock_organizations", leave_then_lock)
    if surface.startswith("api"):
        client = signed_in_api_client(owner.user)
        response = (client.patch(f"/api/v1/members/{leaving.pk}/", {"role": "viewer"}, format="json")
                    if surface == "api role" else client.delete(f"/api/v1/members/{leaving.pk}/"))
    else:
        path = f"/console/members/{leaving.pk}/{'role' if surface == 'console role' else 'remove'}/"
        response = _console(owner.user, org).post(path, {"role": "viewer"})

    assert raced and response.status_code == 404, response.content
    assert not Membership.objects.filter(pk=leaving.pk).exists()
    assert list(AuditEvent.objects.filter(organization=org, action__startswith="member.").values_list(
        "action", flat=True)) == ["member.remove"]



def _credential(organization) -> ModelCredential:
    return ModelCredential.objects.create(organization=organization, name="reader", kind="s3",
                                          role_arn="arn:aws:iam::123456789012:role/reader", external_id="x")


@pytest.mark.parametrize("surface", ["api", "console"])
def test_deleting_a_credential_another_admin_deleted_meanwhile_is_a_404(org, owner_client, monkeypatch, surface):
    """Both deletes found the credential; the second read it again under its lock with `.get`: DoesNotExist, a 500."""
    credential = _credential(org)
    delete, raced = credential_services.delete_credential, []

    def deleted_meanwhile_then_delete(actor, found):
        if not raced:
            raced.append(True)
            _in_another_connection(lambda: delete(Actor(), ModelCredential.objects.get(pk=found.pk)))
        return delete(actor, found)

    monkeypatch.setattr(credential_services, "delete_credential", deleted_meanwhile_then_delete)
    if surface == "api":
        response = owner_client.delete(f"/api/v1/credentials/{credential.pk}/")
    else:
        response = _console(owner_client.user, org).post(f"/console/credentials/{credential.pk}/delete/")

    assert raced and response.status_code == 404, response.content
    assert not ModelCredential.objects.filter(pk=credential.pk).exists()
    assert AuditEvent.objects.filter(action="credential.delete").count() == 1


def test_closing_an_organisation_while_an_admin_deletes_a_credential_closes_it(org, monkeypatch):
    """The close listed the credentials, an admin deleted one meanwhile, then the close's delete of it raised
    DoesNotExist: the whole close rolled back, a 500."""
    owner = MembershipFactory(organization=org, role=Role.OWNER)
    credential = _credential(org)
    delete, raced = closing.delete_credential, []

    def deleted_meanwhile_then_delete(actor, found):
        if not raced:
            raced.append(True)
            _in_another_connection(lambda: delete(Actor(), ModelCredential.objects.get(pk=found.pk)))
        return delete(actor, found)

    monkeypatch.setattr(closing, "delete_credential", deleted_meanwhile_then_delete)
    closing.close_organization(Actor(user=owner.user), org, confirm_name=org.name)

    org.refresh_from_db()
    assert raced and org.closed_at is not None
    assert not ModelCredential.objects.filter(pk=credential.pk).exists()
    assert AuditEvent.objects.filter(action="credential.delete").count() == 1


def test_deleting_an_adapter_another_member_deleted_meanwhile_is_a_404_logged_once(owner_client, monkeypatch):
    """Both deletes found the adapter; the second logged "Adapter removed" and audited its delete again, a 204."""
    endpoint = EndpointFactory(organization=owner_client.organization, max_loras=2)
    adapter = Adapter.objects.create(endpoint=endpoint, name="tuned", source="s3://bucket/adapter")
    delete, raced = adapter_services.delete_adapter, []

    def deleted_meanwhile_then_delete(actor, found):
        if not raced:
            raced.append(True)
            _in_another_connection(lambda: delete(Actor(), Adapter.objects.select_related("endpoint").get(pk=found.pk)))
        return delete(actor, found)

    monkeypatch.setattr(adapter_services, "delete_adapter", deleted_meanwhile_then_delete)
    response = owner_client.delete(f"/api/v1/endpoints/{endpoint.pk}/adapters/{adapter.pk}/")

    assert raced and response.status_code == 404, response.content
    assert AuditEvent.objects.filter(action="adapter.delete").count() == 1
    assert endpoint.events.filter(message__contains="Adapter tuned removed").count() == 1
