"""The management API's OpenAPI schema (`/api/schema/`) is public, leaves out the staff-only views, and is built
once per process: fetching it costs the web process no schema generation."""

from __future__ import annotations

import pytest
import yaml
from django.test import Client
from drf_spectacular.generators import SchemaGenerator

from controlplane import schema_view

pytestmark = pytest.mark.django_db


@pytest.fixture
def fresh_schema():
    schema_view.forget_schema()
    yield
    schema_view.forget_schema()


def test_the_public_schema_leaves_out_the_staff_only_pools(fresh_schema):
    """Before, anyone read the staff-only `/api/v1/fleet/pools/` routes in the public schema, which the routes
    themselves hide with a 404 as if they did not exist."""
    response = Client().get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    paths = response.json()["paths"]
    assert "/api/v1/endpoints/" in paths and "/api/v1/keys/" in paths
    assert not [path for path in paths if "/fleet/" in path]
    assert "NodePool" not in response.content.decode()


def test_the_api_root_lists_no_route_and_so_not_the_staff_only_pools(owner_client, settings):
    """`/api/v1/` was DRF's root view, in no schema, which listed every registered route to any key, the staff-only
    `fleet/pools` (a 404 to everyone else, as if it did not exist) included."""
    settings.DEBUG = False

    response = owner_client.get("/api/v1/")

    assert response.status_code == 404 and response.json() == {"detail": "Not found."}
    assert owner_client.get("/api/v1/endpoints/").status_code == 200


def test_the_schema_is_built_once_whatever_is_asked(fresh_schema, monkeypatch):
    """Before, every fetch built the schema again (about a second of CPU), and `?version=` or `?lang=` could not be
    cached: anyone could keep the web processes busy."""
    builds = []
    build = SchemaGenerator.get_schema
    monkeypatch.setattr(SchemaGenerator, "get_schema", lambda *args, **kwargs: builds.append(1) or build(*args, **kwargs))
    client = Client()
    as_json = client.get("/api/schema/", HTTP_ACCEPT="application/json")
    again = client.get("/api/schema/", {"format": "json", "version": "v9", "lang": "fr"})
    as_yaml = client.get("/api/schema/")
    assert as_json.status_code == again.status_code == as_yaml.status_code == 200
    assert len(builds) == 1
    assert as_json.json() == again.json() == yaml.safe_load(as_yaml.content)
    assert as_json["Content-Type"] == "application/json"
    assert again["Content-Type"] == "application/vnd.oai.openapi+json"
    assert as_yaml["Content-Type"] == "application/vnd.oai.openapi; charset=utf-8"
    assert Client().get("/api/docs/").status_code == 200
