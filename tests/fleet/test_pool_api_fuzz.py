"""Schemathesis fuzzes the node pools' API as staff (tests/test_api_fuzz.py fuzzes it as non-staff:
all 404s): valid and invalid pools, templates and periods are answered as the schema documents,
never with a server error."""

from __future__ import annotations

import os

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.test import Client
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from controlplane.accounts.models import Role
from controlplane.accounts.services import Actor
from endpoints.fleet.pool_services import create_node_pool
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, sign_in_staff
from tests.fleet.staff_schema import staff_schema

FUZZ_EXAMPLES = int(os.environ.get("INFERPLANE_FUZZ_EXAMPLES", "15"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]

# The served schema leaves the staff-only pools out; staff's has them.
schema = schemathesis.openapi.from_dict(staff_schema())
schema.app = get_wsgi_application()
schema = schema.include(path_regex="^/api/v1/fleet/pools/")
SEEDED: list[int] = []


CSRF_TOKEN = "a" * 32  # the session's writes need it, cookie and header alike, as the browser's


@pytest.fixture
def staff_session(db, settings):
    """A staff member's session cookie: the pools' API takes no API key (`pool_api.IsStaff`)."""
    settings.DEBUG = False
    user = UserFactory(is_staff=True)
    organization = OrganizationFactory()
    MembershipFactory(organization=organization, user=user, role=Role.OWNER)
    signed_in = Client()
    sign_in_staff(signed_in, user)
    # NOTE: after the sign-in's request: Django's test client connects close_old_connections again after each,
    # and schemathesis's WSGI calls would then close the test's transaction.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    SEEDED[:] = [create_node_pool(Actor(user=user), name=name, gpu_type=gpu, provider=provider, max_nodes=2).pk
                 for name, gpu, provider in (("l4-local", "l4", "local"), ("cpu-local", "cpu", "local"))]
    yield {settings.SESSION_COOKIE_NAME: signed_in.cookies[settings.SESSION_COOKIE_NAME].value,
           settings.CSRF_COOKIE_NAME: CSRF_TOKEN}
    SEEDED.clear()
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@schema.hook
def flatmap_path_parameters(context, path_parameters):
    """Half the time, the id of a real pool instead of a generated one."""
    if not SEEDED or not path_parameters:
        return st.just(path_parameters)
    return st.one_of(st.just(path_parameters), st.sampled_from(SEEDED).map(lambda pk: path_parameters | {"id": pk}))


@schema.parametrize()
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_every_pool_operation_answers_staff_as_its_schema_documents(case, staff_session):
    case.call_and_validate(headers={"X-CSRFToken": CSRF_TOKEN}, cookies=staff_session, checks=CHECKS)
