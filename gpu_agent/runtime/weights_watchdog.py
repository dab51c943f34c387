"""Ending a request to a store from outside its thread: a deadline and a stop that hold whatever the socket does.

A tenant may point its S3 credential at its own `endpoint_url`, and that server may send its headers or its
body a byte at a time. Every timeout the HTTP libraries offer is per socket read (botocore's `read_timeout`,
httpx's `read`), and the transfer can look at its stop flag only between reads, so a store dripping a byte
every few seconds held a download, its thread and the disk reserved for it for as long as it liked, past a
drain or the agent's own stop.

So a request is made inside `guarded(guard)`: every connection the thread uses while it is inside registers its
socket with the guard (`watch_socket`; botocore's connections through `guard_s3_connections`, httpx's through
the `trace` request extension `watch_new_connections`), and one watchdog thread shuts that socket down the moment
one of the guard's stop events is set or its deadline passes. The read blocked on it returns at once, the library raises its own
connection error, and the caller reads `guard.fired` to say why (`FIRED_STOPPED`, `FIRED_DEADLINE`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from botocore.awsrequest import (
    AWSHTTPConnection,
    AWSHTTPConnectionPool,
    AWSHTTPSConnection,
    AWSHTTPSConnectionPool,
)

FIRED_STOPPED = "stopped"
FIRED_DEADLINE = "deadline"
# How often the watchdog looks at its guards: a stop or a deadline takes effect within this.
WATCH_INTERVAL_S = 0.2


class RequestGuard:
    """One request's bounds: its stop events and its deadline (`time.monotonic()`; moved with `extend_to`)."""

    def __init__(self, stops: tuple[threading.Event, ...], deadline_at: float) -> None:
        self.stops = stops
        self.deadline_at = deadline_at
        self.fired: str | None = None  # why its sockets were shut (None while it has not fired)
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._done = False

    def extend_to(self, deadline_at: float) -> None:
        """Move the deadline (once the headers are in, a request has its body's time)."""
        self.deadline_at = deadline_at

    def due(self) -> str | None:
        if any(stop.is_set() for stop in self.stops):
            return FIRED_STOPPED
        if time.monotonic() > self.deadline_at:
            return FIRED_DEADLINE
        return None

    def watch(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with self._lock:
            if self._done:
                return
            self._sockets.append(sock)
            if self.fired is not None:  # a retry inside the library, after the guard fired: ends at once
                _shut(sock)

    def fire(self, reason: str) -> None:
        with self._lock:
            if self._done or self.fired is not None:
                return
            self.fired = reason
            for sock in self._sockets:
                _shut(sock)

    def _finish(self) -> None:
        # NOTE: under the lock, so a socket given back to its pool after the request is never shut by a late fire.
        with self._lock:
            self._done = True
            self._sockets.clear()


def _shut(sock: socket.socket) -> None:
    # NOTE: `socket.socket.shutdown` rather than the object's own: an SSL socket's would drop its SSL state
    # under the thread still reading it. Shutting (not closing) wakes that read with an end of stream, and
    # leaves the descriptor to its owner, which closes it as it handles the error.
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # already closed, or never connected


_current = threading.local()  # the guard of the request this thread is making
_guards: set[RequestGuard] = set()
_guards_lock = threading.Lock()
_watchdog: threading.Thread | None = None


@contextlib.contextmanager
def guarded(guard: RequestGuard) -> Iterator[RequestGuard]:
    """Make requests in this thread under `guard` (one request, with the library's own retries of it)."""
    _start_watchdog()
    with _guards_lock:
        _guards.add(guard)
    previous = getattr(_current, "guard", None)
    _current.guard = guard
    try:
        yield guard
    finally:
        _current.guard = previous
        with _guards_lock:
            _guards.discard(guard)
        guard._finish()


def watch_socket(sock: socket.socket | None) -> None:
    """A connection about to wait on `sock` for this thread's request: the thread's guard may shut it."""
    guard = getattr(_current, "guard", None)
    if guard is not None:
        guard.watch(sock)


def _start_watchdog() -> None:
    global _watchdog
    with _guards_lock:
        if _watchdog is None or not _watchdog.is_alive():
            _watchdog = threading.Thread(target=_watch, name="weights-watchdog", daemon=True)
            _watchdog.start()


def _watch() -> None:
    while True:
        time.sleep(WATCH_INTERVAL_S)
        with _guards_lock:
            guards = list(_guards)
        for guard in guards:
            reason = guard.due()
            if reason is not None:
                guard.fire(reason)


# -- botocore ---------------------------------------------------------------------------------------


class _GuardedHTTPConnection(AWSHTTPConnection):
    def getresponse(self, *args, **kwargs):
        watch_socket(self.sock)  # sent: what is left is waiting on the store, headers first
        return super().getresponse(*args, **kwargs)


class _GuardedHTTPSConnection(AWSHTTPSConnection):
    def getresponse(self, *args, **kwargs):
        watch_socket(self.sock)
        return super().getresponse(*args, **kwargs)


class _GuardedHTTPConnectionPool(AWSHTTPConnectionPool):
    ConnectionCls = _GuardedHTTPConnection


class _GuardedHTTPSConnectionPool(AWSHTTPSConnectionPool):
    ConnectionCls = _GuardedHTTPSConnection


def guard_s3_connections(client) -> None:
    """Make every connection of a new boto3 client register its socket with its thread's guard.

    NOTE: botocore has no public hook on its connections; its session keeps the pool classes in one dict its
    pool managers share, and pools are made on first use, so this must run before the client's first request.
    `tests/agent/test_weights_stop.py` fails if a botocore upgrade moves them.
    """
    classes = client._endpoint.http_session._pool_classes_by_scheme
    classes.update({"http": _GuardedHTTPConnectionPool, "https": _GuardedHTTPSConnectionPool})


# -- httpx (the Hub) --------------------------------------------------------------------------------


def watch_new_connections(event_name: str, info: dict) -> None:
    """httpx's `trace` request extension: each connection the request opens registers its socket with the guard.

    NOTE: only connections opened for the request are seen (a reused one opens nothing), so a guarded request's
    client must keep none for reuse (`weights_access.hf_client`). TLS hands the socket to a new object, seen too.
    """
    if event_name in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
        stream = info.get("return_value")
        if stream is not None:
            watch_socket(stream.get_extra_info("socket"))
