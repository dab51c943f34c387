"""A minimal HTTP/1.1 server on uvloop and httptools, to measure what uvicorn's ASGI layer costs a request (round 29).

NOT a server to run the gateway in a pod: it owns none of what `controlplane.serve` relies on uvicorn for (graceful
drain on SIGTERM, `Expect: 100-continue`, timeouts other than keep-alive's, multiple workers, access lines, ...:
bench/results/gateway_profile.md, round 29, lists them). It exists so that `bench/profile_gateway.py
--compare-server lean` can serve, paired against uvicorn in the same rounds:

- the floor without ASGI (`--bare-floor`): an asyncio `Protocol` with httptools' parser that forwards each request's
  body with the same aiohttp client as `bench/bare_proxy.py` and writes the same answer (status, `date`,
  `content-type`, `content-length`, body) straight to the transport: no scope, no `receive`/`send`, no task per
  request beyond the one the client's call needs;
- any ASGI app (the gateway's `controlplane.asgi:application`, the same object uvicorn serves), with a minimal
  scope, `receive`/`send` as plain coroutines, a `date` header made once a second, the app's own headers written as
  given (no checks of our own answers), keep-alive with uvicorn's 5 s idle timer, pipelined requests one after
  another, a body limit, flow control both ways, chunked answers where the app gives no length, and the lifespan.

    .venv/bin/python bench/lean_server.py controlplane.asgi:application --port 8001
    BARE_PROXY_UPSTREAM=http://127.0.0.1:PORT .venv/bin/python bench/lean_server.py --bare-floor --port 8002
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import email.utils
import importlib
import os
import signal
import sys

import httptools
import uvloop

KEEP_ALIVE_S = 5.0  # uvicorn's default `--timeout-keep-alive`
MAX_BODY_BYTES = 256 * 1024 * 1024  # above the gateway's own limits (its uploads); a request past it: 413, closed
HIGH_WATER_BYTES = 64 * 1024  # request body buffered before reading pauses (uvicorn's flow control: the same)
ASGI = {"version": "3.0", "spec_version": "2.3"}
REASONS = {200: b"OK", 201: b"Created", 202: b"Accepted", 204: b"No Content", 400: b"Bad Request", 401: b"Unauthorized",
           402: b"Payment Required", 403: b"Forbidden", 404: b"Not Found", 405: b"Method Not Allowed",
           408: b"Request Timeout", 409: b"Conflict", 413: b"Content Too Large", 422: b"Unprocessable Content",
           429: b"Too Many Requests", 499: b"Client Closed Request", 500: b"Internal Server Error",
           502: b"Bad Gateway", 503: b"Service Unavailable", 504: b"Gateway Timeout"}
STATUS_LINES = {status: b"HTTP/1.1 %d %s\r\n" % (status, reason) for status, reason in REASONS.items()}
_date_line = [b""]  # `date: ...\r\n`, made once a second by `_tick_date`


def _tick_date(loop: asyncio.AbstractEventLoop) -> None:
    _date_line[0] = b"date: " + email.utils.formatdate(usegmt=True).encode() + b"\r\n"
    loop.call_later(1.0, _tick_date, loop)


def _status_line(status: int) -> bytes:
    return STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status


class Cycle:
    """One request and its answer: the ASGI `receive` and `send` of it."""

    __slots__ = ("connection", "scope", "body", "complete", "body_sent", "waiter", "started", "chunked", "done",
                 "keep_alive", "head")

    def __init__(self, connection: Connection, scope: dict, keep_alive: bool):
        self.connection, self.scope, self.keep_alive = connection, scope, keep_alive
        self.body: list[bytes] = []
        self.complete = self.body_sent = self.started = self.chunked = self.done = False
        self.waiter: asyncio.Future | None = None
        self.head = b""

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def receive(self) -> dict:
        connection = self.connection
        while not (self.body or self.complete or connection.gone):
            self.waiter = connection.loop.create_future()
            await self.waiter
        if connection.gone or self.body_sent:
            if not connection.gone:  # the whole body was read: what is left to hear is the client's going
                self.waiter = connection.loop.create_future()
                await self.waiter
            return {"type": "http.disconnect"}
        body = b"".join(self.body) if len(self.body) != 1 else self.body[0]
        self.body.clear()
        if connection.reading_paused:
            connection.reading_paused = False
            connection.transport.resume_reading()
        self.body_sent = self.complete
        return {"type": "http.request", "body": body, "more_body": not self.complete}

    async def send(self, message: dict) -> None:
        connection = self.connection
        if connection.gone or self.done:
            return
        if message["type"] == "http.response.start":
            lines = [_status_line(message["status"]), _date_line[0]]
            has_length = False
            for name, value in message.get("headers", ()):
                lines.append(b"%s: %s\r\n" % (name, value))
                lowered = name.lower()
                if lowered == b"content-length":
                    has_length = True
                elif lowered == b"connection" and value.lower() == b"close":
                    self.keep_alive = False
            if not has_length and self.scope["method"] != "HEAD":
                self.chunked = True
                lines.append(b"transfer-encoding: chunked\r\n")
            if not self.keep_alive:
                lines.append(b"connection: close\r\n")
            lines.append(b"\r\n")
            self.head, self.started = b"".join(lines), True
            return
        body, more = message.get("body", b""), message.get("more_body", False)
        if self.chunked:
            data = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + (b"" if more else b"0\r\n\r\n")
        else:
            data = body if self.scope["method"] != "HEAD" else b""
        if self.head:  # the head and the first body in one write
            data, self.head = self.head + data, b""
        if data:
            connection.transport.write(data)
        if not more:
            self.done = True
            connection.cycle_done(self)
        elif connection.writing_paused is not None:
            await connection.writing_paused


class Connection(asyncio.Protocol):
    """One client connection: httptools parses, each request becomes a `Cycle`, run one at a time."""

    def __init__(self, server: LeanServer):
        self.server, self.loop = server, server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.gone = self.reading_paused = False
        self.writing_paused: asyncio.Future | None = None
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.parsing: Cycle | None = None  # the request being parsed
        self.running: Cycle | None = None  # the request whose answer is being made
        self.pipelined: collections.deque[Cycle] = collections.deque()
        self.body_bytes = 0
        self.idle = None  # the keep-alive timer between requests

    # asyncio's callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.client, self.local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
        self.server.connections.add(self)
        self.idle = self.loop.call_later(KEEP_ALIVE_S, self._close)

    def connection_lost(self, exc) -> None:
        self.gone = True
        self.server.connections.discard(self)
        if self.idle is not None:
            self.idle.cancel()
        for cycle in (self.running, self.parsing, *self.pipelined):
            if cycle is not None:
                cycle.wake()
        if self.writing_paused is not None and not self.writing_paused.done():
            self.writing_paused.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        except httptools.HttpParserError:
            self._refuse(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")

    def pause_writing(self) -> None:
        self.writing_paused = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.writing_paused is not None and not self.writing_paused.done():
            self.writing_paused.set_result(None)
        self.writing_paused = None

    # httptools' callbacks
    def on_message_begin(self) -> None:
        self.url, self.headers, self.body_bytes = b"", [], 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        parsed = httptools.parse_url(self.url)
        path = parsed.path.decode("ascii")
        if "%" in path:
            from urllib.parse import unquote
            path = unquote(path)
        scope = {"type": "http", "asgi": ASGI, "http_version": self.parser.get_http_version(),
                 "method": self.parser.get_method().decode("ascii"), "scheme": "http", "path": path,
                 "raw_path": parsed.path, "query_string": parsed.query or b"", "root_path": "",
                 "headers": self.headers, "client": self.client, "server": self.local, "state": {}}
        self.parsing = Cycle(self, scope, self.parser.should_keep_alive())
        for name, value in self.headers:
            if name == b"content-length" and int(value) > MAX_BODY_BYTES:
                return self._refuse(b"HTTP/1.1 413 Content Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        if self.running is None:
            self._run(self.parsing)
        else:
            self.pipelined.append(self.parsing)

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > MAX_BODY_BYTES:
            return self._refuse(b"HTTP/1.1 413 Content Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        cycle = self.parsing
        cycle.body.append(body)
        if self.body_bytes > HIGH_WATER_BYTES and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        cycle, self.parsing = self.parsing, None
        if cycle is not None:
            cycle.complete = True
            cycle.wake()

    # the server's own
    def _run(self, cycle: Cycle) -> None:
        self.running = cycle
        self.loop.create_task(self._answer(cycle))

    async def _answer(self, cycle: Cycle) -> None:
        try:
            await self.server.app(cycle.scope, cycle.receive, cycle.send)
        except BaseException as exc:
            print(f"lean_server: {cycle.scope['method']} {cycle.scope['path']}: {exc!r}", file=sys.stderr, flush=True)
            if not cycle.started and not self.gone:
                cycle.keep_alive = False
                self.transport.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self._close()
            return
        if not cycle.done:  # an app that ended without its answer's end
            self._close()

    def cycle_done(self, cycle: Cycle) -> None:
        self.running = None
        if not cycle.keep_alive:
            return self._close()
        if self.pipelined:
            return self._run(self.pipelined.popleft())
        if self.parsing is None:
            self.idle = self.loop.call_later(KEEP_ALIVE_S, self._close)

    def _refuse(self, answer: bytes) -> None:
        if not self.gone:
            self.transport.write(answer)
            self._close()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class BareFloorConnection(Connection):
    """The floor without ASGI: each request's body forwarded with `bench/bare_proxy.py`'s aiohttp client, the answer
    written as it was read (no streaming: the profile's runs are not streamed)."""

    def on_headers_complete(self) -> None:
        self.method, self.path, self.body_parts = self.parser.get_method(), self.url, []
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body_parts.append(body)

    def on_message_complete(self) -> None:
        self.loop.create_task(self._forward(self.path, b"".join(self.body_parts), self.keep_alive))

    async def _forward(self, path: bytes, body: bytes, keep_alive: bool) -> None:
        if path == b"/health":
            answer, status, content_type = b"ok", 200, b"text/plain"
        else:
            client = self.server.client
            async with client.post(self.server.upstream + path.decode(), data=body,
                                   headers={"content-type": "application/json"}) as response:
                answer, status, content_type = await response.read(), response.status, b"application/json"
        if not self.gone:
            self.transport.write(b"%s%scontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s" % (
                _status_line(status), _date_line[0], content_type, len(answer),
                b"" if keep_alive else b"connection: close\r\n", answer))
            if not keep_alive:
                self._close()


class LeanServer:
    def __init__(self, app, loop: asyncio.AbstractEventLoop, *, bare_floor: bool = False):
        self.app, self.loop, self.bare_floor = app, loop, bare_floor
        self.connections: set[Connection] = set()
        self.client = None
        self.upstream = os.environ.get("BARE_PROXY_UPSTREAM", "")
        self._lifespan_events: asyncio.Queue = asyncio.Queue()
        self._lifespan_answers: asyncio.Queue = asyncio.Queue()

    async def serve(self, host: str, port: int) -> None:
        _tick_date(self.loop)
        if self.bare_floor:
            import aiohttp

            self.client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2000, limit_per_host=0))
            protocol = BareFloorConnection
        else:
            lifespan = self.loop.create_task(self.app({"type": "lifespan", "asgi": ASGI, "state": {}},
                                                      self._lifespan_events.get, self._lifespan_answers.put))
            await self._lifespan_events.put({"type": "lifespan.startup"})
            answer = await self._lifespan_answers.get()
            if answer["type"] != "lifespan.startup.complete":
                raise SystemExit(f"lean_server: the app's startup: {answer}")
            protocol = Connection
        stopping = self.loop.create_future()
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(signum, lambda: stopping.done() or stopping.set_result(None))
        server = await self.loop.create_server(lambda: protocol(self), host, port, backlog=2048)
        print(f"lean_server: serving on http://{host}:{port}", flush=True)
        await stopping
        server.close()
        for connection in list(self.connections):
            if connection.running is None:
                connection._close()
        if self.client is not None:
            await self.client.close()
        else:
            await self._lifespan_events.put({"type": "lifespan.shutdown"})
            await self._lifespan_answers.get()
            await lifespan


def load(app: str):
    module, _, name = app.partition(":")
    return getattr(importlib.import_module(module), name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("app", nargs="?", default=None, help="module:attribute of an ASGI app")
    parser.add_argument("--bare-floor", action="store_true", help="the floor without ASGI (BARE_PROXY_UPSTREAM)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    sys.path.insert(0, os.getcwd())
    uvloop.install()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    app = None if args.bare_floor else load(args.app)
    loop.run_until_complete(LeanServer(app, loop, bare_floor=args.bare_floor).serve(args.host, args.port))


if __name__ == "__main__":
    main()
