"""Engine processes: spawn one in its own process group, signal it, find it again by its marker.

Every engine carries two environment markers (`engine.REPLICA_ENV_MARKER`,
`engine.DATA_DIR_ENV_MARKER`), so an agent finds its engines (and strays they left) by
environment, never by name, and a reused pid is never mistaken for an engine. Every engine runs under
the reaper (`reaper.py`), which takes it down with the agent, so a killed agent leaves no orphans.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

import psutil

from gpu_agent.runtime import shared_memory
from gpu_agent.runtime.engine import DATA_DIR_ENV_MARKER, REPLICA_ENV_MARKER
from gpu_agent.runtime.reaper import OUTLIVES_AGENT_ENV, REAPER_MODULE, group_members, runs_under_reaper

logger = logging.getLogger(__name__)


def spawn(argv: list[str], env: dict[str, str], log: BinaryIO, *, die_with_agent: bool) -> subprocess.Popen:
    """Start an engine in its own process group, its output appended to `log`.

    Every command runs under the reaper (`engine.build_engine_command` puts each engine there; any other command is
    put there here), which dies with the agent, or not, as it is told (`reaper.OUTLIVES_AGENT_ENV`).
    NOTE: the child runs no Python between fork and exec (no `preexec_fn`): in a threaded agent CPython would first
    clear the other threads' state in the child, running their objects' finalisers (an httpx client's SSL context
    freed under an OpenSSL lock another thread held at the fork: a child that never reached exec)."""
    if not runs_under_reaper(argv):
        argv = [sys.executable, "-m", REAPER_MODULE, "--", *argv]
    if not die_with_agent:
        env = {**env, OUTLIVES_AGENT_ENV: "1"}
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # own process group: we signal the engine and its workers together
        close_fds=True,
    )


def exit_code(process: subprocess.Popen | None, pid: int) -> int | None:
    """The engine's exit code, None while it runs; an adopted engine (not our child) exits with -1."""
    if process is not None:
        return process.poll()
    try:  # adopted: not our child, so no exit code, only liveness
        found = psutil.Process(pid)
        if found.status() == psutil.STATUS_ZOMBIE:
            return -1
        return None
    except psutil.NoSuchProcess:
        return -1


def kill_group(
    pid: int | None, process: subprocess.Popen | None, replica_id: str, data_dir: Path, sig: signal.Signals
) -> None:
    """Signal the engine's process group and, on SIGKILL, any stray process carrying its marker.

    On SIGKILL the engine's shared-memory segments go too (`shared_memory`: only a graceful exit unlinks them).
    """
    segments = set()
    if sig == signal.SIGKILL:
        members = group_members(pid) if pid is not None else []
        segments = shared_memory.segments_of(
            [*members, *(found.pid for found in replica_processes(replica_id, data_dir))]
        )
    if pid is not None:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    if sig == signal.SIGKILL:
        for stray in replica_processes(replica_id, data_dir):
            try:
                stray.kill()
            except psutil.Error:
                pass
        if process is not None and process.poll() is None:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    shared_memory.unlink(segments)


def kill_orphans(data_dir: Path, owned: set[int]) -> None:
    """Kill whatever carries this data dir's marker but is not (in the group of) a pid in `owned`."""
    for found in replica_processes(None, data_dir):
        try:
            if found.pid in owned or os.getpgid(found.pid) in owned:
                continue
            logger.warning("killing orphan engine process %s", found.pid)
            found.kill()
        except (psutil.Error, ProcessLookupError):
            pass


def replica_processes(replica_id: str | None, data_dir: str | Path) -> list[psutil.Process]:
    """Live processes started for this data dir (and this replica, if given), found by environment marker."""
    data_dir = str(data_dir)
    found = []
    for process in psutil.process_iter(["pid"]):
        if process.pid == os.getpid():
            continue
        try:
            environ = process.environ()
        except (psutil.Error, OSError):
            continue
        if environ.get(DATA_DIR_ENV_MARKER) != data_dir:
            continue
        if replica_id is not None and environ.get(REPLICA_ENV_MARKER) != replica_id:
            continue
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            continue
    return found


def cpu_seconds(replica_id: str, data_dir: str | Path) -> float | None:
    """The CPU time (user and system) the replica's live processes have used so far, summed; None where none of them
    could be read."""
    total, num_read = 0.0, 0
    for found in replica_processes(replica_id, data_dir):
        try:
            times = found.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
        num_read += 1
    return total if num_read else None


def is_replica_process(pid: int, replica_id: str) -> bool:
    """Guards against pid reuse: the pid must still carry the replica's marker."""
    try:
        process = psutil.Process(pid)
        return (
            process.status() != psutil.STATUS_ZOMBIE
            and process.environ().get(REPLICA_ENV_MARKER) == replica_id
        )
    except (psutil.Error, OSError):
        return False


# What one log of an engine, the standby or the zygote takes on the disk (`keep_log_within`), and how much of the end
# of a log `log_tail` looks at for a failure's last lines.
MAX_LOG_BYTES = 8 * 1024 * 1024
TAIL_BYTES = 64 * 1024


# NOTE: one lock, in this process, for every cut of a log and every read of its end. A read between a cut's truncate
# and its rename of `<name>.1` found nothing, or the previous cut's `.1` (a failure's reason empty, or 8 MiB old), and
# two cuts of one log at once (the standby's spawn and the disk thread, both cutting `standby.log`) wrote one
# `.1.partial` together, the newer end lost.
_log_lock = threading.Lock()


def log_tail(log_path: Path, num_lines: int) -> str:
    """The last lines an engine wrote, for a failure's reason (`log_end`)."""
    data = log_end(log_path, TAIL_BYTES)
    if data is None:
        return ""
    lines = data.decode(errors="replace").splitlines()
    return "\n".join(lines[-num_lines:])


def log_end(log_path: Path, num_bytes: int) -> bytes | None:
    """The last `num_bytes` written to a log: from the log, and from the end of the part kept aside (`<name>.1`)
    before it when the log was started afresh less than that ago; None when there is no log. Never read mid-cut."""
    with _log_lock:
        data = _last_bytes(log_path, num_bytes)
        if data is None:
            return None
        if len(data) < num_bytes:
            data = (_last_bytes(_kept_aside(log_path), num_bytes - len(data)) or b"") + data
    return data


def _last_bytes(path: Path, num_bytes: int) -> bytes | None:
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - num_bytes))
            return log.read(num_bytes)
    except OSError:
        return None


def _kept_aside(log_path: Path) -> Path:
    return log_path.with_name(f"{log_path.name}.1")


def being_kept_aside(log_path: Path) -> Path:
    """Where a cut writes a log's end before renaming it `<name>.1`; left behind by an agent killed mid-cut."""
    return log_path.with_name(f"{log_path.name}.1.partial")


def keep_log_within(log_path: Path, max_bytes: int = MAX_LOG_BYTES) -> None:
    """Start `log_path` afresh once it is past `max_bytes`, its last `max_bytes` (from a line's start) kept as
    `<name>.1` (the one before that goes). Called before a standby or zygote spawns, and every second for each live
    engine's log and theirs (`Supervisor.keep_logs_within`), under `_log_lock`.

    The log may be written meanwhile: every writer appends (O_APPEND: `spawn`'s log, the standby's and a handed-off
    engine's `os.open`), so the file is cut to nothing in place, never renamed, and the writer's next line lands at its
    new start. The writer writes to the file itself, never through a pipe the agent must drain, so it never waits on
    the agent; what it appends between the read of the end and the cut (microseconds) is lost.

    NOTE: the standby's log took a header and what each standby wrote while importing, one standby per cold
    start, and nothing ever removed or rotated it: it grew for as long as the node ran. A replica's log, written by
    its engine for as long as it ran (a chatty engine, a tenant's model printing at every request), grew until the
    replica ended."""
    with _log_lock:
        _cut(log_path, max_bytes)


def _cut(log_path: Path, max_bytes: int) -> None:
    try:
        if log_path.stat().st_size <= max_bytes:
            return
        with open(log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            start = max(0, log.tell() - max_bytes)
            log.seek(start)
            # NOTE: at most twice the bound: a writer as fast as this read never keeps it reading
            data = log.read(2 * max_bytes)[-max_bytes:]
            os.truncate(log_path, 0)  # at once after the read: what comes between is lost
    except OSError:  # none yet, or it cannot be read or cut: appended to as before
        return
    if start or len(data) == max_bytes:
        first_line_end = data.find(b"\n")
        data = data[first_line_end + 1 :] if 0 <= first_line_end < len(data) - 1 else data
    aside = being_kept_aside(log_path)
    try:
        aside.write_bytes(data)
        os.replace(aside, _kept_aside(log_path))
    except OSError:  # a full disk: the log was cut all the same, which is what frees it
        aside.unlink(missing_ok=True)


def timestamp() -> str:
    """The wall-clock time written before each launch in an engine's log."""
    return time.strftime("%Y-%m-%d %H:%M:%S")
