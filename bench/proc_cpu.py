"""CPU time from `/proc` for the benchmarks: a process's, a server's with its workers', the whole machine's.

No side effects at import (unlike `bench_gateway`, which starts the embedded servers): the profile and the probes
import it, and so can a test.
"""

from __future__ import annotations

import os
from pathlib import Path


def _stat_fields(pid: int) -> list[str]:
    """`/proc/<pid>/stat` after the command name (which may hold spaces): state, ppid, …"""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and its threads (and its reaped children)."""
    ticks = sum(int(value) for value in _stat_fields(pid)[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def user_system_s(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of `pid` and its threads, apart: Python's work against the kernel's (a socket write
    to a process on the same machine wakes it from inside the writer's system call)."""
    fields = _stat_fields(pid)
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def preemptions(pid: int) -> int:
    """How often `pid`'s main thread (a gateway's event loop) was taken off its core while it could run on
    (`nonvoluntary_ctxt_switches`): another process woken, often by this one's own writes, ran first."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            return int(line.split()[1])
    return 0


def tree_cpu_s(pid: int | None) -> float:
    """CPU seconds of `pid` (with its reaped children: `cpu_s`) and of its live children: a server and its workers
    (PostgreSQL's postmaster and backends, Redis and a rewrite it forked), 0 for None.

    NOTE: by process tree, not by command name: other engineers' test suites run their own `postgres` and
    `redis-server` on the same machine, and a count by name added their work to the bench's; a backend that exited
    mid-run left the count, which could then fall (bench/results/gateway_profile.md, round 18)."""
    if pid is None:
        return 0.0
    total = cpu_s(pid)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile: its parent has reaped it, or will, into its own figure
            continue
        if int(fields[1]) == pid:
            total += sum(int(value) for value in fields[11:13]) / os.sysconf("SC_CLK_TCK")
    return total


def server_pids(data_dir: Path) -> tuple[int | None, int | None]:
    """The pids of a data folder's embedded Redis and PostgreSQL (its postmaster), None for one not running there
    (`controlplane.embedded`'s layout)."""
    pids = []
    for pid_file in (data_dir / "redis" / "redis.pid", data_dir / "postgres" / "postmaster.pid"):
        try:
            pids.append(int(pid_file.read_text().split()[0]))
        except (FileNotFoundError, IndexError, ValueError):
            pids.append(None)
    return pids[0], pids[1]


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all cores: /proc/stat less idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
