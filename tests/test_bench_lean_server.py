"""The measuring server of round 29 (`bench/lean_server.py`): what it serves must be the answers uvicorn serves, or
its CPU figures compare nothing. Against the mock: the bare-proxy floor's ASGI app under it (plain and streamed
answers, keep-alive, pipelined requests in order, an oversized body refused) and its floor without ASGI."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import httpx
import pytest

from tests.processes import REPO_ROOT, ChildProcess, free_port, wait_until

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def servers(tmp_path: Path):
    """The mock, the floor's ASGI app under the lean server and the lean server's own floor: their addresses."""
    mock_port, asgi_port, bare_port = free_port(), free_port(), free_port()
    lean = [sys.executable, str(REPO_ROOT / "bench" / "lean_server.py"), "--host", "127.0.0.1"]
    mock = ChildProcess([sys.executable, "-m", "tests.fakes.mock_openai", "--port", str(mock_port)], dict(os.environ),
                        tmp_path / "mock.log")
    mock_url = f"http://127.0.0.1:{mock_port}"
    env = {**os.environ, "BARE_PROXY_UPSTREAM": mock_url}
    asgi = ChildProcess([*lean, "bench.bare_proxy:app", "--port", str(asgi_port)], env, tmp_path / "asgi.log")
    bare = ChildProcess([*lean, "--bare-floor", "--port", str(bare_port)], env, tmp_path / "bare.log")
    urls = (f"http://127.0.0.1:{asgi_port}", f"http://127.0.0.1:{bare_port}")
    try:
        wait_until(lambda: _healthy(mock_url + "/health"), 30, message="the mock")
        for url in urls:
            wait_until(lambda url=url: _healthy(url + "/health"), 30, message=f"the lean server at {url}")
        yield urls
    finally:
        for child in (bare, asgi, mock):
            child.stop()


def _exchange(port: int, raw: bytes, num_answers: int) -> bytes:
    """`raw` written at once on one connection; what came back once `num_answers` answers' heads are in."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        received = b""
        while received.count(b"HTTP/1.1 ") < num_answers or not received.endswith((b"ok", b"\r\n\r\n")):
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        return received


def test_lean_server_answers_as_uvicorn_does(servers):
    asgi_url, bare_url = servers
    with httpx.Client(timeout=10) as client:
        for url in (asgi_url, bare_url):
            first = client.post(url + "/v1/chat/completions", json=CHAT)
            second = client.post(url + "/v1/chat/completions", json=CHAT)  # the same connection, kept alive
            assert first.status_code == second.status_code == 200
            assert first.json()["object"] == "chat.completion"
            assert first.headers["content-type"] == "application/json" and "date" in first.headers
            assert int(first.headers["content-length"]) == len(first.content)
        with client.stream("POST", asgi_url + "/v1/chat/completions", json=CHAT | {"stream": True}) as streamed:
            assert streamed.headers["transfer-encoding"] == "chunked"  # the app gave no length
            text = "".join(streamed.iter_text())
        assert text.rstrip().endswith("data: [DONE]")
        assert json.loads(text.split("data: ", 2)[1])["object"] == "chat.completion.chunk"


def test_lean_server_answers_pipelined_requests_in_order_and_refuses_an_oversized_body(servers):
    port = int(servers[0].rsplit(":", 1)[1])
    health = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    answers = _exchange(port, health + health, 2)
    assert answers.count(b"HTTP/1.1 200 OK\r\n") == 2 and answers.endswith(b"ok")
    refused = _exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 999999999999\r\n\r\n", 1)
    assert refused.startswith(b"HTTP/1.1 413 ") and b"connection: close" in refused
