"""A killed engine leaves no shared memory behind (`process.kill_group`), and a live one holds no more than its bound.

vLLM's API server, EngineCore and workers talk through `multiprocessing.shared_memory` segments
(`/dev/shm/psm_*`), unlinked only when the engine exits gracefully; an engine SIGKILLed (an idle drain
past its 1 s grace, a stuck stop) used to leave them until the machine rebooted: hundreds of them on a
busy node. The engine here is a real process group doing what vLLM's does: a parent and a child
process, each holding a segment it created.
"""

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime import process
from gpu_agent.runtime import shared_memory as engine_shared_memory
from gpu_agent.runtime import supervisor as supervisor_module
from gpu_agent.runtime.engine_disk import EngineDiskBounds
from gpu_agent.runtime.supervisor import MAX_INCOMPLETE_SHM_CHECKS, Supervisor

from .conftest import fake_engine_factory, make_spec, processes_with_marker, wait_until

MB = 1_000_000

ENGINE = """
import multiprocessing as mp, sys, time
from multiprocessing import shared_memory

def worker(queue):
    segment = shared_memory.SharedMemory(create=True, size=1 << 16)
    queue.put(segment.name)
    time.sleep(600)

if __name__ == "__main__":
    mp.set_start_method("fork")
    own = shared_memory.SharedMemory(create=True, size=1 << 16)
    queue = mp.Queue()
    mp.Process(target=worker, args=(queue,)).start()
    print(own.name, queue.get(), flush=True)
    time.sleep(600)
"""


def _start_engine(tmp_path: Path):
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    log_path = tmp_path / "engine.log"
    with open(log_path, "ab") as log:
        engine = process.spawn([sys.executable, str(script)], {"PATH": "/usr/bin:/bin"}, log, die_with_agent=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(log_path.read_text().split()) < 2:
        time.sleep(0.05)
    names = log_path.read_text().split()
    assert len(names) == 2, log_path.read_text()
    return engine, [Path("/dev/shm") / name for name in names]


def test_a_killed_engine_s_shared_memory_is_unlinked(tmp_path):
    engine, segments = _start_engine(tmp_path)
    assert all(segment.exists() for segment in segments)
    process.kill_group(engine.pid, engine, "replica-shm", tmp_path, signal.SIGKILL)
    assert engine.poll() is not None
    assert [segment for segment in segments if segment.exists()] == []


def test_shared_memory_of_other_processes_is_left_alone(tmp_path):
    mine = shared_memory.SharedMemory(create=True, size=4096)
    try:
        engine, segments = _start_engine(tmp_path)
        process.kill_group(engine.pid, engine, "replica-shm", tmp_path, signal.SIGKILL)
        assert not any(segment.exists() for segment in segments)
        assert (Path("/dev/shm") / mine.name).exists()
    finally:
        mine.close()
        mine.unlink()


def test_a_gentle_signal_unlinks_nothing(tmp_path):
    engine, segments = _start_engine(tmp_path)
    try:
        process.kill_group(engine.pid, engine, "replica-shm", tmp_path, signal.SIGSTOP)
        assert all(segment.exists() for segment in segments)
    finally:
        process.kill_group(engine.pid, engine, "replica-shm", tmp_path, signal.SIGKILL)


# --- What a live engine holds in /dev/shm counts in its bound -------------------------------------------------
# An engine may create files in /dev/shm but not list it (`sandbox.SHARED_MEMORY`): RAM outside its disk bound, so a
# hostile model's engine filled the machine's memory there, unseen, until the machine rebooted.


@pytest.fixture
def make_supervisor(tmp_path):
    """Supervisors of fake engines: those of replica "r-shm" hold 3 MB in /dev/shm (open and mapped), those of
    "r-unlinked" 3 MB only mapped, its name removed; those of "r-relay" relay a process (fork and exit,
    again and again); whatever they started is gone after the test."""
    made = []
    factories = {
        "r-shm": fake_engine_factory("--fill-shm-bytes", str(3 * MB)),
        "r-unlinked": fake_engine_factory("--fill-shm-bytes", str(3 * MB), "--shm-unlinked"),
        "r-relay": fake_engine_factory("--relay-processes"),
    }
    plain = fake_engine_factory()

    def factory(spec, model_path, port):
        return factories.get(spec.replica_id, plain)(spec, model_path, port)

    def make(**bounds) -> Supervisor:
        made.append(Supervisor(tmp_path / "agent", command_factory=factory, disk_bounds=EngineDiskBounds(**bounds)))
        return made[-1]

    yield make
    for supervisor in made:
        supervisor.shutdown(timeout_s=5)
        process.kill_orphans(supervisor.data_dir, set())
        for log in supervisor.logs_dir.glob("*.log"):  # a killed engine's file waits for the sweep: not here
            for line in log.read_text().splitlines():
                if line.startswith("==> shared memory "):
                    Path(line.removeprefix("==> shared memory ")).unlink(missing_ok=True)


def _held_path(supervisor: Supervisor, replica_id: str) -> Path:
    log = (supervisor.logs_dir / f"{replica_id}.log").read_text()
    return Path(log.split("==> shared memory ", 1)[1].split()[0])


@pytest.mark.parametrize("replica_id", ["r-shm", "r-unlinked"])
def test_an_engine_holding_shared_memory_past_its_bound_fails_with_the_reason_and_its_files_go(
    make_supervisor, replica_id
):
    supervisor = make_supervisor(engine_max_bytes=2 * MB, check_interval_s=0, sweep_interval_s=3600)
    supervisor.start(make_spec(replica_id, endpoint_id="e-shm"), Path("/nonexistent"))
    supervisor.start(make_spec("r-small", endpoint_id="e-small"), Path("/nonexistent"))
    wait_until(lambda: {s.state for s in supervisor.statuses()} == {ReplicaState.READY}, 30, poll=supervisor.poll)
    held = _held_path(supervisor, replica_id)
    assert held.exists() == (replica_id == "r-shm")  # the other holds it only mapped, its name removed

    supervisor.check_disk()

    status = next(status for status in supervisor.statuses() if status.replica_id == replica_id)
    assert status.state == ReplicaState.FAILED
    assert "wrote more than 0.002 GB to its own folders and /dev/shm" in status.failure_reason
    wait_until(lambda: processes_with_marker(replica_id) == [], 10)
    assert not held.exists()
    assert supervisor.get("r-small").state == ReplicaState.READY


def test_an_engine_holding_shared_memory_within_its_bound_runs_on(make_supervisor):
    supervisor = make_supervisor(engine_max_bytes=4 * MB, check_interval_s=0, sweep_interval_s=3600)
    supervisor.start(make_spec("r-shm", endpoint_id="e-shm"), Path("/nonexistent"))
    wait_until(lambda: supervisor.get("r-shm").state == ReplicaState.READY, 30, poll=supervisor.poll)
    held = _held_path(supervisor, "r-shm")
    supervisor.check_disk()
    assert supervisor.get("r-shm").state == ReplicaState.READY and held.exists()
    usage = engine_shared_memory.held_by(engine_shared_memory.process_tree(supervisor.get("r-shm").pid))
    assert usage.num_bytes >= 3 * MB and held in usage.paths and not usage.hidden


def test_an_engine_whose_processes_come_and_go_during_every_walk_of_checks_in_a_row_fails_and_a_quiet_one_runs_on(
    make_supervisor, monkeypatch
):
    # Before, a walk that a process of the engine was born or exited during (a mapping relayed from process to process)
    # was taken as complete: its engine ran on, what it held never counted (`test_a_mapping_relayed_from_process...`).
    # Now checks in a row whose walks are all incomplete stop it, once they have gone on for `MIN_INCOMPLETE_SHM_S`:
    # a burst shorter than that (an engine compiling, a compiler process started many times a second) stops nothing.
    supervisor = make_supervisor(check_interval_s=0, sweep_interval_s=3600)
    supervisor.start(make_spec("r-relay", endpoint_id="e-relay"), Path("/nonexistent"))
    supervisor.start(make_spec("r-quiet", endpoint_id="e-quiet"), Path("/nonexistent"))
    wait_until(lambda: {s.state for s in supervisor.statuses()} == {ReplicaState.READY}, 30, poll=supervisor.poll)

    def check_when_due() -> None:  # NOTE: never sooner than its last walk's cost allows (`next_check_in_s`)
        replica = supervisor.get("r-relay")
        wait_until(lambda: (replica.disk_check_due_at or 0) <= time.monotonic(), 10, step_s=0.01)
        supervisor.check_disk()

    # NOTE: a walk that fits between two of its forks (the relay not scheduled meanwhile) is complete, and true: it
    # resets the count; nearly every check is incomplete (3 walks each), so 3 in a row come within a few checks
    for _ in range(10 * MAX_INCOMPLETE_SHM_CHECKS):
        check_when_due()
        if supervisor.get("r-relay").num_incomplete_shm_checks >= MAX_INCOMPLETE_SHM_CHECKS:
            break
    assert supervisor.get("r-relay").num_incomplete_shm_checks >= MAX_INCOMPLETE_SHM_CHECKS
    assert supervisor.get("r-relay").state == ReplicaState.READY  # for less than `MIN_INCOMPLETE_SHM_S`: runs on

    monkeypatch.setattr(supervisor_module, "MIN_INCOMPLETE_SHM_S", 0.0)  # as if it had gone on that long
    for _ in range(10 * MAX_INCOMPLETE_SHM_CHECKS):
        check_when_due()
        if supervisor.get("r-relay").state != ReplicaState.READY:
            break

    status = next(status for status in supervisor.statuses() if status.replica_id == "r-relay")
    assert status.state == ReplicaState.FAILED
    assert "were born or exited during every walk of" in status.failure_reason
    wait_until(lambda: processes_with_marker("r-relay") == [], 10)
    assert supervisor.get("r-quiet").state == ReplicaState.READY


HOLDER = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.write(fd, b"x" * 4096)
kept = mmap.mmap(fd, 4096)
os.close(fd)  # held by its mapping alone
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def shm_folder():
    """A folder of this test's own in /dev/shm (the same tmpfs), so that no other program's files are swept."""
    folder = Path("/dev/shm") / f"inferplane-test-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    yield folder
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


def test_files_no_process_holds_go_after_the_grace_period_whatever_their_times_and_held_ones_stay(
    make_supervisor, shm_folder
):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(shm_folder / "held")], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        (shm_folder / "left").write_bytes(b"x" * 4096)  # what an engine created and closed, or left when killed
        supervisor = make_supervisor(shared_memory_orphan_age_s=0.5, check_interval_s=0, sweep_interval_s=0)
        supervisor.shared_memory_dir = shm_folder
        supervisor.check_disk()
        assert sorted(path.name for path in shm_folder.iterdir()) == ["held", "left"]  # not held since long enough
        os.utime(shm_folder / "left")  # its engine touching it keeps it no longer: the agent's record counts
        time.sleep(0.6)

        supervisor.check_disk()

        assert sorted(path.name for path in shm_folder.iterdir()) == ["held"]
    finally:
        holder.kill()
        holder.wait()


# As an agent without CAP_CHECKPOINT_RESTORE (the systemd unit's): engine A's own tmpfs (not mounted in the agent's
# view) holds 48 MiB it wrote and closed, and a 1-byte file of it passed to engine B (`fd`); `child` makes a process of
# B holding it by its fd, or mapping it with no fd kept.
FOREIGN_FILE = """
import ctypes, json, os, socket, sys, time
from gpu_agent.runtime import shared_memory

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
folder = sys.argv[1]
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
if os.fork() == 0:  # engine A, in namespaces of its own
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(0x10000000 | 0x00020000) != 0:
        b.send(b"no user namespaces")
        os._exit(0)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        open(f"/proc/self/{name}", "w").write(text)
    assert libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) == 0, ctypes.get_errno()
    assert libc.mount(b"tmpfs", folder.encode(), b"tmpfs", 0, b"size=128m") == 0, ctypes.get_errno()
    with open(f"{folder}/big", "wb") as big:
        big.write(b"x" * 48 * 1024 * 1024)
    fd = os.open(f"{folder}/tiny", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"x")
    socket.send_fds(b, [b"fd"], [fd])
    os._exit(0)  # A is gone: only B's fd keeps its tmpfs
message, fds, _, _ = socket.recv_fds(a, 100, 1)
os.wait()
if not fds:
    print(json.dumps({"skip": message.decode()}))
    sys.exit()
fd, children = fds[0], []


def child(maps: bool) -> int:  # a process of B holding the passed file: by its fd, or (`maps`) only mapped
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        if maps:
            assert libc.mmap(None, 4096, 1, 1, fd, 0) not in (None, ctypes.c_void_p(-1).value)  # read, shared
            os.close(fd)
        os.write(write_end, b"k")
        time.sleep(60)
        os._exit(0)
    os.read(read_end, 1)
    children.append(pid)
    return pid
"""
# B holds the file's fd, and a process of B maps it with no fd kept. Prints the bytes `held_by` counts for B alone, then
# for B and that process, the mapping walked first (whose `map_files` link the kernel refuses to this agent).
FOREIGN_TMPFS = (FOREIGN_FILE + """
# NOTE: a set of two pids walks them in the order of their hashes' low bits: a holder whose pid ends in 0 there comes
# first with any mapper; another holder is made then (before, one run in eight found no order with the mapper first).
for _ in range(16):
    holder = child(maps=False)
    for _ in range(8):  # until a set of the two walks the mapper first
        pid = child(maps=True)
        if next(iter({holder, pid})) == pid:
            break
    if next(iter({holder, pid})) == pid:
        break
fd_only = shared_memory.held_by({holder}).num_bytes
fd_and_map = shared_memory.held_by({holder, pid}).num_bytes
for each in children:
    os.kill(each, 9)
    os.waitpid(each, 0)
print(json.dumps({"fd_only": fd_only, "fd_and_map": fd_and_map, "mapper_first": next(iter({holder, pid})) == pid}))
""")  # fmt: skip


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to another user"
)
def test_a_foreign_tmpfs_held_by_fd_counts_whole_though_a_mapping_of_it_walked_first_is_refused_to_the_agent():
    # Before, the refused mapping's `map_files` link marked the device unknown, and the fd that needs no capability was
    # never asked: the 48 MiB counted 0, the engine's bound blind to them.
    folder = Path(tempfile.mkdtemp(prefix="inferplane-foreign-tmpfs-"))
    folder.chmod(0o755)
    try:
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
             sys.executable, "-c", FOREIGN_TMPFS, str(folder)],
            capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2],
        )  # fmt: skip
    finally:
        folder.rmdir()
    assert done.returncode == 0, done.stderr
    counted = json.loads(done.stdout.splitlines()[-1])
    if "skip" in counted:
        pytest.skip(counted["skip"])
    assert counted["mapper_first"]
    assert counted["fd_only"] >= 48 * 1024 * 1024
    assert counted["fd_and_map"] >= 48 * 1024 * 1024


# Only a process of B maps the file: B keeps no fd of it, and engine A is gone. Prints what `held_by` finds for that
# process; then for a process mapping only the kernel's own tmpfs (a memfd, a shared anonymous mapping), as vLLM's do.
MAPPED_ONLY = (FOREIGN_FILE + """
mapper = child(maps=True)
os.close(fd)  # nothing but the mapping holds A's tmpfs now
held = shared_memory.held_by({mapper})
read_end, write_end = os.pipe()
kernel_own = os.fork()
if kernel_own == 0:
    import mmap
    memfd = os.memfd_create("ring")
    os.ftruncate(memfd, 4096)
    kept = [mmap.mmap(memfd, 4096), mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)]
    os.close(memfd)
    os.write(write_end, b"k")
    time.sleep(60)
    os._exit(0)
os.read(read_end, 1)
children.append(kernel_own)
plain = shared_memory.held_by({kernel_own})
for each in children:
    os.kill(each, 9)
    os.waitpid(each, 0)
print(json.dumps({"bytes": held.num_bytes, "unmeasured": list(getattr(held, "unmeasured", ())),
                  "kernel_own_bytes": plain.num_bytes, "kernel_own_unmeasured": list(getattr(plain, "unmeasured", ()))}))
""")  # fmt: skip


def _run_without_the_capability(script: str) -> dict:
    """`script`'s last line of JSON, run as another user with no capability (the systemd unit's agent has neither
    CAP_CHECKPOINT_RESTORE nor CAP_SYS_ADMIN), its argument a folder of that user's for engine A's own tmpfs."""
    folder = Path(tempfile.mkdtemp(prefix="inferplane-foreign-tmpfs-"))
    folder.chmod(0o755)
    os.chown(folder, 65534, 65534)
    try:
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
             sys.executable, "-c", script, str(folder)],
            capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2],
        )  # fmt: skip
    finally:
        shutil.rmtree(folder)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.splitlines()[-1])
    if "skip" in answer:
        pytest.skip(answer["skip"])
    return answer


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to another user"
)
def test_a_foreign_tmpfs_held_only_by_a_mapping_is_unmeasured_with_its_path_not_counted_zero():
    # Before, the mapping's `map_files` link (refused without the capability) was the only way to it: the 48 MiB of
    # the gone engine's tmpfs counted 0 and nothing said so.
    answer = _run_without_the_capability(MAPPED_ONLY)
    assert [why for why in answer["unmeasured"] if why.startswith("/tiny (device 0:")], answer


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to another user"
)
def test_the_kernel_s_own_shared_memory_mapped_without_the_capability_is_not_unmeasured():
    # Guard (passes before and after): a memfd or a shared anonymous mapping (vLLM's, the kernel's own tmpfs of no
    # size, counted as memory) is no foreign tmpfs and stops no engine.
    answer = _run_without_the_capability(MAPPED_ONLY)
    assert answer["kernel_own_unmeasured"] == []
    assert answer["kernel_own_bytes"] == 0


# An engine in namespaces of its own maps files of what it mounted there (a file system with an anonymous device that
# the agent does not see mounted): an overlay (no memory: its pages are the disk's) and a tmpfs of its own beside its
# /dev/shm holding 48 MiB it wrote and closed, their fds closed; and a file of the node's disk (the overlay's lower
# folder). Prints what `held_by` finds for it, as an agent without CAP_CHECKPOINT_RESTORE (each mapping's `map_files` link refused).
OWN_MOUNTS = """
import ctypes, json, os, sys, time
from gpu_agent.runtime import shared_memory

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
base = sys.argv[1]
for name in ("lower", "upper", "work", "merged", "tmpfs"):
    os.mkdir(f"{base}/{name}")
with open(f"{base}/lower/weights", "wb") as weights:
    weights.write(b"x" * 4096)
read_end, write_end = os.pipe()
engine = os.fork()
if engine == 0:
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(0x10000000 | 0x00020000) != 0:
        os.write(write_end, b"no user namespaces")
        os._exit(0)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        open(f"/proc/self/{name}", "w").write(text)
    assert libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) == 0, ctypes.get_errno()
    options = f"lowerdir={base}/lower,upperdir={base}/upper,workdir={base}/work".encode()
    if libc.mount(b"overlay", f"{base}/merged".encode(), b"overlay", 0, options) != 0:
        os.write(write_end, b"no overlay in a user namespace")
        os._exit(0)
    assert libc.mount(b"tmpfs", f"{base}/tmpfs".encode(), b"tmpfs", 0, b"size=128m") == 0, ctypes.get_errno()
    with open(f"{base}/tmpfs/big", "wb") as big:
        big.write(b"x" * 48 * 1024 * 1024)
    for path in (f"{base}/merged/weights", f"{base}/tmpfs/big", f"{base}/lower/weights"):
        fd = os.open(path, os.O_RDONLY)
        # NOTE: libc's, not Python's `mmap`, which keeps a copy of the fd
        assert libc.mmap(None, 4096, 1, 1, fd, 0) not in (None, ctypes.c_void_p(-1).value)  # read, shared
        os.close(fd)  # held by its mapping alone
    os.write(write_end, b"mapped")
    time.sleep(60)
    os._exit(0)
said = os.read(read_end, 100).decode()
if said != "mapped":
    os.waitpid(engine, 0)
    print(json.dumps({"skip": said}))
    sys.exit()
held = shared_memory.held_by({engine})
os.kill(engine, 9)
os.waitpid(engine, 0)
print(json.dumps({"bytes": held.num_bytes, "unmeasured": list(held.unmeasured)}))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to another user"
)
def test_what_an_engine_maps_of_its_own_tmpfs_is_measured_and_only_its_overlay_is_unmeasured():
    # A tmpfs the engine mounted is memory measured through the engine's root, not unmeasured; the overlay (whose
    # upper folder could as well be a tmpfs: `test_an_overlay_an_engine_mounted_over_a_tmpfs_is_unmeasured...`) is.
    answer = _run_without_the_capability(OWN_MOUNTS)
    unmeasured = [why.split(" (device ")[0] for why in answer["unmeasured"]]
    assert [path.rsplit("/", 2)[-2:] for path in unmeasured] == [["merged", "weights"]]
    assert answer["bytes"] >= 48 * 1024 * 1024  # its own tmpfs counted whole, the file it closed too


# An engine able to mount (not under the production sandbox, which leaves it no capability: the code must not rely on
# that) maps a file of an overlay whose upper folder is on a tmpfs it mounted: 96 MiB of memory the maps show on the
# overlay's device, the tmpfs itself mapped by nothing.
OVERLAY_OVER_TMPFS = """
import ctypes, json, os, sys, time
from gpu_agent.runtime import shared_memory

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
base = sys.argv[1]
for name in ("lower", "memory", "merged"):
    os.mkdir(f"{base}/{name}")
read_end, write_end = os.pipe()
engine = os.fork()
if engine == 0:
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(0x10000000 | 0x00020000) != 0:
        os.write(write_end, b"no user namespaces")
        os._exit(0)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        open(f"/proc/self/{name}", "w").write(text)
    assert libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) == 0, ctypes.get_errno()
    assert libc.mount(b"tmpfs", f"{base}/memory".encode(), b"tmpfs", 0, b"size=256m") == 0, ctypes.get_errno()
    os.mkdir(f"{base}/memory/upper")
    os.mkdir(f"{base}/memory/work")
    options = f"lowerdir={base}/lower,upperdir={base}/memory/upper,workdir={base}/memory/work".encode()
    if libc.mount(b"overlay", f"{base}/merged".encode(), b"overlay", 0, options) != 0:
        os.write(write_end, b"no overlay in a user namespace")
        os._exit(0)
    with open(f"{base}/merged/big", "wb") as big:
        big.write(b"x" * 96 * 1024 * 1024)
    fd = os.open(f"{base}/merged/big", os.O_RDONLY)
    assert libc.mmap(None, 4096, 1, 1, fd, 0) not in (None, ctypes.c_void_p(-1).value)  # read, shared
    os.close(fd)
    os.write(write_end, b"mapped")
    time.sleep(60)
    os._exit(0)
said = os.read(read_end, 100).decode()
if said != "mapped":
    os.waitpid(engine, 0)
    print(json.dumps({"skip": said}))
    sys.exit()
held = shared_memory.held_by({engine})
os.kill(engine, 9)
os.waitpid(engine, 0)
print(json.dumps({"bytes": held.num_bytes, "unmeasured": list(held.unmeasured)}))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to another user"
)
def test_an_overlay_an_engine_mounted_over_a_tmpfs_is_unmeasured_not_counted_zero():
    # Before, an overlay was taken for a file system of no memory: 96 MiB counted 0 and nothing said so. A device is
    # "not memory" only when its type is a disk's (`shared_memory.DISK_FILE_SYSTEMS`).
    answer = _run_without_the_capability(OVERLAY_OVER_TMPFS)
    assert [why for why in answer["unmeasured"] if why.split(" (device ")[0].endswith("/merged/big")], answer


# A process mapping a hugetlbfs memfd (`MFD_HUGETLB`: the huge page pool, its own), its fd closed. Prints what
# `held_by` finds for it, as an agent without CAP_CHECKPOINT_RESTORE. Mapped with MAP_NORESERVE and never touched, it
# takes no huge page: the test runs on a machine with none in its pool (most have none).
HUGE_PAGES = """
import ctypes, json, os, time
from gpu_agent.runtime import shared_memory

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
read_end, write_end = os.pipe()
mapper = os.fork()
if mapper == 0:
    memfd = os.memfd_create("ring", os.MFD_HUGETLB)
    size = 2 * 1024 * 1024
    os.ftruncate(memfd, size)
    MAP_SHARED, MAP_NORESERVE = 0x01, 0x4000
    assert libc.mmap(None, size, 3, MAP_SHARED | MAP_NORESERVE, memfd, 0) not in (None, ctypes.c_void_p(-1).value)
    os.close(memfd)
    os.write(write_end, b"k")
    time.sleep(60)
    os._exit(0)
os.read(read_end, 1)
held = shared_memory.held_by({mapper})
os.kill(mapper, 9)
os.waitpid(mapper, 0)
print(json.dumps({"unmeasured": list(held.unmeasured)}))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to another user"
)
def test_a_hugetlbfs_memfd_mapped_without_the_capability_is_not_unmeasured():
    # Before, its device (the kernel's hugetlbfs of that page size, mounted nowhere) was unmeasured: FAILED.
    assert _run_without_the_capability(HUGE_PAGES)["unmeasured"] == []


# The agent's first probe of the kernel's own devices fails (no fd left: the fd limit reached; as ENOMEM or a seccomp
# filter would), then a process maps shared anonymous memory (`/dev/zero (deleted)`, as vLLM does). Prints what the
# next walk finds for it, as an agent without CAP_CHECKPOINT_RESTORE.
PROBE_FAILED_ONCE = """
import json, mmap, os, resource, time
from gpu_agent.runtime import shared_memory

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
filler = []
try:
    while True:
        filler.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
at_the_limit = shared_memory._kernel_devices()
for fd in filler:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
read_end, write_end = os.pipe()
mapper = os.fork()
if mapper == 0:
    kept = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)  # no fd: only its mapping shows it
    os.write(write_end, b"k")
    time.sleep(60)
    os._exit(0)
os.read(read_end, 1)
held = shared_memory.held_by({mapper})
os.kill(mapper, 9)
os.waitpid(mapper, 0)
print(json.dumps({"probed_at_the_limit": len(at_the_limit), "unmeasured": list(held.unmeasured)}))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to another user"
)
def test_a_probe_that_failed_once_is_asked_again_and_the_kernel_s_own_memory_is_not_unmeasured():
    # Before, the failed probe's empty answer was kept for the agent's life: every engine's shared anonymous mapping
    # was unmeasured ("/dev/zero (deleted) (device 0:1)") and every engine stopped at each sweep.
    answer = _run_without_the_capability(PROBE_FAILED_ONCE)
    assert answer["probed_at_the_limit"] == 0  # the probe did fail
    assert answer["unmeasured"] == []


# A process of B maps the file passed from A's tmpfs (no fd kept), then relays the mapping: it forks and exits every
# millisecond, each child doing the same (B reaps them, as an engine's init does). Prints how many of 40 walks of B's
# tree (`held_by_tree`, as `Supervisor.check_disk` walks an engine's) neither counted A's tmpfs, nor found it
# unmeasured, nor said they were incomplete.
RELAYED_MAPPING = (FOREIGN_FILE + """
import signal
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the relay's orphans stay below B
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
relay = os.fork()
if relay == 0:
    os.setpgid(0, 0)
    assert libc.mmap(None, 4096, 1, 1, fd, 0) not in (None, ctypes.c_void_p(-1).value)  # read, shared
    os.close(fd)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.fork() != 0:
            os._exit(0)
        time.sleep(0.001)
    os._exit(0)
os.close(fd)
walk = getattr(shared_memory, "held_by_tree", None) or (lambda pid: shared_memory.held_by(shared_memory.process_tree(pid)))
num_missed = 0
for _ in range(40):
    held = walk(os.getpid())
    if not (held.num_bytes >= 48 * 1024 * 1024 or held.unmeasured or getattr(held, "incomplete", False)):
        num_missed += 1
os.killpg(relay, 9)
print(json.dumps({"num_missed": num_missed}))
""")  # fmt: skip


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to another user"
)
def test_a_mapping_relayed_from_process_to_process_makes_every_walk_incomplete_and_none_misses_it():
    # Before, each process the walk asked was gone (ENOENT: nothing noted) or born after the tree was listed: most walks
    # counted 0 bytes and nothing unmeasured. `Supervisor.check_disk` stops an engine whose walks are incomplete
    # `MAX_INCOMPLETE_SHM_CHECKS` times in a row.
    assert _run_without_the_capability(RELAYED_MAPPING)["num_missed"] == 0


def test_a_file_swapped_onto_an_fd_while_it_is_asked_is_not_learned_as_the_kernel_s_own(
    tmp_path, monkeypatch
):
    # An engine `dup2`s a file of a tmpfs onto the fd of a dma-buf (a GPU driver's: none on a CPU node, so the file
    # system of a plain file stands in for dma-buf's here) while the agent asks that fd's link. Before, the type came
    # from one lookup of the link and the device from a second: the tmpfs's device was learned as the kernel's own
    # and that tmpfs never measured again for the agent's life.
    plain = os.open(tmp_path / "stands-for-a-dma-buf", os.O_RDWR | os.O_CREAT, 0o600)
    tmpfs_file = shared_memory.SharedMemory(create=True, size=4096)
    held = os.dup(plain)
    asked = engine_shared_memory._file_system_type

    def swapped_once_asked(file):
        answer = asked(file)
        os.dup2(tmpfs_file._fd, held)  # the engine's move, between the agent's questions
        return answer

    try:
        statfs = ctypes.create_string_buffer(256)  # a `struct statfs`, its f_type (a C long) first
        assert ctypes.CDLL(None).fstatfs(plain, statfs) == 0
        monkeypatch.setattr(engine_shared_memory, "_DMA_BUF_MAGIC", ctypes.c_long.from_buffer(statfs).value & 0xFFFFFFFF)
        monkeypatch.setattr(engine_shared_memory, "_file_system_type", swapped_once_asked)
        monkeypatch.setattr(engine_shared_memory, "_kernel_devices_learned", set())
        monkeypatch.setattr(engine_shared_memory, "_kernel_devices_found", None)
        engine_shared_memory._tmpfs_usage(f"/proc/self/fd/{held}")
        assert os.fstat(tmpfs_file._fd).st_dev not in engine_shared_memory._kernel_devices_learned
        assert engine_shared_memory._kernel_devices_learned == {os.fstat(plain).st_dev}
    finally:
        os.close(held)
        os.close(plain)
        tmpfs_file.close()
        tmpfs_file.unlink()
