"""A signed-in person makes another organisation (`POST /api/v1/organizations/`, `accounts.organizations`): they own
it, it starts as a sign-up's does, and the bounds hold (signed in only, active and verified, a cap per person that
closed and handed-on organisations count against, a throttle).

The console's form is `tests/console/test_new_organization_page.py`.
"""

from __future__ import annotations

import threading
import time
from decimal import Decimal

import pytest
from django.db import connection, transaction
from rest_framework.test import APIClient

from billing.models import BillingAccount
from controlplane.accounts import organizations
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.members import remove_member
from controlplane.accounts.models import (
    AuditEvent,
    Membership,
    Organization,
    Quotas,
    Role,
    Scope,
    lock_person,
)
from controlplane.accounts.services import Actor, create_organization
from controlplane.accounts.signup import sign_up_user
from controlplane.accounts.tenancy import SESSION_KEY
from controlplane.schema_view import public_schema
from endpoints import closing
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, signed_in_api_client

pytestmark = pytest.mark.django_db

URL = "/api/v1/organizations/"


@pytest.fixture
def person():
    """A verified user who owns one organisation (as after sign-up), signed in."""
    user = UserFactory()
    create_organization(Actor(user=user), name="First", owner=user)
    return user


@pytest.fixture
def session(person):
    return signed_in_api_client(person)


def test_a_signed_in_person_creates_an_organisation_they_own_and_the_creation_is_audited(session, person):
    answer = session.post(URL, {"name": "Acme Staging"}, format="json")

    assert answer.status_code == 201, answer.content
    organization = Organization.objects.get(pk=answer.json()["id"])
    assert answer.json() | {"created_at": None} == {
        "id": organization.pk, "name": "Acme Staging", "slug": "acme-staging", "created_at": None, "closed_at": None}
    assert Membership.objects.get(organization=organization).user == person
    assert Membership.objects.get(organization=organization).role == Role.OWNER
    event = AuditEvent.objects.get(organization=organization)
    assert (event.action, event.actor, event.source_ip) == ("organization.create", person, "127.0.0.1")


def test_two_organisations_of_one_name_get_slugs_of_their_own(session):
    first = session.post(URL, {"name": "Acme"}, format="json").json()
    second = session.post(URL, {"name": "Acme"}, format="json").json()

    assert (first["slug"], second["slug"]) == ("acme", "acme-2")


def test_the_session_goes_on_acting_in_the_organisation_it_chose(session):
    chosen = session.get("/api/v1/organization/").json()["id"]

    session.post(URL, {"name": "Elsewhere"}, format="json")

    assert session.get("/api/v1/organization/").json()["id"] == chosen


def test_a_new_organisation_starts_with_the_plan_quotas_and_billing_of_a_sign_up(session, settings):
    settings.DEFAULT_MONTHLY_SPEND_CAP = Decimal("25")
    signed_up = sign_up_user(email="new@example.test", password="a good long passphrase", organization_name="Signed up")
    by_sign_up = Organization.objects.get(memberships__user=signed_up)

    made = Organization.objects.get(pk=session.post(URL, {"name": "Made"}, format="json").json()["id"])

    def set_up(organization):
        account = BillingAccount.objects.for_organization(organization)
        return (organization.plan_id, organization.quotas, account.mode, account.spend_cap,
                account.invoiced_without_card, account.is_prepaid, organization.credit_grants.count())

    assert set_up(made) == set_up(by_sign_up)
    assert made.quotas == Quotas.platform_default() and set_up(made)[3] == Decimal("25")


@pytest.mark.parametrize("scopes", [[Scope.MANAGE, Scope.INFERENCE], [Scope.INFERENCE]], ids=["manage", "inference"])
def test_an_api_key_creates_no_organisation_whatever_its_scopes(person, scopes):
    organization = Organization.objects.get(memberships__user=person)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {create_api_key(Actor(user=person), organization, name='ci', scopes=scopes).plain}")

    answer = client.post(URL, {"name": "Through a key"}, format="json")

    assert answer.status_code == 403
    assert answer.json()["code"] == "session_required" and "signed in" in answer.json()["detail"]
    assert not Organization.objects.filter(name="Through a key").exists()


def test_nobody_signed_in_creates_none():
    assert APIClient().post(URL, {"name": "Anonymous"}, format="json").status_code in (401, 403)
    assert not Organization.objects.filter(name="Anonymous").exists()


@pytest.mark.parametrize(("body", "field"), [
    ({}, "name"),
    ({"name": ""}, "name"),
    ({"name": "   "}, "name"),
    ({"name": "x" * 129}, "name"),
    ({"name": "\u202eevil"}, "name"),
    ({"name": ["a", "list"]}, "name"),
    ({"name": "Acme", "slug": "chosen"}, "slug"),
], ids=["missing", "blank", "spaces", "too long", "direction override", "not a string", "a slug"])
def test_a_bad_body_is_a_400_naming_the_field_and_creates_nothing(session, body, field):
    before = Organization.objects.count()

    answer = session.post(URL, body, format="json")

    assert answer.status_code == 400 and field in answer.json(), answer.content
    assert Organization.objects.count() == before


def test_an_unverified_address_creates_none():
    user = UserFactory(verified=False)
    create_organization(Actor(user=user), name="Signed up", owner=user)

    answer = signed_in_api_client(user).post(URL, {"name": "Unverified"}, format="json")

    assert answer.status_code == 403
    with pytest.raises(organizations.CreationRefused) as refused:
        organizations.create_own_organization(Actor(user=user), name="Unverified")
    assert refused.value.code == "email_unverified"
    assert not Organization.objects.filter(name="Unverified").exists()


def test_an_account_deleted_or_deactivated_meanwhile_creates_none(person):
    """The actor was read before: its account deleted since (a tombstone, inactive) is read again under its lock."""
    actor = Actor(user=person)
    closing.delete_account(Actor(user=person), person, password="correct horse battery")

    with pytest.raises(organizations.CreationRefused) as refused:
        organizations.create_own_organization(actor, name="After the deletion")

    assert refused.value.code == "account_inactive"
    assert not Organization.objects.filter(name="After the deletion").exists()


def test_past_the_cap_one_more_is_a_400_that_says_so(session, settings):
    settings.MAX_OWNED_ORGANIZATIONS = 2
    assert session.post(URL, {"name": "Second"}, format="json").status_code == 201

    answer = session.post(URL, {"name": "Third"}, format="json")

    assert answer.status_code == 400
    assert "2 organisations" in answer.json()["non_field_errors"][0]
    assert not Organization.objects.filter(name="Third").exists()


def test_a_closed_organisation_still_counts_against_the_cap(session, person, settings):
    """Closing one and making the next renewed what an organisation gets without paying (its month's allowance
    without a card)."""
    settings.MAX_OWNED_ORGANIZATIONS = 2
    second = Organization.objects.get(pk=session.post(URL, {"name": "Second"}, format="json").json()["id"])
    closing.close_organization(Actor(user=person), second, confirm_name="Second")

    assert session.post(URL, {"name": "Third"}, format="json").status_code == 400


def test_an_organisation_handed_to_another_account_still_counts_against_the_cap(session, person, settings):
    """Its creator invites a second account of theirs as owner and leaves: then makes the next, for ever."""
    settings.MAX_OWNED_ORGANIZATIONS = 2
    second = Organization.objects.get(pk=session.post(URL, {"name": "Second"}, format="json").json()["id"])
    MembershipFactory(organization=second, role=Role.OWNER)
    remove_member(Actor(user=person), Membership.objects.get(organization=second, user=person))

    assert session.post(URL, {"name": "Third"}, format="json").status_code == 400


def test_organisations_the_person_was_only_invited_to_do_not_count(session, person, settings):
    settings.MAX_OWNED_ORGANIZATIONS = 2
    MembershipFactory(organization=OrganizationFactory(), user=person, role=Role.ADMIN)

    assert session.post(URL, {"name": "Second"}, format="json").status_code == 201


@pytest.mark.django_db(transaction=True)
def test_a_creation_waiting_on_another_is_judged_after_it_against_the_cap(person, settings):
    """Two at once: each counted before either was written, and both passed the cap."""
    settings.MAX_OWNED_ORGANIZATIONS = 2
    outcome = {}

    def create_the_other():
        try:
            organizations.create_own_organization(Actor(user=person), name="Racing")
            outcome["result"] = "created"
        except organizations.TooManyOrganizations:
            outcome["result"] = "refused"
        finally:
            connection.close()

    with transaction.atomic():
        # NOTE: this transaction is the first creation, holding the person's row as the service does
        type(person).objects.select_for_update(no_key=True).get(pk=person.pk)
        racing = threading.Thread(target=create_the_other)
        racing.start()
        time.sleep(0.5)
        create_organization(Actor(user=person), name="Winning", owner=person)
    racing.join(timeout=10)

    assert outcome == {"result": "refused"}
    assert organizations.held_by(person).count() == 2


@pytest.mark.django_db(transaction=True)
def test_an_account_deleted_while_it_creates_an_organisation_leaves_none_open_with_only_the_tombstone_to_own_it(person):
    """The deletion read the memberships before the new one committed: the organisation stayed open, owned by nobody
    who could sign in."""
    def delete_the_account():
        try:
            closing.delete_account(Actor(user=person), person, password="correct horse battery")
        finally:
            connection.close()

    with transaction.atomic():
        # NOTE: this transaction is the creation, holding the person's row as the service does
        lock_person(person.pk)
        deleting = threading.Thread(target=delete_the_account)
        deleting.start()
        time.sleep(0.5)
        create_organization(Actor(user=person), name="Meanwhile", owner=person)
    deleting.join(timeout=10)

    meanwhile = Organization.objects.get(name="Meanwhile")
    assert meanwhile.closed_at is not None
    assert not Membership.objects.filter(user=person).exists()


def test_creations_past_the_throttle_are_a_429_with_retry_after(session):
    for name in ("One", "Two", "Three"):
        assert session.post(URL, {"name": name}, format="json").status_code == 201, name

    answer = session.post(URL, {"name": "Four"}, format="json")

    assert answer.status_code == 429 and int(answer["Retry-After"]) > 0
    assert not Organization.objects.filter(name="Four").exists()


def test_attempts_refused_at_the_cap_spend_none_of_the_throttle(session, settings):
    settings.MAX_OWNED_ORGANIZATIONS = 1
    for _ in range(4):
        assert session.post(URL, {"name": "Refused"}, format="json").status_code == 400
    settings.MAX_OWNED_ORGANIZATIONS = 5

    assert session.post(URL, {"name": "Allowed"}, format="json").status_code == 201


def test_a_session_whose_organisation_is_closed_still_creates_one(session, person):
    first = Organization.objects.get(memberships__user=person)
    closing.close_organization(Actor(user=person), first, confirm_name=first.name)

    answer = session.post(URL, {"name": "Fresh start"}, format="json")

    assert answer.status_code == 201
    assert session.session[SESSION_KEY] == first.pk  # the API switches nothing


def test_the_schema_documents_the_operation_its_strict_body_and_its_refusals():
    operation = public_schema()["paths"][URL]["post"]
    components = public_schema()["components"]["schemas"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]

    assert components[body]["additionalProperties"] is False and components[body]["required"] == ["name"]
    assert {"201", "400", "403", "429"} <= set(operation["responses"])
    refused = operation["responses"]["403"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert all(f"`{code}`" in components[refused]["properties"]["code"]["description"]
               for code in ("session_required", "account_inactive", "email_unverified"))
