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
CUDA is uninitialised, spawn otherwise. On CPU vLLM forces `spawn` only because
its CPU platform sets it unconditionally (and it forces the multiprocess executor,
so a replica is three processes: API server, EngineCore, worker); the standby
forks both children instead, from processes that have run no OpenMP region yet.

Agent side: `Standby` (import-light). Standby side: `main()`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpu_agent.runtime.engine import DATA_DIR_ENV_MARKER, DEVICE_CPU, REPLICA_ENV_MARKER, EngineCommand

logger = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
STANDBY_MODULE = "gpu_agent.runtime.standby"
REAPER_MODULE = "gpu_agent.runtime.reaper"
# Reserved width of the replica marker in a standby's environment block.
MARKER_WIDTH = 128
STANDBY_MARKER_VALUE = "standby".ljust(MARKER_WIDTH, "_")
_READY_LINE = b"ready\n"

# Modules a replica would otherwise import at start, API server and EngineCore alike.
PRELOAD_MODULES = (
    "vllm.entrypoints.launchers.api_server.entry",
    "vllm.entrypoints.launchers.cli_args",
    "vllm.utils.argparse_utils",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen2",
    "vllm.model_executor.models.qwen3",
    "uvloop",
)
PRELOAD_MODULES_BY_DEVICE = {
    DEVICE_CPU: ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner"),
    "cuda": ("vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner"),
}


def server_args(command: EngineCommand) -> list[str] | None:
    """The arguments of `python -m vllm.entrypoints.openai.api_server ...`, or None for other commands.

    The command may run under the reaper (`python -m gpu_agent.runtime.reaper -- python -m ...`).
    """
    argv = command.argv
    if len(argv) >= 4 and argv[1:4] == ["-m", REAPER_MODULE, "--"] and argv[0] == sys.executable:
        argv = argv[4:]
    if len(argv) >= 3 and argv[1:3] == ["-m", SERVER_MODULE] and argv[0] == sys.executable:
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

    def __init__(
        self,
        data_dir: Path,
        *,
        device: str,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
        min_respawn_backoff_s: float = 5.0,
        max_respawn_backoff_s: float = 300.0,
    ) -> None:
        self.data_dir = data_dir
        self.device = device
        self.env = env or {}
        self.preexec_fn = preexec_fn
        self.log_path = data_dir / "logs" / "standby.log"
        self.min_respawn_backoff_s = min_respawn_backoff_s
        self.max_respawn_backoff_s = max_respawn_backoff_s
        self.process: subprocess.Popen | None = None
        self.ready = False
        self.spawned_at = 0.0
        self.ready_after_s: float | None = None
        self.num_spawned = 0
        self.num_handoffs = 0
        self._num_early_deaths = 0
        self._respawn_at = 0.0
        self._buffer = b""

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def warming(self) -> bool:
        """Spawned, still importing, alive."""
        return self.process is not None and not self.ready and self.process.poll() is None

    def ensure(self) -> None:
        """Spawn a standby if there is none (with backoff if they keep dying), and read its status."""
        if self.process is not None and self.process.poll() is not None:
            self._on_death()
        if self.process is None:
            if time.monotonic() >= self._respawn_at:
                self._spawn()
            return
        if not self.ready:
            self._read_status()

    def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
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
                ],  # fmt: skip
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,  # its own group, like every engine
                preexec_fn=self.preexec_fn,
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
        if _READY_LINE in self._buffer:
            self.ready = True
            self.ready_after_s = time.monotonic() - self.spawned_at
            self._num_early_deaths = 0
            logger.info("standby: pid %s ready after %.1fs", self.process.pid, self.ready_after_s)

    def _on_death(self) -> None:
        code = self.process.returncode
        self._close_pipes()
        self.process = None
        self.ready = False
        self._num_early_deaths += 1
        backoff = min(
            self.min_respawn_backoff_s * 2 ** (self._num_early_deaths - 1), self.max_respawn_backoff_s
        )
        self._respawn_at = time.monotonic() + backoff
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


# -- the standby process ---------------------------------------------------------------


def rewrite_environ_block(name: str, value: str) -> bool:
    """Overwrite `name`'s value in this process's initial environment block (what /proc shows).

    The new value must fit the old one's width; the remainder becomes a filler entry
    without '=', which environment parsers (psutil, glibc) skip.
    """
    try:
        with open("/proc/self/stat", "rb") as handle:
            stat = handle.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        env_start, env_end = int(fields[47]), int(fields[48])  # fields 50 and 51 of proc(5)
    except (OSError, ValueError, IndexError):
        return False
    block = ctypes.string_at(env_start, env_end - env_start)
    key = name.encode() + b"="
    if block.startswith(key):
        position = 0
    else:
        found = block.find(b"\0" + key)
        if found < 0:
            return False
        position = found + 1
    value_start = position + len(key)
    width = block.index(b"\0", value_start) - value_start
    encoded = value.encode()
    if len(encoded) + 2 > width:
        return False
    payload = encoded + b"\0" + b"_" * (width - len(encoded) - 1)
    ctypes.memmove(env_start + value_start, payload, width)
    return True


def _force_fork_children() -> None:
    """On CPU, start the EngineCore and its worker by fork: they inherit every import.

    vLLM's CPU platform sets the `spawn` start method unconditionally, which makes
    each child import vLLM again. Every module that took `get_mp_context` by name
    gets a fork context instead; forked children inherit the patch.
    """
    import multiprocessing

    import vllm.utils.system_utils as system_utils
    import vllm.v1.engine.utils  # noqa: F401 - make sure the users are imported before patching
    import vllm.v1.executor.multiproc_executor  # noqa: F401

    original = system_utils.get_mp_context

    def fork_context():
        return multiprocessing.get_context("fork")

    for name, module in list(sys.modules.items()):
        # NOTE: look in __dict__ only: getattr on lazy modules (transformers) imports things.
        if name.startswith("vllm") and vars(module).get("get_mp_context") is original:
            module.get_mp_context = fork_context


def _preload(device: str) -> None:
    import importlib

    for module in (*PRELOAD_MODULES, *PRELOAD_MODULES_BY_DEVICE.get(device, ())):
        started_at = time.monotonic()
        try:
            importlib.import_module(module)
        except Exception as exc:  # an optional module of this vLLM build; the server imports what it needs
            print(f"standby: could not preload {module}: {exc!r}", file=sys.stderr)
            continue
        print(f"standby: imported {module} in {time.monotonic() - started_at:.1f}s", file=sys.stderr)


def _serve(handoff: Handoff, device: str) -> None:
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))
    args = parser.parse_args(handoff.args)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    if device == DEVICE_CPU:
        _force_fork_children()
    uvloop.run(run_server(args))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="inferplane-standby")
    parser.add_argument("--device", default=DEVICE_CPU)
    options = parser.parse_args(argv)

    # stdout is the status pipe to the agent; everything else printed goes to the log (stderr).
    status = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    started_at = time.monotonic()
    _preload(options.device)
    print(f"standby: ready after {time.monotonic() - started_at:.1f}s", file=sys.stderr, flush=True)
    status.write(_READY_LINE)

    line = sys.stdin.buffer.readline()  # blocks until a handoff; EOF when the agent goes away
    if not line.strip():
        return 0
    handoff = Handoff(**json.loads(line))
    status.close()
    if not rewrite_environ_block(REPLICA_ENV_MARKER, handoff.replica_id):
        print("standby: cannot set the replica marker; refusing the handoff", file=sys.stderr, flush=True)
        return 75  # the agent sees an early exit and launches this replica naively
    os.environ.update(handoff.env)
    os.environ[REPLICA_ENV_MARKER] = handoff.replica_id
    sys.stdout.flush()
    sys.stderr.flush()
    log_fd = os.open(handoff.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.close(null_fd)
    print(
        f"standby: pid {os.getpid()} serves replica {handoff.replica_id} "
        f"(spawned {time.monotonic() - started_at:.1f}s ago)",
        flush=True,
    )
    _serve(handoff, options.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
