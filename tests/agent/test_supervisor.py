"""Supervisor behaviour against a fake engine that starts in milliseconds."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from gpu_agent.protocol import ReplicaState, ReplicaStatus
from gpu_agent.runtime import supervisor as supervisor_module
from gpu_agent.runtime import zygote as zygote_module
from gpu_agent.runtime.control_plane import heartbeat_interval
from gpu_agent.runtime.probes import parse_engine_metrics
from gpu_agent.runtime.process import kill_group
from gpu_agent.runtime.supervisor import Supervisor, SupervisorPolicy
from gpu_agent.runtime.zygote import ForkedEngine, Zygote

from .conftest import fake_engine_factory, make_spec, processes_with_marker, wait_until

FAST = SupervisorPolicy(restart_backoff_s=0.2, max_consecutive_crashes=3, stop_timeout_s=2.0)


@pytest.fixture
def make_supervisor(tmp_path):
    created = []

    def make(*engine_args, policy=FAST, data_dir=None):
        supervisor = Supervisor(
            data_dir or tmp_path / "agent", command_factory=fake_engine_factory(*engine_args), policy=policy
        )
        created.append(supervisor)
        return supervisor

    yield make
    for supervisor in created:
        supervisor.shutdown(timeout_s=1)


def state_of(supervisor, replica_id):
    return supervisor.get(replica_id).state


def test_replica_becomes_ready_once_health_passes(make_supervisor):
    supervisor = make_supervisor("--ready-after-s", "0.5")
    supervisor.start(make_spec("r-ready"), "/models/x")
    supervisor.poll()
    assert state_of(supervisor, "r-ready") == ReplicaState.STARTING
    wait_until(lambda: state_of(supervisor, "r-ready") == ReplicaState.READY, 10, poll=supervisor.poll)
    status = supervisor.statuses()[0]
    assert status.address.startswith("http://127.0.0.1:")
    assert status.pid and psutil.pid_exists(status.pid)
    supervisor.poll()
    supervisor.poll()
    assert supervisor.statuses()[0].kv_cache_usage == 0.25
    # the engine's prefix-cache counters reach the heartbeat (the fleet's replica view)
    assert (status := supervisor.statuses()[0]).num_prefix_cache_hits == 96 and status.num_prefix_cache_queries == 400


def test_a_ready_engine_is_scraped_at_most_once_a_metrics_interval_however_fast_the_loop_polls(make_supervisor):
    # The loop polls ten times a second while any engine starts; a scrape on each poll cost every engine
    # already up ~8% of a core, taken from the engines starting at once beside it.
    supervisor = make_supervisor()
    supervisor.start(make_spec("r-scraped"), "/models/x")
    wait_until(lambda: state_of(supervisor, "r-scraped") == ReplicaState.READY, 10, poll=supervisor.poll)
    supervisor.poll()
    assert supervisor.statuses()[0].kv_cache_usage == 0.25  # scraped as soon as READY
    scrapes = []
    metrics = supervisor._probe.metrics
    supervisor._probe.metrics = lambda *args: scrapes.append(time.monotonic()) or metrics(*args)
    started_at = time.monotonic()
    while time.monotonic() - started_at < 1.2:
        supervisor.poll()
        time.sleep(0.02)
    assert 1 <= len(scrapes) <= 2, scrapes


def test_crashed_engine_restarts_with_backoff_then_fails_with_log_tail(make_supervisor):
    # NOTE: a first backoff of 0.25 s: a backoff that does not double (or none) still falls short of the second and third
    # waits' 0.5 and 1 s, while the crashes' waits take 1.75 s where they took 3.5.
    policy = SupervisorPolicy(restart_backoff_s=0.25, max_consecutive_crashes=4, stop_timeout_s=2.0)
    supervisor = make_supervisor("--exit-after-s", "0.3", policy=policy)
    supervisor.start(make_spec("r-crash"), "/models/x")
    wait_until(lambda: state_of(supervisor, "r-crash") == ReplicaState.FAILED, 30, poll=supervisor.poll)
    replica = supervisor.get("r-crash")
    assert replica.num_restarts == 3  # the fourth crash in a row is final
    assert "exited with code 3 4 times in a row" in replica.failure_reason
    assert "==> launch" in replica.failure_reason  # the log tail travels with the reason
    states = [state for state, _ in replica.state_history]
    assert states[0] == ReplicaState.STARTING and states[-1] == ReplicaState.FAILED
    assert processes_with_marker("r-crash") == []
    # The backoff, measured: from each crash to the next engine's start, at least 0.25 s, then 0.5 s, then 1 s.
    log = replica.log_path.read_text()
    started = [float(at) for at in re.findall(r"==> fake engine started at ([0-9.]+)", log)]
    exited = [float(at) for at in re.findall(r"==> fake engine exits at ([0-9.]+)", log)]
    assert len(started) == len(exited) == 4
    waits = [start - crash for crash, start in zip(exited[:-1], started[1:], strict=True)]
    assert [wait >= 0.25 * 2**index for index, wait in enumerate(waits)] == [True] * 3, f"waits between a crash and the next start: {waits}"


def test_a_nul_an_engine_logged_before_it_died_never_reaches_the_replicas_report(make_supervisor):
    """An engine's last log lines are its failure's reason, and a tenant's files choose them: transformers' error for a
    config.json whose `model_type` holds a NUL quotes it raw. Before, the report carried the NUL, PostgreSQL refused it,
    and every heartbeat of the node was a 500 until the node went OFFLINE with every tenant's replica on it."""
    policy = SupervisorPolicy(restart_backoff_s=0.2, max_consecutive_crashes=1, stop_timeout_s=2.0)
    supervisor = make_supervisor("--exit-after-s", "0.5", policy=policy)
    supervisor.start(make_spec("r-nul"), "/models/x")
    supervisor.poll()
    wait_until(lambda: supervisor.get("r-nul").log_path.exists(), 10, poll=supervisor.poll)
    with open(supervisor.get("r-nul").log_path, "ab") as log:
        log.write(b"ValueError: The checkpoint you are trying to load has model type `llama\x00x`\n")
    wait_until(lambda: state_of(supervisor, "r-nul") == ReplicaState.FAILED, 30, poll=supervisor.poll)

    [status] = supervisor.statuses()
    assert "model type `llamax`" in status.failure_reason and "\x00" not in status.failure_reason
    assert ReplicaStatus.from_dict(json.loads(json.dumps(status.to_dict()))).failure_reason == status.failure_reason


def test_drain_waits_for_running_requests_then_stops_every_process(make_supervisor, tmp_path):
    running_file = tmp_path / "running"
    running_file.write_text("2")
    supervisor = make_supervisor("--running-file", str(running_file))
    supervisor.start(make_spec("r-drain"), "/models/x")
    wait_until(lambda: state_of(supervisor, "r-drain") == ReplicaState.READY, 10, poll=supervisor.poll)
    assert len(processes_with_marker("r-drain")) == 3  # the reaper, the engine and its worker
    supervisor.drain("r-drain", timeout_s=30)
    for _ in range(5):
        supervisor.poll()
    assert state_of(supervisor, "r-drain") == ReplicaState.DRAINING
    assert supervisor.statuses()[0].num_running == 2
    running_file.write_text("0")
    wait_until(lambda: state_of(supervisor, "r-drain") == ReplicaState.STOPPED, 10, poll=supervisor.poll)
    assert processes_with_marker("r-drain") == []


def test_drain_timeout_and_ignored_sigterm_end_in_sigkill(make_supervisor, tmp_path):
    running_file = tmp_path / "running"
    running_file.write_text("5")
    # SIGKILL 0.5 s after the ignored SIGTERM (FAST waits 2 s: nothing here needs it)
    policy = dataclasses.replace(FAST, stop_timeout_s=0.5)
    supervisor = make_supervisor("--running-file", str(running_file), "--ignore-sigterm", policy=policy)
    supervisor.start(make_spec("r-stubborn"), "/models/x")
    wait_until(lambda: state_of(supervisor, "r-stubborn") == ReplicaState.READY, 10, poll=supervisor.poll)
    supervisor.drain("r-stubborn", timeout_s=0.5)
    wait_until(lambda: state_of(supervisor, "r-stubborn") == ReplicaState.STOPPED, 15, poll=supervisor.poll)
    assert processes_with_marker("r-stubborn") == []


def test_an_idle_draining_engine_is_killed_after_the_short_grace_and_its_stop_reported_at_once(tmp_path):
    # Scale to zero: nothing in flight, so no drain wait and no 30 s SIGTERM timeout; the monitor acts on
    # the drain without waiting for its tick, and the agent hears STOPPED the moment the engine is gone.
    running_file = tmp_path / "running"
    running_file.write_text("0")
    policy = SupervisorPolicy(stop_timeout_s=30.0, idle_stop_grace_s=0.5)
    stopped = []
    supervisor = Supervisor(
        tmp_path / "agent", command_factory=fake_engine_factory("--running-file", str(running_file), "--ignore-sigterm"),
        policy=policy, on_stopped=stopped.append,
    )  # fmt: skip
    try:
        supervisor.start(make_spec("r-idle"), "/models/x")
        supervisor.start_monitor(interval_s=5.0)  # a slow tick: only the drain's own wake-up can be fast
        wait_until(lambda: state_of(supervisor, "r-idle") == ReplicaState.READY, 10)
        drained_at = time.monotonic()
        supervisor.drain("r-idle", timeout_s=120)
        wait_until(lambda: stopped == ["r-idle"], 10)
        assert time.monotonic() - drained_at < 3, "SIGKILL after the grace, not after the drain or stop timeouts"
        assert state_of(supervisor, "r-idle") == ReplicaState.STOPPED
        assert processes_with_marker("r-idle") == []
    finally:
        supervisor.shutdown(timeout_s=1)


def test_new_supervisor_adopts_healthy_desired_and_kills_the_rest(make_supervisor, tmp_path):
    data_dir = tmp_path / "agent"
    first = make_supervisor(data_dir=data_dir)
    first.start(make_spec("r-keep"), "/models/x")
    first.start(make_spec("r-gone"), "/models/x")
    wait_until(lambda: {r.state for r in first.statuses()} == {ReplicaState.READY}, 10, poll=first.poll)
    keep_pid = first.get("r-keep").pid
    first._probe.close()  # the old agent vanishes without stopping its children
    first._replicas.clear()

    second = make_supervisor(data_dir=data_dir)
    adopted, killed = second.recover({"r-keep": make_spec("r-keep")})
    assert adopted == ["r-keep"] and killed == ["r-gone"]
    assert second.get("r-keep").state == ReplicaState.READY and second.get("r-keep").pid == keep_pid
    wait_until(lambda: processes_with_marker("r-gone") == [], 5)
    # The adopted engine is supervised like any other: drain stops it without orphans.
    second.drain("r-keep", timeout_s=5)
    wait_until(lambda: state_of(second, "r-keep") == ReplicaState.STOPPED, 10, poll=second.poll)
    assert processes_with_marker("r-keep") == []


def test_a_record_this_version_cannot_read_is_not_adopted_and_the_agent_starts(make_supervisor, tmp_path):
    # An upgrade whose spec refuses an older record raised out of recover(): the agent crash-looped at every start.
    data_dir = tmp_path / "agent"
    first = make_supervisor(data_dir=data_dir)
    first.start(make_spec("r-keep"), "/models/x")
    first.start(make_spec("r-unreadable"), "/models/x")
    wait_until(lambda: {r.state for r in first.statuses()} == {ReplicaState.READY}, 10, poll=first.poll)
    first._probe.close()  # the old agent vanishes without stopping its children
    first._replicas.clear()
    records = json.loads((data_dir / "replicas.json").read_text())
    records["r-unreadable"]["spec"]["max_model_len"] = "no longer a number"
    (data_dir / "replicas.json").write_text(json.dumps(records))

    second = make_supervisor(data_dir=data_dir)
    adopted, killed = second.recover(None)

    assert adopted == ["r-keep"] and killed == ["r-unreadable"]
    wait_until(lambda: processes_with_marker("r-unreadable") == [], 5)  # the orphan sweep ended its engine


def test_the_logs_of_replicas_that_ended_are_pruned_to_the_newest_few(make_supervisor, monkeypatch, tmp_path):
    # Every replica's log stayed: with scale-to-zero each cold start is a new replica with its own log, outside the
    # weights' disk budget, until the node's disk was full.
    monkeypatch.setattr(supervisor_module, "KEPT_ENDED_LOGS", 2)
    supervisor = make_supervisor()
    logs = supervisor.logs_dir
    for index in range(5):
        (logs / f"r-ended-{index}.log").write_text("old engine output")
        os.utime(logs / f"r-ended-{index}.log", (1_000 + index, 1_000 + index))
    (logs / "zygote.log").write_text("the zygote's")
    supervisor.start(make_spec("r-live"), "/models/x")
    supervisor.start(make_spec("r-done"), "/models/x")
    wait_until(lambda: {r.state for r in supervisor.statuses()} == {ReplicaState.READY}, 10, poll=supervisor.poll)
    supervisor.drain("r-done", timeout_s=5)
    wait_until(lambda: state_of(supervisor, "r-done") == ReplicaState.STOPPED, 10, poll=supervisor.poll)

    supervisor.forget("r-done")

    assert sorted(path.name for path in logs.glob("*.log")) == ["r-done.log", "r-ended-4.log", "r-live.log",
                                                                  "zygote.log"]


def test_the_heartbeat_interval_the_control_plane_asks_for_is_bounded():
    # A null raised out of the heartbeat loop and the agent stopped every tenant's engine; 0 or NaN had it beat flat
    # out, infinity never again.
    for asked, taken in ((None, 5.0), ("5", 5.0), (True, 5.0), (float("nan"), 5.0), (float("inf"), 5.0),
                         (0, 0.2), (-3, 0.2), (2.5, 2.5), (10**9, 60.0)):
        assert heartbeat_interval(asked) == taken, asked


def test_an_adopted_engine_has_its_chat_template_measured(make_supervisor, tmp_path):
    # The measure ran only when an engine first became READY: an engine adopted by a restarted agent was never
    # measured, and the gateway's estimate kept its defaults for its model however much its template adds.
    data_dir = tmp_path / "agent"
    first = make_supervisor("--tokenize-fails", "1", data_dir=data_dir)  # its first measure fails (the next is 10 s on)
    first.start(make_spec("r-keep"), "/models/x")
    wait_until(lambda: first.get("r-keep").num_template_measures == 1 and not first.get("r-keep").measuring, 10,
               poll=first.poll)
    assert first.get("r-keep").chat_template_tokens is None
    first._probe.close()  # the old agent vanishes without stopping its engine, which was never measured
    first._replicas.clear()

    second = make_supervisor(data_dir=data_dir)
    assert second.recover({"r-keep": make_spec("r-keep")})[0] == ["r-keep"]
    wait_until(lambda: second.get("r-keep").chat_template_tokens is not None, 10, poll=second.poll)
    measured = next(s for s in second.statuses() if s.replica_id == "r-keep").chat_template_tokens
    assert (measured.per_conversation, measured.per_message) == (7, 4)


def test_a_chat_template_measure_that_failed_is_tried_again_and_then_no_more(make_supervisor):
    policy = dataclasses.replace(FAST, template_measure_retry_s=(0.2,))
    once = make_supervisor("--tokenize-fails", "1", policy=policy)
    once.start(make_spec("r-once"), "/models/x")
    wait_until(lambda: once.get("r-once").chat_template_tokens is not None, 10, poll=once.poll)
    assert once.get("r-once").num_template_measures == 2

    never = make_supervisor("--tokenize-fails", "1000", policy=policy)
    never.start(make_spec("r-never"), "/models/x")
    wait_until(lambda: never.get("r-never").num_template_measures == 2 and not never.get("r-never").measuring, 10,
               poll=never.poll)
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline:
        never.poll()
        time.sleep(0.05)
    assert never.get("r-never").num_template_measures == 2 and never.get("r-never").chat_template_tokens is None


def test_killed_agent_leaves_no_engine_behind(tmp_path):
    """The engine's reaper (armed with PR_SET_PDEATHSIG) takes the engine and its worker down with the agent."""
    data_dir = tmp_path / "agent"
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from tests.agent.conftest import fake_engine_factory, make_spec
        from gpu_agent.runtime.supervisor import Supervisor
        supervisor = Supervisor({str(data_dir)!r}, command_factory=fake_engine_factory())
        supervisor.start(make_spec("r-orphan"), "/models/x")
        supervisor.start_monitor(0.1)
        while supervisor.get("r-orphan").state.value != "READY":
            time.sleep(0.1)
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    agent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout.readline().strip() == "ready"
        engine_pids = {p.pid for p in processes_with_marker("r-orphan")}
        assert len(engine_pids) == 3  # the reaper, the engine and its worker
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        wait_until(lambda: processes_with_marker("r-orphan") == [], 5)
        # The next agent on this data dir finds nothing to reap, and starts nothing.
        Supervisor(data_dir, command_factory=fake_engine_factory()).recover({})
        assert processes_with_marker("r-orphan") == []
    finally:
        agent.kill()
        for process in processes_with_marker("r-orphan"):
            process.kill()


def test_parses_vllm_prometheus_metrics():
    text = """# HELP vllm:num_requests_running Number of requests
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
vllm:generation_tokens_total{engine="0",model_name="tiny"} 24.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 512.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 128.0
"""
    metrics = parse_engine_metrics(text)
    assert (metrics.num_running, metrics.num_waiting, metrics.kv_cache_usage) == (3, 1, 0.5)
    assert metrics.generation_tokens_total == 24.0
    assert (metrics.prefix_cache_queries_total, metrics.prefix_cache_hits_total) == (512.0, 128.0)


def test_an_engines_nan_or_infinite_gauge_is_skipped_so_its_replicas_report_is_always_taken():
    # Prometheus writes NaN and +Inf; the protocol refuses a report that carries one, and with it the heartbeat.
    text = """vllm:num_requests_running{engine="0"} NaN
vllm:num_requests_waiting{engine="0"} +Inf
vllm:kv_cache_usage_perc{engine="0"} NaN
vllm:generation_tokens_total{engine="0"} +Inf
vllm:prefix_cache_queries_total{engine="0"} -Inf
"""
    metrics = parse_engine_metrics(text)
    assert (metrics.num_running, metrics.num_waiting, metrics.kv_cache_usage, metrics.generation_tokens_total) == (
        0, 0, 0.0, 0.0)
    ReplicaStatus(replica_id="r", state=ReplicaState.READY, kv_cache_usage=metrics.kv_cache_usage,
                  num_running=metrics.num_running, num_waiting=metrics.num_waiting)


class _IdleZygote(Zygote):
    """A zygote that is ready and forks nothing: the supervisor sends it replicas ahead, then launches them plainly."""

    def __init__(self, data_dir) -> None:
        super().__init__(data_dir, device="cpu")
        self.ready = True
        self.asked_for: list[str] = []

    def ensure(self) -> None:
        pass

    def send_ahead(self, replica_id, command, env, log_path) -> bool:
        self.asked_for.append(replica_id)
        return False


def test_a_replica_whose_command_cannot_be_built_fails_alone_and_the_poll_goes_on(tmp_path):
    # A tenant's config.json once made the command factory raise while the supervisor sent the replicas due
    # to the zygote, outside any replica's own guard: every poll of every engine on the node stopped there.
    fake_engine = fake_engine_factory()

    def factory(spec, model_path, port):
        if spec.replica_id == "r-bad":
            raise TypeError("'int' object is not iterable")
        return fake_engine(spec, model_path, port)

    supervisor = Supervisor(tmp_path / "agent", command_factory=factory, policy=FAST)
    supervisor.standby = _IdleZygote(supervisor.data_dir)
    try:
        supervisor.start(make_spec("r-bad"), "/models/x")
        supervisor.start(make_spec("r-good"), "/models/x")
        supervisor.poll()
        assert supervisor.standby.asked_for == ["r-good"]
        assert state_of(supervisor, "r-bad") == ReplicaState.FAILED
        assert "not iterable" in supervisor.get("r-bad").failure_reason
        wait_until(lambda: state_of(supervisor, "r-good") == ReplicaState.READY, 10, poll=supervisor.poll)
    finally:
        supervisor.shutdown(timeout_s=1)


def test_building_a_command_holds_up_no_heartbeat_and_the_replica_still_launches_in_that_poll(tmp_path):
    """A command reads the tenant's model files (its config.json); every heartbeat's `statuses()` waits on the lock
    that each launch held while it built its command, for seconds with a hostile file: the node went offline."""
    fake_engine = fake_engine_factory()
    building = threading.Event()

    def slow_factory(spec, model_path, port):
        building.set()
        time.sleep(1)  # a slow read of the tenant's files: twice the heartbeat's bound below
        return fake_engine(spec, model_path, port)

    supervisor = Supervisor(tmp_path / "agent", command_factory=slow_factory, policy=FAST)
    try:
        supervisor.start(make_spec("r-1"), "/models/x")
        supervisor.start(make_spec("r-2"), "/models/x")
        poller = threading.Thread(target=supervisor.poll)
        poller.start()
        assert building.wait(5)
        started = time.monotonic()
        supervisor.statuses()  # what every heartbeat calls (`Reconciler.replica_statuses`)
        waited_s = time.monotonic() - started
        poller.join()
        assert waited_s < 0.5, f"the heartbeat's statuses() waited {waited_s:.1f}s for a command to be built"
        statuses = supervisor.statuses()
        assert all(status.pid is not None for status in statuses)
        assert len({supervisor.get(status.replica_id).command.port for status in statuses}) == 2
    finally:
        supervisor.shutdown(timeout_s=1)


class _StatusPipe:
    """A zygote process's status pipe alone (`exited <pid> <code>` lines), the zygote itself never started."""

    def __init__(self) -> None:
        read_end, self._write_end = os.pipe()
        os.set_blocking(read_end, False)
        self.stdout = os.fdopen(read_end, "rb", buffering=0)
        self.pid = None

    def say(self, line: str) -> None:
        os.write(self._write_end, f"{line}\n".encode())

    def poll(self):
        return None

    def close(self) -> None:
        self.stdout.close()
        os.close(self._write_end)


def test_a_later_engine_under_the_pid_of_one_the_supervisor_killed_unasked_is_not_taken_for_exited(tmp_path):
    """The supervisor kills a forked engine whose launch failed without ever asking its exit (`Zygote.forget`). Kept,
    that exit stayed for the zygote's life, one per such engine, and the next engine forked under the same pid (pids
    wrap) read it as its own: killed as crashed while healthy."""
    zygote = Zygote(tmp_path / "agent", device="cpu")
    status = zygote.process = _StatusPipe()
    zygote.ready = True
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # alive under a "reused" pid
    try:
        zygote.forget(later.pid)  # before its exit line came
        status.say(f"exited {later.pid} -9")
        status.say(f"exited {os.getpid()} -9")  # ... and one whose line came first
        zygote.read_events()
        zygote.forget(os.getpid())
        status.say("exited 12345678 3")  # an engine the supervisor will ask about
        zygote.read_events()
        assert ForkedEngine(later.pid, zygote).poll() is None
        assert ForkedEngine(os.getpid(), zygote).poll() is None
        assert zygote.exit_codes == {12345678: 3}
    finally:
        later.kill()
        later.wait()
        status.close()


def test_an_engine_killed_before_the_zygote_reaped_it_leaves_no_exit_for_a_later_engine_under_its_pid(
    tmp_path, monkeypatch
):
    """The supervisor kills an engine (a failed launch, a drain, a startup timeout) and polls it every 50 ms; it is a
    zombie until the zygote reaps it (`ZYGOTE_REAP_INTERVAL_S`), so the poll settles on -1 before its `exited` line
    comes. Before, that line was kept for the zygote's life, and a healthy engine forked later under the same pid
    read it as its own exit: killed as crashed."""
    zygote = Zygote(tmp_path / "agent", device="cpu")
    status = zygote.process = _StatusPipe()
    zygote.ready = True
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:  # `engine` stands in for the zygote's child: ours, a zombie until we reap it
        forked = ForkedEngine(engine.pid, zygote)
        kill_group(engine.pid, forked, "r-1", zygote.data_dir, signal.SIGKILL)
        assert forked.returncode == -1
        status.say(f"exited {engine.pid} {engine.wait()}")  # the zygote reaps it and says so
        zygote.read_events()

        monkeypatch.setattr(zygote_module, "_running", lambda pid: True)  # pids wrap: a later engine under it
        assert ForkedEngine(engine.pid, zygote).poll() is None
        assert zygote.exit_codes == {}
    finally:
        engine.kill()
        engine.wait()
        status.close()


def test_a_respawned_zygote_keeps_no_exit_its_dead_predecessor_reported(tmp_path):
    """Exits a zygote reported of children nobody asked about (their replicas gone) stayed after it died, and a child
    of the next zygote forked under one of their pids read that exit as its own."""
    zygote = Zygote(tmp_path / "agent", device="cpu")
    status = zygote.process = _StatusPipe()
    zygote.ready = True
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a child of the next one
    try:
        status.say(f"exited {later.pid} -9")  # a dead zygote's child under the same pid (pids wrap)
        zygote.read_events()
        zygote.process, zygote.ready = None, False  # that zygote died (as `Standby._on_death` leaves it)

        zygote.ensure()  # the next one

        assert zygote.process is not None
        assert ForkedEngine(later.pid, zygote).poll() is None
    finally:
        zygote.stop()
        later.kill()
        later.wait()
        status.close()


def test_a_ready_engine_whose_health_fails_is_restarted(make_supervisor):
    """The kernel's OOM killer takes the largest process, and a vLLM engine's is its EngineCore or a worker (they hold
    the host memory), not the API server the agent watches: since the bare-metal unit's `OOMPolicy=continue` that is
    what a node out of memory does to an engine (before, the whole unit stopped). The API server lives on, answering
    /metrics (the only thing asked of a READY engine) and failing /health: the replica stayed READY, routed calls,
    each failing, until one made vLLM exit. A READY engine's /health is now asked every `ready_health_interval_s`,
    and one unhealthy that many times in a row is killed and restarted, as after a crash."""
    policy = dataclasses.replace(FAST, ready_health_interval_s=0.2, max_unhealthy_ready_checks=2)
    supervisor = make_supervisor("--unhealthy-after-s", "1.5", policy=policy)
    supervisor.start(make_spec("r-core-gone"), "/models/x")
    wait_until(lambda: state_of(supervisor, "r-core-gone") == ReplicaState.READY, 10, poll=supervisor.poll)
    first_pid = supervisor.statuses()[0].pid
    wait_until(lambda: supervisor.get("r-core-gone").num_restarts >= 1, 15, poll=supervisor.poll)
    assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == psutil.STATUS_ZOMBIE
    assert "not healthy" in (supervisor.get("r-core-gone").failure_reason or "")


def _ready_engine_silent_after_1_s(make_supervisor, how: str, replica_id: str) -> Supervisor:
    """A READY fake engine whose /health goes unanswered (`how`: `--slow-health-after-s` idle, `--busy-health-after-s`
    computing) after 1 s, its supervisor asking every 0.2 s and taking 1 s of silence while idle for hung."""
    policy = dataclasses.replace(FAST, ready_health_interval_s=0.2, health_timeout_s=0.5, hung_after_s=1.0)
    supervisor = make_supervisor(how, "1.0", policy=policy)
    supervisor.start(make_spec(replica_id), "/models/x")
    wait_until(lambda: state_of(supervisor, replica_id) == ReplicaState.READY, 10, poll=supervisor.poll)
    return supervisor


def test_a_ready_engine_silent_and_idle_is_killed_as_hung_and_restarted(make_supervisor):
    """An engine alive but answering nothing and computing nothing (stopped, deadlocked) is hung, not busy. Before, it
    was killed only after `max_unanswered_ready_checks` unanswered asks (5 minutes), READY and routed calls meanwhile,
    each waiting on it until the gateway's read timeout."""
    supervisor = _ready_engine_silent_after_1_s(make_supervisor, "--slow-health-after-s", "r-hung")
    wait_until(lambda: supervisor.get("r-hung").num_restarts >= 1, 10, poll=supervisor.poll)
    assert "not healthy while READY" in supervisor.get("r-hung").failure_reason


def test_a_ready_engine_silent_while_it_computes_is_not_taken_for_hung(make_supervisor):
    """An engine whose /health goes unanswered while its processes compute (a saturated API server) is busy: kept
    READY past `hung_after_s`, every request in flight on it kept."""
    supervisor = _ready_engine_silent_after_1_s(make_supervisor, "--busy-health-after-s", "r-computing")
    first_pid = supervisor.statuses()[0].pid
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        supervisor.poll()
        time.sleep(0.05)
    replica = supervisor.get("r-computing")
    assert replica.num_unanswered_checks >= 2, "its /health was asked and left unanswered"
    assert replica.num_restarts == 0
    assert (state_of(supervisor, "r-computing"), supervisor.statuses()[0].pid) == (ReplicaState.READY, first_pid)


def test_a_ready_engine_silent_while_it_computes_is_asked_no_more_often_than_one_that_answers(make_supervisor):
    """Each unanswered ask holds the agent's one poll (which also turns a starting engine READY, on a cold call's path)
    for the probe's whole timeout: a busy engine is asked every `ready_health_interval_s` as before, the quicker asks
    (a quarter of `hung_after_s`) kept for one silent and idle. Before, a node's busy engines were asked every 3.75 s,
    2 s of the poll held each time, at the node's busiest."""
    policy = dataclasses.replace(FAST, ready_health_interval_s=2.0, health_timeout_s=0.5, hung_after_s=1.0)
    supervisor = make_supervisor("--busy-health-after-s", "1.0", policy=policy)
    supervisor.start(make_spec("r-busy"), "/models/x")
    wait_until(lambda: state_of(supervisor, "r-busy") == ReplicaState.READY, 10, poll=supervisor.poll)
    deadline = time.monotonic() + 7
    while time.monotonic() < deadline:
        supervisor.poll()
        time.sleep(0.05)
    replica = supervisor.get("r-busy")
    assert replica.num_restarts == 0
    # every 2.5 s (its interval and the timeout), after one quicker ask that found it computing: 9 asks before
    assert 1 <= replica.num_unanswered_checks <= 5


def test_a_ready_engine_slow_to_answer_its_health_is_not_restarted(make_supervisor):
    """A busy engine (a long prefill, a saturated API server, a CPU engine's workers on every core) answers /health late,
    not with a failure: vLLM's own check reads a flag. Before, each answer later than `health_timeout_s` counted as
    unhealthy, and three in a row (30 s under load) killed a healthy engine and every request in flight on it, at the
    busiest time, and again after its restart. Only an answer that is not healthy (or none at all for far longer) counts."""
    policy = dataclasses.replace(FAST, ready_health_interval_s=0.2, max_unhealthy_ready_checks=2, health_timeout_s=0.5)
    supervisor = make_supervisor("--slow-health-after-s", "1.5", policy=policy)
    supervisor.start(make_spec("r-busy"), "/models/x")
    wait_until(lambda: state_of(supervisor, "r-busy") == ReplicaState.READY, 10, poll=supervisor.poll)
    first_pid = supervisor.statuses()[0].pid
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        supervisor.poll()
        time.sleep(0.05)
    assert supervisor.get("r-busy").num_restarts == 0
    assert (state_of(supervisor, "r-busy"), supervisor.statuses()[0].pid) == (ReplicaState.READY, first_pid)
