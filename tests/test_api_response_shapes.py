"""The management API's answers match its OpenAPI schema for objects in states the fuzz (tests/test_api_fuzz.py)
does not seed: a client generated from the schema (openapi-generator, oapi-codegen) reads every answer it may get.

Each answer is checked by Schemathesis against the schema as served (`/api/schema/`), as the fuzz checks its own.
"""

from __future__ import annotations

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from schemathesis.specs.openapi.checks import response_schema_conformance

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Invitation, Role, Scope
from controlplane.accounts.services import Actor
from controlplane.schema_view import public_schema
from endpoints import credentials
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory


@pytest.fixture
def call(db, settings):
    """Calls one documented operation with an owner's key, on the test's transaction, and checks its answer's body
    against the schema; returns the answer's JSON."""
    settings.DEBUG = False
    organization = OrganizationFactory()
    owner = UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    secret = create_api_key(Actor(user=owner), organization, name="owner", scopes=[Scope.MANAGE]).plain
    schema = schemathesis.openapi.from_dict(public_schema())
    schema.app = get_wsgi_application()
    # NOTE: as Django's test client does: requests must not close the test's transaction.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)

    def call_operation(method: str, path: str, **kwargs):
        template = next(p for p in schema.raw_schema["paths"] if _matches(p, path))
        parameters = dict(zip(_names(template), _values(template, path), strict=True))
        case = schema[template][method].Case(path_parameters=parameters or None, **kwargs)
        response = case.call(headers={"Authorization": f"Bearer {secret}"})
        assert response.status_code < 300, response.text
        case.validate_response(response, checks=[response_schema_conformance])
        return response.json()

    call_operation.organization = organization
    call_operation.owner = owner
    yield call_operation
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


def _names(template: str) -> list[str]:
    return [part[1:-1] for part in template.split("/") if part.startswith("{")]


def _values(template: str, path: str) -> list[str]:
    return [value for part, value in zip(template.split("/"), path.split("/"), strict=True) if part.startswith("{")]


def _matches(template: str, path: str) -> bool:
    parts, values = template.split("/"), path.split("/")
    return len(parts) == len(values) and all(p == v or p.startswith("{") for p, v in zip(parts, values, strict=True))


def test_an_invitation_whose_sender_was_deleted_is_listed_as_the_schema_says(call):
    """Before, `invited_by` was documented as an email, never null, and answered null for an invitation whose sender
    staff deleted (revoked with them, listed with `?status=all`) or one the platform made: a generated client failed on the whole
    list."""
    sender = MembershipFactory(organization=call.organization, role=Role.ADMIN).user
    invitation = Invitation.objects.create(organization=call.organization, email="someone@example.com",
                                           role=Role.MEMBER, invited_by=sender, expires_at="2999-01-01T00:00:00Z",
                                           revoked_at="2026-01-01T00:00:00Z")
    sender.delete()  # staff, in the Django admin

    listed = call("GET", "/api/v1/invitations/", query={"status": "all"})
    shown = call("GET", f"/api/v1/invitations/{invitation.pk}/")

    assert [row["invited_by"] for row in listed["results"]] == [None] and shown["invited_by"] is None


def test_a_credential_whose_creator_was_deleted_is_listed_as_the_schema_says(call):
    """Before, `created_by` was documented as an email, never null, and answered null once staff deleted its
    creator: a generated client failed on the credentials' list."""
    creator = MembershipFactory(organization=call.organization, role=Role.ADMIN).user
    credential = credentials.create_credential(Actor(user=creator), call.organization, name="hub", kind="hf",
                                               hf_token="hf_" + "x" * 30)
    creator.delete()

    listed = call("GET", "/api/v1/credentials/")
    shown = call("GET", f"/api/v1/credentials/{credential.pk}/")

    assert [row["created_by"] for row in listed["results"]] == [None] and shown["created_by"] is None


def _documented_properties(method: str, template: str) -> set[str]:
    schema = public_schema()
    answer = schema["paths"][template][method]["responses"]["200"]["content"]["application/json"]["schema"]
    if "$ref" in answer:
        answer = schema["components"]["schemas"][answer["$ref"].rsplit("/", 1)[1]]
    return set(answer["properties"])


def test_a_keys_spend_cap_answer_holds_the_fields_the_schema_documents_and_no_secret(call):
    """Before, the schema documented `spend_cap` alone and the answer held `key` too: a client generated from the
    schema (a strict one, or one that drops what it does not know) never saw which key was capped."""
    key = create_api_key(Actor(user=call.owner), call.organization, name="capped", scopes=[Scope.INFERENCE])

    answer = call("PATCH", f"/api/v1/billing/keys/{key.api_key.pk}/", body={"spend_cap": "5.00"}, media_type="application/json")

    assert set(answer) == _documented_properties("patch", "/api/v1/billing/keys/{key_id}/") == {"key", "spend_cap"}
    assert answer["key"] == key.api_key.display_prefix and answer["spend_cap"] == "5.00"
    assert key.plain not in str(answer)
