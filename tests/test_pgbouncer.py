"""The control plane behind PgBouncer in transaction mode, where each transaction may run on another
server connection: the API, a `select_for_update` reconcile and Celery task bodies work through a real
`pgbouncer` (Debian's; tests/run.sh installs it) with `DATABASE_POOLER=transaction`'s database
settings, and the code keeps no session state a pooler would leak or lose."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import psycopg
import pytest
from django.db import OperationalError, connection, connections

from billing import tasks as billing_tasks
from billing.quota import rebuild
from endpoints import autoscaler, scheduler
from endpoints.models import Endpoint
from tests.conftest import REPO_ROOT
from tests.processes import ChildProcess, free_port, wait_until

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
SERVER_CONNECTIONS = 2  # fewer than the clients below: transactions share server connections
PROJECT_PACKAGES = ("controlplane", "endpoints", "billing")
# Session-level constructs that break (or leak into other clients) behind a transaction-mode pooler.
SESSION_STATE = {
    "a session advisory lock": re.compile(r"pg_(try_)?advisory_lock(_shared)?\s*\(", re.I),
    "LISTEN/NOTIFY": re.compile(r"""["'](LISTEN|NOTIFY|UNLISTEN)\s""", re.I),
    "a temporary table": re.compile(r"CREATE\s+(GLOBAL\s+|LOCAL\s+)?TEMP(ORARY)?\s+TABLE", re.I),
    "a session SET": re.compile(r"""["']\s*SET\s+(?!LOCAL\b)(SESSION\s+)?\w+"""),  # SQL is upper case here
    "a prepared statement": re.compile(r"""["']\s*(PREPARE|DEALLOCATE)\s"""),
    "a held cursor": re.compile(r"WITH\s+HOLD|withhold\s*=\s*True", re.I),
}


def test_the_code_keeps_no_session_state_a_transaction_pooler_would_break():
    found = []
    for package in PROJECT_PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            text = path.read_text()
            found += [f"{path.relative_to(REPO_ROOT)}: {what}" for what, pattern in SESSION_STATE.items()
                      if pattern.search(text)]
    assert not found, found


def test_the_rollup_lock_is_transaction_scoped():
    assert "pg_advisory_xact_lock(" in (REPO_ROOT / "billing" / "rollups.py").read_text()


@pytest.fixture(scope="module")
def pgbouncer(django_db_setup) -> int:
    """PgBouncer in transaction mode in front of the test database; yields its port."""
    if not os.path.exists(PGBOUNCER):
        pytest.skip("pgbouncer is not installed (tests/run.sh installs Debian's package)")
    database = connection.settings_dict
    # NOTE: not under pytest's tmp folder, which only root may enter: pgbouncer may run as another user.
    folder = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
    port = free_port()
    server = f"host={database['HOST'] or '127.0.0.1'}" + (f" port={database['PORT']}" if database["PORT"] else "")
    (folder / "pgbouncer.ini").write_text(f"""
[databases]
{database["NAME"]} = {server} dbname={database["NAME"]} user={database["USER"] or "postgres"}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = any
pool_mode = transaction
default_pool_size = {SERVER_CONNECTIONS}
max_client_conn = 200
ignore_startup_parameters = extra_float_digits,options
""")
    args = [PGBOUNCER, str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:  # pgbouncer refuses to run as root: run it as the database's owner
        owner = os.stat(database["HOST"]).st_uid if database["HOST"].startswith("/") else pwd.getpwnam("nobody").pw_uid
        shutil.chown(folder, user=owner)
        for path in folder.iterdir():
            shutil.chown(path, user=owner)
        args[1:1] = ["-u", pwd.getpwuid(owner).pw_name]
    bouncer = ChildProcess(args, {}, folder / "pgbouncer.log")
    try:
        wait_until(lambda: _answers(port, database), 30, interval_s=0.2, message="pgbouncer to accept connections")
        yield port
    finally:
        bouncer.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _answers(port: int, database: dict) -> bool:
    try:
        with psycopg.connect(host="127.0.0.1", port=port, dbname=database["NAME"], user="postgres",
                             connect_timeout=2) as probe:
            return probe.execute("SELECT 1").fetchone() == (1,)
    except psycopg.OperationalError:
        return False


@pytest.fixture
def through_pgbouncer(pgbouncer, transactional_db, settings):
    """The default database connection goes through PgBouncer, with DATABASE_POOLER=transaction's settings."""
    default = connections["default"]
    saved = {key: default.settings_dict.get(key) for key in ("HOST", "PORT", "OPTIONS", "DISABLE_SERVER_SIDE_CURSORS")}
    default.close()
    default.settings_dict.update(HOST="127.0.0.1", PORT=str(pgbouncer), OPTIONS={**saved["OPTIONS"], "prepare_threshold": None},
                                 DISABLE_SERVER_SIDE_CURSORS=True)
    try:
        yield pgbouncer
    finally:
        default.close()
        default.settings_dict.update(saved)


def test_the_api_a_locked_reconcile_and_task_bodies_work_through_pgbouncer_in_transaction_mode(
        through_pgbouncer, org, member_client_factory):
    client = member_client_factory(org)
    connection.ensure_connection()
    assert connection.connection.info.port == through_pgbouncer  # really through PgBouncer
    key = client.post("/api/v1/keys/", {"name": "ci", "scopes": ["inference"]}, format="json")
    assert key.status_code == 201, key.content
    created = client.post("/api/v1/endpoints/", {"name": "llama-chat", "model_source": "hf:meta-llama/Llama-3.1-8B-Instruct",
                                                 "gpu_type": "l4", "min_replicas": 1}, format="json")
    assert created.status_code == 201, created.content
    endpoint_id = created.json()["id"]
    assert client.post(f"/api/v1/endpoints/{endpoint_id}/pause/").status_code == 200
    assert client.post(f"/api/v1/endpoints/{endpoint_id}/resume/").status_code == 200
    # select_for_update(skip_locked=True) and the organisation's row lock, in one transaction
    decision = scheduler.reconcile_endpoint(endpoint_id, autoscaler.Load(0, 0, None, 0))
    assert decision is not None and decision.desired == 1
    assert "waiting for capacity" in Endpoint.objects.get(pk=endpoint_id).status_message  # no GPU node here
    # task bodies: a sweep that iterates every organisation, a rollup under its advisory lock
    assert billing_tasks.sweep_expired_reservations() == 0
    assert isinstance(billing_tasks.rollup_usage(), dict)
    assert client.get("/api/v1/endpoints/").status_code == 200


def test_a_rebuilds_deadline_leaves_no_statement_timeout_on_a_pooled_server_connection(through_pgbouncer):
    # A rebuild's reads are given the time left to its window (`SET LOCAL statement_timeout`), those outside a
    # transaction in one of their own: a timeout set for the session would stay on the server connection, and cancel
    # another client's statement that PgBouncer runs on it.
    seen = []

    def client(number: int) -> None:
        try:
            if number % 2 == 0:
                with rebuild._until(time.monotonic() + 0.1), connection.cursor() as cursor:
                    try:
                        cursor.execute("SELECT pg_sleep(0.5)")  # autocommit: in a transaction of its own
                    except OperationalError:
                        seen.append("cancelled")
            for _ in range(5):
                with connection.cursor() as cursor:
                    cursor.execute("SHOW statement_timeout")
                    seen.append(cursor.fetchone()[0])
                    cursor.execute("SELECT pg_sleep(0.15)")  # cancelled, if a 100 ms timeout were left
        except Exception as exc:  # any error is the finding
            seen.append(repr(exc))
        finally:
            connections.close_all()

    clients = [threading.Thread(target=client, args=(number,)) for number in range(6)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    assert sorted(set(seen)) == ["0", "cancelled"], seen
    assert seen.count("cancelled") == 3
