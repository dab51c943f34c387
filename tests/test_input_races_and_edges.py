"""Input that passed its check and still broke at the write, or in arithmetic after it: each was a 500.

A name taken by a concurrent request between the serializer's check and the insert, a date at the end of the
calendar, a digit that is not ASCII, a value longer than its column, a sign-up racing another with the same
address or organisation name, and a login link that points back at itself."""

from __future__ import annotations

import threading

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.db import connection, transaction
from django.test import Client

from controlplane.accounts import services as account_services
from controlplane.accounts import signup as account_signup
from controlplane.accounts.models import Invitation, Organization, Role
from controlplane.accounts.tenancy import SESSION_KEY
from controlplane.plain_numbers import plain_int
from endpoints import serializers as endpoint_serializers
from endpoints.models import Adapter, Endpoint, ModelCredential
from tests.factories import EndpointFactory, MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db

ENDPOINT = {"model_source": "s3://bucket/model", "gpu_type": "l4"}


def _console(user, organization) -> Client:
    console = Client(raise_request_exception=False)
    console.force_login(user)
    session = console.session
    session[SESSION_KEY] = organization.pk
    session.save()
    return console


@pytest.fixture
def checks_lost_the_race(monkeypatch):
    """The serializers' name checks pass, as both requests of a race pass them."""
    monkeypatch.setattr(endpoint_serializers, "validate_unique_name", lambda value, *_args: value)
    monkeypatch.setattr(endpoint_serializers.AdapterSerializer, "validate_name", lambda self, value: value)


def test_an_endpoint_name_taken_meanwhile_is_a_400_on_name(owner_client, checks_lost_the_race):
    EndpointFactory(organization=owner_client.organization, name="taken")
    other = EndpointFactory(organization=owner_client.organization, name="other")

    created = owner_client.post("/api/v1/endpoints/", ENDPOINT | {"name": "taken"}, format="json")
    renamed = owner_client.patch(f"/api/v1/endpoints/{other.pk}/", {"name": "taken"}, format="json")

    assert created.status_code == 400 and "already exists" in created.json()["name"][0]
    assert renamed.status_code == 400 and "already exists" in renamed.json()["name"][0]
    assert Endpoint.objects.filter(name="taken").count() == 1
    assert Endpoint.objects.get(pk=other.pk).name == "other"


def test_an_endpoint_name_taken_meanwhile_is_a_form_error_in_the_console(org, owner_client, checks_lost_the_race):
    EndpointFactory(organization=org, name="taken")
    console = _console(owner_client.user, org)

    response = console.post("/console/endpoints/new/", ENDPOINT | {"name": "taken", "max_replicas": 1,
                                                                   "target_concurrency": 4, "scale_to_zero_after_s": 300})

    assert response.status_code == 400 and "already exists" in response.content.decode()


def test_a_credential_or_adapter_name_taken_meanwhile_is_a_400_on_name(owner_client, checks_lost_the_race):
    credential = {"kind": "s3", "role_arn": "arn:aws:iam::123456789012:role/reader"}
    assert owner_client.post("/api/v1/credentials/", credential | {"name": "taken"}, format="json").status_code == 201
    second = owner_client.post("/api/v1/credentials/", credential | {"name": "taken"}, format="json")
    endpoint = owner_client.post("/api/v1/endpoints/", ENDPOINT | {"name": "lora", "max_loras": 2, "max_lora_rank": 16},
                                 format="json").json()["id"]
    adapter = {"name": "legal", "source": "s3://tuned-adapters/legal", "rank": 8}
    assert owner_client.post(f"/api/v1/endpoints/{endpoint}/adapters/", adapter, format="json").status_code == 201
    again = owner_client.post(f"/api/v1/endpoints/{endpoint}/adapters/", adapter, format="json")

    assert second.status_code == 400 and "already exists" in second.json()["name"][0]
    assert again.status_code == 400 and "already has an adapter" in again.json()["name"][0]
    assert ModelCredential.objects.count() == 1 and Adapter.objects.count() == 1


@pytest.mark.parametrize("query", [{"start": "9999-12-31", "end": "9999-12-31"}, {"end": "0001-01-05"},
                                   {"start": "0001-01-01", "end": "0001-01-02"}])
def test_dates_at_the_ends_of_the_calendar_are_field_errors(owner_client, query):
    endpoint = EndpointFactory(organization=owner_client.organization)
    for path in ("/api/v1/usage/", "/api/v1/usage/export.csv", f"/api/v1/endpoints/{endpoint.pk}/stats/"):
        response = owner_client.get(path, query)
        assert response.status_code == 400, (path, response.status_code)
        assert {"start", "end"} & set(response.json()), path


@pytest.mark.parametrize("query", [{"end": "9999-12-31"}, {"end": "0001-01-01"}, {"start": "0001-01-01"}])
def test_the_usage_page_says_what_it_did_with_a_date_at_the_ends_of_the_calendar(org, owner_client, query):
    response = _console(owner_client.user, org).get("/console/usage/", query)

    assert response.status_code == 200 and "was not taken" in response.content.decode()


def test_digits_that_are_not_ascii_are_not_numbers(org, owner_client):
    endpoint = EndpointFactory(organization=org)
    console = _console(owner_client.user, org)

    metrics = console.get(f"/console/endpoints/{endpoint.pk}/metrics.json", {"minutes": "²"})
    long_metrics = console.get(f"/console/endpoints/{endpoint.pk}/metrics.json", {"minutes": "9" * 5000})
    window = console.post("/console/endpoints/new/", ENDPOINT | {"name": "windows",
                                                                 "prewarm_windows": "0 9 * * 1-5 UTC ² 1"})
    long_window = console.post("/console/endpoints/new/", ENDPOINT | {"name": "windows",
                                                                      "prewarm_windows": f"0 9 * * 1-5 UTC {'9' * 5000} 1"})

    assert metrics.status_code == long_metrics.status_code == 200
    assert window.status_code == long_window.status_code == 400
    assert (plain_int("²"), plain_int(" 42 "), plain_int("9" * 20), plain_int("-1")) == (None, 42, None, None)


def test_a_role_arn_longer_than_its_column_is_a_400(owner_client):
    response = owner_client.post("/api/v1/credentials/", {
        "name": "long", "kind": "s3", "role_arn": "arn:aws" + "-" * 2100 + ":iam::123456789012:role/r"}, format="json")

    assert response.status_code == 400 and "role_arn" in response.json()
    assert not ModelCredential.objects.exists()


def test_an_email_longer_than_its_column_is_a_form_error(org, owner_client, client):
    signed_up = client.post("/signup/", {"email": "a" * 140 + "@example.com", "password": "a long passphrase 1",
                                         "organization_name": "Acme"})
    invited = _console(owner_client.user, org).post("/console/members/", {"email": "a" * 250 + "@example.com",
                                                                           "role": "member"})

    assert signed_up.status_code == 200 and "email" in signed_up.context["form"].errors
    assert invited.status_code in (200, 400) and "email" in invited.context["invite_form"].errors
    assert not get_user_model().objects.filter(email__startswith="a" * 140).exists()


# Lower-casing lengthens some characters ("\u0130", one code point, is two lowered): these fit the form's and the
# serializer's max_length as typed and are past their column's once lowered (the tenancy review).
SIGN_UP_LONG_WHEN_LOWERED = "a" * 120 + "@" + "\u0130" * 20 + ".com"  # 145 characters, 165 lowered (username: 150)
INVITE_LONG_WHEN_LOWERED = "a" * 60 + "@" + ("\u0130" * 20 + ".") * 8 + "com"  # 232 characters, 392 lowered (254)


def test_a_sign_up_with_an_address_past_its_column_once_lowered_is_a_form_error():
    assert len(SIGN_UP_LONG_WHEN_LOWERED) <= 150 < len(SIGN_UP_LONG_WHEN_LOWERED.lower())
    anonymous = Client(raise_request_exception=False)
    response = anonymous.post("/signup/", {"email": SIGN_UP_LONG_WHEN_LOWERED, "password": "a long passphrase 1",
                                           "organization_name": "Acme"})

    assert response.status_code == 200 and "once lower-cased" in str(response.context["form"].errors["email"])
    assert not get_user_model().objects.exists() and not Organization.objects.exists()


def test_an_invitation_to_an_address_past_its_column_once_lowered_is_a_400_or_a_form_error(org):
    assert len(INVITE_LONG_WHEN_LOWERED) <= 254 < len(INVITE_LONG_WHEN_LOWERED.lower())
    owner = UserFactory()
    MembershipFactory(organization=org, user=owner, role=Role.OWNER)
    console = _console(owner, org)
    api = console.post("/api/v1/invitations/", {"email": INVITE_LONG_WHEN_LOWERED, "role": "member"},
                       content_type="application/json")
    page = console.post("/console/members/", {"email": INVITE_LONG_WHEN_LOWERED, "role": "member"})

    assert api.status_code == 400 and "once lower-cased" in api.json()["email"][0], api.content[:300]
    assert page.status_code == 400 and "once lower-cased" in str(page.context["invite_form"].errors["email"])
    assert not Invitation.objects.exists()


def test_a_sign_up_that_lost_the_race_for_its_email_answers_as_any_sign_up_and_mails_the_address(client, monkeypatch):
    get_user_model().objects.create_user("taken@example.test", "taken@example.test", "a long passphrase 1")
    in_use = iter([False])  # the first look found the address free: another sign-up took it before the insert
    monkeypatch.setattr(account_signup, "email_in_use", lambda email: next(in_use, True))

    response = client.post("/signup/", {"email": "taken@example.test", "password": "a long passphrase 2",
                                        "organization_name": "Acme"})

    assert response.status_code == 302 and response.url == "/signup/done/"
    assert get_user_model().objects.filter(username="taken@example.test").count() == 1
    assert [message.subject for message in mail.outbox] == ["You already have an Inferplane account"]


def test_a_sign_up_that_lost_the_race_for_its_organisation_slug_gets_the_next_one(client, monkeypatch):
    Organization.objects.create(name="Acme", slug="acme")
    free_slug = account_services.unique_org_slug
    answers = iter(["acme"])  # the first look found "acme" free: another sign-up took it before the insert
    monkeypatch.setattr(account_services, "unique_org_slug", lambda name: next(answers, None) or free_slug(name))

    response = client.post("/signup/", {"email": "second@example.test", "password": "a long passphrase 1",
                                        "organization_name": "Acme"})

    assert response.status_code == 302
    assert Organization.objects.filter(memberships__user__username="second@example.test").get().slug == "acme-2"


def test_a_login_link_back_to_the_login_page_sends_a_signed_in_user_to_the_console(org, owner_client):
    response = _console(owner_client.user, org).get("/login/", {"next": "/login/"})

    assert response.status_code == 302 and response["Location"] == "/console/"


@pytest.mark.django_db(transaction=True)
def test_an_edit_is_checked_against_the_row_another_edit_leaves(owner_client):
    # Both PATCHes were checked against the row as it was before either (each valid alone) and both applied: a
    # lookup window whose minimum is above its maximum, refused by every heartbeat of the nodes running it.
    endpoint = EndpointFactory(organization=owner_client.organization, speculative_method="ngram",
                               prompt_lookup_min=2, prompt_lookup_max=4)
    locked, release = threading.Event(), threading.Event()

    def first_edit():
        try:
            with transaction.atomic():
                Endpoint.objects.select_for_update().get(pk=endpoint.pk)
                Endpoint.objects.filter(pk=endpoint.pk).update(prompt_lookup_min=1, prompt_lookup_max=1)
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=first_edit)
    thread.start()
    assert locked.wait(10)
    threading.Timer(0.5, release.set).start()  # the second edit is on its way meanwhile
    response = owner_client.patch(f"/api/v1/endpoints/{endpoint.pk}/", {"prompt_lookup_min": 3}, format="json")
    thread.join()

    assert response.status_code == 400 and "prompt_lookup_min" in response.json()
    endpoint.refresh_from_db()
    assert (endpoint.prompt_lookup_min, endpoint.prompt_lookup_max) == (1, 1)


def _delete_meanwhile(credential, user) -> None:
    """Deletes `credential` in another connection, committed, as an admin's DELETE that ran between a request's checks
    and its write."""
    from controlplane.accounts.services import Actor
    from endpoints import credentials as credential_services

    def delete():
        try:
            credential_services.delete_credential(Actor(user=user), credential)
        finally:
            connection.close()

    thread = threading.Thread(target=delete)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("operation", ["create endpoint", "patch endpoint", "create adapter"])
def test_a_credential_deleted_between_the_checks_and_the_write_is_a_400_on_credential(owner_client, monkeypatch,
                                                                                      operation):
    """Before, the serializer found the credential, a DELETE (which saw no endpoint using it yet) removed it, and the
    write's deferred foreign key failed at commit: an IntegrityError, a 500."""
    organization = owner_client.organization
    credential = ModelCredential.objects.create(organization=organization, name="reader", kind="s3",
                                                role_arn="arn:aws:iam::123456789012:role/reader", external_id="x")
    endpoint = EndpointFactory(organization=organization, model_source="s3://bucket/model", max_loras=2)
    serializer = {"create adapter": endpoint_serializers.AdapterSerializer}.get(
        operation, endpoint_serializers.EndpointDetailSerializer)
    checked = serializer.validate

    def validate_then_lose_the_race(self, attrs):
        attrs = checked(self, attrs)
        _delete_meanwhile(credential, owner_client.user)
        return attrs

    monkeypatch.setattr(serializer, "validate", validate_then_lose_the_race)
    path, body, method = {
        "create endpoint": ("/api/v1/endpoints/", ENDPOINT | {"name": "new", "credential": str(credential.pk)}, "post"),
        "patch endpoint": (f"/api/v1/endpoints/{endpoint.pk}/", {"credential": str(credential.pk)}, "patch"),
        "create adapter": (f"/api/v1/endpoints/{endpoint.pk}/adapters/",
                           {"name": "tuned", "source": "s3://bucket/adapter", "credential": str(credential.pk)}, "post"),
    }[operation]

    response = getattr(owner_client, method)(path, body, format="json")

    assert response.status_code == 400 and "credential" in response.json()
    assert not ModelCredential.objects.filter(pk=credential.pk).exists()
    assert not Endpoint.objects.filter(credential__isnull=False).exists() and not Adapter.objects.exists()
