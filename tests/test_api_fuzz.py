"""Schemathesis fuzzes every operation of the management API's own OpenAPI schema (`/api/schema/`).

For each operation it generates valid and invalid requests (bodies, query strings, path parameters)
and sends them, with the owner key of one of two organisations or signed in as its owner (a session cookie and
a CSRF token, as the console and Swagger UI call), to the Django application itself
(WSGI, in this process, on the real test database: each operation starts from the same seeded data
and its writes are rolled back). Every answer must be no server error, carry a status code and a
content type the schema documents for that operation and the headers it documents as required, and
match the documented body; the same call without credentials, or with made-up ones, must be refused
(Schemathesis's `ignored_auth`). Path parameters are often the ids of real objects, of the caller's
organisation or of the other one, whose objects must stay invisible (a 404).

Bounded and reproducible: `FUZZ_EXAMPLES` examples per operation, derandomised.
"""

from __future__ import annotations

import os
from datetime import timedelta
from decimal import Decimal

import pytest
import schemathesis
from django.conf import settings as django_settings
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.test import Client
from django.utils import timezone
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import ignored_auth, not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from billing.credits import grant_credits
from billing.ledger import record_usage
from billing.models import Invoice, InvoiceLine
from controlplane.accounts.keys import create_api_key, revoke_api_key
from controlplane.accounts.models import Role, Scope
from controlplane.accounts.services import Actor
from endpoints import services as endpoint_services
from endpoints.events import record_event
from endpoints.models import EventKind, Replica
from endpoints.nodes.models import Node
from gpu_agent.protocol import NodeState, ReplicaState
from tests.billing.conftest import usage_report
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory
from tests.fakes.stripe_server import FakeStripe

FUZZ_EXAMPLES = int(os.environ.get("INFERPLANE_FUZZ_EXAMPLES", "15"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]

# NOTE: loaded from the application as it serves it (Django is set up before collection; serving
# the schema reads no database).
schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application())

# The ids of the seeded objects, per kind of path parameter; the current test fills it.
SEEDED: dict[str, list] = {}


def _seed_organisation(label: str) -> dict:
    organization = OrganizationFactory(name=f"Fuzz {label}")
    owner = UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    actor = Actor(user=owner)
    key = create_api_key(actor, organization, name=f"{label} owner", scopes=[Scope.MANAGE, Scope.INFERENCE])
    other_key = create_api_key(actor, organization, name=f"{label} spare", scopes=[Scope.INFERENCE])
    revoked = create_api_key(actor, organization, name=f"{label} old", scopes=[Scope.INFERENCE])
    revoke_api_key(actor, revoked.api_key)
    admin = MembershipFactory(organization=organization, role=Role.ADMIN)
    viewer = MembershipFactory(organization=organization, role=Role.VIEWER)
    endpoint = endpoint_services.create_endpoint(
        actor, organization, name=f"fuzz-{label.lower()}", model_source="hf:meta-llama/Llama-3.1-8B-Instruct",
        gpu_type="l4",
    )
    paused = endpoint_services.create_endpoint(
        actor, organization, name=f"fuzz-{label.lower()}-paused", model_source="hf:meta-llama/Llama-3.1-8B-Instruct",
        gpu_type="l4",
    )
    endpoint_services.pause_endpoint(actor, paused)
    node = Node.objects.create(name=f"fuzz-node-{label}", gpu_type="l4", num_gpus=1, gpu_memory_mb=24_000,
                               secret_lookup=f"fuzz{label}".ljust(12, "0"), secret_digest="x", state=NodeState.READY,
                               quantizations=["none"], last_heartbeat_at=timezone.now())
    ready = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY, address="http://127.0.0.1:9",
                                   ready_at=timezone.now())
    Replica.objects.create(endpoint=endpoint, state=ReplicaState.PENDING)  # not placed yet: no node
    record_event(endpoint, EventKind.REPLICA, "Replica ready.", replica=ready)
    record_usage(usage_report(endpoint, api_key=key.api_key))
    record_usage(usage_report(endpoint, finished_at=timezone.now() - timedelta(days=1)))
    grant_credits(actor, organization, amount=Decimal("5"), note="welcome")
    invoice = Invoice.objects.create(organization=organization, stripe_invoice_id=f"in_fuzz_{label}", status="paid",
                                     amount_due=950, number="INV-1")
    InvoiceLine.objects.create(invoice=invoice, stripe_line_id="il_1", description="Output tokens", quantity=5, amount=950)
    session = Client()
    session.force_login(owner)
    return {
        "secret": key.plain,
        "session": session.cookies[django_settings.SESSION_COOKIE_NAME].value,
        "endpoint": [str(endpoint.pk), str(paused.pk)],
        # NOTE: not the key the fuzz calls with: an example that revoked it left every later example of the operation a
        # 401, and the cross-tenant check failed on one (80 examples).
        "key": [other_key.api_key.pk, revoked.api_key.pk],
        "member": [admin.pk, viewer.pk, organization.memberships.get(user=owner).pk],
    }


@pytest.fixture
def seeded(db, settings):
    # As in production: no debug pages (every 404 and 500 is the application's own answer), and
    # Stripe (the local fake) configured, so that the billing portal answers.
    settings.DEBUG = False
    stripe = FakeStripe().start()
    settings.STRIPE_SECRET_KEY = "sk_test_inferplane"
    settings.STRIPE_API_BASE = stripe.base_url
    # NOTE: as Django's test client does: requests must not close the test's transaction.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    organisations = {"a": _seed_organisation("A"), "b": _seed_organisation("B")}
    SEEDED.clear()
    SEEDED.update({kind: [i for o in organisations.values() for i in o[kind]] for kind in ("endpoint", "key", "member")})
    yield organisations
    stripe.stop()
    SEEDED.clear()
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


def _kind_of_path(path: str) -> str | None:
    for kind, prefix in (("endpoint", "/api/v1/endpoints/"), ("key", "/api/v1/keys/"),
                         ("key", "/api/v1/billing/keys/"), ("member", "/api/v1/members/")):
        if path.startswith(prefix):
            return kind
    return None


@schema.hook
def flatmap_path_parameters(context, path_parameters):
    """Half the time, the id of a real object (either organisation's) instead of a generated one."""
    kind = _kind_of_path(context.operation.path)
    if kind is None or not SEEDED.get(kind) or not path_parameters:
        return st.just(path_parameters)
    name = next(iter(path_parameters))
    real = st.sampled_from(SEEDED[kind]).map(lambda value: path_parameters | {name: value})
    return st.one_of(st.just(path_parameters), real)


# A made-up CSRF secret, sent as the cookie and the header, as the console's pages do with theirs.
CSRF_SECRET = "fuzz" * 8


def _sign(case, organisation: dict, credential: str) -> dict:
    """The headers of a call with the owner's API key, or `case` signed in as the owner (the console, Swagger UI)."""
    if credential == "key":
        return {"Authorization": f"Bearer {organisation['secret']}"}
    # NOTE: the case's cookies, not a Cookie header: Schemathesis fills them with a made-up `sessionid` (the schema's
    # cookieAuth), which replaced the header's; and no generated `Authorization` beside them (a malformed one is a 401
    # whatever the session).
    case.cookies = {django_settings.SESSION_COOKIE_NAME: organisation["session"],
                    django_settings.CSRF_COOKIE_NAME: CSRF_SECRET}
    case.headers = {name: value for name, value in (case.headers or {}).items() if name.lower() != "authorization"}
    return {"X-CSRFToken": CSRF_SECRET}


@schema.parametrize()
@schema.given(caller=st.sampled_from(["a", "b"]), credential=st.sampled_from(["key", "session"]))
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_every_api_operation_answers_as_its_schema_documents(case, caller, credential, seeded):
    organisation = seeded[caller]
    # NOTE: `ignored_auth` on key calls alone: it takes the case's generated cookie for the credential, and reads the
    # real session put in its place as a made-up one accepted.
    checks = CHECKS + [ignored_auth] if credential == "key" else CHECKS
    response = case.call_and_validate(headers=_sign(case, organisation, credential), checks=checks)
    kind = _kind_of_path(case.operation.path)
    theirs = {str(i) for name, o in seeded.items() if name != caller and kind for i in o[kind]}
    if theirs & {str(value) for value in (case.path_parameters or {}).values()}:
        assert response.status_code in (400, 404), f"another organisation's object must stay invisible: {response.text}"
