"""What an upload to `/v1/files` costs the web pod's disk: its `/tmp` is a volume of fixed size (infra/k8s/base/web.yaml)
that, once passed, has the pod evicted with every tenant's calls on it. An upload holds at most one copy of its body
there; a process reads at most `INFERPLANE_FILES_UPLOADS_PER_PROCESS` at once; one that could never be stored is
refused before its body is written."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.batches.conftest import bucket_objects
from tests.conftest import start_web_server

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
        "TMPDIR": str(temporary), "INFERPLANE_FILES_MAX_BYTES": str(64 * MiB)})
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
