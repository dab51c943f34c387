"""One supervised replica: what the agent knows of it, the states it moves through, what it reports.

    STARTING --healthy--> READY --drain--> DRAINING --exit--> STOPPED
       ^  |                 |  ^
       |  |            sleep|  |wake (a failed wake: STARTING, a restart)
       |  |                 v  |
       |  |               SLEEPING --drain--> DRAINING (GPU engines with sleep mode only)
       |  +--crash----------+--> STARTING again after a backoff, FAILED after too many in a row

Each method here is one transition and touches only this object; the supervisor
(`supervisor.py`) decides when to take it and does the I/O around it (processes, probes,
the state file). STOPPED and FAILED are final (`protocol.FINAL_REPLICA_STATES`).
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpu_agent.protocol import (
    FINAL_REPLICA_STATES,
    ChatTemplateTokens,
    EngineMemory,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
)
from gpu_agent.runtime.engine import EngineCommand
from gpu_agent.runtime.probes import EngineMetrics


@dataclass(slots=True)
class CheckStreak:
    """Checks in a row of an engine that each found one thing wrong, and since when (monotonic): a rule stops the
    engine only once the run is both that many checks and that many seconds long (one bad check is noise)."""

    num_checks: int = 0
    since: float | None = None  # the first check of the run

    def record(self, wrong: bool, now: float) -> None:
        """One more check: the run grows while it finds the thing wrong, and ends at the first that does not."""
        if not wrong:
            self.num_checks, self.since = 0, None
            return
        self.num_checks += 1
        if self.since is None:
            self.since = now

    def lasted(self, num_checks: int, min_s: float, now: float) -> bool:
        """At least `num_checks` checks in a row and `min_s` seconds."""
        return self.since is not None and self.num_checks >= num_checks and now - self.since >= min_s

    def describe(self, now: float) -> str:
        return f"{self.num_checks} checks in a row, {now - (self.since or now):.0f} s"


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
    # The drain's clock (monotonic), logged at STOPPED: where scale to zero's seconds went.
    draining_since: float = 0.0
    terminated_at: float | None = None  # SIGTERM sent
    killed: bool = False  # SIGKILL sent because the engine outlived its grace
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    metrics_scraped_at: float | None = None
    # READY: its /health asked last (monotonic), the answers in a row that were not healthy, and whether it was killed
    # for them (its crash's reason says so).
    health_checked_at: float | None = None
    num_unhealthy_checks: int = 0
    num_unanswered_checks: int = 0  # in a row, within the probe's timeout (busy, or hung: `SupervisorPolicy`)
    # Since when (monotonic) its /health has gone unanswered while its processes computed next to nothing, and the CPU
    # seconds they had used then (`Supervisor._hung`); None while it answers, from its last ask while they compute.
    unanswered_idle_since: float | None = None
    unanswered_idle_cpu_s: float = 0.0
    unanswered_computing: bool = False  # its last unanswered ask found it computing: asked at the usual interval
    unhealthy_when_ready: bool = False
    disk_check_due_at: float | None = None  # its engine's folders measured next (monotonic; `Supervisor.check_disk`)
    # its engine's shared memory checks in a row whose walks were all incomplete (`Supervisor.check_disk`)
    incomplete_shm: CheckStreak = field(default_factory=CheckStreak)
    # its engine's disk checks in a row whose folders never settled (`engine_disk.measure`), and the most bytes one
    # of them counted
    unsettled_disk: CheckStreak = field(default_factory=CheckStreak)
    unsettled_disk_max_bytes: int = 0
    tokens_per_s: float = 0.0
    from_standby: bool = False  # the running engine is a standby that took this replica
    avoid_standby: bool = False  # a standby start never got READY: launch naively from now on
    engine_memory: EngineMemory | None = None  # what the running engine's log says it allocated
    download_s: float | None = None  # how long its weights took to fetch (the reconciler's pull)
    engine_start_s: float | None = None  # launch to READY, of the engine that first got READY
    sleep_call: str = ""  # "sleep" or "wake" while that call to the engine is in flight (its own thread)
    # What its model's chat template adds to a conversation, as its engine counted it once READY (`probes`).
    chat_template_tokens: ChatTemplateTokens | None = None
    # Its measure (`Supervisor._measure_chat_template`): one on its thread now, tries so far, the next not before.
    measuring: bool = False
    num_template_measures: int = 0
    measure_template_at: float = 0.0

    @property
    def num_incomplete_shm_checks(self) -> int:
        return self.incomplete_shm.num_checks

    @property
    def num_unsettled_disk_checks(self) -> int:
        return self.unsettled_disk.num_checks

    def set_state(self, state: ReplicaState) -> None:
        if state != self.state or not self.state_history:
            self.state = state
            self.state_history.append((state, time.time()))

    @property
    def address(self) -> str:
        return self.command.address if self.command else ""

    @property
    def is_final(self) -> bool:
        return self.state in FINAL_REPLICA_STATES

    def status(self) -> ReplicaStatus:
        alive = not self.is_final
        return ReplicaStatus(
            replica_id=self.spec.replica_id,
            state=self.state,
            address=self.address if self.state in (ReplicaState.READY, ReplicaState.DRAINING, ReplicaState.SLEEPING) else "",
            pid=self.pid if alive else None,
            num_running=self.metrics.num_running if alive else 0,
            num_waiting=self.metrics.num_waiting if alive else 0,
            kv_cache_usage=min(max(self.metrics.kv_cache_usage, 0.0), 1.0) if alive else 0.0,
            tokens_per_s=self.tokens_per_s if alive else 0.0,
            num_prefix_cache_queries=int(self.metrics.prefix_cache_queries_total) if alive else 0,
            num_prefix_cache_hits=int(self.metrics.prefix_cache_hits_total) if alive else 0,
            num_restarts=self.num_restarts,
            failure_reason=self.failure_reason,
            progress=self.progress if self.state == ReplicaState.STARTING else "",
            engine_memory=self.engine_memory if alive else None,
            download_s=self.download_s,
            engine_start_s=self.engine_start_s,
            chat_template_tokens=self.chat_template_tokens,
        )

    # -- transitions ------------------------------------------------------------------

    def schedule_launch(self, now: float) -> None:
        self.set_state(ReplicaState.STARTING)
        self.launch_at = now

    def launched(self, command: EngineCommand, process: subprocess.Popen, now: float) -> None:
        self.command = command
        self.process = process
        self.pid = process.pid
        self.started_at = now
        self.launch_at = 0.0
        self.ready_at = None
        self.metrics = EngineMetrics()
        self.metrics_scraped_at = None
        self.health_checked_at = self.unanswered_idle_since = None
        self.num_unhealthy_checks = self.num_unanswered_checks = 0
        self.unhealthy_when_ready = False
        self.engine_memory = None
        self.progress = "starting engine"
        # A measure the last engine never finished, or whose tries ran out, is tried afresh on this one.
        self.num_template_measures = 0
        self.measure_template_at = 0.0
        self.set_state(ReplicaState.STARTING)

    def became_ready(self, now: float, engine_memory: EngineMemory | None = None) -> None:
        self.set_state(ReplicaState.READY)
        self.ready_at = now
        if self.engine_start_s is None and self.started_at:
            self.engine_start_s = round(max(now - self.started_at, 0.0), 3)
        self.progress = ""
        self.engine_memory = engine_memory

    def fell_asleep(self) -> None:
        """Its engine answered `/sleep`: weights in host memory, KV cache freed, no requests taken."""
        self.set_state(ReplicaState.SLEEPING)
        self.metrics = EngineMetrics()
        self.metrics_scraped_at = None

    def woke(self, now: float) -> None:
        """Its engine answered `/wake_up`: READY again, the same process."""
        self.set_state(ReplicaState.READY)
        self.ready_at = now
        self.health_checked_at = self.unanswered_idle_since = None
        self.num_unhealthy_checks = self.num_unanswered_checks = 0

    def started_draining(self, now: float, timeout_s: float) -> None:
        self.set_state(ReplicaState.DRAINING)
        self.draining_since = now
        self.drain_deadline_at = now + timeout_s

    def terminated(self, now: float, grace_s: float) -> None:
        """SIGTERM was sent; SIGKILL follows after `grace_s` if the engine is still there."""
        self.terminated_at = now
        self.kill_deadline_at = now + grace_s

    def exited(self) -> None:
        """Its engine is gone (the supervisor reaped what it left)."""
        self.pid = None
        self.process = None
        self.kill_deadline_at = None
        self.terminated_at = None
        self.killed = False

    def crashed(self, exit_code: int) -> str:
        """Count a crash of its engine; returns the reason to report."""
        self.num_consecutive_crashes += 1
        reason = f"engine exited with code {exit_code}"
        if self.unhealthy_when_ready:
            reason = (f"engine not healthy while READY ({self.num_unhealthy_checks} health checks failed, "
                      f"{self.num_unanswered_checks} in a row unanswered: its EngineCore or a worker gone, as the OOM "
                      "killer leaves it, or hung): killed")
        if self.from_standby and self.ready_at is None:
            self.avoid_standby = True  # the handoff itself may be what fails: retry the plain way
            reason += " (started from the warm standby; retrying with a plain launch)"
        return reason

    def restart_after_crash(self, reason: str, backoff_s: float, now: float) -> None:
        self.num_restarts += 1
        self.launch_at = now + backoff_s
        self.failure_reason = reason
        self.progress = f"restarting engine in {backoff_s:.0f}s after a crash"
        self.set_state(ReplicaState.STARTING)

    def stopped(self) -> None:
        self.pid = None
        self.process = None
        self.launch_at = 0.0
        self.set_state(ReplicaState.STOPPED)

    def failed(self, reason: str) -> None:
        self.pid = None
        self.process = None
        self.launch_at = 0.0
        self.failure_reason = reason
        self.set_state(ReplicaState.FAILED)

    def took_metrics(self, metrics: EngineMetrics, now: float) -> None:
        if self.metrics_scraped_at is not None and now > self.metrics_scraped_at:
            delta = metrics.generation_tokens_total - self.metrics.generation_tokens_total
            self.tokens_per_s = max(delta, 0.0) / (now - self.metrics_scraped_at)
        self.metrics = metrics
        self.metrics_scraped_at = now
