"""Breaking PostgreSQL and Redis under a running test, as an operator's infrastructure would."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import psycopg
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection, connections

from controlplane import embedded


def _admin_connection() -> psycopg.Connection:
    params = connection.get_connection_params() | {"dbname": "postgres"}
    params.pop("cursor_factory", None)
    return psycopg.connect(**params, autocommit=True)


def terminate_backends() -> int:
    """Cut every session of the test database but this test's own (as a PostgreSQL restart would)."""
    name = settings.DATABASES["default"]["NAME"]
    with _admin_connection() as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> %s",
            [name, connection.cursor().connection.info.backend_pid],
        ).fetchall()
    # NOTE: this test process's other session (the thread `sync_to_async` runs in) was cut too; drop it
    # so that later tests reconnect instead of finding it dead.
    asyncio.run(sync_to_async(connections.close_all)())
    return len(rows)


@contextlib.contextmanager
def database_refusing_connections():
    """PostgreSQL as a gateway sees it when down: every session cut, no new one accepted (this test's
    own session is kept, so the test can look and put things back)."""
    name = settings.DATABASES["default"]["NAME"]
    with _admin_connection() as admin:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        try:
            terminate_backends()
            yield
        finally:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')


@contextlib.contextmanager
def postgresql_stopped():
    """The embedded PostgreSQL stopped (a fast shutdown: every session cut, every connect refused), then started again
    with its data. This test process's own connections were cut too: dropped, so the test reconnects."""
    embedded.stop_postgres()
    try:
        yield
    finally:
        embedded.ensure_postgres()
        connections.close_all()
        asyncio.run(sync_to_async(connections.close_all)())


def restart_redis() -> None:
    """Stop the embedded Redis and start it again on the same port (its append-only file kept)."""
    embedded.stop_redis()
    embedded.ensure_redis()


@contextlib.contextmanager
def redis_frozen():
    """Redis stopped with SIGSTOP: connections open, nothing answered (a hung or partitioned server)."""
    pid = embedded.redis_pid()
    assert pid is not None, "the embedded Redis is not running"
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def redis_out_of_memory():
    """Redis at its `maxmemory` with `noeviction`: reads answered, every write refused with `-OOM`."""
    from controlplane.redis_client import get_redis

    client = get_redis()
    before = client.config_get("maxmemory")["maxmemory"], client.config_get("maxmemory-policy")["maxmemory-policy"]
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    try:
        yield
    finally:
        client.config_set("maxmemory", before[0])
        client.config_set("maxmemory-policy", before[1])


@contextlib.contextmanager
def database_read_only():
    """PostgreSQL as a demoted primary looks after a failover: sessions accepted, every write refused
    (SQLSTATE 25006, read-only transaction). This test's own session keeps writing."""
    name = settings.DATABASES["default"]["NAME"]
    with _admin_connection() as admin:
        admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        try:
            terminate_backends()  # sessions take the setting when they start
            yield
        finally:
            admin.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
            terminate_backends()
