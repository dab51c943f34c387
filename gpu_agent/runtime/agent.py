"""The agent loop: register, heartbeat, reconcile desired replicas against running ones.

    POST /agent/v1/register   RegisterRequest  -> RegisterResponse
    POST /agent/v1/heartbeat  Heartbeat        -> HeartbeatResponse (Bearer <node secret>)
    POST /agent/v1/watch                       -> WatchResponse     (Bearer <node secret>)

The node id and secret are kept in `<data-dir>/node.json`, so a restarted agent
is the same node. A 401 on a heartbeat means the control plane forgot the node:
the agent registers again with its join token.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gpu_agent.protocol import (
    DEFAULT_ENGINE_PORT_MAX,
    DEFAULT_ENGINE_PORT_MIN,
    FINAL_REPLICA_STATES,
    Heartbeat,
    HeartbeatResponse,
    RegisterRequest,
    RegisterResponse,
    ReplicaAction,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    WatchResponse,
)
from gpu_agent.runtime import engine, hardware
from gpu_agent.runtime.model_info import context_problem
from gpu_agent.runtime.supervisor import CommandFactory, Supervisor, SupervisorPolicy
from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_access import SourceAccess, WeightsError

logger = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
WATCH_TIMEOUT_S = 35.0  # the control plane answers a watch within 25 s


@dataclass(slots=True)
class AgentConfig:
    control_plane_url: str
    join_token: str
    data_dir: Path
    name: str = ""
    force_cpu: bool = False
    weights_budget_bytes: int | None = None
    s3_endpoint_url: str | None = None
    request_timeout_s: float = 10.0
    min_backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    cpu_kv_cache_gib: int = engine.DEFAULT_CPU_KV_CACHE_GIB
    # The address the gateway uses to reach this node's engines (the pod or host IP on a fleet).
    # Engines listen on exactly this address, never on every interface.
    advertise_host: str = "127.0.0.1"
    # The ports engines may use; registered with the node, which accepts no address outside them.
    engine_ports: tuple[int, int] = (DEFAULT_ENGINE_PORT_MIN, DEFAULT_ENGINE_PORT_MAX)
    # Leave engines running when the agent exits (agent upgrades): no PR_SET_PDEATHSIG, and the
    # next agent on this data dir adopts them. Off by default: an exiting agent stops its engines.
    keep_engines_on_exit: bool = False
    # Keep a warm standby engine process (vLLM already imported) for fast cold starts.
    # Off here so library users and tests opt in; the `run` command turns it on.
    standby: bool = False

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).resolve()
        self.control_plane_url = self.control_plane_url.rstrip("/")
        if not self.name:
            self.name = socket.gethostname()[:128]


class RegistrationRefused(Exception):
    """The control plane rejected the join token."""


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


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        *,
        command_factory: CommandFactory | None = None,
        policy: SupervisorPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.config = config
        config.data_dir.mkdir(parents=True, exist_ok=True)
        self.hardware = hardware.detect_hardware(
            force_cpu=config.force_cpu, cpu_kv_cache_gib=config.cpu_kv_cache_gib
        )
        self.device = engine.DEVICE_CPU if self.hardware.is_cpu else engine.DEVICE_CUDA
        if command_factory is None:
            # NOTE: engines bind to the advertised address only (loopback on one machine, the pod or
            # host IP on a fleet), never to every interface.
            bind_host = config.advertise_host

            def command_factory(spec, model_path, port):
                return engine.build_engine_command(
                    spec,
                    model_path,
                    port=port,
                    device=self.device,
                    host=bind_host,
                    advertise_host=config.advertise_host,
                    cpu_kv_cache_gib=config.cpu_kv_cache_gib,
                )

        policy = dataclasses.replace(
            policy or SupervisorPolicy(), kill_children_on_agent_death=not config.keep_engines_on_exit
        )
        self.supervisor = Supervisor(
            config.data_dir,
            device=self.device,
            command_factory=command_factory,
            policy=policy,
            standby=config.standby,
            engine_ports=config.engine_ports,
            on_ready=lambda _replica_id: self._wake.set(),
        )
        self.weights = WeightsCache(
            config.data_dir / "weights",
            budget_bytes=config.weights_budget_bytes,
            s3_endpoint_url=config.s3_endpoint_url,
            private_dirs=(config.data_dir,),  # a local model_source never reads the agent's own files
        )
        self.http = httpx.Client(
            base_url=config.control_plane_url, timeout=config.request_timeout_s, transport=transport
        )
        self._transport = transport
        self.credentials_path = config.data_dir / "node.json"
        self.node_id: str | None = None
        self.node_secret: str | None = None
        self.heartbeat_interval_s = 5.0
        self.num_heartbeats = 0
        self._pulls: dict[str, _Pull] = {}
        self._pins: dict[str, Path] = {}  # replica id -> cached model it uses
        self._reported_terminal: set[str] = set()
        self._lock = threading.Lock()
        # Set when a replica turns READY: report it now rather than at the next interval,
        # since a cold request is held until the control plane hears of it.
        self._wake = threading.Event()
        self._load_credentials()

    # -- registration -------------------------------------------------------------

    def _load_credentials(self) -> None:
        try:
            data = json.loads(self.credentials_path.read_text())
            # The node was registered with this control plane, host and port range; if the operator
            # changed either, register again so the control plane trusts the new address.
            if data.get("control_plane_url") == self.config.control_plane_url and data.get(
                "engine_address"
            ) == self._engine_address():
                self.node_id, self.node_secret = data["node_id"], data["node_secret"]
        except (OSError, ValueError, KeyError):
            pass

    def _engine_address(self) -> list:
        return [self.config.advertise_host, *self.config.engine_ports]

    def register(self) -> RegisterResponse:
        request = RegisterRequest(
            join_token=self.config.join_token,
            name=self.config.name,
            gpu_type=self.hardware.gpu_type,
            num_gpus=self.hardware.num_gpus,
            gpu_memory_mb=self.hardware.gpu_memory_mb,
            num_cpus=self.hardware.num_cpus,
            memory_mb=self.hardware.memory_mb,
            agent_version=AGENT_VERSION,
            engine_version=engine.engine_version(),
            supported_quantizations=sorted(engine.supported_quantizations(self.device)),
            advertise_host=self.config.advertise_host,
            engine_port_min=self.config.engine_ports[0],
            engine_port_max=self.config.engine_ports[1],
        )
        response = self.http.post("/agent/v1/register", json=request.to_dict())
        if response.status_code in (400, 401, 403):
            raise RegistrationRefused(f"register refused ({response.status_code}): {response.text[:200]}")
        response.raise_for_status()
        answer = RegisterResponse.from_dict(response.json())
        self.node_id, self.node_secret = answer.node_id, answer.node_secret
        self.heartbeat_interval_s = answer.heartbeat_interval_s
        data = {
            "control_plane_url": self.config.control_plane_url,
            "node_id": answer.node_id,
            "node_secret": answer.node_secret,
            "engine_address": self._engine_address(),
        }
        tmp = self.credentials_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle)
        os.replace(tmp, self.credentials_path)
        logger.info("registered as node %s (%s)", answer.node_id, self.hardware.gpu_type)
        return answer

    # -- heartbeat ----------------------------------------------------------------

    def build_heartbeat(self) -> Heartbeat:
        usage = hardware.host_usage(str(self.config.data_dir))
        gpus = hardware.gpu_statuses() if not self.hardware.is_cpu else []
        return Heartbeat(
            agent_version=AGENT_VERSION,
            num_cpus=self.hardware.num_cpus,
            memory_mb=self.hardware.memory_mb,
            memory_used_mb=usage.memory_used_mb,
            cpu_percent=usage.cpu_percent,
            gpus=gpus,
            replicas=self.replica_statuses(),
            weights=self.weights.statuses(),
            disk_free_mb=usage.disk_free_mb,
            standby_ready=self.supervisor.standby_ready,
        )

    def heartbeat_once(self) -> HeartbeatResponse:
        """Send one heartbeat (registering first if needed) and reconcile with the answer."""
        if self.node_secret is None:
            self.register()
        heartbeat = self.build_heartbeat()
        response = self._post_heartbeat(heartbeat)
        if response.status_code == 401:
            logger.warning("heartbeat refused (401): registering again")
            self.register()
            response = self._post_heartbeat(heartbeat)
        response.raise_for_status()
        answer = HeartbeatResponse.from_dict(response.json())
        self.num_heartbeats += 1
        self.heartbeat_interval_s = answer.heartbeat_interval_s
        with self._lock:
            for status in heartbeat.replicas:
                if status.state in FINAL_REPLICA_STATES:
                    self._reported_terminal.add(status.replica_id)
        self.reconcile(answer.desired)
        return answer

    def _post_heartbeat(self, heartbeat: Heartbeat) -> httpx.Response:
        return self.http.post(
            "/agent/v1/heartbeat",
            json=heartbeat.to_dict(),
            headers={"Authorization": f"Bearer {self.node_secret}"},
        )

    def run(self, stop: threading.Event) -> None:
        """Heartbeat until `stop` is set, then stop every engine.

        Engines a previous agent left on this data dir are adopted if healthy (and then
        drained at the first heartbeat if the control plane no longer wants them); the
        rest are killed before anything else happens.
        """
        self.supervisor.recover()
        self.supervisor.start_monitor()
        threading.Thread(target=self._watch_loop, args=(stop,), name="watch", daemon=True).start()
        failures = 0
        try:
            while not stop.is_set():
                try:
                    self.heartbeat_once()
                    failures = 0
                    delay = self.heartbeat_interval_s
                except RegistrationRefused as exc:
                    failures += 1
                    logger.error("%s", exc)
                    delay = self._backoff(failures)
                except (httpx.HTTPError, ValueError) as exc:
                    failures += 1
                    delay = self._backoff(failures)
                    logger.warning("heartbeat failed (%s); retrying in %.1fs", exc, delay)
                except Exception:  # the agent outlives its bugs; the engines keep serving
                    failures += 1
                    delay = self._backoff(failures)
                    logger.exception("heartbeat loop error; retrying in %.1fs", delay)
                self._sleep(delay, stop)
        finally:
            self.shutdown()

    def _watch_loop(self, stop: threading.Event) -> None:
        """Long-poll `/agent/v1/watch` so a new or drained replica is heard of at once, not at the next beat."""
        failures = 0
        with httpx.Client(
            base_url=self.config.control_plane_url, timeout=WATCH_TIMEOUT_S, transport=self._transport
        ) as client:
            while not stop.is_set():
                if not self.node_secret:
                    stop.wait(0.2)
                    continue
                try:
                    response = client.post(
                        "/agent/v1/watch", headers={"Authorization": f"Bearer {self.node_secret}"}
                    )
                    if response.status_code == 404:  # an older control plane: heartbeats alone will do
                        return
                    response.raise_for_status()
                    failures = 0
                    if WatchResponse.from_dict(response.json()).changed:
                        self._wake.set()
                except (httpx.HTTPError, ValueError):
                    failures += 1
                    stop.wait(self._backoff(failures))

    def _sleep(self, delay_s: float, stop: threading.Event) -> None:
        """Wait until the next heartbeat is due, `stop` is set, or a replica turned READY."""
        deadline = time.monotonic() + delay_s
        while not stop.is_set() and not self._wake.is_set() and time.monotonic() < deadline:
            stop.wait(min(0.05, max(deadline - time.monotonic(), 0.0)))
        self._wake.clear()

    def _backoff(self, failures: int) -> float:
        ceiling = min(self.config.max_backoff_s, self.config.min_backoff_s * 2 ** (failures - 1))
        return random.uniform(ceiling / 2, ceiling)  # jitter: a fleet must not retry in lockstep

    def shutdown(self) -> None:
        with self._lock:
            for pull in self._pulls.values():
                pull.cancelled = True
        if self.config.keep_engines_on_exit:
            self.supervisor.detach()
        else:
            self.supervisor.shutdown()
        self.http.close()

    # -- reconcile ----------------------------------------------------------------

    def reconcile(self, desired: list[ReplicaSpec]) -> None:
        """Start missing replicas, drain unwanted ones, forget finished ones the control plane dropped."""
        desired_by_id = {spec.replica_id: spec for spec in desired}
        known = set(self.supervisor.replica_ids())
        with self._lock:
            pulling = set(self._pulls)
        for spec in desired:
            if spec.action == ReplicaAction.RUN and spec.replica_id not in known | pulling:
                self._begin_start(spec)
            elif spec.replica_id in known:
                self.supervisor.refresh_secrets(spec)
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

        try:
            path = self.weights.fetch(
                spec.model_source, access=SourceAccess.for_replica(spec), on_progress=on_progress
            )
            self.weights.pin(path)
        except (WeightsError, ValueError) as exc:  # NOTE: their messages carry no secrets
            logger.warning("replica %s: fetching weights failed: %s", spec.replica_id, exc)
            pull.failure_reason = f"fetching weights from {spec.model_source} failed: {exc}"
            pull.done = True
            return
        except OSError as exc:  # the node's own trouble (a full disk): the system's words, no paths
            logger.exception("replica %s: fetching weights failed", spec.replica_id)
            pull.failure_reason = (
                f"fetching weights from {spec.model_source} failed: {exc.strerror or 'I/O error'}"
            )
            pull.done = True
            return
        except Exception:
            # Anything else may quote what it should not (an endpoint, a library's internals):
            # the operator's log has it, the customer gets a plain reason.
            logger.exception("replica %s: fetching weights failed", spec.replica_id)
            pull.failure_reason = (
                f"fetching weights from {spec.model_source} failed (the node's log has details)"
            )
            pull.done = True
            return
        # NOTE: checked before launching: vLLM would refuse the same spec only after loading for a
        # minute; the replica fails now, with a reason the endpoint shows, and no engine is started.
        problem = context_problem(spec.max_model_len, self.weights.model_info(path))
        if problem:
            logger.warning("replica %s: not starting: %s", spec.replica_id, problem)
            self.weights.unpin(path)
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
                self.weights.unpin(path)
                pull.done = True
                return
            self._pins[spec.replica_id] = path
            # NOTE: start() only schedules; the supervisor's monitor thread forks the engine,
            # because PR_SET_PDEATHSIG would kill it when this short-lived thread ends.
            self.supervisor.start(spec, path)
            del self._pulls[spec.replica_id]
        self._wake.set()  # report STARTING now: the console and held requests show "starting engine"

    def _drain(self, replica_id: str, spec: ReplicaSpec | None) -> None:
        with self._lock:
            pull = self._pulls.get(replica_id)
            if pull is not None:
                pull.cancelled = True
                pull.done = True
                pull.progress = ""
                return
        replica = self.supervisor.get(replica_id)
        if replica is not None and replica.state not in (*FINAL_REPLICA_STATES, ReplicaState.DRAINING):
            logger.info("replica %s: draining (%s)", replica_id, "DRAIN" if spec else "no longer desired")
            self.supervisor.drain(replica_id, timeout_s=spec.drain_timeout_s if spec else None)

    def _release_weights(self, replica_id: str) -> None:
        with self._lock:
            path = self._pins.pop(replica_id, None)
        if path is not None:
            self.weights.unpin(path)

    def replica_statuses(self) -> list[ReplicaStatus]:
        statuses = self.supervisor.statuses()
        with self._lock:
            pulls = list(self._pulls.values())
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
                )
            )
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
