"""The gateway's HTTP/1.1 client to its replicas: asyncio protocols, httptools' parser, keep-alive pools.

It speaks only to our own replicas (vLLM's OpenAI server behind the agent, the benchmarks' mock):
HTTP/1.1, keep-alive, a JSON body up, JSON or SSE (chunked) down. Per request it writes the request
line, headers and body in one `write`, and lets httptools call back into one `Response`; what
aiohttp adds for a general client (request and response objects, multidict headers, cookie jar,
tracing hooks, per-read timers, a stream reader) is not on the path.

- One pool of idle connections per address, newest reused first, at most `max_idle` kept, each
  closed after `idle_timeout_s` idle (4 s: under the engine's own 5 s). A connection is reused only after a response read to its
  end on a keep-alive exchange; an error, an unread or aborted response (`Response.close`: a client
  gone mid-stream) closes it, which is how an engine learns its caller left.
- A pooled connection the server closed while idle is dropped when found closing; one that closes
  under a request with no byte of the answer raises `UpstreamClosed` with `before_first_byte` set:
  the caller decides. Nothing is ever sent twice here, and the gateway sends a call again elsewhere
  only where its engine cannot have read it (`engine_cannot_have_started`: no connection, or the request
  could not be written), or where a replica no longer READY closed it as its server stops, the call
  unread (`idle_close_raced`, `reset_before_answer`), never after it may have.
- Timeouts: connect `connect_timeout_s`; a read `read_timeout_s` between bytes, the answer's first
  byte included (one timer per request, moved on as bytes arrive). A request sent with `patience` is asked,
  when its wait for the answer's first byte passes the read timeout, how much longer to wait: a non-streamed
  answer comes in one piece when the engine is done, which takes as long as its tokens take. A stream's request
  (`patience_until_body`) is asked so until its body's first byte (the engine sends a stream's headers at once, its
  first event after the prompt's prefill), from `first_byte_timeout_s` of silence; one whose engine writes events of
  its own before that (`first_event_told`: a Responses stream's lifecycle events) until its caller says the first
  came (`Response.first_event_came`). A timeout is never safe to send again (the replica has the request):
  `UpstreamTimeout.before_first_byte` is False.
- Every failure is an `UpstreamError`.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from urllib.parse import urlsplit

import httptools

CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 600.0
# NOTE: under vLLM's own keep-alive timeout (its HTTP server closes a connection idle for 5 s): a
# connection kept longer is one the engine may close just as a request goes out on it.
IDLE_TIMEOUT_S = 4.0
MAX_IDLE_PER_HOST = 1024
# NOTE: a streamed answer's bytes not yet taken by the gateway (its client reads slowly) stop the
# connection's reads here: a slow or hostile client never makes the gateway hold a whole answer.
HIGH_WATER_BYTES = 256 * 1024
# NOTE: a non-streamed answer is held whole by the gateway before it is sent on (its usage is read from
# it); past this a request (n: 16 with logprobs over a long context, say) fails instead of taking the
# gateway process's memory, and every other tenant's calls on it, with it. Streamed answers have no limit.
MAX_WHOLE_BODY_BYTES = 64 * 1024 * 1024
# NOTE: a replica's server that stops closes a connection with a call on it unread at once, as the call goes out (an
# idle keep-alive connection it closes, a connection queued on its listener as it closes): a close that comes later
# than this after the call went out is no such close, whatever its replica's state, but a middlebox (a NAT's or a load
# balancer's idle timeout, a proxy giving up) on a call its engine read and may be computing
# (`idle_close_raced`, `reset_before_answer`).
CLOSED_UNREAD_WITHIN_S = 3.0


class UpstreamError(Exception):
    """The replica failed: refused, reset, timed out, closed early, or answered something that is not HTTP."""

    before_first_byte = False  # set when no byte of the answer had arrived
    nothing_sent = False  # set when no byte of the request left: the replica cannot have read it
    on_reused_connection = False  # set when it failed on a pooled connection that had carried an answer before
    reset_unanswered = False  # set when the replica reset the connection before any byte of the answer
    closed_soon = False  # set when the connection closed within `CLOSED_UNREAD_WITHIN_S` of the request going out


def engine_cannot_have_started(error: UpstreamError) -> bool:
    """Whether the replica cannot have started work on the request `error` ended: none of it was sent (no connection,
    or it could not be written). NOTE: a connection closed before any byte of the answer is not one, plainly or
    reset: the engine may have read the request and died on it (a non-streamed answer's first byte comes at its end),
    or be computing it still behind a middlebox that reset it (`reset_before_answer`), so sent again elsewhere it
    would be computed twice."""
    return error.nothing_sent


def reset_before_answer(error: UpstreamError) -> bool:
    """Whether `error` may be the replica's server closing the connection with the request unread as it stops: reset
    before any byte of the answer, new or pooled. A kernel resets a connection whose socket is closed with bytes
    received and not read, or that is sent bytes once closed, or that waited in a listening socket's queue when it
    closed: uvicorn's graceful shutdown (a replica drained or scaled to zero) closing a connection it had no call on
    yet. An engine that read the request and died closes plainly (a FIN): a process that exits closes its sockets so
    once it read all they received.
    NOTE: not proof that the engine never read it: anything on the path that resets a connection (a NAT's or a load
    balancer's idle timeout, a proxy giving up) resets one whose engine read the call and is computing it, silent
    until a non-streamed answer's end. As `idle_close_raced`, the caller tells them apart by its replica's state
    (`InferenceCall._forward`), and only a reset that came at once may be a stopping server's (`CLOSED_UNREAD_WITHIN_S`):
    a middlebox's reset of a call silent longer, its replica draining, was taken for one, and the call computed twice
    (the first engine's work unbilled)."""
    return error.reset_unanswered and error.closed_soon


def idle_close_raced(error: UpstreamError) -> bool:
    """Whether `error` may be the replica's server closing a pooled connection it held idle as the request went out on
    it (uvicorn's graceful shutdown closes idle keep-alive connections at once, unread): closed with no byte of the
    answer, on a connection that had carried an answer before. An engine that died on the request ends so too: the
    caller tells them apart by its replica's state (`InferenceCall._forward`); a close that came later than
    `CLOSED_UNREAD_WITHIN_S` after the request is not one."""
    return error.before_first_byte and error.on_reused_connection and error.closed_soon


class UpstreamConnectError(UpstreamError):
    before_first_byte = True
    nothing_sent = True


class UpstreamTimeout(UpstreamError):
    """No byte within the read timeout (and, before the first, no more `patience`). Never sent again: the replica
    has the request, and its engine may be computing it."""


class UpstreamClosed(UpstreamError):
    pass


class MalformedResponse(UpstreamError):
    pass


class ResponseTooLarge(UpstreamError):
    """A whole answer passed `MAX_WHOLE_BODY_BYTES`: dropped with its connection (the engine aborts it), or,
    read with an `overflow` callback, read to its end through it and then raised."""


class MalformedRequest(UpstreamError):
    """Nothing was sent: the request could not be written as HTTP."""

    before_first_byte = True
    nothing_sent = True


class Response:
    """One answer as it arrives: `status` once its headers are in; the body by `read()` or `async for`."""

    __slots__ = ("status", "_conn", "_chunks", "_num_buffered", "_bounded", "_done", "_error", "_waiter",
                 "_headers_seen", "_overflow", "_overflowed", "_patience", "_holding", "_patience_until_body",
                 "_body_seen", "_first_event_told")

    def __init__(self, conn: _Connection, patience=None, patience_until_body: bool = False,
                 first_event_told: bool = False):
        self.status = 0
        # Asked (awaited, no argument) when the first byte is later than the read timeout: the seconds more to wait
        # for it, or None to give up (`UpstreamTimeout`). It may ask again when those pass.
        self._patience = patience
        # The first byte `patience` waits for is the body's, not the headers' (a stream's: its first event)
        self._patience_until_body = patience_until_body
        self._body_seen = False
        # NOTE: the body's first bytes are not that byte either (a Responses stream's engine writes `response.created`
        # and `response.in_progress` as it takes the request, its first output after the prefill): the caller, which
        # reads the events, says when it came (`first_event_came`)
        self._first_event_told = first_event_told
        self._conn = conn
        self._chunks: list[bytes] = []
        self._num_buffered = 0  # bytes in `_chunks`
        self._bounded = True  # reads pause above HIGH_WATER_BYTES (not for `read()`, which wants it all)
        self._done = False  # the whole message arrived
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future | None = None
        self._headers_seen = False
        self._overflow = None  # `read`'s callback for the bytes past MAX_WHOLE_BODY_BYTES
        self._overflowed = False  # past it: every byte goes to `_overflow`, none is kept
        self._holding = None  # `read`'s count of the bytes it keeps against their organisation (`delivery.Holding`)

    def _answer_started(self) -> bool:
        """Whether the first byte `patience` waits for has come."""
        return self._body_seen if self._patience_until_body else self._headers_seen

    def first_event_came(self) -> None:
        """The caller read the answer's first event (`first_event_told`): from now on the read timeout alone bounds
        the silence (the connection's timer, due at the first event's bound, finds it and waits on)."""
        self._body_seen = True

    # --- fed by the connection -------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self._done or self._error is not None:
            return
        self._error = error
        self._wake()

    def _spill(self) -> bool:
        """Past MAX_WHOLE_BODY_BYTES: hand what is held, and from now on every byte, to `_overflow`
        (False when there is none: the caller fails the read)."""
        if self._overflow is None:
            return False
        self._overflowed = True
        chunks, self._chunks, self._num_buffered = self._chunks, [], 0
        if self._holding is not None:
            self._holding.give(sum(len(chunk) for chunk in chunks))  # none of it is kept from now on
        for chunk in chunks:
            self._overflow(chunk)
        return True

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        await self._waiter

    # --- the caller's side -------------------------------------------------------------------
    async def read(self, overflow=None, holding=None) -> bytes:
        """The whole body; `UpstreamError` if the connection fails before its end.

        With `holding` (`delivery.Holding`), every byte kept is counted against its organisation and the process as it
        arrives (those that came before the read at its start), and the connection pauses while they hold more than
        their bounds (resumed by `delivery`).

        Past MAX_WHOLE_BODY_BYTES, `ResponseTooLarge`: at once, the connection dropped, without `overflow`; with
        it (a callable taking bytes), once the answer is read to its end, every byte of it passed to
        `overflow` and none held (the gateway reads such an answer's usage that way: the engine computed it).
        """
        self._bounded = False
        self._overflow = overflow
        self._holding = holding
        # NOTE: what came with the headers counts too, and may pause the connection at once: uncounted, it (up to
        # HIGH_WATER_BYTES and a read more) went unseen by the bounds, and the connection read a piece more.
        if holding is not None and self._num_buffered and holding.take(self._num_buffered, self._conn):
            self._conn.pause()
        else:
            self._conn.resume()
        if self._num_buffered > MAX_WHOLE_BODY_BYTES and not self._overflowed:  # it came in before the read
            self._spill()
        while not self._done or self._error is not None:
            if self._error is not None:
                raise self._error
            await self._wait()
        if self._overflowed:
            self._conn.release(self)  # read to its end: the connection is reused
            raise ResponseTooLarge(f"the answer passed {MAX_WHOLE_BODY_BYTES} bytes")
        if self._num_buffered > MAX_WHOLE_BODY_BYTES:  # it came in before the read, under the high-water mark
            self._chunks, self._done = [], False  # not at its end: `close` drops the connection
            raise ResponseTooLarge(f"the answer passed {MAX_WHOLE_BODY_BYTES} bytes")
        body = b"".join(self._chunks) if len(self._chunks) != 1 else self._chunks[0]
        self._chunks = []
        self._conn.release(self)
        return body

    async def chunks(self):
        """The body's bytes as they arrive, everything received so far in each piece; every byte that
        arrived is yielded before an `UpstreamError` is raised."""
        while True:
            if self._chunks:
                chunks, self._chunks = self._chunks, []
                self._num_buffered = 0
                self._conn.resume()
                yield chunks[0] if len(chunks) == 1 else b"".join(chunks)
            elif self._done:
                self._conn.release(self)
                return
            elif self._error is not None:
                raise self._error
            else:
                await self._wait()

    def arrived_before_failure(self) -> bytes:
        """Bytes received and not read yet (after a failure: what arrived before it)."""
        chunks, self._chunks = self._chunks, []
        self._num_buffered = 0
        return b"".join(chunks)

    def at_eof(self) -> bool:
        return self._done and not self._chunks

    def close(self) -> None:
        """Done with it: a connection whose answer was read to the end goes back to its pool, any other
        is closed (the engine sees its client leave)."""
        if not self.at_eof():
            self._conn.abandon(self)
        else:
            self._conn.release(self)


class _Connection(asyncio.Protocol):
    __slots__ = ("loop", "pool", "transport", "parser", "response", "closed", "idle_since", "last_read", "timer",
                 "read_timeout_s", "first_byte_timeout_s", "reusable", "paused", "patient_until", "asking", "reused",
                 "sent_at")

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: _Pool, read_timeout_s: float):
        self.loop = loop
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0
        self.last_read = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.read_timeout_s = read_timeout_s
        self.first_byte_timeout_s = read_timeout_s  # the request's, until the first byte its `patience` waits for
        self.reusable = False
        self.paused = False
        self.patient_until = 0.0  # the response's `patience` granted a wait for its first byte until then
        self.asking: asyncio.Task | None = None  # the response's `patience`, being asked
        self.reused = False  # taken from the pool: it carried an answer before (`idle_close_raced`)
        self.sent_at = 0.0  # when the request went out (loop time)

    # --- asyncio ---------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # nothing asked: a server talking out of turn is not reused
            self.close()
            return
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response._fail(MalformedResponse(f"malformed response: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # the transport closes; `connection_lost` follows

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._stop_timer()
        response = self.response
        if response is not None and not response._done:
            first = not response._headers_seen
            error = UpstreamClosed(f"the replica closed the connection {'before answering' if first else 'mid-body'}"
                                   + (f": {exc}" if exc else ""))
            error.before_first_byte = first
            error.on_reused_connection = self.reused
            # NOTE: a write that found the connection reset (EPIPE) fails so too: the request never left whole.
            error.reset_unanswered = first and isinstance(exc, (ConnectionResetError, BrokenPipeError))
            error.closed_soon = self.loop.time() - self.sent_at <= CLOSED_UNREAD_WITHIN_S
            response._fail(error)

    # --- httptools -------------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        response = self.response
        response.status = self.parser.get_status_code()
        response._headers_seen = True
        response._wake()

    def on_body(self, body: bytes) -> None:
        response = self.response
        if not response._first_event_told:
            response._body_seen = True
        if response._error is not None:  # past the limit: the rest of what this read held is dropped
            return
        if response._overflowed:
            response._overflow(body)
            return
        response._chunks.append(body)
        response._num_buffered += len(body)
        if not response._bounded and response._num_buffered > MAX_WHOLE_BODY_BYTES:
            if response._spill():
                return
            response._chunks = []
            self.reusable = False
            response._fail(ResponseTooLarge(f"the answer passed {MAX_WHOLE_BODY_BYTES} bytes"))
            self.transport.close()
            return
        if response._num_buffered > HIGH_WATER_BYTES and response._bounded and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        elif response._holding is not None and response._holding.take(len(body), self) and not self.paused:
            self.paused = True  # NOTE: the data waits in the replica's engine; `delivery` resumes it
            self.transport.pause_reading()
        if response._waiter is not None:
            response._wake()

    def on_message_complete(self) -> None:
        response = self.response
        if response._error is not None:  # failed past the limit: the connection is closing
            return
        self.reusable = self.parser.should_keep_alive()
        response._done = True
        self._stop_timer()
        response._wake()

    # --- the client's side ---------------------------------------------------------------------
    def send(self, data: bytes, patience=None, first_byte_timeout_s: float | None = None,
             patience_until_body: bool = False, first_event_told: bool = False) -> Response:
        self.response = response = Response(self, patience, patience_until_body, first_event_told)
        self.reusable = False
        self.patient_until = 0.0
        self.first_byte_timeout_s = self.read_timeout_s if first_byte_timeout_s is None else first_byte_timeout_s
        self.transport.write(data)
        self.sent_at = self.last_read = now = self.loop.time()
        self.timer = self.loop.call_at(now + self.first_byte_timeout_s, self._check_read)
        return response

    def pause(self) -> None:
        """Reads wait (the data waits in the replica's engine) until `resume`."""
        if not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Reads go on after a pause (the gateway took what was buffered); the read timeout counts from now."""
        if self.paused and not self.closed:
            self.paused = False
            self.last_read = self.loop.time()
            self.transport.resume_reading()

    def drop_whole_answer(self, keep=None) -> None:
        """The answer being read whole is larger than its holding may keep in memory (a batch line's past the largest
        its worker process holds: `endpoints.batches.answer_bytes`): as past MAX_WHOLE_BODY_BYTES, what is held and
        every byte after goes to `read`'s `overflow`, none of it kept, and `ResponseTooLarge` is raised at its end;
        without an `overflow`, it fails now, the connection dropped. With `keep` (a callable taking bytes), each of them
        goes to it too, before `overflow`: the holding keeps the answer elsewhere (on disk), and says so to the caller
        of `read`."""
        response = self.response
        if response is None or response._overflowed:
            return
        if keep is not None and response._overflow is not None:
            overflow = response._overflow

            def kept(data: bytes) -> None:
                keep(data)
                overflow(data)

            response._overflow = kept
        if response._spill():
            return
        response._chunks, response._num_buffered = [], 0
        self.reusable = False
        response._fail(ResponseTooLarge("the answer passed the most its holder keeps"))
        self.transport.close()  # NOTE: not `close`: the parser may call back again with this read's rest

    def _check_read(self) -> None:
        self.timer = None
        response = self.response
        if response is None or response._done or self.closed:
            return
        if self.paused:  # waiting on our own client, not on the replica
            self.last_read = self.loop.time()
        silence_s = self.read_timeout_s if response._answer_started() else self.first_byte_timeout_s
        due = max(self.last_read + silence_s, self.patient_until)
        if self.loop.time() < due:
            self.timer = self.loop.call_at(due, self._check_read)
            return
        if response._patience is not None and not response._answer_started():
            self.asking = self.loop.create_task(self._ask_patience(response))
            return
        self._time_out(response)

    async def _ask_patience(self, response: Response) -> None:
        try:
            more_s = await response._patience()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a question that fails is a no: the timeout stands
            more_s = None
        finally:
            self.asking = None
        if self.response is not response or response._done or self.closed:
            return  # answered, or given up, while asking
        if response._answer_started():  # its first byte came while asking: the reads' own timeout again, from the last
            self.timer = self.loop.call_at(self.last_read + self.read_timeout_s, self._check_read)
            return
        if not more_s or more_s <= 0:
            self._time_out(response)
            return
        self.patient_until = self.loop.time() + more_s
        self.timer = self.loop.call_at(self.patient_until, self._check_read)

    def _time_out(self, response: Response) -> None:
        waited_s = self.loop.time() - self.last_read
        error = UpstreamTimeout(f"no byte from the replica for {waited_s:.0f} s")
        response._fail(error)
        self.close()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.asking is not None:
            self.asking.cancel()
            self.asking = None

    def release(self, response: Response) -> None:
        if self.response is not response:
            return
        self.response = None
        self.resume()  # a whole answer can arrive in the read that paused: the next one must be read
        if self.reusable and not self.closed and not self.transport.is_closing():
            self.idle_since = self.loop.time()
            self.pool.put(self)
        else:
            self.close()

    def abandon(self, response: Response) -> None:
        if self.response is response:
            self.close()

    def close(self) -> None:
        self._stop_timer()
        self.response = None  # its caller has what it needs (an error, or nothing more to read)
        if not self.closed:
            self.closed = True
            self.transport.close()


class _Pool:
    """One (scheme, host, port)'s idle connections, newest last."""

    __slots__ = ("client", "host", "port", "ssl", "prefix", "head", "idle")

    def __init__(self, client: UpstreamClient, scheme: str, host: str, port: int, prefix: str):
        self.client = client
        self.prefix = prefix.rstrip("/").encode("latin-1")  # an address's own path, before each request's
        self.host, self.port = host, port
        self.ssl = ssl.create_default_context() if scheme == "https" else None
        default = 443 if scheme == "https" else 80
        self.head = f"host: {host if port == default else f'{host}:{port}'}\r\n".encode("latin-1")
        self.idle: deque[_Connection] = deque()

    def put(self, conn: _Connection) -> None:
        if self.client.closed:  # a call that ended after its client closed: nothing would sweep or close it
            conn.close()
            return
        self.idle.append(conn)
        if len(self.idle) > self.client.max_idle:
            self.idle.popleft().close()
        self.client._sweep_soon()

    async def connection(self) -> _Connection:
        idle = self.idle
        client = self.client
        loop = asyncio.get_running_loop()
        if idle:
            fresh_since = loop.time() - client.idle_timeout_s
            while idle:
                conn = idle.pop()
                if not conn.closed and not conn.transport.is_closing() and conn.idle_since > fresh_since:
                    conn.reused = True
                    return conn
                conn.close()  # closed by the server while idle, or idle too long: dropped, nothing was sent on it
        try:
            async with asyncio.timeout(client.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(loop, self, client.read_timeout_s),
                                                       self.host, self.port, ssl=self.ssl)
        except TimeoutError:
            raise UpstreamConnectError(f"no connection to {self.host}:{self.port} within {client.connect_timeout_s:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamConnectError(f"no connection to {self.host}:{self.port}: {exc}") from None
        return conn


class UpstreamClient:
    """Keep-alive connections to replicas, one pool per address; one per event loop."""

    def __init__(self, *, connect_timeout_s: float = CONNECT_TIMEOUT_S, read_timeout_s: float = READ_TIMEOUT_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, max_idle: int = MAX_IDLE_PER_HOST):
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle = max_idle
        self.closed = False
        self._pools: dict[str, _Pool] = {}
        self._sweeper: asyncio.TimerHandle | None = None

    def _pool(self, address: str) -> _Pool:
        pool = self._pools.get(address)
        if pool is None:
            parts = urlsplit(address)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise UpstreamConnectError(f"not an http(s) address: {address!r}")
            pool = self._pools[address] = _Pool(self, parts.scheme, parts.hostname,
                                                 parts.port or (443 if parts.scheme == "https" else 80), parts.path)
        return pool

    async def post(self, address: str, path: str, body: bytes, headers: dict[str, str], *, patience=None,
                   first_byte_timeout_s: float | None = None, patience_until_body: bool = False,
                   first_event_told: bool = False) -> Response:
        """POST `body` to `address` + `path`; the `Response` once its status line and headers are in.

        Raises `UpstreamError` (`engine_cannot_have_started` when it is safe to send again elsewhere: nothing was
        sent; `before_first_byte` also when the replica closed the connection before answering, `reset_before_answer`
        when it reset it). `patience`, `patience_until_body`, `first_event_told`: see `Response`; `first_byte_timeout_s`: the silence
        before that first byte after which `patience` is asked (or, without it, the call times out); the read
        timeout where not given."""
        pool = self._pool(address)
        head = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
        if head.count("\n") != len(headers) or head.count("\r") != len(headers):
            # NOTE: a line break in a name or value would be a header (or a request) of its own.
            raise MalformedRequest("a header name or value holds a line break")
        conn = await pool.connection()
        response = conn.send(b"".join((b"POST ", pool.prefix, path.encode("latin-1"), b" HTTP/1.1\r\n", pool.head,
                                       f"{head}content-length: {len(body)}\r\n\r\n".encode("latin-1"), body)),
                             patience, first_byte_timeout_s, patience_until_body, first_event_told)
        try:
            while not response._headers_seen:
                if response._error is not None:
                    raise response._error
                await response._wait()
        except BaseException:
            conn.abandon(response)  # cancelled or failed while waiting: never reused
            raise
        return response

    def _sweep_soon(self) -> None:
        if self._sweeper is None and not self.closed:
            self._sweeper = asyncio.get_running_loop().call_later(self.idle_timeout_s / 2, self._sweep)

    def _sweep(self) -> None:
        """Closes connections idle longer than `idle_timeout_s`."""
        self._sweeper = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() - self.idle_timeout_s
        any_left = False
        for pool in self._pools.values():
            idle = pool.idle
            while idle and (idle[0].idle_since <= deadline or idle[0].closed):
                idle.popleft().close()
            idle_now = [c for c in idle if not c.closed]
            if len(idle_now) != len(idle):
                pool.idle = deque(idle_now)
            any_left = any_left or bool(pool.idle)
        if any_left:
            self._sweep_soon()

    def num_idle(self, address: str) -> int:
        pool = self._pools.get(address)
        return sum(not c.closed for c in pool.idle) if pool else 0

    async def close(self) -> None:
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for pool in self._pools.values():
            while pool.idle:
                pool.idle.pop().close()
        self._pools.clear()
