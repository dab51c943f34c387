"""The management API's request bodies are documented as the API reads them (`controlplane.schema`).

A body the schema allows must not be refused for its shape, and a body the schema forbids must be refused:
Schemathesis's `positive_data_acceptance` and `negative_data_rejection` checks, and any client generated from the
schema, rely on both. Each test sends one body, reads the answer, and checks the schema as served (`/api/schema/`)
says the same thing about it.
"""

from __future__ import annotations

import jsonschema
import pytest
from django.test import Client

from controlplane.accounts.models import ApiKey, Membership, Role
from controlplane.schema_view import public_schema
from tests.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db


def _documented_body(path: str, method: str) -> dict:
    """The JSON body schema of one operation as served, as a request's: its `$ref`s resolved, OpenAPI's `nullable` as
    JSON Schema's, read-only fields left out."""
    schema = public_schema()
    components = schema["components"]["schemas"]

    def resolved(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return resolved(components[node["$ref"].rsplit("/", 1)[1]])
            node = {key: resolved(value) for key, value in node.items()}
            if node.pop("nullable", False) and "type" in node:
                node["type"] = [node["type"], "null"]
            # A request leaves out what is read-only, as OpenAPI says (and Schemathesis does).
            read_only = {name for name, field in node.get("properties", {}).items() if field.get("readOnly")}
            if read_only:
                node["properties"] = {k: v for k, v in node["properties"].items() if k not in read_only}
                node["required"] = [name for name in node.get("required", []) if name not in read_only]
            return node
        if isinstance(node, list):
            return [resolved(item) for item in node]
        return node

    return resolved(schema["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"])


def _allows(body_schema: dict, body: dict) -> bool:
    return jsonschema.Draft4Validator(body_schema).is_valid(body)


def test_a_field_the_api_does_not_know_is_refused_and_the_schema_says_it_would_be(owner_client):
    """Before, every body was documented open (no `additionalProperties: false`) while each strict serializer answered
    400 "Unknown field.": `negative_data_rejection`'s opposite, `positive_data_acceptance`, failed on every create."""
    body = {"name": "ci", "scopes": ["inference"], "colour": "red"}
    answer = owner_client.post("/api/v1/keys/", body, format="json")

    assert answer.status_code == 400 and answer.json() == {"colour": ["Unknown field."]}
    documented = _documented_body("/api/v1/keys/", "post")
    assert not _allows(documented, body)
    assert _allows(documented, {"name": "ci", "scopes": ["inference"]})


@pytest.mark.parametrize("path", ["/api/v1/billing/", "/api/v1/billing/keys/{key_id}/"])
def test_a_spend_cap_patch_needs_the_cap_and_the_schema_says_so(owner_client, path):
    """Before, the PATCH body was documented with `spend_cap` optional (drf-spectacular makes every PATCH partial) and
    `{}` was a 400: a body the schema allows, refused."""
    key_id = ApiKey.objects.get(organization=owner_client.organization).pk
    answer = owner_client.patch(path.replace("{key_id}", str(key_id)), {}, format="json")

    assert answer.status_code == 400 and answer.json() == {"spend_cap": ["This field is required."]}
    documented = _documented_body(path, "patch")
    assert not _allows(documented, {})
    assert _allows(documented, {"spend_cap": "12.50"}) and _allows(documented, {"spend_cap": None})


def test_a_members_role_patch_needs_the_role_alone_and_the_schema_says_so(org):
    """Before, `{}` and `{"role": "viewer", "note": "x"}` were each a 400 ("Send exactly {'role': …}") that the
    schema allowed. Now each is a field error, as the schema documents."""
    owner = UserFactory()
    MembershipFactory(organization=org, user=owner, role=Role.OWNER)
    member = MembershipFactory(organization=org, role=Role.MEMBER)
    client = Client()
    client.force_login(owner)
    path = f"/api/v1/members/{member.pk}/"
    documented = _documented_body("/api/v1/members/{id}/", "patch")

    empty = client.patch(path, {}, content_type="application/json")
    extra = client.patch(path, {"role": "viewer", "note": "x"}, content_type="application/json")
    changed = client.patch(path, {"role": "viewer"}, content_type="application/json")

    assert empty.status_code == 400 and empty.json() == {"role": ["This field is required."]}
    assert extra.status_code == 400 and extra.json() == {"note": ["Unknown field."]}
    assert changed.status_code == 200 and Membership.objects.get(pk=member.pk).role == Role.VIEWER
    assert not _allows(documented, {}) and not _allows(documented, {"role": "viewer", "note": "x"})
    assert _allows(documented, {"role": "viewer"})


def test_a_prewarm_window_with_a_field_the_api_does_not_know_is_refused_and_the_schema_says_it_would_be(owner_client):
    """Before, a window (`PrewarmWindow`, the shape `PrewarmWindowsField` checks) was documented open while the API
    answered 400 "unknown field(s)" for an extra key in it: a body the schema allowed, refused."""
    from tests.factories import EndpointFactory

    endpoint = EndpointFactory(organization=owner_client.organization, max_replicas=2)
    window = {"schedule": "0 9 * * 1-5", "timezone": "Europe/Paris", "duration_minutes": 60, "min_replicas": 1}
    body = {"prewarm_windows": [window | {"label": "office hours"}]}
    answer = owner_client.patch(f"/api/v1/endpoints/{endpoint.pk}/", body, format="json")

    assert answer.status_code == 400 and "unknown field(s) label" in str(answer.json()["prewarm_windows"])
    documented = _documented_body("/api/v1/endpoints/{id}/", "patch")
    assert not _allows(documented, body)
    assert _allows(documented, {"prewarm_windows": [window]})


def test_an_answer_is_never_documented_closed_to_fields_a_later_release_adds():
    """A request's component and its answer's were one (`COMPONENT_SPLIT_REQUEST` off): the answer's claimed
    `additionalProperties: false` too, and a strict client generated from it (pydantic's `extra="forbid"`) failed on
    the first field a later release added (during a rollout, pods of two releases answering)."""
    schema = public_schema()
    components = schema["components"]["schemas"]
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            for status, response in operation.get("responses", {}).items():
                for content in response.get("content", {}).values():
                    reference = content["schema"].get("$ref") or content["schema"].get("items", {}).get("$ref")
                    if reference:
                        answer = components[reference.rsplit("/", 1)[1]]
                        assert answer.get("additionalProperties") is not False, (path, method, status)
    assert components["ApiKeyRequest"]["additionalProperties"] is False
    assert "additionalProperties" not in components["ApiKey"]
