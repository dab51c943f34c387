"""A batch run's lease check never waits behind its stores on the run's few database threads
(`INFERPLANE_BATCH_DB_SESSIONS`), and a read of free slots that keeps failing gives up as an outage does."""

from __future__ import annotations

import json
import time

import httpx
import psycopg
import pytest
from django.db import OperationalError, connection

from controlplane.accounts.models import Organization
from endpoints.batches import runner, services
from endpoints.batches.models import Batch
from tests.batches.conftest import new_batch, one_chat_line, run_in_a_thread
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


def _lines(endpoint, num_lines: int, max_tokens: int) -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens},
    }).encode() + b"\n" for i in range(num_lines))


def _timed_checks(monkeypatch) -> list[float]:
    """How long each of the run's lease checks took, from its call to its answer."""
    waits: list[float] = []
    through_outages = runner._through_outages

    def timed(keep_going):
        check = through_outages(keep_going)

        async def timed_check(progress):
            started = time.monotonic()
            try:
                return await check(progress)
            finally:
                waits.append(time.monotonic() - started)
        return timed_check

    monkeypatch.setattr(runner, "_through_outages", timed)
    return waits


def test_stores_waiting_for_their_organisations_row_never_hold_up_the_lease_check(
        files_bucket, tenant, start_mock_upstream, settings, monkeypatch, caplog):
    # NOTE: before, the lease check queued behind two stores blocked on the organisation's row (both threads of the
    # default 2): it waited 7 s, and a lease of 3 s lapsed while lines were in flight
    settings.BATCH_LEASE_S = 3.0
    upstream = start_mock_upstream(token_delay_ms=100)
    endpoint = serve_endpoint(tenant.org, upstream, target_concurrency=4)
    batch = new_batch(endpoint, _lines(endpoint, 8, 10))  # 8 lines, 4 at a time, ~1 s each
    waits = _timed_checks(monkeypatch)
    params = connection.get_connection_params()
    locker = psycopg.connect(**{k: v for k, v in params.items() if k not in ("context", "cursor_factory")})
    lapsed = False
    try:
        worker, runs = run_in_a_thread(batch.pk)
        deadline = time.monotonic() + 60
        while httpx.get(f"{upstream}/_stats").json()["num_requests"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        locker.execute(f"SELECT 1 FROM {Organization._meta.db_table} WHERE id = %s FOR NO KEY UPDATE",
                       [tenant.org.pk])  # another run's store, holding it for 8 s
        held_until = time.monotonic() + 8
        while time.monotonic() < held_until:
            lapsed = lapsed or Batch.objects.filter(pk=batch.pk).filter(services._lease_lapsed()).exists()
            time.sleep(0.1)
        locker.rollback()
        worker.join(timeout=120)
    finally:
        locker.close()
    assert not worker.is_alive()
    assert not lapsed, f"the lease lapsed while the row was held (longest check {max(waits):.1f} s)"
    assert max(waits) < 1.5, f"a lease check took {max(waits):.1f} s"
    assert runs == ["ran"]
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 8  # no line ran twice
    # a store gave up on the lock after `STORE_LOCK_WAIT_S` (55P03), and was stored again once the row was free
    assert any("could not be stored yet" in record.getMessage() and "lock timeout" in record.getMessage()
               for record in caplog.records)
    batch.refresh_from_db()
    assert (batch.num_completed, batch.num_failed) == (8, 0)


def test_a_read_of_free_slots_that_keeps_failing_gives_up_though_the_lease_checks_succeed(
        files_bucket, tenant, start_mock_upstream, settings, monkeypatch):
    # NOTE: before, each failed read (a statement timeout: not an outage the checks meet) started the give-up's clock
    # again, and each successful check cleared it: the run spun for its whole slice, a warning every 0.4 s
    settings.BATCH_OUTAGE_RETRY_S = 2.0
    upstream = start_mock_upstream(token_delay_ms=100)
    endpoint = serve_endpoint(tenant.org, upstream)
    batch = new_batch(endpoint, one_chat_line(endpoint, 4))
    state = {"reads": 0, "fail": True}
    free_slots = runner.free_slots

    async def failing(*args, **kwargs):
        state["reads"] += 1
        if state["reads"] > 1 and state["fail"]:  # the first: `run_batch`'s own, before the run
            raise OperationalError("canceling statement due to statement timeout")
        return await free_slots(*args, **kwargs)

    monkeypatch.setattr(runner, "free_slots", failing)
    waits = _timed_checks(monkeypatch)
    worker, runs = run_in_a_thread(batch.pk)
    worker.join(timeout=15)
    gave_up = not worker.is_alive()
    state["fail"] = False
    worker.join(timeout=60)
    assert gave_up, f"still running after 15 s: {len(waits)} lease checks, {state['reads']} reads"
    assert runs == ["outage"]
    assert state["reads"] <= 12, f"{state['reads']} reads in the give-up's 2 s"
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 0
