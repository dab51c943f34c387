"""A replica's log stays within its bound while its engine runs, keeps the last lines a failure's reason quotes, and
never makes the engine wait: the engine writes to the file itself, and the agent cuts the file in place."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime import process
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


def test_the_part_kept_aside_of_a_pruned_replicas_log_goes_with_it(tmp_path, monkeypatch):
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
        supervisor.logs_dir.joinpath("r-ended.log.1").write_bytes(b"kept aside\n")
        supervisor.forget("r-ended")
        assert list(supervisor.logs_dir.iterdir()) == []
    finally:
        supervisor.shutdown(timeout_s=1)
