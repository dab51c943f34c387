"""`local`: a node pool's machines are agent processes on this machine, in CPU mode.

The default of `make run`, so the whole loop (demand, launch, join, idle, release) runs and is
tested on one machine. Each launch is `python -m gpu_agent run --cpu` in its own session, with its
own data folder `<LOCAL_POOL_DIR>/<launch_id>/`, log `<launch_id>.log` and engine port block, and a
state file (`controlplane.local_agents`) that later calls, other processes and `make stop` read.

NOTE: the join token reaches the agent only through its environment (`INFERPLANE_JOIN_TOKEN`):
argv is readable by every user in /proc, a process's environment only by its owner.
NOTE: the agent runs in a new session, so it outlives the Celery worker that launched it (a
worker restart must not kill the fleet's machines). Its engines run in sessions of their own but
inherit its working directory (the launch's folder): `terminate` stops the agent's group, then
whatever still works in that folder (`controlplane.local_agents.stop_agent`).
NOTE: the agent gets the launcher's environment less the control plane's own settings (secrets).

Template fields: `agent_args` (allow-listed agent flags, `agent_flags`), `control_plane_url`
(default: the `LaunchSpec`'s, i.e. `AGENT_CONTROL_PLANE_URL`), `engine_ports` ("LOW-HIGH", the
range blocks are taken from) and `ports_per_node` (the size of each machine's block).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from django.conf import settings

from controlplane import local_agents
from controlplane.env import SETTINGS_ENV_VARS
from controlplane.local_agents import LocalAgent
from endpoints.fleet.providers.agent_flags import agent_args_errors, agent_argv
from endpoints.fleet.providers.base import LaunchResult, LaunchSpec, Machine, PoolSpec, ProviderError
from endpoints.fleet.providers.template_fields import parse_port_range, unknown_field_errors, url_errors
from gpu_agent.protocol import DEFAULT_ENGINE_PORT_MAX, DEFAULT_ENGINE_PORT_MIN

# NOTE: below the default agent's range (20000-29999, the first agent of `make run`) and below
# Linux's ephemeral ports (32768+), so a pool's engines never collide with either.
DEFAULT_ENGINE_PORTS = (10000, 19999)
DEFAULT_PORTS_PER_NODE = 100
TEMPLATE_FIELDS = ("agent_args", "control_plane_url", "engine_ports", "ports_per_node")
assert DEFAULT_ENGINE_PORTS[1] < DEFAULT_ENGINE_PORT_MIN or DEFAULT_ENGINE_PORTS[0] > DEFAULT_ENGINE_PORT_MAX


def _ports_per_node(template: dict) -> int:
    value = template.get("ports_per_node", DEFAULT_PORTS_PER_NODE)
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError("A whole number of ports, at least 2.")
    return value


class LocalProvider:
    name = "local"

    def template_errors(self, template: dict) -> dict[str, list[str]]:
        errors = unknown_field_errors(template, TEMPLATE_FIELDS)
        if "template" in errors:
            return errors
        if "agent_args" in template and (problems := agent_args_errors(template["agent_args"])):
            errors["template.agent_args"] = problems
        if "control_plane_url" in template and (problems := url_errors(template["control_plane_url"])):
            errors["template.control_plane_url"] = problems
        ports = None
        try:
            ports = parse_port_range(template.get("engine_ports", DEFAULT_ENGINE_PORTS))
        except ValueError as error:
            errors["template.engine_ports"] = [str(error)]
        try:
            per_node = _ports_per_node(template)
            if ports and per_node > ports[1] - ports[0] + 1:
                errors["template.ports_per_node"] = ["Larger than the whole engine_ports range."]
        except ValueError as error:
            errors["template.ports_per_node"] = [str(error)]
        return errors

    def zones(self, template: dict) -> list[str]:
        return [""]

    def launch(self, pool: PoolSpec, specs: list[LaunchSpec]) -> list[LaunchResult]:
        if errors := self.template_errors(pool.template):
            raise ProviderError(f"invalid template: {errors}")
        directory = _pool_dir()
        results = []
        for spec in specs:
            try:
                with _locked(directory):
                    agent = _live(directory, spec.launch_id) or _start(directory, pool, spec)
            except ProviderError as error:
                results.append(LaunchResult(launch_id=spec.launch_id, error=str(error)))
                continue
            results.append(LaunchResult(launch_id=spec.launch_id, provider_id=agent.launch_id))
        return results

    def terminate(self, pool: PoolSpec, provider_id: str) -> None:
        directory = _pool_dir()
        path = local_agents.state_path(directory, _safe_id(provider_id))
        agent = LocalAgent.load(path)
        if agent is None:
            return
        local_agents.stop_agent(agent, directory)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        shutil.rmtree(directory / agent.launch_id, ignore_errors=True)

    def list(self, pool: PoolSpec) -> list[Machine]:
        return [
            Machine(provider_id=agent.launch_id, launch_id=agent.launch_id, state="running", node_name=agent.name,
                    fleet_marked=(agent.fleet_id == settings.FLEET_ID and bool(pool.installation_id)
                                  and agent.installation_id == pool.installation_id))
            for agent in local_agents.read_agents(_pool_dir())
            if agent.pool_id == pool.id and local_agents.is_alive(agent)
        ]

    def stopped(self, pool: PoolSpec) -> set[str]:
        """The launch ids of this folder's recorded agents that no longer run (`make stop` keeps their records).

        NOTE: a launch without a record here is unknown, not stopped: another `make run`, with another data folder
        and the same database, runs its own agents, recorded in its own folder."""
        return {agent.launch_id for agent in local_agents.read_agents(_pool_dir())
                if agent.pool_id == pool.id and not local_agents.is_alive(agent)}


def _pool_dir() -> Path:
    directory = Path(settings.LOCAL_POOL_DIR)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def _safe_id(launch_id: str) -> str:
    # NOTE: ids name files: a path separator or `..` must never reach one.
    if not launch_id or not all(c.isalnum() or c in "-_" for c in launch_id):
        raise ProviderError(f"not a launch id: {launch_id!r}")
    return launch_id


@contextlib.contextmanager
def _locked(directory: Path):
    """One launch at a time per folder (across processes): port blocks are chosen from the live
    records, and two launches must never pick the same one."""
    with open(directory / ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _live(directory: Path, launch_id: str) -> LocalAgent | None:
    agent = LocalAgent.load(local_agents.state_path(directory, _safe_id(launch_id)))
    return agent if agent is not None and local_agents.is_alive(agent) else None


def _free_block(directory: Path, template: dict) -> tuple[int, int]:
    low, high = parse_port_range(template.get("engine_ports", DEFAULT_ENGINE_PORTS))
    per_node = _ports_per_node(template)
    taken = [(a.engine_port_min, a.engine_port_max) for a in local_agents.read_agents(directory) if local_agents.is_alive(a)]
    for start in range(low, high - per_node + 2, per_node):
        block = (start, start + per_node - 1)
        if all(block[1] < other[0] or block[0] > other[1] for other in taken):
            return block
    raise ProviderError(f"no free engine port block of {per_node} in {low}-{high}: too many local machines")


def _agent_environment(join_token: str) -> dict[str, str]:
    """The launcher's environment without the control plane's own settings (its database URL, secret
    key, Stripe keys: `SETTINGS_ENV_VARS`), plus the join token. An agent is another program: it gets
    what a GPU machine's agent would, never the control plane's secrets."""
    env = {name: value for name, value in os.environ.items()
           if name not in SETTINGS_ENV_VARS and not name.startswith("DJANGO_")}
    env.pop("INFERPLANE_AGENT_ENGINE_PORTS", None)  # the launch's own block, on the command line
    return env | {"INFERPLANE_JOIN_TOKEN": join_token}


def _start(directory: Path, pool: PoolSpec, spec: LaunchSpec) -> LocalAgent:
    ports = _free_block(directory, pool.template)
    data_dir = directory / _safe_id(spec.launch_id)
    data_dir.mkdir(mode=0o700, exist_ok=True)
    argv = [
        sys.executable, "-m", "gpu_agent", "run",
        "--control-plane", pool.template.get("control_plane_url") or spec.control_plane_url,
        "--data-dir", str(data_dir),
        "--cpu",
        "--name", spec.name,
        "--engine-ports", f"{ports[0]}-{ports[1]}",
        *agent_argv(pool.template.get("agent_args")),
    ]
    env = _agent_environment(spec.join_token)
    with open(directory / f"{spec.launch_id}.log", "ab") as log:
        try:
            process = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True, cwd=data_dir,
            )
        except OSError as error:
            raise ProviderError(f"could not start the agent: {error}") from error
    # Reap it when it exits while this process lives (else it lingers as a zombie); if this process
    # goes first, init adopts and reaps it.
    threading.Thread(target=process.wait, name=f"reap-agent-{process.pid}", daemon=True).start()
    started = local_agents.process_start_time(process.pid)
    if started is None:
        raise ProviderError(f"the agent exited at once: see {directory / f'{spec.launch_id}.log'}")
    agent = LocalAgent(
        launch_id=spec.launch_id, pool_id=pool.id, name=spec.name, pid=process.pid, pgid=process.pid,
        started=started, engine_port_min=ports[0], engine_port_max=ports[1], fleet_id=settings.FLEET_ID,
        installation_id=pool.installation_id,
    )
    agent.save(directory)
    return agent
