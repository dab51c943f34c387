"""The zygote: one process per node that has imported vLLM once and forks a fresh engine per replica.

The warm standby (`standby.py`) is used up by its one replica and takes ~25 s to replace on
the tiny CPU model, so the second of two endpoints woken at once waited for a new one (34 s and
37.7 s against 3.1 s for one). The zygote is the same standby process, started with `--zygote`,
that never becomes an engine itself: each handoff line makes it fork a child, and the child does
what a standby did at its handoff (marker rewrite, log, the replica's environment, vLLM's
`run_server`). Any number of replicas starting at once then each pay only for weights and engine
set-up, and nothing needs refilling.

    agent (monitor thread)            reaper -> zygote (standby_process.serve_forks)
    ----------------------            ---------------------------------------------
    spawn, read "ready"        <----  imports done, CUDA untouched
    hand_off: one JSON line    ---->  fork(); the child: own process group, replica marker,
    read "started <id> <pid>"  <----  runs the engine (its EngineCore and worker fork from it on CPU)
    supervise <pid> (ForkedEngine)
    read "exited <pid> <code>" <----  waitpid() of a child that ended

Process lifetime (no orphans):
- each engine leads its own session and process group (`setsid`), so drain's SIGTERM and the final
  SIGKILL go to the engine and everything it started, and the kernel's autogroup scheduler gives it
  its own CPU share, as for a plain launch;
- the engines are descendants of the zygote's reaper, which is a child subreaper: when the agent dies
  (PR_SET_PDEATHSIG) or the zygote dies, the reaper kills every descendant, not just its own group;
  a zygote crash is therefore a crash of its engines, which the supervisor restarts;
- `stop()` (agent exit, detach) SIGKILLs the reaper's group only: the engines stay for the supervisor's
  own shutdown, or for the next agent to adopt after a detach.

CUDA: the zygote never initialises CUDA (same checks as the standby, `standby_process.py`), and checks
again before every fork; a child reads its replica's `CUDA_VISIBLE_DEVICES` when it first initialises
CUDA, after the fork. vLLM's EngineCore then starts by fork on CUDA too (it is chosen when CUDA is not
initialised) and its workers initialise CUDA themselves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import select
import subprocess
import time
from pathlib import Path

import psutil

from gpu_agent.runtime.engine import EngineCommand
from gpu_agent.runtime.standby import READY_LINE, REFUSED_PREFIX, Handoff, Standby, server_args

logger = logging.getLogger(__name__)

STARTED_WORD = "started"  # `started <replica_id> <pid>`: the zygote forked this replica's engine
EXITED_WORD = "exited"  # `exited <pid> <code>`: the zygote reaped one
ZYGOTE_REAP_INTERVAL_S = 0.5  # how often the zygote reaps children while waiting for handoffs
# A fork takes milliseconds, after at most one look-up the zygote loads ahead (`zygote_models.WARM_BUDGET_S`); a
# zygote this slow to answer is stopped. NOTE: the agent's supervisor waits holding its lock, which its heartbeat
# needs: a wait of 30 s (and 5 more to stop the zygote) outlasted the control plane's heartbeat grace.
FORK_REPLY_TIMEOUT_S = 15.0


def wait_readable(file, timeout_s: float) -> None:
    """Wait until `file` has something to read (or `timeout_s`). NOTE: `poll`, not `select`: the agent raises its
    open-files limit (`cli.raise_open_files_limit`), and `select` refuses a descriptor numbered 1024 or more."""
    poller = select.poll()
    poller.register(file, select.POLLIN)
    poller.poll(timeout_s * 1000)


class ForkedEngine:
    """A replica's engine forked by the zygote, shaped like the `Popen` the supervisor otherwise holds.

    It is not the agent's child: its exit code comes from the zygote (`exited` lines), and when the
    zygote is gone too, from the process table (-1 once it no longer runs).
    """

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        self._zygote.read_events()
        code = self._zygote.exit_codes.pop(self.pid, None)
        if code is None and not _running(self.pid):
            # NOTE: gone (or a zombie the zygote reaps within `ZYGOTE_REAP_INTERVAL_S`) before its `exited` line came:
            # that line, when it comes, is nobody's. Kept, a later engine forked under the same pid read it as its
            # own exit and was killed as crashed (`kill_group` polls a killed engine every 50 ms: the common case).
            self._zygote.read_events()
            code = self._zygote.exit_codes.pop(self.pid, None)
            if code is None:
                code = -1
                self._zygote.forget(self.pid)
        self.returncode = code
        return code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Zygote(Standby):
    """The node's fork server, driven by the supervisor's poll loop like the standby it extends.

    Unlike a standby it stays `ready` after a handoff: it is replaced only when it dies.
    """

    label = "zygote"
    process_args = ("--zygote",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log_path = self.data_dir / "logs" / "zygote.log"
        self.exit_codes: dict[int, int] = {}  # children reaped by the zygote and not yet asked about
        self.started: dict[str, int] = {}  # `started` lines read and not yet asked about: replica id -> pid
        self.sent_ahead: set[str] = set()  # replicas whose handoff line went out before their `hand_off`
        self.num_sent_ahead = 0
        self._unasked: set[int] = set()  # children nobody will ask about (`forget`): their exits are not kept

    def _spawn(self) -> None:
        super()._spawn()
        # NOTE: what a dead zygote said of its children is of no child of this one (pids wrap): its engines died with
        # it (the reaper), and their polls read -1 from the process table.
        self.exit_codes.clear()
        self.started.clear()
        self.sent_ahead.clear()
        self._unasked.clear()

    def forget(self, pid: int) -> None:
        """Keep no exit code for this child: nobody will ask about it (an engine forked for a replica whose launch
        then failed, killed at once by the supervisor; one `ForkedEngine.poll` found gone before its `exited` line).

        NOTE: kept, each such exit stayed in `exit_codes` for the zygote's life, and a later engine forked under the
        same pid (pids wrap) read it as its own exit: the supervisor killed that healthy engine as crashed."""
        self.read_events()
        if self.exit_codes.pop(pid, None) is None:
            self._unasked.add(pid)

    def ensure(self) -> None:
        super().ensure()
        if self.ready:
            self.read_events()

    def read_events(self) -> None:
        """Take the zygote's `exited` lines (and a refusal) from its status pipe, without blocking."""
        if self.process is None or not self.ready:
            return
        self._take_lines()

    def _take_lines(self) -> None:
        for line in self._read_lines():
            if line.startswith(EXITED_WORD + " "):
                _, pid, code = line.split()
                if int(pid) in self._unasked:
                    self._unasked.discard(int(pid))
                else:
                    self.exit_codes[int(pid)] = int(code)
            elif line.startswith(STARTED_WORD + " "):
                _, replica_id, pid = line.split()
                self.started[replica_id] = int(pid)

    def _read_lines(self) -> list[str]:
        try:
            chunk = self.process.stdout.read()
        except (OSError, ValueError):
            chunk = None
        if chunk:
            self._buffer += chunk
        lines = []
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            if line.startswith(REFUSED_PREFIX):
                self.refused_reason = line[len(REFUSED_PREFIX) :].decode(errors="replace").strip()
            elif line + b"\n" != READY_LINE:
                lines.append(line.decode(errors="replace"))
        return lines

    def _read_status(self) -> None:
        super()._read_status()
        if self.ready:  # what followed "ready" in the same read stays for read_events
            self._buffer = self._buffer.split(READY_LINE, 1)[1]

    def send_ahead(self, replica_id: str, command: EngineCommand, env: dict[str, str], log_path: Path) -> bool:
        """Send a replica's handoff line now, without waiting for its fork; its `hand_off` then only waits.

        The supervisor sends every replica due in one poll before it waits for the first fork: the zygote
        forks them back to back instead of one per round trip (~0.1 s each at load, 0.47 s for four).
        """
        args = server_args(command)
        if args is None or not self.can_take(command) or replica_id in self.sent_ahead:
            return False
        try:
            self._write(Handoff(replica_id=replica_id, args=args, env=env, log_path=str(log_path)))
        except (BrokenPipeError, OSError, ValueError) as exc:
            logger.warning("zygote: handoff to pid %s failed (%s)", self.process.pid, exc)
            self.stop()
            return False
        self.sent_ahead.add(replica_id)
        self.num_sent_ahead += 1
        return True

    def _write(self, message: Handoff) -> None:
        self.process.stdin.write(json.dumps(dataclasses.asdict(message)).encode() + b"\n")
        self.process.stdin.flush()

    def hand_off(self, replica_id: str, command: EngineCommand, env: dict[str, str], log_path: Path):
        """Fork this replica's engine (or wait for the fork `send_ahead` asked for); returns its `ForkedEngine`,
        or None to launch naively."""
        args = server_args(command)
        if args is None or not self.can_take(command):
            return None
        process = self.process
        try:
            if replica_id in self.sent_ahead:
                self.sent_ahead.discard(replica_id)
            else:
                self._write(Handoff(replica_id=replica_id, args=args, env=env, log_path=str(log_path)))
            pid = self._wait_for_start(replica_id)
        except (BrokenPipeError, OSError, ValueError) as exc:
            logger.warning("zygote: handoff to pid %s failed (%s)", process.pid, exc)
            pid = None
        if pid is None:
            self.stop()
            return None
        self.num_handoffs += 1
        logger.info("zygote: forked pid %s for replica %s", pid, replica_id)
        return ForkedEngine(pid, self)

    def _wait_for_start(self, replica_id: str) -> int | None:
        deadline = time.monotonic() + FORK_REPLY_TIMEOUT_S
        while time.monotonic() < deadline:
            self._take_lines()  # NOTE: the forks of replicas sent ahead come in the same reads
            if replica_id in self.started:
                return self.started.pop(replica_id)
            if self.refused_reason is not None or self.process.poll() is not None:
                return None
            wait_readable(self.process.stdout, 0.1)
        logger.warning("zygote: no fork reported for replica %s in %.0fs", replica_id, FORK_REPLY_TIMEOUT_S)
        return None
