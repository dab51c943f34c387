"""Every route of the URLconf that takes an object's id, with another organisation's object, answers exactly as it
answers an id that matches nothing (never a 2xx, never a 5xx, never a 403 only that object gets), for every role,
signed in or with an API key, on every method; and the other organisation's objects are left as they were.

The routes are read from the URLconf itself: a new route with a path parameter this file does not know fails the
test until it is given an object here.
"""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import ApiKey, Invitation, Membership, Role, Scope
from controlplane.accounts.services import Actor, record_audit
from controlplane.accounts.tenancy import SESSION_KEY
from endpoints.batches.models import Batch, BatchStatus, File
from endpoints.models import Adapter, Endpoint, ModelCredential
from endpoints.nodes.models import JoinToken, Node, NodePool
from tests.factories import (
    EndpointFactory,
    MembershipFactory,
    OrganizationFactory,
    UserFactory,
    make_credential,
)

pytestmark = pytest.mark.django_db

METHODS = ("get", "post", "put", "patch", "delete")
# Routes whose path parameter is no object's id: a signed token, or a part of Django's admin (staff only).
NOT_OBJECT_ROUTES = ("verify-email/", "invitations/<str:token>/", "reset/", "django-admin/")


def routes_of(patterns, prefix: str = ""):
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from routes_of(pattern.url_patterns, prefix + str(pattern.pattern).lstrip("^"))
        elif isinstance(pattern, URLPattern):
            yield prefix + str(pattern.pattern).lstrip("^")


PARAMETER = re.compile(r"<(?:\w+:)?(?P<angle>\w+)>|\(\?P<(?P<group>\w+)>[^)]*\)")


def concrete_path(route: str, ids: dict[str, str]) -> str:
    """`route` (path() and re_path() parts joined) with each parameter replaced by its id for this route."""
    path = route.replace("$", "").replace("\\.", ".").replace("/?", "/")
    return "/" + PARAMETER.sub(lambda m: ids[_kind(route, m.group("angle") or m.group("group"))], path)


# What each path parameter names, by where it appears.
KINDS = [
    ("api/v1/endpoints/<uuid:endpoint_pk>/adapters/<uuid:pk>", "pk", "adapter"),
    ("api/v1/endpoints/", "endpoint_pk", "endpoint"),
    ("api/v1/endpoints/", "pk", "endpoint"),
    ("api/v1/credentials/", "pk", "credential"),
    ("api/v1/keys/", "pk", "key"),
    ("api/v1/billing/keys/", "key_id", "key"),
    ("api/v1/members/", "pk", "member"),
    ("api/v1/invitations/", "pk", "invitation"),
    ("api/v1/audit-log/", "pk", "audit_event"),
    ("api/v1/fleet/pools/", "pk", "pool"),
    ("console/endpoints/", "pk", "endpoint"),
    ("console/credentials/", "pk", "credential"),
    ("console/batches/", "batch_id", "batch"),
    ("console/files/", "file_id", "file"),
    ("console/keys/", "pk", "key"),
    ("console/members/", "pk", "member"),
    ("console/invitations/", "pk", "invitation"),
    ("console/fleet/nodes/", "pk", "node"),
    ("console/fleet/pools/", "pk", "pool"),
    ("console/fleet/join-tokens/", "pk", "join_token"),
    ("v1/files/", "file_id", "file"),
    ("v1/batches/", "batch_id", "batch"),
]


def _kind(route: str, name: str) -> str:
    for prefix, parameter, kind in KINDS:
        if route.startswith(prefix) and name == parameter:
            return kind
    raise AssertionError(f"{route}: what does its parameter {name!r} name? Add it to KINDS.")


def object_routes() -> list[str]:
    routes = [r for r in routes_of(get_resolver().url_patterns) if PARAMETER.search(r) and ".*" not in r]
    return [r for r in routes if not r.startswith(NOT_OBJECT_ROUTES)]


def seed_organisation(organization) -> dict[str, str]:
    """One object of each kind in `organization`; their ids by kind."""
    owner = UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    actor = Actor(user=owner)
    endpoint = EndpointFactory(organization=organization)
    adapter = Adapter.objects.create(endpoint=endpoint, name="lora", source="hf:org/lora")
    credential = make_credential(organization)
    key = create_api_key(actor, organization, name="theirs", scopes=[Scope.MANAGE, Scope.INFERENCE]).api_key
    member = MembershipFactory(organization=organization, role=Role.MEMBER)
    invitation = Invitation.objects.create(
        organization=organization,
        email="invited@example.test",
        invited_by=owner,
        expires_at=timezone.now() + timedelta(days=7),
    )
    event = record_audit(actor, organization, "endpoint.create", endpoint)
    input_file = File.objects.create(
        organization_id=organization.pk,
        purpose="batch",
        filename="in.jsonl",
        bytes=1,
        s3_key=f"files/{uuid.uuid4().hex}",
    )
    batch = Batch.objects.create(
        organization_id=organization.pk,
        endpoint=endpoint,
        request_path="/v1/chat/completions",
        input_file=input_file,
        status=BatchStatus.IN_PROGRESS,
        num_total=3,
        expires_at=timezone.now() + timedelta(hours=24),
    )
    return {
        "endpoint": str(endpoint.pk),
        "adapter": str(adapter.pk),
        "credential": str(credential.pk),
        "key": str(key.pk),
        "member": str(member.pk),
        "invitation": str(invitation.pk),
        "audit_event": str(event.pk),
        "file": input_file.pk,
        "batch": batch.pk,
    }


def seed_fleet() -> dict[str, str]:
    """The fleet's objects: nobody's but staff's."""
    pool = NodePool.objects.create(name="pool", gpu_type="l4", provider="local", max_nodes=1)
    node = Node.objects.create(
        name="node", gpu_type="l4", num_gpus=1, secret_lookup="n" * 12, secret_digest="x"
    )
    join_token = JoinToken.objects.create(name="token", lookup="j" * 12, digest="x")
    return {"pool": str(pool.pk), "node": str(node.pk), "join_token": str(join_token.pk)}


NOWHERE = {
    "endpoint": str(uuid.uuid4()),
    "adapter": str(uuid.uuid4()),
    "credential": str(uuid.uuid4()),
    "key": "987654321",
    "member": "987654321",
    "invitation": "987654321",
    "audit_event": "987654321",
    "file": "file-nosuchfile0000000000000",
    "batch": "batch_nosuchbatch00000000000",
    "pool": "987654321",
    "node": str(uuid.uuid4()),
    "join_token": "987654321",
}


def state_of(organization) -> list:
    """What a caller from elsewhere must never change."""
    return [
        list(
            Endpoint.objects.filter(organization=organization).values_list(
                "pk", "deleted_at", "paused_at", "max_replicas", "name"
            )
        ),
        list(Adapter.objects.filter(endpoint__organization=organization).values_list("pk", "name")),
        list(
            ModelCredential.objects.filter(organization=organization).values_list("pk", "name", "updated_at")
        ),
        list(ApiKey.objects.filter(organization=organization).values_list("pk", "revoked_at", "name")),
        list(Membership.objects.filter(organization=organization).values_list("pk", "role").order_by("pk")),
        list(
            Invitation.objects.filter(organization=organization).values_list(
                "pk", "revoked_at", "accepted_at"
            )
        ),
        list(
            Batch.objects.filter(organization_id=organization.pk).values_list("pk", "status", "cancelling_at")
        ),
        list(File.objects.filter(organization_id=organization.pk).values_list("pk", "deleted_at")),
    ]


def caller_of(organization, role: str, *, with_key: bool) -> APIClient:
    """A client of `organization` with `role`: signed in (a session), or with an API key of both scopes."""
    user = UserFactory()
    membership = MembershipFactory(organization=organization, user=user, role=Role.OWNER)
    plain = create_api_key(
        Actor(user=user), organization, name=f"{role} key", scopes=[Scope.MANAGE, Scope.INFERENCE]
    ).plain
    membership.role = role  # NOTE: a key acts with its creator's current role
    membership.save(update_fields=["role"])
    client = APIClient(raise_request_exception=False)
    if with_key:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {plain}")
    else:
        client.force_login(user)
        session = client.session
        session[SESSION_KEY] = organization.pk
        session.save()
    return client


def _answer(client, method: str, path: str, ids: dict[str, str]) -> tuple[int, str]:
    """The status, and a JSON body with the ids asked for written as their kind (a 404 may name what it did not find).

    NOTE: an HTML page differs from one answer to the next (its CSRF token): only its status is compared."""
    response = getattr(client, method)(path, {}, format="json") if method != "get" else client.get(path)
    if not response.get("Content-Type", "").startswith("application/json"):
        return response.status_code, ""
    body = response.content.decode()
    for kind, value in ids.items():
        body = body.replace(value, f"<{kind}>") if len(value) > 8 else body
    return response.status_code, body


def test_the_routes_read_from_the_urlconf_include_every_object_kind():
    kinds = {
        _kind(route, (m.group("angle") or m.group("group")))
        for route in object_routes()
        for m in PARAMETER.finditer(route)
    }
    assert kinds == set(NOWHERE)


# NOTE: transactional: `/v1` looks a key up in a worker thread, on its own connection, which sees only what is
# committed. In a test's transaction the key was unknown there: every `/v1` route answered 401 for both ids (and the
# key, refused, answered 401 from then on), so the comparison said nothing of `/v1/files` and `/v1/batches`.
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("with_key", [False, True], ids=["signed in", "with a key"])
@pytest.mark.parametrize("role", Role.values)
def test_another_organisations_object_answers_as_an_id_that_matches_nothing_on_every_route(
    settings, role, with_key
):
    settings.DEBUG = False
    theirs = OrganizationFactory()
    their_ids = seed_organisation(theirs) | seed_fleet()
    ours = OrganizationFactory()
    seed_organisation(ours)
    client = caller_of(ours, role, with_key=with_key)
    if with_key:
        # the key is one `/v1` knows: a viewer's is refused for its role (403), never as unknown (401)
        assert client.get("/v1/files").status_code == (403 if role == Role.VIEWER else 200)
    before = state_of(theirs)
    differences, leaks = {}, {}

    # NOTE: the console takes no API key (a key's call is sent to the log-in page, whatever the id).
    for route in (
        object_routes() if not with_key else [r for r in object_routes() if not r.startswith("console/")]
    ):
        for method in METHODS:
            foreign = _answer(client, method, concrete_path(route, their_ids), their_ids)
            nowhere = _answer(client, method, concrete_path(route, NOWHERE), NOWHERE)
            if foreign != nowhere:
                differences[f"{method.upper()} {route}"] = (foreign, nowhere)
            if 200 <= foreign[0] < 300 or foreign[0] >= 500:
                leaks[f"{method.upper()} {route}"] = foreign[0]

    assert leaks == {}
    assert differences == {}
    assert state_of(theirs) == before
