"""A file's download (`/v1/files/<id>/content`, the console's download link) streams from S3 a chunk at a time through
the web process: never the whole file in its memory, whatever the file's size."""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import threading
import time

import pytest
import urllib3
from botocore.response import StreamingBody

from controlplane.asgi import application
from endpoints.batches import services, storage
from tests.batches.conftest import peak_bytes_while

pytestmark = pytest.mark.django_db(transaction=True)

MiB = 1024 * 1024
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'


async def _download(path: str, key: str) -> tuple[int, int]:
    """The status and the number of body bytes the ASGI application answers `path` with (none of them kept)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), (b"authorization", f"Bearer {key}".encode())],
        "client": ("10.1.2.3", 40000),
        "server": ("testserver", 80),
    }
    requests = [{"type": "http.request", "body": b"", "more_body": False}]
    answer = {"status": 0, "num_bytes": 0}

    async def receive():
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # the client stays until the answer ends

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        else:
            answer["num_bytes"] += len(message.get("body", b""))

    await application(scope, receive, send)
    return answer["status"], answer["num_bytes"]


def test_a_files_download_never_holds_the_whole_file_in_memory(tenant, files_bucket):
    """Before, Django read the whole object into a list before its first byte went out (a synchronous iterator under
    ASGI): a download of an 8 MB file took the process's memory up by 180 MB, to 450 MB (glibc kept each request
    thread's arena), and a few large output files downloaded at once took the pod past its memory limit."""
    data = (LINE * (16 * MiB // len(LINE) + 1))[: 16 * MiB]
    file = services.create_file(
        organization_id=tenant.org.pk,
        purpose="batch",
        filename="in.jsonl",
        stream=io.BytesIO(data),
        size=len(data),
    )
    answered = {}

    def download():
        answered["status"], answered["num_bytes"] = asyncio.run(
            _download(f"/v1/files/{file.pk}/content", tenant.key)
        )

    peak_bytes = peak_bytes_while(download)
    assert answered == {"status": 200, "num_bytes": len(data)}
    assert peak_bytes < 4 * MiB, peak_bytes


def test_a_download_cut_while_s3_stalls_never_blocks_the_event_loop():
    # Before, the cut download's body was closed on the event loop while a worker thread was still in its read,
    # holding the socket's reader lock: the loop (every request of the process) stood still until S3 answered or
    # botocore's read timeout (60 s) passed: 29.5 s here, for a stall of 30 s.
    listener = socket.create_server(("127.0.0.1", 0))
    stalled = threading.Event()

    def stalling_s3() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10000000\r\n\r\n" + b"x" * 70_000)
            stalled.wait(30)  # an object that stops coming mid-way

    threading.Thread(target=stalling_s3, daemon=True).start()
    raw = urllib3.PoolManager().request("GET", f"http://127.0.0.1:{listener.getsockname()[1]}/k",
                                        preload_content=False, timeout=urllib3.Timeout(read=60))
    body = StreamingBody(raw, 10_000_000)

    async def cut_mid_read() -> float:
        gaps, last = [], time.monotonic()

        async def beat() -> None:
            nonlocal last
            while True:
                await asyncio.sleep(0.05)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        beating = asyncio.create_task(beat())
        chunks = storage._chunks_of(body)
        await chunks.__anext__()
        reading = asyncio.create_task(chunks.__anext__())  # its read stalls in a worker thread
        await asyncio.sleep(0.5)
        reading.cancel()  # the client left: Django cancels the answer's task
        with contextlib.suppress(asyncio.CancelledError):
            await reading
        await asyncio.sleep(0.3)
        beating.cancel()
        return max(gaps)

    try:
        assert asyncio.run(cut_mid_read()) < 2
    finally:
        stalled.set()
        listener.close()


def test_a_download_cut_as_its_last_chunk_went_closes_quietly():
    # Before, urllib3 had already given the connection back to its pool, and cutting the read raised RuntimeError in
    # the stream's `finally` (a traceback for each such download, in place of the client's going).
    listener = socket.create_server(("127.0.0.1", 0))

    def s3() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789")
            connection.recv(10)

    threading.Thread(target=s3, daemon=True).start()
    raw = urllib3.PoolManager().request("GET", f"http://127.0.0.1:{listener.getsockname()[1]}/k",
                                        preload_content=False)
    body = StreamingBody(raw, 10)

    async def cut_after_the_last_chunk() -> bytes:
        chunks = storage._chunks_of(body)
        first = await chunks.__anext__()  # the whole object
        await chunks.aclose()  # the client left as it went
        return first

    try:
        assert asyncio.run(cut_after_the_last_chunk()) == b"0123456789"
    finally:
        listener.close()
