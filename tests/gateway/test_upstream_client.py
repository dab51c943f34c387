"""The gateway's HTTP/1.1 client to its replicas (`endpoints.gateway.upstream`), against real sockets."""

import asyncio
import socket

import pytest
import uvloop

from endpoints.gateway import upstream
from endpoints.gateway.upstream import UpstreamClient
from tests.fakes.closing_engine import ClosingEngine

SSE = [b"data: {\"n\": %d}\n\n" % i for i in range(5)] + [b"data: [DONE]\n\n"]


def _chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return head + await reader.readexactly(length)


class Server:
    """A replica on a real socket whose `handle(reader, writer, state)` answers each connection."""

    def __init__(self, handle):
        self.handle, self.connections, self.requests, self.closed = handle, 0, [], asyncio.Event()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            await self.handle(reader, writer, self)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()


def run(coro):
    return uvloop.run(coro)


async def _keep_alive(reader, writer, server):
    while True:
        server.requests.append(await _read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()


def test_one_connection_serves_request_after_request_and_the_request_goes_out_whole():
    async def main():
        async with Server(_keep_alive) as server:
            client = UpstreamClient()
            for i in range(3):
                response = await client.post(server.address, "/v1/chat/completions", b'{"a": 1}',
                                             {"content-type": "application/json", "x-request-id": f"r{i}"})
                assert (response.status, await response.read()) == (200, b"{}")
                response.close()
            assert server.connections == 1
            assert client.num_idle(server.address) == 1
            first = server.requests[0]
            assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
            assert b"\r\nx-request-id: r0\r\n" in first and b"\r\ncontent-length: 8\r\n" in first
            assert first.endswith(b'\r\n\r\n{"a": 1}')
            await client.close()
    run(main())


def test_an_idle_connection_the_server_closed_is_dropped_and_the_next_request_dials_anew():
    async def answer_once(reader, writer, server):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()  # then closes, as an engine's keep-alive timeout does

    async def main():
        async with Server(answer_once) as server:
            client = UpstreamClient()
            response = await client.post(server.address, "/", b"{}", {})
            assert await response.read() == b"{}"
            await server.closed.wait()
            await asyncio.sleep(0.05)  # the FIN reaches the pooled connection
            response = await client.post(server.address, "/", b"{}", {})
            assert await response.read() == b"{}"
            assert server.connections == 2
            await client.close()
    run(main())


def test_a_pooled_connection_closed_under_a_request_fails_before_the_first_byte_and_is_not_resent():
    # The race an idle timeout leaves: the server closes just as the request goes out. The client says
    # "nothing arrived" (the gateway then tries elsewhere) and never sends the request again itself.
    async def close_after_first_request(reader, writer, server):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        server.requests.append(await _read_request(reader))  # the second request: read, then dropped unanswered

    async def main():
        async with Server(close_after_first_request) as server:
            client = UpstreamClient()
            assert await (await client.post(server.address, "/", b"{}", {})).read() == b"{}"
            with pytest.raises(upstream.UpstreamClosed) as failure:
                await client.post(server.address, "/", b"{}", {})
            assert failure.value.before_first_byte
            assert len(server.requests) == 1 and server.connections == 1
            await client.close()
    run(main())


async def _closed_under(address: str, before=lambda: None) -> upstream.UpstreamError:
    """The failure of a request sent on a new connection to `address`, `before` run once it went out."""
    client = UpstreamClient()
    asyncio.get_running_loop().call_later(0.1, before)
    try:
        with pytest.raises(upstream.UpstreamClosed) as failure:
            await client.post(address, "/", b"{}", {})
        return failure.value
    finally:
        await client.close()


def test_a_new_connection_its_server_closed_with_the_request_unread_fails_as_reset_before_the_answer():
    # uvicorn's graceful shutdown closes a connection it has no call on yet: its kernel resets it, the request unread.
    # Sent again only where its replica is no longer READY (a middlebox's reset looks the same: `_forward`).
    failure = run(_closed_under(ClosingEngine(lambda number, body: True, unread=True).address))
    assert failure.before_first_byte and not failure.on_reused_connection
    assert upstream.reset_before_answer(failure) and not upstream.engine_cannot_have_started(failure)


def test_a_new_connection_queued_on_a_listener_that_closed_fails_as_reset_before_the_answer():
    # uvicorn's graceful shutdown closes its listening socket first: a connection its kernel took and nobody accepted
    listener = socket.create_server(("127.0.0.1", 0))
    failure = run(_closed_under(f"http://127.0.0.1:{listener.getsockname()[1]}", listener.close))
    assert failure.before_first_byte and upstream.reset_before_answer(failure)


def test_a_connection_closed_plainly_after_its_request_was_read_is_never_sent_elsewhere():
    # An engine that read the request and died: it may have computed it
    failure = run(_closed_under(ClosingEngine(lambda number, body: True).address))
    assert failure.before_first_byte and not upstream.reset_before_answer(failure)
    assert not upstream.engine_cannot_have_started(failure)


def test_a_server_that_dies_mid_body_fails_the_read_and_the_bytes_before_it_are_yielded():
    async def dies(reader, writer, server):
        await _read_request(reader)
        writer.write(STREAM_HEAD + _chunked(SSE[:2])[:-5])  # two events, then no end
        await writer.drain()

    async def main():
        async with Server(dies) as server:
            client = UpstreamClient()
            response = await client.post(server.address, "/", b"{}", {})
            received = []
            with pytest.raises(upstream.UpstreamClosed) as failure:
                async for chunk in response.chunks():
                    received.append(chunk)
            assert b"".join(received) + response.arrived_before_failure() == b"".join(SSE[:2])
            assert not failure.value.before_first_byte
            response.close()
            response = await client.post(server.address, "/", b"{}", {})
            with pytest.raises(upstream.UpstreamClosed):
                await response.read()
            assert client.num_idle(server.address) == 0
            await client.close()
    run(main())


def test_a_silent_server_hits_the_read_timeout_before_and_after_its_headers():
    async def stalls(reader, writer, server):
        await _read_request(reader)
        if server.connections == 2:
            writer.write(STREAM_HEAD + _chunked(SSE[:1])[:-5])
            await writer.drain()
        await asyncio.sleep(5)

    async def main():
        async with Server(stalls) as server:
            client = UpstreamClient(read_timeout_s=0.3)
            with pytest.raises(upstream.UpstreamTimeout) as failure:
                await client.post(server.address, "/", b"{}", {})
            assert not failure.value.before_first_byte  # the replica has the request: never safe to send again
            response = await client.post(server.address, "/", b"{}", {})
            chunks = []
            with pytest.raises(upstream.UpstreamTimeout) as failure:
                async for chunk in response.chunks():
                    chunks.append(chunk)
            assert chunks == [SSE[0]] and not failure.value.before_first_byte
            await client.close()
    run(main())


async def _answers_after_a_second(reader, writer, server):
    server.requests.append(await _read_request(reader))
    await asyncio.sleep(1.0)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
    await writer.drain()
    await asyncio.sleep(1)


def test_a_first_byte_later_than_the_read_timeout_is_waited_for_as_long_as_patience_grants():
    asked = []

    async def patience():
        asked.append(asyncio.get_running_loop().time())
        return 0.3

    async def main():
        async with Server(_answers_after_a_second) as server:
            client = UpstreamClient(read_timeout_s=0.3)
            response = await client.post(server.address, "/", b"{}", {}, patience=patience)
            assert await response.read() == b"{}"
            assert 2 <= len(asked) <= 4 and len(server.requests) == 1
            await client.close()
    run(main())


def test_a_first_byte_that_comes_while_patience_is_asked_leaves_the_read_timeout_running():
    # Its timer was spent on the question: an answer whose headers came meanwhile and then stalled hung for ever.
    async def headers_then_stall(reader, writer, server):
        await _read_request(reader)
        await asyncio.sleep(0.35)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 10\r\n\r\n{")
        await writer.drain()
        await asyncio.sleep(5)

    async def slow_patience():
        await asyncio.sleep(0.3)
        return 10.0

    async def main():
        async with Server(headers_then_stall) as server:
            client = UpstreamClient(read_timeout_s=0.2)
            response = await client.post(server.address, "/", b"{}", {}, patience=slow_patience)
            with pytest.raises(upstream.UpstreamTimeout):
                await asyncio.wait_for(response.read(), 3)
            await client.close()
    run(main())


@pytest.mark.parametrize("answer", ["no", "raises"])
def test_a_first_byte_is_given_up_on_when_patience_says_no_or_fails(answer):
    asked = []

    async def patience():
        asked.append(1)
        if len(asked) == 1:
            return 0.2
        if answer == "raises":
            raise RuntimeError("the database is away")
        return None

    async def main():
        async with Server(_answers_after_a_second) as server:
            client = UpstreamClient(read_timeout_s=0.2)
            started = asyncio.get_running_loop().time()
            with pytest.raises(upstream.UpstreamTimeout) as failure:
                await client.post(server.address, "/", b"{}", {}, patience=patience)
            assert not failure.value.before_first_byte
            assert len(asked) == 2 and 0.35 < asyncio.get_running_loop().time() - started < 0.9
            await asyncio.wait_for(server.closed.wait(), 2)  # the connection dropped: the engine aborts its request
            await client.close()
    run(main())


def test_a_slow_stream_within_the_read_timeout_is_never_cut():
    async def slow(reader, writer, server):
        await _read_request(reader)
        writer.write(STREAM_HEAD)
        for part in SSE:
            await asyncio.sleep(0.1)
            writer.write(_chunked([part])[:-5])
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def main():
        async with Server(slow) as server:
            client = UpstreamClient(read_timeout_s=0.25)  # less than the stream, more than a gap
            response = await client.post(server.address, "/", b"{}", {})
            assert b"".join([chunk async for chunk in response.chunks()]) == b"".join(SSE)
            await client.close()
    run(main())


class _Transport:
    def __init__(self):
        self.written, self.closing = [], False

    def write(self, data):
        self.written.append(data)

    def is_closing(self):
        return self.closing

    def close(self):
        self.closing = True


@pytest.mark.parametrize("keep_alive", [True, False])
def test_chunked_sse_split_at_every_byte_boundary_reads_the_same(keep_alive):
    head = STREAM_HEAD if keep_alive else STREAM_HEAD.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")
    wire = head + _chunked(SSE)

    async def main():
        loop = asyncio.get_running_loop()
        client = UpstreamClient()
        pool = client._pool("http://127.0.0.1:1")
        for cut in range(1, len(wire)):
            conn = upstream._Connection(loop, pool, 60)
            conn.connection_made(_Transport())
            response = conn.send(b"POST / HTTP/1.1\r\n\r\n")
            conn.data_received(wire[:cut])
            conn.data_received(wire[cut:])
            assert response.status == 200
            assert b"".join([chunk async for chunk in response.chunks()]) == b"".join(SSE), cut
            assert (conn in pool.idle) is keep_alive and conn.transport.closing is not keep_alive
            pool.idle.clear()
            conn.close()
    run(main())


def test_a_response_larger_than_one_read_arrives_whole():
    body = bytes(range(256)) * (5 * 4096)  # 5 MiB

    async def large(reader, writer, server):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        await _read_request(reader)

    async def main():
        async with Server(large) as server:
            client = UpstreamClient()
            response = await client.post(server.address, "/", b"{}", {})
            assert await response.read() == body
            assert client.num_idle(server.address) == 1
            await client.close()
    run(main())


def test_a_client_gone_mid_stream_closes_the_upstream_connection():
    async def endless(reader, writer, server):
        await _read_request(reader)
        writer.write(STREAM_HEAD)
        while True:
            writer.write(_chunked([SSE[0]])[:-5])
            await writer.drain()
            await asyncio.sleep(0.01)

    async def main():
        async with Server(endless) as server:
            client = UpstreamClient()
            response = await client.post(server.address, "/", b"{}", {})
            async for _chunk in response.chunks():
                break
            response.close()  # what the gateway does once its own client left
            await asyncio.wait_for(server.closed.wait(), 5)  # the engine sees it
            assert client.num_idle(server.address) == 0
            await client.close()
    run(main())


def test_a_refused_connection_is_unavailable_before_the_first_byte():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: refused

    async def main():
        client = UpstreamClient()
        with pytest.raises(upstream.UpstreamConnectError) as failure:
            await client.post(f"http://127.0.0.1:{port}", "/", b"{}", {})
        assert failure.value.before_first_byte
        await client.close()
    run(main())


def test_a_malformed_status_line_is_a_malformed_response_and_its_connection_is_dropped():
    async def garbage(reader, writer, server):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 2x0 NOPE\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def main():
        async with Server(garbage) as server:
            client = UpstreamClient()
            with pytest.raises(upstream.MalformedResponse):
                await client.post(server.address, "/", b"{}", {})
            await asyncio.wait_for(server.closed.wait(), 5)
            assert client.num_idle(server.address) == 0
            await client.close()
    run(main())


def test_idle_connections_are_closed_after_the_idle_timeout():
    async def main():
        async with Server(_keep_alive) as server:
            client = UpstreamClient(idle_timeout_s=0.2)
            assert await (await client.post(server.address, "/", b"{}", {})).read() == b"{}"
            assert client.num_idle(server.address) == 1
            await asyncio.wait_for(server.closed.wait(), 5)
            assert client.num_idle(server.address) == 0
            await client.close()
    run(main())


def test_a_stream_its_reader_does_not_take_stops_being_read_at_the_high_water_mark_and_arrives_whole_once_taken():
    # A slow or hostile client must not make the gateway buffer an engine's whole answer: the
    # connection stops reading above the mark (the replica's writes back up), then goes on.
    parts = [b"data: %s\n\n" % (b"x" * 16_000) for _ in range(200)]  # ~3.2 MB of events

    async def stream(reader, writer, server):
        server.requests.append(await _read_request(reader))
        writer.write(STREAM_HEAD + _chunked(parts))
        await writer.drain()
        await reader.read()

    async def main():
        async with Server(stream) as server:
            client = UpstreamClient()
            response = await client.post(server.address, "/v1/chat/completions", b"{}", {})
            await asyncio.sleep(0.5)  # nothing taken: the replica's bytes wait in the sockets, not here
            assert response._num_buffered <= upstream.HIGH_WATER_BYTES + 256 * 1024
            assert response._conn.paused
            received = b"".join([piece async for piece in response.chunks()])
            assert received == b"".join(parts)
            response.close()
            assert client.num_idle(server.address) == 1
            await client.close()
    run(main())


def test_a_whole_answer_read_at_once_is_not_held_back_by_the_high_water_mark():
    body = b"{" + b'"x": "' + b"y" * 2_000_000 + b'"}'

    async def big(reader, writer, server):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        await _keep_alive(reader, writer, server)

    async def main():
        async with Server(big) as server:
            client = UpstreamClient(read_timeout_s=5)
            response = await client.post(server.address, "/v1/chat/completions", b"{}", {})
            await asyncio.sleep(0.3)
            assert await response.read() == body
            response.close()
            again = await client.post(server.address, "/v1/chat/completions", b"{}", {})  # the same connection, reading
            assert (again.status, await again.read()) == (200, b"{}")
            assert server.connections == 1
            await client.close()
    run(main())


@pytest.mark.parametrize("headers", [{"x-request-id": "r1\r\nx-injected: 1"}, {"x-request-id": "r1\rx"},
                                     {"x-a\nb": "1"}])
def test_a_header_with_a_line_break_is_refused_before_anything_is_sent(headers):
    async def main():
        async with Server(_keep_alive) as server:
            client = UpstreamClient()
            with pytest.raises(upstream.UpstreamError) as refused:
                await client.post(server.address, "/v1/chat/completions", b"{}", headers)
            assert refused.value.before_first_byte
            assert server.connections == 0 and server.requests == []
            await client.close()
    run(main())


def test_a_whole_answer_past_the_limit_fails_the_read_and_drops_its_connection(monkeypatch):
    # A non-streamed answer is held whole; one of hundreds of MB (n: 16 with logprobs over a long
    # context) took the gateway process's memory, and every other tenant's calls on it, with it.
    monkeypatch.setattr(upstream, "MAX_WHOLE_BODY_BYTES", 1_000_000)
    body = b'{"x": "' + b"y" * 3_000_000 + b'"}'

    async def huge(reader, writer, server):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
        writer.write(body)
        await writer.drain()
        await reader.read()  # until the client drops the connection

    async def main():
        async with Server(huge) as server:
            client = UpstreamClient(read_timeout_s=5)
            response = await client.post(server.address, "/v1/chat/completions", b"{}", {})
            with pytest.raises(upstream.ResponseTooLarge):
                await response.read()
            response.close()
            await asyncio.wait_for(server.closed.wait(), 5)
            assert client.num_idle(server.address) == 0
            await client.close()
    run(main())


@pytest.mark.parametrize("body_first", [True, False], ids=["in-before-the-read", "in-pieces-during-it"])
def test_a_whole_answer_past_the_limit_read_with_an_overflow_goes_through_it_to_its_end_and_keeps_its_connection(
        monkeypatch, body_first):
    # The gateway reads such an answer to its end for its usage (the engine computed it): every byte reaches the
    # callback, none is held, the read then fails, and the connection, read to its end, is reused.
    monkeypatch.setattr(upstream, "MAX_WHOLE_BODY_BYTES", 10_000)
    body = b'{"x": "' + b"y" * 3_000_000 + b'"}'

    async def huge(reader, writer, server):
        while True:
            server.requests.append(await _read_request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
            for start in range(0, len(body), 100_000):
                writer.write(body[start:start + 100_000])
                await writer.drain()
                await asyncio.sleep(0)

    async def main():
        async with Server(huge) as server:
            client = UpstreamClient(read_timeout_s=5)
            seen = []
            response = await client.post(server.address, "/v1/chat/completions", b"{}", {})
            if body_first:
                await asyncio.sleep(0.3)
            with pytest.raises(upstream.ResponseTooLarge):
                await response.read(overflow=seen.append)
            assert b"".join(seen) == body and response._num_buffered == 0
            response.close()
            assert client.num_idle(server.address) == 1
            again = await client.post(server.address, "/v1/chat/completions", b"{}", {})
            with pytest.raises(upstream.ResponseTooLarge):
                await again.read(overflow=lambda data: None)
            assert server.connections == 1 and len(server.requests) == 2
            await client.close()
    run(main())


@pytest.mark.parametrize("body_first", [True, False], ids=["in-before-the-read", "in-one-piece-during-it"])
def test_a_whole_answer_past_the_limit_that_arrives_in_one_piece_still_fails(monkeypatch, body_first):
    # The parser went on through the same read to the message's end: the answer was marked done and
    # read() returned an empty body, sent on as a 200 billed nothing.
    monkeypatch.setattr(upstream, "MAX_WHOLE_BODY_BYTES", 1_000)
    body = b'{"x": "' + b"y" * 5_000 + b'"}'

    async def whole_at_once(reader, writer, server):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
        if not body_first:
            await asyncio.sleep(0.3)  # the client is reading by now
        writer.write(body)
        await writer.drain()
        await reader.read()

    async def main():
        async with Server(whole_at_once) as server:
            client = UpstreamClient(read_timeout_s=5)
            response = await client.post(server.address, "/v1/chat/completions", b"{}", {})
            if body_first:
                await asyncio.sleep(0.2)  # the whole answer is in before the read
            with pytest.raises(upstream.ResponseTooLarge):
                await response.read()
            response.close()
            assert client.num_idle(server.address) == 0
            await client.close()
    run(main())


@pytest.mark.django_db(transaction=True)
def test_a_gateway_run_by_one_loop_after_another_gives_each_its_own_connections_and_stops_cleanly():
    # The same gateway object served by two event loops in turn (the process's `application` across tests, a script's
    # `asyncio.run`s): before, the second loop was handed the first one's keep-alive connections, whose loop was
    # closed, and its lifespan's shutdown raised "Event loop is closed" closing them (CI failed on it).
    import threading

    from endpoints.gateway.app import Gateway

    listener = socket.create_server(("127.0.0.1", 0))
    address = f"http://127.0.0.1:{listener.getsockname()[1]}"
    held = []

    def replica():  # outside both loops: its connection stays open as the first loop ends
        conn, _ = listener.accept()
        held.append(conn)
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")

    thread = threading.Thread(target=replica, daemon=True)
    thread.start()
    gateway = Gateway(fallback=None)

    async def first_loop():
        response = await gateway.client.post(address, "/v1/x", b"{}", {})
        assert await response.read() == b"{}"
        assert gateway.client.num_idle(address) == 1
        return gateway.client

    try:
        first_client = asyncio.run(first_loop())
        thread.join(5)
        sent = []

        async def receive():
            return {"type": "lifespan.shutdown"}

        async def send(message):
            sent.append(message)

        async def second_loop():
            assert gateway.client is not first_client
            assert gateway.client.num_idle(address) == 0
            await gateway({"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}, receive, send)

        asyncio.run(second_loop())
        assert sent == [{"type": "lifespan.shutdown.complete"}]
        assert first_client.closed  # closed as its own loop ended, its sockets with it
        assert held[0].recv(1) == b""  # the replica saw the first loop's connection closed
    finally:
        for conn in held:
            conn.close()
        listener.close()


def test_a_call_ending_after_its_client_closed_closes_its_connection_rather_than_keeping_it_idle():
    async def main():
        async with Server(_keep_alive) as server:
            client = UpstreamClient()
            response = await client.post(server.address, "/v1/x", b"{}", {})
            await client.close()  # the gateway stops with this call in flight
            assert await response.read() == b"{}"
            assert client.num_idle(server.address) == 0
            await asyncio.wait_for(server.closed.wait(), 5)  # nothing left open for a sweep that will not come

    run(main())
