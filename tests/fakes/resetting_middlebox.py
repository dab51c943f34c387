"""A middlebox between the gateway and an engine that resets a connection once the engine has been silent on a call for
`silent_s`: as a NAT's or a load balancer's idle timeout does (one that resets both sides, as Azure's does), or a proxy
that gives up, here after a fraction of a second rather than minutes. Each connection is relayed to `target` whole, so
the engine behind it reads the call and computes it; a non-streamed answer is silent until its end, and the gateway's
side is reset (SO_LINGER 0) before any byte of it."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

from tests.fakes.local_server import serve_connections


class ResettingMiddlebox:
    """`before_closing` runs before each reset (its replica marked DRAINING: a drain under way as it resets); `plain`:
    the connection is closed plainly (a FIN: a proxy that gives up) rather than reset."""

    def __init__(self, target: str, *, silent_s: float, before_closing: Callable[[], None] = lambda: None,
                 plain: bool = False):
        parts = urlsplit(target)
        self.target, self.silent_s, self.before_closing = (parts.hostname, parts.port), silent_s, before_closing
        self.plain = plain
        self.num_closed = 0  # connections reset
        self.address = serve_connections(self._relay)

    def _relay(self, client: socket.socket) -> None:
        sent = threading.Event()  # the gateway sent a call: the engine's silence counts from then
        with client, socket.create_connection(self.target) as engine:
            threading.Thread(target=self._forward, args=(client, engine, sent), daemon=True).start()
            sent.wait()
            engine.settimeout(self.silent_s)
            while True:
                try:
                    data = engine.recv(65536)
                except TimeoutError:
                    self.before_closing()
                    self.num_closed += 1
                    if not self.plain:
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    # NOTE: the other thread's read ends first: the socket is closed (reset) only once none uses it
                    client.shutdown(socket.SHUT_RD)
                    return
                if not data:
                    return
                client.sendall(data)

    @staticmethod
    def _forward(client: socket.socket, engine: socket.socket, sent: threading.Event) -> None:
        try:
            while data := client.recv(65536):
                engine.sendall(data)
                sent.set()
        except OSError:
            pass
        finally:
            sent.set()
