"""The agent loop: heartbeat the control plane, apply its answer, until told to stop.

`Agent` wires the parts of one node together: the supervisor of its engines (`supervisor`), its
weights cache (`weights`), its client of the agent API (`control_plane`: registration, heartbeats,
the watch) and the application of the desired replicas (`reconciler`). Its loop sends a heartbeat
(what the machine and every replica are doing), reconciles with the answer, and waits for the next
interval, or less when there is news: a replica turned READY, or the watch heard of a change.
Failures back off with jitter; the engines keep serving through them, unless the control plane refuses the node
itself (`RegistrationRefused.node_refused`): then they stop (`Agent.heartbeat_once`); or says the node is retired
(`node_retired`): then they stop and what they left on disk goes, weights included.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import uuid

import httpx

from gpu_agent.protocol import Heartbeat, HeartbeatResponse, ReplicaAction, engine_sandbox_fact
from gpu_agent.runtime import engine, hardware, sandbox, weights_access
from gpu_agent.runtime.config import AgentConfig
from gpu_agent.runtime.control_plane import AGENT_VERSION, ControlPlaneClient, RegistrationRefused
from gpu_agent.runtime.reconciler import Reconciler, wanted_copies
from gpu_agent.runtime.supervisor import CommandFactory, Supervisor, SupervisorPolicy
from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_transfer import TransferSettings

logger = logging.getLogger(__name__)


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
        # Set when a replica turns READY or a drained one STOPPED: report it now rather than at the next
        # interval, since a cold request is held until the control plane hears of READY, and scale to
        # zero (and the GPU-seconds counted) lasts until it hears of STOPPED.
        self._wake = threading.Event()
        self.supervisor = Supervisor(
            config.data_dir,
            device=self.device,
            command_factory=command_factory,
            policy=policy,
            # NOTE: what a standby becomes, or a zygote forks, dies with the agent (its reaper is the agent's
            # child): engines kept on exit are launched plainly.
            standby=config.standby and not config.keep_engines_on_exit,
            zygote=config.zygote,
            engine_ports=config.engine_ports,
            sandbox_mode=config.engine_sandbox,
            disk_bounds=config.engine_disk,
            on_ready=lambda _replica_id: self._wake.set(),
            on_stopped=lambda _replica_id: self._wake.set(),
        )
        self.weights = WeightsCache(
            config.data_dir / "weights",
            budget_bytes=config.weights_budget_bytes,
            disk_reserve_fraction=config.weights_disk_reserve_fraction,
            adapter_max_bytes=config.adapter_max_bytes,
            s3_endpoint_url=config.s3_endpoint_url,
            private_dirs=(config.data_dir,),  # a local model_source never reads the agent's own files
            transfer=TransferSettings(min_bytes_per_s=config.min_download_bytes_per_s),
            private_grace_s=config.private_weights_grace_s,
        )
        self._keep_readings_across_restarts()
        self.control_plane = ControlPlaneClient(config, self.hardware, device=self.device, transport=transport)
        self.replicas = Reconciler(self.supervisor, self.weights, wake=self._wake)
        self.num_heartbeats = 0
        # NOTE: this process's heartbeats are numbered (`Heartbeat.sequence`, under this boot id), so the control plane
        # takes none that arrives after a newer one; a restarted agent counts again under a new boot id.
        self.boot_id = uuid.uuid4().hex
        self._heartbeat_numbers = itertools.count(1)

    def _keep_readings_across_restarts(self) -> None:
        """What this agent reads of its node that a restart must not forget, kept in its state file (`state_file.py`)
        and taken back from there: a refusal of namespaces the kernel confirmed (`sandbox.NamespacesFact`), and the
        back-offs of safetensors readings that gave no answer (`WeightsCache.restore_unsettled`). Before, a
        restarted agent re-learnt both: the refusal tested again, and every back-off back at its first step."""
        state = self.supervisor.state
        readings = state.readings()
        sandbox.NAMESPACES.restore(readings.get("namespaces"))
        sandbox.NAMESPACES.keep = lambda record: state.save_reading("namespaces", record)
        self.weights.restore_unsettled(readings.get("unsettled"))
        self.weights.keep_unsettled = lambda record: state.save_reading("unsettled", record or None)

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
            replicas=self.replicas.replica_statuses(),
            weights=self.weights.statuses(),
            disk_free_mb=usage.disk_free_mb,
            standby_ready=self.supervisor.standby_ready,
            # NOTE: every beat, not only at registration: the namespaces' fact changes while the agent runs (an
            # engine's exit 79 re-tests them), and operators read the node's fact on the control plane.
            engine_sandbox=engine_sandbox_fact(sandbox.node_fact(self.config.engine_sandbox)),
            boot_id=self.boot_id,
            sequence=next(self._heartbeat_numbers),
            # NOTE: what the reconciler carries out: the control plane sends no other action (`understood_actions`).
            replica_actions=[action.value for action in ReplicaAction],
            launches_within_billed_context=True,  # `engine.engine_context_length`
        )

    def heartbeat_once(self) -> HeartbeatResponse:
        """Send one heartbeat (registering first if needed) and reconcile with the answer.

        Refused as a node (`RegistrationRefused.node_refused`: a heartbeat under the node's own secret, or a
        registration under a join token usable there, answered `protocol.NODE_REFUSED`: the control plane refuses the
        node's host or ports now), the agent stops every engine before it raises; told the node is retired
        (`node_retired`), it winds down for good (`_wind_down_retired_node`). Refused otherwise (a 401 with no
        code, the node's secret unknown and its join token refused), the engines keep serving: a proxy dropping
        `Authorization`, agents pointed at another environment or at a restored database answer so with the node wanted
        as much as before, and a join token that no longer admits anyone is the usual state (a pool's is one-use, a
        rotation revokes the old one).
        NOTE: stopping then stopped every engine of the fleet within a heartbeat, past the control plane's hold for
        a fleet gone silent all at once (`NODE_FLEET_SILENCE_HOLD_S`)."""
        try:
            self.control_plane.register_if_needed()
            heartbeat = self.build_heartbeat()
            answer = self.control_plane.send_heartbeat(heartbeat)
        except RegistrationRefused as refusal:
            if refusal.node_refused:
                self._stop_engines_of_refused_node()
            elif refusal.node_retired:
                self._wind_down_retired_node()
            raise
        self.num_heartbeats += 1
        self.replicas.mark_reported(heartbeat.replicas)
        self.replicas.reconcile(answer.desired)
        try:
            self._let_go_of_what_no_replica_wants(answer.desired)
        except Exception:
            # NOTE: a cleanup, tried again at the next answer: raised out of here, the loop backed off as from a
            # control plane that failed (up to `max_backoff_s`, past the control plane's grace for a silent node) at
            # every heartbeat while a disk error lasted, and the node went OFFLINE with every replica on it.
            logger.exception("could not let go of the weights or clients no replica wants; trying again next heartbeat")
        return answer

    def _let_go_of_what_no_replica_wants(self, desired) -> None:
        """After each answer: the S3 clients of credentials no desired replica (nor its adapters) carries are dropped,
        and the organisations' cached copies no desired replica names go once unused for the grace
        (`WeightsCache.release_unwanted`). After `reconcile`, in the heartbeat's thread: the pulls this answer started
        are for copies it names, and the next answer's pulls start only after this returns.

        NOTE: before, both stayed until a budget or the clients' bound pushed them out: a deleted endpoint's private
        weights on the node's disk, a deleted or rotated credential's keys in the agent's memory."""
        credentials = [spec.credentials for spec in desired]
        credentials += [adapter.credentials for spec in desired for adapter in spec.adapters]
        weights_access.drop_clients_except(credentials)
        evicted = self.weights.release_unwanted(wanted_copies(desired))
        if evicted:
            logger.info("removed %d cached model(s) of organisations that no replica here wants any more", len(evicted))

    def _stop_engines_of_refused_node(self) -> None:
        """Drain and stop every replica, as an answer that wants none would.

        NOTE: the control plane refuses a node it will not route to (its host or engine ports outside what the gateway
        may reach since it registered, `protocol.NODE_REFUSED`): the gateway leaves its replicas out and the sweep fails them and
        places them elsewhere, so its engines serve nobody the platform sends, and must not go on serving anyone who
        reaches them, nor hold the GPUs. Before, they ran until the agent stopped. The agent keeps registering
        again at every back-off, and once the node is taken again its answers start what it should run, those it
        stopped here included (`Reconciler.stop_unasked`)."""
        num_stopping = self.replicas.stop_unasked()
        if num_stopping:
            logger.warning("the control plane refuses this node: stopping its %d engine(s)", num_stopping)

    def _wind_down_retired_node(self) -> None:
        """Drain and stop every replica; once none runs, remove the engines' cache folders and logs, every model in the
        weights cache and every download stopped mid-way (tenants' weights). Each heartbeat answered `protocol.NODE_RETIRED` does what is left (a drain
        takes a while), and nothing more once all is gone; the agent idles, asking at its back-off, never registering
        again (`protocol.py` says why it does not exit).

        NOTE: the node's secret is the very one of a retired node (the control plane answers so only then): nobody
        routes to its engines any more. Before, told the node was unknown, its agent registered again with a revoked
        join token, was refused, and its engines ran on, holding the GPUs, tenants' weights kept on its disk."""
        num_stopping = self.replicas.stop_unasked()
        if num_stopping:
            logger.warning("this node is retired: stopping its %d engine(s)", num_stopping)
        if not self.replicas.nothing_runs():
            return
        num_caches = self.supervisor.remove_engine_caches()
        weights_access.drop_clients_except(())
        evicted = self.weights.remove_unpinned()
        if num_caches or evicted:
            logger.warning("this node is retired: removed %d engine cache folder(s) and %d model(s) from the "
                           "weights cache", num_caches, len(evicted))

    def run(self, stop: threading.Event) -> None:
        """Heartbeat until `stop` is set, then stop every engine.

        Engines a previous agent left on this data dir are adopted if healthy (and then
        drained at the first heartbeat if the control plane no longer wants them); the
        rest are killed before anything else happens.
        """
        adopted, _ = self.supervisor.recover()
        self.replicas.adopted(adopted)
        self.supervisor.start_monitor()
        threading.Thread(
            target=self.control_plane.watch, args=(stop, self._wake.set), name="watch", daemon=True
        ).start()
        failures = 0
        try:
            while not stop.is_set():
                try:
                    self.heartbeat_once()
                    failures = 0
                    delay = self.control_plane.heartbeat_interval_s
                except RegistrationRefused as exc:
                    failures += 1
                    logger.error("%s", exc)
                    delay = self.config.backoff_s(failures)
                except (httpx.HTTPError, ValueError) as exc:
                    failures += 1
                    delay = self.config.backoff_s(failures)
                    logger.warning("heartbeat failed (%s); retrying in %.1fs", exc, delay)
                except Exception:  # the agent outlives its bugs; the engines keep serving
                    failures += 1
                    delay = self.config.backoff_s(failures)
                    logger.exception("heartbeat loop error; retrying in %.1fs", delay)
                self._sleep(delay, stop)
        finally:
            self.shutdown()

    def _sleep(self, delay_s: float, stop: threading.Event) -> None:
        """Wait until the next heartbeat is due, `stop` is set, or there is news to report."""
        deadline = time.monotonic() + delay_s
        while not stop.is_set() and not self._wake.is_set() and time.monotonic() < deadline:
            stop.wait(min(0.05, max(deadline - time.monotonic(), 0.0)))
        self._wake.clear()

    def shutdown(self) -> None:
        self.replicas.cancel_pulls()
        if self.config.keep_engines_on_exit:
            self.supervisor.detach()
        else:
            self.supervisor.shutdown()
        self.control_plane.close()
