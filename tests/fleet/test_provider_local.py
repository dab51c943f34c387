"""The `local` node-pool provider: real agent processes on this machine, in their own session.

The agents are the real `python -m gpu_agent run --cpu`, pointed at a control plane address nobody
listens on (they keep retrying their heartbeat): what is tested is the process side (detached,
token only in the environment, port blocks, state files, stopping the whole group), not joining,
which the end-to-end node-pool tests cover.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controlplane import local_agents
from controlplane.local_agents import LocalAgent
from endpoints.fleet.providers import get_provider, pool_spec
from endpoints.fleet.providers.base import LaunchSpec, PoolSpec
from endpoints.nodes.models import FleetInstallation, NodePool, PoolProvider
from tests.processes import REPO_ROOT, free_port, wait_until

TOKEN = "jt_local-provider-secret-0123456789"


@pytest.fixture
def pool_dir(tmp_path, settings):
    directory = tmp_path / "local-pool"
    settings.LOCAL_POOL_DIR = str(directory)
    yield directory
    # NOTE: 1 s to exit before it is killed with all it started: an agent caught in a heartbeat finishes it first, and a
    # whole-suite run waited out the 5 s here. This is cleanup: the provider's stop is the terminate test's to check.
    local_agents.stop_all(directory, wait_s=1)


INSTALLATION_ID = "6b1d4a0e-3c2f-4e8a-9d7b-5a4c3b2a1f00"  # `FleetInstallation.current_id()` of this control plane


def _pool(**template) -> PoolSpec:
    template.setdefault("agent_args", ["--no-standby"])
    return PoolSpec(id=7, name="cpu-local", gpu_type="cpu", gpus_per_node=0, gpu_memory_mb=4096, template=template,
                    installation_id=INSTALLATION_ID)


def _spec(launch_id: str, name: str = "") -> LaunchSpec:
    # Nobody listens there: the agent keeps retrying its heartbeat and stays up.
    return LaunchSpec(launch_id=launch_id, name=name or f"pool-{launch_id[:8]}", join_token=TOKEN,
                      control_plane_url=f"http://127.0.0.1:{free_port()}")


def _group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def test_launch_starts_a_detached_cpu_agent_with_the_join_token_only_in_its_environment(pool_dir, monkeypatch):
    monkeypatch.setenv("DJANGO_SECRET_KEY", "the-control-planes-own-secret")
    monkeypatch.setenv("STRIPE_SECRET_KEY", "sk_test_control_plane_only")
    provider = get_provider("local")
    [result] = provider.launch(_pool(), [_spec("6b1d0a4e-launch-one", name="cpu-local-1")])

    assert result.error == "" and result.provider_id == "6b1d0a4e-launch-one"
    state = json.loads((pool_dir / "6b1d0a4e-launch-one.json").read_text())
    pid = state["pid"]
    assert os.getsid(pid) == pid and os.getpgid(pid) == pid  # its own session: a worker's exit spares it
    assert state["started"] == local_agents.process_start_time(pid)
    assert (state["engine_port_min"], state["engine_port_max"]) == (10000, 10099)

    # NOTE: waited for: Popen returns once the child's exec is past its point of no return, and its arguments are
    # mapped a moment later; read in between, under load, the cmdline was empty (a whole-suite run failed so).
    argv = wait_until(lambda: Path(f"/proc/{pid}/cmdline").read_bytes(), 10, message="its arguments").split(b"\0")
    assert TOKEN.encode() not in b" ".join(argv)  # argv is world-readable
    assert argv[1:4] == [b"-m", b"gpu_agent", b"run"] and b"--cpu" in argv and b"--no-standby" in argv
    assert argv[argv.index(b"--data-dir") + 1] == str(pool_dir / "6b1d0a4e-launch-one").encode()
    assert argv[argv.index(b"--engine-ports") + 1] == b"10000-10099"
    assert argv[argv.index(b"--name") + 1] == b"cpu-local-1"
    environment = Path(f"/proc/{pid}/environ").read_bytes()
    assert f"INFERPLANE_JOIN_TOKEN={TOKEN}".encode() in environment.split(b"\0")
    assert b"the-control-planes-own-secret" not in environment and b"sk_test_control_plane_only" not in environment
    wait_until(lambda: b"heartbeat failed" in (pool_dir / "6b1d0a4e-launch-one.log").read_bytes(), 60,
               message="the agent's log")

    [machine] = provider.list(_pool())
    assert (machine.provider_id, machine.launch_id, machine.state, machine.node_name) == (
        "6b1d0a4e-launch-one", "6b1d0a4e-launch-one", "running", "cpu-local-1")
    assert machine.fleet_marked  # its record names this installation
    another_installation = dataclasses.replace(_pool(), installation_id="0f0e0d0c-0000-4000-8000-00000000000a")
    assert [machine.fleet_marked for machine in provider.list(another_installation)] == [False]
    assert provider.list(PoolSpec(id=8, name="other", gpu_type="cpu", gpus_per_node=0, gpu_memory_mb=1)) == []


def test_launching_the_same_launch_id_twice_keeps_one_agent(pool_dir):
    provider = get_provider("local")
    [first] = provider.launch(_pool(), [_spec("launch-twice")])
    pid = json.loads((pool_dir / "launch-twice.json").read_text())["pid"]
    [again] = provider.launch(_pool(), [_spec("launch-twice")])

    assert again == first
    assert json.loads((pool_dir / "launch-twice.json").read_text())["pid"] == pid
    assert len(provider.list(_pool())) == 1


def test_each_live_machine_gets_its_own_engine_port_block_and_a_released_block_is_reused(pool_dir):
    provider = get_provider("local")
    pool = _pool(engine_ports="15000-15299", ports_per_node=100)
    provider.launch(pool, [_spec("block-a"), _spec("block-b")])

    def block(launch_id):
        agent = LocalAgent.load(pool_dir / f"{launch_id}.json")
        return agent.engine_port_min, agent.engine_port_max

    assert (block("block-a"), block("block-b")) == ((15000, 15099), (15100, 15199))
    provider.terminate(pool, "block-a")
    provider.launch(pool, [_spec("block-c")])
    assert block("block-c") == (15000, 15099)
    provider.launch(pool, [_spec("block-d")])
    [full] = provider.launch(pool, [_spec("block-e")])
    assert full.provider_id == "" and "no free engine port block" in full.error


def test_terminate_stops_the_agent_with_its_engines_and_may_be_repeated(pool_dir):
    provider = get_provider("local")
    pool = _pool(agent_args=[])  # with its warm standby engine, in a session of its own
    provider.launch(pool, [_spec("group-launch")])
    agent = LocalAgent.load(pool_dir / "group-launch.json")
    log = pool_dir / "group-launch.log"
    spawned = wait_until(lambda: re.search(rb"standby: spawned pid (\d+)", log.read_bytes()), 60,
                         message="the agent's standby engine")
    standby_pid = int(spawned.group(1))
    assert os.getpgid(standby_pid) != agent.pgid
    assert set(local_agents.processes_in(pool_dir / "group-launch")) >= {agent.pid, standby_pid}

    provider.terminate(pool, "group-launch")

    assert _group_members(agent.pgid) == [] and local_agents.process_start_time(standby_pid) is None
    assert not (pool_dir / "group-launch.json").exists() and not (pool_dir / "group-launch").exists()
    assert provider.list(pool) == []
    provider.terminate(pool, "group-launch")  # already gone: nothing happens


def test_a_process_that_ignores_sigterm_is_killed_with_its_group(tmp_path):
    script = "trap '' TERM; sleep 300 & sleep 300"
    process = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    wait_until(lambda: len(_group_members(process.pid)) >= 3, 10, message="the group")
    agent = LocalAgent(launch_id="stubborn", pool_id=1, name="n", pid=process.pid, pgid=process.pid,
                       started=local_agents.process_start_time(process.pid), engine_port_min=1, engine_port_max=2)

    local_agents.stop_agent(agent, tmp_path, wait_s=1)

    process.wait(5)
    wait_until(lambda: _group_members(process.pid) == [], 5, message="the group gone")


def test_a_reused_pid_is_never_mistaken_for_the_agent(pool_dir):
    provider = get_provider("local")
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        pool_dir.mkdir(parents=True, exist_ok=True)
        # The record of an agent that died, whose pid now belongs to another process.
        LocalAgent(launch_id="reused-pid", pool_id=7, name="gone", pid=stranger.pid, pgid=stranger.pid,
                   started="1", engine_port_min=10000, engine_port_max=10099).save(pool_dir)

        assert provider.list(_pool()) == []
        provider.terminate(_pool(), "reused-pid")
        assert stranger.poll() is None  # the stranger was not signalled

        LocalAgent(launch_id="reused-pid", pool_id=7, name="gone", pid=stranger.pid, pgid=stranger.pid,
                   started="1", engine_port_min=10000, engine_port_max=10099).save(pool_dir)
        [result] = provider.launch(_pool(), [_spec("reused-pid")])
        assert result.provider_id == "reused-pid"
        assert LocalAgent.load(pool_dir / "reused-pid.json").pid != stranger.pid  # a new agent
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_templates_accept_only_allow_listed_agent_flags_and_sane_port_blocks():
    errors = get_provider("local").template_errors

    assert errors({}) == {}
    assert errors({"agent_args": ["--no-zygote", "--cpu-kv-cache-gib", "2", "--log-level=DEBUG"],
                   "engine_ports": "12000-12999", "ports_per_node": 50,
                   "control_plane_url": "http://127.0.0.1:8000"}) == {}
    for hostile in (["--join-token", "x"], ["--control-plane=http://evil"], ["; rm -rf /"], ["--cpu-kv-cache-gib", "$(id)"],
                    "--no-standby", [["--no-standby"]]):
        assert "template.agent_args" in errors({"agent_args": hostile}), hostile
    assert "template.engine_ports" in errors({"engine_ports": "80-90"})
    assert "template.ports_per_node" in errors({"engine_ports": "12000-12009", "ports_per_node": 11})
    assert "template.control_plane_url" in errors({"control_plane_url": "file:///etc/passwd"})
    assert "template.subnets" in errors({"subnets": []})  # a field of another provider is refused


def _child_env(pool_dir: Path) -> dict[str, str]:
    return {**os.environ, "INFERPLANE_LOCAL_POOL_DIR": str(pool_dir), "DJANGO_SETTINGS_MODULE": "tests.settings"}


LAUNCH_AND_EXIT = """
import django, sys
django.setup()
from endpoints.fleet.providers import get_provider, pool_spec
from endpoints.fleet.providers.base import LaunchSpec, PoolSpec
from endpoints.nodes.models import NodePool, PoolProvider
pool = PoolSpec(id=7, name="cpu-local", gpu_type="cpu", gpus_per_node=0, gpu_memory_mb=1, template={"agent_args": ["--no-standby"]})
[result] = get_provider("local").launch(pool, [LaunchSpec(launch_id="from-a-worker", name="w", join_token="jt_0123456789", control_plane_url=sys.argv[1])])
print(result.provider_id)
"""


def test_an_agent_outlives_the_process_that_launched_it_and_make_stop_stops_it(pool_dir, tmp_path):
    env = _child_env(pool_dir)
    launched = subprocess.run([sys.executable, "-c", LAUNCH_AND_EXIT, f"http://127.0.0.1:{free_port()}"],
                              env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert launched.stdout.strip() == "from-a-worker", launched.stderr[-3000:]
    agent = LocalAgent.load(pool_dir / "from-a-worker.json")
    time.sleep(0.5)
    assert local_agents.is_alive(agent)  # its launcher has exited

    # `make stop`: an empty data folder, so no embedded server of the test run is touched.
    stop_env = {**env, "INFERPLANE_DATA_DIR": str(tmp_path / "empty-data")}
    subprocess.run([sys.executable, "-m", "controlplane.embedded", "down"], env=stop_env, cwd=REPO_ROOT,
                   check=True, timeout=60)

    assert not local_agents.is_alive(agent)
    assert _group_members(agent.pgid) == []


@pytest.mark.django_db
def test_providers_are_found_by_the_pools_provider_name_and_see_a_plain_copy_of_the_pool():
    assert {get_provider(choice).name for choice in PoolProvider.values} == {"local", "ec2", "kubernetes"}
    with pytest.raises(KeyError):
        get_provider("gce")
    pool = NodePool(pk=4, name="cpu", gpu_type="cpu", provider=PoolProvider.LOCAL, gpus_per_node=0,
                    gpu_memory_mb=8192, template={"ports_per_node": 10})
    spec = pool_spec(pool)
    assert (spec.id, spec.name, spec.gpus_per_node, spec.gpu_memory_mb, spec.template) == (4, "cpu", 0, 8192, {"ports_per_node": 10})
    spec.template["ports_per_node"] = 20
    assert pool.template == {"ports_per_node": 10}  # a copy: a provider never changes the row
    assert spec.installation_id == FleetInstallation.current_id() == pool_spec(pool).installation_id  # made once
