"""Agent processes the `local` node-pool provider started on this machine: their state files and
stopping them.

Standard library only, and in the shared layer, so `python -m controlplane.embedded down`
(`make stop`) stops them as it stops the embedded servers, and nothing keeps running after it;
`endpoints.fleet.providers.local` starts them and writes the files.

One JSON file per launch, `<dir>/<launch_id>.json`: the pid, the process group, the process's
start time, its engine port range, node name and the fleet that launched it.

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
    fleet_id: str = ""  # the launching control plane's `INFERPLANE_FLEET_ID` ("": recorded before it was kept)
    installation_id: str = ""  # its `FleetInstallation` id ("": recorded before it was kept)

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


def processes_in(folder: Path) -> list[int]:
    """Processes whose working directory is `folder` or below: the agent and everything it started
    (engines run in sessions of their own, but inherit the agent's working directory)."""
    prefix, pids = f"{folder}/", []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                cwd = os.readlink(entry / "cwd")
                if cwd == str(folder) or cwd.startswith(prefix):
                    pids.append(int(entry.name))
    return pids


def stop_agent(agent: LocalAgent, directory: Path, *, wait_s: float = STOP_WAIT_S) -> None:
    """SIGTERM the agent's process group (it stops its engines itself), wait up to `wait_s`, then
    SIGKILL what is left: the group, and every process still working in the launch's folder.

    NOTE: the group is signalled only while the recorded process is still the one launched; the
    folder's processes are this launch's whatever became of the agent (an engine orphaned by a
    crashed agent included).
    """
    folder = directory / agent.launch_id
    if is_alive(agent):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pgid, signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and (_group_exists(agent.pgid) or processes_in(folder)):
            time.sleep(0.05)
        if is_alive(agent) or _group_exists(agent.pgid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(agent.pgid, signal.SIGKILL)
    for pid in processes_in(folder):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


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
    agents = read_agents(directory)
    live = [agent for agent in agents if is_alive(agent)]
    for agent in live:  # all at once first: their drains overlap instead of queueing
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pgid, signal.SIGTERM)
    for agent in agents:
        stop_agent(agent, directory, wait_s=wait_s)
    return len(live)
