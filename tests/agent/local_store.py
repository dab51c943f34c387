"""A local HTTP server standing for a tenant's own S3-compatible store in the weights tests."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass


class LocalServer:
    """Serves `handler` on a free loopback port until `close()`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def pull_in_thread(cache, source: str, stop: threading.Event | None = None, *, access=None):
    """`cache.fetch(source, stop=stop, access=access)` on a thread of its own: (the thread, the failures it ended
    with)."""
    failures: list[Exception] = []

    def pull():
        try:
            cache.fetch(source, stop=stop, access=access)
        except Exception as exc:  # noqa: BLE001 - what the pull thread ended with
            failures.append(exc)

    thread = threading.Thread(target=pull, daemon=True)
    thread.start()
    return thread, failures
