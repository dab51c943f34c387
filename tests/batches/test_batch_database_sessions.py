"""A batch run leaves no PostgreSQL session of its own open once it has ended, also after an outage it went through:
each held one of the database's `max_connections` until a garbage collection, or for good. And it opens one a thread,
kept across its calls: it opened one a call."""

from __future__ import annotations

import gc
import threading
import time

import httpx
import pytest
from django.db import connection
from django.db.backends.signals import connection_created

from tests.batches.conftest import new_batch, one_chat_line, run_in_a_thread
from tests.gateway.conftest import serve_endpoint
from tests.outages import database_refusing_connections

pytestmark = pytest.mark.django_db(transaction=True)


def _other_sessions() -> list[tuple]:
    """The test database's sessions but this test's own, once those closed have gone (a closed session's backend
    leaves `pg_stat_activity` a moment after its client)."""
    deadline = time.monotonic() + 5
    while True:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pid, left(query, 90) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            rows = cursor.fetchall()
        if not rows or time.monotonic() >= deadline:
            return rows
        time.sleep(0.1)


def _run_a_line(tenant, start_mock_upstream, *, outage_s: float, num_tokens: int = 8) -> object:
    upstream = start_mock_upstream(token_delay_ms=500)  # the line answers in num_tokens / 2 s
    endpoint = serve_endpoint(tenant.org, upstream)
    batch = new_batch(endpoint, one_chat_line(endpoint, num_tokens))
    worker, runs = run_in_a_thread(batch.pk)
    deadline = time.monotonic() + 60
    while httpx.get(f"{upstream}/_stats").json()["num_requests"] < 1:
        assert time.monotonic() < deadline, "the line never started"
        time.sleep(0.05)
    if outage_s:
        with database_refusing_connections():
            time.sleep(outage_s)
    worker.join(timeout=120)
    return runs


def test_a_run_through_an_outage_leaves_no_session_open_once_its_objects_are_collected(
    files_bucket, tenant, start_mock_upstream
):
    # NOTE: the warning logged for the outage kept the exception, whose traceback's frames kept a worker thread's
    # connection (reconnected after the outage) open as long as the record was kept
    # a blip the run rides through (`BATCH_OUTAGE_RETRY_S`), its connections cut by it
    assert _run_a_line(tenant, start_mock_upstream, outage_s=1.5) == ["ran"]
    gc.collect()
    assert _other_sessions() == []


def test_a_run_leaves_no_session_of_its_worker_threads_open(files_bucket, tenant, start_mock_upstream):
    # NOTE: each thread the run's calls ran in (its lease checks, its stores, its lookups) kept its connection open
    # after the run, until a garbage collection found it: three sessions a run, of the database's `max_connections`
    assert _run_a_line(tenant, start_mock_upstream, outage_s=0) == ["ran"]
    assert _other_sessions() == []


def test_a_run_keeps_its_connections_across_its_checks_and_stores_and_closes_them_as_it_ends(
    files_bucket, tenant, start_mock_upstream
):
    # NOTE: each of the run's calls closed its connection after it: a run opened a PostgreSQL session per lease check
    # (one a second) and per stored line, 19 for this line of ~8 s where it now opens one a thread (7)
    opened: list[threading.Thread] = []  # the thread of each session opened (kept: an ident may be reused)

    def count(sender, connection, **kwargs) -> None:
        # NOTE: the quota rebuild's own pool closes its connections after each call by design (`in_worker_thread`)
        if not threading.current_thread().name.startswith("quota-rebuild"):
            opened.append(threading.current_thread())

    connection_created.connect(count)
    try:
        assert _run_a_line(tenant, start_mock_upstream, outage_s=0, num_tokens=16) == ["ran"]
    finally:
        connection_created.disconnect(count)
    assert len(opened) == len(set(opened)), f"{len(opened)} sessions opened by {len(set(opened))} threads"
    assert _other_sessions() == [], "a session was left open past the run"
