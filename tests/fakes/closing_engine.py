"""An engine that closes a connection under a call instead of answering it, where `closes_on` says so: as an engine
dies on a call it read (closed plainly: a FIN), or, `unread`, as uvicorn's graceful shutdown (a replica drained or
scaled to zero) closes a connection it has no call on yet, new or kept alive, with the call that landed on it unread
(its kernel resets the connection). Every other call is answered with a short chat completion, kept alive."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable

from tests.fakes.local_server import serve_connections

_ANSWER = json.dumps({"id": "cmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
                      "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}).encode()


def _whole(request: bytes) -> bool:
    head, separator, body = request.partition(b"\r\n\r\n")
    return bool(separator) and len(body) >= int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))


def _consume(conn: socket.socket, num_bytes: int) -> None:
    while num_bytes:
        num_bytes -= len(conn.recv(num_bytes))


class ClosingEngine:
    """`closes_on(number, body)`: whether the call `body`, the `number`th on its connection (from 0), is closed on;
    `before_closing` runs first (its replica marked DRAINING, as the control plane does before its engine stops)."""

    def __init__(self, closes_on: Callable[[int, bytes], bool], before_closing: Callable[[], None] = lambda: None, *,
                 unread: bool = False):
        self.closes_on, self.before_closing, self.unread = closes_on, before_closing, unread
        self.num_requests = self.num_closed = 0
        self.address = serve_connections(self._serve)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            for number in range(1_000):
                # Peeked, not read: a call closed on `unread` stays in the socket, as uvicorn leaves it.
                request = b""
                while not _whole(request):
                    time.sleep(0.001 if request else 0)
                    request = conn.recv(1 << 20, socket.MSG_PEEK)
                    if not request:
                        return
                body = request.partition(b"\r\n\r\n")[2]
                self.num_requests += 1
                if self.closes_on(number, body):
                    self.before_closing()
                    self.num_closed += 1
                    if not self.unread:
                        _consume(conn, len(request))  # read whole: its kernel closes it plainly
                    return
                _consume(conn, len(request))
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(_ANSWER)).encode() + b"\r\n\r\n" + _ANSWER)

    def stop(self) -> None:
        self.listener.close()
