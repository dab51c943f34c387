"""vLLM sleep mode's decisions and HTTP calls (`sleep_mode.py`), against a fake engine.

The fake serves vLLM's three routes (`/sleep?level=N`, `/wake_up`, `/is_sleeping`) behind the replica's
key, as an engine started with `--enable-sleep-mode` and `VLLM_SERVER_DEV_MODE=1` does. No GPU here:
a real engine's sleep and wake are unrun.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from gpu_agent.runtime.engine import DEVICE_CPU
from gpu_agent.runtime.sleep_mode import (
    DEV_MODE_ENV,
    SLEEP_MODE_FLAG,
    EngineSleepClient,
    EngineSleepError,
    SleepPolicy,
    sleep_mode_flags,
)

KEY = "engine-key"


class FakeSleepingEngine(BaseHTTPRequestHandler):
    calls: list[tuple[str, str]] = []
    sleeping_level = 0

    def _answer(self, status: int, body: dict) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _authorised(self) -> bool:
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            self._answer(401, {"error": "Unauthorized"})
            return False
        return True

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        url = urlparse(self.path)
        type(self).calls.append(("POST", self.path))
        if not self._authorised():
            return
        if url.path == "/sleep":
            type(self).sleeping_level = int(parse_qs(url.query).get("level", ["1"])[0])
            self._answer(200, {"status": "sleeping", "level": type(self).sleeping_level})
        elif url.path == "/wake_up":
            type(self).sleeping_level = 0
            self._answer(200, {"status": "awake", "tags": None})
        else:
            self._answer(404, {"detail": "Not Found"})

    def do_GET(self) -> None:  # noqa: N802
        type(self).calls.append(("GET", self.path))
        if self._authorised() and self.path == "/is_sleeping":
            self._answer(200, {"is_sleeping": type(self).sleeping_level > 0})

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def engine_address():
    FakeSleepingEngine.calls = []
    FakeSleepingEngine.sleeping_level = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSleepingEngine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_idle_replica_sleeps_and_wakes_through_the_engines_own_routes(engine_address):
    client = EngineSleepClient(engine_address, KEY)
    try:
        assert not client.is_sleeping()
        client.sleep(level=1)
        assert client.is_sleeping()
        assert client.wake_up() is True
        assert not client.is_sleeping()
    finally:
        client.close()
    assert FakeSleepingEngine.calls == [
        ("GET", "/is_sleeping"), ("POST", "/sleep?level=1"), ("GET", "/is_sleeping"),
        ("POST", "/wake_up"), ("GET", "/is_sleeping"),
    ]  # fmt: skip


def test_a_refused_sleep_call_raises_with_the_engines_answer(engine_address):
    client = EngineSleepClient(engine_address, "wrong-key")
    try:
        with pytest.raises(EngineSleepError, match="HTTP 401"):
            client.sleep()
    finally:
        client.close()


def test_an_engine_that_is_gone_is_an_error_not_a_hang():
    client = EngineSleepClient("http://127.0.0.1:9", KEY, timeout_s=2)
    try:
        with pytest.raises(EngineSleepError):
            client.wake_up()
    finally:
        client.close()


def test_only_gpu_engines_of_endpoints_that_allow_it_start_with_sleep_mode():
    assert sleep_mode_flags("cuda", True) == ([SLEEP_MODE_FLAG], {DEV_MODE_ENV: "1"})
    assert sleep_mode_flags("cuda", False) == ([], {})
    assert sleep_mode_flags(DEVICE_CPU, True) == ([], {})


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, True),
        ({"device": DEVICE_CPU}, False),
        ({"enabled": False}, False),
        ({"sleeping": True}, False),
        ({"num_running": 1}, False),
        ({"num_waiting": 2}, False),
        ({"idle_for_s": 59.0}, False),
    ],
)
def test_a_replica_sleeps_only_when_allowed_on_a_gpu_and_idle_long_enough(changes, expected):
    inputs = {
        "device": "cuda", "enabled": True, "sleeping": False, "num_running": 0, "num_waiting": 0,
        "idle_for_s": 60.0, **changes,
    }  # fmt: skip
    assert SleepPolicy(idle_after_s=60).should_sleep(**inputs) is expected


def test_a_sleeping_replica_wakes_for_a_held_request_only():
    policy = SleepPolicy()
    assert policy.should_wake(sleeping=True, num_held_requests=1)
    assert not policy.should_wake(sleeping=True, num_held_requests=0)
    assert not policy.should_wake(sleeping=False, num_held_requests=3)


def test_a_sleep_policy_refuses_levels_vllm_does_not_have():
    with pytest.raises(ValueError):
        SleepPolicy(level=3)
    with pytest.raises(ValueError):
        SleepPolicy(idle_after_s=0)
