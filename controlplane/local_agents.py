"""Agent processes the `local` node-pool provider started on this machine: their state files and
stopping them.

Standard library only, and in the shared layer, so `python -m controlplane.embedded down`
(`make stop`) stops them as it stops the embedded servers, and nothing keeps running after it;
`endpoints.fleet.providers.local` starts them and writes the files.

One JSON file per launch, `<dir>/<launch_id>.json`: the pid, the process group, the process's
start time, its engine port range and node name.

NOTE: a pid alone can name another process once the agent has died and the number was reused; a
record is live only while its pid's start time (from /proc) is still the one recorded at launch, so
a stranger's process is never signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STOP_WAIT_S = 10.0


@dataclass(slots=True, frozen=True)
class LocalAgent:
    launch_id: str
    pool_id: int
    name: str
    pid: int
    pgid: int
    started: str  # the process's start time in clock ticks since boot (/proc/<pid>/stat field 22)
    engine_port_min: int
    engine_port_max: int

    @classmethod
    def load(cls, path: Path) -> LocalAgent | None:
        with contextlib.suppress(OSError, ValueError, TypeError):
            return cls(**json.loads(path.read_text()))
        return None

    def save(self, directory: Path) -> None:
        path = directory / f"{self.launch_id}.json"
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(asdict(self)))
        partial.replace(path)  # a reader never sees half a record


def process_start_time(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot), or None when there is no such
    process or it is a zombie (exited, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields after it follow the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def is_alive(agent: LocalAgent) -> bool:
    return process_start_time(agent.pid) == agent.started


def state_path(directory: Path, launch_id: str) -> Path:
    return directory / f"{launch_id}.json"


def read_agents(directory: Path) -> list[LocalAgent]:
    """Every recorded agent of `directory`, live or not."""
    if not directory.is_dir():
        return []
    agents = (LocalAgent.load(path) for path in sorted(directory.glob("*.json")))
    return [agent for agent in agents if agent is not None]


def stop_agent(agent: LocalAgent, *, wait_s: float = STOP_WAIT_S) -> None:
    """SIGTERM the agent's process group (its engines with it), wait up to `wait_s`, then SIGKILL.

    Nothing is signalled unless the recorded process is still the one launched.
    """
    if not is_alive(agent):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(agent.pgid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not is_alive(agent) and not _group_exists(agent.pgid):
            return
        time.sleep(0.05)
    if is_alive(agent) or _group_exists(agent.pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pgid, signal.SIGKILL)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_all(directory: Path, *, wait_s: float = STOP_WAIT_S) -> int:
    """Stop every live recorded agent of `directory` (`make stop`); returns how many were live.
    Their records stay, so the pool's next look sees them gone."""
    live = [agent for agent in read_agents(directory) if is_alive(agent)]
    for agent in live:
        stop_agent(agent, wait_s=wait_s)
    return len(live)
