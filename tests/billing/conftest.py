"""Billing fixtures: usage reports, a fake Stripe wired into settings."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from billing.ledger import UsageReport
from tests.fakes.stripe_server import FakeStripe

_request_ids = itertools.count(1)


def usage_report(endpoint, *, api_key=None, finished_at: datetime | None = None, prompt_tokens=100, cached_tokens=0,
                 completion_tokens=50, status="ok", request_id: str | None = None) -> UsageReport:
    finished_at = finished_at or timezone.now()
    return UsageReport(
        request_id=request_id or f"req-{next(_request_ids)}-{timezone.now().timestamp()}",
        organization_id=endpoint.organization_id,
        api_key_id=api_key.pk if api_key is not None else None,
        endpoint_id=str(endpoint.pk),
        replica_id="replica-1",
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=completion_tokens,
        started_at=finished_at - timedelta(seconds=2),
        first_token_at=finished_at - timedelta(seconds=1),
        finished_at=finished_at,
        status=status,
        cold_start_s=0.0,
    )


@pytest.fixture(autouse=True)
def _close_thread_connections(request, django_db_blocker):
    """Async code reaches the database from worker threads whose connections outlive the test;
    end them, so that the test database can be flushed and dropped."""
    yield
    marker = request.node.get_closest_marker("django_db")
    if marker is None or not marker.kwargs.get("transaction"):
        return
    from django.db import connection

    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")


@pytest.fixture
def fake_stripe(settings):
    fake = FakeStripe().start()
    settings.STRIPE_SECRET_KEY = "sk_test_inferplane"
    settings.STRIPE_API_BASE = fake.base_url
    # NOTE: generous: an ordinary call never times out, so call counts are exact; an injected
    # timeout costs this long (the fake holds its answer until the client hangs up).
    settings.STRIPE_TIMEOUT_S = 3.0
    settings.STRIPE_RETRY_BASE_DELAY_S = 0.01
    settings.STRIPE_WEBHOOK_SECRET = "whsec_test_secret"
    yield fake
    fake.stop()
