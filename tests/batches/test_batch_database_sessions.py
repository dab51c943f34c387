"""A batch run leaves no PostgreSQL session of its own open once it has ended, also after an outage it went through:
each held one of the database's `max_connections` until a garbage collection, or for good. And it opens one a thread,
kept across its calls: it opened one a call."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import signal
import threading
import time
from contextlib import contextmanager

import httpx
import psycopg
import pytest
from django.db import connection
from django.db.backends.signals import connection_created

from controlplane.accounts.models import Organization
from controlplane.worker_threads import in_worker_thread, run_briefly
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
                "WHERE datname = current_database() AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
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
    # (a line of ~2 s, not ~4: its lease checks, lookups and store have each of those threads open its session)
    assert _run_a_line(tenant, start_mock_upstream, outage_s=0, num_tokens=4) == ["ran"]
    assert _other_sessions() == []


def test_a_run_keeps_its_connections_across_its_checks_and_stores_and_closes_them_as_it_ends(
    files_bucket, tenant, start_mock_upstream
):
    # NOTE: each of the run's calls closed its connection after it: a run opened a PostgreSQL session per lease check
    # (one a second) and per stored line, 19 for a line of ~8 s where it now opens one a thread (7). A line of ~4 s
    # (8 s before, 4 s more of the suite) still has each of its threads open sessions for several calls that way.
    opened: list[threading.Thread] = []  # the thread of each session opened (kept: an ident may be reused)

    def count(sender, connection, **kwargs) -> None:
        # NOTE: the quota rebuild's own pool closes its connections after each call by design (`in_worker_thread`)
        if not threading.current_thread().name.startswith("quota-rebuild"):
            opened.append(threading.current_thread())

    connection_created.connect(count)
    try:
        assert _run_a_line(tenant, start_mock_upstream, outage_s=0, num_tokens=8) == ["ran"]
    finally:
        connection_created.disconnect(count)
    # NOTE: the task's own thread closes its session while its run goes (`run_briefly`), and opens one again after
    tasks = {thread for thread in opened if thread.name.endswith("(run)")}  # `run_in_a_thread`'s
    assert len(tasks) == 1 and opened.count(*tasks) <= 2
    opened = [thread for thread in opened if thread not in tasks]
    assert len(opened) == len(set(opened)), f"{len(opened)} sessions opened by {len(set(opened))} threads"
    assert _other_sessions() == [], "a session was left open past the run"


def _chat_lines(endpoint, num_lines: int, max_tokens: int) -> bytes:
    return b"".join(
        json.dumps({"custom_id": f"line-{index}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": max_tokens}}).encode() + b"\n"
        for index in range(num_lines))


def _session_pids() -> set[int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                       "AND backend_type = 'client backend'")
        return {row[0] for row in cursor.fetchall()}


def _num_other_sessions_now(mine: set[int]) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        # NOTE: client sessions only: an autovacuum worker on the test database is listed with it too
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND backend_type = 'client backend' AND pid <> ALL(%s)", [sorted(mine)])
        return cursor.fetchone()[0]


def test_a_run_of_many_lines_at_once_holds_no_more_sessions_than_its_bound(
    files_bucket, tenant, start_mock_upstream, settings
):
    # NOTE: each store (and lookup, and lease check) ran on a thread of the loop's default executor, each thread kept
    # its own session till the run ended: a run held up to min(32, CPUs + 4) of them beside its task's, and the batch
    # workers' eight runs took PostgreSQL past its `max_connections` (the whole control plane "too many clients").
    # Here 16 finished lines wait for the organisation's row lock (as behind a busy upload) to store their answers:
    # each such thread held a session (8 in all on two CPUs, its task's and its usage writer's among them).
    num_lines = 16
    upstream = start_mock_upstream(token_delay_ms=100)
    endpoint = serve_endpoint(tenant.org, upstream, target_concurrency=num_lines)
    batch = new_batch(endpoint, _chat_lines(endpoint, num_lines, max_tokens=10))  # each line answers in ~1 s
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        mine = {cursor.fetchone()[0]}
    params = connection.get_connection_params()
    locker = psycopg.connect(**{key: value for key, value in params.items() if key not in ("context", "cursor_factory")})
    mine.add(locker.info.backend_pid)
    # NOTE: and every session there before the run began: none is the run's, and a loaded machine still listed the
    # backend of a connection the set-up had closed (read as the run's fourth: "the run held 4 sessions at once").
    mine |= _session_pids()
    peak = 0
    try:
        worker, runs = run_in_a_thread(batch.pk)
        deadline = time.monotonic() + 60
        while httpx.get(f"{upstream}/_stats").json()["num_requests"] < num_lines:
            assert time.monotonic() < deadline, "the lines never all started"
            time.sleep(0.05)
        locker.execute(f"SELECT 1 FROM {Organization._meta.db_table} WHERE id = %s FOR UPDATE", [tenant.org.pk])
        held_until = time.monotonic() + 4  # the lines finish meanwhile, their stores wait for the lock
        while time.monotonic() < held_until:
            peak = max(peak, _num_other_sessions_now(mine))
            time.sleep(0.05)
        locker.rollback()
        worker.join(timeout=120)
    finally:
        locker.close()
    assert runs == ["ran"]
    batch.refresh_from_db()
    assert (batch.status, batch.num_completed, batch.num_failed) == ("completed", num_lines, 0)
    # the run's database threads, and its usage writer's own connection
    assert peak <= settings.BATCH_DB_SESSIONS + 1, f"the run held {peak} sessions at once"
    assert _other_sessions() == []


class _SoftTimeLimit(Exception):
    """As Celery's `SoftTimeLimitExceeded`: raised in the worker's main thread by a signal, wherever it is."""


@contextmanager
def _soft_time_limits(first_after_s: float, *, then_every_s: float = 0.0):
    """`_SoftTimeLimit` raised in this thread after `first_after_s` (and every `then_every_s` after, if given), as
    Celery's soft time limit is."""

    def raise_soft_limit(signum, frame):
        raise _SoftTimeLimit()

    previous = signal.signal(signal.SIGALRM, raise_soft_limit)
    signal.setitimer(signal.ITIMER_REAL, first_after_s, then_every_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _one_thread_executor() -> None:
    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(1))


def test_a_soft_time_limit_while_a_run_joins_its_threads_lets_a_call_mid_query_finish_and_store():
    # NOTE: the run's end closed every kept connection while a store was still mid-query in its thread: the store
    # failed ("connection socket closed") and its answer was lost
    outcome: list[str] = []

    def quick() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")

    def slow_store() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_sleep(2)")
                cursor.execute("SELECT 1")
            outcome.append("stored")
        except Exception as exc:  # noqa: BLE001 - what the store met is the test's outcome
            outcome.append(f"{type(exc).__name__}: {exc}")

    async def a_run() -> None:
        _one_thread_executor()
        await in_worker_thread(quick)()  # the thread's connection, kept for its next call
        asyncio.ensure_future(in_worker_thread(slow_store)())  # still in its thread as the run ends
        await asyncio.sleep(0.1)
        raise RuntimeError("the run failed (a put S3 refused)")

    with _soft_time_limits(0.8), pytest.raises((RuntimeError, _SoftTimeLimit)):
        run_briefly(a_run())  # the soft limit lands while `asyncio.run` joins the store's thread
    deadline = time.monotonic() + 10
    while not outcome and time.monotonic() < deadline:
        time.sleep(0.05)
    assert outcome == ["stored"]
    assert _other_sessions() == []


def test_a_call_that_ends_after_its_run_closes_its_own_connection():
    # NOTE: a second soft limit during the join ended the run with a call still in its thread; the call then kept its
    # connection in the emptied list, and the session stayed open until a garbage collection
    def slow() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_sleep(2)")

    async def a_run() -> None:
        _one_thread_executor()
        await in_worker_thread(slow)()

    with _soft_time_limits(0.5, then_every_s=0.5), pytest.raises(_SoftTimeLimit):
        run_briefly(a_run())  # one limit during the call, the next while `asyncio.run` joins its thread
    time.sleep(2)  # the call ends in its thread
    assert _other_sessions() == []
