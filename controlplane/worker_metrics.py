"""A Celery worker's own `/metrics` (the worker and batch-worker pods), for the operator's Prometheus.

What a worker counts lives in its own processes: the lines its replays of the files bucket set aside
(`inferplane_usage_lines_set_aside_total`, `billing.journal_shipping`), and whatever else a task counts. Before, no
worker served them: they showed in its log alone. With `INFERPLANE_METRICS_TOKEN` set, the worker's main process serves
them on `INFERPLANE_WORKER_METRICS_PORT` (the pod's port `metrics`), under the web's rule
(`metrics_processes.token_granted`): only `Authorization: Bearer <that token>`, anything else a bare 401; without a
token (or with port 0) the worker listens on nothing.

Tasks run in prefork children, and a child's counters die with it (a pool recycles them), so every process of the
worker writes its counters into one folder (prometheus_client's multiprocess mode), emptied at each start of the
worker. prometheus_client reads the folder's variable once, as it is first imported, and Celery's Django fixup sets
Django up (which imports it: billing's admin, the usage journal, ...) before `celeryd_init`; so the folder is made at
`import_modules`, the first thing `celery worker` sends, by a receiver connected before the Celery app is built (and
with it the fixup's own receiver), for the `celery ... worker` command alone (the pods' command, as the manifests run
it: `PROMETHEUS_MULTIPROC_DIR` unset, a private folder under /tmp; set, that folder, emptied).

NOTE: a thread of the main process serves the scrapes: the main process runs no task, so a long task never holds a
scrape up. It starts at `worker_init`, before the broker is reached, so a worker started during a broker outage is
scraped all through it; the pool's children, forked after, close their copy of the listening socket at once
(`os.register_at_fork`), so none holds the port or is handed a scrape. A connection is served by a thread of its own,
at most `MAX_CONNECTIONS` at a time (one more takes the place of the oldest still sending its request), each dropped
after `IDLE_TIMEOUT_S` without a byte, and its request must arrive whole within `REQUEST_DEADLINE_S` (`_Server`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from celery.signals import import_modules, worker_init, worker_shutdown

from controlplane.metrics_processes import (
    forget_dead_processes,
    multiprocess_registry,
    prepare_metrics_dir,
    token_granted,
)

logger = logging.getLogger("inferplane.worker")

# A scrape is one short request: Prometheus holds one connection to a pod at a time.
MAX_CONNECTIONS = 8
IDLE_TIMEOUT_S = 10.0  # a connection silent this long (one read or write) is dropped
# A request must arrive whole (its line and headers) this long after its connection was accepted, however it trickles.
REQUEST_DEADLINE_S = 5.0


class _Server(ThreadingMixIn, WSGIServer):
    """At most `MAX_CONNECTIONS` handled at a time; one more takes the place of the oldest still sending its request
    (closed), or is closed at once if every one is past it (being answered). A request not whole `REQUEST_DEADLINE_S`
    after its accept is closed (swept by `service_actions`, every half second of `serve_forever`'s loop).

    NOTE: before, a slot was held as long as its client sent a byte per `IDLE_TIMEOUT_S` (a per-read timeout), and
    the connection past the cap was the one closed: eight sockets trickling a byte every 9 s kept Prometheus out for
    good (found by the second review of these metrics)."""

    daemon_threads = True

    def server_activate(self) -> None:
        self._connections_lock = threading.Lock()
        self._num_connections = 0
        self._reading: dict[socket.socket, float] = {}  # still sending its request: its deadline, oldest first
        super().server_activate()

    def process_request(self, request, client_address) -> None:
        with self._connections_lock:
            if self._num_connections >= MAX_CONNECTIONS:
                if not self._reading:
                    self.shutdown_request(request)  # every slot answering a request: closed at once, no thread
                    return
                oldest = next(iter(self._reading))
                _cut_off(oldest)  # the oldest still sending: its thread reads the end and returns, freeing its slot
                del self._reading[oldest]
            self._num_connections += 1
            self._reading[request] = time.monotonic() + REQUEST_DEADLINE_S
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def request_arrived(self, request) -> None:
        """`request`'s line and headers are read: from now on only `IDLE_TIMEOUT_S` bounds it."""
        with self._connections_lock:
            self._reading.pop(request, None)

    def _forget(self, request) -> None:
        with self._connections_lock:
            self._num_connections -= 1
            self._reading.pop(request, None)

    def service_actions(self) -> None:
        now = time.monotonic()
        with self._connections_lock:
            late = [request for request, deadline_at in self._reading.items() if deadline_at <= now]
            for request in late:
                _cut_off(request)
                del self._reading[request]

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a client silent past IDLE_TIMEOUT_S, cut off, or gone midway: its connection closed, nothing to say
        logger.exception("worker metrics: a scrape failed")


def _cut_off(request: socket.socket) -> None:
    """End a connection still sending its request: its handler reads the end of it and returns."""
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)


class _QuietHandler(WSGIRequestHandler):
    def setup(self) -> None:
        self.timeout = IDLE_TIMEOUT_S  # read at each connection: StreamRequestHandler sets it on the socket
        super().setup()

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # NOTE: reads the headers too
        self.server.request_arrived(self.request)
        return parsed

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass  # a scrape every 15 s: no access line each


def metrics_app(token: str, directory: str):
    """The WSGI application: `GET /metrics` with the token, the sums of every process's counters in `directory`."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    def application(environ, start_response):
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b""]
        if not token_granted(environ.get("HTTP_AUTHORIZATION", "").encode("latin-1"), token):
            start_response("401 Unauthorized", [("Content-Type", "text/plain")])
            return [b""]
        forget_dead_processes(directory)
        body = generate_latest(multiprocess_registry(directory))
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
        return [body]

    return application


def serve(port: int, token: str, directory: str) -> _Server | None:
    """Serve `port` (every address of the pod) from a thread of this process; None without a token or a port."""
    if not token or not port:
        return None
    server = make_server("", port, metrics_app(token, directory), server_class=_Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="worker-metrics", daemon=True).start()
    return server


class _State:
    directory: str | None = None
    server: _Server | None = None


def _close_in_child() -> None:
    """In a process forked from the worker's main one (a pool child): close the listening socket it inherited."""
    server, _State.server = _State.server, None
    if server is not None:
        server.socket.close()  # this process's copy only; the main process's thread serves on


os.register_at_fork(after_in_child=_close_in_child)


def _wanted() -> bool:
    from django.conf import settings

    return bool(settings.METRICS_TOKEN and settings.WORKER_METRICS_PORT)


def _a_worker_command() -> bool:
    """Whether this process runs `celery ... worker` (not beat, not a shell, not a web process)."""
    import click

    context = click.get_current_context(silent=True)
    return context is not None and context.command.name == "worker"


@import_modules.connect
def _prepare_metrics_dir(**_) -> None:
    if _State.directory is not None or not _a_worker_command() or not _wanted():
        return
    if "prometheus_client" in sys.modules and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # NOTE: too late for multiprocess mode (prometheus_client read the variable as it was imported): the
        # children's counts would never reach a scrape, so none is served rather than a misleading one.
        logger.error("worker metrics: prometheus_client was imported before the worker started; /metrics not served")
        return
    _State.directory = str(prepare_metrics_dir(2))


@worker_init.connect
def _serve_metrics(**_) -> None:
    from django.conf import settings

    if _State.directory is None or _State.server is not None:
        return
    try:
        _State.server = serve(settings.WORKER_METRICS_PORT, settings.METRICS_TOKEN, _State.directory)
    except OSError as exc:  # the port taken: the worker works on, unscraped, and says so
        logger.error("worker metrics: cannot listen on port %d (%r); /metrics not served",
                     settings.WORKER_METRICS_PORT, exc)
        return
    logger.info("worker metrics: /metrics served on port %d", settings.WORKER_METRICS_PORT)


@worker_shutdown.connect
def _stop_serving_metrics(**_) -> None:
    server, _State.server = _State.server, None
    if server is not None:
        server.shutdown()
        server.server_close()
