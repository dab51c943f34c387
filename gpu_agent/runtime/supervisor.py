"""Runs each replica as a child engine process and keeps it honest.

One `ManagedReplica` per replica. `poll()` advances every replica one step and
never blocks for long: launch, health check (STARTING -> READY), metrics scrape,
restart after a crash with exponential backoff, FAILED after too many crashes,
drain (DRAINING -> SIGTERM -> SIGKILL -> STOPPED). The monitor thread calls
`poll()` about once a second.

NOTE: every engine is started from the monitor thread (or the thread calling
`poll()`), never from a short-lived worker thread: PR_SET_PDEATHSIG fires when the
*thread* that forked the child exits, not only when the process does.

Pids live in `<data-dir>/replicas.json`, so a restarted agent adopts children
that are healthy and still desired and kills the rest: no orphan engines.

With `standby=True` the supervisor keeps one warm standby process (`standby.py`)
that has already imported vLLM; `_launch` hands a replica to it instead of
spawning `vllm serve`, and falls back to the naive launch when there is no ready
standby or the handoff fails. A new standby is spawned only while no engine is
starting, so its imports never compete with an engine's start for the CPU.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from gpu_agent.protocol import (
    DEFAULT_ENGINE_PORT_MAX,
    DEFAULT_ENGINE_PORT_MIN,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
)
from gpu_agent.runtime import engine
from gpu_agent.runtime.engine import DATA_DIR_ENV_MARKER, REPLICA_ENV_MARKER, EngineCommand
from gpu_agent.runtime.standby import Standby, server_args

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_TERMINAL_STATES = (ReplicaState.STOPPED, ReplicaState.FAILED)

CommandFactory = Callable[[ReplicaSpec, Path, int], EngineCommand]


@dataclass(slots=True)
class SupervisorPolicy:
    max_consecutive_crashes: int = 3  # then FAILED
    restart_backoff_s: float = 2.0  # doubled after each crash
    max_restart_backoff_s: float = 60.0
    stable_after_s: float = 120.0  # READY this long resets the crash count
    startup_timeout_s: float = 900.0  # STARTING longer than this counts as a crash
    stop_timeout_s: float = 15.0  # SIGTERM -> SIGKILL
    health_timeout_s: float = 2.0
    kill_children_on_agent_death: bool = True  # PR_SET_PDEATHSIG on Linux
    num_log_lines_in_reason: int = 20
    # A used standby is replaced once no engine has been starting for this long.
    standby_refill_quiet_s: float = 2.0
    # A replica due while the standby is still importing waits for it (it is ready sooner than a
    # plain start, which would also compete for the CPU), at most this long after the standby spawned.
    standby_wait_s: float = 180.0


@dataclass(slots=True)
class EngineMetrics:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    generation_tokens_total: float = 0.0


@dataclass(slots=True)
class ManagedReplica:
    spec: ReplicaSpec
    model_path: Path
    log_path: Path
    state: ReplicaState = ReplicaState.STARTING
    state_history: list[tuple[ReplicaState, float]] = field(default_factory=list)
    command: EngineCommand | None = None
    process: subprocess.Popen | None = None  # None for adopted engines
    pid: int | None = None
    num_restarts: int = 0
    num_consecutive_crashes: int = 0
    failure_reason: str = ""
    progress: str = "starting engine"
    launch_at: float = 0.0  # when to (re)launch; 0 means not scheduled
    started_at: float = 0.0
    ready_at: float | None = None
    drain_deadline_at: float | None = None
    kill_deadline_at: float | None = None  # set once SIGTERM was sent
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    metrics_scraped_at: float | None = None
    tokens_per_s: float = 0.0
    from_standby: bool = False  # the running engine is a standby that took this replica
    avoid_standby: bool = False  # a standby start never got READY: launch naively from now on

    def set_state(self, state: ReplicaState) -> None:
        if state != self.state or not self.state_history:
            self.state = state
            self.state_history.append((state, time.time()))

    @property
    def address(self) -> str:
        return self.command.address if self.command else ""

    def status(self) -> ReplicaStatus:
        alive = self.state not in _TERMINAL_STATES
        return ReplicaStatus(
            replica_id=self.spec.replica_id,
            state=self.state,
            address=self.address if self.state in (ReplicaState.READY, ReplicaState.DRAINING) else "",
            pid=self.pid if alive else None,
            num_running=self.metrics.num_running if alive else 0,
            num_waiting=self.metrics.num_waiting if alive else 0,
            kv_cache_usage=min(max(self.metrics.kv_cache_usage, 0.0), 1.0) if alive else 0.0,
            tokens_per_s=self.tokens_per_s if alive else 0.0,
            num_restarts=self.num_restarts,
            failure_reason=self.failure_reason,
            progress=self.progress if self.state == ReplicaState.STARTING else "",
        )


class Supervisor:
    """Owns every engine process of this agent."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        device: str = engine.DEVICE_CPU,
        command_factory: CommandFactory | None = None,
        policy: SupervisorPolicy | None = None,
        standby: bool = False,
        on_ready: Callable[[str], None] | None = None,
        engine_ports: tuple[int, int] = (DEFAULT_ENGINE_PORT_MIN, DEFAULT_ENGINE_PORT_MAX),
    ) -> None:
        # NOTE: absolute, because engines carry it as a marker the next agent matches on.
        self.data_dir = Path(data_dir).resolve()
        self.logs_dir = self.data_dir / "logs"
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.data_dir / "replicas.json"
        self.device = device
        self.policy = policy or SupervisorPolicy()
        self.command_factory = command_factory or self._default_command
        self.on_ready = on_ready  # called with the replica id when an engine turns READY
        # Engines listen only inside the range this node registered (the control plane checks it).
        self.engine_ports = engine_ports
        self._replicas: dict[str, ManagedReplica] = {}
        self._lock = threading.RLock()
        self._http = httpx.Client(timeout=self.policy.health_timeout_s)
        self._monitor: threading.Thread | None = None
        self._stop_monitor = threading.Event()
        # Set by start(): the monitor launches a new engine now, not at its next tick.
        self._poke = threading.Event()
        self.standby = (
            Standby(
                self.data_dir,
                device=device,
                preexec_fn=_die_with_parent if self.policy.kill_children_on_agent_death else None,
            )
            if standby
            else None
        )
        self._engines_quiet_since = time.monotonic() - self.policy.standby_refill_quiet_s

    @property
    def standby_ready(self) -> bool:
        with self._lock:
            return self.standby is not None and self.standby.ready

    def _default_command(self, spec: ReplicaSpec, model_path: Path, port: int) -> EngineCommand:
        return engine.build_engine_command(spec, model_path, port=port, device=self.device)

    # -- commands -------------------------------------------------------------------

    def start(self, spec: ReplicaSpec, model_path: str | Path) -> ManagedReplica:
        """Schedule a replica's engine; the next `poll()` launches it."""
        with self._lock:
            if spec.replica_id in self._replicas:
                return self._replicas[spec.replica_id]
            replica = ManagedReplica(
                spec=spec, model_path=Path(model_path), log_path=self.logs_dir / f"{spec.replica_id}.log"
            )
            replica.set_state(ReplicaState.STARTING)
            replica.launch_at = time.monotonic()
            self._replicas[spec.replica_id] = replica
        self._poke.set()
        return replica

    def drain(self, replica_id: str, *, timeout_s: float | None = None) -> None:
        """Stop routing to the replica, let in-flight requests finish, then stop it."""
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is None or replica.state in (*_TERMINAL_STATES, ReplicaState.DRAINING):
                return
            if replica.pid is None:  # never launched or waiting for a restart: nothing to drain
                replica.launch_at = 0.0
                replica.set_state(ReplicaState.STOPPED)
                return
            replica.set_state(ReplicaState.DRAINING)
            timeout = replica.spec.drain_timeout_s if timeout_s is None else timeout_s
            replica.drain_deadline_at = time.monotonic() + timeout

    def forget(self, replica_id: str) -> None:
        """Drop a terminal replica from reports."""
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is not None and replica.state in _TERMINAL_STATES:
                del self._replicas[replica_id]
                self._save_state()

    def refresh_secrets(self, spec: ReplicaSpec) -> None:
        """Take a desired spec's secrets for a replica we already run.

        An engine adopted from a previous agent was recovered from the state file, which holds no
        secrets; its engine key arrives with the next desired spec.
        """
        with self._lock:
            replica = self._replicas.get(spec.replica_id)
            if replica is not None and spec.engine_api_key and replica.spec.engine_api_key != spec.engine_api_key:
                replica.spec = dataclasses.replace(
                    replica.spec, engine_api_key=spec.engine_api_key, credentials=spec.credentials
                )

    def get(self, replica_id: str) -> ManagedReplica | None:
        with self._lock:
            return self._replicas.get(replica_id)

    def replica_ids(self) -> list[str]:
        with self._lock:
            return list(self._replicas)

    def statuses(self) -> list[ReplicaStatus]:
        with self._lock:
            return [replica.status() for replica in self._replicas.values()]

    # -- the loop -------------------------------------------------------------------

    def start_monitor(self, interval_s: float = 1.0, starting_interval_s: float = 0.1) -> None:
        """Poll every `interval_s`, and every `starting_interval_s` while an engine starts:
        the health check that turns STARTING into READY is on a cold request's path."""
        if self._monitor is not None:
            return

        def loop() -> None:
            while not self._stop_monitor.is_set():
                self._poke.wait(starting_interval_s if self._any_engine_starting() else interval_s)
                self._poke.clear()
                if self._stop_monitor.is_set():
                    return
                try:
                    self.poll()
                except Exception:
                    logger.exception("supervisor poll failed")

        self._monitor = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._monitor.start()

    def _any_engine_starting(self) -> bool:
        with self._lock:
            # A launch that is due counts too: the next poll starts it, so it should come soon.
            return any(
                replica.state == ReplicaState.STARTING and (replica.pid is not None or replica.launch_at)
                for replica in self._replicas.values()
            )

    def stop_monitor(self) -> None:
        self._stop_monitor.set()
        self._poke.set()
        if self._monitor is not None:
            self._monitor.join(timeout=10)
            self._monitor = None

    def poll(self) -> None:
        with self._lock:
            replicas = list(self._replicas.values())
            for replica in replicas:
                try:
                    self._step(replica)
                except Exception as exc:  # one bad replica must not stop the others
                    logger.exception("replica %s: step failed", replica.spec.replica_id)
                    self._fail(replica, f"supervisor error: {exc}")
            if self.standby is not None:
                self._step_standby(replicas)

    def _step_standby(self, replicas: list[ManagedReplica]) -> None:
        """Keep one standby: refill it once no engine is starting (imports would slow that start)."""
        now = time.monotonic()
        if any(replica.state == ReplicaState.STARTING and replica.pid is not None for replica in replicas):
            self._engines_quiet_since = now
        if (
            self.standby.process is not None
            or now - self._engines_quiet_since >= self.policy.standby_refill_quiet_s
        ):
            self.standby.ensure()

    def _step(self, replica: ManagedReplica) -> None:
        now = time.monotonic()
        if replica.state in _TERMINAL_STATES:
            return
        if replica.pid is None:
            if replica.launch_at and now >= replica.launch_at:
                self._launch(replica)
            return
        exit_code = self._exit_code(replica)
        if exit_code is not None:
            self._on_exit(replica, exit_code)
            return
        if replica.state == ReplicaState.STARTING:
            if self._healthy(replica):
                replica.set_state(ReplicaState.READY)
                replica.ready_at = now
                replica.progress = ""
                if self.on_ready is not None:
                    self.on_ready(replica.spec.replica_id)
                logger.info(
                    "replica %s READY at %s after %.1fs",
                    replica.spec.replica_id, replica.address, now - replica.started_at,
                )  # fmt: skip
            elif now - replica.started_at > self.policy.startup_timeout_s:
                logger.warning(
                    "replica %s: not healthy after %.0fs", replica.spec.replica_id, now - replica.started_at
                )
                self._kill_group(replica, signal.SIGKILL)
        elif replica.state == ReplicaState.READY:
            self._scrape(replica)
            if replica.ready_at and now - replica.ready_at > self.policy.stable_after_s:
                replica.num_consecutive_crashes = 0
        elif replica.state == ReplicaState.DRAINING:
            if replica.kill_deadline_at is None:
                scraped = self._scrape(replica)
                idle = scraped and replica.metrics.num_running == 0 and replica.metrics.num_waiting == 0
                if idle or now >= (replica.drain_deadline_at or now):
                    self._kill_group(replica, signal.SIGTERM)
                    replica.kill_deadline_at = now + self.policy.stop_timeout_s
            elif now >= replica.kill_deadline_at:
                self._kill_group(replica, signal.SIGKILL)

    def _launch(self, replica: ManagedReplica) -> None:
        spec = replica.spec
        in_use = {other.command.port for other in self._replicas.values() if other.command and other.pid}
        port = engine.free_port_in_range(*self.engine_ports, exclude=in_use)
        command = self.command_factory(spec, replica.model_path, port)
        if (
            self.standby is not None
            and not replica.avoid_standby
            and self.standby.warming
            and time.monotonic() - self.standby.spawned_at < self.policy.standby_wait_s
            and server_args(command) is not None
        ):
            replica.progress = "starting engine (warm standby)"
            return  # launch_at stays due: the next poll tries again
        env = {
            **os.environ,
            **command.env,
            REPLICA_ENV_MARKER: spec.replica_id,
            DATA_DIR_ENV_MARKER: str(self.data_dir),
        }
        with open(replica.log_path, "ab") as log:
            process = None
            if self.standby is not None and not replica.avoid_standby and self.standby.can_take(command):
                log.write(f"\n==> launch {_now()} on the warm standby: {' '.join(command.argv)}\n".encode())
                log.flush()
                process = self.standby.hand_off(
                    spec.replica_id, command, {**command.env, DATA_DIR_ENV_MARKER: str(self.data_dir)},
                    replica.log_path,
                )  # fmt: skip
            if process is None:
                log.write(f"\n==> launch {_now()}: {' '.join(command.argv)}\n".encode())
                log.flush()
            replica.from_standby = process is not None
            process = process or subprocess.Popen(
                command.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group: we signal the engine and its workers together
                preexec_fn=_die_with_parent if self.policy.kill_children_on_agent_death else None,
                close_fds=True,
            )
        replica.command = command
        replica.process = process
        replica.pid = process.pid
        replica.started_at = time.monotonic()
        replica.launch_at = 0.0
        replica.ready_at = None
        replica.metrics = EngineMetrics()
        replica.metrics_scraped_at = None
        replica.progress = "starting engine"
        replica.set_state(ReplicaState.STARTING)
        logger.info(
            "replica %s: launched pid %s on port %s%s",
            spec.replica_id, process.pid, port, " (warm standby)" if replica.from_standby else "",
        )  # fmt: skip
        self._save_state()

    def _exit_code(self, replica: ManagedReplica) -> int | None:
        if replica.process is not None:
            return replica.process.poll()
        try:  # adopted: not our child, so no exit code, only liveness
            process = psutil.Process(replica.pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return -1
            return None
        except psutil.NoSuchProcess:
            return -1

    def _on_exit(self, replica: ManagedReplica, exit_code: int) -> None:
        self._kill_group(replica, signal.SIGKILL)  # reap workers the engine left behind
        replica.pid = None
        replica.process = None
        replica.kill_deadline_at = None
        if replica.state == ReplicaState.DRAINING:
            replica.set_state(ReplicaState.STOPPED)
            logger.info("replica %s STOPPED", replica.spec.replica_id)
            self._save_state()
            return
        replica.num_consecutive_crashes += 1
        reason = f"engine exited with code {exit_code}"
        if replica.from_standby and replica.ready_at is None:
            replica.avoid_standby = True  # the handoff itself may be what fails: retry the plain way
            reason += " (started from the warm standby; retrying with a plain launch)"
        if replica.num_consecutive_crashes >= self.policy.max_consecutive_crashes:
            self._fail(
                replica,
                f"{reason} {replica.num_consecutive_crashes} times in a row:\n{self.log_tail(replica)}",
            )
            return
        backoff = min(
            self.policy.restart_backoff_s * 2 ** (replica.num_consecutive_crashes - 1),
            self.policy.max_restart_backoff_s,
        )
        replica.num_restarts += 1
        replica.launch_at = time.monotonic() + backoff
        replica.failure_reason = reason
        replica.progress = f"restarting engine in {backoff:.0f}s after a crash"
        replica.set_state(ReplicaState.STARTING)
        logger.warning(
            "replica %s: %s; restart %d in %.1fs",
            replica.spec.replica_id,
            reason,
            replica.num_restarts,
            backoff,
        )
        self._save_state()

    def _fail(self, replica: ManagedReplica, reason: str) -> None:
        self._kill_group(replica, signal.SIGKILL)
        replica.pid = None
        replica.process = None
        replica.launch_at = 0.0
        replica.failure_reason = reason
        replica.set_state(ReplicaState.FAILED)
        logger.error(
            "replica %s FAILED: %s", replica.spec.replica_id, reason.splitlines()[0] if reason else ""
        )
        self._save_state()

    def log_tail(self, replica: ManagedReplica) -> str:
        try:
            with open(replica.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - 64 * 1024))
                lines = log.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-self.policy.num_log_lines_in_reason :])

    def _kill_group(self, replica: ManagedReplica, sig: signal.Signals) -> None:
        """Signal the engine's process group and any stray process carrying its marker."""
        if replica.pid is not None:
            try:
                os.killpg(replica.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGKILL:
            for process in replica_processes(replica.spec.replica_id, self.data_dir):
                try:
                    process.kill()
                except psutil.Error:
                    pass
            if replica.process is not None and replica.process.poll() is None:
                try:
                    replica.process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass

    def _healthy(self, replica: ManagedReplica) -> bool:
        try:
            return self._http.get(f"{replica.address}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _scrape(self, replica: ManagedReplica) -> bool:
        try:
            response = self._http.get(
                f"{replica.address}/metrics", headers={"Authorization": f"Bearer {replica.spec.engine_api_key}"}
            )
            response.raise_for_status()
        except httpx.HTTPError:
            return False
        metrics = parse_engine_metrics(response.text)
        now = time.monotonic()
        if replica.metrics_scraped_at is not None and now > replica.metrics_scraped_at:
            delta = metrics.generation_tokens_total - replica.metrics.generation_tokens_total
            replica.tokens_per_s = max(delta, 0.0) / (now - replica.metrics_scraped_at)
        replica.metrics = metrics
        replica.metrics_scraped_at = now
        return True

    # -- shutdown and recovery -------------------------------------------------------

    def shutdown(self, *, timeout_s: float | None = None) -> None:
        """Stop every engine now (SIGTERM, then SIGKILL after the bound); used on agent exit."""
        self.stop_monitor()
        self._stop_standby()
        timeout = self.policy.stop_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            running = [replica for replica in self._replicas.values() if replica.pid is not None]
            for replica in running:
                self._kill_group(replica, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for replica in running:
                while self._exit_code(replica) is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                self._kill_group(replica, signal.SIGKILL)
                replica.pid = None
                replica.process = None
                replica.set_state(ReplicaState.STOPPED)
            for replica in self._replicas.values():
                if replica.state not in _TERMINAL_STATES:
                    replica.launch_at = 0.0
                    replica.set_state(ReplicaState.STOPPED)
            self._save_state()
        self._http.close()

    def detach(self) -> None:
        """Stop supervising but leave engines running, for the next agent on this data dir to adopt."""
        self.stop_monitor()
        self._stop_standby()  # a waiting standby is nobody's engine: it never outlives the agent
        with self._lock:
            self._save_state()
        self._http.close()

    def recover(self, desired: dict[str, ReplicaSpec] | None = None) -> tuple[list[str], list[str]]:
        """Adopt engines a previous agent left running if healthy and desired; kill all others.

        `desired=None` adopts every healthy engine (reconcile drains the unwanted later).
        Returns (adopted replica ids, killed replica ids).
        """
        adopted, killed = [], []
        records = self._load_state()
        with self._lock:
            for replica_id, record in records.items():
                if replica_id in self._replicas:
                    continue
                pid = record.get("pid")
                spec = dataclasses.replace(
                    ReplicaSpec.from_dict(record["spec"]), engine_api_key=record.get("engine_api_key", "")
                )
                command = EngineCommand(argv=record.get("argv", []), host=record["host"], port=record["port"],
                                         advertise_host=record.get("advertise_host", ""))
                wanted_spec = desired.get(replica_id, spec) if desired else spec
                if not wanted_spec.engine_api_key:  # the running engine holds the key it was started with
                    wanted_spec = dataclasses.replace(wanted_spec, engine_api_key=spec.engine_api_key)
                replica = ManagedReplica(
                    spec=wanted_spec,
                    model_path=Path(record["model_path"]),
                    log_path=self.logs_dir / f"{replica_id}.log",
                    command=command,
                    pid=pid,
                    num_restarts=record.get("num_restarts", 0),
                )
                wanted = desired is None or replica_id in desired
                alive = pid is not None and _is_replica_process(pid, replica_id)
                if wanted and alive and self._healthy(replica):
                    replica.set_state(ReplicaState.READY)
                    replica.ready_at = time.monotonic()
                    replica.started_at = time.monotonic()
                    replica.progress = ""
                    self._replicas[replica_id] = replica
                    adopted.append(replica_id)
                    logger.info("adopted replica %s (pid %s)", replica_id, pid)
                else:
                    killed.append(replica_id)
                    if alive:
                        self._kill_group(replica, signal.SIGKILL)
            # Whatever else carries our data-dir marker but is not ours now is an orphan.
            owned = {replica.pid for replica in self._replicas.values() if replica.pid}
            if self.standby is not None and self.standby.pid is not None:
                owned.add(self.standby.pid)
            for process in replica_processes(None, self.data_dir):
                try:
                    if process.pid in owned or os.getpgid(process.pid) in owned:
                        continue
                    logger.warning("killing orphan engine process %s", process.pid)
                    process.kill()
                except (psutil.Error, ProcessLookupError):
                    pass
            self._save_state()
        if killed:
            logger.info("killed replicas left by a previous agent: %s", killed)
        return adopted, killed

    def _stop_standby(self) -> None:
        with self._lock:
            if self.standby is not None:
                self.standby.stop()

    def _save_state(self) -> None:
        records = {}
        for replica_id, replica in self._replicas.items():
            if replica.pid is None or replica.command is None:
                continue
            records[replica_id] = {
                "pid": replica.pid,
                "host": replica.command.host,
                "advertise_host": replica.command.advertise_host,
                "port": replica.command.port,
                "argv": replica.command.argv,
                "model_path": str(replica.model_path),
                # NOTE: source credentials never go to disk. The engine key does (this file is 0600,
                # like node.json): the next agent must reach an engine it adopts to drain it.
                "spec": replica.spec.without_secrets().to_dict(),
                "engine_api_key": replica.spec.engine_api_key,
                "num_restarts": replica.num_restarts,
            }
        tmp = self.state_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(records, indent=2))
        os.replace(tmp, self.state_path)

    def _load_state(self) -> dict[str, dict]:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}


_METRIC_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Sum vLLM's Prometheus gauges over engines (one per data-parallel rank)."""
    values: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = _METRIC_LINE.match(line)
        if match:
            try:
                values[match["name"]] += float(match["value"])
            except ValueError:
                continue
    kv_cache = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc", 0.0))
    return EngineMetrics(
        num_running=int(values.get("vllm:num_requests_running", 0)),
        num_waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_cache_usage=float(kv_cache),
        generation_tokens_total=values.get("vllm:generation_tokens_total", 0.0),
    )


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


def _is_replica_process(pid: int, replica_id: str) -> bool:
    """Guards against pid reuse: the pid must still carry the replica's marker."""
    try:
        process = psutil.Process(pid)
        return (
            process.status() != psutil.STATUS_ZOMBIE
            and process.environ().get(REPLICA_ENV_MARKER) == replica_id
        )
    except (psutil.Error, OSError):
        return False


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
