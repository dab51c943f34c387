"""A batch's refusals (`Batch.refused_since`, `last_refused_at`, and `line_concurrency_at`) are stamped by PostgreSQL's
clock, as its window is (`services._on_this_clock`), and judged by it (`demand.read_demand`): runs go to any worker.

Before: each run stamped them by its own worker's clock and the next run, on another worker, went on from them by its
own: a run on a worker 250 s ahead of the one that saw a refusal 100 s before took the streak as 350 s long, past
`scheduling.STALL_S`, and the batch was left out of the demand as stalled (its replicas let go, its endpoint never woken
for its deadline) after 100 s of refusals."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.clock import database_now
from endpoints.batches import services
from endpoints.batches.demand import read_demand
from endpoints.batches.models import Batch, BatchStatus
from tests.batches.conftest import new_batch
from tests.batches.test_batch_engine_failures import _lines, quick_retries  # noqa: F401 - a fixture
from tests.fakes.mock_openai import ENGINE_FAILS_FOR
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_run_on_a_worker_whose_clock_is_ahead_does_not_make_a_short_streak_of_refusals_a_stall(
        files_bucket, tenant, start_mock_upstream, quick_retries, monkeypatch):  # noqa: F811
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    batch = services.validate_batch(new_batch(endpoint, _lines(endpoint, ENGINE_FAILS_FOR)))
    assert batch.status == BatchStatus.IN_PROGRESS
    # a run on a worker whose clock is right saw its line refused from 100 s ago to 10 s ago
    now = database_now()
    Batch.objects.filter(pk=batch.pk).update(refused_since=now - timedelta(seconds=100),
                                             last_refused_at=now - timedelta(seconds=10))
    with monkeypatch.context() as patched:  # the next run's worker, 250 s ahead
        real_time, real_now = time.time, timezone.now
        patched.setattr(time, "time", lambda: real_time() + 250)
        patched.setattr(timezone, "now", lambda: real_now() + timedelta(seconds=250))
        services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.IN_PROGRESS and batch.refused_since is not None
    assert (batch.last_refused_at - batch.refused_since).total_seconds() < 200
    assert str(endpoint.pk) in read_demand([str(endpoint.pk)]), "left out of the demand as stalled"
