"""Replicas started from the warm standby with real vLLM on the tiny model.

One module-scoped agent (no control plane: the tests drive its supervisor directly,
polling from the main thread, which PR_SET_PDEATHSIG ties the engines to). The tests
run in file order: a standby-started replica serves, the standby is refilled, a killed
engine restarts from the new standby, drain leaves no process, shutdown leaves no standby.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import psutil
import pytest

from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime.agent import Agent
from gpu_agent.runtime.config import AgentConfig
from gpu_agent.runtime.engine import DATA_DIR_ENV_MARKER
from gpu_agent.runtime.supervisor import SupervisorPolicy

from .conftest import make_spec, processes_with_marker, wait_for_state, wait_until

pytestmark = pytest.mark.vllm

TIMEOUT_S = 300


def data_dir_processes(data_dir) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["pid"]):
        try:
            if process.environ().get(DATA_DIR_ENV_MARKER) == str(data_dir) and process.status() != "zombie":
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    config = AgentConfig(
        control_plane_url="http://127.0.0.1:9",  # never called: the tests drive the supervisor
        join_token="unused",
        data_dir=tmp_path_factory.mktemp("standby-agent"),
        force_cpu=True,
        standby=True,
        zygote=False,  # the one-shot standby; test_zygote_vllm.py runs the fork server
    )
    agent = Agent(config, policy=SupervisorPolicy(restart_backoff_s=0.5, stop_timeout_s=20))
    yield agent
    agent.supervisor.shutdown(timeout_s=20)
    for process in data_dir_processes(config.data_dir):
        process.kill()


def wait_for_standby(agent) -> int:
    supervisor = agent.supervisor
    wait_until(lambda: supervisor.standby_ready, TIMEOUT_S, step_s=0.5, poll=supervisor.poll)
    return supervisor.standby.pid


def complete(replica) -> dict:
    """A completion straight from the replica's engine, with the replica's key (it answers no other)."""
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 8, "ignore_eos": True}
    response = httpx.post(f"{replica.address}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {replica.spec.engine_api_key}"})
    response.raise_for_status()
    return response.json()


def test_a_standby_started_replica_serves_completions_with_usage(agent, tiny_model_dir):
    supervisor = agent.supervisor
    standby_pid = wait_for_standby(agent)
    assert agent.build_heartbeat().standby_ready
    supervisor.start(make_spec("r-warm", model_source=str(tiny_model_dir)), tiny_model_dir)
    wait_for_state(supervisor, "r-warm", ReplicaState.READY)
    replica = supervisor.get("r-warm")
    assert replica.from_standby and replica.pid == standby_pid
    assert complete(replica)["usage"]["completion_tokens"] == 8
    # The standby (under its reaper) now carries the replica's marker, as a plain engine would.
    engine_pids = {p.pid for p in psutil.Process(standby_pid).children()}
    assert engine_pids & {p.pid for p in processes_with_marker("r-warm")}
    assert "on the warm standby" in replica.log_path.read_text()


def test_the_standby_is_refilled_after_use(agent):
    supervisor = agent.supervisor
    new_pid = wait_for_standby(agent)
    assert new_pid != supervisor.get("r-warm").pid
    assert agent.build_heartbeat().standby_ready
    assert supervisor.standby.num_handoffs == 1 and supervisor.standby.num_spawned == 2


def test_a_killed_standby_started_engine_restarts_on_the_next_standby(agent):
    supervisor = agent.supervisor
    old_pid = supervisor.get("r-warm").pid
    standby_pid = supervisor.standby.pid
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: supervisor.get("r-warm").state == ReplicaState.STARTING, 30, poll=supervisor.poll)
    wait_for_state(supervisor, "r-warm", ReplicaState.READY)
    replica = supervisor.get("r-warm")
    assert replica.num_restarts == 1 and replica.pid == standby_pid and replica.from_standby
    assert "engine exited" in replica.failure_reason
    assert complete(replica)["usage"]["completion_tokens"] == 8
    assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE


def test_drain_and_shutdown_leave_no_engine_and_no_standby(agent):
    supervisor = agent.supervisor
    wait_for_standby(agent)
    supervisor.drain("r-warm", timeout_s=30)
    wait_for_state(supervisor, "r-warm", ReplicaState.STOPPED, timeout_s=60)
    assert processes_with_marker("r-warm") == []
    standby = psutil.Process(supervisor.standby.pid)
    assert {p.pid for p in data_dir_processes(agent.config.data_dir)} == {
        standby.pid,
        *(child.pid for child in standby.children(recursive=True)),
    }
    supervisor.shutdown(timeout_s=20)
    # NOTE: the standby's group is killed and its leader waited for; a child SIGKILLed with it may still read as
    # running for a moment (one clean run saw one): waited for, a while, never more than that.
    deadline = time.monotonic() + 10
    while data_dir_processes(agent.config.data_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert data_dir_processes(agent.config.data_dir) == []
    assert not agent.build_heartbeat().standby_ready


def test_a_killed_agent_leaves_no_standby_behind(tmp_path):
    data_dir = tmp_path / "agent"
    script = textwrap.dedent(
        f"""
        import time
        import psutil
        from gpu_agent.runtime.supervisor import Supervisor
        supervisor = Supervisor({str(data_dir)!r}, standby=True)  # one-shot (test_zygote_vllm.py: zygote)
        supervisor.poll()
        # Killed while the standby imports vLLM (most of its life before a handoff), once the reaper has
        # started it: waiting for it to be ready only cost the suite the import's CPU.
        while not psutil.Process(supervisor.standby.pid).children():
            time.sleep(0.05)
        print(supervisor.standby.pid, flush=True)
        time.sleep(600)
        """
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        standby_pid = int(agent.stdout.readline())
        running = {p.pid for p in data_dir_processes(data_dir.resolve())}
        assert standby_pid in running and len(running) >= 2, "the reaper and the standby it started"
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        wait_until(lambda: data_dir_processes(data_dir.resolve()) == [], 10)
    finally:
        agent.kill()
        for process in data_dir_processes(data_dir.resolve()):
            process.kill()
