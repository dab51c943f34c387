"""A replica's log stays within its bound while its engine runs, keeps the last lines a failure's reason quotes, and
never makes the engine wait: the engine writes to the file itself, and the agent cuts the file in place."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from gpu_agent.protocol import EngineMemory, ReplicaState
from gpu_agent.runtime import process
from gpu_agent.runtime.engine_memory import read_engine_memory
from gpu_agent.runtime.supervisor import Supervisor, SupervisorPolicy
from tests.agent.conftest import fake_engine_factory, make_spec, wait_for_state, wait_until

MIB = 1024 * 1024
BOUND = 1 * MIB


def sizes_of(log_path) -> tuple[int, int]:
    """The log's size and its kept-aside part's (0 for none)."""
    aside = log_path.with_name(f"{log_path.name}.1")
    return (
        log_path.stat().st_size if log_path.exists() else 0,
        aside.stat().st_size if aside.exists() else 0,
    )


@pytest.fixture
def chatty_replica(tmp_path):
    """A supervisor whose monitor runs (its disk thread every 0.2 s) and one engine writing 24 MiB of log lines at
    8 MiB/s, its log bounded to 1 MiB; yields the supervisor, the replica and the largest sizes seen while it wrote."""
    supervisor = Supervisor(
        tmp_path / "agent",
        command_factory=fake_engine_factory(
            "--chatter-bytes", str(24 * MIB), "--chatter-bytes-per-s", str(8 * MIB)
        ),
        policy=SupervisorPolicy(max_log_bytes=BOUND),
    )
    supervisor.start_monitor(interval_s=0.2, starting_interval_s=0.05)
    replica = supervisor.start(make_spec("r-chatty"), "/nonexistent")
    wait_until(lambda: replica.state == ReplicaState.READY, timeout_s=60)
    largest = [0, 0]
    stop_sampling = threading.Event()

    def sample():
        while not stop_sampling.wait(0.01):
            for index, size in enumerate(sizes_of(replica.log_path)):
                largest[index] = max(largest[index], size)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    yield supervisor, replica, largest
    stop_sampling.set()
    sampler.join(timeout=5)
    supervisor.shutdown(timeout_s=1)


def test_a_chatty_engines_log_stays_within_its_bound_and_keeps_its_last_lines(chatty_replica):
    supervisor, replica, largest = chatty_replica
    wait_until(lambda: "chatter done" in process.log_tail(replica.log_path, 3), timeout_s=120)
    wait_until(lambda: sizes_of(replica.log_path)[0] <= BOUND, timeout_s=30)  # the disk thread's next check

    size, aside = sizes_of(replica.log_path)
    tail = process.log_tail(replica.log_path, 5).splitlines()
    print(f"log {size} bytes, kept aside {aside}; largest seen {largest[0]} and {largest[1]}; {tail[-1]}")
    assert size <= BOUND and 0 < aside <= BOUND
    assert sorted(path.name for path in replica.log_path.parent.iterdir()) == [
        "r-chatty.log",
        "r-chatty.log.1",
    ]
    assert tail[-1].startswith("chatter done: 25165824 bytes in 262144 lines")
    assert tail[-2].startswith("chatter line 000262143 ")  # the last line it wrote, whole
    assert (
        supervisor.get("r-chatty").state == ReplicaState.READY
        and process.exit_code(replica.process, replica.pid) is None
    )


def test_an_engine_writes_its_log_to_the_file_itself_never_to_a_pipe_the_agent_drains(chatty_replica):
    supervisor, replica, _ = chatty_replica
    wait_until(lambda: "chatter done" in process.log_tail(replica.log_path, 3), timeout_s=120)
    for fd in (1, 2):
        target = os.stat(f"/proc/{replica.pid}/fd/{fd}")
        assert stat.S_ISREG(target.st_mode)
        assert os.path.samestat(
            target, os.stat(replica.log_path)
        )  # the very file, cut in place, never replaced
        assert open_flags(replica.pid, fd) & os.O_APPEND  # so each write lands at the end the cut left


def open_flags(pid: int, fd: int) -> int:
    with open(f"/proc/{pid}/fdinfo/{fd}") as fdinfo:
        return int(fdinfo.read().split("flags:")[1].split()[0], 8)


def test_a_log_cut_while_its_writer_appends_keeps_its_end_aside_and_takes_the_next_line_at_its_start(
    tmp_path,
):
    log_path = tmp_path / "r-1.log"
    writer = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # as every engine's log is open
    try:
        lines = [f"line {number:07d} {'.' * 40}\n".encode() for number in range(60_000)]  # ~3 MiB
        os.write(writer, b"".join(lines))
        process.keep_log_within(log_path, BOUND)
        assert sizes_of(log_path)[0] == 0
        aside = log_path.with_name("r-1.log.1").read_bytes()
        assert len(aside) <= BOUND and aside.startswith(b"line ") and aside.endswith(lines[-1])
        assert process.log_tail(log_path, 2) == "\n".join(line.decode().rstrip("\n") for line in lines[-2:])

        os.write(writer, b"after the cut\n")
        assert (
            log_path.read_bytes() == b"after the cut\n"
        )  # at its new start: no hole where the old content was
        assert process.log_tail(log_path, 2) == f"{lines[-1].decode().rstrip()}\nafter the cut"
    finally:
        os.close(writer)


@pytest.fixture
def ended_replica(tmp_path, monkeypatch):
    """A supervisor that keeps no ended replica's log, and its one replica `r-ended`, whose engine exited: FAILED."""
    from gpu_agent.runtime import supervisor as supervisor_module

    monkeypatch.setattr(supervisor_module, "KEPT_ENDED_LOGS", 0)
    supervisor = Supervisor(
        tmp_path / "agent",
        command_factory=fake_engine_factory("--exit-after-s", "0"),
        policy=SupervisorPolicy(max_consecutive_crashes=1),
    )
    try:
        supervisor.start(make_spec("r-ended"), "/nonexistent")
        wait_for_state(supervisor, "r-ended", ReplicaState.FAILED, timeout_s=60)
        yield supervisor
    finally:
        supervisor.shutdown(timeout_s=1)


def test_the_part_kept_aside_of_a_pruned_replicas_log_goes_with_it(ended_replica):
    supervisor = ended_replica
    supervisor.logs_dir.joinpath("r-ended.log.1").write_bytes(b"kept aside\n")
    supervisor.forget("r-ended")
    assert list(supervisor.logs_dir.iterdir()) == []


def crash_log(log_path, label: str) -> bytes:
    """Appends ~1.7 MiB of an engine's chatter and then its crash's reason (the last line); returns that line."""
    reason = f"RuntimeError: CUDA out of memory ({label})\n".encode()
    with open(log_path, "ab") as log:
        log.write(b"".join(f"{label} line {number:06d} {'x' * 40}\n".encode() for number in range(30_000)))
        log.write(b"Traceback (most recent call last):\n" + reason)
    return reason


class DuringTheCut:
    """Runs `action` on a thread of its own once the next cut of `log_path` has emptied it and writes its end aside
    (its `.1.partial`), and lets the cut go on once `action` is done, or after a while if it waits for the cut."""

    def __init__(self, monkeypatch, log_path, action) -> None:
        self.thread: threading.Thread | None = None
        self.result = None
        real_write_bytes = Path.write_bytes

        def run() -> None:
            self.result = action()

        def write_bytes(path, data):
            if path.name == f"{log_path.name}.1.partial" and self.thread is None:
                self.thread = threading.Thread(target=run)
                self.thread.start()
                self.thread.join(timeout=0.5)
            return real_write_bytes(path, data)

        monkeypatch.setattr(Path, "write_bytes", write_bytes)

    def joined(self):
        """What `action` returned."""
        assert self.thread is not None, "no cut wrote its end aside"
        self.thread.join()
        return self.result


def test_a_failure_reason_read_while_the_log_is_cut_quotes_the_crashs_last_lines_never_nothing_nor_an_older_cut(
    tmp_path, monkeypatch
):
    log_path = tmp_path / "r-crash.log"
    for label in ("first crash", "second crash"):  # the second with the first cut's `.1` still in place
        reason = crash_log(log_path, label)
        during = DuringTheCut(monkeypatch, log_path, lambda: process.log_tail(log_path, 20))
        process.keep_log_within(log_path, BOUND)
        tail = during.joined()
        monkeypatch.undo()
        print(f"{label}: read during the cut, last line {tail.splitlines()[-1:]!r}")
        assert tail.splitlines()[-1:] == [reason.decode().rstrip("\n")]


def test_two_cuts_of_one_log_at_once_keep_the_newer_end_aside(tmp_path, monkeypatch):
    """The standby's spawn and the log thread both cut `standby.log`: the second comes while the first writes its end
    aside, the writer having refilled the log meanwhile."""
    log_path = tmp_path / "standby.log"
    crash_log(log_path, "older")

    def refill_and_cut():
        newer = crash_log(log_path, "newer")
        process.keep_log_within(log_path, BOUND)
        return newer

    during = DuringTheCut(monkeypatch, log_path, refill_and_cut)
    process.keep_log_within(log_path, BOUND)
    newer = during.joined()

    aside = log_path.with_name("standby.log.1").read_bytes()
    left = sorted(path.name for path in tmp_path.iterdir())
    print(f"kept aside: {len(aside)} bytes ending {aside[-50:]!r}; left: {left}")
    assert aside.endswith(newer)
    assert left == ["standby.log", "standby.log.1"]


def test_the_engine_memory_a_replica_reports_survives_a_cut_between_its_memory_lines_and_ready(tmp_path):
    log_path = tmp_path / "r-memory.log"
    with open(log_path, "ab") as log:
        log.write(
            b"".join(
                f"an earlier launch's line {number:06d} {'z' * 30}\n".encode() for number in range(17_000)
            )
        )
        log.write(b"\n==> launch 2026-12-05 10:00:00: vllm serve\n")
        log.write(
            b"(EngineCore pid=1) INFO 12-05 10:00:01 [gpu_model_runner.py:1] Model loading took 14.5 GiB memory "
            b"and 3.0 seconds\n"
            b"(EngineCore pid=1) INFO 12-05 10:00:02 [gpu_worker.py:1] Available KV cache memory: 50.0 GiB\n"
        )
        log.write(
            b"(APIServer pid=1) INFO 12-05 10:00:03 [api_server.py:1] Starting vLLM API server\n" * 2000
        )
    before = read_engine_memory(log_path)
    assert log_path.stat().st_size > BOUND and before is not None

    process.keep_log_within(log_path, BOUND)  # past its bound before the engine answers its health check

    assert log_path.stat().st_size == 0
    assert read_engine_memory(log_path) == before == EngineMemory(weights_mb=14848, kv_cache_mb=51200)


def test_what_an_agent_killed_mid_cut_left_goes_at_the_next_agents_start(tmp_path):
    logs_dir = tmp_path / "agent" / "logs"
    logs_dir.mkdir(parents=True)
    for name in ("r-old.log", "r-old.log.1", "r-old.log.1.partial", "standby.log", "standby.log.1.partial"):
        logs_dir.joinpath(name).write_bytes(b"x" * 1000)

    Supervisor(tmp_path / "agent")

    assert sorted(path.name for path in logs_dir.iterdir()) == ["r-old.log", "r-old.log.1", "standby.log"]


def test_what_a_cut_left_beside_a_pruned_replicas_log_goes_with_it(ended_replica):
    supervisor = ended_replica
    # agent killed mid-cut
    supervisor.logs_dir.joinpath("r-ended.log.1.partial").write_bytes(b"being kept aside\n")
    supervisor.forget("r-ended")
    assert list(supervisor.logs_dir.iterdir()) == []


def test_the_logs_stay_within_their_bound_while_a_walk_of_the_engines_folders_takes_long(
    tmp_path, monkeypatch
):
    """An engine may slow the disk check's walk on purpose (200k files in its scratch took 1.7 s a walk): the logs are
    bounded all the same. Here the walk never ends while the test runs."""
    supervisor = Supervisor(tmp_path / "agent", policy=SupervisorPolicy(max_log_bytes=BOUND))
    walking, walk_may_end = threading.Event(), threading.Event()

    def endless_walk():
        walking.set()
        walk_may_end.wait(120)

    monkeypatch.setattr(supervisor, "check_disk", endless_walk)
    supervisor.start_monitor(interval_s=0.2)
    try:
        assert walking.wait(30)
        log_path = supervisor.logs_dir / "standby.log"
        crash_log(log_path, "standby")  # written while the walk goes on
        # NOTE: the cut empties the log before it writes the kept part (`process.keep_log_within`): wait for both.
        wait_until(lambda: sizes_of(log_path)[0] <= BOUND and sizes_of(log_path)[1] > 0, timeout_s=30)
        assert 0 < sizes_of(log_path)[1] <= BOUND
    finally:
        walk_may_end.set()
        supervisor.shutdown(timeout_s=1)
