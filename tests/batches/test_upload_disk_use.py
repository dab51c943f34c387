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


def held_files(pid: int, folder: Path) -> dict[int, int]:
    """The files (inode: bytes) a process holds under `folder`: its open files there (Django's temporary files are
    unnamed, `O_TMPFILE`) and those named there."""
    sizes = {}
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            if os.readlink(f"{fd_dir}/{fd}").startswith(str(folder)):
                stat = os.stat(f"{fd_dir}/{fd}")
                sizes[stat.st_ino] = stat.st_size
        except OSError:
            continue  # closed meanwhile
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                stat = os.stat(os.path.join(root, name))
                sizes[stat.st_ino] = stat.st_size
            except OSError:
                continue
    return sizes


class DiskSampler:
    """The most bytes a process held at once in files under `folder` (`held_files`), sampled every few milliseconds."""

    def __init__(self, pid: int, folder: Path):
        self.pid, self.folder, self.peak_bytes = pid, folder, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, sum(held_files(self.pid, self.folder).values()))
            time.sleep(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def web_temporary(tmp_path_factory) -> Path:
    """The web servers' temporary folder, the module's (one environment, one zygote: `WebZygote.for_env`): each test's
    server is a process of its own, and the files it holds there are told apart by its pid (`held_files`)."""
    return tmp_path_factory.mktemp("web-tmp")


@pytest.fixture
def web(files_bucket, transactional_db, tmp_path, web_zygote, web_temporary):
    """A web server whose temporary files go to the module's folder."""
    temporary = web_temporary
    child, base_url = start_web_server(tmp_path, name="web", zygote=web_zygote, extra_env={
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
    """An upload whose client sent its headers and the first 3 MiB of its body (past what Django keeps in memory),
    then waits."""
    host, port = web.base_url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)))
    connection.sendall(f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                       f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: {declared}\r\n\r\n".encode()
                       + b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"r.jsonl\"\r\n\r\n"
                       + b"x" * (3 * MiB))
    return connection


def test_uploads_past_what_one_process_may_read_at_once_are_refused_with_429_until_one_ends(web, tenant):
    """Before, any number of uploads went on at once: two of 70 MiB passed the pod's 256 MiB `/tmp`."""
    from tests.gateway.conftest import new_tenant

    # NOTE: two organisations': one may not take the last place (tests/batches/test_upload_fairness.py).
    held = [_held_upload(web, key, declared=32 * MiB) for key in (tenant.key, new_tenant().key)]
    wait_until(lambda: len(held_files(web.pid, web.temporary)) == 2, 10, message="both held uploads to be spooled")

    refused = _upload(web, tenant.key, LINE)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1

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


def test_an_upload_past_what_its_organisations_storage_quota_has_left_is_refused_before_its_body_is_written(
        web, tenant, files_bucket):
    """Before, the quota was checked once Django had written the whole body to the pod's disk (twice)."""
    from tests.batches.test_files_api import _on_plan

    _on_plan(tenant.org, max_file_bytes=MiB)
    with DiskSampler(web.pid, web.temporary) as disk:
        answer = _upload(web, tenant.key, _file_of(4 * MiB))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "storage_quota_exceeded" and answer.json()["error"]["param"] == "file"
    assert disk.peak_bytes < 64 * 1024, f"{disk.peak_bytes / MiB:.1f} MiB on disk"
    assert bucket_objects(files_bucket) == {}
    assert _upload(web, tenant.key, _file_of(MiB // 2)).status_code == 200  # one it has room for goes on


def test_an_upload_with_a_bad_idempotency_key_is_refused_before_its_body_is_written(web, tenant, files_bucket):
    """Before, the gateway let it through, and the view refused the key once Django had written the whole body (up to
    200 MiB) to the pod's disk."""
    from endpoints.batches.models import IdempotentRequest

    with DiskSampler(web.pid, web.temporary) as disk:
        answer = httpx.post(f"{web.base_url}/v1/files", files={"file": ("r.jsonl", _file_of(4 * MiB))},
                            data={"purpose": "batch"}, timeout=60,
                            headers={"authorization": f"Bearer {tenant.key}", "idempotency-key": "k" * 256})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "invalid_idempotency_key", "Idempotency-Key", "invalid_request_error")
    assert disk.peak_bytes < 64 * 1024, f"{disk.peak_bytes / MiB:.1f} MiB on disk"
    assert bucket_objects(files_bucket) == {} and not IdempotentRequest.objects.exists()


def _held_body(web, method: str, path: str, headers: str) -> socket.socket:
    """A request whose client sent its headers (a 200 MiB body declared) and 12 MiB of its body, then waits."""
    host, port = web.base_url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)))
    connection.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Content-Type: application/json\r\n"
                       f"Content-Length: {200 * MiB}\r\n\r\n".encode())
    try:
        for _ in range(12):
            connection.sendall(b"x" * MiB)
    except OSError:
        pass  # the server answered and closed: what it has read is all it read
    return connection


@pytest.mark.parametrize(("method", "path"), [("PUT", "/v1/files"), ("PATCH", "/v1/files/file-abc"),
                                              ("POST", "/v1/batches"), ("GET", "/v1/batches")])
def test_a_body_to_the_files_or_batch_api_that_is_no_upload_is_never_spooled_with_or_without_a_key(
        web, tenant, method, path):
    """Before, only an upload (`POST /v1/files`) was checked before Django read its body: a `PUT` or `PATCH` to
    `/v1/files`, or any body sent to `/v1/batches`, had Django spool as much as the ingress let through (200 MiB) to the
    web pod's disk, with no key at all, and the connection held open (seven such filled the pod's `/tmp`)."""
    for headers in ("", f"Authorization: Bearer {tenant.key}\r\n"):
        with DiskSampler(web.pid, web.temporary) as disk:
            connection = _held_body(web, method, path, headers)
            connection.settimeout(10)
            answer = connection.recv(4096).decode(errors="replace")
            connection.close()
        assert answer.startswith("HTTP/1.1 401" if not headers else "HTTP/1.1 413"), answer[:200]
        assert disk.peak_bytes < MiB, f"{disk.peak_bytes / MiB:.1f} MiB spooled for a {method} {path}"


def test_the_batch_api_still_takes_its_own_bodies(web, tenant):
    created = httpx.post(f"{web.base_url}/v1/batches", headers={"authorization": f"Bearer {tenant.key}"},
                         json={"input_file_id": "file-none", "endpoint": "/v1/chat/completions",
                               "completion_window": "24h"}, timeout=30)
    assert created.status_code in (400, 404) and created.json()["error"]["message"], created.text
    listed = httpx.get(f"{web.base_url}/v1/batches", headers={"authorization": f"Bearer {tenant.key}"}, timeout=30)
    assert listed.status_code == 200 and listed.json()["object"] == "list"
    assert httpx.get(f"{web.base_url}/v1/batches", timeout=30).status_code == 401


@pytest.mark.parametrize(("method", "path"), [("POST", "/login/"), ("POST", "/api/v1/endpoints/"),
                                              ("POST", "/console/batches"), ("PUT", "/console/batches/"),
                                              ("POST", "/agent/v1/heartbeat/"), ("POST", "/no/such/page")])
def test_a_body_to_any_other_page_is_never_spooled_past_what_django_reads_in_memory(web, method, path):
    """Before, only the Files and Batch APIs and the console's batch form were cut before Django read a body: a body
    posted to any other path (the log-in page, the management API, a page that does not exist), by anyone, had Django
    spool as much as the ingress let through to the web pod's disk before any view ran, the connection held open
    (found by the review of console uploads). Such bodies are now cut at Django's own `DATA_UPLOAD_MAX_MEMORY_SIZE`,
    below which they stay in memory."""
    with DiskSampler(web.pid, web.temporary) as disk:
        connection = _held_body(web, method, path, "")
        connection.settimeout(10)
        answer = b""
        while b"larger than" not in answer and (piece := connection.recv(4096)):  # the server closes after it
            answer += piece
        connection.close()
    assert answer.startswith(b"HTTP/1.1 413") and b'{"detail": "The request body is larger than' in answer, answer[:300]
    assert disk.peak_bytes < MiB, f"{disk.peak_bytes / MiB:.1f} MiB spooled for a {method} {path}"


def test_a_body_that_declares_no_length_to_any_other_page_is_cut_at_the_bound(web):
    def body():
        for _ in range(12):
            yield b"x" * MiB

    try:
        answer = httpx.post(f"{web.base_url}/api/v1/endpoints/", content=body(), timeout=30,
                            headers={"content-type": "application/json"})
    except httpx.TransportError:
        return  # the server answered and closed the connection while the body was still being sent
    assert answer.status_code == 413 and "larger than" in answer.json()["detail"], answer.text


def test_ordinary_pages_still_take_their_bodies(web):
    page = httpx.get(f"{web.base_url}/login/", timeout=30)
    assert page.status_code == 200
    refused = httpx.post(f"{web.base_url}/login/", data={"username": "nobody@example.com", "password": "x" * 10},
                         timeout=30)
    assert refused.status_code in (200, 403)  # the form again, or the CSRF refusal: Django read the body either way
    api = httpx.post(f"{web.base_url}/api/v1/endpoints/", json={"name": "x" * (1024 * 1024)}, timeout=30)
    assert api.status_code in (401, 403), api.text  # a 1 MiB body reaches the API, which wants a key


@pytest.fixture
def impatient(files_bucket, transactional_db, tmp_path, web_zygote):
    """A web server that stops reading a body after 0.5 s without a byte."""
    child, base_url = start_web_server(tmp_path, name="web", extra_env={"INFERPLANE_FILES_UPLOAD_IDLE_S": "0.5"},
                                       zygote=web_zygote)
    child.base_url = base_url
    yield child
    child.stop()


@pytest.mark.parametrize(("path", "status"), [("/login/", b"413"), ("/v1/files", b"401"), ("/v1/batches", b"401")])
def test_a_refused_body_that_stops_coming_never_holds_its_connection(impatient, path, status):
    """Before, a body refused before Django (past the pages' bound, or without a key) was read on to drop it, with no
    deadline: anyone who declared a large body, sent a few bytes and then nothing held the connection open for as long
    as they liked (found by the review of this change)."""
    host, port = impatient.base_url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)))
    connection.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {200 * MiB}\r\n\r\n".encode() + b"{}" * 5)
    connection.settimeout(15)
    started = time.monotonic()
    answer = connection.recv(4096)
    connection.close()
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
    assert time.monotonic() - started < 10
