"""Each engine runs in its own user, PID and mount namespaces: its own /proc and its own /dev/shm.

Before, engines on a node shared /proc and /dev/shm. On a GPU node the sandbox lets an engine write files in /proc
(`sandbox.PROC_WRITE`), so one engine raised a neighbour's `oom_score_adj`; and one that read a neighbour's segment
name opened and grew it in the shared /dev/shm, where it counted against its holder. Fake engines confine themselves
through the real entry (`sandbox.apply_from_environment`, as `engine_main` and `become_engine` do) and log what a
hostile tenant's code in them could do to a neighbour (`fake_engine.py --try-neighbour`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime import namespaces, process, reaper, sandbox, shared_memory
from gpu_agent.runtime.engine import DEVICE_CPU, DEVICE_CUDA
from gpu_agent.runtime.engine_disk import EngineDiskBounds
from gpu_agent.runtime.reaper import runs_under_reaper
from gpu_agent.runtime.supervisor import Supervisor, SupervisorPolicy

from .conftest import fake_engine_factory, make_spec, processes_with_marker, wait_for_state, wait_until

MB = 1024 * 1024
NAMESPACES_MISSING = namespaces.find().missing
pytestmark = pytest.mark.skipif(bool(NAMESPACES_MISSING), reason=NAMESPACES_MISSING or "-")


@pytest.fixture
def make_supervisor(tmp_path, monkeypatch):
    """Supervisors of confined fake engines, each with its own data dir and the fake's arguments given per replica
    (`extra`); as on a GPU node, the policy lets engines write in /proc. Whatever they started goes after the test."""
    monkeypatch.setattr(
        sandbox, "device_nodes", lambda: [*sandbox.DEVICE_NODES, "/dev/nvidia0", "/dev/nvidiactl"]
    )
    made = []

    def make(
        name: str,
        extra: dict[str, list[str]],
        *,
        under_reaper: bool = False,
        device: str = DEVICE_CPU,
        **bounds,
    ) -> Supervisor:
        def factory(spec, model_path, port):
            args = ["--confine", *extra.get(spec.replica_id, [])]
            return fake_engine_factory(*args, under_reaper=under_reaper)(spec, model_path, port)

        made.append(Supervisor(tmp_path / name, command_factory=factory, device=device, sandbox_mode=sandbox.SandboxMode.REQUIRED,
                               policy=SupervisorPolicy(stop_timeout_s=5),
                               disk_bounds=EngineDiskBounds(**{"check_interval_s": 3600, **bounds})))  # fmt: skip
        return made[-1]

    yield make
    for supervisor in made:
        supervisor.shutdown(timeout_s=5)
        process.kill_orphans(supervisor.data_dir, set())


def start(supervisor: Supervisor, replica_id: str, tmp_path: Path):
    supervisor.start(make_spec(replica_id, endpoint_id=f"e-{replica_id}"), tmp_path)
    wait_for_state(supervisor, replica_id, ReplicaState.READY, timeout_s=30)
    return supervisor.get(replica_id)


def logged(replica, prefix: str) -> str:
    line = wait_until(lambda: [line for line in replica.log_path.read_text().splitlines() if line.startswith(prefix)],
                      timeout_s=10)  # fmt: skip
    return line[-1].removeprefix(prefix)


def tried(supervisor: Supervisor, replica_id: str, tmp_path: Path) -> dict:
    """What a fake engine started now could do (`fake_engine.py --try-neighbour`), as it logged it."""
    return json.loads(logged(start(supervisor, replica_id, tmp_path), "==> tried "))


def neighbour_with_shared_memory(make_supervisor, tmp_path) -> tuple[object, str]:
    """Another tenant's engine, holding a segment of 64 KiB in /dev/shm; and that segment's path."""
    neighbours = make_supervisor("neighbour", {"r-b": ["--fill-shm-bytes", str(64 * 1024)]})
    replica = start(neighbours, "r-b", tmp_path)
    return replica, logged(replica, "==> shared memory ")


def test_an_engine_sees_only_its_own_processes_and_cannot_raise_a_neighbours_oom_score(
    make_supervisor, tmp_path
):
    neighbour, _segment = neighbour_with_shared_memory(make_supervisor, tmp_path)
    hostile = make_supervisor("hostile", {"r-a": ["--try-neighbour", json.dumps({"pid": neighbour.pid})]})
    seen = tried(hostile, "r-a", tmp_path)
    assert neighbour.pid not in seen["pids"] and len(seen["pids"]) <= 4  # its init, itself, its worker, `ls`
    assert seen["own_pid"] == 2  # below its init, PID 1
    assert seen["oom_score_adj"] == "refused: No such file or directory"
    # NOTE: as its reaper left it (the agent's own score raised, so the kernel takes an engine before the agent), the
    # hostile engine's "1000" not written
    given = min(1000, int(Path("/proc/self/oom_score_adj").read_text()) + reaper.OOM_SCORE_ADJ_RAISE)
    assert Path(f"/proc/{neighbour.pid}/oom_score_adj").read_text().strip() == str(given)
    assert "own pid, mount and user namespaces" in logged(hostile.get("r-a"), sandbox.APPLIED_LINE)


def test_an_engine_cannot_open_a_neighbours_shared_memory_and_its_own_is_bounded(make_supervisor, tmp_path):
    neighbour, segment = neighbour_with_shared_memory(make_supervisor, tmp_path)
    hostile = make_supervisor("hostile", {"r-a": ["--try-neighbour", json.dumps({"shm": segment}),
                                                  "--try-shm-bytes", str(16 * MB)]},
                              engine_max_bytes=4 * MB)  # fmt: skip
    seen = tried(hostile, "r-a", tmp_path)
    assert seen["shm_open"] == "refused: No such file or directory"
    assert Path(segment).name not in str(seen["shm_listing"])
    assert seen["shm_written"] == 4 * MB  # its /dev/shm is a tmpfs of its bound: the kernel stops it there
    # The agent still counts what the neighbour holds in its own /dev/shm, and names none of it outside.
    held = shared_memory.held_by(shared_memory.process_tree(neighbour.pid))
    assert held.num_bytes >= 64 * 1024 and not held.paths and not held.hidden


@pytest.mark.parametrize("under_reaper", [False, True])
def test_the_agent_stops_and_kills_an_engine_in_its_namespaces_and_every_process_of_it(
    make_supervisor, tmp_path, under_reaper, caplog
):
    caplog.set_level(logging.INFO, logger="gpu_agent.runtime.supervisor")
    supervisor = make_supervisor("agent", {"r-kill": ["--ignore-sigterm"]}, under_reaper=under_reaper)
    # SIGTERM reaches the engine through its outer process and init (PID 1 gets only what it handles); one that
    # ignores it is SIGKILLed after the grace.
    for replica_id, how in (("r-stop", "its own exit, code 0"), ("r-kill", "killed, code")):
        start(supervisor, replica_id, tmp_path)
        processes = processes_with_marker(replica_id)
        assert len(processes) >= 4  # outer, init, engine, its worker (and the reaper)
        supervisor.drain(replica_id)
        wait_for_state(supervisor, replica_id, ReplicaState.STOPPED, timeout_s=20, step_s=0.05)
        wait_until(lambda rid=replica_id: not processes_with_marker(rid), timeout_s=5, step_s=0.05)
        assert f"replica {replica_id} STOPPED" in caplog.text and f"({how}" in caplog.text
        assert not [
            found for found in processes if found.is_running() and found.status() != psutil.STATUS_ZOMBIE
        ]


def test_a_crashed_engine_takes_its_namespace_with_it(make_supervisor, tmp_path):
    supervisor = make_supervisor("agent", {"r-crash": ["--exit-after-s", "1"]})
    replica = start(supervisor, "r-crash", tmp_path)
    worker = [
        found
        for found in psutil.Process(replica.pid).children(recursive=True)
        if "sleep" in " ".join(found.cmdline())
    ]
    assert len(worker) == 1
    # PID 1 exits with the engine, and the kernel kills what is left in its namespace: the worker, at once.
    wait_until(lambda: "fake engine exits" in replica.log_path.read_text(), timeout_s=10)
    worker[0].wait(timeout=2)


def test_a_new_agent_reaps_the_engines_an_agent_left(make_supervisor, tmp_path):
    old_agent = make_supervisor("agent", {})
    orphan = start(old_agent, "r-orphan", tmp_path)
    below = psutil.Process(orphan.pid).children(recursive=True)
    assert len(below) >= 2  # its init, the engine and its worker, seen by their outer pids
    # The agent that started it is gone without stopping it; the next one finds it by its marker and kills it.
    process.kill_orphans(old_agent.data_dir, set())
    wait_until(lambda: not processes_with_marker("r-orphan"), timeout_s=5)
    # NOTE: killed, the init (PID 1 inside) ends only once the kernel has ended what is left in its namespace: seen
    # running for a moment after its marker can no longer be read (failed once on a loaded machine)
    wait_until(lambda: not _alive(below), timeout_s=5)
    assert not _alive(below)


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for found in processes:
        try:
            if found.is_running() and found.status() != psutil.STATUS_ZOMBIE:
                alive.append(found)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_a_new_agent_adopts_an_engine_in_its_namespaces_sleeps_and_wakes_it_and_kills_the_one_it_does_not_want(
    make_supervisor, tmp_path
):
    sleepy = {replica_id: ["--sleep-mode"] for replica_id in ("r-kept", "r-gone")}
    first = make_supervisor("agent", sleepy, under_reaper=True, device=DEVICE_CUDA)
    for replica_id in ("r-kept", "r-gone"):
        first.start(make_spec(replica_id, endpoint_id=f"e-{replica_id}", sleep_mode=True), tmp_path)
        wait_for_state(first, replica_id, ReplicaState.READY, timeout_s=30)
    pid = first.get("r-kept").pid
    first._probe.close()  # the old agent vanishes without stopping its engines
    first._replicas.clear()

    second = make_supervisor("agent", sleepy, under_reaper=True, device=DEVICE_CUDA)
    kept = make_spec("r-kept", endpoint_id="e-r-kept", sleep_mode=True)
    assert second.recover({"r-kept": kept}) == (["r-kept"], ["r-gone"])
    wait_until(lambda: not processes_with_marker("r-gone"), timeout_s=5)
    assert second.get("r-kept").pid == pid
    second.sleep("r-kept")
    wait_until(lambda: second.get("r-kept").state == ReplicaState.SLEEPING, timeout_s=10, poll=second.poll)
    second.wake("r-kept")
    wait_until(lambda: second.get("r-kept").state == ReplicaState.READY, timeout_s=10, poll=second.poll)
    log = second.get("r-kept").log_path.read_text()
    assert "fake engine sleeps (level 1)" in log and "fake engine wakes" in log


def test_an_engine_past_its_bound_fails_and_the_names_it_held_in_its_own_shared_memory_remove_nothing_outside(
    make_supervisor, tmp_path
):
    supervisor = make_supervisor("agent", {"r-shm": ["--fill-shm-bytes", str(64 * 1024), "--fill-scratch-bytes",
                                                     str(2 * MB)]}, engine_max_bytes=MB, check_interval_s=0)  # fmt: skip
    replica = start(supervisor, "r-shm", tmp_path)
    segment = Path(logged(replica, "==> shared memory "))
    segment.write_bytes(b"the agent's own")  # the same name in the node's /dev/shm, outside its namespace
    try:
        supervisor.check_disk()
        assert supervisor.get("r-shm").state == ReplicaState.FAILED
        assert "to its own folders and /dev/shm" in supervisor.get("r-shm").failure_reason
        wait_until(lambda: not processes_with_marker("r-shm"), timeout_s=10)
        assert segment.read_bytes() == b"the agent's own"
    finally:
        segment.unlink(missing_ok=True)


def test_an_engine_can_make_no_namespaces_of_its_own(make_supervisor, tmp_path):
    # Nested user namespaces need no capability, and each counted against the node's per-uid limit, which every
    # engine and the agent share: one engine exhausted it and the next engines' namespaces were refused.
    seen = tried(make_supervisor("hostile", {"r-a": ["--try-namespaces"]}), "r-a", tmp_path)
    assert seen["unshare_user"] == "refused: No space left on device"
    assert seen["lift_limit"] == "refused: Permission denied"
    assert namespaces.find().missing == ""  # the agent's, as before


def test_an_engines_own_shared_memory_holds_few_files_and_the_agent_counts_them(make_supervisor, tmp_path):
    # Empty files cost the kernel ~1 KiB each and no byte: 300,000 of them were ~300 MiB of its memory, counted 0.
    supervisor = make_supervisor("agent", {"r-a": ["--try-shm-files", "1000"]}, engine_max_files=300,
                                 check_interval_s=0)  # fmt: skip
    seen = tried(supervisor, "r-a", tmp_path)
    assert 250 < seen["shm_files_made"] < 300  # its tmpfs's nr_inodes: the engine's bound of files, its root is one
    assert shared_memory.held_by(shared_memory.process_tree(supervisor.get("r-a").pid)).num_files == seen[
        "shm_files_made"
    ]
    supervisor.check_disk()  # with its folders' files, past its bound
    assert supervisor.get("r-a").state == ReplicaState.FAILED
    assert "more than 300 files and folders" in supervisor.get("r-a").failure_reason


def test_what_an_engine_closed_in_its_own_shared_memory_counts_in_its_bound(make_supervisor, tmp_path):
    # Closed and unmapped, a file still holds its RAM for the engine's whole life; the agent counted only what its
    # processes held.
    supervisor = make_supervisor("agent", {"r-a": ["--fill-shm-bytes", str(768 * 1024), "--shm-closed",
                                                   "--fill-scratch-bytes", str(512 * 1024)]},
                                 engine_max_bytes=MB, check_interval_s=0)  # fmt: skip
    replica = start(supervisor, "r-a", tmp_path)
    logged(replica, "==> shared memory ")
    assert shared_memory.held_by(shared_memory.process_tree(replica.pid)).num_bytes >= 768 * 1024
    supervisor.check_disk()
    assert supervisor.get("r-a").state == ReplicaState.FAILED
    assert "to its own folders and /dev/shm" in supervisor.get("r-a").failure_reason


MAP_FILES = pytest.mark.skipif(os.geteuid() != 0, reason="map_files needs CAP_CHECKPOINT_RESTORE")
# The engines' socket for passing a file (`fake_engine.py --give-shm-fd`) is in the giver's scratch folder, under the
# machine's /tmp, which each engine's mount namespace now hides (`namespaces._hide_socket_folders`). The agent's charge
# of a file of another engine's tmpfs stays for the ways still open without it: engines share the node's network
# namespace, so below Landlock ABI 6 (abstract sockets unscoped) one passes a file to another over an abstract socket.
# Shown here with the folders left unhidden, the one socket the fake engines use standing for any such way.
GIVERS_ARGS = ["--fill-shm-bytes", str(48 * MB), "--shm-closed", "--give-shm-fd", "TMPDIR"]


@pytest.fixture
def socket_folders_unhidden(monkeypatch):
    """Engines started now whose mount namespaces hide none of the machine's socket folders."""
    monkeypatch.setattr(sandbox, "MACHINE_SOCKET_FOLDERS", ())


@pytest.mark.parametrize("mapped", [False, pytest.param(True, marks=MAP_FILES)])
def test_an_engine_holding_files_of_stopped_engines_shared_memory_is_charged_their_whole_tmpfs_and_stopped(
    make_supervisor, tmp_path, mapped, socket_folders_unhidden
):
    # Two replicas of one tenant's endpoint: each giver writes 48 MiB in its own /dev/shm, closes it, and passes a
    # 1-byte file of it over a Unix socket to the keeper, then stops. That file keeps the giver's whole tmpfs; in the
    # keeper its path names nothing under /dev/shm, so the agent counted it 0: each giver's bound of RAM pinned for
    # good, in pages no RSS shows (the review of the sandbox). The socket is in the giver's scratch folder, whose path
    # /proc/net/unix lists: the endpoint's shared cache folder, where they met first, makes none since.
    keeper_args = ["--keep-shm-fds", *(["--keep-mapped"] if mapped else [])]
    supervisor = make_supervisor("agent", {"r-b": keeper_args, "r-a1": GIVERS_ARGS, "r-a2": GIVERS_ARGS},
                                 engine_max_bytes=64 * MB, check_interval_s=0)  # fmt: skip
    for replica_id in ("r-b", "r-a1", "r-a2"):
        supervisor.start(make_spec(replica_id, endpoint_id="e-same"), tmp_path)
        wait_for_state(supervisor, replica_id, ReplicaState.READY, timeout_s=30)
        assert "the machine's sockets hidden" not in logged(supervisor.get(replica_id), sandbox.APPLIED_LINE)
        if replica_id == "r-b":
            continue
        assert json.loads(logged(supervisor.get(replica_id), "==> give "))["socket"] == "made"
        logged(supervisor.get("r-b"), f"==> kept {replica_id[-1]}")
        supervisor.drain(replica_id)
        wait_for_state(supervisor, replica_id, ReplicaState.STOPPED, timeout_s=20)
    keeper = supervisor.get("r-b")
    assert keeper.state == ReplicaState.READY  # each giver's 48 MiB alone is within the keeper's bound
    assert shared_memory.held_by(shared_memory.process_tree(keeper.pid)).num_bytes >= 96 * MB
    supervisor.check_disk()
    assert supervisor.get("r-b").state == ReplicaState.FAILED
    assert "to its own folders and /dev/shm" in supervisor.get("r-b").failure_reason


def test_with_the_machines_socket_folders_hidden_an_engine_reaches_no_other_engines_socket_to_take_a_file(
    make_supervisor, tmp_path
):
    supervisor = make_supervisor("agent", {"r-b": ["--keep-shm-fds"], "r-a1": GIVERS_ARGS},
                                 engine_max_bytes=64 * MB, check_interval_s=0)  # fmt: skip
    keeper, giver = (start(supervisor, replica_id, tmp_path) for replica_id in ("r-b", "r-a1"))
    made = json.loads(logged(giver, "==> give "))
    assert made["socket"] == "made"  # in its own scratch folder, which it still reaches
    # The keeper finds the socket in the node's /proc/net/unix, and the path names nothing in its mount namespace.
    refused = json.loads(logged(keeper, "==> refused "))
    assert refused["path"].startswith(made["folder"] + "/") and refused["error"] == "No such file or directory"
    assert "==> kept" not in keeper.log_path.read_text()
    assert shared_memory.held_by(shared_memory.process_tree(keeper.pid)).num_bytes < 48 * MB


# Runs the engine in a user namespace that may make none below it: as on a node whose user namespaces are exhausted.
EXHAUSTED = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
assert libc.unshare(0x10000000) == 0
for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
    open(f"/proc/self/{name}", "w").write(text)
open("/proc/sys/user/max_user_namespaces", "w").write("0")
os.execv(sys.argv[1], sys.argv[1:])
"""


@pytest.mark.parametrize("under_reaper", [False, True])
def test_namespaces_refused_after_the_agent_found_them_working_fail_the_launch_and_are_tested_again(
    make_supervisor, tmp_path, monkeypatch, under_reaper
):
    supervisor = make_supervisor("agent", {}, under_reaper=under_reaper)
    fact = sandbox.NamespacesFact(attempt_pause_s=0.05, retest_interval_s=0.0)
    monkeypatch.setattr(sandbox, "NAMESPACES", fact)
    assert fact.missing() == ""
    factory = supervisor.command_factory

    def exhausted(spec, model_path, port):
        command = factory(spec, model_path, port)
        at = 4 if runs_under_reaper(command.argv) else 0  # inside the reaper, as a node's kernel would refuse it
        return dataclasses.replace(command, argv=[*command.argv[:at], sys.executable, "-c", EXHAUSTED, *command.argv[at:]])

    monkeypatch.setattr(supervisor, "command_factory", exhausted)
    supervisor.start(make_spec("r-a", endpoint_id="e-r-a"), tmp_path)
    wait_for_state(supervisor, "r-a", ReplicaState.FAILED, timeout_s=30)
    replica = supervisor.get("r-a")
    # At once, never restarted into the same refusal; the agent's fact tested again, off the lock (here they work:
    # only that engine's namespace was exhausted).
    assert replica.num_restarts == 0
    reason = replica.failure_reason
    assert "namespaces were refused where this agent had found them working (the agent tests them again)" in reason
    assert "unshare refused (No space left on device)" in reason
    wait_until(lambda: fact.num_retests, timeout_s=30, poll=supervisor.poll)
    assert sandbox.namespaces_missing() == ""


REFUSALS = {
    # A container runtime's seccomp, or user namespaces turned off: the kernel refuses at once.
    "unshare": (
        """
        real = namespaces._libc()
        class Refusing:
            def __getattr__(self, name):
                return getattr(real, name)
            def unshare(self, flags):
                ctypes.set_errno(1)
                return -1
        namespaces._libc = Refusing
    """,
        "no namespaces: unshare refused (Operation not permitted)",
    ),
    # A /proc with masked parts (a container's): a fresh procfs is refused after the PID namespace exists.
    "mount": (
        """
        mount = namespaces._mount
        def refusing(libc, source, target, *rest):
            if target == "/proc":
                raise OSError(1, "mounting /proc: Operation not permitted")
            return mount(libc, source, target, *rest)
        namespaces._mount = refusing
    """,
        "no namespaces: mounting /proc: Operation not permitted",
    ),
    # The node short of memory: not the kernel's answer about namespaces, but no start half set up either.
    "mount short of memory": (
        """
        mount = namespaces._mount
        def short(libc, source, target, *rest):
            if target == "/dev/shm":
                raise OSError(12, "mounting /dev/shm: Cannot allocate memory")
            return mount(libc, source, target, *rest)
        namespaces._mount = short
    """,
        "no namespaces: mounting /dev/shm: Cannot allocate memory",
    ),
}


def confine(mode: sandbox.SandboxMode, refused: str | None, namespaces_missing: str | None = None):
    """An engine's start (`apply_from_environment`) where the kernel refuses namespaces as `refused` says, under a
    policy that says what the agent found (`namespaces_missing`); it then starts a child, as vLLM would."""
    script = "import ctypes, os\nfrom gpu_agent.runtime import namespaces, sandbox\n"
    script += textwrap.dedent(REFUSALS[refused][0] if refused else "") + textwrap.dedent("""
        sandbox.apply_from_environment()
        # NOTE: never half set up: a process left in a PID namespace whose init is gone could not start a child.
        child = os.fork() or os._exit(7)
        print("vLLM would start now, a child exited", os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
    """)
    policy = sandbox.SandboxPolicy(mode=mode, namespaces_missing=namespaces_missing)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, sandbox.POLICY_ENV: policy.to_json()}, cwd=Path(__file__).parents[2])  # fmt: skip


@pytest.mark.parametrize("refused", sorted(REFUSALS))
def test_where_namespaces_are_refused_the_sandbox_mode_decides_and_says_so(refused):
    why = REFUSALS[refused][1]
    required = confine(sandbox.SandboxMode.REQUIRED, refused)
    assert required.returncode == 78 and "vLLM would start now" not in required.stdout
    assert (
        f"{sandbox.APPLIED_LINE} none: {why}; INFERPLANE_ENGINE_SANDBOX=required: not starting"
        in required.stderr
    )
    best_effort = confine(sandbox.SandboxMode.BEST_EFFORT, refused)
    assert best_effort.returncode == 0, best_effort.stderr
    assert "vLLM would start now, a child exited 7" in best_effort.stdout
    assert f"{why} (INFERPLANE_ENGINE_SANDBOX=best-effort: {sandbox.SHARED_WITHOUT_NAMESPACES})" in best_effort.stderr


SYSTEM_V_SEGMENT = """
import ctypes, os, sys
from gpu_agent.runtime import sandbox
sandbox.apply_from_environment()
libc = ctypes.CDLL(None, use_errno=True)
print(libc.shmget(int(sys.argv[1]), 1 << 20, 0o1600), flush=True)  # IPC_CREAT | 0600, never removed
"""


@pytest.mark.skipif(bool(NAMESPACES_MISSING), reason=NAMESPACES_MISSING or "-")
def test_a_system_v_segment_an_engine_leaves_goes_with_it_and_no_other_process_of_the_node_finds_it():
    # In the node's IPC namespace a segment no process removes outlives its maker until the machine restarts: a
    # tenant's engines left memory no engine's bound counts, and any engine of the node attached it by its key.
    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x52560000 + os.getpid() % 0xFFFF
    policy = sandbox.SandboxPolicy(mode=sandbox.SandboxMode.REQUIRED, namespaces_missing="")
    done = subprocess.run([sys.executable, "-c", SYSTEM_V_SEGMENT, str(key)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, sandbox.POLICY_ENV: policy.to_json()},
                          cwd=Path(__file__).parents[2])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) >= 0  # made in the engine
    left = libc.shmget(key, 0, 0)
    if left >= 0:
        libc.shmctl(left, 0, None)  # IPC_RMID: not left on this machine by the test
    assert left == -1 and ctypes.get_errno() == errno.ENOENT


def test_an_engine_goes_by_what_the_agent_found_and_never_on_half_set_up():
    # Refused on this node, as the agent found: not tried again; the mode decides.
    best_effort = confine(sandbox.SandboxMode.BEST_EFFORT, None, namespaces_missing="unshare refused (EPERM)")
    assert "vLLM would start now, a child exited 7" in best_effort.stdout
    assert (
        "no namespaces: unshare refused (EPERM) (INFERPLANE_ENGINE_SANDBOX=best-effort" in best_effort.stderr
    )
    assert (
        confine(sandbox.SandboxMode.REQUIRED, None, namespaces_missing="unshare refused (EPERM)").returncode
        == 78
    )
    # Found working, then refused (the node's user namespaces exhausted): never a start without them, whatever the mode.
    for mode in (sandbox.SandboxMode.BEST_EFFORT, sandbox.SandboxMode.REQUIRED):
        refused = confine(mode, "unshare", namespaces_missing="")
        assert "vLLM would start now" not in refused.stdout and refused.returncode == sandbox.EXIT_NAMESPACES_REFUSED
        assert (
            f"{sandbox.APPLIED_LINE} none: no namespaces: unshare refused (Operation not permitted); though the agent "
            "found them working here, whatever the mode: not starting" in refused.stderr
        )
    # Found working, so entered at once (no trial in a child): where that fails half done, the engine never starts.
    assert "own pid, mount and user namespaces" in confine(sandbox.SandboxMode.REQUIRED, None, "").stderr
    half = confine(sandbox.SandboxMode.BEST_EFFORT, "mount", namespaces_missing="")
    assert half.returncode == 78 and "vLLM would start now" not in half.stdout
    assert (
        f"{sandbox.APPLIED_LINE} none: namespaces half set up: mounting /proc: Operation not permitted; "
        "whatever the mode: not starting" in half.stderr
    )
    short = confine(sandbox.SandboxMode.BEST_EFFORT, "mount short of memory", namespaces_missing="")
    assert short.returncode == 78 and "vLLM would start now" not in short.stdout
    assert "namespaces half set up: mounting /dev/shm: Cannot allocate memory" in short.stderr


def test_the_node_says_its_engines_have_namespaces_of_their_own():
    assert sandbox.node_fact(sandbox.SandboxMode.BEST_EFFORT).endswith("; own pid, mount and user namespaces")


# The scenario above, mapped, under an agent without CAP_CHECKPOINT_RESTORE (the systemd unit's): prints the keeper's
# state and reason after the agent's check.
KEEPER_WITHOUT_THE_CAPABILITY = """
import json, sys
from pathlib import Path
from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime import process, sandbox
from gpu_agent.runtime.engine_disk import EngineDiskBounds
from gpu_agent.runtime.reaper import runs_under_reaper
from gpu_agent.runtime.supervisor import Supervisor, SupervisorPolicy
from tests.agent.conftest import fake_engine_factory, make_spec, wait_for_state

sandbox.MACHINE_SOCKET_FOLDERS = ()  # as the test above (`socket_folders_unhidden`)
MB = 1_000_000
args = {"r-b": ["--keep-shm-fds", "--keep-mapped"],
        "r-a1": ["--fill-shm-bytes", str(48 * MB), "--shm-closed", "--give-shm-fd", "TMPDIR"]}
factory = lambda spec, path, port: fake_engine_factory("--confine", *args[spec.replica_id])(spec, path, port)
supervisor = Supervisor(Path(sys.argv[1]), command_factory=factory, sandbox_mode=sandbox.SandboxMode.REQUIRED,
                        policy=SupervisorPolicy(stop_timeout_s=5),
                        disk_bounds=EngineDiskBounds(engine_max_bytes=64 * MB, check_interval_s=0))
try:
    for replica_id in ("r-b", "r-a1"):
        supervisor.start(make_spec(replica_id, endpoint_id="e-same"), Path(sys.argv[1]))
        wait_for_state(supervisor, replica_id, ReplicaState.READY, timeout_s=30)
    log = supervisor.get("r-b").log_path
    wait_for_state(supervisor, "r-a1", ReplicaState.READY, timeout_s=1)
    import time
    deadline = time.monotonic() + 20
    while "==> kept 1" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    supervisor.drain("r-a1")
    wait_for_state(supervisor, "r-a1", ReplicaState.STOPPED, timeout_s=20)
    supervisor.check_disk()
    keeper = supervisor.get("r-b")
    print(json.dumps({"state": keeper.state.value, "reason": keeper.failure_reason or ""}))
finally:
    supervisor.shutdown(timeout_s=5)
    process.kill_orphans(supervisor.data_dir, set())
"""


AS_ROOT = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root")


@AS_ROOT
def test_an_engine_mapping_a_stopped_engines_shared_memory_fails_with_the_reason_under_an_agent_without_the_capability(
    tmp_path,
):
    # Before, the keeper's mapping (its fd closed) was refused to this agent and counted 0: READY, 48 MiB pinned.
    # NOTE: the agent keeps its user (root here: this interpreter may lie where no other user reads) and every
    # capability but CAP_SETFCAP (which root needs to map itself in its engines' user namespaces) goes, CAP_SYS_ADMIN
    # and CAP_CHECKPOINT_RESTORE among them.
    done = subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-all,+setfcap",
         sys.executable, "-c", KEEPER_WITHOUT_THE_CAPABILITY, str(tmp_path / "agent")],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    keeper = json.loads(done.stdout.splitlines()[-1])
    assert keeper["state"] == ReplicaState.FAILED.value, keeper
    assert "maps memory of a tmpfs not its own that this agent cannot measure (/" in keeper["reason"]
