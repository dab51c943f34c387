"""The agent's HTTP loop against a tiny fake control plane speaking `gpu_agent.protocol`."""

from __future__ import annotations

import http.server
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading

import httpx
import psutil
import pytest

from gpu_agent.protocol import (
    DEFAULT_ENGINE_PORT_MAX,
    DEFAULT_ENGINE_PORT_MIN,
    NODE_REFUSED,
    NODE_RETIRED,
    NODE_UNKNOWN,
    Heartbeat,
    HeartbeatResponse,
    NodeState,
    RegisterRequest,
    RegisterResponse,
    ReplicaAction,
    ReplicaState,
    WatchResponse,
)
from gpu_agent.runtime import control_plane as control_plane_client
from gpu_agent.runtime.agent import Agent
from gpu_agent.runtime.cli import EXIT_STUCK_STOPPING
from gpu_agent.runtime.config import AgentConfig
from gpu_agent.runtime.reaper import OUTLIVES_AGENT_ENV
from gpu_agent.runtime.supervisor import SupervisorPolicy

from .conftest import fake_engine_factory, make_spec, processes_with_marker, wait_until
from .test_weights_cache import s3, s3_endpoint, upload_model  # noqa: F401  (fixtures)


class FakeControlPlane:
    """Registers nodes, records heartbeats and answers with whatever `desired` holds; a watch
    answers "changed" once `desired_changed` is set."""

    def __init__(self) -> None:
        self.join_token = "join-123"
        self.secrets: set[str] = set()
        self.registrations: list[RegisterRequest] = []
        self.heartbeats: list[Heartbeat] = []
        self.desired = []
        self.heartbeat_interval_s = 0.2
        self.desired_changed = threading.Event()
        self.num_watches = 0
        self.num_failures_to_inject = 0
        # Set: the node is refused, as the control plane refuses one whose host it no longer allows (heartbeats
        # 401, registrations 400 with this reason, both with the `NODE_REFUSED` code).
        self.refusal = ""
        # Set: the node is retired (heartbeats and watches 401 with the `NODE_RETIRED` code).
        self.retired = False
        self.num_register_calls = 0
        self.num_refused = 0  # requests answered `refusal`
        self.lock = threading.Lock()
        plane = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

            def reply(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                if self.path == "/agent/v1/watch":
                    return self.watch()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with plane.lock:
                    if plane.num_failures_to_inject:
                        plane.num_failures_to_inject -= 1
                        return self.reply(503, {"error": "busy"})
                    if self.path == "/agent/v1/register":
                        plane.num_register_calls += 1
                    if plane.refusal:
                        plane.num_refused += 1
                        status = 400 if self.path == "/agent/v1/register" else 401
                        return self.reply(status, {"error": {"message": plane.refusal, "code": NODE_REFUSED}})
                    if self.path == "/agent/v1/register":
                        request = RegisterRequest.from_dict(body)
                        if request.join_token != plane.join_token:
                            return self.reply(401, {"error": "bad join token"})
                        plane.registrations.append(request)
                        secret = f"secret-{len(plane.registrations)}"
                        plane.secrets.add(secret)
                        answer = RegisterResponse(
                            node_id="node-1", node_secret=secret, heartbeat_interval_s=plane.heartbeat_interval_s
                        )
                        return self.reply(201, answer.to_dict())
                    if self.path == "/agent/v1/heartbeat":
                        token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                        if plane.retired and token in plane.secrets:
                            plane.num_refused += 1
                            return self.reply(401, {"error": {"message": "node retired", "code": NODE_RETIRED}})
                        if token not in plane.secrets:
                            return self.reply(401, {"error": {"message": "unknown node", "code": NODE_UNKNOWN}})
                        plane.heartbeats.append(Heartbeat.from_dict(body))
                        answer = HeartbeatResponse(
                            node_state=NodeState.READY, heartbeat_interval_s=plane.heartbeat_interval_s,
                            desired=list(plane.desired),
                        )
                        return self.reply(200, answer.to_dict())
                return self.reply(404, {})

            def watch(self):
                """A long poll, shorter than the control plane's."""
                with plane.lock:
                    if self.headers.get("Authorization", "").removeprefix("Bearer ") not in plane.secrets:
                        return self.reply(401, {"error": "unknown node"})
                    plane.num_watches += 1
                changed = plane.desired_changed.wait(2.0)
                if changed:
                    plane.desired_changed.clear()
                return self.reply(200, WatchResponse(changed=changed).to_dict())

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def last_states(self) -> dict[str, ReplicaState]:
        with self.lock:
            if not self.heartbeats:
                return {}
            return {status.replica_id: status.state for status in self.heartbeats[-1].replicas}

    def ever_reported(self, replica_id: str, state: ReplicaState) -> bool:
        """Whether any heartbeat so far said `replica_id` was in `state` (a STOPPED replica is reported once or
        twice, then forgotten: the last heartbeat alone may never be seen saying it)."""
        with self.lock:
            return any(status.replica_id == replica_id and status.state == state
                       for heartbeat in self.heartbeats for status in heartbeat.replicas)

    def all_progress(self) -> list[str]:
        with self.lock:
            return [
                status.progress for beat in self.heartbeats for status in beat.replicas if status.progress
            ]


# A spawned agent still stopping this long after SIGTERM writes every thread's stack and exits with
# `cli.EXIT_STUCK_STOPPING`; tests wait longer than this for its exit. NOTE: a loaded machine once took over 20 s
# (the test's wait then) with nothing in its output to say why.
SPAWNED_SHUTDOWN_DEADLINE_S = 40


def spawn_agent_process(control_plane, data_dir, *, keep_engines_on_exit=False, under_reaper=False) -> subprocess.Popen:
    """An agent in its own process (fake engines), stopped by signals like the real CLI."""
    script = textwrap.dedent(
        f"""
        from tests.agent.conftest import fake_engine_factory
        from gpu_agent.runtime.agent import Agent
        from gpu_agent.runtime.config import AgentConfig
        from gpu_agent.runtime.cli import run_until_signalled
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)  # the test's captured stderr, on failure
        config = AgentConfig(control_plane_url={control_plane.url!r}, join_token={control_plane.join_token!r},
                             data_dir={str(data_dir)!r}, force_cpu=True, keep_engines_on_exit={keep_engines_on_exit})
        run_until_signalled(Agent(config, command_factory=fake_engine_factory(under_reaper={under_reaper})),
                            shutdown_deadline_s={SPAWNED_SHUTDOWN_DEADLINE_S})
        """
    )
    return subprocess.Popen([sys.executable, "-c", script], cwd=os.getcwd())


@pytest.fixture
def control_plane():
    plane = FakeControlPlane()
    yield plane
    plane.server.shutdown()


@pytest.fixture
def running_agent(control_plane, tmp_path, s3_endpoint):  # noqa: F811
    agents = []

    def start(**config):
        config = {"force_cpu": True} | config
        agent = Agent(
            AgentConfig(
                control_plane_url=control_plane.url,
                join_token=control_plane.join_token,
                data_dir=tmp_path / "agent",
                s3_endpoint_url=s3_endpoint,
                min_backoff_s=0.05,
                max_backoff_s=0.2,
                **config,
            ),
            command_factory=fake_engine_factory(),
            policy=SupervisorPolicy(restart_backoff_s=0.2, stop_timeout_s=2.0),
        )
        stop = threading.Event()
        thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        thread.start()
        agents.append((agent, stop, thread))
        return agent, stop, thread

    yield start
    for _agent, stop, thread in agents:
        stop.set()
        thread.join(timeout=20)


def test_registers_then_heartbeats_with_its_node_secret(control_plane, running_agent):
    agent, stop, thread = running_agent()
    wait_until(lambda: len(control_plane.heartbeats) >= 2, 10)
    [registration] = control_plane.registrations
    assert registration.gpu_type == "cpu" and registration.num_gpus == 0 and registration.num_cpus >= 1
    assert "fp8_per_channel" in registration.supported_quantizations
    beat = control_plane.heartbeats[-1]
    assert beat.memory_mb == registration.memory_mb and 0 < beat.memory_used_mb < beat.memory_mb
    assert beat.engine_sandbox == registration.engine_sandbox != ""  # every beat says what confines its engines now
    # A restarted agent is the same node: it re-uses the stored secret instead of registering again.
    stop.set()
    thread.join(timeout=10)
    num_beats = len(control_plane.heartbeats)
    running_agent()
    wait_until(lambda: len(control_plane.heartbeats) >= num_beats + 2, 10)
    assert len(control_plane.registrations) == 1
    # Each process numbers its heartbeats from 1 under its own boot id (the control plane takes none that arrives
    # after a newer one), so the restarted agent's are not taken for stale ones.
    first, second = control_plane.heartbeats[:num_beats], control_plane.heartbeats[num_beats:]
    assert [beat.sequence for beat in first] == list(range(1, num_beats + 1))
    assert [beat.sequence for beat in second] == list(range(1, len(second) + 1))
    assert len({beat.boot_id for beat in first}) == len({beat.boot_id for beat in second}) == 1
    assert first[0].boot_id != second[0].boot_id


def test_a_kubernetes_pool_agent_registers_with_its_pods_projected_token_and_a_bare_metal_one_with_none(
        control_plane, running_agent, tmp_path, monkeypatch):
    """What binds a pool machine's registration to its agent pod (the control plane reviews the token); a host without
    the projected token (bare metal) sends none."""
    monkeypatch.setattr(control_plane_client, "REREGISTER_MIN_INTERVAL_S", 0.0)  # else once a minute
    running_agent()
    wait_until(lambda: control_plane.heartbeats, 10)
    assert control_plane.registrations[0].pod_token == ""

    token_file = tmp_path / "registration" / "token"
    token_file.parent.mkdir()
    token_file.write_text("eyJhbGciOiJSUzI1NiJ9.pod.sig\n")
    monkeypatch.setattr(control_plane_client, "POD_TOKEN_FILE", token_file)
    with control_plane.lock:
        control_plane.secrets.clear()  # the control plane forgets the node: the agent registers again
    wait_until(lambda: len(control_plane.registrations) >= 2, 10)
    assert control_plane.registrations[-1].pod_token == "eyJhbGciOiJSUzI1NiJ9.pod.sig"


def test_a_pod_token_file_that_is_huge_undecodable_or_unreadable_is_sent_as_none_and_logged(tmp_path, monkeypatch,
                                                                                               caplog):
    """The agent reads at most a token's worth of the file, and a file it cannot send (too long, not UTF-8, control
    characters, unreadable) is no token: it registers without one (a pool does not link it: the log says why) instead
    of failing every registration. Before, a huge file was read whole at each try, and it, or one not UTF-8, raised in
    the agent's own request: the node never registered, pooled or not; an unreadable one was dropped silently."""
    token_file = tmp_path / "token"
    monkeypatch.setattr(control_plane_client, "POD_TOKEN_FILE", token_file)
    caplog.set_level(logging.WARNING, logger=control_plane_client.__name__)
    token_file.write_text("eyJhbGciOiJSUzI1NiJ9.pod.sig\n")
    assert control_plane_client.pod_token() == "eyJhbGciOiJSUzI1NiJ9.pod.sig" and not caplog.records
    for content in (b"e" * 50_000_000, b"eyJ\xff\xfe.pod.sig", b"eyJ\x00.pod.sig"):
        caplog.clear()
        token_file.write_bytes(content)
        assert control_plane_client.pod_token() == ""
        assert [record.getMessage() for record in caplog.records if "pod token" in record.getMessage()], content[:8]
    token_file.unlink()
    token_file.mkdir()  # unreadable as a file
    caplog.clear()
    assert control_plane_client.pod_token() == ""
    assert any("pod token" in record.getMessage() for record in caplog.records)
    token_file.rmdir()
    caplog.clear()
    assert control_plane_client.pod_token() == "" and not caplog.records  # bare metal: no file, nothing to say


def test_a_gpu_node_registers_and_heartbeats_each_gpu_nvidia_smi_lists(control_plane, running_agent, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"  # the driver's tool, answering as on a node with two L4s
    fake.write_text(textwrap.dedent("""\
        #!/bin/sh
        if [ "$1" = "-L" ]; then
          echo "GPU 0: NVIDIA L4 (UUID: GPU-0b9e3c0e-6a51-4c47-8f6e-2a3d4b5c6d7e)"
          echo "GPU 1: NVIDIA L4 (UUID: GPU-7f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f)"
        else
          echo "0, GPU-0b9e3c0e-6a51-4c47-8f6e-2a3d4b5c6d7e, NVIDIA L4, 23034, 0, 0, 36"
          echo "1, GPU-7f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f, NVIDIA L4, 23034, 1210, 87, 61"
        fi
    """))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    running_agent(force_cpu=False)
    wait_until(lambda: len(control_plane.heartbeats) >= 2, 10)
    [registration] = control_plane.registrations
    assert (registration.gpu_type, registration.num_gpus, registration.gpu_memory_mb) == ("l4", 2, 23034)
    assert [gpu.uuid for gpu in registration.gpus] == ["GPU-0b9e3c0e-6a51-4c47-8f6e-2a3d4b5c6d7e",
                                                       "GPU-7f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"]
    assert [gpu.utilization_percent for gpu in control_plane.heartbeats[-1].gpus] == [0.0, 87.0]


def test_registers_again_when_the_control_plane_forgets_the_node(control_plane, running_agent, monkeypatch):
    monkeypatch.setattr(control_plane_client, "REREGISTER_MIN_INTERVAL_S", 0.0)  # else once a minute
    running_agent()
    wait_until(lambda: control_plane.heartbeats, 10)
    with control_plane.lock:
        control_plane.secrets.clear()
    wait_until(lambda: len(control_plane.registrations) == 2, 10)
    num_beats = len(control_plane.heartbeats)
    wait_until(lambda: len(control_plane.heartbeats) > num_beats, 10)


def test_a_watch_answering_changed_makes_the_agent_heartbeat_at_once(control_plane, running_agent):
    control_plane.heartbeat_interval_s = 600.0  # the next heartbeat is far off: only the watch brings one
    running_agent()
    wait_until(lambda: control_plane.heartbeats and control_plane.num_watches, 10)
    num_beats = len(control_plane.heartbeats)
    control_plane.desired_changed.set()
    wait_until(lambda: len(control_plane.heartbeats) > num_beats, 10)


def test_keeps_retrying_through_control_plane_errors(control_plane, running_agent):
    control_plane.num_failures_to_inject = 4
    running_agent()
    wait_until(lambda: control_plane.heartbeats, 15)


def test_starts_desired_replicas_and_reports_them_ready(control_plane, running_agent, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    control_plane.desired = [make_spec("r-a", model_source=str(model))]
    agent, _stop, _thread = running_agent()
    wait_until(lambda: control_plane.last_states().get("r-a") == ReplicaState.READY, 15)
    status = next(s for s in control_plane.heartbeats[-1].replicas if s.replica_id == "r-a")
    assert status.address.startswith("http://127.0.0.1:") and status.pid
    assert "starting engine" in control_plane.all_progress()
    # its cold start's anatomy: how long the weights took, and the engine from launch to READY
    assert status.download_s is not None and status.download_s >= 0
    assert status.engine_start_s is not None and status.engine_start_s >= 0


def test_a_refused_node_stops_its_engines_and_starts_again_once_taken_back(control_plane, running_agent, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    control_plane.desired = [make_spec("r-a", model_source=str(model))]
    agent, _stop, _thread = running_agent()
    wait_until(lambda: control_plane.last_states().get("r-a") == ReplicaState.READY, 15)
    assert processes_with_marker("r-a")
    # The operator narrowed the node networks: the control plane refuses the node; its replicas are failed there and
    # the gateway routes to none of them.
    with control_plane.lock:
        control_plane.refusal = "invalid registration: advertise_host: it is outside the networks GPU nodes may serve on"
        num_registrations = len(control_plane.registrations)
    # Before: its engine served on, for as long as the agent ran. Stopped unasked, it is never reported.
    wait_until(lambda: processes_with_marker("r-a") == [] and agent.supervisor.get("r-a").is_final, 15)
    assert not control_plane.ever_reported("r-a", ReplicaState.STOPPED)
    assert len(control_plane.registrations) == num_registrations  # no registration was taken
    # The operator widens them again: the node's next heartbeat is taken, and it runs what it is told to.
    control_plane.desired = [make_spec("r-b", model_source=str(model))]
    with control_plane.lock:
        control_plane.refusal = ""
    wait_until(lambda: control_plane.last_states().get("r-b") == ReplicaState.READY, 15)
    assert agent.supervisor.get("r-a") is None  # forgotten at the first answer that does not want it
    assert not control_plane.ever_reported("r-a", ReplicaState.STOPPED)


def test_a_refused_node_taken_back_reports_a_replica_it_stopped_that_the_answer_drains(control_plane, running_agent,
                                                                                      tmp_path):
    """The refusal outlasts the drain, then the answer that takes the node back drains the replica. Before: the agent
    forgot it at the refusal's first retry past its drain, reported nothing of it, and the control plane held its
    placement DRAINING until the drain sweep."""
    model = tmp_path / "model"
    model.mkdir()
    control_plane.desired = [make_spec("r-a", model_source=str(model), drain_timeout_s=0.5)]
    agent, _stop, _thread = running_agent()
    wait_until(lambda: control_plane.last_states().get("r-a") == ReplicaState.READY, 15)
    with control_plane.lock:
        control_plane.refusal = "invalid registration: advertise_host: it is outside the networks GPU nodes may serve on"
    wait_until(lambda: processes_with_marker("r-a") == [], 15)
    with control_plane.lock:
        num_refused = control_plane.num_refused
    wait_until(lambda: control_plane.num_refused >= num_refused + 2, 15)  # refused again, past the drain
    control_plane.desired = [make_spec("r-a", model_source=str(model), action=ReplicaAction.DRAIN)]
    with control_plane.lock:
        control_plane.refusal = ""
    wait_until(lambda: control_plane.ever_reported("r-a", ReplicaState.STOPPED), 15)


def test_a_refused_node_taken_back_while_its_replicas_are_still_wanted_starts_them_again(control_plane, running_agent,
                                                                                        tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    control_plane.desired = [make_spec("r-a", model_source=str(model))]
    agent, _stop, _thread = running_agent()
    wait_until(lambda: control_plane.last_states().get("r-a") == ReplicaState.READY, 15)
    first_engine = processes_with_marker("r-a")
    with control_plane.lock:
        control_plane.refusal = "invalid registration: advertise_host: it is outside the networks GPU nodes may serve on"
    wait_until(lambda: processes_with_marker("r-a") == [], 15)
    # The operator widens the networks again before the sweep moved r-a elsewhere: the control plane still wants it.
    with control_plane.lock:
        control_plane.refusal = ""
        num_beats = len(control_plane.heartbeats)
    # Before: the agent reported r-a STOPPED (final on the control plane: replaced cold), and an answer still wanting
    # it never started it again (only replicas it did not know were started).
    wait_until(lambda: control_plane.last_states().get("r-a") == ReplicaState.READY
               and len(control_plane.heartbeats) > num_beats, 15)
    assert processes_with_marker("r-a") and not set(processes_with_marker("r-a")) & set(first_engine)
    assert not control_plane.ever_reported("r-a", ReplicaState.STOPPED)


def test_a_retired_node_stops_its_engines_removes_what_they_left_and_idles(control_plane, running_agent, s3,  # noqa: F811
                                                                          tmp_path, tokenizer_not_described):
    """The operator retired the node (its machine shut out): the control plane answers its very secret `NODE_RETIRED`.
    Before: the agent logged the refusal and retried, its engine serving on (routed to by nobody), the endpoint's
    cache folder and the tenant's weights left on its disk, for as long as the agent ran."""
    upload_model(s3, "fleet-models", "tiny", num_bytes=1_000_000)
    control_plane.desired = [make_spec("r-a", model_source="s3://fleet-models/tiny", endpoint_id="e-a")]
    agent, _stop, thread = running_agent()
    wait_until(lambda: control_plane.last_states().get("r-a") == ReplicaState.READY, 20)
    caches = agent.supervisor.data_dir / "engine-caches"
    assert processes_with_marker("r-a") and agent.weights._index.entries() and caches.is_dir() and any(
        not path.name.startswith(".") for path in caches.iterdir())
    with control_plane.lock:
        control_plane.retired = True
        num_registrations = len(control_plane.registrations)
    wait_until(lambda: processes_with_marker("r-a") == [] and agent.supervisor.get("r-a").is_final, 15)
    wait_until(lambda: not agent.weights._index.entries()
               and not [path for path in caches.iterdir() if not path.name.startswith(".")], 15)
    # NOTE: waited for: the index forgets an entry before its folder is removed (a fresh run found the file a moment
    # after the entry had gone)
    wait_until(lambda: not list(agent.weights.root.glob("*/model.safetensors")), 15)
    wait_until(lambda: not (agent.supervisor.logs_dir / "r-a.log").exists(), 15)  # before: the engine's log stayed
    # It idles: asks again at its back-off, never registers again, starts nothing, and the agent runs on.
    with control_plane.lock:
        num_refused = control_plane.num_refused
    wait_until(lambda: control_plane.num_refused >= num_refused + 2, 15)
    assert len(control_plane.registrations) == num_registrations and thread.is_alive()
    assert not control_plane.ever_reported("r-a", ReplicaState.STOPPED)


def test_a_heartbeat_401_with_a_join_token_no_longer_usable_leaves_the_engines_serving(control_plane, running_agent,
                                                                                       tmp_path, monkeypatch):
    monkeypatch.setattr(control_plane_client, "REREGISTER_MIN_INTERVAL_S", 0.0)  # else once a minute
    model = tmp_path / "model"
    model.mkdir()
    control_plane.desired = [make_spec("r-a", model_source=str(model))]
    agent, _stop, _thread = running_agent()
    wait_until(lambda: control_plane.last_states().get("r-a") == ReplicaState.READY, 15)
    engine = processes_with_marker("r-a")
    # A proxy drops `Authorization` (every heartbeat 401) while the node's join token admits nobody any more (a pool's
    # one-use token, or rotated): neither says anything of the node, which the control plane wants as before.
    with control_plane.lock:
        secrets = set(control_plane.secrets)
        control_plane.secrets.clear()
        control_plane.join_token = "rotated"
        num_register_calls = control_plane.num_register_calls
    wait_until(lambda: control_plane.num_register_calls >= num_register_calls + 5, 15)
    # Before: every engine was stopped within a heartbeat (the whole fleet at once, past the control plane's hold for a
    # fleet gone silent), and r-a was reported STOPPED once the proxy was fixed: replaced cold.
    assert processes_with_marker("r-a") == engine
    assert agent.supervisor.get("r-a").state == ReplicaState.READY
    with control_plane.lock:
        control_plane.secrets |= secrets
        num_beats = len(control_plane.heartbeats)
    wait_until(lambda: len(control_plane.heartbeats) >= num_beats + 3, 15)
    assert control_plane.last_states().get("r-a") == ReplicaState.READY and processes_with_marker("r-a") == engine


def test_two_replicas_of_one_s3_model_download_once(  # noqa: F811
    control_plane, running_agent, s3, s3_endpoint, tokenizer_not_described  # noqa: F811
):
    upload_model(s3, "fleet-models", "tiny", num_bytes=4_000_000)
    source = "s3://fleet-models/tiny"
    control_plane.desired = [make_spec("r-1", model_source=source), make_spec("r-2", model_source=source)]
    agent, _stop, _thread = running_agent()
    wait_until(lambda: set(control_plane.last_states().values()) == {ReplicaState.READY}
               and len(control_plane.last_states()) == 2, 20)  # fmt: skip
    assert agent.weights.num_downloads == 1
    assert agent.supervisor.get("r-1").model_path == agent.supervisor.get("r-2").model_path
    [weights] = control_plane.heartbeats[-1].weights
    assert weights.complete and weights.source == source and weights.size_bytes > 4_000_000
    # A third replica later is a cache hit.
    control_plane.desired = [*control_plane.desired, make_spec("r-3", model_source=source)]
    wait_until(lambda: control_plane.last_states().get("r-3") == ReplicaState.READY, 20)
    assert agent.weights.num_downloads == 1 and agent.weights.num_hits >= 2


def test_failed_weight_fetch_is_reported_as_failed(control_plane, running_agent, s3):  # noqa: F811
    control_plane.desired = [make_spec("r-bad", model_source="s3://no-such-bucket/x")]
    running_agent()
    wait_until(lambda: control_plane.last_states().get("r-bad") == ReplicaState.FAILED, 15)
    status = next(s for s in control_plane.heartbeats[-1].replicas if s.replica_id == "r-bad")
    assert "fetching weights" in status.failure_reason


def test_drains_replicas_reports_stopped_then_forgets_them(control_plane, running_agent, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    control_plane.desired = [
        make_spec("r-x", model_source=str(model)),
        make_spec("r-y", model_source=str(model)),
    ]
    agent, _stop, _thread = running_agent()
    wait_until(
        lambda: control_plane.last_states() == {"r-x": ReplicaState.READY, "r-y": ReplicaState.READY}, 15
    )
    # r-x: explicit DRAIN; r-y: no longer listed at all.
    control_plane.desired = [make_spec("r-x", model_source=str(model), action=ReplicaAction.DRAIN)]
    wait_until(lambda: control_plane.last_states() == {"r-x": ReplicaState.STOPPED}, 15)
    assert processes_with_marker("r-x") == [] and processes_with_marker("r-y") == []
    assert any(
        status.replica_id == "r-y" and status.state == ReplicaState.STOPPED
        for beat in control_plane.heartbeats
        for status in beat.replicas
    ), "the control plane must learn r-y's final state before the agent forgets it"
    control_plane.desired = []
    wait_until(lambda: control_plane.last_states() == {}, 10)


def test_sigterm_stops_the_agent_and_its_engines(control_plane, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    control_plane.desired = [make_spec("r-term", model_source=str(model))]
    agent = spawn_agent_process(control_plane, tmp_path / "agent")
    try:
        wait_until(lambda: control_plane.last_states().get("r-term") == ReplicaState.READY, 20)
        assert len(processes_with_marker("r-term")) == 3  # the reaper, the engine and its worker
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=SPAWNED_SHUTDOWN_DEADLINE_S + 15) == 0
        assert processes_with_marker("r-term") == []
    finally:
        agent.kill()


def test_an_agent_stuck_stopping_exits_by_its_deadline_with_every_threads_stack(tmp_path):
    """A stop that hangs (here a lock its shutdown waits for, held by a thread that never lets go) ends the
    process at the deadline, with code `EXIT_STUCK_STOPPING` and the stacks that show where it hung."""
    script = textwrap.dedent(
        """
        import threading, time
        from gpu_agent.runtime.cli import run_until_signalled

        class StuckAgent:
            def run(self, stop):
                held = threading.Lock()
                held.acquire()
                print("running", flush=True)
                stop.wait()
                self.shutdown_waiting_for_a_lock_nobody_releases(held)

            def shutdown_waiting_for_a_lock_nobody_releases(self, lock):
                lock.acquire()

        run_until_signalled(StuckAgent(), shutdown_deadline_s=1.0)
        """
    )
    agent = subprocess.Popen([sys.executable, "-c", script], cwd=os.getcwd(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert agent.stdout.readline() == "running\n"
        agent.send_signal(signal.SIGTERM)
        _, stderr = agent.communicate(timeout=30)
    finally:
        agent.kill()
    assert agent.returncode == EXIT_STUCK_STOPPING
    assert "still stopping 1s after the signal" in stderr
    assert "shutdown_waiting_for_a_lock_nobody_releases" in stderr


def test_reports_weight_loading_progress_while_fetching(control_plane, running_agent, tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    release = threading.Event()
    agent, _stop, _thread = running_agent()

    def slow_fetch(source, *, access=None, on_progress=None, stop=None, pin=False):
        on_progress(40, 100)
        release.wait(20)
        return model

    monkeypatch.setattr(agent.weights, "fetch", slow_fetch)
    control_plane.desired = [make_spec("r-slow", model_source="s3://slow/model")]
    wait_until(lambda: "loading weights 40%" in control_plane.all_progress(), 10)
    status = next(s for s in control_plane.heartbeats[-1].replicas if s.replica_id == "r-slow")
    assert status.state == ReplicaState.STARTING and status.progress_percent == 40.0
    release.set()
    wait_until(lambda: control_plane.last_states().get("r-slow") == ReplicaState.READY, 15)


@pytest.mark.parametrize("under_reaper", [False, True], ids=["plain", "under-the-reaper"])
def test_next_agent_adopts_engines_a_detached_agent_left_running(control_plane, running_agent, tmp_path, under_reaper):
    """Under the reaper too, as every vLLM engine runs: it killed its engine when the agent exited (its death
    signal armed whatever the agent asked), so `--keep-engines-on-exit` kept no real engine."""
    model = tmp_path / "model"
    model.mkdir()
    control_plane.desired = [
        make_spec("r-stay", model_source=str(model)),
        make_spec("r-old", model_source=str(model)),
    ]
    first = spawn_agent_process(control_plane, tmp_path / "agent", keep_engines_on_exit=True, under_reaper=under_reaper)
    try:
        wait_until(lambda: set(control_plane.last_states().values()) == {ReplicaState.READY}
                   and len(control_plane.last_states()) == 2, 20)  # fmt: skip
        pids = {s.replica_id: s.pid for s in control_plane.heartbeats[-1].replicas}
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=SPAWNED_SHUTDOWN_DEADLINE_S + 15) == 0
        threading.Event().wait(1.0)  # a reaper told of the agent's death kills its group at once
        assert {p.pid for p in processes_with_marker("r-stay")} >= {pids["r-stay"]}, (
            "engines outlive the agent"
        )
        assert all(OUTLIVES_AGENT_ENV not in p.environ() for p in processes_with_marker("r-stay")
                   if p.pid != pids["r-stay"]), "the reaper keeps its instruction to itself"  # fmt: skip
        # The control plane meanwhile stopped wanting r-old.
        control_plane.desired = [make_spec("r-stay", model_source=str(model))]
        agent, _stop, _thread = running_agent()
        wait_until(lambda: control_plane.ever_reported("r-old", ReplicaState.STOPPED), 60)
        replica = agent.supervisor.get("r-stay")
        assert (
            replica.state == ReplicaState.READY
            and replica.pid == pids["r-stay"]
            and replica.num_restarts == 0
        )
        assert processes_with_marker("r-old") == []
        # Its weights are pinned as a pull pins them: unpinned, they were the cache's first victim under pressure.
        assert agent.weights._pins.get(model.name, 0) >= 1
    finally:
        first.kill()


@pytest.mark.vllm
def test_cli_agent_serves_a_real_engine_and_sigterm_leaves_no_process(
    control_plane, tmp_path, tiny_model_dir
):

    control_plane.desired = [make_spec("r-cli", model_source=str(tiny_model_dir))]
    command = [
        sys.executable, "-m", "gpu_agent", "run",
        "--control-plane", control_plane.url,
        "--join-token", control_plane.join_token,
        "--data-dir", str(tmp_path / "agent"),
        "--cpu", "--name", "cpu-test-node",
    ]  # fmt: skip
    agent = subprocess.Popen(command, cwd=os.getcwd(), stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: control_plane.last_states().get("r-cli") == ReplicaState.READY, 300, step_s=0.5)
        assert control_plane.registrations[0].name == "cpu-test-node"
        status = next(s for s in control_plane.heartbeats[-1].replicas if s.replica_id == "r-cli")
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "ignore_eos": True}
        # The engine is closed to anyone without the replica's key, on every path but /health:
        # vLLM's own --api-key would leave /invocations, /tokenize, /pooling and /metrics open.
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for method, path, payload in [
            ("POST", "/v1/completions", body), ("POST", "/invocations", chat), ("POST", "/tokenize", {"prompt": "hi"}),
            ("GET", "/metrics", None), ("GET", "/v1/models", None), ("POST", "/pooling", {"input": "hi"}),
        ]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "engine-key-of-r-cli"}):
                refused = httpx.request(method, f"{status.address}{path}", json=payload, headers=headers, timeout=60)
                assert refused.status_code == 401, (path, headers, refused.status_code)
        assert httpx.get(f"{status.address}/health", timeout=10).status_code == 200
        key = {"Authorization": "Bearer engine-key-of-r-cli"}
        answer = httpx.post(f"{status.address}/v1/completions", json=body, headers=key, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 4
        assert httpx.post(f"{status.address}/tokenize", json={"prompt": "hi"}, headers=key, timeout=60).status_code == 200
        # The engine listens on the advertised address only, inside the node's engine port range.
        port = int(status.address.rsplit(":", 1)[1])
        assert DEFAULT_ENGINE_PORT_MIN <= port <= DEFAULT_ENGINE_PORT_MAX
        listening = {conn.laddr.ip for conn in psutil.net_connections("tcp") if conn.laddr and conn.laddr.port == port
                     and conn.status == psutil.CONN_LISTEN}
        assert listening == {"127.0.0.1"}
        # The key is never in the engine's command line or log; only the agent's own state file (0600) holds it.
        for path in (tmp_path / "agent").rglob("*"):
            if path.is_file() and b"engine-key-of-r-cli" in path.read_bytes():
                assert path.name == "replicas.json" and path.stat().st_mode & 0o077 == 0, path
        assert all("engine-key-of-r-cli" not in " ".join(p.cmdline()) for p in processes_with_marker("r-cli"))
        assert len(processes_with_marker("r-cli")) >= 2  # API server and EngineCore
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0
        assert processes_with_marker("r-cli") == []
    finally:
        agent.kill()
        for process in processes_with_marker("r-cli"):
            process.kill()


def test_a_new_models_reading_is_in_every_heartbeat_from_before_its_replica_is_ready(
        control_plane, running_agent, tmp_path, tokenizer_not_described):
    """The agent reads a model before it starts its engine, and from then on each heartbeat carries the reading; the
    control plane takes a heartbeat's readings before its replica reports, so by the time it hears READY it bills by
    the context the engine is launched with, never a brand-new model's 4,096 default while the engine serves more.
    (Heartbeats while the weights load report the replica STARTING with no reading yet.)
    NOTE: the tokenizer is not described (`tokenizer_not_described`): its child imports transformers, 10.7 s under
    load 8.6, and the replica missed its 15 s to READY on every run there; the claim is the context's reading."""
    model = tmp_path / "long-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                   "max_position_embeddings": 32768}))
    control_plane.desired = [make_spec("r-new", model_source=str(model), max_model_len=None)]
    running_agent()
    wait_until(lambda: control_plane.last_states().get("r-new") == ReplicaState.READY, 15)
    with control_plane.lock:
        reports = [(status.state, [w.model_info.max_model_len if w.model_info else None
                                   for w in beat.weights if w.source == str(model)])
                   for beat in control_plane.heartbeats for status in beat.replicas if status.replica_id == "r-new"]
    first_read = next(index for index, (_, readings) in enumerate(reports) if readings != [None])
    assert {state for state, _ in reports[:first_read]} <= {ReplicaState.STARTING}
    assert all(readings == [32768] for _, readings in reports[first_read:])
    assert reports[-1][0] == ReplicaState.READY
