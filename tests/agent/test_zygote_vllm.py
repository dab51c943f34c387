"""Replicas forked by the zygote with real vLLM on the tiny model.

One module-scoped agent with the zygote (the default when the standby is on), driven from the
main thread. The tests run in file order: several replicas started at once each answer from
children of the one zygote, a drained replica leaves nothing and the zygote stays, and a killed
zygote takes its engines down with it (the supervisor sees crashes) and leaves no process behind
once the agent shuts down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import psutil
import pytest

from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime import sandbox
from gpu_agent.runtime.agent import Agent
from gpu_agent.runtime.config import AgentConfig
from gpu_agent.runtime.supervisor import SupervisorPolicy
from gpu_agent.runtime.zygote import Zygote

from .conftest import make_spec, processes_with_marker, wait_for_state, wait_until
from .test_standby_vllm import data_dir_processes

pytestmark = pytest.mark.vllm

TIMEOUT_S = 600
NUM_AT_ONCE = 3


@pytest.fixture(scope="module")
def vllm_cache_root(tmp_path_factory):
    """vLLM's cache directory of this module's zygote and engines, empty at first."""
    cache_root = tmp_path_factory.mktemp("vllm-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CACHE_ROOT", str(cache_root))
        yield cache_root


@pytest.fixture(scope="module")
def agent(tmp_path_factory, vllm_cache_root):
    config = AgentConfig(
        control_plane_url="http://127.0.0.1:9",  # never called: the tests drive the supervisor
        join_token="unused",
        data_dir=tmp_path_factory.mktemp("zygote-agent"),
        force_cpu=True,
        standby=True,
    )
    agent = Agent(config, policy=SupervisorPolicy(restart_backoff_s=0.5, stop_timeout_s=20))
    yield agent
    agent.supervisor.shutdown(timeout_s=20)
    for process in data_dir_processes(config.data_dir):
        process.kill()


def zygote_pid(agent) -> int:
    """The zygote process itself (the standby's Popen is its reaper)."""
    supervisor = agent.supervisor
    wait_until(lambda: supervisor.standby_ready, TIMEOUT_S, step_s=0.5, poll=supervisor.poll)
    (zygote,) = [
        child for child in psutil.Process(supervisor.standby.pid).children()
        if "gpu_agent.runtime.standby_process" in child.cmdline()
    ]
    return zygote.pid


def complete(replica) -> dict:
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 8, "ignore_eos": True}
    response = httpx.post(f"{replica.address}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {replica.spec.engine_api_key}"})
    response.raise_for_status()
    return response.json()


def test_the_zygote_has_the_model_class_facts_on_disk_before_any_engine_starts(agent, vllm_cache_root):
    # Else the first engine of an architecture on a node inspects it in a fresh interpreter that imports
    # vLLM again (21.8 s of a 30 s cold start on the tiny CPU model).
    zygote_pid(agent)
    assert agent.supervisor.replica_ids() == []
    cached = vllm_cache_root / "modelinfos" / "vllm-model_executor-models-llama-LlamaForCausalLM.json"
    assert json.loads(cached.read_text())["modelinfo"]


def test_several_replicas_started_at_once_each_answer_from_their_own_fork_of_one_zygote(agent, tiny_model_dir):
    supervisor = agent.supervisor
    assert isinstance(supervisor.standby, Zygote)
    parent = zygote_pid(agent)
    replica_ids = [f"r-fork-{index}" for index in range(NUM_AT_ONCE)]
    for replica_id in replica_ids:
        supervisor.start(make_spec(replica_id, model_source=str(tiny_model_dir)), tiny_model_dir)
    for replica_id in replica_ids:
        wait_for_state(supervisor, replica_id, ReplicaState.READY, timeout_s=TIMEOUT_S)
    replicas = [supervisor.get(replica_id) for replica_id in replica_ids]
    assert all(replica.from_standby for replica in replicas)
    # All were due in the same poll: their handoffs went out together, before the first fork was waited for
    # (`Supervisor._send_due_to_zygote`), and no fork's `started` line was lost among the others.
    assert supervisor.standby.num_sent_ahead == NUM_AT_ONCE and supervisor.standby.started == {}
    assert {psutil.Process(replica.pid).ppid() for replica in replicas} == {parent}
    assert len({replica.address for replica in replicas}) == NUM_AT_ONCE
    for replica in replicas:
        assert complete(replica)["usage"]["completion_tokens"] == 8
        assert "on the zygote" in replica.log_path.read_text()
        # Each engine (and what it started) carries its own replica's marker, as a plain launch would.
        assert replica.pid in {process.pid for process in processes_with_marker(replica.spec.replica_id)}
        # Each engine leads its own session, as a plain launch does: autogroup scheduling shares CPU out per
        # session, and in the zygote's one, four engines got one engine's share.
        assert os.getsid(replica.pid) == replica.pid != os.getsid(parent)
        # On CPU the model runs in the EngineCore (`standby_process._keep_uniproc_executor`): two processes, not
        # vLLM's forced separate worker with its shared-memory queue and that queue's resource tracker; above them the
        # outer process and the init of the engine's own namespaces (`namespaces.py`), where it has them.
        tree = [psutil.Process(replica.pid), *psutil.Process(replica.pid).children(recursive=True)]
        num_namespace_processes = 0 if sandbox.namespaces_missing() else 2
        assert len(tree) == num_namespace_processes + 2, [process.cmdline() for process in tree]
        assert "EngineCore" in " ".join(tree[-1].cmdline())
        # Both carry the marker where /proc shows it (vLLM's process title must not overwrite it).
        assert {process.pid for process in tree} <= {process.pid for process in processes_with_marker(replica.spec.replica_id)}
    assert supervisor.standby.num_spawned == 1 and supervisor.standby_ready, "nothing to refill"
    assert agent.build_heartbeat().standby_ready
    # libgomp reads its wait policy when the zygote imports torch: spinning OpenMP threads of engines
    # forked from it took the cores the other engines were starting on (engine.CPU_OPENMP_ENV).
    assert psutil.Process(parent).environ().get("OMP_WAIT_POLICY") == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")


def test_a_drained_replica_leaves_nothing_and_the_zygote_stays(agent):
    supervisor = agent.supervisor
    parent = zygote_pid(agent)
    supervisor.drain("r-fork-0", timeout_s=30)
    wait_for_state(supervisor, "r-fork-0", ReplicaState.STOPPED, timeout_s=60)
    assert processes_with_marker("r-fork-0") == []
    assert zygote_pid(agent) == parent and supervisor.standby_ready
    # What the drained engine started was reaped too: no zombie left under the zygote's reaper.
    reaper = psutil.Process(supervisor.standby.pid)
    wait_until(lambda: [child for child in reaper.children() if child.pid != parent] == [], 30)


def test_a_killed_zygote_takes_its_engines_down_and_shutdown_leaves_no_process(agent):
    supervisor = agent.supervisor
    parent = zygote_pid(agent)
    engines = [supervisor.get(f"r-fork-{index}").pid for index in range(1, NUM_AT_ONCE)]
    engine_trees = [pid for engine in engines for pid in (engine, *(c.pid for c in psutil.Process(engine).children(recursive=True)))]
    os.kill(parent, signal.SIGKILL)

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(lambda: all(gone(pid) for pid in engine_trees), 60, step_s=0.2, poll=supervisor.poll)
    for index in range(1, NUM_AT_ONCE):
        replica = supervisor.get(f"r-fork-{index}")
        wait_until(lambda replica=replica: replica.num_restarts >= 1, 30, step_s=0.2, poll=supervisor.poll)
        assert "engine exited" in replica.failure_reason
    supervisor.shutdown(timeout_s=20)
    wait_until(lambda: data_dir_processes(agent.config.data_dir) == [], 30)


# What the zygote does to the modules it shares, checked in one fresh interpreter that imports vLLM once
# (~15 s of CPU; one each cost the suite a minute), in the order the zygote does it (`standby_process.main`),
# the snippet that edits `sys.modules` last. Each test below reads its own snippet's outcome.
SNIPPETS = {
    "lookups": (
        "import importlib.metadata as metadata\n"
        "from types import SimpleNamespace\n"
        "from gpu_agent.runtime import standby_process\n"
        "from vllm.entrypoints.serve.utils import fingerprint\n"
        "before = {group: sorted(ep.value for ep in metadata.entry_points(group=group))\n"
        "          for group in ('console_scripts', 'vllm.general_plugins', 'vllm.stat_logger_plugins')}\n"
        "standby_process._share_model_independent_lookups()\n"
        "for group, values in before.items():\n"
        "    assert sorted(ep.value for ep in metadata.entry_points(group=group)) == values, group\n"
        "assert before['console_scripts'], 'vllm installs console scripts'\n"
        "calls = []\n"
        "class Config:\n"
        "    def compute_hash(self):\n"
        "        calls.append(self)\n"
        "        return f'{len(calls):08d}'\n"
        "config, other = Config(), Config()\n"
        "first = fingerprint.get_system_fingerprint(config)\n"
        "assert fingerprint.get_system_fingerprint(config) == first and len(calls) == 1\n"
        "assert fingerprint.get_system_fingerprint(other) != first and len(calls) == 2\n"
        "fingerprint.set_default_fingerprint_mode('custom', 'mine')\n"
        "assert fingerprint.get_system_fingerprint(other) == 'mine'\n"
    ),
    "logging": (
        "import vllm.logger, vllm.v1.engine.core as core\n"
        "from gpu_agent.runtime import standby_process\n"
        "original = vllm.logger.configure_logging\n"
        "standby_process._skip_inherited_logging_setup()\n"
        "assert core.configure_logging is vllm.logger.configure_logging_if_needed, core.configure_logging\n"
        "assert vllm.logger.configure_logging is original, 'configure_logging_if_needed would call itself'\n"
    ),
    "routes": (
        "import fastapi.routing\n"
        "from gpu_agent.runtime import standby_process\n"
        "from vllm.entrypoints.openai.chat_completion import api_router\n"
        "standby_process._warm_app_build()\n"
        "assert id(api_router.create_chat_completion) in fastapi.routing._endpoint_context_cache\n"
    ),
    "gloo": (
        "import os, torch, torch.distributed as dist\n"
        "from gpu_agent.runtime import standby_process\n"
        "from tests.processes import free_port\n"
        "standby_process._share_one_gloo_device()\n"
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "def threads():\n"
        "    return {task: open(f'/proc/self/task/{task}/comm').read().strip() for task in os.listdir('/proc/self/task')}\n"
        "dist.all_reduce(torch.ones(1))\n"
        "before = threads()\n"
        "groups = [dist.new_group([0], backend='gloo') for _ in range(8)]\n"
        "for group in [None, *groups]:\n"
        "    tensor = torch.ones(2)\n"
        "    dist.all_reduce(tensor, group=group)\n"
        "    dist.barrier(group=group)\n"
        "    found = [None]\n"
        "    dist.all_gather_object(found, {'rank': 0}, group=group)\n"
        "    assert tensor.tolist() == [1.0, 1.0] and found == [{'rank': 0}]\n"
        "# Each new group adds its one worker thread and no device (whose network loop thread is named after the\n"
        "# transport, or not at all, by the build: the count is what holds).\n"
        "added = [name for task, name in threads().items() if task not in before]\n"
        "assert len(added) == len(groups), (added, before)\n"
        "dist.destroy_process_group()\n"
    ),
    "patches": (
        "import sys, types, vllm.utils.system_utils as system_utils, vllm.v1.engine.utils as engine_utils\n"
        "from gpu_agent.runtime import standby_process\n"
        "original = system_utils.get_mp_context\n"
        "standby_process._patch_forked_engines('cpu')\n"
        "assert engine_utils.get_mp_context().get_start_method() == 'fork'\n"
        "assert standby_process._patched_modules == (len(sys.modules), list(sys.modules)[-1])\n"
        "late = types.ModuleType('vllm_late_import'); late.get_mp_context = original\n"
        "sys.modules['vllm_late_import'] = late\n"
        "assert standby_process._modules_imported_since_patch() == [('vllm_late_import', late)]\n"
        "standby_process._force_fork_children(standby_process._modules_imported_since_patch())\n"
        "assert late.get_mp_context is not original and late.get_mp_context().get_start_method() == 'fork'\n"
        "# A module removed since: the zygote's last one is no longer where it was, so every module is looked at.\n"
        "del sys.modules[standby_process._patched_modules[1]]\n"
        "assert len(standby_process._modules_imported_since_patch()) == len(sys.modules)\n"
    ),
}
RUN_SNIPPETS = """
import json, sys, traceback
outcomes = {}
for name, code in json.loads(sys.stdin.read()).items():
    try:
        exec(compile(code, name, "exec"), {"__name__": name})
        outcomes[name] = ""
    except BaseException:
        outcomes[name] = traceback.format_exc()
print(json.dumps(outcomes))
"""


@pytest.fixture(scope="module")
def in_one_interpreter() -> dict[str, str]:
    """Each snippet's traceback ("" where it passed), all run in one interpreter."""
    done = subprocess.run([sys.executable, "-c", RUN_SNIPPETS], input=json.dumps(SNIPPETS), capture_output=True,
                          text=True, check=True, timeout=TIMEOUT_S)
    return json.loads(done.stdout.splitlines()[-1])


def test_the_zygote_patches_its_modules_once_and_an_engine_only_what_it_imported_since(in_one_interpreter):
    # Each engine walked every module of `sys.modules` twice in its API server (~0.15 s at load); the zygote
    # now does it before it forks, and an engine patches only the modules imported after that, found from the
    # end of `sys.modules` (listing it whole copied thousands of the zygote's pages into every engine).
    assert in_one_interpreter["patches"] == "", in_one_interpreter["patches"]


def test_the_zygote_answers_the_entry_points_and_the_fingerprint_its_engines_asked_for_again(in_one_interpreter):
    # Every engine read every installed package's entry points three times and hashed its whole configuration
    # once per serving class: the answers are the same, so they come from the zygote (or are kept).
    assert in_one_interpreter["lookups"] == "", in_one_interpreter["lookups"]


def test_the_zygote_reads_the_routes_source_positions_its_engines_read_on_their_first_request(in_one_interpreter):
    # FastAPI reads an endpoint's source file on the first request to it, keyed by the function: read in the
    # zygote, for the same function objects every forked engine's app routes to.
    assert in_one_interpreter["routes"] == "", in_one_interpreter["routes"]


def test_forked_engine_processes_skip_the_logging_set_up_they_inherit(in_one_interpreter):
    # The EngineCore calls vLLM's `configure_logging` by name; it set up every logger again in each forked
    # engine (~0.5 s of CPU) because patching `vllm.logger` first hid the original from the comparison.
    assert in_one_interpreter["logging"] == "", in_one_interpreter["logging"]


def test_one_rank_gloo_groups_share_one_device_so_an_idle_engine_runs_one_network_loop(in_one_interpreter):
    # vLLM's CPU engine makes ~9 one-rank gloo groups; each had its own device, whose loop thread wakes every
    # 10 ms: ~0.02 CPU-s/s of an idle READY engine. One device now serves them all; collectives still work.
    assert in_one_interpreter["gloo"] == "", in_one_interpreter["gloo"]
