"""An engine's command starts with no Python of the agent's run between fork and exec, and still dies with the agent.

The agent is threaded (heartbeat, supervisor probes, weight pulls). A child that runs Python before exec
(`preexec_fn`) first has CPython clear every other thread's state, running their objects' finalisers: a
fresh clone's run hung 600 s in such a child, freeing an httpx client's SSL context under an OpenSSL lock
another thread held at the fork. So every command runs under the reaper (`reaper.py`), which arms the
death signal itself, after exec.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from gpu_agent.runtime import process

from .conftest import wait_until


class _Canary:
    """Held only by another thread's thread-local state: its finaliser runs where that state is cleared."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __del__(self):
        (self.folder / f"finalised-in-{os.getpid()}").write_text("")


@pytest.mark.parametrize("die_with_agent", [True, False])
def test_a_spawned_command_runs_none_of_the_agents_python_before_exec(tmp_path, die_with_agent):
    local, holding, done = threading.local(), threading.Event(), threading.Event()

    def hold():
        local.canary = _Canary(tmp_path)
        holding.set()
        done.wait(60)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert holding.wait(10)
    try:
        with open(tmp_path / "engine.log", "ab") as log:
            engine = process.spawn(
                ["/bin/true"], {"PATH": "/usr/bin:/bin"}, log, die_with_agent=die_with_agent
            )
        assert engine.wait(30) == 0
        assert sorted(found.name for found in tmp_path.glob("finalised-in-*")) == []
    finally:
        done.set()
        thread.join(10)


AGENT = """
import sys
from gpu_agent.runtime import process
engine = process.spawn(["sleep", "300"], {"PATH": "/usr/bin:/bin"}, open(sys.argv[1], "ab"), die_with_agent=sys.argv[2] == "1")
print(engine.pid, flush=True)
sys.stdin.read()
"""


def _sleeps_under(pid: int) -> list[psutil.Process]:
    engine = psutil.Process(pid)
    return [found for found in [engine, *engine.children(recursive=True)] if found.name() == "sleep"]


@pytest.mark.parametrize("die_with_agent", [True, False])
def test_a_command_dies_with_a_killed_agent_only_when_told_to(tmp_path, die_with_agent):
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(AGENT),
            str(tmp_path / "engine.log"),
            "1" if die_with_agent else "0",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    try:
        engine_pid = int(agent.stdout.readline())
        wait_until(lambda: _sleeps_under(engine_pid), timeout_s=30)
        (sleep,) = _sleeps_under(engine_pid)
        agent.kill()
        agent.wait(10)
        if die_with_agent:
            wait_until(lambda: not sleep.is_running() or sleep.status() == psutil.STATUS_ZOMBIE, timeout_s=30)
        else:
            time.sleep(1)
            assert sleep.is_running() and sleep.status() != psutil.STATUS_ZOMBIE
    finally:
        agent.kill()
        for leftover in (engine_pid,):
            try:
                os.killpg(leftover, signal.SIGKILL)
            except ProcessLookupError:
                pass
