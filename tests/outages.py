"""Breaking PostgreSQL and Redis under a running test, as an operator's infrastructure would."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

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
    # NOTE: opened before connections are refused: a test that had not read the database yet (its own session not
    # open) failed to open it here, once the database refused it
    connection.ensure_connection()
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


def _relay(source: socket.socket, sink: socket.socket, held: Callable[[], bool]) -> None:
    """Relay `source`'s bytes to `sink` until either end closes; while `held()`, the bytes read are held back (a
    blackhole: nothing relayed, nothing closed)."""
    while True:
        try:
            data = source.recv(65536)
        except OSError:
            return
        if not data:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
            return
        while held():
            time.sleep(0.05)
        try:
            sink.sendall(data)
        except OSError:
            return


def _end_sessions(sockets: list[socket.socket]) -> None:
    for relayed in sockets:
        with contextlib.suppress(OSError):
            relayed.shutdown(socket.SHUT_RDWR)
        relayed.close()


class StallableSocketProxy:
    """A proxy on a Unix socket of its own in front of PostgreSQL's: `stall()` blackholes every session open through it
    now (no byte relayed either way, nothing closed: a partition, a failover that sent no RST), while sessions opened
    after relay normally. `url` is a `DATABASE_URL` through it."""

    def __init__(self, directory: Path):
        database = settings.DATABASES["default"]
        host, port = database["HOST"], database["PORT"] or "5432"
        assert host.startswith("/"), f"the test PostgreSQL listens on a Unix socket, not {host!r}"
        directory.mkdir(parents=True, exist_ok=True)
        self.upstream = f"{host}/.s.PGSQL.{port}"
        self.url = (
            f"postgresql://{database['USER'] or 'postgres'}@/{database['NAME']}?host={directory}&port={port}"
        )
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(str(directory / f".s.PGSQL.{port}"))
        self.server.listen(64)
        self.sockets: list[socket.socket] = []
        self.num_sessions = 0
        self.num_stalled = 0  # sessions numbered below it are blackholed
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(self.upstream)
            self.sockets += [client, upstream]
            session = self.num_sessions
            self.num_sessions += 1
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._relay, args=(source, sink, session), daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket, session: int) -> None:
        _relay(source, sink, lambda: session < self.num_stalled)

    def stall(self) -> None:
        self.num_stalled = self.num_sessions

    def close(self) -> None:
        """Stop listening and end every session through it (PostgreSQL's end of a stalled one too)."""
        self.num_stalled = 0
        self.server.close()
        _end_sessions(self.sockets)


class BlackholingRedisProxy:
    """A TCP proxy in front of the test Redis: `blackhole()` makes it a socket that accepts and never answers (every
    session open now and every one opened later: no byte relayed either way, nothing closed, as a partition or a
    dead load balancer that sends no RST), `heal()` relays sessions opened after it normally again (those open during
    the blackhole stay silent, as a partition's do). `url` is a `REDIS_URL` through it."""

    def __init__(self):
        redis_url = urlparse(settings.REDIS_URL)
        self.upstream = (redis_url.hostname or "127.0.0.1", redis_url.port or 6379)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.server.getsockname()[1]}{redis_url.path}"
        self.sockets: list[socket.socket] = []
        self.num_sessions = 0
        self.blackholed: set[int] = set()  # sessions whose bytes are held for good
        self.blackholing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            session = self.num_sessions
            self.num_sessions += 1
            self.sockets.append(client)
            if self.blackholing:
                self.blackholed.add(session)
                continue  # accepted, never answered
            upstream = socket.create_connection(self.upstream)
            self.sockets.append(upstream)
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._relay, args=(source, sink, session), daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket, session: int) -> None:
        _relay(source, sink, lambda: session in self.blackholed)

    def blackhole(self) -> None:
        self.blackholing = True
        self.blackholed.update(range(self.num_sessions))

    def heal(self) -> None:
        self.blackholing = False

    def close(self) -> None:
        self.blackholed.clear()
        self.server.close()
        _end_sessions(self.sockets)
