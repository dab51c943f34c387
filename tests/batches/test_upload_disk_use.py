"""What an upload to `/v1/files` costs the web pod's disk: its `/tmp` is a volume of fixed size (infra/k8s/base/web.yaml)
that, once passed, has the pod evicted with every tenant's calls on it. An upload holds at most one copy of its body
there; a process reads at most `INFERPLANE_FILES_UPLOADS_PER_PROCESS` at once; one that could never be stored is
refused before its body is written."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.batches.conftest import bucket_objects
from tests.conftest import start_web_server, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

MiB = 1024 * 1024
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'


def _file_of(num_bytes: int) -> bytes:
    return (LINE * (num_bytes // len(LINE) + 1))[:num_bytes]


class DiskSampler:
    """The most bytes a process held at once in files under `folder`: its open files there (Django's temporary files
    are unnamed, `O_TMPFILE`) and those named there, sampled every few milliseconds."""

    def __init__(self, pid: int, folder: Path):
        self.pid, self.folder, self.peak_bytes = pid, str(folder), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _held_bytes(self) -> int:
        sizes = {}
        fd_dir = f"/proc/{self.pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                if os.readlink(f"{fd_dir}/{fd}").startswith(self.folder):
                    stat = os.stat(f"{fd_dir}/{fd}")
                    sizes[stat.st_ino] = stat.st_size
            except OSError:
                continue  # closed meanwhile
        for root, _, names in os.walk(self.folder):
            for name in names:
                try:
                    stat = os.stat(os.path.join(root, name))
                    sizes[stat.st_ino] = stat.st_size
                except OSError:
                    continue
        return sum(sizes.values())

    def _run(self):
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._held_bytes())
            time.sleep(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.fixture
def web(files_bucket, transactional_db, tmp_path):
    """A web server whose temporary files go to a folder of the test's own."""
    temporary = tmp_path / "web-tmp"
    temporary.mkdir()
    child, base_url = start_web_server(tmp_path, name="web", extra_env={
        "TMPDIR": str(temporary), "INFERPLANE_FILES_MAX_BYTES": str(64 * MiB), "INFERPLANE_FILES_UPLOADS_PER_PROCESS": "2"})
    child.temporary = temporary
    child.base_url = base_url
    yield child
    child.stop()


def test_an_upload_holds_at_most_one_copy_of_its_body_on_the_web_servers_disk(web, tenant, files_bucket):
    """Before, Django's ASGI handler spooled the body to a temporary file and its multipart parser wrote the file a
    second time beside it: a 130 MiB upload passed the pod's 256 MiB `/tmp` and had the pod evicted."""
    data = _file_of(10 * MiB)
    with DiskSampler(web.pid, web.temporary) as disk:
        answer = httpx.post(f"{web.base_url}/v1/files", headers={"authorization": f"Bearer {tenant.key}"},
                            files={"file": ("big.jsonl", data)}, data={"purpose": "batch"}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["bytes"] == len(data)
    assert list(bucket_objects(files_bucket).values()) == [data]
    assert disk.peak_bytes >= len(data)  # the sampler saw the body's own copy: it measures what it should
    assert disk.peak_bytes < len(data) + MiB, f"{disk.peak_bytes / MiB:.1f} MiB on disk for a 10 MiB upload"


def _upload(web, key: str, data: bytes) -> httpx.Response:
    return httpx.post(f"{web.base_url}/v1/files", headers={"authorization": f"Bearer {key}"},
                      files={"file": ("r.jsonl", data)}, data={"purpose": "batch"}, timeout=60)


def _held_upload(web, key: str, *, declared: int) -> socket.socket:
    """An upload whose client sent its headers and the first 64 KiB of its body, then waits."""
    host, port = web.base_url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)))
    connection.sendall(f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                       f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: {declared}\r\n\r\n".encode()
                       + b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"r.jsonl\"\r\n\r\n"
                       + b"x" * 65_536)
    return connection


def test_uploads_past_what_one_process_may_read_at_once_are_refused_with_429_until_one_ends(web, tenant):
    """Before, any number of uploads went on at once: two of 70 MiB passed the pod's 256 MiB `/tmp`."""
    held = [_held_upload(web, tenant.key, declared=32 * MiB) for _ in range(2)]
    refusals = []

    def third_refused():
        answer = _upload(web, tenant.key, LINE)
        refusals.append(answer)
        return answer.status_code == 429

    wait_until(third_refused, 10, message="a third upload at once to be refused")
    refused = refusals[-1]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert all(answer.status_code == 429 for answer in refusals)  # never stored while two were read

    for connection in held:
        connection.close()
    wait_until(lambda: _upload(web, tenant.key, LINE).status_code == 200, 10,
               message="an upload to go on once the held ones ended")


def test_a_body_that_declares_no_length_is_cut_at_the_size_limit_before_it_fills_the_disk(web, tenant, files_bucket):
    """Before, Django spooled a chunked body whole, however large, before the size limit was checked."""
    def body():
        yield b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"r.jsonl\"\r\n\r\n"
        for _ in range(96):
            yield b"x" * MiB

    answer = None
    with DiskSampler(web.pid, web.temporary) as disk:
        try:
            answer = httpx.post(f"{web.base_url}/v1/files", content=body(), timeout=60, headers={
                "authorization": f"Bearer {tenant.key}", "content-type": "multipart/form-data; boundary=b"})
        except httpx.TransportError:
            pass  # the server answered and closed the connection while the body was still being sent
    assert disk.peak_bytes <= 64 * MiB + MiB, f"{disk.peak_bytes / MiB:.1f} MiB on disk"
    if answer is not None:
        assert answer.status_code == 413 and "larger than" in answer.json()["error"]["message"], answer.text
    assert bucket_objects(files_bucket) == {}
