"""The web process's PostgreSQL connections come from a pool (`controlplane.database_pool`): requests reuse a few open
connections instead of each opening its own, a connection PostgreSQL cut is replaced before a request gets it, a
request that fails mid-transaction hands its connection back clean, and a request that finds every connection taken
is refused with a 503 soon instead of waiting."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path

import httpx
import psycopg
import pytest
from asgiref.sync import sync_to_async
from django.db import connection, connections

from tests.conftest import PRODUCTION_WEB_ENV, start_web_server, wait_until
from tests.fork_server import ForkServer
from tests.outages import StallableSocketProxy, database_refusing_connections, terminate_backends
from tests.web_callers import (
    bogus_node_secret,
    heartbeat_with_a_bogus_secret,
    registered_agent,
    signed_in_owner,
)

pytestmark = pytest.mark.django_db(transaction=True)

REPO_ROOT = Path(__file__).resolve().parent.parent

POOL_MAX_SIZE = 3
POOL_ENV = {"DATABASE_POOL_MIN_SIZE": "1", "DATABASE_POOL_MAX_SIZE": str(POOL_MAX_SIZE)}
NUM_REQUESTS = 30


def sessions_opened() -> int:
    """Sessions PostgreSQL has started on the test database so far (each a backend forked for a connect)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT sessions FROM pg_stat_database WHERE datname = current_database()")
        return cursor.fetchone()[0]


def sessions_in(state: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = %s "
            "AND pid <> pg_backend_pid()",
            [state],
        )
        return cursor.fetchone()[0]


def sessions_waiting_for_a_lock() -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return [row[0] for row in cursor.fetchall()]


def table_locked_by_another_session(model) -> psycopg.Connection:
    """A session of its own holding `model`'s table locked (ACCESS EXCLUSIVE: no read gets past) until closed."""
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    holder = psycopg.connect(**params)
    holder.execute(f'LOCK TABLE "{model._meta.db_table}" IN ACCESS EXCLUSIVE MODE')
    return holder


@pytest.fixture
def pooled_web(tmp_path, web_zygote):
    child, base_url = start_web_server(tmp_path, extra_env=POOL_ENV, zygote=web_zygote)
    yield base_url
    child.stop()


def test_sequential_console_api_and_agent_requests_open_no_more_connections_than_the_pool_holds(
    pooled_web, client, owner_client
):
    """Before, each request's thread opened a connection of its own (a PostgreSQL backend forked, authenticated, closed
    as the request ended): 30 requests opened 30 sessions and more."""
    cookies, endpoint = signed_in_owner(client)
    secret, beat = registered_agent(pooled_web, join_token_name="pool")
    opened_before = sessions_opened()

    for _ in range(NUM_REQUESTS // 3):
        with httpx.Client(base_url=pooled_web, cookies=cookies) as browser:
            assert browser.get(f"/console/endpoints/{endpoint.pk}/").status_code == 200
        listed = httpx.get(
            f"{pooled_web}/api/v1/endpoints/", headers={"authorization": f"Bearer {owner_client.plain_key}"}
        )
        assert listed.status_code == 200, listed.text
        answer = httpx.post(
            f"{pooled_web}/agent/v1/heartbeat", json=beat, headers={"authorization": f"Bearer {secret}"}
        )
        assert answer.status_code == 200, answer.text

    assert sessions_opened() - opened_before <= POOL_MAX_SIZE


def test_after_postgresql_cuts_every_session_the_next_requests_are_answered(pooled_web, owner_client):
    """The pool checks a connection before it hands it out (`CONN_HEALTH_CHECKS`): one PostgreSQL cut (a restart, a
    failover, an idle timeout) is replaced, so not even the first request after the cut fails."""
    headers = {"authorization": f"Bearer {owner_client.plain_key}"}
    for _ in range(POOL_MAX_SIZE):
        assert httpx.get(f"{pooled_web}/api/v1/endpoints/", headers=headers).status_code == 200

    assert terminate_backends() >= 1

    statuses = [httpx.get(f"{pooled_web}/api/v1/endpoints/", headers=headers).status_code for _ in range(10)]
    assert statuses == [200] * 10


def test_after_postgresql_cuts_every_idle_pooled_connection_readiness_api_console_and_agent_are_answered_at_once(
    tmp_path, client, owner_client
):
    """A failover or a restart cuts every session at once, the pool's idle ones included. Before, psycopg_pool checked
    the stale idle connections one by one inside the request that asked for one and slept after each failed check (~1 s,
    then 2 s, 4 s...): `/readyz`'s 2 s database check timed out (the pod left the load balancer) and the next requests
    waited seconds. Now the first failed check drops every idle connection and the request gets a fresh one."""
    pool_size = 4
    child, web = start_web_server(
        tmp_path,
        extra_env={"DATABASE_POOL_MIN_SIZE": str(pool_size), "DATABASE_POOL_MAX_SIZE": str(pool_size)},
    )
    headers = {"authorization": f"Bearer {owner_client.plain_key}"}
    cookies, endpoint = signed_in_owner(client)
    try:
        secret, beat = registered_agent(web, join_token_name="cut")
        assert httpx.get(f"{web}/api/v1/endpoints/", headers=headers).status_code == 200
        wait_until(
            lambda: sessions_in("idle") >= pool_size, 20, message="the pool's connections to be open and idle"
        )

        assert terminate_backends() >= pool_size

        ready = httpx.get(f"{web}/readyz", timeout=30)
        listed = [httpx.get(f"{web}/api/v1/endpoints/", headers=headers, timeout=30) for _ in range(3)]
        with httpx.Client(base_url=web, cookies=cookies, timeout=30) as browser:
            page = browser.get(f"/console/endpoints/{endpoint.pk}/")
        beaten = httpx.post(
            f"{web}/agent/v1/heartbeat", json=beat, headers={"authorization": f"Bearer {secret}"}
        )
    finally:
        child.stop()

    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"]["database"] == "ok"
    assert [answer.status_code for answer in listed] == [200] * 3
    assert page.status_code == 200
    assert beaten.status_code == 200, beaten.text


def test_a_request_that_fails_mid_transaction_hands_its_connection_back_clean(pooled_web, owner_client):
    """A key's creation (its row and its audit event, one transaction) cancelled by PostgreSQL half-way: the request
    fails, and its connection goes back to the pool rolled back, never left idle in its transaction."""
    from controlplane.accounts.models import AuditEvent

    headers = {"authorization": f"Bearer {owner_client.plain_key}"}
    holder = table_locked_by_another_session(AuditEvent)
    answers = []
    creating = threading.Thread(
        target=lambda: answers.append(
            httpx.post(
                f"{pooled_web}/api/v1/keys/",
                json={"name": "half-way", "scopes": ["inference"]},
                headers=headers,
                timeout=30,
            )
        )
    )
    creating.start()
    try:
        wait_until(
            lambda: sessions_waiting_for_a_lock(),
            20,
            message="the key's creation to wait for the audit table",
        )
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_cancel_backend(%s)", [sessions_waiting_for_a_lock()[0]])
    finally:
        holder.close()  # NOTE: at once: the debug error page reads the tables its frames' querysets name
        creating.join(30)
    assert answers and answers[0].status_code == 500

    assert sessions_in("idle in transaction") == 0
    assert sessions_in("idle in transaction (aborted)") == 0
    listed = httpx.get(f"{pooled_web}/api/v1/keys/", headers=headers)
    assert listed.status_code == 200
    assert "half-way" not in listed.text  # rolled back


def test_a_request_that_finds_every_pooled_connection_taken_gets_a_503_soon(tmp_path, owner_client):
    """Before, every request opened a connection of its own, however many were open: a request behind a stuck one
    waited with it (here until the client gave up), and a burst could take PostgreSQL's `max_connections`."""
    from endpoints.models import Endpoint

    child, web = start_web_server(
        tmp_path,
        extra_env=PRODUCTION_WEB_ENV
        | {"DATABASE_POOL_MIN_SIZE": "1", "DATABASE_POOL_MAX_SIZE": "1", "DATABASE_POOL_TIMEOUT_S": "1"},
    )
    headers = {"authorization": f"Bearer {owner_client.plain_key}"}
    holder = table_locked_by_another_session(Endpoint)
    answers = []
    stuck = threading.Thread(
        target=lambda: answers.append(httpx.get(f"{web}/api/v1/endpoints/", headers=headers, timeout=30))
    )
    stuck.start()
    try:
        wait_until(
            lambda: sessions_waiting_for_a_lock(),
            20,
            message="the first request to hold the pool's connection",
        )
        refused = httpx.get(f"{web}/api/v1/endpoints/", headers=headers, timeout=10)
        agent_refused = heartbeat_with_a_bogus_secret(web, timeout=10)
    finally:
        holder.close()
        stuck.join(30)
        child.stop()

    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert refused.json() == {"detail": "The database is busy or unavailable: try again shortly."}
    # the agent API's own error shape, as its other errors (`endpoints.fleet.api`)
    assert agent_refused.status_code == 503
    assert agent_refused.json() == {
        "error": {"message": "The database is busy or unavailable: try again shortly."}
    }
    assert answers[0].status_code == 200


def _database_settings_of(*cases: tuple[str, dict[str, str]]) -> list[str]:
    """For each `(entry, env)`, the default database's pool options, `CONN_MAX_AGE`, the pool's connection arguments and
    `ENGINE` as a process started through `entry` (a module imported first) sees them, with production's settings and
    `env`. NOTE: one process per case, forked from one that imported only the dependencies (`tests.fork_server`): a
    fresh interpreter each (~1.5 s of CPU apiece, five in a test) spent most of its time importing them again."""
    script = (
        "import importlib, sys\n"
        "importlib.import_module(sys.argv[1])\n"
        "import django\n"
        "django.setup()\n"
        "from django.db import connection\n"
        "pool = connection.pool\n"
        "print(repr((connection.settings_dict['OPTIONS'].get('pool'), connection.settings_dict['CONN_MAX_AGE'], "
        "pool and pool.kwargs.get('prepare_threshold', 'unset'), connection.settings_dict['ENGINE'])))\n"
    )
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DJANGO_SETTINGS_MODULE", "DJANGO_DEBUG"} and not k.startswith("DATABASE_POOL")
    }
    production = {k: v for k, v in PRODUCTION_WEB_ENV.items() if k != "SECURE_SSL_REDIRECT"} | {
        "DATABASE_URL": "postgresql://u:p@db.internal:5432/inferplane",
        "REDIS_URL": "redis://redis.internal:6379/0",
    }
    forks = ForkServer(clean, REPO_ROOT)
    try:
        results = [
            forks.run(["-c", script, entry], cwd=REPO_ROOT, timeout=120,
                      env=clean | production | env | {"DJANGO_SETTINGS_MODULE": "controlplane.settings"})
            for entry, env in cases
        ]
    finally:
        forks.stop()
    for (entry, _), result in zip(cases, results, strict=True):
        assert result.returncode == 0, f"{entry}: {result.stderr}"
        assert len(result.stdout.strip().splitlines()) == 1, result.stdout
    return [result.stdout.strip() for result in results]


def test_only_the_web_process_pools_its_connections_and_only_when_opted_in():
    """A Celery prefork worker forks its children, and a pool must never be shared across a fork; beat and
    `manage.py` keep `CONN_MAX_AGE` too. The web process's pool is off by default (a burst of slow requests starved
    the agent API, below); opted in, it goes through the backend that checks its connections
    (`controlplane.database_pool.base`)."""
    pool = "{'name': 'web', 'min_size': 2, 'max_size': 4, 'max_idle': 300.0, 'timeout': 5.0, 'reconnect_timeout': 0.0}"
    pooled = f"({pool}, 0, None, 'controlplane.database_pool')"
    unpooled = "(None, 60, None, 'django.db.backends.postgresql')"
    assert _database_settings_of(
        ("controlplane.asgi", {}),
        ("controlplane.asgi", {"DATABASE_POOL_MAX_SIZE": "4"}),
        ("controlplane.celery_app", {}),
        ("os", {"DATABASE_POOL_MAX_SIZE": "5"}),
        ("controlplane.asgi", {"DATABASE_POOL_MAX_SIZE": "0"}),
    ) == [unpooled, pooled, unpooled, unpooled, unpooled]


def test_behind_pgbouncer_in_transaction_mode_the_pools_connections_prepare_no_statements():
    [settings_seen] = _database_settings_of(
        ("controlplane.asgi", {"DATABASE_POOLER": "transaction", "DATABASE_POOL_MAX_SIZE": "4"})
    )
    assert settings_seen.startswith("({'name': 'web'")
    # prepare_threshold None, not psycopg's default of 5
    assert settings_seen.endswith(", 0, None, 'controlplane.database_pool')")


def test_bogus_node_secrets_on_watch_take_no_pooled_connection_from_other_requests(tmp_path, owner_client):
    """Before, `/agent/v1/watch` looked a secret up on the event loop's default executor and never closed the thread's
    connection: each of its long-lived threads kept one pooled connection for good, and after a few rounds of bogus
    secrets (no credentials needed) the pool was theirs and the management API answered 503."""
    child, web = start_web_server(
        tmp_path,
        extra_env=PRODUCTION_WEB_ENV
        | {
            "DATABASE_POOL_MIN_SIZE": "1",
            "DATABASE_POOL_MAX_SIZE": str(POOL_MAX_SIZE),
            "DATABASE_POOL_TIMEOUT_S": "1",
        },
    )
    headers = {"authorization": f"Bearer {owner_client.plain_key}"}

    def watch_with_a_bogus_secret(_) -> int:
        return httpx.post(
            f"{web}/agent/v1/watch", headers={"authorization": f"Bearer {bogus_node_secret()}"}, timeout=10
        ).status_code

    try:
        refusals = []
        # NOTE: in rounds, the server idle between them: a steady stream pinned fewer threads
        for _ in range(4):
            with ThreadPoolExecutor(4) as clients:
                refusals += clients.map(watch_with_a_bogus_secret, range(8))
            time.sleep(0.5)
        listed = [
            httpx.get(f"{web}/api/v1/endpoints/", headers=headers, timeout=10).status_code for _ in range(3)
        ]
    finally:
        child.stop()

    assert set(refusals) == {401}
    assert listed == [200] * 3


def test_after_postgresql_comes_back_the_first_request_is_answered_at_once(tmp_path, owner_client):
    """Before, psycopg_pool retried a failed connect in the background with a backoff (1 s, doubling) and started no
    other meanwhile (its tries 1, 3, 7, 15 s after the first): after a 10 s outage `/api/` kept failing for seconds after
    PostgreSQL took connections again (6 s after a 20 s outage). Now a failed connect is given up at once and the next
    request tries again."""
    # NOTE: 10 s down: with psycopg_pool's backoff back (`RECONNECT_TIMEOUT_S` 300) the first 200 came 1.7 to 3.8 s
    # after PostgreSQL was back (four runs), past the bound below; after 4 s down it came 0.3 to 1.3 s after (one run in
    # three failed), after 5 or 6 s within 0.5 s: a shorter outage lets the backoff's next try land just after it.
    child, web = start_web_server(tmp_path, extra_env=POOL_ENV | {"DATABASE_POOL_TIMEOUT_S": "1"})
    headers = {"authorization": f"Bearer {owner_client.plain_key}"}
    try:
        assert httpx.get(f"{web}/api/v1/endpoints/", headers=headers).status_code == 200
        with database_refusing_connections():
            down_until = time.monotonic() + 10
            # requests meanwhile: each fails, and the pool tries to connect
            while time.monotonic() < down_until:
                assert httpx.get(f"{web}/api/v1/endpoints/", headers=headers, timeout=30).status_code >= 500
        back_at = time.monotonic()
        statuses = []
        while 200 not in statuses:
            statuses.append(httpx.get(f"{web}/api/v1/endpoints/", headers=headers, timeout=30).status_code)
            answered_s = time.monotonic() - back_at
            assert answered_s < 1.0, f"{statuses}: no 200 {answered_s:.1f} s after PostgreSQL was back"
    finally:
        child.stop()


def test_a_replays_count_in_the_quota_counters_leaves_no_connection_open_behind_it():
    """Before, the usage writer ran `count_superseded` (and `count_replayed`) through asgiref's one process-wide thread
    (no request's context there) and left that thread's connection open: in the web process, one pooled connection
    checked out for good after a replay."""
    from billing import usage_writer

    def open_on_asgirefs_one_thread() -> bool:
        return connections["default"].connection is not None

    asyncio.run(sync_to_async(connections.close_all)())
    assert not asyncio.run(sync_to_async(open_on_asgirefs_one_thread)())

    asyncio.run(usage_writer._count_superseded({"req-superseded": Decimal("0.10")}))

    assert not asyncio.run(sync_to_async(open_on_asgirefs_one_thread)())


def test_a_pool_one_web_pods_processes_could_fill_past_max_connections_is_warned_of(settings, monkeypatch):
    """`migrate` (and `check --database default`) runs the project's database checks: (max_size + its ledger writer)
    x `WEB_CONCURRENCY` against what PostgreSQL allows its clients (the test server's `max_connections`: 100)."""
    from django.core import checks

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('max_connections')::int - current_setting('superuser_reserved_connections')::int"
        )
        num_allowed = cursor.fetchone()[0]
    monkeypatch.setenv("WEB_CONCURRENCY", "2")

    def warned() -> list[str]:
        return [
            message.msg
            for message in checks.run_checks(databases=["default"])
            if message.id == "inferplane.W001"
        ]

    settings.DATABASE_POOL_MAX_SIZE = 4  # the size the shipped manifests are sized for, opted in
    assert warned() == []
    settings.DATABASE_POOL_MAX_SIZE = num_allowed // 2
    assert warned() == [
        f"One web pod may hold {2 * (num_allowed // 2 + 1)} PostgreSQL connections (WEB_CONCURRENCY=2 processes x "
        f"(DATABASE_POOL_MAX_SIZE={num_allowed // 2} + 1 ledger writer)), more than the {num_allowed} PostgreSQL "
        "allows clients (max_connections less superuser_reserved_connections)."
    ]
    settings.DATABASE_POOL_MAX_SIZE = 0  # no pool
    assert warned() == []


def _during_a_burst_of_slow_api_requests(
    tmp_path, owner_client, env: dict
) -> tuple[httpx.Response, httpx.Response]:
    """`/readyz` and an agent's heartbeat (a bogus secret: 401 once its lookup gets a connection) while 6 management-API
    requests wait on a lock another session holds (as they would on a slow PostgreSQL)."""
    from endpoints.models import Endpoint

    child, web = start_web_server(tmp_path, extra_env=env)
    headers = {"authorization": f"Bearer {owner_client.plain_key}"}
    holder = table_locked_by_another_session(Endpoint)
    burst = [
        threading.Thread(target=lambda: httpx.get(f"{web}/api/v1/endpoints/", headers=headers, timeout=60))
        for _ in range(6)
    ]
    try:
        for request in burst:
            request.start()
        wait_until(
            lambda: len(sessions_waiting_for_a_lock()) >= 4, 20, message="the burst to wait on the lock"
        )
        ready = httpx.get(f"{web}/readyz", timeout=10)
        beaten = heartbeat_with_a_bogus_secret(web, timeout=10)
    finally:
        holder.close()
        for request in burst:
            request.join(60)
        child.stop()
    return ready, beaten


def test_by_default_a_burst_of_slow_api_requests_leaves_the_pod_ready_and_the_agent_api_answered(
    tmp_path, owner_client
):
    """Before, the pool was on by default (4 connections): the burst held all 4, `/readyz` answered 503 after 5 s (the
    kubelet's probe gives up then: every pod out of the load balancer at once) and agents' heartbeats got 503."""
    ready, beaten = _during_a_burst_of_slow_api_requests(tmp_path, owner_client, PRODUCTION_WEB_ENV)

    assert ready.status_code == 200, ready.text
    assert beaten.status_code == 401, beaten.text  # the secret refused, not the database busy


def test_with_the_pool_on_a_burst_of_slow_requests_that_holds_every_connection_leaves_the_pod_ready(
    tmp_path, owner_client
):
    """`/readyz` checks PostgreSQL on a connection of its own, never a pooled one. Before, it waited for a pooled
    connection (its 2 s `wait_for` did not stop the thread) and answered 503 after the pool's 5 s. The agent API still
    shares the pool (why it is off by default)."""
    ready, _ = _during_a_burst_of_slow_api_requests(
        tmp_path, owner_client, PRODUCTION_WEB_ENV | {"DATABASE_POOL_MAX_SIZE": "4"}
    )

    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"]["database"] == "ok"


def test_a_pooled_session_that_stalls_is_cut_and_replaced_instead_of_hanging_the_requests_handed_it(
    tmp_path, owner_client
):
    """A partition or a failover with no RST: the pool's sessions go silent. Before, the pool's check of a connection
    (an empty query) waited on it with no deadline: every request handed one hung (here until the client gave up),
    while `/readyz` stayed 200. Now the check is cut after 2 s, the pool drops its idle connections and connects anew."""
    proxy = StallableSocketProxy(tmp_path / "sock")
    child, web = start_web_server(
        tmp_path,
        extra_env=PRODUCTION_WEB_ENV | POOL_ENV | {"DATABASE_URL": proxy.url, "DATABASE_POOL_TIMEOUT_S": "2"},
    )
    headers = {"authorization": f"Bearer {owner_client.plain_key}"}
    try:
        for _ in range(3):
            assert httpx.get(f"{web}/api/v1/endpoints/", headers=headers, timeout=10).status_code == 200
        proxy.stall()
        listed = [httpx.get(f"{web}/api/v1/endpoints/", headers=headers, timeout=20) for _ in range(3)]
        ready = httpx.get(f"{web}/readyz", timeout=10)
    finally:
        child.stop()
        proxy.close()

    assert [answer.status_code for answer in listed] == [200] * 3
    assert ready.status_code == 200, ready.text
