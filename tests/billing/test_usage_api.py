"""`GET /api/v1/usage/` and its CSV export: groupings, date ranges, tenancy."""

import csv
import dataclasses
import io
from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing.ledger import record_usage
from billing.models import UsageRecord
from controlplane.accounts.models import ApiKey, Role
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory, OrganizationFactory

pytestmark = pytest.mark.django_db

COLD_START_PHASES = {"queue": 100, "placement": 400, "download": 1500, "engine": 1800, "first_token": 200}


def _day(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(hour=12, tzinfo=timezone.get_current_timezone())


@pytest.fixture
def usage(owner_client):
    organization = owner_client.organization
    key = ApiKey.objects.get(created_by=owner_client.user)
    chat = EndpointFactory(organization=organization, name="chat", price_input_per_million=Decimal("1"),
                           price_cached_input_per_million=Decimal("0.5"), price_output_per_million=Decimal("2"))
    code = EndpointFactory(organization=organization, name="code", price_input_per_million=Decimal("1"),
                           price_cached_input_per_million=Decimal("0.5"), price_output_per_million=Decimal("2"))
    record_usage(usage_report(chat, api_key=key, finished_at=_day("2026-03-01"), prompt_tokens=1000, cached_tokens=200, completion_tokens=100))
    record_usage(dataclasses.replace(
        usage_report(chat, api_key=key, finished_at=_day("2026-03-02"), prompt_tokens=500, completion_tokens=50),
        cold_start_ms=4000, cold_start_phases=COLD_START_PHASES))
    record_usage(usage_report(code, finished_at=_day("2026-03-02"), prompt_tokens=10, completion_tokens=1, status="client_aborted"))
    record_usage(usage_report(code, finished_at=_day("2026-04-01"), prompt_tokens=7, completion_tokens=7))
    return {"key": key, "chat": chat, "code": code}


def _get(client, **params):
    return client.get("/api/v1/usage/", {"start": "2026-03-01", "end": "2026-03-31", **params})


def test_usage_by_endpoint_counts_requests_tokens_and_cost(owner_client, usage):
    response = _get(owner_client, group_by="endpoint")

    assert response.status_code == 200
    assert response.json() == {"results": [
        # 800 × $1 + 200 × $0.5 + 100 × $2 per million, then 500 × $1 + 50 × $2
        {"endpoint": "chat", "requests": 2, "prompt_tokens": 1500, "cached_tokens": 200, "completion_tokens": 150, "cost": "0.0017",
         "cold_starts": 1, "cold_start_ms": 4000},
        {"endpoint": "code", "requests": 1, "prompt_tokens": 10, "cached_tokens": 0, "completion_tokens": 1, "cost": "0.000012",
         "cold_starts": 0, "cold_start_ms": 0},
    ]}


def test_usage_by_day_splits_at_midnight_utc_and_honours_the_range(owner_client, usage):
    results = _get(owner_client, group_by="day", start="2026-03-02", end="2026-04-01").json()["results"]

    assert [(row["day"], row["requests"]) for row in results] == [("2026-03-02", 2), ("2026-04-01", 1)]


def test_usage_by_key_names_the_key_and_keeps_keyless_usage_apart(owner_client, usage):
    results = _get(owner_client, group_by="key").json()["results"]

    by_key = {row["key"]: row["requests"] for row in results}
    assert by_key == {usage["key"].display_prefix: 2, None: 1}


@pytest.mark.parametrize("params, field", [
    ({"group_by": "model"}, "group_by"),
    ({"start": "03/01/2026"}, "start"),
    ({"end": "2026-02-30"}, "end"),
    ({"start": "2026-04-01", "end": "2026-03-01"}, "start"),
    ({"start": "2020-01-01", "end": "2026-03-01"}, "start"),
])
def test_a_bad_grouping_or_date_is_a_400_with_field_errors(owner_client, params, field):
    response = _get(owner_client, **params)

    assert response.status_code == 400
    assert field in response.json()


def test_another_organisation_sees_none_of_this_usage(usage, member_client_factory):
    stranger = member_client_factory(OrganizationFactory(), Role.OWNER)

    assert _get(stranger, group_by="endpoint").json() == {"results": []}


def test_a_viewer_may_read_usage(usage, owner_client, member_client_factory):
    viewer = member_client_factory(owner_client.organization, Role.VIEWER)
    assert _get(viewer).status_code == 200


def test_the_csv_export_has_the_same_rows_as_the_api(owner_client, usage):
    response = owner_client.get("/api/v1/usage/export.csv", {"group_by": "endpoint", "start": "2026-03-01", "end": "2026-03-31"})

    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(r["endpoint"], r["requests"], r["cost"]) for r in rows] == [("chat", "2", "0.0017"), ("code", "1", "0.000012")]


def test_the_default_range_is_this_month(owner_client):
    endpoint = EndpointFactory(organization=owner_client.organization)
    record_usage(usage_report(endpoint, finished_at=timezone.now()))
    record_usage(usage_report(endpoint, finished_at=timezone.now() - timedelta(days=40)))

    assert owner_client.get("/api/v1/usage/").json()["results"][0]["requests"] == 1


def test_a_cold_start_reaches_the_usage_row_and_the_csv_with_its_phases(owner_client, usage):
    row = UsageRecord.objects.get(endpoint=usage["chat"], cold_start_ms__isnull=False)
    assert row.cold_start_ms == 4000 and row.cold_start_phases == COLD_START_PHASES

    response = owner_client.get("/api/v1/usage/export.csv", {"group_by": "endpoint", "start": "2026-03-01", "end": "2026-03-31"})
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(r["endpoint"], r["cold_starts"], r["cold_start_ms"]) for r in rows] == [("chat", "1", "4000"), ("code", "0", "0")]


@pytest.mark.parametrize("accept", ["text/csv", "text/csv, application/json"])
def test_the_csv_export_answers_a_client_that_asks_for_csv(owner_client, usage, accept):
    """A client generated from the schema asks for the documented `text/csv` (openapi-generator sends `Accept: text/csv`
    for this operation). Before, DRF found no renderer for it and answered 406, in no schema, with no CSV."""
    response = owner_client.get("/api/v1/usage/export.csv", {"group_by": "endpoint", "start": "2026-03-01",
                                                             "end": "2026-03-31"}, HTTP_ACCEPT=accept)

    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(r["endpoint"], r["requests"]) for r in rows] == [("chat", "2"), ("code", "1")]


def test_a_bad_csv_export_request_from_a_csv_client_is_still_a_400_with_field_errors(owner_client):
    response = owner_client.get("/api/v1/usage/export.csv", {"group_by": "nothing"}, HTTP_ACCEPT="text/csv")

    assert response.status_code == 400 and "group_by" in response.json()
