"""Child processes for tests and benchmarks: start in their own group, stop with the whole group.

Plain standard library, so benchmarks (which run outside pytest) share it with the test suite.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ChildProcess:
    """A child process in its own group, stopped with its whole group."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(args, env=env, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_text()[-num_chars:]

    def kill(self, sig=signal.SIGKILL) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout_s: float = 10) -> None:
        """SIGTERM to the group, SIGKILL after `timeout_s` (0: at once, for a child whose shutdown nothing reads)."""
        if self.process.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.process.wait(5)
        self._log.close()


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1, message: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {message}")
