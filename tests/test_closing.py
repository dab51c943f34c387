"""An owner closes their organisation, a user deletes their own account (`endpoints.closing`): everything the
organisation ran or kept ends through the services that end each thing, its billing and audit records stay, nothing
in it changes afterwards; and the only owner of an organisation others depend on cannot slip out of it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.middleware.csrf import _get_new_csrf_string
from django.test import Client
from django.utils import timezone
from rest_framework.exceptions import ValidationError
from rest_framework.test import APIClient

from billing.ledger import record_usage
from billing.models import UsageRollup
from billing.rollups import rollup_usage
from controlplane.accounts import invitations
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import ApiKey, AuditEvent, Invitation, Membership, Organization, Role, Scope
from controlplane.accounts.services import Actor, NotPermitted
from controlplane.accounts.signup import sign_up_user
from endpoints import closing
from endpoints.gateway import auth
from endpoints.models import Adapter, Endpoint, ModelCredential
from endpoints.services import create_endpoint
from tests.billing.conftest import usage_report
from tests.factories import (
    EndpointFactory,
    MembershipFactory,
    OrganizationFactory,
    UserFactory,
    make_credential,
    signed_in_api_client,
)

pytestmark = pytest.mark.django_db

CLOSE = "/api/v1/organization/close/"
DELETE_ACCOUNT = "/api/v1/account/delete/"
PASSWORD = "correct horse battery"  # UserFactory's


def _member(organization, role):
    user = UserFactory()
    MembershipFactory(organization=organization, user=user, role=role)
    return user


def _signed_in(user, organization) -> APIClient:
    client = signed_in_api_client(user)
    session = client.session
    session["organization_id"] = organization.pk
    session.save()
    return client


def _key(user, organization, scopes=(Scope.INFERENCE, Scope.MANAGE)) -> str:
    return create_api_key(Actor(user=user), organization, name="k", scopes=list(scopes)).plain


def _with_key(plain: str) -> APIClient:
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plain}")
    return client


def test_an_owner_who_types_the_name_closes_the_organisation_and_everything_it_ran_ends():
    org = OrganizationFactory(name="Acme Labs")
    owner, member = _member(org, Role.OWNER), _member(org, Role.MEMBER)
    _key(owner, org)
    _key(member, org, scopes=[Scope.INFERENCE])
    endpoint = EndpointFactory(organization=org, max_loras=2, max_lora_rank=16)
    credential = make_credential(org)
    Adapter.objects.create(endpoint=endpoint, name="tone", source="s3://tuned/tone", credential=credential)
    invitations.invite_member(Actor(user=owner), org, email="newcomer@example.test", role=Role.MEMBER)

    answer = _signed_in(owner, org).post(CLOSE, {"confirm_name": "Acme Labs"}, format="json")

    assert answer.status_code == 200, answer.json()
    assert answer.json()["closed_at"] is not None
    org.refresh_from_db()
    assert org.closed_at is not None
    assert not ApiKey.objects.filter(organization=org, revoked_at__isnull=True).exists()
    assert Endpoint.objects.get(pk=endpoint.pk).deleted_at is not None
    assert not Adapter.objects.filter(endpoint=endpoint).exists()
    assert not ModelCredential.objects.filter(organization=org).exists()
    assert not Invitation.objects.for_org(org).pending().exists()
    # NOTE: each through its own service: one audit event each, and the close's own
    actions = list(AuditEvent.objects.filter(organization=org).values_list("action", flat=True))
    assert actions.count("api_key.revoke") == 2
    assert {"invitation.revoke", "adapter.delete", "endpoint.delete", "credential.delete",
            "organization.close"} <= set(actions)
    revoked = AuditEvent.objects.filter(organization=org, action="api_key.revoke").values_list("details", flat=True)
    assert all(details["reason"] == "organization.close" for details in revoked)
    # its members stay, read-only
    assert Membership.objects.filter(organization=org).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_closed_organisations_old_key_gets_a_401_on_v1():
    org = OrganizationFactory()
    owner = _member(org, Role.OWNER)
    plain = _key(owner, org)
    client = _with_key(plain)
    assert client.get("/v1/files").status_code == 200

    closing.close_organization(Actor(user=owner), org, confirm_name=org.name)

    auth._callers_by_key.clear()  # NOTE: the key's cached caller dropped, as its TTL (a second here) would
    answer = client.get("/v1/files")
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("role", [Role.ADMIN, Role.MEMBER, Role.VIEWER])
def test_a_member_who_is_not_an_owner_gets_a_403_and_the_organisation_stays_open(role):
    org = OrganizationFactory()
    _member(org, Role.OWNER)
    answer = _signed_in(_member(org, role), org).post(CLOSE, {"confirm_name": org.name}, format="json")
    assert answer.status_code == 403
    assert Organization.objects.get(pk=org.pk).closed_at is None


def test_an_owners_api_key_cannot_close_the_organisation():
    org = OrganizationFactory()
    answer = _with_key(_key(_member(org, Role.OWNER), org)).post(CLOSE, {"confirm_name": org.name}, format="json")
    assert answer.status_code == 403
    assert "signed in" in answer.json()["detail"]
    assert Organization.objects.get(pk=org.pk).closed_at is None


@pytest.mark.parametrize("typed", [{"confirm_name": "acme labs"}, {"confirm_name": "Acme Labs "}, {}])
def test_a_wrong_or_missing_confirmation_is_a_400_naming_the_field_and_closes_nothing(typed):
    org = OrganizationFactory(name="Acme Labs")
    owner = _member(org, Role.OWNER)
    plain = _key(owner, org)
    answer = _signed_in(owner, org).post(CLOSE, typed, format="json")
    assert answer.status_code == 400
    assert "confirm_name" in answer.json()
    assert Organization.objects.get(pk=org.pk).closed_at is None
    assert ApiKey.objects.get(lookup=plain.split("_")[1]).revoked_at is None


def test_a_second_close_is_a_clear_4xx_and_the_service_refuses_it_too():
    org = OrganizationFactory()
    owner = _member(org, Role.OWNER)
    client = _signed_in(owner, org)
    assert client.post(CLOSE, {"confirm_name": org.name}, format="json").status_code == 200
    closed_at = Organization.objects.get(pk=org.pk).closed_at

    again = client.post(CLOSE, {"confirm_name": org.name}, format="json")

    assert again.status_code == 403
    assert "closed" in again.json()["detail"]
    with pytest.raises(closing.AlreadyClosed):  # a close that raced it and waited on its lock
        closing.close_organization(Actor(user=owner), org, confirm_name=org.name)
    assert Organization.objects.get(pk=org.pk).closed_at == closed_at
    assert AuditEvent.objects.filter(organization=org, action="organization.close").count() == 1


def test_a_closed_organisation_refuses_every_write_and_still_shows_its_records():
    org = OrganizationFactory()
    owner = _member(org, Role.OWNER)
    api, console = _signed_in(owner, org), Client()
    console.force_login(owner)
    session = console.session
    session["organization_id"] = org.pk
    session.save()
    closing.close_organization(Actor(user=owner), org, confirm_name=org.name)

    created = api.post("/api/v1/keys/", {"name": "again", "scopes": ["inference"]}, format="json")
    assert created.status_code == 403 and "closed" in created.json()["detail"]
    assert api.post("/api/v1/endpoints/", {"name": "x"}, format="json").status_code == 403
    assert console.post("/console/keys/", {"name": "again", "scopes": ["inference"]}).status_code == 403
    assert not ApiKey.objects.filter(organization=org, revoked_at__isnull=True).exists()
    shown = api.get("/api/v1/organization/")
    assert shown.status_code == 200 and shown.json()["closed_at"] is not None
    assert api.get("/api/v1/audit-log/").status_code == 200


def test_a_key_or_an_endpoint_made_by_a_write_that_waited_on_the_close_is_refused():
    org = OrganizationFactory()
    owner = _member(org, Role.OWNER)
    closing.close_organization(Actor(user=owner), org, confirm_name=org.name)
    with pytest.raises(NotPermitted):
        create_api_key(Actor(user=owner), org, name="late", scopes=[Scope.INFERENCE])
    with pytest.raises(ValidationError):
        create_endpoint(Actor(user=owner), org, name="late", model_source="hf:meta-llama/Llama-3.1-8B-Instruct",
                        gpu_type="l4")
    with pytest.raises(NotPermitted):
        invitations.invite_member(Actor(user=owner), org, email="late@example.test", role=Role.MEMBER)
    assert not Endpoint.objects.filter(organization=org).exists()


def test_a_credential_made_by_a_write_that_waited_on_the_close_is_refused_and_keeps_no_secret():
    # NOTE: the request passed its permission check before the close committed, and wrote after it: the credential's
    # encrypted secrets were kept for good in an organisation that changes no more
    org = OrganizationFactory()
    owner = _member(org, Role.OWNER)
    closing.close_organization(Actor(user=owner), org, confirm_name=org.name)
    with pytest.raises(ValidationError) as refused:
        make_credential(org, name="late")
    assert "non_field_errors" in refused.value.detail
    assert not ModelCredential.objects.filter(organization=org).exists()


def test_usage_recorded_before_closing_still_rolls_up_and_is_pushed_to_stripe():
    endpoint = EndpointFactory()
    org = endpoint.organization
    owner = _member(org, Role.OWNER)
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=2)
    record_usage(usage_report(endpoint, finished_at=hour + timedelta(minutes=5)))
    record_usage(usage_report(endpoint, finished_at=timezone.now()))
    closing.close_organization(Actor(user=owner), org, confirm_name=org.name)

    rollup_usage()

    rolled = UsageRollup.objects.filter(organization=org)
    assert sum(r.num_requests for r in rolled) == 2
    assert UsageRollup.objects.pushable().filter(organization=org, hour_start=hour).exists()


# --- deleting one's account ------------------------------------------------------------------


def test_a_deleted_user_cannot_log_in_their_keys_are_revoked_and_their_address_may_sign_up_again():
    org = OrganizationFactory()
    _member(org, Role.OWNER)
    user = _member(org, Role.MEMBER)
    address = user.email
    plain = _key(user, org, scopes=[Scope.INFERENCE])
    other_session = Client()
    assert other_session.post("/login/", {"username": address, "password": PASSWORD}).status_code == 302

    answer = _signed_in(user, org).post(DELETE_ACCOUNT, {"password": PASSWORD}, format="json")

    assert answer.status_code == 204
    user.refresh_from_db()
    assert not user.is_active and user.email != address and (user.first_name, user.last_name) == ("", "")
    assert ApiKey.objects.get(lookup=plain.split("_")[1]).revoked_at is not None
    assert not Membership.objects.filter(user=user).exists()
    assert Client().post("/login/", {"username": address, "password": PASSWORD}).status_code == 200  # the form again
    assert other_session.get("/console/").status_code == 302  # its other sessions ended: to the log-in
    assert AuditEvent.objects.filter(action="user.delete", actor=user).exists()
    assert AuditEvent.objects.filter(organization=org, action="member.remove", details__reason="user.delete").exists()
    assert sign_up_user(email=address, password="another good passphrase", organization_name="Again") is not None


def test_the_only_owner_of_an_organisation_with_other_members_is_refused_until_they_transfer_or_close_it():
    org = OrganizationFactory(name="Acme Labs")
    owner = _member(org, Role.OWNER)
    _member(org, Role.MEMBER)
    client = _signed_in(owner, org)

    refused = client.post(DELETE_ACCOUNT, {"password": PASSWORD}, format="json")

    assert refused.status_code == 400
    assert "only owner of Acme Labs" in refused.json()["non_field_errors"][0]
    owner.refresh_from_db()
    assert owner.is_active and Membership.objects.filter(user=owner, organization=org).exists()

    closing.close_organization(Actor(user=owner), org, confirm_name=org.name)
    assert client.post(DELETE_ACCOUNT, {"password": PASSWORD}, format="json").status_code == 204


def test_a_member_made_the_only_owner_while_deleting_their_account_is_refused_not_a_500(monkeypatch):
    # NOTE: the memberships were read before their organisations' rows were taken: one promoted to the only owner
    # meanwhile (the owner stepping down) was judged as the member it had been, and its departure then raised
    # `LastOwnerError`, uncaught: a 500
    org = OrganizationFactory(name="Acme Labs")
    owner = _member(org, Role.OWNER)
    user = _member(org, Role.MEMBER)
    locked = closing.lock_organizations

    def promoted_meanwhile(ids):
        Membership.objects.filter(organization=org, user=user).update(role=Role.OWNER)
        Membership.objects.filter(organization=org, user=owner).update(role=Role.MEMBER)
        return locked(ids)

    monkeypatch.setattr(closing, "lock_organizations", promoted_meanwhile)
    refused = _signed_in(user, org).post(DELETE_ACCOUNT, {"password": PASSWORD}, format="json")

    assert refused.status_code == 400
    assert "only owner of Acme Labs" in refused.json()["non_field_errors"][0]
    user.refresh_from_db()
    assert user.is_active and Membership.objects.filter(user=user, organization=org).exists()


def test_the_only_owner_of_an_organisation_with_an_endpoint_is_refused():
    endpoint = EndpointFactory()
    owner = _member(endpoint.organization, Role.OWNER)
    refused = _signed_in(owner, endpoint.organization).post(DELETE_ACCOUNT, {"password": PASSWORD}, format="json")
    assert refused.status_code == 400 and "endpoints" in refused.json()["non_field_errors"][0]


def test_a_user_alone_in_an_empty_organisation_deletes_their_account_and_it_is_closed():
    org = OrganizationFactory()
    owner = _member(org, Role.OWNER)
    assert _signed_in(owner, org).post(DELETE_ACCOUNT, {"password": PASSWORD}, format="json").status_code == 204
    assert Organization.objects.get(pk=org.pk).closed_at is not None


def test_a_wrong_password_or_an_api_key_deletes_nothing():
    org = OrganizationFactory()
    _member(org, Role.OWNER)
    user = _member(org, Role.ADMIN)
    wrong = _signed_in(user, org).post(DELETE_ACCOUNT, {"password": "not it"}, format="json")
    assert wrong.status_code == 400 and "password" in wrong.json()
    with_key = _with_key(_key(user, org)).post(DELETE_ACCOUNT, {"password": PASSWORD}, format="json")
    assert with_key.status_code == 403
    assert get_user_model().objects.get(pk=user.pk).is_active


def test_a_borrowed_session_cannot_guess_the_password_without_end_to_delete_the_account():
    org = OrganizationFactory()
    _member(org, Role.OWNER)
    user = _member(org, Role.MEMBER)
    client = _signed_in(user, org)
    wrong = [client.post(DELETE_ACCOUNT, {"password": f"guess {n}"}, format="json").status_code for n in range(10)]
    assert wrong == [400] * 10

    answer = client.post(DELETE_ACCOUNT, {"password": PASSWORD}, format="json")

    assert answer.status_code == 429 and int(answer["Retry-After"]) > 0
    assert get_user_model().objects.get(pk=user.pk).is_active


@pytest.mark.django_db(transaction=True)
def test_a_members_console_session_of_a_closed_organisation_calls_nothing_on_v1():
    org = OrganizationFactory()
    owner = _member(org, Role.OWNER)
    client = Client()
    client.force_login(owner)
    session = client.session
    session["organization_id"] = org.pk
    session.save()
    csrf = _get_new_csrf_string()
    client.cookies[settings.CSRF_COOKIE_NAME] = csrf
    assert client.get("/v1/batches", HTTP_X_CSRFTOKEN=csrf).status_code == 200

    closing.close_organization(Actor(user=owner), org, confirm_name=org.name)

    listed = client.get("/v1/batches", HTTP_X_CSRFTOKEN=csrf)
    assert listed.status_code == 403
    assert listed.json()["error"]["code"] == "organization_closed"


def test_the_console_closes_the_organisation_once_its_name_is_typed():
    org = OrganizationFactory(name="Acme Labs")
    owner = _member(org, Role.OWNER)
    console = Client()
    console.force_login(owner)
    session = console.session
    session["organization_id"] = org.pk
    session.save()
    assert "Type" in console.get("/console/organization/close/").content.decode()

    wrong = console.post("/console/organization/close/", {"confirm_name": "Acme"})
    assert wrong.status_code == 400 and "exactly" in wrong.content.decode()
    assert Organization.objects.get(pk=org.pk).closed_at is None

    done = console.post("/console/organization/close/", {"confirm_name": "Acme Labs"})
    assert done.status_code == 302
    assert Organization.objects.get(pk=org.pk).closed_at is not None
    assert "was closed on" in console.get("/console/organization/close/").content.decode()
    assert console.get("/console/").status_code == 200  # its pages still read
    assert console.get("/console/billing/").status_code == 200


def test_the_console_deletes_the_account_with_its_password_and_signs_it_out():
    org = OrganizationFactory()
    _member(org, Role.OWNER)
    user = _member(org, Role.MEMBER)
    console = Client()
    console.force_login(user)

    wrong = console.post("/account/delete/", {"password": "nope"})
    assert wrong.status_code == 400 and get_user_model().objects.get(pk=user.pk).is_active

    done = console.post("/account/delete/", {"password": PASSWORD})
    assert done.status_code == 302 and done["Location"].startswith("/login/")
    assert not get_user_model().objects.get(pk=user.pk).is_active
    assert console.get("/console/").status_code == 302  # signed out
