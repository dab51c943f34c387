"""Cost truth per endpoint and its recent cold starts, in the API and on the endpoint page: numbers
on known usage rows; the platform's margin (GPU-seconds used against billed) only ever for staff."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from billing.models import UsageRecord
from endpoints.models import Replica
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory, OrganizationFactory, sign_in_staff

pytestmark = pytest.mark.django_db

DAY = datetime(2026, 3, 2, 10, 0, tzinfo=UTC)
RANGE = "?start=2026-03-01&end=2026-03-03"


def usage(endpoint, n, *, prompt, cached, completion, cost, ttft_ms, generating_ms, **extra):
    started = DAY + timedelta(minutes=n)
    first = started + timedelta(milliseconds=ttft_ms)
    return UsageRecord.objects.create(
        request_id=f"req-{endpoint.pk}-{n}", organization=endpoint.organization, endpoint=endpoint,
        prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion, cost=Decimal(cost),
        started_at=started, first_token_at=first, finished_at=first + timedelta(milliseconds=generating_ms),
        status="ok", **extra)


@pytest.fixture
def endpoint(org):
    endpoint = EndpointFactory(organization=org, name="truth")
    usage(endpoint, 1, prompt=100, cached=50, completion=100, cost="0.000300", ttft_ms=100, generating_ms=1000)
    usage(endpoint, 2, prompt=100, cached=0, completion=300, cost="0.000500", ttft_ms=300, generating_ms=2000,
          cold_start_ms=4000, cold_start_phases={"queue": 500, "placement": 500, "download": 1000, "engine": 1700,
                                                 "first_token": 300})
    Replica.objects.create(endpoint=endpoint, state=ReplicaState.STOPPED, gpu_indices=[0, 1],
                           created_at=DAY.replace(hour=0), stopped_at=DAY.replace(hour=1))
    return endpoint


def test_the_stats_api_gives_each_days_ttft_speed_cache_hits_and_cost_per_million(endpoint, owner_client):
    response = owner_client.get(f"/api/v1/endpoints/{endpoint.pk}/stats/{RANGE}")
    assert response.status_code == 200
    [day] = response.json()["results"]
    assert day["day"] == "2026-03-02" and day["requests"] == 2
    assert (day["ttft_p50_ms"], day["ttft_p95_ms"]) == (200, 290)
    assert day["output_tokens_per_s"] == pytest.approx(133.33)
    assert day["prefix_cache_hit_rate"] == 0.25
    assert Decimal(day["cost_per_million_tokens"]) == Decimal("1.333333")
    assert "gpu_seconds_used" not in day and "gpu_seconds_billed" not in day


def test_staff_see_the_gpu_seconds_used_against_billed_in_a_staff_session_and_not_with_a_key(endpoint, owner_client):
    owner_client.user.is_staff = True
    owner_client.user.save(update_fields=["is_staff"])
    session = APIClient()
    sign_in_staff(session, owner_client.user)

    [day] = session.get(f"/api/v1/endpoints/{endpoint.pk}/stats/{RANGE}").json()["results"]
    assert day["gpu_seconds_used"] == 7200.0  # two GPUs for an hour
    assert day["gpu_seconds_billed"] == pytest.approx(3.4)  # 1.1 s + 2.3 s of requests
    # NOTE: staff powers come with a session that passed the second factor, never with a key.
    [by_key] = owner_client.get(f"/api/v1/endpoints/{endpoint.pk}/stats/{RANGE}").json()["results"]
    assert "gpu_seconds_used" not in by_key


def test_a_bad_range_is_a_400_with_field_errors(endpoint, owner_client):
    response = owner_client.get(f"/api/v1/endpoints/{endpoint.pk}/stats/?start=2026-03-05&end=2026-03-01")
    assert response.status_code == 400 and "start" in response.json()
    assert owner_client.get(f"/api/v1/endpoints/{endpoint.pk}/stats/?start=tomorrow").status_code == 400


def test_another_organisations_endpoint_has_no_stats(endpoint, member_client_factory):
    stranger = member_client_factory(OrganizationFactory())
    assert stranger.get(f"/api/v1/endpoints/{endpoint.pk}/stats/").status_code == 404
    assert stranger.get(f"/api/v1/endpoints/{endpoint.pk}/cold-starts/").status_code == 404


def test_the_cold_starts_api_lists_recent_cold_starts_by_phase(endpoint, owner_client):
    [cold] = owner_client.get(f"/api/v1/endpoints/{endpoint.pk}/cold-starts/").json()["results"]
    assert cold["cold_start_ms"] == 4000
    assert cold["phases"] == {"queue": 500, "placement": 500, "download": 1000, "engine": 1700, "wake": 0, "first_token": 300}


def test_the_openapi_schema_documents_stats_and_cold_starts(owner_client):
    schema = owner_client.get("/api/schema/").content.decode()
    assert "/api/v1/endpoints/{id}/stats/" in schema and "ttft_p95_ms" in schema
    assert "/api/v1/endpoints/{id}/cold-starts/" in schema


def test_the_endpoint_page_shows_cost_truth_and_a_cold_start_chart_but_no_margin_to_members(endpoint, owner, monkeypatch):
    monkeypatch.setattr("endpoints.stats.DEFAULT_DAYS", 10_000)  # the known rows are in the past
    page = owner.get(reverse("console:endpoint", args=[endpoint.pk])).content.decode()
    assert "Cost truth" in page and "2026-03-02" in page and "200 / 290" in page and "25%" in page
    assert "Recent cold starts" in page and "4000 ms" in page and 'class="phase-download"' in page
    assert "GPU-s used" not in page


def test_staff_see_the_margin_on_the_endpoint_page(endpoint, console_client_factory, monkeypatch):
    monkeypatch.setattr("endpoints.stats.DEFAULT_DAYS", 10_000)
    staff = console_client_factory(endpoint.organization, is_staff=True)
    page = staff.get(reverse("console:endpoint", args=[endpoint.pk])).content.decode()
    assert "GPU-s used / billed (staff)" in page and "7200.0 / 3.4" in page
