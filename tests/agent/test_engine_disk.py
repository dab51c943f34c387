"""An engine cannot fill its node's disk: a live engine's folders are bounded, and unused endpoint caches are pruned.

Before, a confined engine's scratch folder and its endpoint's cache folder (`<data dir>/engine-caches/<endpoint>`)
were outside every budget and the cache folders were never removed: a tenant's engine writing without end, or a node
that served thousands of endpoints over months, filled the disk, and weights downloads and other tenants' engines
failed. Real fake engines (child processes writing into their folders) and real folders; no vLLM is needed.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime import cli, engine_disk, process, sandbox, shared_memory
from gpu_agent.runtime.engine_disk import CacheFolders, EngineDiskBounds
from gpu_agent.runtime.supervisor import Supervisor

from .conftest import fake_engine_factory, make_spec, processes_with_marker, wait_for_state, wait_until
from .test_agent_loop import control_plane, running_agent  # noqa: F401  (fixtures)
from .test_weights_cache import s3_endpoint  # noqa: F401  (a fixture of running_agent's)

MB = 1_000_000
NOBODY = 65534
DAY_S = 86400.0
NO_CHECKS = {"check_interval_s": 3600.0, "sweep_interval_s": 3600.0}


@pytest.fixture
def make_supervisor(tmp_path):
    """Supervisors of fake engines (those of replica "r-big" write 3 MB into their cache folder); whatever they
    started is gone after the test, passed or failed."""
    made = []
    filling = fake_engine_factory("--fill-cache-bytes", str(3 * MB), "--fill-scratch-bytes", str(MB // 10))
    plain = fake_engine_factory()

    def factory(spec, model_path, port):
        return (filling if spec.replica_id == "r-big" else plain)(spec, model_path, port)

    def make(command_factory=factory, **bounds) -> Supervisor:
        made.append(
            Supervisor(tmp_path / "agent", command_factory=command_factory, disk_bounds=EngineDiskBounds(**bounds))
        )
        return made[-1]

    yield make
    for supervisor in made:
        supervisor.shutdown(timeout_s=5)
        process.kill_orphans(supervisor.data_dir, set())


def fill(folder: Path, num_bytes: int) -> Path:
    """`num_bytes` on disk in `folder` (random, so no file system stores them sparse)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fill.bin").write_bytes(os.urandom(num_bytes))
    return folder


def last_used(caches: CacheFolders, name: str, days_ago: float) -> None:
    caches.touch(name)
    at = time.time() - days_ago * DAY_S
    os.utime(caches.root / engine_disk.USED_DIR / name, (at, at))


def cache_names(caches: CacheFolders) -> set[str]:
    return {path.name for path in caches.root.iterdir()} - {engine_disk.USED_DIR}


# --- Caches of endpoints with no replica here ---------------------------------------------------------------


def test_unused_endpoint_caches_go_least_recently_used_first_past_the_budget_and_one_in_use_stays(
    make_supervisor, tmp_path
):
    supervisor = make_supervisor(cache_budget_bytes=int(3.5 * MB), cache_max_age_s=None, sweep_interval_s=0,
                                 check_interval_s=3600)  # fmt: skip
    supervisor.start(make_spec("r-live", endpoint_id="e-in-use"), tmp_path / "model")
    wait_for_state(supervisor, "r-live", ReplicaState.READY, timeout_s=30)
    caches = CacheFolders(supervisor.data_dir / "engine-caches")
    for days_ago, name in [(5, "e-in-use"), (4, "e-oldest"), (3, "e-older"), (2, "e-newer"), (1, "e-newest")]:
        fill(caches.folder(name), MB)
        last_used(caches, name, days_ago)

    supervisor.check_disk()
    wait_until(lambda: not supervisor._removals.pending(), 10)  # removed on the removals' thread

    # 5 MB in all, 3.5 allowed: the two least recently used unused ones go; the oldest of all is in use and stays.
    assert cache_names(caches) == {"e-in-use", "e-newer", "e-newest"}
    assert (caches.folder("e-in-use") / "fill.bin").exists()
    assert supervisor.get("r-live").state == ReplicaState.READY
    assert not (caches.root / engine_disk.USED_DIR / "e-oldest").exists()  # its record goes with it


def test_an_unused_endpoint_cache_older_than_the_age_goes_within_the_budget(make_supervisor):
    supervisor = make_supervisor(cache_max_age_s=7 * DAY_S, sweep_interval_s=0, check_interval_s=3600)
    caches = CacheFolders(supervisor.data_dir / "engine-caches")
    for days_ago, name in [(8, "e-stale"), (6, "e-fresh")]:
        fill(caches.folder(name), 1000)
        last_used(caches, name, days_ago)
    made_before_records = fill(
        caches.folder("e-from-before"), 1000
    )  # no record: the folder's own time counts
    month_ago = time.time() - 30 * DAY_S
    os.utime(made_before_records, (month_ago, month_ago))
    # Dated ahead by its engine, the folder's own time is not its last use: the agent's record is.
    os.utime(caches.folder("e-stale"), (time.time() + 365 * DAY_S,) * 2)
    leftover = fill(
        caches.root / f"{engine_disk.SET_ASIDE_PREFIX}e-gone-1234", 1000
    )  # an agent killed mid-delete

    supervisor.check_disk()
    wait_until(lambda: not supervisor._removals.pending(), 10)

    assert cache_names(caches) == {"e-fresh"} and not leftover.exists()


def test_a_replica_starting_while_its_endpoints_cache_is_pruned_keeps_that_cache(
    make_supervisor, tmp_path, monkeypatch
):
    supervisor = make_supervisor(cache_max_age_s=7 * DAY_S, sweep_interval_s=0, check_interval_s=3600)
    caches = CacheFolders(supervisor.data_dir / "engine-caches")
    fill(caches.folder("e-back"), 1000)
    last_used(caches, "e-back", 30)
    measure = engine_disk.measure

    def measure_while_a_replica_arrives(folders, **bounds):
        # The walk runs outside the supervisor's lock: a replica of the endpoint is placed here meanwhile.
        if any(Path(folder).name == "e-back" for folder in folders):
            supervisor.start(make_spec("r-back", endpoint_id="e-back"), tmp_path / "model")
        return measure(folders, **bounds)

    monkeypatch.setattr(engine_disk, "measure", measure_while_a_replica_arrives)
    supervisor.check_disk()
    monkeypatch.setattr(engine_disk, "measure", measure)

    assert (caches.folder("e-back") / "fill.bin").exists()
    wait_for_state(supervisor, "r-back", ReplicaState.READY, timeout_s=30)
    assert Path(supervisor.get("r-back").command.env["XDG_CACHE_HOME"]) == caches.folder("e-back")
    # A folder being deleted is one renamed aside: a launch meanwhile makes a new one, which the deletion never reaches.
    aside = engine_disk.set_aside(caches.folder("e-back"))
    supervisor.start(make_spec("r-next", endpoint_id="e-back"), tmp_path / "model")
    wait_for_state(supervisor, "r-next", ReplicaState.READY, timeout_s=30)
    engine_disk.remove_tree(aside)
    assert not aside.exists() and (caches.folder("e-back") / "vllm").is_dir()


# --- A live engine's folders ------------------------------------------------------------------------------


def test_an_engine_past_its_disk_bound_fails_with_the_reason_and_its_folders_are_emptied(
    make_supervisor, tmp_path
):
    supervisor = make_supervisor(engine_max_bytes=2 * MB, check_interval_s=0, sweep_interval_s=3600)
    supervisor.start(make_spec("r-big", endpoint_id="e-big"), tmp_path / "model")
    supervisor.start(make_spec("r-small", endpoint_id="e-small"), tmp_path / "model")
    wait_until(
        lambda: {s.state for s in supervisor.statuses()} == {ReplicaState.READY}, 30, poll=supervisor.poll
    )
    big = supervisor.get("r-big").command.env
    scratch, cache = Path(big["TMPDIR"]), Path(big["XDG_CACHE_HOME"])
    assert (cache / "fill.bin").stat().st_size == 3 * MB  # what the engine wrote itself
    # Another tenant's engine holds a link to 5 MB outside its folders: that is not its disk.
    (Path(supervisor.get("r-small").command.env["XDG_CACHE_HOME"]) / "weights").symlink_to(
        fill(tmp_path / "outside", 5 * MB), target_is_directory=True
    )

    supervisor.check_disk()

    status = next(status for status in supervisor.statuses() if status.replica_id == "r-big")
    assert status.state == ReplicaState.FAILED
    assert "wrote more than 0.002 GB to its own folders" in status.failure_reason
    wait_until(lambda: processes_with_marker("r-big") == [] and not supervisor._removals.pending(), 10)
    assert not scratch.exists() and not cache.exists()
    assert supervisor.get("r-small").state == ReplicaState.READY
    assert (tmp_path / "outside" / "fill.bin").stat().st_size == 5 * MB


def test_the_folders_of_an_engine_past_its_bound_and_pruned_caches_are_removed_off_the_disk_thread(
    make_supervisor, tmp_path, monkeypatch
):
    """Before, `check_disk` walked them itself: an engine past its bound of 200k files held every other engine's disk
    checks for 23-46 s (here: the check took the whole 3 s of each slow removal, on its own thread)."""
    import threading

    supervisor = make_supervisor(engine_max_bytes=2 * MB, check_interval_s=0, sweep_interval_s=0,
                                 cache_max_age_s=7 * DAY_S)  # fmt: skip
    supervisor.start(make_spec("r-big", endpoint_id="e-big"), tmp_path / "model")
    wait_for_state(supervisor, "r-big", ReplicaState.READY, timeout_s=30)
    big = supervisor.get("r-big").command.env
    scratch, cache = Path(big["TMPDIR"]), Path(big["XDG_CACHE_HOME"])
    caches = CacheFolders(supervisor.data_dir / "engine-caches")
    fill(caches.folder("e-stale"), 1000)
    last_used(caches, "e-stale", 30)
    release = threading.Event()
    walked_on = []
    remove_tree = engine_disk.remove_tree

    def slow(path, **kwargs):
        walked_on.append(threading.current_thread().name)
        release.wait(3)  # a tree of 200k files
        return remove_tree(path, **kwargs)

    monkeypatch.setattr(engine_disk, "remove_tree", slow)
    started = time.monotonic()
    supervisor.check_disk()
    took = time.monotonic() - started
    assert supervisor.get("r-big").state == ReplicaState.FAILED
    assert threading.current_thread().name not in walked_on and took < 1, (walked_on, took)
    release.set()
    wait_until(lambda: not supervisor._removals.pending(), 10)
    assert walked_on and {name.removesuffix("-urgent") for name in walked_on} == {"folder-removals"}
    assert not scratch.exists() and not cache.exists() and cache_names(caches) == set()


def test_the_folders_of_an_engine_past_its_bound_are_removed_without_waiting_behind_ended_engines_folders(
    make_supervisor, tmp_path, monkeypatch
):
    """Before, they went to the one removals' thread, behind every folder queued there: an engine stopped for filling
    the disk kept its bytes on it while other tenants' ended engines' trees (200k files, 23-46 s each) were walked
    (here: the 3 MB still there 5.9 s after the check that stopped it, behind three removals of 2 s)."""
    supervisor = make_supervisor(engine_max_bytes=2 * MB, check_interval_s=0, sweep_interval_s=3600)
    supervisor.start(make_spec("r-big", endpoint_id="e-big"), tmp_path / "model")
    wait_for_state(supervisor, "r-big", ReplicaState.READY, timeout_s=30)
    cache_root = supervisor.data_dir / "engine-caches"
    remove_tree = engine_disk.remove_tree

    def slow(path, **kwargs):  # another tenant's ended engine's tree of 200k files
        if path is not None and Path(path).name.startswith("slow"):
            time.sleep(2)
        return remove_tree(path, **kwargs)

    monkeypatch.setattr(engine_disk, "remove_tree", slow)
    slow_trees = [fill(tmp_path / f"slow{i}", 1000) for i in range(3)]
    supervisor._removals.add(*slow_trees)  # three ended engines' folders, queued just before
    time.sleep(0.1)  # the first of them being walked

    def big_bytes_left():
        return sum(path.stat().st_size for path in cache_root.rglob("fill.bin"))

    assert big_bytes_left() == 3 * MB
    supervisor.check_disk()
    checked = time.monotonic()
    assert supervisor.get("r-big").state == ReplicaState.FAILED
    wait_until(lambda: big_bytes_left() == 0, 20)
    assert time.monotonic() - checked < 1
    assert any(tree.exists() for tree in slow_trees)  # the ended engines' folders still being removed meanwhile
    wait_until(lambda: not supervisor._removals.pending(), 20)
    assert not any(tree.exists() for tree in slow_trees)


def test_an_exited_engines_folders_are_removed_outside_the_supervisors_lock(make_supervisor, tmp_path, monkeypatch):
    """Before, `_drop_scratch` removed them under the lock every heartbeat and launch waits on: an engine's deep or
    busy tree held the whole agent for as long as the walk took (another thread could not take the lock meanwhile)."""
    import signal
    import threading

    supervisor = make_supervisor(check_interval_s=3600, sweep_interval_s=3600)
    supervisor.start(make_spec("r-a", endpoint_id="e-a"), tmp_path / "model")
    wait_until(lambda: supervisor.get("r-a").state == ReplicaState.READY, 30, poll=supervisor.poll)
    scratch = Path(supervisor.get("r-a").command.env["TMPDIR"])
    lock_free_during = []
    remove_tree = engine_disk.remove_tree

    def probing(path, **kwargs):
        if path is not None:
            taken = []

            def take():
                taken.append(supervisor._lock.acquire(timeout=1))
                if taken[0]:
                    supervisor._lock.release()

            probe = threading.Thread(target=take)
            probe.start()
            probe.join()
            lock_free_during.append(taken[0])
        return remove_tree(path, **kwargs)

    monkeypatch.setattr(engine_disk, "remove_tree", probing)
    os.killpg(supervisor.get("r-a").pid, signal.SIGKILL)
    wait_until(lambda: not scratch.exists() and not supervisor._removals.pending(), 30, poll=supervisor.poll)
    assert lock_free_during and all(lock_free_during)


def test_the_monitors_polls_keep_their_pace_while_an_ended_engines_folders_are_removed(make_supervisor, tmp_path,
                                                                                        monkeypatch):
    """Before, `poll` removed them on the monitor's own thread once the lock was let go: a tree of 199k nested
    folders took 23 s, and every engine's launch, health check and drain waited (here: a poll took the whole 3 s of
    the slow removal)."""
    import signal
    import threading

    supervisor = make_supervisor(**NO_CHECKS)
    supervisor.start(make_spec("r-a", endpoint_id="e-a"), tmp_path / "model")
    wait_until(lambda: supervisor.get("r-a").state == ReplicaState.READY, 30, poll=supervisor.poll)
    scratch = Path(supervisor.get("r-a").command.env["TMPDIR"])
    release = threading.Event()
    remove_tree = engine_disk.remove_tree

    def slow(path, **kwargs):
        release.wait(3)  # an engine's tree that takes a while
        return remove_tree(path, **kwargs)

    monkeypatch.setattr(engine_disk, "remove_tree", slow)
    os.killpg(supervisor.get("r-a").pid, signal.SIGKILL)
    polls = []
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        started = time.monotonic()
        supervisor.poll()
        polls.append(time.monotonic() - started)
        time.sleep(0.05)
    assert supervisor.get("r-a").state != ReplicaState.READY  # its exit was seen: its folders are being removed
    assert max(polls) < 0.5, polls
    release.set()
    wait_until(lambda: not supervisor._removals.pending(), 10)
    assert not scratch.exists() and sandbox.scratch_set_aside_of(supervisor.data_dir) == []


def test_a_killed_agents_leftover_folders_are_removed_after_the_next_agents_start_outside_its_lock(
    tmp_path, monkeypatch
):
    """Before, `recover` removed a killed agent's engines' scratch and adapters folders under the lock, with no bound on
    a walk: a deep tree left behind held the new agent's start (its first heartbeat, every launch) for the whole walk
    (another thread could not take the lock meanwhile)."""
    import threading

    data_dir = tmp_path / "data"
    (data_dir / "engine-adapters" / "r-old" / "a").mkdir(parents=True)
    scratch = sandbox.make_scratch_folder(data_dir, "r-old")
    (scratch / "deep").mkdir()
    aside = sandbox.set_scratch_aside(sandbox.make_scratch_folder(data_dir, "r-older"), data_dir)
    supervisor = Supervisor(data_dir)
    lock_free_during, removed = [], []
    remove_tree = engine_disk.remove_tree

    def probing(path, **kwargs):
        taken = []

        def take():
            taken.append(supervisor._lock.acquire(timeout=1))
            if taken[0]:
                supervisor._lock.release()

        probe = threading.Thread(target=take)
        probe.start()
        probe.join()
        lock_free_during.append(taken[0])
        removed.append((path, kwargs.get("max_entries")))
        return remove_tree(path, **kwargs)

    monkeypatch.setattr(engine_disk, "remove_tree", probing)
    supervisor.recover()
    wait_until(lambda: not any((data_dir / "engine-adapters").iterdir()) and not scratch.exists()
               and not aside.exists() and not sandbox.scratch_set_aside_of(data_dir), 10)
    assert len(removed) == 3 and all(lock_free_during)
    assert all(bound == supervisor._removals.max_entries for _, bound in removed)  # each walk bounded
    supervisor._removals.close(5)


def test_a_folder_queued_for_removal_moves_to_the_urgent_thread_and_is_never_walked_by_both_at_once(tmp_path, monkeypatch):
    import threading

    release = threading.Event()
    walks = []  # (folder name, thread name)
    remove_tree = engine_disk.remove_tree

    def slow(path, **kwargs):
        walks.append((Path(path).name, threading.current_thread().name))
        release.wait(5)
        return remove_tree(path, **kwargs)

    monkeypatch.setattr(engine_disk, "remove_tree", slow)
    removals = engine_disk.Removals()
    busy, queued = fill(tmp_path / "busy", 1000), fill(tmp_path / "queued", 1000)
    removals.add(busy, queued)
    wait_until(lambda: walks, 5)  # the routine thread walks "busy"; "queued" waits behind it
    removals.add(queued, busy, urgent=True)  # "busy" is left to the walk under way
    wait_until(lambda: len(walks) == 2, 5)
    removals.add(queued, busy)  # both being walked: neither walked again
    release.set()
    wait_until(lambda: not removals.pending(), 10)
    assert walks == [("busy", "folder-removals"), ("queued", "folder-removals-urgent")]
    assert not busy.exists() and not queued.exists()
    assert removals.close(5) == []


def test_an_urgent_folder_of_few_files_waits_for_one_turn_of_each_urgent_tree_queued_before_it_not_their_whole_walks(
    tmp_path, monkeypatch
):
    """Before (the review of fix-fleet8), the urgent thread walked its folders whole, one after another: a tenant
    getting its engines stopped on purpose queued trees of up to 400k entries each (23-46 s a walk), and another
    tenant's engine stopped for 20 GB of bytes waited behind all of them (here: all 6 x 1500 files of the hostile
    trees were gone before the victim's folder was first walked). Now each urgent turn walks `URGENT_SLICE_ENTRIES`
    (here 100) and a folder with more goes to the back at once."""
    monkeypatch.setattr(engine_disk, "URGENT_SLICE_ENTRIES", 100, raising=False)
    hostile = []
    for i in range(6):
        tree = tmp_path / f"hostile-{i}"
        tree.mkdir()
        for j in range(1500):
            (tree / f"f{j}").touch()
        hostile.append(tree)
    victim = fill(tmp_path / "victim-bytes", 3 * MB)
    hostile_left_at_victim = []
    remove_tree = engine_disk.remove_tree

    def watching(path, **kwargs):
        if Path(path).name == "victim-bytes":
            hostile_left_at_victim.append(sum(len(os.listdir(tree)) for tree in hostile if tree.exists()))
        return remove_tree(path, **kwargs)

    monkeypatch.setattr(engine_disk, "remove_tree", watching)
    removals = engine_disk.Removals(max_entries=2 * 1500)
    removals.add(*hostile, urgent=True)
    removals.add(victim, urgent=True)
    wait_until(lambda: not removals.pending(), 60)
    assert removals.close(5) == []
    assert not victim.exists() and not any(tree.exists() for tree in hostile)
    # at most one turn (100 entries, its folder's own included) of each hostile tree before the victim's first turn,
    # which removed it whole
    assert len(hostile_left_at_victim) == 1 and 6 * 1400 <= hostile_left_at_victim[0] < 6 * 1500


def test_an_urgent_tree_written_to_all_along_waits_like_any_folder_left_once_walked_max_entries_in_turns(
    tmp_path, monkeypatch
):
    """Turns come back at once only until a folder has been walked `max_entries` in all: then it waits
    `REMOVAL_RETRY_S` like a folder left, so a writer that never stops costs no more than before."""
    monkeypatch.setattr(engine_disk, "URGENT_SLICE_ENTRIES", 100)
    walks = []

    def never_done(path, **kwargs):
        walks.append((time.monotonic(), kwargs))
        return None if kwargs.get("slice_only") else False

    monkeypatch.setattr(engine_disk, "remove_tree", never_done)
    removals = engine_disk.Removals(max_entries=300)
    removals.add(tmp_path / "busy", urgent=True)
    wait_until(lambda: len(walks) >= 4, 10)
    removals.close(0)
    assert [kwargs for _, kwargs in walks[:3]] == [{"max_entries": 100, "slice_only": True}] * 3
    assert walks[2][0] - walks[0][0] < engine_disk.REMOVAL_RETRY_S / 2  # three turns at once
    assert walks[3][0] - walks[2][0] >= engine_disk.REMOVAL_RETRY_S * 0.9  # then a wait


def test_an_engine_near_its_disk_bound_is_measured_sooner_and_fails_soon_after_it_passes_it(make_supervisor, tmp_path):
    # Measured every 30 s whatever it held: an engine at 90% of its bound wrote for half a minute past it unseen.
    supervisor = make_supervisor(engine_max_bytes=int(3.5 * MB), check_interval_s=20, sweep_interval_s=3600)
    supervisor.start(make_spec("r-big", endpoint_id="e-big"), tmp_path / "model")
    wait_until(lambda: supervisor.get("r-big").state == ReplicaState.READY, 30, poll=supervisor.poll)
    supervisor.check_disk()  # ~3.1 MB of its 3.5: within its bound, near it
    assert supervisor.get("r-big").state == ReplicaState.READY
    fill(Path(supervisor.get("r-big").command.env["XDG_CACHE_HOME"]) / "more", MB)
    time.sleep(engine_disk.MIN_CHECK_INTERVAL_S + 0.2)
    supervisor.check_disk()
    assert supervisor.get("r-big").state == ReplicaState.FAILED


def test_the_next_measure_comes_sooner_the_nearer_an_engine_is_to_its_bound():
    bounds = EngineDiskBounds(engine_max_bytes=100 * MB, engine_max_files=1000, check_interval_s=30)
    assert engine_disk.next_check_in_s(engine_disk.DiskUsage(0, 0, True), bounds) == 30
    assert engine_disk.next_check_in_s(engine_disk.DiskUsage(50 * MB, 10, True), bounds) == 15
    assert engine_disk.next_check_in_s(engine_disk.DiskUsage(MB, 900, True), bounds) == pytest.approx(3)  # files
    assert engine_disk.next_check_in_s(engine_disk.DiskUsage(99 * MB, 10, True), bounds) == engine_disk.MIN_CHECK_INTERVAL_S


def test_an_engine_near_its_bound_is_walked_again_no_sooner_than_ten_times_its_walk_took():
    # An engine holding 190,000 files (95 % of the bound) took 1.1 s to walk and was walked every 2 s: half a core, and
    # the other engines' checks waited behind it (the review of the sooner checks).
    bounds = EngineDiskBounds(engine_max_bytes=None, engine_max_files=200_000, check_interval_s=30)
    near = engine_disk.DiskUsage(MB, 190_000, True)
    assert engine_disk.next_check_in_s(near, bounds, walked_s=1.1) == pytest.approx(11)
    assert engine_disk.next_check_in_s(near, bounds, walked_s=0.01) == engine_disk.MIN_CHECK_INTERVAL_S
    assert engine_disk.next_check_in_s(near, bounds, walked_s=9) == 30  # never past the interval itself


def test_an_engine_past_its_bound_is_reported_failed_with_the_reason_to_the_control_plane(
    control_plane,  # noqa: F811
    running_agent,  # noqa: F811
    tmp_path,
):
    model = tmp_path / "model"
    model.mkdir()
    control_plane.desired = [make_spec("r-fills", model_source=str(model))]
    agent, _stop, _thread = running_agent(
        engine_disk=EngineDiskBounds(engine_max_bytes=MB, check_interval_s=0.2, sweep_interval_s=3600)
    )
    wait_until(lambda: control_plane.last_states().get("r-fills") == ReplicaState.READY, 15)
    fill(Path(agent.supervisor.get("r-fills").command.env["XDG_CACHE_HOME"]) / "torchinductor", 2 * MB)

    wait_until(lambda: control_plane.last_states().get("r-fills") == ReplicaState.FAILED, 15)
    status = next(s for s in control_plane.heartbeats[-1].replicas if s.replica_id == "r-fills")
    assert "wrote more than 0.001 GB to its own folders" in status.failure_reason
    assert processes_with_marker("r-fills") == []


def test_links_in_an_engines_folders_are_never_followed_to_count_or_to_delete(tmp_path):
    outside = fill(tmp_path / "other-tenants-weights", 5 * MB)
    cache = tmp_path / "engine-caches" / "e-1"
    cache.mkdir(parents=True)
    (cache / "to-folder").symlink_to(outside, target_is_directory=True)
    (cache / "to-file").symlink_to(outside / "fill.bin")
    (cache / "to-root").symlink_to("/", target_is_directory=True)
    os.link(outside / "fill.bin", cache / "hard-link")  # a name inside: counted (`test_a_file_linked_...`)
    own = fill(cache / "own", MB) / "fill.bin"
    os.link(own, cache / "own-again")  # both names inside: counted once
    locked = fill(cache / "locked", 1000)
    locked.chmod(0o500)  # an engine may take its own write permission away

    usage = engine_disk.measure([cache])
    assert usage.complete and 6 * MB < usage.num_bytes < 6 * MB + 100_000
    assert not engine_disk.measure([cache], max_bytes=MB // 2).complete

    engine_disk.remove_tree(engine_disk.set_aside(cache))

    assert not cache.exists() and not list(cache.parent.iterdir())
    assert (outside / "fill.bin").stat().st_size == 5 * MB and os.stat(outside / "fill.bin").st_nlink == 1


def test_the_walk_stops_at_its_bound_on_files(tmp_path):
    for number in range(50):
        (tmp_path / f"f{number}").touch()
    usage = engine_disk.measure([tmp_path], max_files=20)
    assert not usage.complete and usage.num_files == 21
    assert usage.over(None, 20) == "more than 20 files and folders"


def test_an_operator_sets_the_engines_disk_bounds_on_the_command_line_or_environment(monkeypatch):
    def parse(argv):
        return cli._parser().parse_args(argv)  # the environment is read as the parser is made

    defaults = cli.engine_disk_bounds(parse(["run", "--control-plane", "http://cp"]))
    assert defaults == EngineDiskBounds()
    assert (defaults.engine_max_bytes, defaults.cache_budget_bytes) == (20 * 10**9, 50 * 10**9)
    assert defaults.cache_max_age_s == 14 * DAY_S
    monkeypatch.setenv("INFERPLANE_AGENT_ENGINE_DISK_GB", "5")
    monkeypatch.setenv("INFERPLANE_AGENT_ENGINE_CACHE_GB", "200")
    monkeypatch.setenv("INFERPLANE_AGENT_ENGINE_CACHE_DAYS", "0.5")
    bounds = cli.engine_disk_bounds(parse(["run", "--control-plane", "http://cp"]))
    assert (bounds.engine_max_bytes, bounds.cache_budget_bytes, bounds.cache_max_age_s) == (
        5e9,
        200e9,
        DAY_S / 2,
    )
    with pytest.raises(SystemExit):
        parse(["run", "--control-plane", "http://cp", "--engine-disk-gb", "0"])


def test_a_folder_swapped_for_a_link_while_its_tree_is_removed_never_changes_what_the_link_names(base):
    """An engine's leftover child still writing in its tree swaps a folder for a link to one outside at the worst
    moment: as the agent makes the folder its own (0o700) to empty it (the engine had locked its parent). Before, the
    chmod went by name and followed the link: the outside folder became 0o700."""
    outside = fill(base / "outside", 1000)
    tree = base / "tree"
    victim = fill(tree / "locked" / "victim", 1000)
    (victim / "inner").mkdir()

    def remove_while_swapping():
        chmod = os.chmod

        def chmod_after_a_swap(target, mode, **kwargs):
            named = os.readlink(target) if str(target).startswith("/proc/self/fd/") else os.fspath(target)
            if named == str(victim) and not victim.is_symlink():  # the worst moment
                victim.rename(victim.with_name("moved"))
                victim.symlink_to(outside, target_is_directory=True)
            return chmod(target, mode, **kwargs)

        os.chmod = chmod_after_a_swap  # NOTE: in the forked remover only
        (tree / "locked").chmod(0o500)
        engine_disk.remove_tree(tree)
        assert victim.is_symlink() or not tree.exists()  # swapped, or it never reached it (it always does)

    run_unprivileged(base, remove_while_swapping)
    assert stat.S_IMODE(outside.stat().st_mode) == 0o755
    assert (outside / "fill.bin").stat().st_size == 1000
    assert sorted(path.name for path in base.iterdir()) == ["outside"]


def test_a_tree_with_folders_an_engine_made_unreadable_is_removed_whole(base):
    """Folders at 0o000 and 0o500, a link to one outside, a link in the top's place."""
    outside = fill(base / "outside", 1000)
    tree = base / "tree"
    fill(tree / "a" / "b" / "c", 1000)
    fill(tree / "locked" / "inner", 1000)
    (tree / "a" / "to-outside").symlink_to(outside, target_is_directory=True)
    (base / "link-at-top").symlink_to(outside, target_is_directory=True)

    def lock_and_remove():
        (tree / "locked" / "inner").chmod(0o000)
        (tree / "locked").chmod(0o500)
        (tree / "a" / "b").chmod(0o000)
        engine_disk.remove_tree(tree)
        engine_disk.remove_tree(base / "link-at-top")

    run_unprivileged(base, lock_and_remove)
    assert sorted(path.name for path in base.iterdir()) == ["outside"]
    assert (outside / "fill.bin").stat().st_size == 1000 and stat.S_IMODE(outside.stat().st_mode) == 0o755


@pytest.fixture
def base():
    """A folder an unprivileged user may work in (pytest's own are root's, 0o700)."""
    made = Path(tempfile.mkdtemp(prefix="engine-disk-", dir="/tmp"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)  # NOTE: what a failed test left locked, root removes


def run_unprivileged(base: Path, action) -> None:
    """`action()` in a forked process as nobody, `base` and all in it nobody's (the agent is no root on a node: as
    root, every permission admits it and no folder is left for the chmod walk). Unprivileged already: as itself."""
    as_root = os.geteuid() == 0
    for root, dirs, files in os.walk(base) if as_root else ():
        for name in dirs + files:
            os.chown(os.path.join(root, name), NOBODY, NOBODY, follow_symlinks=False)
    if as_root:
        os.chown(base, NOBODY, NOBODY)
    child = os.fork()
    if child == 0:  # NOTE: forked, as nobody may not run this venv's interpreter (under /root)
        code = 1
        try:
            if as_root:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            action()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    assert os.waitpid(child, 0)[1] == 0


def _remove_deep_tree_with_few_descriptors(base: Path, depth: int, spare_fds: int) -> tuple[bool | None, bool]:
    """In a forked child, `remove_tree` of a folder `depth` levels deep with `spare_fds` descriptors left under its
    RLIMIT_NOFILE (what an engine's deep tree does to an agent holding many sockets): (its answer, whether the tree is
    left). The child gives up after 15 s: a walk still going then is a hang."""
    import resource
    import signal

    top = base / "cache"
    top.mkdir()
    folder = os.open(top, os.O_RDONLY)
    for _ in range(depth):  # by descriptor: no path length limit
        os.mkdir("d", dir_fd=folder)
        deeper = os.open("d", os.O_RDONLY, dir_fd=folder)
        os.close(folder)
        folder = deeper
    os.close(folder)
    answer = base / "answer"
    child = os.fork()
    if child == 0:
        code = 1
        try:
            signal.signal(signal.SIGALRM, lambda *_: os._exit(3))
            signal.alarm(15)
            # NOTE: RLIMIT_NOFILE bounds the numbers of new descriptors, not how many are open: a process with gaps
            # below its highest descriptor (a whole suite's worker) had more spare than counted, and the walk that
            # should have run out finished (the fresh-clone run's failure). The limit is set past the lowest
            # `spare_fds` free numbers exactly.
            free, number = [], 0
            while len(free) < spare_fds:
                try:
                    os.fstat(number)
                except OSError:
                    free.append(number)
                number += 1
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (free[-1] + 1, hard))
            answer.write_text(repr(engine_disk.remove_tree(top)))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    status = os.waitpid(child, 0)[1]
    assert os.WEXITSTATUS(status) != 3, "still removing after 15 s"
    assert status == 0
    return eval(answer.read_text()), top.exists()  # noqa: S307 (the child's repr of a bool)


def test_a_tree_deeper_than_the_agents_spare_descriptors_is_removed_whole_in_seconds(base):
    """Before, the walk held one descriptor a level: past RLIMIT_NOFILE, EMFILE read as "not a folder", each level
    rescanned with a budget of its own, and the walk never ended (still removing after 15 s), under the supervisor's
    lock. Now it holds a few, whatever the depth."""
    started = time.monotonic()
    assert _remove_deep_tree_with_few_descriptors(base, depth=300, spare_fds=20) == (True, False)
    assert time.monotonic() - started < 15


def test_a_removal_out_of_descriptors_stops_at_once_and_says_the_rest_is_left(base):
    answer, left = _remove_deep_tree_with_few_descriptors(base, depth=50, spare_fds=1)
    assert (answer, left) == (False, True)


def test_a_removal_stopped_by_a_folder_moved_mid_walk_is_tried_again_and_found_by_name_after_a_restart(
    tmp_path, monkeypatch
):
    """A tenant's process still alive moves a folder up while the walk is in it: the walk stops. Before, nothing tried
    it again, and the walk had removed the owner file first: the next agent's sweep (`recover`, which matched that
    tenant-writable file) never found the folder either. Now the scratch is renamed aside to a name the agent's
    sweep matches, and the removals try it again."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    scratch = sandbox.make_scratch_folder(data_dir, "r-x")
    (scratch / "a" / "b").mkdir(parents=True)
    (scratch / "a" / "b" / "big.bin").write_bytes(b"x" * 4096)
    (scratch / "z").mkdir()
    aside = sandbox.set_scratch_aside(scratch, data_dir)
    assert not scratch.exists() and sandbox.scratch_set_aside_of(data_dir) == [aside]
    real_enter, real_names = engine_disk._enter_folder, engine_disk._names_in
    moves = {"left": 1}

    def racing(dir_fd, name):
        entered = real_enter(dir_fd, name)
        if name == "b" and moves["left"]:  # the tenant's live process moves b up while the walk is in it
            moves["left"] -= 1
            os.rename(aside / "a" / "b", aside / "moved")
        return entered

    monkeypatch.setattr(engine_disk, "_enter_folder", racing)
    monkeypatch.setattr(engine_disk, "_names_in", lambda fd: iter(
        sorted(real_names(fd), key=lambda name: name != sandbox.SCRATCH_OWNER_FILE)))  # the owner file goes first
    assert engine_disk.remove_tree(aside) is False
    assert (aside / "moved").exists() and not (aside / sandbox.SCRATCH_OWNER_FILE).exists()
    assert sandbox.scratch_set_aside_of(data_dir) == [aside]  # found by its name all the same
    next_agent = Supervisor(data_dir)
    next_agent.recover()  # the next agent's start: removed on its removals' thread
    wait_until(lambda: not aside.exists(), 10)
    next_agent._removals.close(5)
    # Within the agent, the removals try it again.
    aside = sandbox.set_scratch_aside(sandbox.make_scratch_folder(data_dir, "r-y"), data_dir)
    (aside / "a" / "b").mkdir(parents=True)
    moves["left"] = 1
    monkeypatch.setattr(engine_disk, "REMOVAL_RETRY_S", 0.05)
    removals = engine_disk.Removals(max_entries=100)
    removals.add(aside)
    wait_until(lambda: not removals.pending(), 10)
    assert moves["left"] == 0 and not aside.exists()


def test_a_walk_rescanning_a_top_folder_written_to_meanwhile_leaves_no_descriptor_open(tmp_path, monkeypatch):
    """A process of the engine still writing in its folder set aside (its working folder there) adds a file after
    each listing of it: the walk rescans it, entering it again each time. Before, each time opened a descriptor of it
    that only the last one closed: 48 leaked by 3 walks, for the agent's life."""
    top = tmp_path / "set-aside"
    top.mkdir()
    (top / "f").write_text("x")
    top_inode = top.stat().st_ino
    listed = engine_disk._names_in
    made = iter(range(10**6))

    def names_in(folder):
        names = listed(folder)
        if os.fstat(folder).st_ino == top_inode:  # the engine's process writes again
            open(f"/proc/self/fd/{folder}/w{next(made)}", "w").close()
        return names

    monkeypatch.setattr(engine_disk, "_names_in", names_in)
    before = set(os.listdir("/proc/self/fd"))
    for _ in range(3):
        assert engine_disk.remove_tree(top, max_entries=1000) is False  # its rescans spent: left for a later walk
    assert next(made) > 3 * engine_disk.RESCANS
    assert set(os.listdir("/proc/self/fd")) - before == set()


def test_a_live_writer_adding_levels_stops_a_walk_at_its_bound_and_the_removal_finishes_in_later_walks(
    tmp_path, monkeypatch
):
    """Before, the walk had no bound on entries: a process adding a level below each folder the walk entered kept it
    going as long as it wrote (here: one walk went down 2,000 levels). Now each walk stops at its bound, and the next
    ones finish the tree, deeper than the bound though it is."""
    top = tmp_path / "t"
    (top / "d").mkdir(parents=True)
    real = engine_disk._enter_folder
    entered = {"n": 0}

    def racing(dir_fd, name):
        got = real(dir_fd, name)
        if got is not None:
            entered["n"] += 1
            if entered["n"] < 2000:  # the tenant adds a level below each one the walk enters
                os.mkdir(f"n{entered['n']}", dir_fd=got)
        return got

    monkeypatch.setattr(engine_disk, "_enter_folder", racing)
    assert engine_disk.remove_tree(top, max_entries=300) is False
    assert entered["n"] <= 301 and top.exists()
    monkeypatch.setattr(engine_disk, "REMOVAL_RETRY_S", 0.01)
    monkeypatch.setattr(engine_disk, "MAX_REMOVAL_RETRY_S", 0.01)
    removals = engine_disk.Removals(max_entries=300)
    removals.add(top)
    wait_until(lambda: not removals.pending(), 30)
    assert not top.exists() and entered["n"] >= 2000


def test_an_adapter_staged_after_its_engines_folder_went_makes_no_folder_and_a_retire_removes_stray_adapters(
    make_supervisor, tmp_path
):
    """Before, the copy (outside the supervisor's lock) made the folders above it again (`mkdir(parents=True)`): an
    adapters folder `_drop_scratch` had just set aside came back, and nothing removed it; and a retired node's
    wind-down (`remove_engine_caches`) never looked at `engine-adapters/`, so such folders stayed."""
    supervisor = make_supervisor(**NO_CHECKS)
    supervisor.start(make_spec("r-a", endpoint_id="e-a"), tmp_path / "model")
    wait_until(lambda: supervisor.get("r-a").state == ReplicaState.READY, 30, poll=supervisor.poll)
    adapter = tmp_path / "cache" / "lora-1"
    (adapter / "sub").mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "sub" / "w.bin").write_bytes(b"x")
    live = supervisor._adapter_dirs["r-a"]
    gone = live.parent / "r-gone"
    gone.mkdir()
    engine_disk.remove_tree(engine_disk.set_aside(gone))  # its engine ended while its adapter was being copied
    with pytest.raises(FileNotFoundError):
        sandbox.stage_adapter(adapter, gone)
    assert not gone.exists()
    stray = live.parent / "r-killed-agents"  # left by an agent killed before it removed it
    (stray / "lora-1").mkdir(parents=True)
    assert supervisor.stage_adapter("r-a", adapter) == live / "lora-1"
    supervisor.remove_engine_caches()
    assert not stray.exists() and (live / "lora-1" / "sub" / "w.bin").exists()
    assert sorted(path.name for path in live.parent.iterdir()) == ["r-a"]


def test_an_urgent_folder_mid_slice_as_the_agent_stops_is_tried_once_more_whole(tmp_path, monkeypatch):
    """`close` tries every folder still waiting once more whole; before, the one in a slice as it was called was left
    (with the rest of its files) for the next agent, whose start queued it behind every routine removal."""
    import threading

    folder = tmp_path / "a"
    folder.mkdir()
    for i in range(300):
        (folder / f"f{i}").touch()
    monkeypatch.setattr(engine_disk, "URGENT_SLICE_ENTRIES", 50)
    in_slice, go = threading.Event(), threading.Event()
    remove_tree = engine_disk.remove_tree

    def held_slice(path, **kwargs):
        answer = remove_tree(path, **kwargs)
        if kwargs.get("slice_only"):
            in_slice.set()
            go.wait(5)
        return answer

    monkeypatch.setattr(engine_disk, "remove_tree", held_slice)
    removals = engine_disk.Removals(max_entries=100_000)
    removals.add(folder, urgent=True)
    assert in_slice.wait(5)
    threading.Timer(0.2, go.set).start()
    assert removals.close(10) == []
    assert not folder.exists()


# --- What an engine hides from its bound ---------------------------------------------------------------------


def test_a_folder_an_engine_made_unreadable_stops_the_walk_as_hidden_never_as_measured(base):
    """The agent is the engines' own user, no root: a folder an engine made 0o000 (Landlock leaves chmod to it) or
    0o400 (listed, never searched) refuses it. Before, the walk skipped it and took the folders as measured: 20 MB
    hidden, 8 kB counted, `complete`. Once readable again, the same folders measure as before."""
    scratch = base / "scratch"
    fill(scratch / "locked", 20 * MB)
    fill(scratch / "unsearchable", 20 * MB)
    answers = base / "answers"

    def lock_and_measure():
        lines = []
        for name, mode in (("locked", 0o000), ("unsearchable", 0o400)):
            (scratch / name).chmod(mode)  # what a confined engine may do in its own folder
            usage = engine_disk.measure([scratch])  # as the agent (the same user) measures it
            lines.append(f"{name}: {usage.complete} {usage.unreadable}")
            (scratch / name).chmod(0o700)
        usage = engine_disk.measure([scratch])
        lines.append(f"readable: {usage.complete} {usage.num_bytes >= 40 * MB} {usage.unreadable!r}")
        answers.write_text("\n".join(lines))

    run_unprivileged(base, lock_and_measure)
    assert answers.read_text().splitlines() == [
        f"locked: False {scratch}/locked",
        f"unsearchable: False {scratch}/unsearchable/fill.bin",
        "readable: True True ''",
    ]


def test_an_engine_that_made_a_folder_of_its_own_unreadable_fails_and_its_folders_are_emptied(
    make_supervisor, tmp_path, monkeypatch
):
    """The verdict on `measure`'s `unreadable` (the tests run as root, whom no permission refuses: the walk's part is
    `test_a_folder_an_engine_made_unreadable_...`, as nobody)."""
    supervisor = make_supervisor(check_interval_s=0, sweep_interval_s=3600)
    supervisor.start(make_spec("r-hides", endpoint_id="e-hides"), tmp_path / "model")
    supervisor.start(make_spec("r-plain", endpoint_id="e-plain"), tmp_path / "model")
    wait_until(lambda: {s.state for s in supervisor.statuses()} == {ReplicaState.READY}, 30, poll=supervisor.poll)
    hides = Path(supervisor.get("r-hides").command.env["TMPDIR"])
    measure = engine_disk.measure

    def measure_as_the_agent(folders, **bounds):
        usage = measure(folders, **bounds)
        if hides in folders:  # what nobody's walk gets there (a folder at 0o000)
            return engine_disk.DiskUsage(usage.num_bytes, usage.num_files, False, unreadable=str(hides / "locked"))
        return usage

    monkeypatch.setattr(engine_disk, "measure", measure_as_the_agent)
    supervisor.check_disk()

    status = next(status for status in supervisor.statuses() if status.replica_id == "r-hides")
    assert status.state == ReplicaState.FAILED
    assert "its engine hid what it wrote from the agent (a folder in its own folders made unreadable)" in (
        status.failure_reason
    )
    wait_until(lambda: processes_with_marker("r-hides") == [] and not supervisor._removals.pending(), 10)
    assert not hides.exists()
    assert supervisor.get("r-plain").state == ReplicaState.READY


@pytest.mark.parametrize("held", ["open", "mapped"])
def test_what_an_engine_holds_in_its_folders_after_removing_it_counts_in_its_bound(make_supervisor, tmp_path, held):
    """A file an engine unlinked while it holds it (open, or only mapped) keeps its blocks on the disk where no walk
    of its folders meets it. Before, an engine holding 3 MB so, past a bound of 2 MB, stayed READY (counted 4 kB);
    an honest engine's count is the same as before."""
    hiding = fake_engine_factory("--fill-scratch-bytes", str(3 * MB), "--unlink-scratch-fill", held)
    honest = fake_engine_factory("--fill-scratch-bytes", str(MB))

    def factory(spec, model_path, port):
        return (hiding if spec.replica_id == "r-hides" else honest)(spec, model_path, port)

    supervisor = make_supervisor(command_factory=factory, engine_max_bytes=2 * MB, check_interval_s=0,
                                 sweep_interval_s=3600)  # fmt: skip
    supervisor.start(make_spec("r-hides", endpoint_id="e-hides"), tmp_path / "model")
    supervisor.start(make_spec("r-honest", endpoint_id="e-honest"), tmp_path / "model")
    wait_until(lambda: {s.state for s in supervisor.statuses()} == {ReplicaState.READY}, 30, poll=supervisor.poll)
    hides = Path(supervisor.get("r-hides").command.env["TMPDIR"])
    assert engine_disk.measure([hides]).num_bytes < MB  # its name is gone: no walk meets it
    honest_replica = supervisor.get("r-honest")
    honest_folders = [Path(honest_replica.command.env[name]) for name in ("TMPDIR", "XDG_CACHE_HOME")]

    supervisor.check_disk()

    status = next(status for status in supervisor.statuses() if status.replica_id == "r-hides")
    assert status.state == ReplicaState.FAILED
    assert "wrote more than 0.002 GB to its own folders" in status.failure_reason
    assert supervisor.get("r-honest").state == ReplicaState.READY
    with_disks = shared_memory.held_by_tree(honest_replica.pid, supervisor.shared_memory_dir,
                                            engine_disk.devices_of(honest_folders))  # fmt: skip
    assert with_disks.num_bytes == shared_memory.held_by_tree(honest_replica.pid, supervisor.shared_memory_dir).num_bytes


# Writes 5 MB at argv[1], forks (the child holds it too), removes its name and says the child's pid.
HOLD_UNLINKED = """
import os, sys, time
with open(sys.argv[1], "wb") as fill:
    fill.write(os.urandom(5_000_000))
held = os.open(sys.argv[1], os.O_RDONLY)
child = os.fork()
if child:
    os.unlink(sys.argv[1])
    print(child, flush=True)
time.sleep(60)
"""


def test_a_file_unlinked_and_held_by_several_processes_of_an_engine_counts_once(tmp_path):
    # NOTE: stdin and stderr never pytest's capture file, itself a file unlinked and open
    holder = subprocess.Popen([sys.executable, "-c", HOLD_UNLINKED, str(tmp_path / "fill.bin")], text=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
    child = None
    try:
        child = int(holder.stdout.readline())
        held = shared_memory.held_by({holder.pid, child}, disk_devices=engine_disk.devices_of([tmp_path]))
        assert held.num_files == 1 and 5 * MB <= held.num_bytes < 5 * MB + 100_000
        assert shared_memory.held_by({holder.pid, child}).num_bytes == 0  # of no device of its folders: not counted
    finally:
        holder.kill()
        if child is not None:
            os.kill(child, signal.SIGKILL)
        holder.wait()


def test_a_file_two_replicas_of_one_endpoint_link_through_their_shared_cache_counts_in_both(tmp_path):
    """Two replicas of one endpoint on a node share its cache folder (READ_WRITE with REFER in both): a file with a
    name in each scratch and one in the cache. Before, a file counted only when all its names were inside, so
    neither engine counted it: 20 MB, 16 kB counted in all."""
    cache, scratch_a, scratch_b = tmp_path / "cache", tmp_path / "a", tmp_path / "b"
    big = fill(scratch_a, 20 * MB) / "fill.bin"
    cache.mkdir(), scratch_b.mkdir()
    os.link(big, cache / "x")
    os.link(big, scratch_b / "x")
    for folders in ([scratch_a, cache], [scratch_b, cache]):
        assert engine_disk.measure(folders).num_bytes >= 20 * MB
    assert engine_disk.measure([scratch_a, cache, scratch_b]).num_bytes < 21 * MB  # once, however many names
