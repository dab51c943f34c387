"""vLLM sleep mode's engine flags and HTTP calls (`sleep_mode.py`), against a fake engine.

The fake serves vLLM's three routes (`/sleep?level=N`, `/wake_up`, `/is_sleeping`) behind the replica's
key, as an engine started with `--enable-sleep-mode` and `VLLM_SERVER_DEV_MODE=1` does. No GPU here:
a real engine's sleep and wake are unrun.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from gpu_agent.protocol import ReplicaAction, ReplicaState
from gpu_agent.runtime import state_file
from gpu_agent.runtime.engine import DEVICE_CPU, DEVICE_CUDA, build_engine_command
from gpu_agent.runtime.reconciler import Reconciler
from gpu_agent.runtime.sleep_mode import (
    DEV_MODE_ENV,
    SLEEP_MODE_FLAG,
    EngineSleepClient,
    EngineSleepError,
    sleep_mode_flags,
)
from gpu_agent.runtime.supervisor import Supervisor, SupervisorPolicy

from .conftest import fake_engine_factory, make_spec, processes_with_marker, wait_for_state, wait_until

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
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
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


def test_only_gpu_engines_of_endpoints_that_allow_it_start_with_sleep_mode(tmp_path):
    assert sleep_mode_flags(True) == ([SLEEP_MODE_FLAG], {DEV_MODE_ENV: "1"})
    assert sleep_mode_flags(False) == ([], {})
    spec = make_spec("r-sleep", sleep_mode=True)
    cuda = build_engine_command(spec, tmp_path, port=20001, device=DEVICE_CUDA)
    assert SLEEP_MODE_FLAG in cuda.argv and cuda.env[DEV_MODE_ENV] == "1"
    cpu = build_engine_command(spec, tmp_path, port=20001, device=DEVICE_CPU)
    assert SLEEP_MODE_FLAG not in cpu.argv and DEV_MODE_ENV not in cpu.env
    plain = build_engine_command(make_spec("r-plain"), tmp_path, port=20001, device=DEVICE_CUDA)
    assert SLEEP_MODE_FLAG not in plain.argv and DEV_MODE_ENV not in plain.env


# -- the supervisor drives the engine's sleep: a stand-in engine process (`fake_engine.py --sleep-mode`) --


@pytest.fixture
def sleepy_supervisor(tmp_path):
    created = []

    def make(*engine_args, device=DEVICE_CUDA):
        woken, slept = [], []
        supervisor = Supervisor(
            tmp_path / f"agent-{len(created)}", device=device,
            command_factory=fake_engine_factory("--sleep-mode", *engine_args),
            policy=SupervisorPolicy(restart_backoff_s=0.2, stop_timeout_s=2.0, sleep_call_timeout_s=5.0),
            on_ready=woken.append, on_stopped=slept.append,
        )  # fmt: skip
        supervisor.woken, supervisor.slept = woken, slept
        created.append(supervisor)
        return supervisor

    yield make
    for supervisor in created:
        supervisor.shutdown(timeout_s=1)


def _ready(supervisor, replica_id, **spec):
    supervisor.start(make_spec(replica_id, sleep_mode=True, **spec), "/nonexistent")
    wait_for_state(supervisor, replica_id, ReplicaState.READY, timeout_s=30, step_s=0.05)
    return supervisor.get(replica_id).pid


def _poll_until(supervisor, predicate, timeout_s=15):
    return wait_until(predicate, timeout_s, step_s=0.05, poll=supervisor.poll)


def test_a_sleeping_replica_keeps_its_process_and_wakes_ready(sleepy_supervisor):
    supervisor = sleepy_supervisor()
    pid = _ready(supervisor, "r-sleep")
    supervisor.sleep("r-sleep")
    _poll_until(supervisor, lambda: supervisor.get("r-sleep").state == ReplicaState.SLEEPING)
    (status,) = supervisor.statuses()
    assert status.state == ReplicaState.SLEEPING and status.pid == pid and status.address
    assert supervisor.slept == ["r-sleep"]  # the agent reports it now, not at its next heartbeat
    for _ in range(5):
        supervisor.poll()  # a sleeping engine is neither health-checked into a crash nor restarted
    assert supervisor.get("r-sleep").state == ReplicaState.SLEEPING
    woken_at = time.monotonic()
    supervisor.wake("r-sleep")
    _poll_until(supervisor, lambda: supervisor.get("r-sleep").state == ReplicaState.READY)
    assert time.monotonic() - woken_at < 2.0
    replica = supervisor.get("r-sleep")
    assert replica.pid == pid and replica.num_restarts == 0 and supervisor.woken == ["r-sleep", "r-sleep"]
    log = replica.log_path.read_text()
    assert "fake engine sleeps (level 1)" in log and "fake engine wakes" in log


def test_an_engine_asleep_when_its_agent_went_is_adopted_sleeping_and_woken_when_wanted(sleepy_supervisor):
    # An asleep engine answers /health: the next agent adopted it as READY, the gateway routed calls to it, and a RUN
    # found it READY already, so it was never woken (an upgrade with --keep-engines-on-exit on a node with sleepers).
    first = sleepy_supervisor()
    pid = _ready(first, "r-asleep")
    first.sleep("r-asleep")
    _poll_until(first, lambda: first.get("r-asleep").state == ReplicaState.SLEEPING)
    first._probe.close()  # the agent vanishes without stopping its engine
    first._replicas.clear()

    second = Supervisor(first.data_dir, device=DEVICE_CUDA, command_factory=fake_engine_factory("--sleep-mode"),
                        policy=SupervisorPolicy(restart_backoff_s=0.2, stop_timeout_s=2.0, sleep_call_timeout_s=5.0))
    try:
        assert second.recover(None)[0] == ["r-asleep"]
        assert second.get("r-asleep").state == ReplicaState.SLEEPING and second.get("r-asleep").pid == pid
        second.wake("r-asleep")
        _poll_until(second, lambda: second.get("r-asleep").state == ReplicaState.READY)
        assert "fake engine wakes" in second.get("r-asleep").log_path.read_text()
    finally:
        second.shutdown(timeout_s=1)


def test_a_failed_wake_restarts_the_engine_with_the_reason(sleepy_supervisor):
    supervisor = sleepy_supervisor("--wake-fails")
    pid = _ready(supervisor, "r-wake")
    supervisor.sleep("r-wake")
    _poll_until(supervisor, lambda: supervisor.get("r-wake").state == ReplicaState.SLEEPING)
    supervisor.wake("r-wake")
    _poll_until(supervisor, lambda: supervisor.get("r-wake").num_restarts == 1)
    wait_for_state(supervisor, "r-wake", ReplicaState.READY, timeout_s=30, step_s=0.05)
    replica = supervisor.get("r-wake")
    assert replica.pid != pid
    assert "wake up failed" in replica.failure_reason and "HTTP 500" in replica.failure_reason
    assert pid not in {process.pid for process in processes_with_marker("r-wake")}  # the old engine is gone


def test_a_failed_wake_drained_before_its_relaunch_leaves_no_scratch_folder_on_disk_nor_in_the_record(sleepy_supervisor):
    """Before (the review of fix-fleet8), the failed wake killed the engine but kept its scratch folder held: a drain
    before the next poll's relaunch stopped the replica, `forget` dropped it, and the folder stayed on the disk,
    queued for no removal and still listed as made in the state file (until the next agent's start)."""
    supervisor = sleepy_supervisor("--wake-fails")
    _ready(supervisor, "r-wake")
    scratch = supervisor._scratch_dirs.get("r-wake")
    if scratch is None:
        pytest.skip("engines get no scratch folder here (the sandbox is off)")
    supervisor.sleep("r-wake")
    _poll_until(supervisor, lambda: supervisor.get("r-wake").state == ReplicaState.SLEEPING)
    supervisor.wake("r-wake")
    wait_until(lambda: supervisor.get("r-wake").num_restarts == 1, 15)  # no poll: the relaunch has not come
    supervisor.drain("r-wake")  # the control plane scales it away first
    assert supervisor.get("r-wake").state == ReplicaState.STOPPED
    supervisor.forget("r-wake")
    wait_until(lambda: not supervisor._removals.pending(), 15)
    assert not scratch.exists()
    made = json.loads(supervisor.state_path.read_text()).get(state_file.MADE_SCRATCH_KEY) or []
    assert [replica_id for replica_id, _path in made if replica_id == "r-wake"] == []


@pytest.mark.parametrize(("device", "sleep_mode", "why"), [
    (DEVICE_CPU, True, "a CPU engine has no sleep mode"),
    (DEVICE_CUDA, False, "its engine was started without sleep mode"),
])  # fmt: skip
def test_a_replica_that_cannot_sleep_stops_instead_with_the_reason(sleepy_supervisor, device, sleep_mode, why):
    supervisor = sleepy_supervisor(device=device)
    supervisor.start(make_spec("r-no", sleep_mode=sleep_mode), "/nonexistent")
    wait_for_state(supervisor, "r-no", ReplicaState.READY, timeout_s=30, step_s=0.05)
    supervisor.sleep("r-no")
    _poll_until(supervisor, lambda: supervisor.get("r-no").state == ReplicaState.STOPPED)
    assert why in supervisor.get("r-no").failure_reason
    assert "fake engine sleeps" not in supervisor.get("r-no").log_path.read_text()


def test_the_control_planes_sleep_and_run_actions_sleep_and_wake_the_engine(sleepy_supervisor):
    supervisor = sleepy_supervisor()
    _ready(supervisor, "r-act")
    reconciler = Reconciler(supervisor, weights=None, wake=threading.Event())
    spec = make_spec("r-act", sleep_mode=True)
    reconciler.reconcile([dataclasses.replace(spec, action=ReplicaAction.SLEEP)])
    _poll_until(supervisor, lambda: supervisor.get("r-act").state == ReplicaState.SLEEPING)
    reconciler.reconcile([dataclasses.replace(spec, action=ReplicaAction.SLEEP)])  # still asleep: nothing more
    reconciler.reconcile([spec])  # RUN: desired READY again
    _poll_until(supervisor, lambda: supervisor.get("r-act").state == ReplicaState.READY)
    log = supervisor.get("r-act").log_path.read_text()
    assert log.count("fake engine sleeps") == 1 and log.count("fake engine wakes") == 1
