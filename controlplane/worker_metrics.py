"""A Celery worker's own `/metrics` (the worker and batch-worker pods), for the operator's Prometheus.

What a worker counts lives in its own processes: the lines its replays of the files bucket set aside
(`inferplane_usage_lines_set_aside_total`, `billing.journal_shipping`), and whatever else a task counts. Before, no
worker served them: they showed in its log alone. With `INFERPLANE_METRICS_TOKEN` set, the worker's main process serves
them on `INFERPLANE_WORKER_METRICS_PORT` (the pod's port `metrics`), under the web's rule
(`metrics_processes.token_granted`): only `Authorization: Bearer <that token>`, anything else a bare 401; without a
token (or with port 0) the worker listens on nothing.

Tasks run in prefork children, and a child's counters die with it (a pool recycles them), so every process of the
worker writes its counters into one folder (prometheus_client's multiprocess mode), emptied at each start of the
worker (`celeryd_init`: in the main process, before the pool, Django's set-up and the tasks import prometheus_client);
a scrape sums them, the children's that have gone included.

NOTE: a thread of the main process serves the scrapes (wsgiref, a thread each): the main process runs no task, so a
long task never holds a scrape up. It starts once the pool has forked its children (`worker_ready`); a child the pool
forks later inherits the listening socket, never the thread, and never accepts on it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from celery.signals import celeryd_init, worker_ready, worker_shutdown

from controlplane.metrics_processes import (
    forget_dead_processes,
    multiprocess_registry,
    prepare_metrics_dir,
    token_granted,
)

logger = logging.getLogger("inferplane.worker")


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
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
    """Listen on `port` (every address of the pod) in a thread of this process; None without a token or a port."""
    if not token or not port:
        return None
    server = make_server("", port, metrics_app(token, directory), server_class=_Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="worker-metrics", daemon=True).start()
    return server


class _State:
    directory: str | None = None
    server: _Server | None = None


def _wanted() -> bool:
    from django.conf import settings

    return bool(settings.METRICS_TOKEN and settings.WORKER_METRICS_PORT)


@celeryd_init.connect
def _prepare_metrics_dir(**_) -> None:
    if not _wanted():
        return
    if "prometheus_client" in sys.modules and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # NOTE: too late for multiprocess mode (prometheus_client read the variable as it was imported): the
        # children's counts would never reach a scrape, so none is served rather than a misleading one.
        logger.error("worker metrics: prometheus_client was imported before the worker started; /metrics not served")
        return
    _State.directory = str(prepare_metrics_dir(2))


@worker_ready.connect
def _serve_metrics(**_) -> None:
    from django.conf import settings

    if _State.directory is None:
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
