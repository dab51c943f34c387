"""An engine cannot hide what it writes from the walk that measures its folders by moving files ahead of it.

Before, `engine_disk.measure` listed one folder at a time and took what it met as the engine's usage: an engine that
watched its own folders with inotify (the agent's listing opens and closes each folder) moved a large file into the
folder just listed, and back once the next was, so no walk ever met it (the review of the disk bound: a 64 MB file
against a 32 MB bound, missed by 20 of 20 measures), and it wrote without limit to the node's disk. Now the folders
that changed under a walk are read again, and folders that never held still under a check's reads for long fail the
replica; an honest engine, whose caches change only while it compiles, is never failed for it. Real folders, real
inotify and real fake engines; a real vLLM engine's warm-up is measured in `test_engine_sandbox.py` (its confined
engine), real inductor compiling in `bench/bench_engine_disk_settle.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime import engine_disk
from gpu_agent.runtime import supervisor as supervisor_module
from gpu_agent.runtime.supervisor import MAX_UNSETTLED_DISK_CHECKS

from .conftest import make_spec, wait_for_state, wait_until
from .test_engine_disk import make_supervisor  # noqa: F401  (a fixture)

MB = 1 << 20


# The reviewer's engine (a process of its own, as an engine is): watches its two folders, and moves `scratch/big` into
# `cache` as soon as the walk closes `cache`, back once it closes `scratch`.
MOVER = """
import ctypes, ctypes.util, os, struct, sys
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
scratch, cache = sys.argv[1], sys.argv[2]
fd = libc.inotify_init()
wd_cache = libc.inotify_add_watch(fd, cache.encode(), 0x10)  # IN_CLOSE_NOWRITE
wd_scratch = libc.inotify_add_watch(fd, scratch.encode(), 0x10)
print("watching", flush=True)
while True:
    data = os.read(fd, 4096)
    for offset in range(0, len(data), 16):
        wd = struct.unpack_from("i", data, offset)[0]
        try:
            if wd == wd_cache:
                os.rename(os.path.join(scratch, "big"), os.path.join(cache, "big"))
            elif wd == wd_scratch:
                os.rename(os.path.join(cache, "big"), os.path.join(scratch, "big"))
        except FileNotFoundError:
            pass
"""


@contextmanager
def moving_ahead_of_the_walk(scratch: Path, cache: Path, size: int):
    """`size` bytes in `scratch/big` that the reviewer's engine (`MOVER`) moves ahead of the walk: into `cache`, listed
    first (the walk is depth first from the last folder), as soon as the walk closes it; a filler folder of 2,000 files
    there gives it the time. No timing guess: the agent's own closes drive it."""
    filler = cache / "triton"
    filler.mkdir(exist_ok=True)
    for i in range(2000):
        (filler / f"k{i}").touch()
    (scratch / "big").write_bytes(os.urandom(size))
    mover = subprocess.Popen([sys.executable, "-c", MOVER, str(scratch), str(cache)], stdout=subprocess.PIPE, text=True)
    try:
        assert mover.stdout.readline() == "watching\n"
        yield
    finally:
        mover.kill()
        mover.wait()


@contextmanager
def writing(action, *, every_s: float = 0.0):
    """Run `action` again and again on a thread of its own (a process writing its folders) while the block runs."""
    stop = threading.Event()

    def run():
        while not stop.is_set():
            action()
            time.sleep(every_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def test_a_file_moved_ahead_of_the_walk_is_counted_or_the_measure_says_its_folders_never_settled(tmp_path):
    # Before: 20/20 measures counted a few hundred kB, complete, with no sign of the 64 MB file.
    scratch, cache = tmp_path / "scratch", tmp_path / "cache"
    scratch.mkdir()
    cache.mkdir()
    hidden = 0
    with moving_ahead_of_the_walk(scratch, cache, 64 * MB):
        for _ in range(20):
            usage = engine_disk.measure([scratch, cache], max_bytes=32 * MB)
            hidden += usage.num_bytes < 32 * MB and getattr(usage, "settled", True)
            time.sleep(0.05)
    assert hidden == 0, f"{hidden}/20 measures neither met the 64 MB file nor said their folders never settled"


def test_folders_that_never_hold_still_under_the_walk_fail_the_replica_after_the_bound_with_the_reason(
    make_supervisor, tmp_path, monkeypatch  # noqa: F811
):
    """The verdict on `settled`: an engine moving a file between its folders all along (whatever it hides) is
    unsettled at every check, runs on for `MIN_UNSETTLED_DISK_S`, and fails then. Before, it ran on for ever."""
    supervisor = make_supervisor(check_interval_s=0, sweep_interval_s=3600)
    supervisor.start(make_spec("r-moves", endpoint_id="e-moves"), tmp_path / "model")
    supervisor.start(make_spec("r-plain", endpoint_id="e-plain"), tmp_path / "model")
    wait_until(lambda: {s.state for s in supervisor.statuses()} == {ReplicaState.READY}, 30, poll=supervisor.poll)
    env = supervisor.get("r-moves").command.env
    scratch, cache = Path(env["TMPDIR"]), Path(env["XDG_CACHE_HOME"])
    (scratch / "ball").write_bytes(b"x")
    where = [scratch, cache]

    def move():
        try:
            os.rename(where[0] / "ball", where[1] / "ball")
            where.reverse()
        except FileNotFoundError:
            pass

    with writing(move):
        for _ in range(2 * MAX_UNSETTLED_DISK_CHECKS):
            supervisor.check_disk()
        assert supervisor.get("r-moves").num_unsettled_disk_checks >= MAX_UNSETTLED_DISK_CHECKS
        assert supervisor.get("r-moves").state == ReplicaState.READY  # for less than `MIN_UNSETTLED_DISK_S`: runs on
        monkeypatch.setattr(supervisor_module, "MIN_UNSETTLED_DISK_S", 0.0)  # as if it had gone on that long
        supervisor.check_disk()

    status = next(status for status in supervisor.statuses() if status.replica_id == "r-moves")
    assert status.state == ReplicaState.FAILED
    assert "its engine hid what it wrote from the agent (its folders kept changing under every measurement" in (
        status.failure_reason
    )
    wait_until(lambda: not scratch.exists(), 10)
    assert supervisor.get("r-plain").state == ReplicaState.READY


def test_the_reviewers_engine_moving_its_file_ahead_of_the_walk_fails_its_replica(
    make_supervisor, tmp_path, monkeypatch  # noqa: F811
):
    # Before: its 3 MB-bound replica stayed READY through every check, the 16 MB file never met.
    supervisor = make_supervisor(check_interval_s=0, sweep_interval_s=3600, engine_max_bytes=3 * MB)
    supervisor.start(make_spec("r-hides", endpoint_id="e-hides"), tmp_path / "model")
    wait_for_state(supervisor, "r-hides", ReplicaState.READY, timeout_s=30)
    env = supervisor.get("r-hides").command.env
    monkeypatch.setattr(supervisor_module, "MIN_UNSETTLED_DISK_S", 0.0)
    # NOTE: as if the caches were just swept: the sweep's own walk of the cache folder alone (`CacheFolders.listing`)
    # has this simple mover leave its file there, where the next check meets it; an engine that tells the walks apart
    # is not fooled by it.
    supervisor._caches_swept_at = time.monotonic()
    with moving_ahead_of_the_walk(Path(env["TMPDIR"]), Path(env["XDG_CACHE_HOME"]), 16 * MB):
        for _ in range(2 * MAX_UNSETTLED_DISK_CHECKS):
            supervisor.check_disk()
            if supervisor.get("r-hides").state == ReplicaState.FAILED:
                break
    status = supervisor.get("r-hides")
    assert status.state == ReplicaState.FAILED, "the file moved ahead of the walk was never met"
    assert "its engine wrote more than" in status.failure_reason or "kept changing" in status.failure_reason


def test_an_engine_writing_its_caches_during_measures_is_never_failed_and_counted_whole_once_it_stops(
    make_supervisor, tmp_path  # noqa: F811
):
    """An honest engine compiling: new files in its cache folder every few ms, through several checks in a row."""
    supervisor = make_supervisor(check_interval_s=0, sweep_interval_s=3600)
    supervisor.start(make_spec("r-compiles", endpoint_id="e-compiles"), tmp_path / "model")
    wait_for_state(supervisor, "r-compiles", ReplicaState.READY, timeout_s=30)
    compiled = Path(supervisor.get("r-compiles").command.env["XDG_CACHE_HOME"]) / "torchinductor"
    compiled.mkdir()
    names = iter(range(10**9))

    def compile_one():
        (compiled / f"kernel-{next(names)}.so").write_bytes(os.urandom(4096))

    with writing(compile_one, every_s=0.002):
        for _ in range(2 * MAX_UNSETTLED_DISK_CHECKS):
            supervisor.check_disk()
            time.sleep(0.05)
    assert supervisor.get("r-compiles").state == ReplicaState.READY
    supervisor.check_disk()
    assert supervisor.get("r-compiles").num_unsettled_disk_checks == 0
    usage = engine_disk.measure([compiled])
    assert usage.settled and usage.num_files == len(list(compiled.iterdir()))
    assert usage.num_bytes >= 4096 * usage.num_files


def test_a_file_renamed_between_folders_during_a_walk_is_counted_once_across_its_reads(tmp_path):
    """Every file once, across the reads (the union): one met in both folders, in two reads, is not counted twice."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "file").write_bytes(os.urandom(MB))
    where = [first, second]

    def move():
        try:
            os.rename(where[0] / "file", where[1] / "file")
            where.reverse()
        except FileNotFoundError:
            pass

    with writing(move, every_s=0.001):
        usage = engine_disk.measure([first, second])
    assert usage.num_bytes < 2 * MB  # the two folders, and the file once
    quiet = engine_disk.measure([first, second])
    assert quiet.settled and MB <= quiet.num_bytes < 2 * MB


def test_quiet_folders_settle_though_the_file_systems_clock_is_ahead_of_the_nodes(tmp_path, monkeypatch):
    """A network file system dates changes by its server's clock: one 10 s ahead of the node's made every folder look
    changed just before its listing, at every read, and every engine would have been failed as hiding."""
    (tmp_path / "cache" / "triton").mkdir(parents=True)
    (tmp_path / "cache" / "triton" / "kernel.so").write_bytes(os.urandom(4096))
    node_clock = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: node_clock() - 10 * 10**9)
    usage = engine_disk.measure([tmp_path / "cache"])
    assert usage.settled and usage.num_files == 2
