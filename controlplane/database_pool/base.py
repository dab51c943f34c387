"""The pooling process's database backend (`ENGINE` "controlplane.database_pool"): Django's PostgreSQL backend whose
pool hands out only connections that answer, and recovers at once after PostgreSQL cut every session.

NOTE: the pool itself checks nothing (`CONN_HEALTH_CHECKS` off where this backend is used, the settings say so):
psycopg_pool's own check, after each connection that failed it, slept inside the request that asked (~1 s, then 2 s,
4 s...) before it tried the next idle one. A restart or a failover cuts every session at once, so after one all the
pool's idle connections were dead and the first request to ask waited for the sum: `/readyz`'s 2 s database check
timed out and a gateway's traffic did not resume for 30 s (`tests/test_web_database_pool.py`). Here a connection that
fails the same check (an empty query) drops every idle one with it (`ConnectionPool.drain`: those handed out are
closed as they come back), and the request waits for a fresh one, connected at once, with no sleep between.

The check has a deadline (`CHECK_TIMEOUT_S`): a session that stalled (a partition, a failover with no RST) never
answers, and the empty query waited on its socket for good, with every request handed that connection; at the
deadline the socket is shut down under the check, which then fails like any broken connection.
"""

from __future__ import annotations

import socket
import threading

import psycopg
from django.db.backends.postgresql import base
from psycopg_pool import ConnectionPool

# NOTE: an empty query answers in well under a millisecond on a live session; a second means the session is gone.
CHECK_TIMEOUT_S = 2.0


def check_within_deadline(connection: psycopg.Connection, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """psycopg_pool's check (an empty query), but a session that has not answered within `timeout_s` is cut: its socket
    shut down, so the check raises `psycopg.OperationalError` instead of waiting for good."""
    lock = threading.Lock()
    done = False

    def cut() -> None:
        with lock:
            if done:
                return
            try:
                stalled = socket.socket(fileno=connection.pgconn.socket)
            except (OSError, psycopg.Error):
                return
            try:
                stalled.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                stalled.detach()  # NOTE: the descriptor stays libpq's, closed with the connection

    timer = threading.Timer(timeout_s, cut)
    timer.daemon = True
    timer.start()
    try:
        ConnectionPool.check_connection(connection)
    finally:
        with lock:
            done = True
        timer.cancel()


class DatabaseWrapper(base.DatabaseWrapper):
    def get_new_connection(self, conn_params):
        connection = super().get_new_connection(conn_params)
        if self.pool is None:
            return connection
        try:
            check_within_deadline(connection)
        except psycopg.Error:
            self.pool.putconn(connection)  # broken: the pool discards it and connects a replacement
            self.pool.drain()  # NOTE: cut together with it: every idle one is dead too
            connection = super().get_new_connection(conn_params)
        return connection
