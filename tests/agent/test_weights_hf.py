"""`hf:org/name@revision` through huggingface_hub against a tiny local Hub mirror (the real Hub is unreachable)."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from gpu_agent.runtime.weights import WeightsCache

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Serves one model repo the way the Hub's REST API does, enough for snapshot_download."""

    @staticmethod
    def digest_of(name: str, body: bytes) -> dict:
        if name.endswith(".safetensors"):  # stored with LFS on the Hub
            return {"lfs": {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}}
        return {"blobId": hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()}

    def __init__(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        token: str | None = None,
        listed_sizes: dict[str, int] | None = None,
        ranges: bool = False,
        digests: bool = False,
    ) -> None:
        self.repo_id, self.files = repo_id, files
        self.ranges = ranges  # answer `Range` with 206 like the Hub's CDN (else the whole file, 200)
        self.digests = digests  # list LFS SHA-256s and git blob ids like the Hub's `blobs=true`
        self.served = dict(files)  # what file downloads send (a corrupting mirror differs from `files`)
        self.ranged_requests: list[str] = []
        self.listed_sizes = listed_sizes or {}  # what the repo info claims, where it lies
        self.token = token  # when set, the repo is private: other callers get the Hub's 401
        self.authorizations: list[str | None] = []  # the Authorization header of every request
        self.num_file_downloads = 0
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

            def send(self, status, body=b"", headers=None, head=False):
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def route(self, head: bool):
                path = unquote(urlparse(self.path).path)
                hub.authorizations.append(self.headers.get("Authorization"))
                if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self.send(401, b"{}", {"X-Error-Code": "RepoNotFound"}, head)
                api = f"/api/models/{hub.repo_id}"
                if path.startswith(f"{api}/revision/"):
                    siblings = [
                        {"rfilename": name, "size": hub.listed_sizes.get(name, len(body))}
                        | (hub.digest_of(name, body) if hub.digests else {})
                        for name, body in hub.files.items()
                    ]
                    info = {"id": hub.repo_id, "modelId": hub.repo_id, "sha": COMMIT, "siblings": siblings}
                    return self.send(
                        200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head
                    )
                if path.startswith(f"{api}/tree/"):
                    tree = [
                        {
                            "type": "file",
                            "path": name,
                            "size": len(body),
                            "oid": hashlib.sha1(body).hexdigest(),
                        }
                        for name, body in hub.files.items()
                    ]
                    return self.send(
                        200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head
                    )
                prefix = f"/{hub.repo_id}/resolve/"
                if path.startswith(prefix):
                    _revision, _, name = path[len(prefix) :].partition("/")
                    if name not in hub.files:
                        return self.send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                    body = hub.served[name]
                    headers = {
                        "X-Repo-Commit": COMMIT,
                        "ETag": f'"{hashlib.sha1(body).hexdigest()}"',
                        "Content-Type": "application/octet-stream",
                    }
                    if not head:
                        hub.num_file_downloads += 1
                    wanted = self.headers.get("Range", "")
                    if hub.ranges and wanted.startswith("bytes=") and body:
                        first, _, last = wanted[len("bytes="):].partition("-")
                        start, end = int(first), min(int(last), len(body) - 1)
                        hub.ranged_requests.append(f"{name}:{start}-{end}")
                        headers["Content-Range"] = f"bytes {start}-{end}/{len(body)}"
                        return self.send(206, body[start : end + 1], headers, head)
                    return self.send(200, body, headers, head)
                return self.send(404, b"{}", {"X-Error-Code": "RepoNotFound"}, head)

            def do_HEAD(self):
                self.route(head=True)

            def do_GET(self):
                self.route(head=False)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()


@pytest.fixture
def hub(tiny_model_dir):
    files = {path.name: path.read_bytes() for path in Path(tiny_model_dir).iterdir() if path.is_file()}
    fake = FakeHub("inferplane/tiny", files)
    yield fake
    fake.server.shutdown()


def test_hf_model_downloads_from_a_mirror_once(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    cache = WeightsCache(tmp_path / "weights", hf_endpoint=hub.url)
    path = cache.fetch("hf:inferplane/tiny@main")
    for name, body in hub.files.items():
        assert (path / name).read_bytes() == body
    assert not (path / ".cache").exists()
    assert cache.fetch("hf:inferplane/tiny@main") == path
    assert cache.num_downloads == 1 and hub.num_file_downloads == len(hub.files)
    [status] = cache.statuses()
    assert status.complete and status.size_bytes == sum(len(body) for body in hub.files.values())
