"""A bare TCP server on a free local port for the socket-level fakes: each connection served in a thread of its own."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable


def serve_connections(serve: Callable[[socket.socket], None]) -> str:
    """Listen on 127.0.0.1 and call `serve` with each connection accepted, in a thread of its own; the address."""
    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"
