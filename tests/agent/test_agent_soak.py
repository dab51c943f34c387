"""An agent runs for a long day: replica after replica starts, serves, crashes or is dropped, in one process.

A guard against what grows per cycle until the agent dies or the node fills: after a warm-up, more cycles leave the
agent's open files, threads and child processes, its records of replicas, and its state file where they were (the
classes a soak of `tests/agent/fake_engine.py` engines found bounded; the weights cache's and the adapters' are
`test_weights_churn.py` and `test_lora_adapters.py`)."""

from __future__ import annotations

import os
import threading

import psutil

from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime import sandbox
from gpu_agent.runtime.agent import Agent
from gpu_agent.runtime.config import AgentConfig
from gpu_agent.runtime.supervisor import SupervisorPolicy

from .conftest import fake_engine_factory, make_spec, wait_until
from .test_agent_loop import FakeControlPlane

NUM_WARM_UP_CYCLES = 2
NUM_CYCLES = 3


def test_replica_after_replica_started_and_dropped_or_crashed_leaves_nothing_behind(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    plane = FakeControlPlane()
    plane.heartbeat_interval_s = 0.2
    agent = Agent(
        AgentConfig(control_plane_url=plane.url, join_token=plane.join_token, data_dir=tmp_path / "agent",
                    force_cpu=True, min_backoff_s=0.05, max_backoff_s=0.2),
        command_factory=fake_engine_factory(),
        policy=SupervisorPolicy(restart_backoff_s=0.05, max_consecutive_crashes=1, stop_timeout_s=2.0),
    )  # fmt: skip
    crashing = fake_engine_factory("--exit-after-s", "0.3")
    serving = agent.supervisor.command_factory
    agent.supervisor.command_factory = lambda spec, path, port: (
        crashing if spec.replica_id.endswith("crash") else serving
    )(spec, path, port)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()

    def cycle(index: int) -> None:
        for replica_id, state in (
            (f"r-{index}", ReplicaState.READY),
            (f"r-{index}-crash", ReplicaState.FAILED),
        ):
            plane.desired = [make_spec(replica_id, model_source=str(model))]
            plane.desired_changed.set()
            wait_until(
                lambda replica_id=replica_id, state=state: plane.last_states().get(replica_id) == state, 20
            )
            plane.desired = []
            plane.desired_changed.set()
            wait_until(lambda: plane.last_states() == {} and not agent.supervisor.replica_ids(), 20)
        with plane.lock:
            del plane.heartbeats[:-2]

    try:
        for index in range(NUM_WARM_UP_CYCLES):
            cycle(index)
        before = _footprint(agent)
        for index in range(NUM_WARM_UP_CYCLES, NUM_WARM_UP_CYCLES + NUM_CYCLES):
            cycle(index)
        # NOTE: a count may be up for a moment (the watch's long poll reconnecting): back where it was, soon after
        wait_until(lambda: _footprint(agent) == before, 10)
        logs = os.listdir(agent.supervisor.logs_dir)
        assert len(logs) == 2 * (NUM_WARM_UP_CYCLES + NUM_CYCLES)  # the ended replicas' logs, pruned past 50
    finally:
        stop.set()
        thread.join(20)
        plane.server.shutdown()


def _footprint(agent: Agent) -> dict:
    me = psutil.Process()
    supervisor, replicas = agent.supervisor, agent.replicas
    return {
        "open files": me.num_fds(),
        "threads": threading.active_count(),
        "child processes": len(me.children(recursive=True)),
        "replicas kept": sum(
            len(records)
            for records in (
                supervisor._replicas,
                supervisor._prepared,
                supervisor._built,
                supervisor._ports_held,
                supervisor._scratch_dirs,
                supervisor._adapter_dirs,
                replicas._pulls,
                replicas._pins,
                replicas._draft_pins,
                replicas._reported_terminal,
            )
        ),  # fmt: skip
        "state file bytes": supervisor.state_path.stat().st_size,
        "scratch folders": len(sandbox.scratch_folders_of(supervisor.data_dir)),
        "adapter folders": len(list((supervisor.data_dir / "engine-adapters").glob("*"))),
    }
