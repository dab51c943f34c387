"""What engines write to a node's disk, bounded: each live engine's folders, and the caches endpoints leave behind.

A confined engine writes two folders (`sandbox.engine_folder_env`): its launch's scratch folder (HOME, TMPDIR;
removed when its engine ends) and its endpoint's cache folder (`<data dir>/engine-caches/<endpoint>`: vLLM's,
torch's and Triton's compile caches, kept for the endpoint's next cold start). Both were outside every budget: a
tenant's engine writing without end, or a node that served thousands of endpoints over months, filled the node's
disk, and then weights downloads and other tenants' engines failed. Now:

- a live engine's scratch and cache folders together, with what its processes hold in /dev/shm (RAM, which it may
  write but not list: `shared_memory.held_by`) and what they hold of those folders' disks with no name left (a file
  unlinked while open or mapped, which no walk meets), are measured every `EngineDiskBounds.check_interval_s`, sooner
  the nearer they are to their bound (`next_check_in_s`), and its replica fails past `engine_max_bytes` or
  `engine_max_files` (the supervisor empties both, and removes the /dev/shm files it held); a /dev/shm file of the
  agent's user that no process held at the sweeps of `shared_memory_orphan_age_s` goes;
- the cache folders of endpoints with no replica on the node go when their last use is older than `cache_max_age_s`,
  and least recently used first while all cache folders together are past `cache_budget_bytes`.

A folder is measured by what it holds on disk (blocks; a file with several names once, wherever its other names are),
never following a link, and the walk stops once past its bound, or at a folder its engine made unreadable to the agent
(its replica then fails: what it holds is unknown): an engine cannot make the agent count, walk or delete anything
outside its folders. The folders that changed under a walk are read again (an engine moved files ahead of it), and
an engine whose folders never settle under the reads fails after a while (`measure`, `Supervisor.check_disk`). A folder is removed by renaming it aside first (`set_aside`, under the supervisor's
lock, which every launch holds) and deleting the renamed copy after: a replica of the endpoint starting meanwhile
makes a new folder, never one half deleted. `CacheFolders` is the record of the cache folders; the supervisor
decides when (`Supervisor.check_disk`).
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import os
import stat
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# The defaults an operator changes with the agent's `--engine-cache-gb`, `--engine-cache-days`, `--engine-disk-gb`.
DEFAULT_ENGINE_CACHE_BYTES = 50 * 10**9
DEFAULT_ENGINE_CACHE_MAX_AGE_S = 14 * 24 * 3600.0
DEFAULT_ENGINE_MAX_BYTES = 20 * 10**9
# Files and folders one engine's folders may hold (the walk that measures them stops here): a torch and Triton cache
# of a large model holds tens of thousands; a million empty files would exhaust the disk's inodes, not its bytes.
DEFAULT_ENGINE_MAX_FILES = 200_000

USED_DIR = ".used"  # in the caches folder: one empty file per cache folder, its mtime the folder's last use
SET_ASIDE_PREFIX = ".removing-"  # a cache folder being deleted (renamed aside first)


@dataclass(slots=True, frozen=True)
class EngineDiskBounds:
    """How much engines may keep on the node's disk (None: no bound)."""

    # One live engine's scratch and cache folders together.
    engine_max_bytes: int | None = DEFAULT_ENGINE_MAX_BYTES
    engine_max_files: int = DEFAULT_ENGINE_MAX_FILES
    # Every endpoint's cache folder together, and how long ago an unused one may have been used last.
    cache_budget_bytes: int | None = DEFAULT_ENGINE_CACHE_BYTES
    cache_max_age_s: float | None = DEFAULT_ENGINE_CACHE_MAX_AGE_S
    check_interval_s: float = 30.0  # a live engine's folders measured at most this often
    sweep_interval_s: float = 300.0  # unused cache folders looked at at most this often
    # A file in /dev/shm that no process held at the sweeps of this long goes (`shared_memory.remove_orphans`).
    shared_memory_orphan_age_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("engine_max_bytes", "cache_budget_bytes", "cache_max_age_s", "shared_memory_orphan_age_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, not {value}")
        if self.engine_max_files < 1:
            raise ValueError(f"engine_max_files must be at least 1, not {self.engine_max_files}")


@dataclass(slots=True, frozen=True)
class DiskUsage:
    num_bytes: int
    num_files: int
    complete: bool  # False: the walk stopped at its bound, and there is more
    # a folder (or a file in one) its engine made unreadable to the agent, where the walk stopped: what it holds is
    # unknown ("" when none)
    unreadable: str = ""
    # False: its folders changed under every read of the walk (`measure`): what it counted is what its reads met
    settled: bool = True

    def over(self, max_bytes: int | None, max_files: int) -> str:
        """Why this usage is past the bounds ("" when it is not)."""
        if max_bytes is not None and self.num_bytes > max_bytes:
            return f"more than {max_bytes / 1e9:g} GB"
        if self.num_files > max_files:
            return f"more than {max_files:,} files and folders"
        return ""


# NOTE: an engine writes what it likes between two measures: one at 90% of its bound is measured again in a tenth of
# `check_interval_s`, never sooner than this (each measure walks its folders), so what it can write past its bound is
# what it writes in a few seconds, not in half a minute.
MIN_CHECK_INTERVAL_S = 2.0


# An engine's folders are walked again no sooner than this many times its last walk took (up to `check_interval_s`).
WALKS_APART = 10


def next_check_in_s(usage: DiskUsage, bounds: EngineDiskBounds, *, walked_s: float = 0.0) -> float:
    """How long, from the end of the walk that measured `usage` (it took `walked_s`), until an engine's folders are
    measured again: `check_interval_s` times the share of its bounds (bytes or files, the nearer) it has left, at least
    `MIN_CHECK_INTERVAL_S` (or the interval itself when that is shorter), and at least `WALKS_APART` times its walk.

    NOTE: without the last, an engine holding 190,000 files (95 % of the bound, a walk of 1.1 s) was walked every 2 s:
    half of the disk thread's core, and the other engines' checks waited behind it (the review of the sooner checks)."""
    used = usage.num_files / bounds.engine_max_files
    if bounds.engine_max_bytes is not None:
        used = max(used, usage.num_bytes / bounds.engine_max_bytes)
    shortest = min(bounds.check_interval_s, MIN_CHECK_INTERVAL_S)
    sooner = max(shortest, bounds.check_interval_s * max(0.0, 1.0 - used))
    return max(sooner, min(bounds.check_interval_s, WALKS_APART * walked_s))


# How many times one measure reads its folders at most: once whole, then again those that changed while it read
# (`measure`), and what it had to read again the last time makes it unsettled.
MAX_PASSES = 3
# A folder whose change time is this close before its listing, or later, counts as changing: the kernel dates a
# folder's changes by a clock that may lag a tick (up to 10 ms), so a change in the tick of its listing could leave its
# times as they were. A folder is read again no sooner than this after the walk that found it changed, and one whose
# times were the same then and at that listing holds still since (whatever the clock of the file system that dated it:
# a network file system's server ahead of this node's clock made every folder look just changed).
SETTLE_MARGIN_NS = 20_000_000


def measure(folders, *, max_bytes: int | None = None, max_files: int = DEFAULT_ENGINE_MAX_FILES) -> DiskUsage:
    """The blocks `folders` hold on disk, and their files and folders, counted until past `max_bytes` or
    `max_files` (then `complete` is False), or until a folder or file the agent may not read (then `unreadable` names
    it, and `complete` is False); `settled` False when its folders kept changing under every read (`MAX_PASSES`).

    NOTE: no link is followed (a symbolic link counts as itself: one to `/` or to another tenant's weights counts a
    few bytes, not what it names), and a file with several names counts once, at the first of them met in `folders`,
    wherever its others are: before, only when all of them were inside, and a file with a name in each of two
    replicas' scratch folders and one in their endpoint's shared cache was counted by neither engine (the review of
    the weights: 20 MB counted 16 kB). A confined engine can only name there a file of folders it may write (Landlock's
    REFER, which its scratch and cache need for the compilers' renames, is on no other), so what it counts is its
    own; an engine left unconfined that links another's file there makes only itself fail.
    The walk holds no recursion, so no depth of folders stops it.

    NOTE: a walk lists one folder at a time, and an engine that watches its own folders (inotify: the agent's listing
    opens and closes each) moved a file into a folder already listed each time, and back before the next walk: 64 MB
    counted by none of 20 walks against a 32 MB bound (the review of the disk bound). No walk can be a snapshot of
    folders written meanwhile, so every folder's identity and change time are noted as it is listed and looked at
    again after the walk: one that changed (or was changed just before its listing) is read again, and what each read
    met counts, every file once across the reads (never only the last state). What still changed after `MAX_PASSES`
    reads is `settled` False: the supervisor takes folders never settled for long as a hiding engine
    (`Supervisor.check_disk`). A folder's change time is the kernel's (no process sets it), and a rename, link, unlink
    or new entry changes it in both folders it touches.

    NOTE: a folder its engine made unreadable (Landlock leaves chmod to it) stops the walk as `unreadable`, which its
    replica fails for: before, the walk skipped it and reported its folders complete (20 MB counted 8 kB). Not made
    readable again here as `_enter_folder` does for a removal: the engine may take the permission away again between
    the chmod and the open, so a refused folder would still have to be taken as hidden; and a live engine's files are
    never changed by a measure."""
    walk = _Walk(max_bytes, max_files)
    pending = []
    for folder in folders:
        try:
            info = os.lstat(folder)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and walk.count(info):
            pending.append(os.fspath(folder))
    for num_pass in range(MAX_PASSES):
        if num_pass:
            time.sleep(SETTLE_MARGIN_NS / 1e9)  # a folder changed just before its listing is not read again at once
        stopped = walk.read(pending)
        if stopped is not None:
            return stopped
        pending = walk.changed()
        if pending is None:
            return walk.usage(settled=True)
    return walk.usage(settled=False)


@dataclass(slots=True)
class _Listed:
    """A folder as `_Walk` listed it last: where, its change times then, and whether they were older than its
    listing by `SETTLE_MARGIN_NS` at least (else a change in the tick of its listing might not show)."""

    path: str
    ctime_ns: int
    mtime_ns: int
    old: bool


class _Walk:
    """One `measure`'s reads of an engine's folders: what they met (every file once, across the reads), and each
    folder as listed last."""

    def __init__(self, max_bytes: int | None, max_files: int) -> None:
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.num_bytes = 0
        self.num_files = 0
        self.counted: set[int] = set()  # every file and folder met (device and inode, as one number)
        self.listed: dict[int, _Listed] = {}  # the folders whose last listing still holds
        self.names: dict[int, int] = {}  # each folder's most entries at any of its listings: its part of num_files
        # each folder found changed: its change times then, and when (monotonic, ns)
        self.stamps: dict[int, tuple[int, int, int]] = {}

    def count(self, info: os.stat_result) -> bool:
        """Count a file or folder met; False when it was met before."""
        key = info.st_dev << 64 | info.st_ino
        if key in self.counted:
            return False
        self.counted.add(key)
        self.num_bytes += info.st_blocks * 512
        return True

    def usage(self, *, complete: bool = True, unreadable: str = "", settled: bool = True) -> DiskUsage:
        return DiskUsage(self.num_bytes, self.num_files, complete, unreadable, settled)

    def past_bounds(self) -> bool:
        return (self.max_bytes is not None and self.num_bytes > self.max_bytes) or self.num_files > self.max_files

    def read(self, pending: list[str]) -> DiskUsage | None:
        """List the folders `pending` and every folder below them not listed yet (depth first); a usage when the walk
        stopped (its bound, or a folder it may not read), else None."""
        queued = set()
        while pending:
            path = pending.pop()
            listed_at_ns = time.time_ns()
            listed_at_monotonic_ns = time.monotonic_ns()
            try:
                before = os.lstat(path)
            except OSError:
                continue  # removed meanwhile (its folder above changed: read again if it was listed)
            if not stat.S_ISDIR(before.st_mode):
                continue
            folder = before.st_dev << 64 | before.st_ino
            num_names = 0
            known_names = self.names.get(folder, 0)
            try:
                with os.scandir(path) as entries:
                    for entry in entries:
                        try:
                            info = entry.stat(follow_symlinks=False)
                        except PermissionError:  # a folder it may list but not search (0o400)
                            return self.usage(complete=False, unreadable=entry.path)
                        except OSError:
                            continue  # removed meanwhile
                        num_names += 1
                        if num_names > known_names:  # a name more than this folder held at any listing before
                            self.num_files += 1
                        self.count(info)
                        key = info.st_dev << 64 | info.st_ino
                        if stat.S_ISDIR(info.st_mode) and key not in self.listed and key not in queued:
                            queued.add(key)
                            pending.append(entry.path)
                        if self.past_bounds():
                            return self.usage(complete=False)
            except PermissionError:
                return self.usage(complete=False, unreadable=path)
            except OSError:
                continue  # a folder removed meanwhile
            self.names[folder] = max(num_names, known_names)
            times = (before.st_ctime_ns, before.st_mtime_ns)
            stamp = self.stamps.get(folder)
            old = before.st_ctime_ns < listed_at_ns - SETTLE_MARGIN_NS or (
                stamp is not None and stamp[:2] == times and listed_at_monotonic_ns - stamp[2] >= SETTLE_MARGIN_NS)
            self.listed[folder] = _Listed(path, *times, old)
        return None

    def changed(self) -> list[str] | None:
        """The folders to read again: those changed since their listing (or just before it), which are forgotten as
        listed; None when none changed. One moved or replaced is found again through the folders it left and went
        to, which changed too."""
        again = []
        moved = False
        for folder, listed in list(self.listed.items()):
            try:
                now = os.lstat(listed.path)
            except OSError:
                now = None
            same = now is not None and (now.st_dev << 64 | now.st_ino) == folder
            if (same and now.st_ctime_ns == listed.ctime_ns and now.st_mtime_ns == listed.mtime_ns
                    and listed.old):
                continue
            del self.listed[folder]
            if same:
                self.stamps[folder] = (now.st_ctime_ns, now.st_mtime_ns, time.monotonic_ns())
                again.append(listed.path)
            else:
                moved = True
        return again if again or moved else None


def devices_of(folders) -> frozenset[int]:
    """The devices (file systems) `folders` are on: where what an engine holds with no name left is counted
    (`shared_memory.held_by`'s `disk_devices`)."""
    found = set()
    for folder in folders:
        try:
            found.add(os.lstat(folder).st_dev)
        except OSError:
            continue
    return frozenset(found)


def set_aside(folder: Path) -> Path | None:
    """Rename `folder` (never what a link there names) aside in its parent, to be deleted with `remove_tree`;
    None when there is nothing to rename. NOTE: called under the lock every launch takes, so that no engine starts
    with a folder being deleted: the next launch makes a new one."""
    aside = folder.with_name(f"{SET_ASIDE_PREFIX}{folder.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return None
    return aside


# How many times, in one removal, a folder written to while it was emptied is emptied again before it is left: one
# budget for the whole walk (before, each folder had its own, renewed at each entry: exponential in the depth).
RESCANS = 16
# Running out of descriptors (the agent's, or the machine's) stops a removal: never taken as "not a folder".
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


class _WalkStopped(Exception):
    """The removal cannot go on (out of descriptors, or a folder moved out of the tree): the rest is left, reported."""


class _WalkCapped(_WalkStopped):
    """The walk came to its `max_entries`: the rest is left for the next walk."""


def remove_tree(path: Path | None, *, max_entries: int | None = None, slice_only: bool = False) -> bool | None:
    """Remove a folder an engine wrote (or a link there, never what it names), however the engine left it; True when
    nothing is left (or there was nothing), False when the rest was left (logged): `Removals` tries it again later.
    With `max_entries`, the walk stops after that many entries (files, links and folders it came to): a process still
    writing in the tree (a level below each one the walk enters) kept it going as long as it wrote. With `slice_only`
    (the urgent removals' turns), a walk that came to `max_entries` returns None, unlogged: the rest is for its next turn.

    NOTE: Landlock leaves chmod to an engine: one that took the permissions off folders inside its own made a plain
    `rmtree` leave them, and their bytes, behind, so each folder is made the agent's (0o700) before it is emptied. That
    is done on the folder opened (`_enter_folder`), never by its name: an engine's leftover child, or a tenant's model
    code, still writing in the tree can swap a folder for a link at any moment, and a chmod by name followed it. Before,
    between the walk's `lstat` and its `chmod`, a folder replaced by a link to one outside the tree made that folder
    0o700 (`tests/agent/test_engine_disk.py`). Every step is relative to an open folder (`dir_fd`), the top path's
    included; a link anywhere is removed as a name, never followed.

    NOTE: the walk holds a few descriptors whatever the depth: it goes down by name and back up through `..`, checked
    to be the very folder it came from (device and inode). Before, it held one a level: past the agent's
    RLIMIT_NOFILE an engine's deep tree made `EMFILE` read as "not a folder", each level rescanned, and the walk
    never ended, under the supervisor's lock: the whole agent froze. `EMFILE`/`ENFILE`, or a folder moved out from
    under the walk, now stop it, the rest left and logged."""
    outcome = _remove(path, max_entries=max_entries, slice_only=slice_only)
    return None if slice_only and outcome == _CAPPED else outcome == _DONE


# What one walk of `_remove` did: removed all, came to its `max_entries` (a slice), or left the rest (logged).
_DONE, _CAPPED, _LEFT = "done", "capped", "left"


def _remove(path: Path | None, *, max_entries: int | None, slice_only: bool = False) -> str:
    """`remove_tree`'s walk, saying whether a walk that left something came to its cap (`_CAPPED`: logged only
    unless `slice_only`, a walk meant to stop there) or was stopped or written to all along (`_LEFT`)."""
    if path is None:
        return _DONE
    path = Path(path)
    try:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return _DONE
    except OSError as error:
        logger.warning("could not remove %s: %s", path, error)
        return _LEFT
    try:
        if _remove_entry(parent, path.name, max_entries=max_entries):
            return _DONE
        logger.warning("removing %s left folders written to all along", path)
    except _WalkCapped as capped:
        if not slice_only:
            logger.warning("removing %s stopped, the rest left: %s", path, capped)
        return _CAPPED
    except _WalkStopped as stopped:
        logger.warning("removing %s stopped, the rest left: %s", path, stopped)
    finally:
        os.close(parent)
    return _LEFT


# A removal that left something is tried again this long after, the wait doubled at each failure up to the most.
REMOVAL_RETRY_S = 1.0
MAX_REMOVAL_RETRY_S = 60.0
# The urgent thread walks a folder this many entries at a turn (about 1 s of walking), the rest queued again behind
# the other urgent folders (`Removals`).
URGENT_SLICE_ENTRIES = 10_000


class _Lane:
    """One thread's queue of `Removals` (under its condition)."""

    __slots__ = ("pending", "busy", "thread", "name", "walked")

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending: dict[Path, tuple[float, float]] = {}  # path -> (when it is due, the wait after its next try)
        self.walked: dict[Path, int] = {}  # urgent: entries walked in a folder's slices since its last wait
        self.busy: Path | None = None
        self.thread: threading.Thread | None = None


class Removals:
    """Folders set aside (`set_aside`, `sandbox.set_scratch_aside`), removed one after another on a thread of its own,
    each walk bounded (`remove_tree`'s `max_entries`); one left (a walk stopped, capped, or written to all along) is
    tried again `REMOVAL_RETRY_S` later, then twice as late each time up to `MAX_REMOVAL_RETRY_S`. Those added
    `urgent` (the folders of an engine stopped past its disk bound) have a thread of their own, never behind the
    routine walks, and take turns on it: each turn walks one folder at most `URGENT_SLICE_ENTRIES` entries, and a
    folder with more left goes to the back of the urgent queue at once (no wait) until it has been walked
    `max_entries` in all (then it waits like any folder left). A folder added is walked before those queued again,
    so an urgent folder waits for at most one turn of each urgent folder before it: a folder of a few large files
    (an engine stopped for its bytes) goes in its first turn, however many trees of many files were queued before.

    NOTE: before, the supervisor removed them on its monitor's thread: an engine's tree of 199k nested folders took
    23 s, and every tenant's launches, health checks and drains waited behind it; a walk stopped by a folder moved
    under it was never tried again (`tests/agent/test_engine_disk.py`). Then with one thread for all: an engine
    stopped for filling the disk kept its bytes there until every removal queued before it was done (each walk up to
    2 x `engine_max_files` entries, 23-46 s), and a tenant whose replicas crashed with such trees kept that queue
    long (the review of fix-fleet7). Then with the urgent folders walked whole, one after another: a tenant getting
    its engines stopped on purpose queued trees of up to 2 x 200k entries each, and another tenant's engine stopped
    for 20 GB of bytes waited behind all of them (the review of fix-fleet8)."""

    def __init__(self, *, max_entries: int | None = None) -> None:
        self.max_entries = max_entries
        self._changed = threading.Condition()
        self._lanes = {False: _Lane("folder-removals"), True: _Lane("folder-removals-urgent")}
        self._left: list[Path] = []  # failed after `close`: left for the next agent's sweep (`Supervisor.recover`)
        self._closing = False

    def add(self, *paths: Path | None, urgent: bool = False) -> None:
        """Remove these soon (None: nothing); `urgent`: on the thread that removes nothing else. A folder already being
        removed is left to that walk (tried again if it fails); one waiting in the other lane moves to the urgent one."""
        lane, other = self._lanes[urgent], self._lanes[not urgent]
        with self._changed:
            for path in map(Path, filter(None, paths)):
                if path in (lane.busy, other.busy) or (not urgent and path in other.pending):
                    continue  # NOTE: never two walks of one tree at once
                lane.pending.setdefault(path, other.pending.pop(path, (-math.inf, REMOVAL_RETRY_S)))
            if lane.pending and lane.thread is None:
                lane.thread = threading.Thread(target=self._run, args=(lane,), name=lane.name, daemon=True)
                lane.thread.start()
            self._changed.notify_all()

    def pending(self) -> list[Path]:
        """What is still to remove (being removed included)."""
        with self._changed:
            lanes = self._lanes.values()
            return [*filter(None, [lane.busy for lane in lanes]), *(path for lane in lanes for path in lane.pending),
                    *self._left]  # fmt: skip

    def close(self, timeout_s: float) -> list[Path]:
        """Try each folder still to remove once more, waiting at most `timeout_s`; what is left (logged)."""
        with self._changed:
            self._closing = True
            threads = [lane.thread for lane in self._lanes.values() if lane.thread is not None]
            self._changed.notify_all()
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        left = self.pending()
        if left:
            logger.warning("%d folder(s) left to remove (the next agent's start removes them): %s", len(left),
                           ", ".join(map(str, left)))
        return left

    def _next(self, lane: _Lane) -> Path | None:
        """The lane's next folder due (under `_changed`), waiting for one; None once closing and none is left."""
        while True:
            now = time.monotonic()
            due = [path for path, (at, _wait) in lane.pending.items() if self._closing or at <= now]
            if due:
                return min(due, key=lambda path: lane.pending[path][0])
            if self._closing or not lane.pending:
                lane.thread = None
                return None
            self._changed.wait(min(at for at, _wait in lane.pending.values()) - now)

    def _run(self, lane: _Lane) -> None:
        while True:
            with self._changed:
                path = self._next(lane)
                if path is None:
                    return
                _at, wait = lane.pending.pop(path)
                lane.busy = path
                urgent = lane is self._lanes[True]
                walk = self.max_entries
                if urgent and not self._closing:
                    walk = min(walk or URGENT_SLICE_ENTRIES, URGENT_SLICE_ENTRIES)
            try:
                done = remove_tree(path, max_entries=walk, slice_only=walk != self.max_entries)
            except Exception:
                logger.exception("removing %s failed", path)
                done = False
            with self._changed:
                lane.busy = None
                walked = lane.walked.pop(path, 0) + (walk or 0)
                if done:
                    pass
                elif done is None and self._closing:
                    # NOTE: a slice cut short by its cap as the agent stops: tried once more whole, as every folder
                    # waiting is at close. Before, it was left for the next agent, whose start queued it behind every
                    # routine removal (the review of these turns).
                    lane.pending.setdefault(path, (-math.inf, wait))
                elif self._closing:
                    self._left.append(path)
                elif done is None and (self.max_entries is None or walked < self.max_entries):
                    # NOTE: its next slice behind the other urgent folders, at once (`URGENT_SLICE_ENTRIES`)
                    lane.pending.setdefault(path, (time.monotonic(), wait))
                    lane.walked[path] = walked
                else:
                    lane.pending.setdefault(path, (time.monotonic() + wait, min(wait * 2, MAX_REMOVAL_RETRY_S)))
                self._changed.notify_all()


def _enter_folder(dir_fd: int, name: str) -> int | None:
    """The folder `name` in `dir_fd` opened for listing, made 0o700 first; None when `name` is not a folder (a link to
    one included: never followed) or is gone. The mode is set through an `O_PATH` descriptor of the folder itself
    (`/proc/self/fd`, what glibc's `fchmodat(AT_SYMLINK_NOFOLLOW)` does): a folder the engine made 0o000 cannot be
    opened for reading before, and whatever its name names by then is never what is changed. Raises `_WalkStopped`
    when out of descriptors."""
    try:
        handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as error:
        _stop_if_out_of_descriptors(error)
        return None  # a link (ELOOP, ENOTDIR), a file, or gone
    try:
        try:
            os.chmod(f"/proc/self/fd/{handle}", 0o700)
        except OSError:
            pass  # no /proc: a folder the agent can read is still emptied
        try:
            return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=handle)
        except OSError as error:
            _stop_if_out_of_descriptors(error)
            return None
    finally:
        os.close(handle)


def _stop_if_out_of_descriptors(error: OSError) -> None:
    if error.errno in _OUT_OF_DESCRIPTORS:
        raise _WalkStopped(f"out of file descriptors ({error.strerror})") from error


def _identity(folder: int) -> tuple[int, int]:
    found = os.fstat(folder)
    return found.st_dev, found.st_ino


def _remove_entry(dir_fd: int, name: str, *, max_entries: int | None = None) -> bool:
    """Remove `name` in `dir_fd`: a file or link unlinked, a folder emptied depth first and removed (no recursion, so
    no depth of folders stops it, and one open folder at a time: `remove_tree`). False when a folder written to
    meanwhile was left once the walk's rescans were spent; raises `_WalkStopped`, also past `max_entries` entries: the
    folder it is in then is moved up, into the top folder (`_cut`), so that the next walk removes what this one went
    down through (a chain deeper than `max_entries` is removed in several walks, never walked again whole)."""
    rescans = RESCANS
    entries_left = max_entries
    top = None  # the folder being removed, open (once entered): where a walk cut short moves the rest
    complete = True
    try:
        current = os.dup(dir_fd)
    except OSError as error:
        _stop_if_out_of_descriptors(error)
        raise
    # Each level: [its name in the level above, its (device, inode), the names in it still to remove]; the first is
    # `dir_fd`'s own, never removed.
    stack = [["", _identity(current), iter([name])]]
    try:
        while stack:
            level = stack[-1]
            for child in level[2]:
                if entries_left is not None:
                    if entries_left <= 0:
                        _cut(current, stack, top)
                        raise _WalkCapped(f"more than {max_entries} entries in one walk")
                    entries_left -= 1
                entered = _enter_folder(current, child)
                if entered is not None:
                    os.close(current)
                    current = entered
                    stack.append([child, _identity(current), _names_in(current)])
                    if len(stack) == 2 and max_entries is not None:
                        # NOTE: entered again at each rescan of the top folder (written to meanwhile): the last one
                        # closed first. Before, each rescan leaked a descriptor (16 a walk, for the agent's life).
                        if top is not None:
                            os.close(top)
                            top = None
                        top = os.dup(current)
                    break
                _unlink(current, child)
            else:
                stack.pop()
                if not stack:
                    return complete
                up = _open_parent(current, stack[-1][1])
                os.close(current)
                current = up
                try:
                    os.rmdir(level[0], dir_fd=current)
                except NotADirectoryError:  # swapped for a link since it was entered: the link goes, as a name
                    _unlink(current, level[0])
                except OSError as exc:
                    if exc.errno == errno.ENOTEMPTY and rescans > 0:  # written to meanwhile: emptied again
                        rescans -= 1
                        stack[-1][2] = itertools.chain([level[0]], stack[-1][2])
                    elif exc.errno != errno.ENOENT:
                        complete = False
        return complete
    finally:
        os.close(current)
        if top is not None:
            os.close(top)


def _cut(current: int, stack: list, top: int | None) -> None:
    """Move the folder the walk is in (`current`, the last of `stack`) up into `top` under a name of its own, when it
    is at least two levels below it; never raises."""
    if top is None or len(stack) < 4:
        return
    try:
        up = _open_parent(current, stack[-2][1])
    except (_WalkStopped, OSError):
        return
    try:
        os.rename(stack[-1][0], f"{SET_ASIDE_PREFIX}cut-{uuid.uuid4().hex[:8]}", src_dir_fd=up, dst_dir_fd=top)
    except OSError:
        pass
    finally:
        os.close(up)


def _open_parent(folder: int, expected: tuple[int, int]) -> int:
    """The folder above `folder`, through `..`: the one the walk came down from, or `_WalkStopped`."""
    try:
        up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    except OSError as error:
        _stop_if_out_of_descriptors(error)
        raise _WalkStopped(f"its folder above could not be opened ({error.strerror})") from error
    if _identity(up) != expected:  # moved out from under the walk: never emptied where it went
        os.close(up)
        raise _WalkStopped("a folder was moved out of the tree while it was removed")
    return up


def _names_in(folder: int):
    try:
        with os.scandir(folder) as entries:
            return iter([entry.name for entry in entries])
    except OSError as error:
        _stop_if_out_of_descriptors(error)
        return iter(())


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


@dataclass(slots=True, frozen=True)
class CacheFolder:
    name: str
    path: Path
    last_used_at: float  # wall clock
    usage: DiskUsage


class CacheFolders:
    """The endpoints' cache folders under `root` (`<data dir>/engine-caches`) and when each was last used.

    NOTE: a folder's last use is the agent's record (`<root>/.used/<name>`, which no engine may write), not the
    folder's own times: an engine sets those at will, and one dated years ahead was never pruned for its age."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def folder(self, name: str) -> Path:
        return self.root / name

    def touch(self, name: str) -> None:
        """Record a use of the folder `name` now (a launch, and every sweep while a replica of its endpoint lives)."""
        used = self.root / USED_DIR
        used.mkdir(parents=True, exist_ok=True)
        (used / name).touch()

    def listing(self, *, max_bytes: int | None, max_files: int) -> list[CacheFolder]:
        """Every cache folder, measured (each up to the bounds given), least recently used first."""
        found = []
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path = Path(entry.path)
            record = self.root / USED_DIR / entry.name
            try:
                last_used_at = os.stat(record).st_mtime
            except OSError:
                try:  # a folder made before the record was kept: its own time (never ahead of now), once
                    last_used_at = min(entry.stat(follow_symlinks=False).st_mtime, time.time())
                    self.touch(entry.name)
                    os.utime(record, (last_used_at, last_used_at))
                except OSError:
                    continue
            found.append(CacheFolder(entry.name, path, last_used_at,
                                     measure([path], max_bytes=max_bytes, max_files=max_files)))  # fmt: skip
        return sorted(found, key=lambda folder: folder.last_used_at)

    def names(self) -> list[str]:
        """Every cache folder's name (those set aside left out)."""
        try:
            return sorted(entry.name for entry in os.scandir(self.root) if not entry.name.startswith("."))
        except OSError:
            return []

    def forget(self, name: str) -> None:
        (self.root / USED_DIR / name).unlink(missing_ok=True)

    def leftovers(self, *, keep: set[str]) -> list[Path]:
        """Folders set aside and never deleted (an agent killed mid-way), and the records of folders that are gone
        but for those in `keep`."""
        found = list(self.root.glob(SET_ASIDE_PREFIX + "*"))
        found += [path for path in (self.root / USED_DIR).glob("*")
                  if path.name not in keep and not (self.root / path.name).exists()]  # fmt: skip
        return found


def to_prune(
    folders: list[CacheFolder], in_use: set[str], bounds: EngineDiskBounds, now: float
) -> list[CacheFolder]:
    """Which cache folders go: of those no replica uses (`in_use`: names), any whose walk stopped at its bound (or at
    a folder it could not read: `DiskUsage.unreadable`), any last used more than `cache_max_age_s` ago, then the
    least recently used while all of them together are past `cache_budget_bytes`. `folders` is least recently used
    first."""
    chosen = []
    total = sum(folder.usage.num_bytes for folder in folders)
    for folder in folders:
        if folder.name in in_use:
            continue
        too_old = bounds.cache_max_age_s is not None and now - folder.last_used_at > bounds.cache_max_age_s
        over_budget = bounds.cache_budget_bytes is not None and total > bounds.cache_budget_bytes
        if not folder.usage.complete or too_old or over_budget:
            chosen.append(folder)
            total -= folder.usage.num_bytes
    return chosen
