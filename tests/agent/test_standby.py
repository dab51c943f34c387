"""The warm standby's plumbing, without vLLM: the marker rewrite, command matching, and the
supervisor's use of a standby (fallback to a plain launch, no refill while an engine starts)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil

from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime import engine
from gpu_agent.runtime import standby as standby_module
from gpu_agent.runtime.standby import SERVER_MODULE, STANDBY_MARKER_VALUE, server_args
from gpu_agent.runtime.supervisor import Supervisor, SupervisorPolicy

from .conftest import FAKE_ENGINE, fake_engine_factory, make_spec, processes_with_marker, wait_until

FAST = SupervisorPolicy(restart_backoff_s=0.2, max_consecutive_crashes=3, stop_timeout_s=2.0)


def test_a_process_rewrites_its_replica_marker_where_other_processes_read_it(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        from gpu_agent.runtime.standby_process import rewrite_environ_block
        assert rewrite_environ_block("INFERPLANE_REPLICA_ID", "r-0123456789abcdef")
        print("rewritten", flush=True)
        sys.stdin.readline()
        """
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "BEFORE": "1",
        engine.REPLICA_ENV_MARKER: STANDBY_MARKER_VALUE,
        "AFTER": "2",
        "PYTHONPATH": ".",
    }
    child = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "rewritten"
        seen = psutil.Process(child.pid).environ()
        assert seen[engine.REPLICA_ENV_MARKER] == "r-0123456789abcdef"
        assert seen["BEFORE"] == "1" and seen["AFTER"] == "2"  # the filler hides no neighbour
        assert processes_with_marker("r-0123456789abcdef") == [psutil.Process(child.pid)]
    finally:
        child.kill()
        child.wait()


def test_only_a_vllm_openai_server_command_can_go_to_the_standby(tmp_path):
    spec = make_spec("r-args")
    command = engine.build_engine_command(spec, tmp_path, port=8123, device=engine.DEVICE_CPU)
    args = server_args(command)
    assert args[:2] == ["--model", str(tmp_path)] and "--port" in args and SERVER_MODULE not in args
    assert server_args(fake_engine_factory()(spec, tmp_path, 8123)) is None


class FakeStandby:
    """Stands in for `standby.Standby`: a hand-off launches the fake engine with `engine_args`."""

    label = "warm standby"

    def __init__(self, *engine_args: str) -> None:
        self.engine_args = engine_args
        self.ready = True
        self.warming = False
        self.process = None
        self.pid = None
        self.spawned_at = 0.0
        self.num_ensures = 0
        self.handoffs: list[str] = []

    def can_take(self, command) -> bool:
        return self.ready

    def ensure(self) -> None:
        self.num_ensures += 1
        self.ready = True

    def hand_off(self, replica_id, command, env, log_path):
        self.handoffs.append(replica_id)
        self.ready = False
        argv = [sys.executable, str(FAKE_ENGINE), "--port", str(command.port), *self.engine_args]
        return subprocess.Popen(
            argv, env={**env, engine.REPLICA_ENV_MARKER: replica_id}, start_new_session=True
        )

    def stop(self) -> None:
        self.ready = False


def supervisor_with(tmp_path, standby: FakeStandby) -> Supervisor:
    supervisor = Supervisor(tmp_path / "agent", command_factory=fake_engine_factory(), policy=FAST)
    supervisor.standby = standby
    return supervisor


def test_a_replica_goes_to_a_ready_standby_and_the_next_one_is_made_only_after_it_started(tmp_path):
    standby = FakeStandby("--ready-after-s", "1")
    supervisor = supervisor_with(tmp_path, standby)
    try:
        supervisor.start(make_spec("r-warm"), "/models/x")
        supervisor.poll()
        replica = supervisor.get("r-warm")
        assert standby.handoffs == ["r-warm"] and replica.from_standby
        num_ensures_while_starting = standby.num_ensures
        for _ in range(3):
            supervisor.poll()
        assert supervisor.get("r-warm").state == ReplicaState.STARTING
        assert standby.num_ensures == num_ensures_while_starting, "no refill while an engine starts"
        wait_until(lambda: supervisor.get("r-warm").state == ReplicaState.READY, 10, poll=supervisor.poll)
        wait_until(lambda: standby.num_ensures > num_ensures_while_starting, 10, poll=supervisor.poll)
        assert supervisor.standby_ready
    finally:
        supervisor.shutdown(timeout_s=1)
    assert processes_with_marker("r-warm") == []


def test_a_standby_start_that_never_gets_ready_is_retried_with_a_plain_launch(tmp_path):
    standby = FakeStandby("--exit-after-s", "0.2", "--ready-after-s", "60")
    supervisor = supervisor_with(tmp_path, standby)
    try:
        supervisor.start(make_spec("r-fallback"), "/models/x")
        wait_until(lambda: supervisor.get("r-fallback").state == ReplicaState.READY, 15, poll=supervisor.poll)
        replica = supervisor.get("r-fallback")
        assert standby.handoffs == ["r-fallback"], "the retry does not use the standby again"
        assert not replica.from_standby and replica.avoid_standby and replica.num_restarts == 1
        assert "retrying with a plain launch" in replica.failure_reason
        log = replica.log_path.read_text()
        launches = [line for line in log.splitlines() if line.startswith("==> launch")]
        assert len(launches) == 2 and "on the warm standby" in launches[0] and "on the warm standby" not in launches[1]
    finally:
        supervisor.shutdown(timeout_s=1)
    assert processes_with_marker("r-fallback") == []


def test_a_replica_waits_for_a_warming_standby_instead_of_starting_plainly(tmp_path):
    class Warming(FakeStandby):
        def can_take(self, command) -> bool:
            return False

    standby = Warming()
    standby.ready, standby.warming = False, True
    supervisor = Supervisor(tmp_path / "agent", policy=FAST)  # vLLM commands, never launched here
    supervisor.standby = standby
    standby.spawned_at = time.monotonic()
    try:
        supervisor.start(make_spec("r-wait"), "/models/x")
        supervisor.poll()
        replica = supervisor.get("r-wait")
        assert (
            replica.pid is None and replica.launch_at and replica.progress == "starting engine (warm standby)"
        )
    finally:
        supervisor.shutdown(timeout_s=1)


def test_a_replica_due_while_no_standby_is_kept_spawns_one_and_waits_for_it(tmp_path):
    class Spawning(FakeStandby):
        def can_take(self, command) -> bool:
            return False

        def ensure(self) -> None:  # spawns: importing, not ready yet
            self.num_ensures += 1
            self.process, self.warming, self.spawned_at = object(), True, time.monotonic()

    standby = Spawning()
    standby.ready = False  # just handed off: no standby process at all
    supervisor = Supervisor(tmp_path / "agent", policy=FAST)  # vLLM commands, never launched here
    supervisor.standby = standby
    try:
        supervisor.start(make_spec("r-due"), "/models/x")
        supervisor.poll()
        replica = supervisor.get("r-due")
        assert standby.num_ensures >= 1, "a standby is spawned for the due replica"
        assert replica.pid is None and replica.launch_at and replica.progress == "starting engine (warm standby)"
    finally:
        supervisor.shutdown(timeout_s=1)


def test_the_standbys_log_is_started_afresh_past_its_bound_keeping_only_the_previous_one(tmp_path, monkeypatch):
    """One standby spawns per cold start, each appending to one log that nothing removed or rotated: it grew for
    as long as the node ran."""
    monkeypatch.setattr(standby_module, "MAX_LOG_BYTES", 1000, raising=False)
    standby = standby_module.Standby(tmp_path, device=engine.DEVICE_CPU)
    for _ in range(3):  # each past the bound by what it wrote (a standby's imports print some)
        standby.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(standby.log_path, "ab") as log:
            log.write(b"x" * 1500)
        standby.ensure()
        assert standby.process is not None
        standby.stop()
    logs = sorted(path.name for path in standby.log_path.parent.iterdir())
    assert logs == ["standby.log", "standby.log.1"]
    assert standby.log_path.stat().st_size < 1000  # this spawn's header (and what it wrote before it was stopped)
    # the previous one's end (its last 1000 bytes: what the test wrote), not all three
    assert (standby.log_path.parent / "standby.log.1").read_bytes() == b"x" * 1000
