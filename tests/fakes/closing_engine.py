"""An engine that closes a connection under a call instead of answering it, where `closes_on` says so: as uvicorn closes
an idle keep-alive connection as it stops (a replica drained or scaled to zero) when a call lands on it, or as an
engine dies on a call it read. Every other call is answered with a short chat completion, kept alive."""

from __future__ import annotations

import json
import re
import socket
import struct
import threading
from collections.abc import Callable

_ANSWER = json.dumps({"id": "cmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
                      "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}).encode()


class ClosingEngine:
    """`closes_on(number, body)`: whether the call `body`, the `number`th on its connection (from 0), is closed on;
    `before_closing` runs first (its replica marked DRAINING, as the control plane does before its engine stops)."""

    def __init__(self, closes_on: Callable[[int, bytes], bool], before_closing: Callable[[], None] = lambda: None):
        self.closes_on, self.before_closing = closes_on, before_closing
        self.num_requests = self.num_closed = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            pending = b""
            for number in range(1_000):
                while b"\r\n\r\n" not in pending:
                    data = conn.recv(65536)
                    if not data:
                        return
                    pending += data
                head, _, pending = pending.partition(b"\r\n\r\n")
                length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
                while len(pending) < length:
                    pending += conn.recv(65536)
                body, pending = pending[:length], pending[length:]
                self.num_requests += 1
                if self.closes_on(number, body):
                    self.before_closing()
                    self.num_closed += 1
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset, unanswered
                    return
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(_ANSWER)).encode() + b"\r\n\r\n" + _ANSWER)

    def stop(self) -> None:
        self.listener.close()
