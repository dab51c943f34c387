"""Warm standby: one engine process per node that has already imported vLLM and waits for a replica.

A naive `vllm serve` spends most of its start importing Python: about 19 s in the
API server process and 14 s again in the EngineCore child it spawns, out of ~40 s
for the tiny model on CPU. The standby pays the first part ahead of time:

    agent (monitor thread)          standby process
    ----------------------          -----------------------------------------------
    spawn `-m ...standby`  ------->  import vLLM's OpenAI server, AsyncLLM, EngineCore
    read "ready" on its stdout <---  "ready\\n"; block on stdin
    replica must start:
    write one JSON line    ------->  set the replica marker and env, send output to the
                                     replica's log, run vLLM's `run_server(args)` in
                                     process; on CPU the EngineCore and its worker are
                                     *forked* from already-imported processes, not spawned
    supervise it like any engine     (the standby process *is* the engine now)
    spawn the next standby once no engine is starting

NOTE: the replica marker (`engine.REPLICA_ENV_MARKER`) must be visible in
`/proc/<pid>/environ`, which shows the environment block the process was started
with, not `os.environ`. The standby is therefore started with a fixed-width
placeholder value that it overwrites in place at handoff; children forked from it
copy that block. If the rewrite is impossible the handoff is refused and the agent
launches the replica naively.

On CUDA the standby pre-imports but never initialises CUDA (no `torch.cuda` call
before the handoff), and the EngineCore start method is left to vLLM: fork while
CUDA is uninitialised, spawn otherwise. The standby checks it (`standby_process.py`):
one that finds CUDA initialised says why (`REFUSED_PREFIX` on its status pipe) and
exits, and this agent keeps no standby from then on (`refused_reason`): every replica
starts the plain way, with its own `CUDA_VISIBLE_DEVICES`. On CPU vLLM forces `spawn` only because
its CPU platform sets it unconditionally (and it forces the multiprocess executor,
so a replica is three processes: API server, EngineCore, worker); the standby
forks both children instead, from processes that have run no OpenMP region yet.

`zygote.py` extends this into a fork server that is never used up (parallel cold starts).

This module is the agent side (`Standby`, import-light) and the handoff it sends (`Handoff`); the
standby process itself (`main()`) is `standby_process.py`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_agent.runtime.engine import (
    DATA_DIR_ENV_MARKER,
    DEVICE_CPU,
    ENGINE_MODULE,
    REPLICA_ENV_MARKER,
    EngineCommand,
    cpu_openmp_env,
)
from gpu_agent.runtime.engine_environment import engine_environment
from gpu_agent.runtime.engine_main import SERVER_MODULE
from gpu_agent.runtime.process import MAX_LOG_BYTES, keep_log_within
from gpu_agent.runtime.reaper import REAPER_MODULE, runs_under_reaper

logger = logging.getLogger(__name__)

STANDBY_MODULE = "gpu_agent.runtime.standby_process"
# Reserved width of the replica marker in a standby's environment block.
MARKER_WIDTH = 128
STANDBY_MARKER_VALUE = "standby".ljust(MARKER_WIDTH, "_")
READY_LINE = b"ready\n"  # what the standby process writes on its stdout once warm
REFUSED_PREFIX = b"refused: "  # ... or, followed by the reason, when it may not become an engine
EXIT_CUDA_INITIALISED = 78  # its exit status then (EX_CONFIG): CUDA was initialised before the handoff


def server_args(command: EngineCommand) -> list[str] | None:
    """The arguments of `python -m vllm.entrypoints.openai.api_server ...` (or of `engine_main`, which runs it
    confined), or None for other commands.

    The command may run under the reaper (`python -m gpu_agent.runtime.reaper -- python -m ...`).
    """
    argv = command.argv
    if runs_under_reaper(argv) and argv[0] == sys.executable:
        argv = argv[4:]
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in (SERVER_MODULE, ENGINE_MODULE):
        return argv[3:]
    return None


@dataclass(slots=True)
class Handoff:
    """What the agent sends a standby to turn it into one replica's engine."""

    replica_id: str
    args: list[str]  # vLLM OpenAI server arguments, as after `-m vllm.entrypoints.openai.api_server`
    env: dict[str, str]
    log_path: str

    def __post_init__(self) -> None:
        if not self.replica_id or len(self.replica_id) > MARKER_WIDTH - 2:
            raise ValueError(f"replica_id must be 1-{MARKER_WIDTH - 2} characters")


class Standby:
    """The node's one warm standby, driven by the supervisor's poll loop (never blocks).

    NOTE: spawn and hand off from the supervisor's monitor thread: PR_SET_PDEATHSIG is
    tied to the thread that forks, and the standby becomes an engine.
    """

    label = "warm standby"  # as launch lines in a replica's log name it
    process_args: tuple[str, ...] = ()  # extra arguments of the standby process (the zygote's `--zygote`)

    def __init__(
        self,
        data_dir: Path,
        *,
        device: str,
        env: dict[str, str] | None = None,
        min_respawn_backoff_s: float = 5.0,
        max_respawn_backoff_s: float = 300.0,
    ) -> None:
        self.data_dir = data_dir
        self.device = device
        self.env = env or {}
        self.log_path = data_dir / "logs" / "standby.log"
        self.min_respawn_backoff_s = min_respawn_backoff_s
        self.max_respawn_backoff_s = max_respawn_backoff_s
        self.process: subprocess.Popen | None = None
        self.ready = False
        self.spawned_at = 0.0
        self.ready_after_s: float | None = None
        self.num_spawned = 0
        self.num_handoffs = 0
        # Set when a standby refused to serve (CUDA initialised before its handoff): none is spawned again.
        self.refused_reason: str | None = None
        self._num_early_deaths = 0
        self._respawn_at = 0.0
        self._buffer = b""

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def warming(self) -> bool:
        """Spawned, still importing, alive (and has not refused)."""
        return (
            self.process is not None
            and not self.ready
            and self.refused_reason is None
            and self.process.poll() is None
        )

    def ensure(self) -> None:
        """Spawn a standby if there is none (with backoff if they keep dying), and read its status."""
        if self.process is not None and self.process.poll() is not None:
            self._on_death()
        if self.process is None:
            if self.refused_reason is None and time.monotonic() >= self._respawn_at:
                self._spawn()
            return
        if not self.ready:
            self._read_status()

    def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        keep_log_within(self.log_path, MAX_LOG_BYTES)
        env = {
            # NOTE: the zygote's environment is its engines' (a fork inherits it): never the agent's own.
            **engine_environment(),
            # NOTE: libgomp reads its settings when the standby imports torch, long before a handoff's env.
            **(cpu_openmp_env() if self.device == DEVICE_CPU else {}),
            **self.env,
            DATA_DIR_ENV_MARKER: str(self.data_dir),
            REPLICA_ENV_MARKER: STANDBY_MARKER_VALUE,
        }
        with open(self.log_path, "ab") as log:
            log.write(f"\n==> standby {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
            log.flush()
            # NOTE: under the reaper, like every engine: it takes the standby (and, once it
            # serves, vLLM's children) down with it when the agent dies.
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    REAPER_MODULE,
                    "--",
                    sys.executable,
                    "-m",
                    STANDBY_MODULE,
                    "--device",
                    self.device,
                    *self.process_args,
                ],  # fmt: skip
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,  # its own group, like every engine
                close_fds=True,
            )
        os.set_blocking(self.process.stdout.fileno(), False)
        self.ready = False
        self._buffer = b""
        self.spawned_at = time.monotonic()
        self.num_spawned += 1
        logger.info("standby: spawned pid %s", self.process.pid)

    def _read_status(self) -> None:
        try:
            chunk = self.process.stdout.read()
        except (OSError, ValueError):
            return
        if chunk:  # None: nothing yet (non-blocking pipe)
            self._buffer += chunk
        if self._buffer.startswith(REFUSED_PREFIX) and self._buffer.endswith(b"\n"):
            self.refused_reason = self._buffer[len(REFUSED_PREFIX) :].decode(errors="replace").strip()
        elif READY_LINE in self._buffer:
            self.ready = True
            self.ready_after_s = time.monotonic() - self.spawned_at
            self._num_early_deaths = 0
            logger.info("standby: pid %s ready after %.1fs", self.process.pid, self.ready_after_s)

    def _on_death(self) -> None:
        code = self.process.returncode
        if not self.ready:
            self._read_status()  # what it wrote before exiting: a refusal's reason
        self._close_pipes()
        self.process = None
        self.ready = False
        self._num_early_deaths += 1
        backoff = min(
            self.min_respawn_backoff_s * 2 ** (self._num_early_deaths - 1), self.max_respawn_backoff_s
        )
        self._respawn_at = time.monotonic() + backoff
        if self.refused_reason is not None:
            logger.warning(
                "standby refused to serve, none will be kept (see %s): %s", self.log_path, self.refused_reason
            )
            return
        logger.warning(
            "standby exited with code %s; next one in %.0fs (see %s)", code, backoff, self.log_path
        )

    def can_take(self, command: EngineCommand) -> bool:
        """A standby is ready and the command is a vLLM OpenAI server it can run in process."""
        if self.process is not None and not self.ready:
            self._read_status()
        return self.ready and server_args(command) is not None

    def hand_off(self, replica_id: str, command: EngineCommand, env: dict[str, str], log_path: Path):
        """Turn the ready standby into this replica's engine; returns its Popen, or None to launch naively.

        `env` is added to the standby's environment (the command's own variables, markers).
        """
        args = server_args(command)
        if args is None or not self.can_take(command):
            return None
        process = self.process
        message = Handoff(replica_id=replica_id, args=args, env=env, log_path=str(log_path))
        try:
            process.stdin.write(json.dumps(dataclasses.asdict(message)).encode() + b"\n")
            process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            logger.warning("standby: handoff to pid %s failed (%s)", process.pid, exc)
            self.stop()
            return None
        self._close_pipes()
        self.process = None
        self.ready = False
        self.num_handoffs += 1
        logger.info("standby: pid %s now runs replica %s", process.pid, replica_id)
        return process

    def stop(self) -> None:
        """Kill the waiting standby (agent exit, or after a failed handoff)."""
        process, self.process, self.ready = self.process, None, False
        if process is None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (process.stdin, process.stdout):
            try:
                pipe.close()
            except (OSError, ValueError):
                pass

    def _close_pipes(self) -> None:
        if self.process is None:
            return
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except (OSError, ValueError):
                pass
