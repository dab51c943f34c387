"""A batch run whose PostgreSQL sessions go silent (a partition, a failover with no RST, a proxy that stops relaying
without closing): its checks and stores go on over fresh sessions within seconds, its lines run once."""

from __future__ import annotations

import time

import httpx
import pytest
from django.db import connection

from billing.models import UsageRecord
from endpoints.batches.models import Batch, BatchStatus
from tests.batches.conftest import new_batch, one_chat_line, run_in_a_thread
from tests.gateway.conftest import serve_endpoint
from tests.outages import StallableSocketProxy

pytestmark = pytest.mark.django_db(transaction=True)

NUM_LINES = 2
NUM_TOKENS = 8


def test_a_run_whose_sessions_stall_goes_on_over_fresh_ones_and_runs_each_line_once(
    files_bucket, tenant, start_mock_upstream, monkeypatch, tmp_path
):
    # NOTE: a session kept between the run's calls was checked first with a `SELECT 1` that had no deadline: behind a
    # proxy that stopped relaying (its kernel still acknowledging every byte, so no TCP timeout ever fired) the lease
    # check waited for good, the run's loop with it: no answer stored, the lease left to lapse (another run then runs
    # every line again), the worker held until its task's time limit.
    upstream = start_mock_upstream(token_delay_ms=500)  # a line answers in ~4 s
    endpoint = serve_endpoint(tenant.org, upstream, target_concurrency=1)
    batch = new_batch(endpoint, b"".join(
        one_chat_line(endpoint, NUM_TOKENS).replace(b'"only"', f'"c{index}"'.encode()) for index in range(NUM_LINES)))
    proxy = StallableSocketProxy(tmp_path / "pg")
    connection.ensure_connection()  # the test's own session, not through the proxy
    # every session opened from now on (the run's) goes through the proxy
    monkeypatch.setitem(connection.settings_dict, "HOST", str(tmp_path / "pg"))

    def num_engine_requests() -> int:
        return httpx.get(f"{upstream}/_stats").json()["num_requests"]

    try:
        worker, runs = run_in_a_thread(batch.pk)
        deadline = time.monotonic() + 60
        while num_engine_requests() < 1:
            assert time.monotonic() < deadline, "the first line never started"
            time.sleep(0.05)
        time.sleep(1.5)  # its lease checked over the sessions it keeps
        proxy.stall()  # those sessions go silent; sessions opened after relay as before
        worker.join(timeout=40)
        hung = worker.is_alive()
    finally:
        proxy.close()  # NOTE: ends a stalled session's wait, so a run that hung ends too
    worker.join(timeout=60)
    assert not hung, "the run waited on a silent session"
    assert runs == ["ran"]
    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, NUM_LINES, 0)
    assert num_engine_requests() == NUM_LINES, "each line ran once"
    assert UsageRecord.objects.filter(batch_id=batch.pk).count() == NUM_LINES
