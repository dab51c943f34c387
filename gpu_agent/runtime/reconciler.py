"""Applying the control plane's desired replicas to this node: fetch, start, drain, forget.

Each heartbeat's answer lists the replicas the node should run (`ReplicaSpec`, with a RUN, SLEEP or
DRAIN action; SLEEP puts a READY engine to sleep, RUN wakes a sleeping one, `Supervisor.sleep`/`wake`). A new one first has its weights fetched on its own thread (`_Pull`, reported as STARTING
with the download's progress), is checked against what the model's config allows, and is then
handed to the supervisor without the source's credentials. A replica no longer wanted is drained;
a finished one is forgotten, and its weights unpinned, once the control plane has seen its final
state. `replica_statuses` is what the next heartbeat reports. Replicas the agent stops unasked (the control plane
refuses the node: `stop_unasked`) are reported no more: an answer that still wants one starts it again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpu_agent.protocol import (
    FINAL_REPLICA_STATES,
    AdapterSpec,
    ReplicaAction,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
)
from gpu_agent.runtime.adapters import ReplicaAdapters
from gpu_agent.runtime.model_info import ModelReading, spec_problem
from gpu_agent.runtime.speculative import draft_problem, needs_draft, with_local_draft
from gpu_agent.runtime.supervisor import Supervisor
from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_access import FetchStopped, SourceAccess, WeightsError

logger = logging.getLogger(__name__)


def wanted_copies(desired: list[ReplicaSpec]) -> set[tuple[str, str]]:
    """The (source, weights scope) of every copy the desired replicas name: weights, draft and adapters, whatever
    their action (a sleeping or draining replica's are still its own). What `WeightsCache.release_unwanted` keeps."""
    wanted = set()
    for spec in desired:
        wanted.add((spec.model_source, spec.weights_scope))
        if spec.speculative is not None and spec.speculative.draft_source:
            wanted.add((spec.speculative.draft_source, spec.speculative.draft_weights_scope))
        wanted.update((adapter.source, adapter.weights_scope) for adapter in spec.adapters)
    return wanted


@dataclass(slots=True)
class _Pull:
    """A replica whose weights are being fetched before its engine starts."""

    spec: ReplicaSpec
    progress: str = "loading weights"
    progress_percent: float | None = None
    failure_reason: str = ""
    failure_permanent: bool = False  # the spec cannot run on this model: retrying would fail alike
    done: bool = False
    cancelled: bool = False
    download_s: float | None = None  # how long the fetch took, once it is done
    # Set with `cancelled`: a download in progress ends, and the disk reserved for it is freed.
    stop: threading.Event = field(default_factory=threading.Event)


class Reconciler:
    """Owns the replicas between "desired" and "running": pulls in progress and the weights they pin."""

    def __init__(self, supervisor: Supervisor, weights: WeightsCache, *, wake: threading.Event) -> None:
        self.supervisor = supervisor
        self.weights = weights
        # Set when there is news the control plane should hear now rather than at the next interval.
        self._wake = wake
        self._pulls: dict[str, _Pull] = {}
        self._pins: dict[str, Path] = {}  # replica id -> cached model it uses
        self._draft_pins: dict[str, Path] = {}  # replica id -> cached draft model it uses
        self._reported_terminal: set[str] = set()
        # Replicas stopped without the control plane asking (`stop_unasked`), left out of every report.
        self._stopped_unasked: set[str] = set()
        self._lock = threading.Lock()
        self.adapters = ReplicaAdapters(self._fetch_adapter, wake=wake, stage=supervisor.stage_adapter)

    def adopted(self, replica_ids: list[str]) -> None:
        """Pin the weights (and draft) of engines adopted from a previous agent, as a pull pins its own until its
        replica ends. NOTE: unpinned, a running engine's model was the cache's first victim under pressure (its
        manifest as old as its last fetch), and its next crash restarted from a deleted folder."""
        for replica_id in replica_ids:
            replica = self.supervisor.get(replica_id)
            if replica is None:
                continue
            paths = [replica.model_path]
            if needs_draft(replica.spec):  # its spec names the local copy the pull made (`with_local_draft`)
                paths.append(Path(replica.spec.speculative.draft_source))
            for path in paths:
                self.weights.pin(path)
            with self._lock:
                self._pins[replica_id] = paths[0]
                if len(paths) > 1:
                    self._draft_pins[replica_id] = paths[1]

    def mark_reported(self, statuses: list[ReplicaStatus]) -> None:
        """The control plane has heard these statuses: a final one may now be forgotten once dropped."""
        with self._lock:
            for status in statuses:
                if status.state in FINAL_REPLICA_STATES:
                    self._reported_terminal.add(status.replica_id)

    def stop_unasked(self) -> int:
        """Drain every replica and cancel every pull, unasked: the control plane refuses this node (`Agent.heartbeat_once`).
        Returns how many were not stopping already.

        NOTE: they are left out of the heartbeats from now on (`replica_statuses`), and forgotten once stopped at the
        next answer that does not drain or sleep them (`_forget_stopped_unasked`), so an answer that wants one again,
        the node taken back before the sweep moved it elsewhere, starts it afresh (`reconcile`). Reported STOPPED, the
        control plane took that as final (a replica's final state is its own) and replaced it cold, and an answer still
        wanting a replica this agent knew as STOPPED never started it. Never forgotten here, on a refusal: a refusal
        that outlasted the drain forgot them, and the answer that took the node back, draining or sleeping one, found
        nothing to report (a draining replica kept its placement until the drain sweep, a sleeping one was held)."""
        with self._lock:
            pulling = {replica_id for replica_id, pull in self._pulls.items() if not pull.done}
        running = {replica_id for replica_id in self.supervisor.replica_ids()
                   if (replica := self.supervisor.get(replica_id)) is not None and not replica.is_final}
        with self._lock:
            stopping = (running | pulling) - self._stopped_unasked
            self._stopped_unasked |= running | pulling
        self.reconcile([], answered=False)
        return len(stopping)

    def nothing_runs(self) -> bool:
        """Whether no engine here runs, starts or drains and no pull is in progress (after `stop_unasked`: what a
        retired node waits for before it removes what its engines left, `Agent.heartbeat_once`). The weights of those
        ended are unpinned (`reconcile`)."""
        self.reconcile([], answered=False)
        with self._lock:
            if any(not pull.done for pull in self._pulls.values()):
                return False
        return all(replica is None or replica.is_final
                   for replica in map(self.supervisor.get, self.supervisor.replica_ids()))

    def _forget_stopped_unasked(self, desired_by_id: dict[str, ReplicaSpec]) -> None:
        """Forget each replica stopped unasked once its engine or pull is gone, unless the answer drains or sleeps it
        (then it is reported, as any drained replica): not wanted, nothing more to say of it; wanted, `reconcile`
        starts it again as a replica it does not know."""
        with self._lock:
            unasked = set(self._stopped_unasked)
        for replica_id in unasked:
            spec = desired_by_id.get(replica_id)
            if spec is not None and spec.action != ReplicaAction.RUN:
                with self._lock:
                    self._stopped_unasked.discard(replica_id)
                continue
            replica = self.supervisor.get(replica_id)
            with self._lock:
                pull = self._pulls.get(replica_id)
            if (replica is not None and not replica.is_final) or (pull is not None and not pull.done):
                continue  # still stopping: the next answer decides
            if replica is not None:
                self.supervisor.forget(replica_id)
                self._release_weights(replica_id)
            with self._lock:
                self._pulls.pop(replica_id, None)
                self._stopped_unasked.discard(replica_id)
                self._reported_terminal.discard(replica_id)

    def reconcile(self, desired: list[ReplicaSpec], *, answered: bool = True) -> None:
        """Start missing replicas, drain unwanted ones, forget finished ones the control plane dropped. `answered`:
        `desired` is the control plane's answer (not `stop_unasked`'s nothing)."""
        desired_by_id = {spec.replica_id: spec for spec in desired}
        if answered:
            self._forget_stopped_unasked(desired_by_id)
        known = set(self.supervisor.replica_ids())
        with self._lock:
            pulling = set(self._pulls)
        for spec in desired:
            if spec.action == ReplicaAction.RUN and spec.replica_id not in known | pulling:
                self._begin_start(spec)
            elif spec.replica_id in known:
                self.supervisor.refresh_secrets(spec)
                self.supervisor.check_adopted_context(spec)
                self.supervisor.replace_if_billed_less(spec)
                replica = self.supervisor.get(spec.replica_id)
                if replica is not None and replica.state == ReplicaState.READY:
                    if spec.action == ReplicaAction.SLEEP:
                        self.supervisor.sleep(spec.replica_id)
                    else:
                        self.adapters.sync(spec, replica.address, replica.num_restarts)
                elif replica is not None and replica.state == ReplicaState.SLEEPING and spec.action == ReplicaAction.RUN:
                    self.supervisor.wake(spec.replica_id)
        for replica_id in known | pulling:
            spec = desired_by_id.get(replica_id)
            if spec is None or spec.action == ReplicaAction.DRAIN:
                self._drain(replica_id, spec)
        # Forget a finished replica once the control plane has seen its final state and dropped it.
        for replica_id in list(known):
            replica = self.supervisor.get(replica_id)
            if (
                replica is not None
                and replica.state in FINAL_REPLICA_STATES
                and replica_id not in desired_by_id
                and replica_id in self._reported_terminal
            ):
                self.supervisor.forget(replica_id)
                self._release_weights(replica_id)
        with self._lock:
            for replica_id, pull in list(self._pulls.items()):
                if pull.done and replica_id not in desired_by_id and replica_id in self._reported_terminal:
                    del self._pulls[replica_id]
            self._reported_terminal &= (
                set(desired_by_id) | set(self.supervisor.replica_ids()) | set(self._pulls)
            )
        for replica_id in self.supervisor.replica_ids():
            replica = self.supervisor.get(replica_id)
            if replica is not None and replica.state in FINAL_REPLICA_STATES:
                self._release_weights(replica_id)

    def cancel_pulls(self) -> None:
        """Let no pull in progress start its engine (the agent is stopping)."""
        with self._lock:
            for pull in self._pulls.values():
                pull.cancelled = True
                pull.stop.set()

    def _begin_start(self, spec: ReplicaSpec) -> None:
        pull = _Pull(spec=spec)
        with self._lock:
            self._pulls[spec.replica_id] = pull
        logger.info("replica %s: fetching %s", spec.replica_id, spec.model_source)
        threading.Thread(
            target=self._pull_then_start, args=(pull,), name=f"pull-{spec.replica_id}", daemon=True
        ).start()

    def _pull_then_start(self, pull: _Pull) -> None:
        spec = pull.spec

        def on_progress(done: int, total: int) -> None:
            if total:
                pull.progress_percent = round(100.0 * done / total, 1)
                pull.progress = f"loading weights {pull.progress_percent:.0f}%"

        fetch_from = time.monotonic()
        # Unpinned again if the engine does not start. NOTE: each fetch pins its copy before it returns (`pin=True`):
        # pinned here after it, a copy could be evicted in between by another pull making room.
        pinned: list[Path] = []
        try:
            path = self.weights.fetch(
                spec.model_source, access=SourceAccess.for_replica(spec), on_progress=on_progress, stop=pull.stop,
                pin=True,
            )
            pinned.append(path)
            if needs_draft(spec):  # fetched like the weights, with the same access rules
                draft = self.weights.fetch(
                    spec.speculative.draft_source, access=SourceAccess.for_draft(spec), stop=pull.stop, pin=True
                )
                pinned.append(draft)
                spec = with_local_draft(spec, draft)
            pull.download_s = round(time.monotonic() - fetch_from, 3)
        except FetchStopped:  # drained or the agent stopping: not the replica's failure (it reports STOPPED)
            logger.info("replica %s: its download stopped: the replica is no longer wanted", spec.replica_id)
            self._unpin(pinned)
            pull.done = True
            return
        except (WeightsError, ValueError) as exc:  # NOTE: their messages carry no secrets
            logger.warning("replica %s: fetching weights failed: %s", spec.replica_id, exc)
            pull.failure_reason = f"fetching weights from {spec.model_source} failed: {exc}"
            self._unpin(pinned)
            pull.done = True
            return
        except OSError as exc:  # the node's own trouble (a full disk): the system's words, no paths
            logger.exception("replica %s: fetching weights failed", spec.replica_id)
            pull.failure_reason = (
                f"fetching weights from {spec.model_source} failed: {exc.strerror or 'I/O error'}"
            )
            self._unpin(pinned)
            pull.done = True
            return
        except Exception:
            # Anything else may quote what it should not (an endpoint, a library's internals):
            # the operator's log has it, the customer gets a plain reason.
            logger.exception("replica %s: fetching weights failed", spec.replica_id)
            pull.failure_reason = (
                f"fetching weights from {spec.model_source} failed (the node's log has details)"
            )
            self._unpin(pinned)
            pull.done = True
            return
        # NOTE: checked before launching: vLLM would refuse the same spec only after loading for a
        # minute; the replica fails now, with a reason the endpoint shows, and no engine is started.
        reading = None
        try:
            reading = self._read_model(pull, path)
            problem = reading.problem or spec_problem(spec, reading.info) or (
                draft_problem(path, Path(spec.speculative.draft_source)) if needs_draft(spec) else ""
            )
        except Exception:  # NOTE: whatever the tenant's files hold, the pull ends: pins released, replica reported
            logger.exception("replica %s: checking the model failed", spec.replica_id)
            problem = "checking the model's files failed (the node's log has details)"
        if reading is not None and reading.unsettled:  # not refused: another try (the control plane's) may read them
            if not pull.stop.is_set():  # else drained meanwhile
                logger.warning("replica %s: not starting: %s", spec.replica_id, reading.unsettled)
                pull.failure_reason = (f"the model's files could not be checked on this node ({reading.unsettled}; "
                                       f"tried {1 + len(self.weights.unsettled_retry_s)} times)")  # fmt: skip
            self._unpin(pinned)
            pull.done = True
            self._wake.set()
            return
        if problem:
            logger.warning("replica %s: not starting: %s", spec.replica_id, problem)
            self._unpin(pinned)
            pull.failure_reason = problem
            pull.failure_permanent = True
            pull.done = True
            self._wake.set()
            return
        # The engine never needs the source's credentials: nothing past this point (the supervisor,
        # its state file) holds them.
        spec = dataclasses.replace(spec, credentials=None)
        with self._lock:
            if pull.cancelled:
                self._unpin(pinned)
                pull.done = True
                return
            self._pins[spec.replica_id] = path
            if len(pinned) > 1:
                self._draft_pins[spec.replica_id] = pinned[1]
            # NOTE: start() only schedules; the supervisor's monitor thread forks the engine,
            # because PR_SET_PDEATHSIG would kill it when this short-lived thread ends.
            self.supervisor.start(spec, path).download_s = pull.download_s
            del self._pulls[spec.replica_id]
        self._wake.set()  # report STARTING now: the console and held requests show "starting engine"

    def _read_model(self, pull: _Pull, path: Path) -> ModelReading:
        """What the model's files say; where a reading gives no answer (`ModelReading.unsettled`: the header reader
        past its wall time on a loaded node, or killed), read again after each of `WeightsCache.unsettled_retry_s`,
        the replica STARTING with the reason in its progress, until the pull is stopped.

        NOTE: before, such a reading refused the model (`failure_permanent`) for the agent's life on that node."""
        reading = self.weights.read_model(path)
        for delay_s in self.weights.unsettled_retry_s:
            if not reading.unsettled:
                break
            pull.progress = f"checking the model's files again in {delay_s:.0f} s ({reading.unsettled})"
            self._wake.set()
            if pull.stop.wait(delay_s):
                break
            pull.progress = "checking the model's files"
            reading = self.weights.read_model(path)
        return reading

    def _drain(self, replica_id: str, spec: ReplicaSpec | None) -> None:
        with self._lock:
            pull = self._pulls.get(replica_id)
            if pull is not None:
                pull.cancelled = True
                pull.stop.set()
                pull.done = True
                pull.progress = ""
                return
        replica = self.supervisor.get(replica_id)
        if replica is not None and replica.state not in (*FINAL_REPLICA_STATES, ReplicaState.DRAINING):
            logger.info("replica %s: draining (%s)", replica_id, "DRAIN" if spec else "no longer desired")
            self.supervisor.drain(replica_id, timeout_s=spec.drain_timeout_s if spec else None)

    def _unpin(self, paths: list[Path]) -> None:
        for path in paths:
            self.weights.unpin(path)

    def _release_weights(self, replica_id: str) -> None:
        with self._lock:
            paths = [self._pins.pop(replica_id, None), self._draft_pins.pop(replica_id, None)]
        self._unpin([path for path in paths if path is not None])

    def _fetch_adapter(self, adapter: AdapterSpec) -> Path:
        access = SourceAccess(credentials=adapter.credentials, scope=adapter.weights_scope)
        return self.weights.fetch_adapter(adapter.source, access=access)

    def replica_statuses(self) -> list[ReplicaStatus]:
        with self._lock:
            pulls = [pull for replica_id, pull in self._pulls.items() if replica_id not in self._stopped_unasked]
            unasked = set(self._stopped_unasked)
        statuses = [status for status in self.supervisor.statuses() if status.replica_id not in unasked]
        for pull in pulls:
            if pull.failure_reason:
                state = ReplicaState.FAILED
            elif pull.cancelled:
                state = ReplicaState.STOPPED
            else:
                state = ReplicaState.STARTING
            statuses.append(
                ReplicaStatus(
                    replica_id=pull.spec.replica_id,
                    state=state,
                    failure_reason=pull.failure_reason,
                    failure_permanent=pull.failure_permanent,
                    progress=pull.progress if state == ReplicaState.STARTING else "",
                    progress_percent=pull.progress_percent if state == ReplicaState.STARTING else None,
                    download_s=pull.download_s,
                )
            )
        self.adapters.report(statuses)
        return statuses

    def wait_for(self, replica_id: str, states: tuple[ReplicaState, ...], timeout_s: float) -> ReplicaStatus:
        """Poll until a replica reaches one of `states` (tests and benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for status in self.replica_statuses():
                if status.replica_id == replica_id and status.state in states:
                    return status
            time.sleep(0.2)
        raise TimeoutError(f"replica {replica_id} did not reach {states} in {timeout_s}s")
