"""Runs each replica as a child engine process and keeps it honest.

One `ManagedReplica` per replica. `poll()` advances every replica one step and
never blocks for long: launch, health check (STARTING -> READY; a READY engine's again every
`ready_health_interval_s`, killed and restarted when it fails in a row), metrics scrape,
restart after a crash with exponential backoff, FAILED after too many crashes,
drain (DRAINING -> SIGTERM -> SIGKILL -> STOPPED). The monitor thread calls
`poll()` about once a second, ten times a second while an engine starts or is being stopped. A second
thread bounds what engines keep on the disk (`check_disk`, `engine_disk.py`), a third their logs
(`keep_logs_within`), away from the health checks and from each other.

Scale to zero is on the clock (issue #17: zero replicas within the idle timeout + 5 s), so a drain
acts at once (`drain` wakes the monitor), an idle engine is stopped without a drain wait: SIGTERM
to its process group, SIGKILL after `idle_stop_grace_s` (nothing is in flight, so a graceful
shutdown of vLLM's server and EngineCore saves nothing and took seconds at load ~30), and
its STOPPED is reported as soon as the process is gone (`on_stopped` wakes the agent's heartbeat).

Sleep mode (GPU engines started with `spec.sleep_mode`, issue #17): `sleep` asks a READY engine to
sleep (`/sleep?level=1`) and keeps its process (SLEEPING); `wake` asks it back (`/wake_up`, READY).
Each call runs on its own short thread, never under the lock nor on the monitor, since a sleep
offloads the weights to host memory (seconds on a big model). A replica that cannot sleep (a CPU
node, an engine without sleep mode, a refused call) drains and stops as before, with the reason in
its report; a failed wake kills the engine and starts it again at once (a restart, its reason
reported like a crash's).

NOTE: every engine is started from the monitor thread (or the thread calling
`poll()`), never from a short-lived worker thread: PR_SET_PDEATHSIG fires when the
*thread* that forked the child exits, not only when the process does.

Pids live in `<data-dir>/replicas.json` (`state_file.py`), so a restarted agent
adopts children that are healthy and still desired and kills the rest: no orphan
engines.

This module is the orchestration; each replica's states and transitions are in
`replica_state.py`, process control in `process.py`, the health check and metrics
in `probes.py`. It stays one module (about 480 lines) because every method below
works under the one lock over the replicas: split, the lock would be shared across files.

With `standby=True, zygote=True` that process is a fork server instead (`zygote.py`): each replica
is a child forked from it, so replicas starting at once never wait for a refill.

With `standby=True` the supervisor keeps one warm standby process (`standby.py`)
that has already imported vLLM; `_launch` hands a replica to it instead of
spawning `vllm serve`, and falls back to the naive launch when there is no ready
standby or the handoff fails. A used standby is refilled only while no engine is
starting, so its imports never compete with an engine's start for the CPU; a replica
due while there is none spawns one at once and waits for it (still the faster start).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from gpu_agent.protocol import (
    DEFAULT_ENGINE_PORT_MAX,
    DEFAULT_ENGINE_PORT_MIN,
    ModelTask,
    ReplicaAction,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
)
from gpu_agent.runtime import engine, engine_disk, process, sandbox, shared_memory, state_file
from gpu_agent.runtime.engine import DATA_DIR_ENV_MARKER, REPLICA_ENV_MARKER, ZYGOTE_WARM_ENV, EngineCommand
from gpu_agent.runtime.engine_environment import engine_environment
from gpu_agent.runtime.engine_memory import read_engine_memory
from gpu_agent.runtime.probes import EngineProbe
from gpu_agent.runtime.replica_state import ManagedReplica
from gpu_agent.runtime.sleep_mode import SLEEP_LEVEL_OFFLOAD_WEIGHTS, EngineSleepClient, EngineSleepError
from gpu_agent.runtime.standby import Standby, server_args
from gpu_agent.runtime.zygote import Zygote
from gpu_agent.runtime.zygote_models import RECORD_NAME

logger = logging.getLogger(__name__)

CommandFactory = Callable[[ReplicaSpec, Path, int], EngineCommand]

# Logs of replicas that ended kept on the node (the newest; `Supervisor.forget` prunes the rest), and the logs that
# are not a replica's.
KEPT_ENDED_LOGS = 50
STANDING_LOGS = frozenset({"standby.log", "zygote.log"})
# At the agent's exit, how long it waits for the folders of ended engines still to remove (`engine_disk.Removals`);
# what is left then is logged, and removed by the next agent's start (`Supervisor.recover`).
REMOVALS_SHUTDOWN_S = 10.0
# Checks of an engine's shared memory in a row whose every walk a process of it was born or exited during
# (`shared_memory.held_by_tree`) before it is stopped as one hiding what it holds, and for how long at least: a check
# comes as often as every second near a disk bound (`engine_disk.next_check_in_s`), and an engine compiling (Triton,
# inductor: a compiler process started and ended many times a second) may make three checks in a row incomplete
# though it hides nothing; a relaying engine is incomplete at every check, for as long as it relays.
MAX_INCOMPLETE_SHM_CHECKS = 3
MIN_INCOMPLETE_SHM_S = 120.0
# Disk checks in a row whose folders never held still under the walk's reads (`engine_disk.measure`: `settled`), and
# for how long at least, before its engine is stopped as one hiding what it wrote (moving files ahead of the walk);
# meanwhile the most any of those checks counted is what counts. An honest engine changes its folders only while it
# compiles (vLLM's, inductor's and Triton's caches, in its warm-up), and a check is unsettled only when they changed
# under each of its reads: a warm-up that long for so many checks in a row is not one (measured every 0.2 s: real
# inductor compiling for 59 s, `bench/bench_engine_disk_settle.py`, and a real confined vLLM warm-up,
# `tests/agent/test_engine_sandbox.py`, never unsettled once); an engine hiding files is unsettled at every check.
MAX_UNSETTLED_DISK_CHECKS = 3
MIN_UNSETTLED_DISK_S = 120.0


DEFAULT_HUNG_AFTER_S = 15.0  # `SupervisorPolicy.hung_after_s`


@dataclass(slots=True)
class SupervisorPolicy:
    max_consecutive_crashes: int = 3  # then FAILED
    restart_backoff_s: float = 2.0  # doubled after each crash
    max_restart_backoff_s: float = 60.0
    stable_after_s: float = 120.0  # READY this long resets the crash count
    startup_timeout_s: float = 900.0  # STARTING longer than this counts as a crash
    stop_timeout_s: float = 15.0  # SIGTERM -> SIGKILL, for an engine stopped with requests in flight
    # SIGTERM -> SIGKILL for a draining engine with nothing in flight (scale to zero): it serves nobody,
    # so its graceful shutdown is a courtesy, cut short. NOTE: on the tiny CPU model vLLM's own shutdown
    # (server, then EngineCore) took 0.45 to 0.91 s at load ~6, seconds at load ~30 (README "Scale-to-zero
    # precision"); SIGKILL leaves no process behind either (the group, then strays by marker).
    idle_stop_grace_s: float = 1.0
    health_timeout_s: float = 2.0
    # An adopted engine that leaves this many asks in a row for the context it serves unanswered (one a desired spec,
    # `Supervisor.check_adopted_context`) is killed as unhealthy, and restarted as after a crash.
    max_unanswered_context_checks: int = 3
    # A chat template's measure that failed (an engine slow to answer at first) is tried again after each of these.
    template_measure_retry_s: tuple[float, ...] = (10.0, 60.0, 300.0)
    # A READY engine's /metrics at most this often. NOTE: the loop polls every 0.1 s while any engine starts,
    # and each scrape costs the engine ~5 ms of CPU (py-spy, tiny CPU model): the engines already up took
    # ~8% of a core each away from the ones still starting at once. Heartbeats read them every few seconds.
    metrics_interval_s: float = 1.0
    # A READY engine's /health at most this often, and killed (restarted as after a crash) once unhealthy this many
    # times in a row. NOTE: the kernel's OOM killer takes vLLM's EngineCore or a worker (they hold the host memory),
    # not the API server whose exit the agent watches; the server lives on, answering /metrics and failing /health
    # (`OOMPolicy=continue` in the bare-metal unit: before, the whole unit stopped). It stayed READY, routed calls.
    ready_health_interval_s: float = 10.0
    max_unhealthy_ready_checks: int = 3
    # NOTE: an engine that does not answer its /health within `health_timeout_s` is busy, not unhealthy (a long
    # prefill, a saturated API server): counted as unhealthy, three late answers in a row (30 s under load) killed a
    # healthy engine, every request in flight on it, at the busiest time. Killed only once it has not answered this
    # many times in a row (5 minutes: hung, not busy).
    max_unanswered_ready_checks: int = 30
    # ... or once it has not answered for this long while its processes computed next to nothing (under
    # `hung_max_cpu_share` of one core): hung (stopped, deadlocked), not busy, which computes. NOTE: before, a hung
    # engine was found only by the bound above: it kept READY and routed calls for 5 minutes, each waiting on it until
    # the gateway's read timeout (10 minutes). Silent and idle, it is asked again every quarter of this, not every
    # `ready_health_interval_s` (silent and computing, at that interval).
    hung_after_s: float = DEFAULT_HUNG_AFTER_S
    hung_max_cpu_share: float = 0.05
    # An engine's `/sleep` (weights to host memory) or `/wake_up` answered within this, or it failed.
    sleep_call_timeout_s: float = 120.0
    kill_children_on_agent_death: bool = True  # PR_SET_PDEATHSIG on Linux
    num_log_lines_in_reason: int = 20
    # Each log an engine (or the standby, or the zygote) appends to is started afresh past this, its last part kept
    # as `<name>.1` (`process.keep_log_within`, every `start_monitor` interval).
    max_log_bytes: int = process.MAX_LOG_BYTES
    # A used standby is replaced once no engine has been starting for this long.
    standby_refill_quiet_s: float = 2.0
    # A replica due while the standby is still importing waits for it (it is ready sooner than a
    # plain start, which would also compete for the CPU), at most this long after the standby spawned.
    standby_wait_s: float = 180.0

    def backoff_after(self, num_consecutive_crashes: int) -> float:
        """Seconds before the next launch: doubled after each crash in a row, capped."""
        return min(self.restart_backoff_s * 2 ** (num_consecutive_crashes - 1), self.max_restart_backoff_s)


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
        zygote: bool = False,
        on_ready: Callable[[str], None] | None = None,
        on_stopped: Callable[[str], None] | None = None,
        engine_ports: tuple[int, int] = (DEFAULT_ENGINE_PORT_MIN, DEFAULT_ENGINE_PORT_MAX),
        sandbox_mode: sandbox.SandboxMode = sandbox.DEFAULT_MODE,
        disk_bounds: engine_disk.EngineDiskBounds | None = None,
    ) -> None:
        # NOTE: absolute, because engines carry it as a marker the next agent matches on.
        self.data_dir = Path(data_dir).resolve()
        self.logs_dir = self.data_dir / "logs"
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        # NOTE: a log's end being kept aside when an agent was killed mid-cut, never renamed nor removed before
        for leftover in self.logs_dir.glob("*.partial"):
            leftover.unlink(missing_ok=True)
        self.state_path = self.data_dir / "replicas.json"
        # its engines' records, and the agent's readings of its node (`Agent`)
        self.state = state_file.StateFile(self.state_path)
        self.device = device
        self.policy = policy or SupervisorPolicy()
        self.command_factory = command_factory or self._default_command
        self.on_ready = on_ready  # called with the replica id when an engine turns READY
        self.on_stopped = on_stopped  # called with the replica id when a drained engine is gone (STOPPED) or fell asleep
        # Engines listen only inside the range this node registered (the control plane checks it).
        self.engine_ports = engine_ports
        self._replicas: dict[str, ManagedReplica] = {}
        # Engines adopted by `recover` (against the spec recorded with them) not yet checked against a desired spec
        # (`check_adopted_context`).
        # The number of asks each has gone unanswered.
        self._adopted_unchecked: dict[str, int] = {}
        self._prepared: dict[str, EngineCommand] = {}  # replica id -> command already sent to the zygote
        # Replica id -> (the replica, its command or why none could be built): built outside the lock (`_build_due`).
        self._built: dict[str, tuple[ManagedReplica, EngineCommand | Exception]] = {}
        self._ports_held: dict[str, int] = {}  # replica id -> the port of its command being built
        self._lock = threading.RLock()
        self._probe = EngineProbe(self.policy.health_timeout_s)
        self._monitor: threading.Thread | None = None
        self._disk_monitor: threading.Thread | None = None  # `check_disk`, every `interval_s` of the monitor
        self._log_monitor: threading.Thread | None = None  # `keep_logs_within`, as often
        self._stop_monitor = threading.Event()
        # Set by start(): the monitor launches a new engine now, not at its next tick.
        self._poke = threading.Event()
        standby_class = Zygote if zygote else Standby
        standby_env = {}
        if sandbox_mode != sandbox.SandboxMode.OFF:
            # NOTE: confined engines share no tenant's parsed files through the zygote (`zygote_models`).
            standby_env[ZYGOTE_WARM_ENV] = "0"
            (self.data_dir / RECORD_NAME).unlink(missing_ok=True)
        # NOTE: a standby (and every engine a zygote forks) dies with the agent, under its reaper: an agent that
        # keeps its engines on exit keeps none (`Agent`).
        self.standby = standby_class(self.data_dir, device=device, env=standby_env) if standby else None
        self._engines_quiet_since = time.monotonic() - self.policy.standby_refill_quiet_s
        # What confines each engine (`sandbox.py`): the agent's setting, and what the kernel offers.
        self.sandbox_mode = sandbox_mode
        self.sandbox_abi, self.sandbox_missing = sandbox.landlock_abi()
        self._scratch_dirs: dict[str, Path] = {}  # replica id -> its running engine's scratch folder
        self._adapter_dirs: dict[str, Path] = {}  # replica id -> where its running engine reads its adapters
        # What engines may keep on the disk (`engine_disk.py`): their endpoints' cache folders, and when each was used.
        self.disk_bounds = disk_bounds or engine_disk.EngineDiskBounds()
        # Folders of engines gone, set aside under the lock and removed on a thread of their own (`_drop_scratch`):
        # at most twice what one engine may hold walked at a time, the rest tried again later.
        self._removals = engine_disk.Removals(max_entries=2 * self.disk_bounds.engine_max_files)
        self._caches = engine_disk.CacheFolders(self.data_dir / "engine-caches")
        self._caches_swept_at: float | None = None
        self.shared_memory_dir = shared_memory.SHARED_MEMORY_DIR  # what engines hold there counts in their bound
        self._shm_unheld_since: dict[tuple[int, int], float] = {}  # its files held by nobody, since when (sweeps)

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
            replica.schedule_launch(time.monotonic())
            self._replicas[spec.replica_id] = replica
        self._poke.set()
        return replica

    def drain(self, replica_id: str, *, timeout_s: float | None = None) -> None:
        """Stop routing to the replica, let in-flight requests finish, then stop it."""
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is None or replica.is_final or replica.state == ReplicaState.DRAINING:
                return
            if replica.pid is None:  # never launched or waiting for a restart: nothing to drain
                self._drop_scratch(replica_id)  # NOTE: a safety net: each way an engine ends drops its own
                replica.stopped()
                return
            timeout = replica.spec.drain_timeout_s if timeout_s is None else timeout_s
            replica.started_draining(time.monotonic(), timeout)
        self._poke.set()  # the monitor acts now, not at its next tick: scale to zero waits on this

    def sleep(self, replica_id: str, level: int = SLEEP_LEVEL_OFFLOAD_WEIGHTS) -> None:
        """Put a READY engine to sleep, keeping its process; one that cannot sleep drains instead."""
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is None or replica.state != ReplicaState.READY or replica.sleep_call:
                return
            why_not = ("a CPU engine has no sleep mode" if self.device == engine.DEVICE_CPU
                       else "" if replica.spec.sleep_mode else "its engine was started without sleep mode")
            if why_not:
                replica.failure_reason = f"cannot sleep ({why_not}): stopped instead"
                logger.info("replica %s: %s", replica_id, replica.failure_reason)
            else:
                replica.sleep_call = "sleep"
        if why_not:
            self.drain(replica_id)
            return
        threading.Thread(target=self._call_engine, args=(replica, "sleep", level), name=f"sleep-{replica_id[:8]}",
                         daemon=True).start()

    def wake(self, replica_id: str) -> None:
        """Wake a SLEEPING engine (`/wake_up`); if that fails, kill it and start it again now."""
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is None or replica.state != ReplicaState.SLEEPING or replica.sleep_call:
                return
            replica.sleep_call = "wake"
        threading.Thread(target=self._call_engine, args=(replica, "wake", 0), name=f"wake-{replica_id[:8]}",
                         daemon=True).start()

    def _measure_chat_template_soon(self, replica: ManagedReplica, now: float) -> None:
        """Measures a READY engine's chat template unless it is measured, being measured, or out of tries: once READY,
        once adopted from an earlier agent (whose measure died with it), and again after a measure that failed
        (an engine slow to answer at first), `SupervisorPolicy.template_measure_retry_s` apart. Unmeasured, the gateway's estimate
        keeps its defaults, which a template adding more outgrows."""
        if (replica.chat_template_tokens is not None or replica.measuring or replica.spec.task == ModelTask.EMBED
                or replica.num_template_measures >= len(self.policy.template_measure_retry_s) + 1 or now < replica.measure_template_at):
            return  # NOTE: a pooling model's inputs get no chat template
        replica.measuring = True
        replica.num_template_measures += 1
        threading.Thread(target=self._measure_chat_template, args=(replica,), daemon=True,
                         name=f"template-{replica.spec.replica_id[:8]}").start()

    def _measure_chat_template(self, replica: ManagedReplica) -> None:
        """What its model's chat template adds (`EngineProbe.chat_template_tokens`), measured on its own thread
        with its own client: a template slow to render never holds the supervisor's lock, and so never the
        heartbeat or another replica's step."""
        spec = replica.spec
        measured = None
        probe = EngineProbe(self.policy.health_timeout_s)
        try:
            measured = probe.chat_template_tokens(replica.address, spec.engine_api_key, spec.served_model_name)
        except Exception:  # noqa: BLE001 - a measure that fails is tried again later; the thread never dies loud
            logger.exception("replica %s: could not measure its chat template", spec.replica_id)
        finally:
            probe.close()
            if measured is not None:  # NOTE: one attribute set whole; `statuses()` reads it as it is
                replica.chat_template_tokens = dataclasses.replace(measured, model_source=spec.model_source,
                                                                   weights_scope=spec.weights_scope)
            else:
                tries = replica.num_template_measures
                retries = self.policy.template_measure_retry_s
                if 1 <= tries <= len(retries):  # 0: its engine was relaunched meanwhile, and is measured afresh
                    replica.measure_template_at = time.monotonic() + retries[tries - 1]
            replica.measuring = False

    def _call_engine(self, replica: ManagedReplica, call: str, level: int) -> None:
        started = time.monotonic()
        client = EngineSleepClient(replica.address, replica.spec.engine_api_key, timeout_s=self.policy.sleep_call_timeout_s)
        error = ""
        try:
            if call == "sleep":
                client.sleep(level)
            elif not client.wake_up():
                error = "the engine did not say it is awake"
        except EngineSleepError as exc:
            error = str(exc)
        finally:
            client.close()
        took_s = time.monotonic() - started
        replica_id = replica.spec.replica_id
        drain = False
        with self._lock:
            replica.sleep_call = ""
            if self._replicas.get(replica_id) is not replica or replica.pid is None:
                return  # stopped, crashed or forgotten meanwhile: its own path reports it
            if call == "sleep" and replica.state == ReplicaState.READY:
                if error:
                    replica.failure_reason = f"sleep failed ({error[:300]}): stopped instead"
                    logger.warning("replica %s: %s", replica_id, replica.failure_reason)
                    drain = True
                else:
                    replica.fell_asleep()
                    self._save_state()  # NOTE: an agent that adopts it must know it sleeps (`recover`)
                    logger.info("replica %s SLEEPING after %.2fs (level %d)", replica_id, took_s, level)
            elif call == "wake" and replica.state == ReplicaState.SLEEPING:
                if error:
                    reason = f"wake up failed ({error[:300]}): engine restarted"
                    logger.warning("replica %s: %s", replica_id, reason)
                    self._kill_group(replica, signal.SIGKILL)
                    if replica.process is not None:
                        try:
                            replica.process.wait(timeout=self.policy.stop_timeout_s)
                        except Exception:  # noqa: BLE001 - killed with SIGKILL: reaped or gone
                            pass
                    replica.exited()
                    # NOTE: before, its folders stayed held: a drain before the relaunch stopped the replica, `forget`
                    # dropped it, and its scratch stayed on the disk, unqueued and still recorded as made
                    self._drop_scratch(replica_id)
                    replica.restart_after_crash(reason, 0.0, time.monotonic())
                    self._save_state()
                else:
                    replica.woke(time.monotonic())
                    self._save_state()
                    logger.info("replica %s woke (READY) after %.2fs", replica_id, took_s)
            else:
                return
        if drain:
            self.drain(replica_id)
        self._poke.set()
        callback = self.on_ready if call == "wake" else self.on_stopped
        if callback is not None:  # the agent reports the change now, not at its next heartbeat
            callback(replica_id)

    def forget(self, replica_id: str) -> None:
        """Drop a terminal replica from reports; the logs of replicas that ended beyond the newest
        `KEPT_ENDED_LOGS` go (its own is kept for a while, for whoever reads why it ended)."""
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is not None and replica.is_final:
                del self._replicas[replica_id]
                self._adopted_unchecked.pop(replica_id, None)
                self._drop_scratch(replica_id)  # NOTE: a safety net: each way an engine ends drops its own
                self._save_state()
                live = {replica.log_path.name for replica in self._replicas.values()}
        if replica is not None and replica.is_final:
            self._prune_logs(live)

    def _prune_logs(self, live: set[str], *, keep: int | None = None) -> None:
        """The logs of ended engines past the `keep` newest (`KEPT_ENDED_LOGS` unless told) go.
        NOTE: every replica's log stayed: with scale-to-zero each cold start is a new replica with a log of its own,
        outside the weights' disk budget, until the node's disk was full."""
        try:
            ended = sorted((path for path in self.logs_dir.glob("*.log") if path.name not in live
                            and path.name not in STANDING_LOGS), key=lambda path: path.stat().st_mtime, reverse=True)
            for path in ended[KEPT_ENDED_LOGS if keep is None else keep:]:
                path.unlink(missing_ok=True)
                path.with_name(f"{path.name}.1").unlink(missing_ok=True)  # its part kept aside (`keep_logs_within`)
                process.being_kept_aside(path).unlink(missing_ok=True)  # what an agent killed mid-cut left
        except OSError:
            logger.warning("could not prune the engines' logs", exc_info=True)

    def refresh_secrets(self, spec: ReplicaSpec) -> None:
        """Take a desired spec's secrets for a replica we already run.

        An engine adopted from a previous agent was recovered from the state file, which holds no
        secrets; its engine key arrives with the next desired spec.
        """
        with self._lock:
            replica = self._replicas.get(spec.replica_id)
            if replica is not None and spec.engine_api_key and replica.spec.engine_api_key != spec.engine_api_key:
                # NOTE: never the source's credentials, which the engine never needs (`Reconciler`): kept here
                # before, a credential deleted or rotated since stayed in the agent's memory for the engine's life.
                replica.spec = dataclasses.replace(replica.spec, engine_api_key=spec.engine_api_key, credentials=None)

    def check_adopted_context(self, spec: ReplicaSpec) -> None:
        """Check an engine adopted from a previous agent against the first desired spec the control plane gives it
        (`_served_context_problem` with the context its calls are billed by now), failing it with the reason if it
        serves more; its restarts take that figure.

        NOTE: `recover` runs before the first heartbeat, with the spec recorded with the engine: an engine an older
        agent launched with no `--max-model-len` serves what vLLM derives, and only the control plane's spec says
        that its calls are billed by less (the model's context kept from another description)."""
        with self._lock:
            replica = self._replicas.get(spec.replica_id)
            if spec.replica_id not in self._adopted_unchecked or replica is None:
                return
            if replica.is_final or replica.pid is None or replica.command is None or replica.command.max_model_len is None:
                self._adopted_unchecked.pop(spec.replica_id, None)
                return
            if replica.state == ReplicaState.DRAINING or spec.action == ReplicaAction.DRAIN:
                return  # NOTE: a draining engine is sent no more calls; failing it would end those it is finishing
            replica.spec = dataclasses.replace(replica.spec, billed_context_tokens=spec.billed_context_tokens)
            believed = engine.engine_context_length(replica.spec, replica.model_path)
            if believed >= replica.command.max_model_len:
                del self._adopted_unchecked[spec.replica_id]  # checked at adoption against as much or less
                return
            # NOTE: checked against the figure believed now, the launched one kept: before, the believed figure
            # replaced the launched one before the engine answered, and the next spec found nothing left to check.
            problem = self._served_context_problem(replica, believed)
            if problem is None:  # not answered in time: asked again with the next desired spec, a few times at most
                self._adopted_unchecked[spec.replica_id] += 1
                if self._adopted_unchecked[spec.replica_id] >= self.policy.max_unanswered_context_checks:
                    del self._adopted_unchecked[spec.replica_id]
                    logger.warning("replica %s: its adopted engine did not say the context it serves after %d asks; "
                                   "killed as unhealthy", spec.replica_id, self.policy.max_unanswered_context_checks)
                    self._kill_group(replica, signal.SIGKILL)  # restarted with the spec's figure, as a crash
                return
            del self._adopted_unchecked[spec.replica_id]
            if problem:
                self._fail(replica, problem)

    def replace_if_billed_less(self, spec: ReplicaSpec) -> bool:
        """Take a desired spec's context (`ReplicaSpec.billed_context_tokens`) for a replica we run: its restarts launch
        with it, and an engine launched with more (`engine.engine_context_length` dropped since: a disputed catalogue
        context replaced) is drained, as the control plane replaces the replicas of a changed spec: its calls in flight
        finish, and once it reports STOPPED the control plane places a replica launched with the figure. True when
        this drained it.

        NOTE: before, a figure that dropped reached no engine running: each served the context it was launched with to
        calls reserved and billed by the lower one. An adopted engine not checked yet is `check_adopted_context`'s."""
        with self._lock:
            replica = self._replicas.get(spec.replica_id)
            if replica is None or replica.is_final or spec.replica_id in self._adopted_unchecked:
                return False
            if replica.spec.billed_context_tokens != spec.billed_context_tokens:
                replica.spec = dataclasses.replace(replica.spec, billed_context_tokens=spec.billed_context_tokens)
            launched = replica.command.max_model_len if replica.pid is not None and replica.command else None
            if launched is None or replica.state == ReplicaState.DRAINING or spec.action == ReplicaAction.DRAIN:
                return False
            if spec.billed_context_tokens is None or spec.billed_context_tokens >= launched:
                return False  # NOTE: the launch took the smaller of it and the node's reading: no file read per beat
            billed = engine.engine_context_length(replica.spec, replica.model_path)
            if billed >= launched:
                return False
            logger.warning("replica %s: launched with a context of %d tokens, its calls are now billed by %d; drained "
                           "to be replaced", spec.replica_id, launched, billed)
            self.drain(spec.replica_id)
            return True

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
        """Poll every `interval_s`, and every `starting_interval_s` while an engine starts or stops:
        the health check that turns STARTING into READY is on a cold request's path, and the exit
        that turns DRAINING into STOPPED on scale to zero's."""
        if self._monitor is not None:
            return

        def loop() -> None:
            while not self._stop_monitor.is_set():
                self._poke.wait(starting_interval_s if self._any_engine_changing() else interval_s)
                self._poke.clear()
                if self._stop_monitor.is_set():
                    return
                try:
                    self.poll()
                except Exception:
                    logger.exception("supervisor poll failed")

        def every_interval(check: str) -> Callable[[], None]:
            def check_loop() -> None:
                while not self._stop_monitor.wait(interval_s):
                    try:
                        getattr(self, check)()
                    except Exception:
                        logger.exception("supervisor %s failed", check)

            return check_loop

        self._monitor = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._monitor.start()
        # NOTE: each on a thread of its own: a walk of many files must never hold up the health checks of engines
        # starting, nor the logs' bound (an engine can slow the walk on purpose: 200k files in its scratch took 1.7 s
        # a walk, and the logs of engines writing fast grew past their bound by what they wrote meanwhile).
        self._disk_monitor = threading.Thread(target=every_interval("check_disk"), name="supervisor-disk")
        self._log_monitor = threading.Thread(target=every_interval("keep_logs_within"), name="supervisor-logs")
        for thread in (self._disk_monitor, self._log_monitor):
            thread.daemon = True
            thread.start()

    def _any_engine_changing(self) -> bool:
        with self._lock:
            # A launch that is due counts too: the next poll starts it, so it should come soon.
            return any(
                (replica.state == ReplicaState.STARTING and (replica.pid is not None or replica.launch_at))
                # Signalled and about to exit: its STOPPED is on scale to zero's path. NOTE: not a drain
                # still waiting for requests in flight, which would be scraped ten times a second.
                or (replica.state == ReplicaState.DRAINING and replica.pid is not None and replica.kill_deadline_at)
                for replica in self._replicas.values()
            )

    def stop_monitor(self) -> None:
        self._stop_monitor.set()
        self._poke.set()
        if self._monitor is not None:
            self._monitor.join(timeout=10)
            self._monitor = None
        if self._disk_monitor is not None:
            self._disk_monitor.join(timeout=10)
            self._disk_monitor = None
        if self._log_monitor is not None:
            self._log_monitor.join(timeout=10)
            self._log_monitor = None

    def poll(self) -> None:
        if self.sandbox_mode != sandbox.SandboxMode.OFF:
            sandbox.NAMESPACES.retest_when_due()  # NOTE: on its own thread: a test takes up to 30 s per attempt
        self._build_due()
        with self._lock:
            replicas = list(self._replicas.values())
            self._send_due_to_zygote(replicas)
            for replica in replicas:
                try:
                    self._step(replica)
                except Exception as exc:  # one bad replica must not stop the others
                    logger.exception("replica %s: step failed", replica.spec.replica_id)
                    self._fail(replica, f"supervisor error: {exc}")
            for replica_id, command in list(self._prepared.items()):  # sent ahead, its launch failed: no engine
                del self._prepared[replica_id]
                orphan = self.standby.hand_off(replica_id, command, self._handoff_env(command), os.devnull)
                if orphan is not None:
                    process.kill_group(orphan.pid, None, replica_id, self.data_dir, signal.SIGKILL)
                    self.standby.forget(orphan.pid)
                self._drop_scratch(replica_id)
            for replica_id, (replica, _) in list(self._built.items()):  # built, then stopped or replaced: no launch
                if self._replicas.get(replica_id) is not replica or replica.is_final or replica.pid is not None:
                    del self._built[replica_id]
            if self.standby is not None:
                self._step_standby(replicas)

    def _build_due(self) -> None:
        """Build the command of every replica due to launch, outside the lock; its `_launch` takes it.

        NOTE: a command reads the tenant's model files (`engine.build_engine_command`: its config.json), and every
        heartbeat waits on the lock (`statuses`): a launch that read them under it held heartbeats up for seconds,
        and a node whose heartbeats stop goes offline with every tenant's replicas. Each command's port is chosen
        under the lock and held (`_ports_in_use`) until its engine runs or its replica goes.
        """
        with self._lock:
            now = time.monotonic()
            in_use = self._ports_in_use()
            due = []
            for replica_id, replica in self._replicas.items():
                if (replica.is_final or replica.pid is not None or not replica.launch_at or now < replica.launch_at
                        or replica_id in self._built or replica_id in self._prepared or replica_id in self._ports_held):
                    continue
                try:
                    port = engine.free_port_in_range(*self.engine_ports, exclude=in_use)
                except Exception as exc:  # noqa: BLE001 - its `_launch` fails the replica with it
                    self._built[replica_id] = (replica, exc)
                    continue
                in_use.add(port)
                self._ports_held[replica_id] = port
                due.append((replica, port))
        for replica, port in due:
            try:
                built = self.command_factory(replica.spec, replica.model_path, port)
            except Exception as exc:  # noqa: BLE001 - its `_launch` fails the replica with it
                built = exc
            with self._lock:
                del self._ports_held[replica.spec.replica_id]
                self._built[replica.spec.replica_id] = (replica, built)

    def _step_standby(self, replicas: list[ManagedReplica]) -> None:
        """Keep one standby: refill it once no engine is starting (imports would slow that start).

        A zygote is never used up: it is only read (children's exits) and respawned if it died."""
        if isinstance(self.standby, Zygote) and self.standby.process is not None:
            self.standby.ensure()
            return
        now = time.monotonic()
        if any(replica.state == ReplicaState.STARTING and replica.pid is not None for replica in replicas):
            self._engines_quiet_since = now
        if (
            self.standby.process is not None
            or now - self._engines_quiet_since >= self.policy.standby_refill_quiet_s
        ):
            self.standby.ensure()

    def _send_due_to_zygote(self, replicas: list[ManagedReplica]) -> None:
        """Send the zygote every replica due to launch now, before `_launch` waits for the first fork.

        Their `_launch` (in this same poll, under the same lock) then takes the command prepared here and
        only waits for its fork. Nothing for one replica alone: it is handed off as before.
        """
        if not isinstance(self.standby, Zygote) or not self.standby.ready:
            return
        now = time.monotonic()
        due = [
            replica for replica in replicas
            if not replica.is_final and replica.pid is None and replica.launch_at and now >= replica.launch_at
            and not replica.avoid_standby and replica.spec.replica_id not in self._prepared
        ]  # fmt: skip
        if len(due) < 2:
            return
        for replica in due:
            built = self._built.get(replica.spec.replica_id)
            if built is None or built[0] is not replica or isinstance(built[1], Exception):
                continue  # not built yet (the next poll), or its `_launch` fails it
            try:
                command = self._confined(replica, built[1])
            except Exception:  # noqa: BLE001 - one bad replica must not stop the poll: its `_launch` fails it
                logger.exception("replica %s: preparing its command failed", replica.spec.replica_id)
                continue
            if self.standby.send_ahead(
                replica.spec.replica_id, command, self._handoff_env(command), replica.log_path
            ):
                del self._built[replica.spec.replica_id]
                self._prepared[replica.spec.replica_id] = command

    def _ports_in_use(self) -> set[int]:
        """Ports of running engines and of commands being built, built or sent to the zygote (engines not started yet)."""
        in_use = {other.command.port for other in self._replicas.values() if other.command and other.pid}
        built = {command.port for _, command in self._built.values() if isinstance(command, EngineCommand)}
        return in_use | {command.port for command in self._prepared.values()} | built | set(self._ports_held.values())

    def _handoff_env(self, command: EngineCommand) -> dict[str, str]:
        return {**command.env, DATA_DIR_ENV_MARKER: str(self.data_dir)}

    def _confined(self, replica: ManagedReplica, command: EngineCommand) -> EngineCommand:
        """The command with what confines its engine (`sandbox.py`): its own folders, and the policy it applies.

        Each launch gets a new scratch folder (HOME, TMPDIR) and adapters folder (`stage_adapter`), removed when
        its engine is gone; its endpoint's cache folder (`<data dir>/engine-caches/<endpoint>`) stays for its next
        cold start (bounded and pruned: `check_disk`). With the sandbox off, the command is left as it is.
        """
        if self.sandbox_mode == sandbox.SandboxMode.OFF:
            return command
        spec = replica.spec
        self._drop_scratch(spec.replica_id)
        scratch_dir = sandbox.make_scratch_folder(self.data_dir, spec.replica_id)
        self._scratch_dirs[spec.replica_id] = scratch_dir
        # NOTE: recorded before its engine starts (or the zygote forks it): before, only with its engine's record at
        # the end of `_launch`, and an agent killed in between left a folder only its owner file named, which the
        # engine may remove. Not recorded (the disk full), no engine starts with it: the folder goes (set aside under
        # the agent's own name, which the next agent's start finds whatever is recorded) and the launch fails.
        if not self._save_state():
            self._drop_scratch(spec.replica_id)
            raise OSError(f"the agent's state file {self.state_path} could not be written: no engine starts with a "
                          "scratch folder it does not record")
        adapter_dir = self.data_dir / "engine-adapters" / sandbox.folder_name(spec.replica_id)
        shutil.rmtree(adapter_dir, ignore_errors=True)  # NOTE: left behind by an agent that was killed
        adapter_dir.mkdir(parents=True)
        self._adapter_dirs[spec.replica_id] = adapter_dir
        cache_dir = self._cache_dir(spec.endpoint_id)
        shared_cache = sandbox.shared_vllm_cache_root()
        sandbox.prepare_cache_folder(cache_dir, shared_cache)
        self._caches.touch(cache_dir.name)
        model_dirs = [replica.model_path, adapter_dir]
        if spec.speculative is not None and os.path.isabs(spec.speculative.draft_source):
            model_dirs.append(spec.speculative.draft_source)  # NOTE: the cached copy (`speculative.with_local_draft`)
        policy = sandbox.engine_policy(
            self.sandbox_mode, model_dirs=model_dirs, own_dirs=[scratch_dir], shared_dirs=[cache_dir],
            shared_read=[shared_cache / "modelinfos"], shared_memory_max_bytes=self.disk_bounds.engine_max_bytes,
            shared_memory_max_files=self.disk_bounds.engine_max_files, namespaces_missing=sandbox.namespaces_missing(),
            tcp_ports=[command.port] if command.port else [],
        )  # fmt: skip
        env = {**command.env, **sandbox.engine_folder_env(scratch_dir, cache_dir, self.sandbox_mode), sandbox.POLICY_ENV: policy.to_json()}
        return dataclasses.replace(command, env=env)

    def _drop_scratch(self, replica_id: str) -> None:
        """Let go of a replica's scratch and adapters folders (under the lock): both renamed aside here (its engine's
        next launch takes the adapters' name again; the scratch's new name is this agent's, `sandbox.set_scratch_aside`,
        for the next agent's sweep), and removed on the removals' thread (`engine_disk.Removals`).

        NOTE: before, removed here, under the lock every heartbeat and launch waits on: an engine's deep or busy tree
        held the whole agent for as long as its walk took (`engine_disk.remove_tree`). Then removed on the monitor's
        thread once the lock was let go: a tree of 199k nested folders took 23 s of every engine's polls."""
        adapters = self._adapter_dirs.pop(replica_id, None)
        self._removals.add(sandbox.set_scratch_aside(self._scratch_dirs.pop(replica_id, None), self.data_dir),
                           adapters and engine_disk.set_aside(adapters))

    def _cache_dir(self, endpoint_id: str) -> Path:
        """An endpoint's cache folder (`<data dir>/engine-caches/<endpoint>`), kept across its engines' launches."""
        return self._caches.root / sandbox.folder_name(endpoint_id)

    def _caches_in_use(self) -> set[str]:
        """The cache folders (names) of endpoints with a replica here that is not STOPPED or FAILED: starting
        (scheduled, sent to the zygote, launching), running, asleep or draining. NOTE: under the lock, which every
        launch holds: what it does not name now, no engine uses until that lock is let go."""
        return {sandbox.folder_name(replica.spec.endpoint_id) for replica in self._replicas.values()
                if not replica.is_final}  # fmt: skip

    def keep_logs_within(self) -> None:
        """Bound the logs being written now: each live engine's, the standby's and the zygote's
        (`SupervisorPolicy.max_log_bytes`, `process.keep_log_within`). A log is cut outside the lock (a copy of its end
        to `<name>.1`), from a thread of its own (never behind `check_disk`'s walks): an engine writing fast takes at
        most the bound twice, and what it writes in one interval of that thread, on the node's disk."""
        with self._lock:
            live = [replica.log_path for replica in self._replicas.values() if replica.pid is not None]
        for log_path in [*live, *(self.logs_dir / name for name in sorted(STANDING_LOGS))]:
            process.keep_log_within(log_path, self.policy.max_log_bytes)

    def check_disk(self) -> None:
        """Bound what engines keep on the node's disk (`engine_disk.py`), every second on a thread of its own.

        Each live engine's scratch and cache folders are measured every `check_interval_s`, sooner the nearer they
        are to their bound (`engine_disk.next_check_in_s`): past its bound its replica
        FAILS with the reason (reported as any failure is) and both folders are emptied (its cache only once no other
        replica of its endpoint runs here). Every `sweep_interval_s` the cache folders of endpoints with no replica
        here go when too old, or least recently used first while all of them are over the budget. The walks run
        outside the lock (thousands of files take a while); what goes is chosen again and renamed aside under it,
        then deleted on the removals' threads (`engine_disk.Removals`; an engine's past its bound on the urgent one). Nothing with the sandbox off: engines then get no folders of their own.
        """
        if self.sandbox_mode == sandbox.SandboxMode.OFF:
            return
        bounds = self.disk_bounds
        now = time.monotonic()
        with self._lock:
            due = [
                (replica, [*filter(None, [self._scratch_dirs.get(replica.spec.replica_id)]),
                           self._cache_dir(replica.spec.endpoint_id)])
                for replica in self._replicas.values()
                if replica.pid is not None and (replica.disk_check_due_at is None or now >= replica.disk_check_due_at)
            ]  # fmt: skip
            for replica, _folders in due:
                replica.disk_check_due_at = now + bounds.check_interval_s
            sweep = self._caches_swept_at is None or now - self._caches_swept_at >= bounds.sweep_interval_s
            if sweep:
                self._caches_swept_at = now
        over = []
        for replica, folders in due:
            walk_started = time.monotonic()
            usage = engine_disk.measure(folders, max_bytes=bounds.engine_max_bytes, max_files=bounds.engine_max_files)
            # NOTE: what its processes hold in /dev/shm is RAM it may write but not list (`sandbox.SHARED_MEMORY`); in
            # namespaces of its own, the whole of its own /dev/shm, closed files too. And what they hold of their
            # folders' disks with no name left (unlinked while open), which no walk of the folders meets.
            held = shared_memory.held_by_tree(replica.pid, self.shared_memory_dir, engine_disk.devices_of(folders))
            usage = dataclasses.replace(usage, num_bytes=usage.num_bytes + held.num_bytes,
                                        num_files=usage.num_files + held.num_files)  # fmt: skip
            replica.unsettled_disk.record(not usage.settled, now)
            if usage.settled:
                replica.unsettled_disk_max_bytes = 0
            else:  # what its reads met, and the most a check of this unsettled run counted
                replica.unsettled_disk_max_bytes = max(replica.unsettled_disk_max_bytes, usage.num_bytes)
                usage = dataclasses.replace(usage, num_bytes=replica.unsettled_disk_max_bytes)
            why = usage.over(bounds.engine_max_bytes, bounds.engine_max_files)
            # NOTE: a process is born or exits during a walk now and then; during each, it may be relaying a mapping
            replica.incomplete_shm.record(held.incomplete, now)
            if usage.unreadable:  # a folder it made unreadable: what it holds is unknown, so it is no engine to keep
                logger.warning("replica %s: its engine made %s unreadable to the agent", replica.spec.replica_id,
                               usage.unreadable)
                over.append((replica, "its engine hid what it wrote from the agent (a folder in its own folders made "
                                      "unreadable): stopped, and its folders emptied", held.paths))
            elif held.hidden:  # a process it made not dumpable: what it holds is unknown, so it is no engine to keep
                over.append((replica, "its engine hid the files it holds from the agent (a process not dumpable): "
                                      "stopped, and its folders emptied", held.paths))
            elif replica.incomplete_shm.lasted(MAX_INCOMPLETE_SHM_CHECKS, MIN_INCOMPLETE_SHM_S, now):
                over.append((replica, "its engine hid the shared memory it holds from the agent (processes of it "
                                      f"were born or exited during every walk of {replica.incomplete_shm.describe(now)}): "
                                      "stopped, and its folders emptied", held.paths))  # fmt: skip
            # a tmpfs only mapped that the agent cannot measure: what it pins is unknown
            elif held.unmeasured:
                over.append((replica, "its engine maps memory of a tmpfs not its own that this agent cannot measure "
                                      f"({', '.join(held.unmeasured[:3])}{' …' * (len(held.unmeasured) > 3)}; "
                                      "the agent has no CAP_CHECKPOINT_RESTORE to read "
                                      "its mappings): stopped, and its folders emptied", held.paths))  # fmt: skip
            elif why:
                over.append((replica, f"its engine wrote {why} to its own folders and /dev/shm (its scratch folder, "
                                      "its endpoint's cache, the files its processes hold there after removing them "
                                      "and the shared memory they hold, this node's bound for one engine): stopped, "
                                      "and its folders emptied", held.paths))
            elif replica.unsettled_disk.lasted(MAX_UNSETTLED_DISK_CHECKS, MIN_UNSETTLED_DISK_S, now):
                over.append((replica, "its engine hid what it wrote from the agent (its folders kept changing under "
                                      f"every measurement of {replica.unsettled_disk.describe(now)}): "
                                      "stopped, and its folders emptied", held.paths))  # fmt: skip
            else:
                walked = time.monotonic()
                # sooner when near, never sooner than its walk's cost allows, from the walk's end
                replica.disk_check_due_at = walked + engine_disk.next_check_in_s(usage, bounds,
                                                                                 walked_s=walked - walk_started)
        caches = self._caches.listing(max_bytes=bounds.cache_budget_bytes, max_files=bounds.engine_max_files) if sweep else []
        if sweep:
            orphans = shared_memory.remove_orphans(self.shared_memory_dir, self._shm_unheld_since,
                                                   older_than_s=bounds.shared_memory_orphan_age_s)
            if orphans:
                logger.info("removed %d files from %s that no process held", len(orphans), self.shared_memory_dir)
        over_bound = []  # the folders of engines stopped past their bound
        removed = []
        unheld = []
        with self._lock:
            for replica, reason, held_paths in over:
                if self._replicas.get(replica.spec.replica_id) is not replica or replica.pid is None:
                    continue  # stopped or relaunched meanwhile: its next engine is measured afresh
                over_bound.append(sandbox.set_scratch_aside(self._scratch_dirs.pop(replica.spec.replica_id, None),
                                                            self.data_dir))  # deleted once it is killed
                unheld += held_paths
                self._fail(replica, reason)
                name = self._cache_dir(replica.spec.endpoint_id).name
                if name not in self._caches_in_use():
                    over_bound.append(engine_disk.set_aside(self._caches.folder(name)))
                    self._caches.forget(name)
            if sweep:
                in_use = self._caches_in_use()
                removed += self._caches.leftovers(keep=in_use)
                for name in in_use:
                    self._caches.touch(name)
                for folder in engine_disk.to_prune(caches, in_use, bounds, time.time()):
                    removed.append(engine_disk.set_aside(folder.path))
                    self._caches.forget(folder.name)
                    logger.info("pruned the engine cache of endpoint folder %s (%d bytes, last used %.0fs ago)",
                                folder.name, folder.usage.num_bytes, time.time() - folder.last_used_at)  # fmt: skip
        # NOTE: on the removals' threads, never this one: before, an engine past its bound of files (200k, a walk of
        # 23-46 s) was walked here, and every other engine's disk checks waited behind it. Those of an engine past its
        # bound on the urgent one: behind the routine removals, its bytes stayed on the disk for as long as every
        # ended engine's tree queued before them took. There they take turns with the other urgent folders
        # (`engine_disk.URGENT_SLICE_ENTRIES` entries a turn): one folder's tree never holds another's bytes long.
        self._removals.add(*over_bound, urgent=True)
        self._removals.add(*removed)
        shared_memory.unlink(unheld)  # their memory is freed as the stopped engine's processes exit

    def remove_engine_caches(self) -> int:
        """Remove every endpoint's cache folder that no replica here uses, whatever its age (a retired node:
        `Agent.heartbeat_once`), and what earlier removals left (the adapters folders of no engine here included), and
        the logs of every engine ended (tenants' requests may be in them); how many cache folders went. Set aside
        under the lock, as `check_disk` does, and deleted outside it. NOTE: before, the last `KEPT_ENDED_LOGS` engines' logs stayed on a retired node's disk."""
        with self._lock:
            live = {replica.log_path.name for replica in self._replicas.values() if not replica.is_final}
            in_use = self._caches_in_use()
            removed = []
            for name in self._caches.names():
                if name not in in_use:
                    removed.append(engine_disk.set_aside(self._caches.folder(name)))
                    self._caches.forget(name)
            num_folders = len(removed)
            removed += self._caches.leftovers(keep=in_use)
            # NOTE: and the adapters folders of no engine here (an agent killed before removing them). Before, they
            # stayed on a retired node's disk.
            kept = set(self._adapter_dirs.values())
            for folder in sorted((self.data_dir / "engine-adapters").glob("*")):
                if folder not in kept:
                    removed.append(folder if folder.name.startswith(engine_disk.SET_ASIDE_PREFIX)
                                   else engine_disk.set_aside(folder))
        self._remove_now(removed)
        self._prune_logs(live, keep=0)
        return num_folders

    def _remove_now(self, paths: list[Path | None]) -> None:
        """Remove folders set aside on this thread (never under the lock); one left goes to the removals' thread, to
        be tried again later (before, nothing tried again); one that thread has already is left to it (a cache folder
        set aside, found again by the next sweep: `CacheFolders.leftovers`)."""
        pending = set(self._removals.pending())
        for path in paths:
            if path in pending:
                continue
            if not engine_disk.remove_tree(path, max_entries=self._removals.max_entries):
                self._removals.add(path)

    def _adopt_folders(self, replica_id: str, pid: int, recorded_scratch: object) -> None:
        """Take on the folders of an engine a previous agent started: its adapters are staged there from now on,
        its scratch is measured (`check_disk`), and both go when it does. The scratch folder is the one its record
        names (`sandbox.recorded_scratch_folder`), present or not.

        NOTE: only for an older agent's record, which names none, the path is the TMPDIR of the engine's environment
        block, which the engine may rewrite, taken only if its owner file (the engine's too) says this agent made it
        for this replica (`sandbox.is_scratch_folder`): an engine that removed that file, or rewrote its TMPDIR, is
        then measured only in its cache folder, until it ends."""
        adapter_dir = self.data_dir / "engine-adapters" / sandbox.folder_name(replica_id)
        if adapter_dir.is_dir():
            self._adapter_dirs[replica_id] = adapter_dir
        if recorded_scratch is not state_file.NOT_RECORDED:
            scratch_dir = sandbox.recorded_scratch_folder(recorded_scratch, replica_id)
            if scratch_dir is not None:
                self._scratch_dirs[replica_id] = scratch_dir
            return
        try:
            scratch_dir = Path(psutil.Process(pid).environ().get("TMPDIR", ""))
        except (psutil.Error, OSError):
            return
        if sandbox.is_scratch_folder(scratch_dir, replica_id, self.data_dir):
            self._scratch_dirs[replica_id] = scratch_dir

    def stage_adapter(self, replica_id: str, source: Path, *, keep: int | None = None) -> Path:
        """Where the replica's running engine reads an adapter from: a copy in its own adapters folder
        (`sandbox.stage_adapter`, at most `keep` copies there), or `source` itself when its engine is not confined."""
        with self._lock:
            folder = self._adapter_dirs.get(replica_id)
        return source if folder is None else sandbox.stage_adapter(Path(source), folder, keep=keep)

    def _step(self, replica: ManagedReplica) -> None:
        now = time.monotonic()
        if replica.is_final:
            return
        if replica.pid is None:
            if replica.launch_at and now >= replica.launch_at:
                self._launch(replica)
            return
        exit_code = process.exit_code(replica.process, replica.pid)
        if exit_code is not None:
            self._on_exit(replica, exit_code)
            return
        if replica.state == ReplicaState.STARTING:
            healthy = self._probe.healthy(replica.address)
            problem = None
            if healthy:
                problem = self._served_context_problem(replica, replica.command.max_model_len if replica.command else None)
            if problem is None:
                # NOTE: not healthy yet, or its context not said yet: asked again next poll, within the start's
                # timeout. Before, a healthy engine whose /v1/models never answered returned here before the timeout
                # was looked at, and stayed STARTING (its GPU held) for as long as the control plane let it.
                if now - replica.started_at > self.policy.startup_timeout_s:
                    logger.warning("replica %s: not %s after %.0fs", replica.spec.replica_id,
                                   "saying its context" if healthy else "healthy", now - replica.started_at)
                    self._kill_group(replica, signal.SIGKILL)
                return
            if problem:
                self._fail(replica, problem)
                return
            # The engine's own figures for what it allocated, for the control plane to check its estimate.
            replica.became_ready(now, read_engine_memory(replica.log_path))
            self._measure_chat_template_soon(replica, now)
            if self.on_ready is not None:
                self.on_ready(replica.spec.replica_id)
            logger.info(
                "replica %s READY at %s after %.1fs",
                replica.spec.replica_id, replica.address, now - replica.started_at,
            )  # fmt: skip
        elif replica.state == ReplicaState.READY:
            self._measure_chat_template_soon(replica, now)  # adopted, or an earlier try failed
            scraped_at = replica.metrics_scraped_at
            if scraped_at is None or time.monotonic() - scraped_at >= self.policy.metrics_interval_s:
                self._scrape(replica)
            checked_at = replica.health_checked_at
            interval_s = self.policy.ready_health_interval_s
            if replica.unanswered_idle_since is not None and not replica.unanswered_computing:
                interval_s = min(interval_s, self.policy.hung_after_s / 4)
            if checked_at is None or now - checked_at >= interval_s:
                replica.health_checked_at = now
                healthy = self._probe.health(replica.address)
                hung = False
                if healthy:
                    replica.num_unhealthy_checks = replica.num_unanswered_checks = 0
                    replica.unanswered_idle_since = None
                elif healthy is None:
                    replica.num_unanswered_checks += 1
                    hung = self._hung(replica, time.monotonic())
                else:
                    replica.num_unhealthy_checks += 1
                if (hung or replica.num_unhealthy_checks >= self.policy.max_unhealthy_ready_checks
                        or replica.num_unanswered_checks >= self.policy.max_unanswered_ready_checks):
                    logger.warning("replica %s: READY, and not healthy %d times in a row, unanswered %d: killed",
                                   replica.spec.replica_id, replica.num_unhealthy_checks, replica.num_unanswered_checks)
                    replica.unhealthy_when_ready = True
                    self._kill_group(replica, signal.SIGKILL)  # its exit, seen next, restarts it as a crash
                    return
            if replica.ready_at and now - replica.ready_at > self.policy.stable_after_s:
                replica.num_consecutive_crashes = 0
        elif replica.state == ReplicaState.DRAINING:
            if replica.kill_deadline_at is None:
                scraped = self._scrape(replica)
                idle = scraped and replica.metrics.num_running == 0 and replica.metrics.num_waiting == 0
                if idle or now >= (replica.drain_deadline_at or now):
                    grace_s = self.policy.idle_stop_grace_s if idle else self.policy.stop_timeout_s
                    self._kill_group(replica, signal.SIGTERM)
                    replica.terminated(now, grace_s)
                    logger.info(
                        "replica %s: %s, SIGTERM %.2fs after the drain began (SIGKILL in %.1fs)",
                        replica.spec.replica_id, "idle" if idle else "drain timeout",
                        now - replica.draining_since, grace_s,
                    )  # fmt: skip
            elif now >= replica.kill_deadline_at:
                self._kill_group(replica, signal.SIGKILL)
                replica.killed = True
                logger.info(
                    "replica %s: still running %.1fs after SIGTERM, SIGKILL",
                    replica.spec.replica_id, now - replica.terminated_at,
                )  # fmt: skip

    def _hung(self, replica: ManagedReplica, now: float) -> bool:
        """Whether a READY engine whose /health just went unanswered is hung: silent for `hung_after_s` while its
        processes used under `hung_max_cpu_share` of one core. One that computed meanwhile is busy: its silence
        counts again from now."""
        cpu_s = process.cpu_seconds(replica.spec.replica_id, self.data_dir)
        if cpu_s is None:
            return False  # NOTE: what it computes unknown: never taken for hung (`max_unanswered_ready_checks` stands)
        since = replica.unanswered_idle_since
        if since is None or cpu_s - replica.unanswered_idle_cpu_s > self.policy.hung_max_cpu_share * (now - since):
            replica.unanswered_idle_since, replica.unanswered_idle_cpu_s = now, cpu_s
            # NOTE: busy, asked again at `ready_health_interval_s`, not sooner: each unanswered ask holds the poll
            # (a starting engine's READY on a cold call's path among what it does) for the whole `health_timeout_s`.
            replica.unanswered_computing = since is not None
            return False
        if now - since < self.policy.hung_after_s:
            return False
        logger.warning("replica %s: READY, its /health unanswered for %.0f s while its processes used %.2f CPU "
                       "seconds: hung", replica.spec.replica_id, now - since, cpu_s - replica.unanswered_idle_cpu_s)
        return True

    def _served_context_problem(self, replica: ManagedReplica, billed: int | None) -> str | None:
        """Why a healthy engine may not turn READY: it serves more context than `billed`, the context the control plane
        reserves and bills its calls by (`engine.engine_context_length`: what it was launched with, for a launch); ""
        when it does not, None when it has not said yet.

        NOTE: defence in depth. vLLM serves no more than `--max-model-len`; a way past it nobody listed (a vLLM
        upgrade, a model format read otherwise) would bill each call by a smaller context than it was served with."""
        if billed is None:
            return ""  # a stand-in engine's command: nothing was launched with a context to check
        try:
            served = self._probe.served_context(replica.address, replica.spec.engine_api_key)
        except ValueError as exc:
            return f"its engine did not say the context it serves ({exc}); it may serve more than its calls are billed by"
        if served is None:
            return None
        if served > billed:
            return (f"its engine serves a context of {served} tokens, more than the {billed} its "
                    "calls are billed by")
        return ""

    def _adopted_context_problem(self, replica: ManagedReplica, record: dict) -> str | None:
        """`_served_context_problem` of a healthy engine a previous agent left running, against the context its calls
        are billed by (`engine.engine_context_length` of its spec: the desired one handed to `recover`, else the one
        recorded with it): "" when it serves no more, None when it did not say in time (not adopted, as one not
        healthy).

        NOTE: before, an adopted engine was READY unchecked: one an older agent had launched with no
        `--max-model-len` served what vLLM derived, past the figure its calls were reserved and billed by."""
        command = replica.command
        if command is None or (state_file.LAUNCHED_CONTEXT_KEY in record and command.max_model_len is None):
            return ""  # a stand-in engine's command: nothing was launched with a context to check
        command.max_model_len = engine.engine_context_length(replica.spec, replica.model_path)
        return self._served_context_problem(replica, command.max_model_len)

    def _launch(self, replica: ManagedReplica) -> None:
        spec = replica.spec
        if self.sandbox_mode == sandbox.SandboxMode.REQUIRED and not self.sandbox_abi:
            self._fail(replica, f"the engine cannot be confined ({sandbox.MODE_ENV}=required): {self.sandbox_missing}")
            return
        if self.sandbox_mode == sandbox.SandboxMode.REQUIRED and sandbox.namespaces_missing():
            self._fail(replica, f"the engine cannot have namespaces of its own ({sandbox.MODE_ENV}=required): "
                                f"{sandbox.namespaces_missing()}")  # fmt: skip
            return
        command = self._prepared.pop(spec.replica_id, None)  # sent to the zygote ahead (`_send_due_to_zygote`)
        built = None
        if command is None:
            built = self._built.get(spec.replica_id)
            if built is None or built[0] is not replica:
                return  # NOTE: due since this poll built commands: the next poll builds it (`_build_due`), then launches
            if isinstance(built[1], Exception):
                del self._built[spec.replica_id]
                raise built[1]
            command = built[1]
        port = command.port
        if self.standby is not None and not replica.avoid_standby and server_args(command) is not None:
            if self.standby.process is None:
                # NOTE: none is kept right after a handoff (the refill waits for quiet engines), but one
                # spawned now is still ready sooner than a plain start, which on CPU imports vLLM three
                # times (API server, EngineCore, worker) where the standby imports it once and forks.
                self.standby.ensure()
            if self.standby.warming and time.monotonic() - self.standby.spawned_at < self.policy.standby_wait_s:
                replica.progress = f"starting engine ({self.standby.label})"
                return  # launch_at stays due, and its built command: the next poll tries again
        if built is not None:
            del self._built[spec.replica_id]
            command = self._confined(replica, command)
        # NOTE: never the agent's own environment: it holds the fleet's credentials (`engine_environment`).
        env = {**engine_environment(), **command.env, REPLICA_ENV_MARKER: spec.replica_id,
               DATA_DIR_ENV_MARKER: str(self.data_dir)}
        with open(replica.log_path, "ab") as log:
            started = None
            if self.standby is not None and not replica.avoid_standby and self.standby.can_take(command):
                log.write(f"\n==> launch {process.timestamp()} on the {self.standby.label}: {' '.join(command.argv)}\n".encode())
                log.flush()
                started = self.standby.hand_off(spec.replica_id, command, self._handoff_env(command), replica.log_path)
            if started is None:
                log.write(f"\n==> launch {process.timestamp()}: {' '.join(command.argv)}\n".encode())
                log.flush()
            replica.from_standby = started is not None
            started = started or process.spawn(
                command.argv, env, log, die_with_agent=self.policy.kill_children_on_agent_death
            )
        replica.launched(command, started, time.monotonic())
        logger.info(
            "replica %s: launched pid %s on port %s%s",
            spec.replica_id, started.pid, port, f" ({self.standby.label})" if replica.from_standby else "",
        )  # fmt: skip
        self._save_state()

    def _on_exit(self, replica: ManagedReplica, exit_code: int) -> None:
        now = time.monotonic()
        self._kill_group(replica, signal.SIGKILL)  # reap workers the engine left behind
        self._drop_scratch(replica.spec.replica_id)
        if replica.state == ReplicaState.DRAINING:
            logger.info(
                "replica %s STOPPED: drain began %.2fs ago, SIGTERM %s, exit seen %.2fs after it (%s, code %s)",
                replica.spec.replica_id, now - replica.draining_since,
                f"{replica.terminated_at - replica.draining_since:.2f}s after it" if replica.terminated_at else "never sent",
                now - (replica.terminated_at or replica.draining_since),
                "killed" if replica.killed else "its own exit", exit_code,
            )  # fmt: skip
            replica.exited()
            replica.stopped()
            self._save_state()
            if self.on_stopped is not None:
                self.on_stopped(replica.spec.replica_id)
            return
        replica.exited()
        if exit_code == sandbox.EXIT_NAMESPACES_REFUSED and self.sandbox_mode != sandbox.SandboxMode.OFF:
            self._namespaces_refused(replica)
            return
        reason = replica.crashed(exit_code)
        if replica.num_consecutive_crashes >= self.policy.max_consecutive_crashes:
            log_tail = process.log_tail(replica.log_path, self.policy.num_log_lines_in_reason)
            self._fail(replica, f"{reason} {replica.num_consecutive_crashes} times in a row:\n{log_tail}")
            return
        backoff = self.policy.backoff_after(replica.num_consecutive_crashes)
        replica.restart_after_crash(reason, backoff, time.monotonic())
        logger.warning("replica %s: %s; restart %d in %.1fs", replica.spec.replica_id, reason, replica.num_restarts, backoff)
        self._save_state()

    def _namespaces_refused(self, replica: ManagedReplica) -> None:
        """Its engine found namespaces refused that this agent had found working (`sandbox.EXIT_NAMESPACES_REFUSED`):
        the replica fails with the engine's reason, not restarted into the same refusal, and the node's fact is tested
        again, off the lock and when due (`sandbox.NamespacesFact`): the next launches go by it, and the next
        registration reports it.

        NOTE: the exit is the tenant's to forge: it fails this replica (its engine cannot be trusted either way), and
        changes the node's fact only where the agent's own tests find the kernel refusing."""
        sandbox.NAMESPACES.engine_refused()
        log_tail = process.log_tail(replica.log_path, self.policy.num_log_lines_in_reason)
        logger.warning("replica %s: its engine's namespaces were refused; the agent tests them again", replica.spec.replica_id)
        self._fail(replica, "its engine's namespaces were refused where this agent had found them working (the agent "
                            f"tests them again):\n{log_tail}")  # fmt: skip

    def _fail(self, replica: ManagedReplica, reason: str) -> None:
        self._kill_group(replica, signal.SIGKILL)
        self._drop_scratch(replica.spec.replica_id)
        replica.failed(reason)
        logger.error("replica %s FAILED: %s", replica.spec.replica_id, reason.splitlines()[0] if reason else "")
        self._save_state()

    def _kill_group(self, replica: ManagedReplica, sig: signal.Signals) -> None:
        process.kill_group(replica.pid, replica.process, replica.spec.replica_id, self.data_dir, sig)

    def _scrape(self, replica: ManagedReplica) -> bool:
        metrics = self._probe.metrics(replica.address, replica.spec.engine_api_key)
        if metrics is None:
            return False
        replica.took_metrics(metrics, time.monotonic())
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
                while process.exit_code(replica.process, replica.pid) is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                self._kill_group(replica, signal.SIGKILL)
                self._drop_scratch(replica.spec.replica_id)
                replica.stopped()
            for replica in self._replicas.values():
                if not replica.is_final:
                    replica.stopped()
            self._save_state()
        self._removals.close(REMOVALS_SHUTDOWN_S)
        self._probe.close()

    def detach(self) -> None:
        """Stop supervising but leave engines running, for the next agent on this data dir to adopt."""
        self.stop_monitor()
        self._stop_standby()  # a waiting standby is nobody's engine: it never outlives the agent
        with self._lock:
            self._save_state()
        self._probe.close()

    def recover(self, desired: dict[str, ReplicaSpec] | None = None) -> tuple[list[str], list[str]]:
        """Adopt engines a previous agent left running if healthy and desired; kill all others.

        `desired=None` adopts every healthy engine (reconcile drains the unwanted later).
        Returns (adopted replica ids, killed replica ids).
        """
        adopted, killed = [], []
        records = self.state.records()
        with self._lock:
            # the scratch folders the records name of engines not adopted, and those made for launches whose engines
            # were never recorded: removed below
            ended_scratch = [sandbox.recorded_scratch_folder(path, replica_id)
                             for replica_id, path in self.state.made_scratch()]
            for replica_id, record in records.items():
                if replica_id in self._replicas:
                    continue
                recorded_scratch = state_file.recorded_scratch(record)
                if recorded_scratch is not state_file.NOT_RECORDED:
                    ended_scratch.append(sandbox.recorded_scratch_folder(recorded_scratch, replica_id))
                try:
                    replica = state_file.replica_from_record(replica_id, record, self.logs_dir, desired)
                except (ValueError, KeyError, TypeError, AttributeError):
                    # NOTE: a record this version cannot read (an upgrade changed the spec): its engine is not adopted
                    # (the orphan sweep below kills it); raising here crash-looped the agent at every start.
                    logger.exception("replica %s: its record cannot be read; its engine is not adopted", replica_id)
                    killed.append(replica_id)
                    continue
                pid = replica.pid
                wanted = desired is None or replica_id in desired
                alive = pid is not None and process.is_replica_process(pid, replica_id)
                problem = None
                if wanted and alive and self._probe.healthy(replica.address):
                    problem = self._adopted_context_problem(replica, record)
                if problem is not None:
                    replica.became_ready(time.monotonic())
                    replica.started_at = time.monotonic()
                    if record.get("sleeping"):
                        # NOTE: an asleep engine answers /health: adopted as READY, it was routed calls and never
                        # woken (a RUN found it READY already).
                        replica.fell_asleep()
                    self._replicas[replica_id] = replica
                    self._adopt_folders(replica_id, pid, recorded_scratch)
                    adopted.append(replica_id)
                    logger.info("adopted replica %s (pid %s)", replica_id, pid)
                    if problem:
                        self._fail(replica, problem)  # NOTE: reported FAILED with the reason, not silently replaced
                    elif replica.command is not None and replica.command.max_model_len is not None:
                        self._adopted_unchecked[replica_id] = 0
                else:
                    killed.append(replica_id)
                    if alive:
                        self._kill_group(replica, signal.SIGKILL)
            # Whatever else carries our data-dir marker but is not ours now is an orphan.
            owned = {replica.pid for replica in self._replicas.values() if replica.pid}
            if self.standby is not None and self.standby.pid is not None:
                owned.add(self.standby.pid)
            process.kill_orphans(self.data_dir, owned)
            # The folders of engines no longer running (a killed agent's, and those killed above) go: renamed aside
            # here, removed on the removals' thread. NOTE: before, removed here, under the lock and with no bound on a
            # walk: a killed agent's engine that left a deep tree held the new agent's start (its first heartbeat,
            # every launch) for as long as the walk took.
            kept = {*self._adapter_dirs.values(), *self._scratch_dirs.values()}
            aside_now = set(sandbox.scratch_set_aside_of(self.data_dir))
            leftovers = []
            for folder in sorted((self.data_dir / "engine-adapters").glob("*")):
                if folder not in kept:
                    leftovers.append(folder if folder.name.startswith(engine_disk.SET_ASIDE_PREFIX)
                                     else engine_disk.set_aside(folder))
            # NOTE: by the records first (an engine may have removed its owner file), then by owner files, for what no
            # record names (`sandbox.scratch_folders_of`). A folder named twice is renamed once (then it is gone).
            for folder in dict.fromkeys([*filter(None, ended_scratch), *sandbox.scratch_folders_of(self.data_dir)]):
                if folder not in kept and folder not in aside_now:
                    leftovers.append(sandbox.set_scratch_aside(folder, self.data_dir))
            leftovers.extend(aside_now)
            self._save_state()
        self._removals.add(*leftovers)
        if killed:
            logger.info("killed replicas left by a previous agent: %s", killed)
        return adopted, killed

    def _stop_standby(self) -> None:
        with self._lock:
            if self.standby is not None:
                self.standby.stop()

    def _save_state(self) -> bool:
        """Write the state file (`StateFile.save`): False when it could not be (logged), never raises."""
        return self.state.save(self._replicas.values(), self._scratch_dirs)
