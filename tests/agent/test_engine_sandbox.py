"""Each engine is confined with Landlock: it reads its own model and writes its own folders, and nothing else.

Before, every engine on a node ran as the agent's user with all of its reach: it could read every other tenant's
cached weights, the agent's state and other engines' logs, list and open other engines' /dev/shm segments, and
signal other engines. Rules are checked as built (`sandbox.rules`), then applied in a plain child process, then
on real engines started the plain way and by the zygote. The plain one is test_vllm_replica.py's module engine
(`test_an_engine_started_plainly_serves_while_confined` there, with the helpers below): a plain launch costs ~20 s of
the suite, and that module starts one anyway.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from gpu_agent.protocol import RegisterRequest, ReplicaState, engine_sandbox_weakened
from gpu_agent.runtime import engine_disk, process, sandbox, shared_memory
from gpu_agent.runtime.adapters import AdapterLoadError, AdapterSlots
from gpu_agent.runtime.engine import build_engine_command
from gpu_agent.runtime.sandbox import SandboxMode, SandboxPolicy
from gpu_agent.runtime.standby import server_args
from gpu_agent.runtime.supervisor import Supervisor
from gpu_agent.runtime.tiny_model import build_tiny_lora_adapter

from .conftest import (
    fake_engine_factory,
    make_spec,
    processes_with_marker,
    wait_for_state,
    wait_until,
)

LANDLOCK_ABI = sandbox.landlock_abi()[0]
needs_landlock = pytest.mark.skipif(not LANDLOCK_ABI, reason="this kernel has no Landlock")


def policy_for(tmp_path: Path, **overrides) -> SandboxPolicy:
    values = {"model_dirs": [tmp_path / "own-model"], "own_dirs": [tmp_path / "own-work"]}
    values.update(overrides)
    return sandbox.engine_policy(SandboxMode.REQUIRED, **values)


# --- The rules as built ---------------------------------------------------------------------------------------


def test_rights_an_older_kernel_does_not_know_are_left_out_of_every_rule(tmp_path):
    (tmp_path / "own-model").mkdir()
    (tmp_path / "own-work").mkdir()
    policy = policy_for(tmp_path)
    for abi in (1, 2, 3, 4, 5, 6, 7):
        ruleset = sandbox.rules(policy, abi)
        assert ruleset.handled == sandbox.handled_rights(abi)
        assert all(rights & ~ruleset.handled == 0 for _path, rights in ruleset.rules)
    assert not sandbox.handled_rights(1) & (sandbox.REFER | sandbox.TRUNCATE | sandbox.IOCTL_DEV)
    assert sandbox.handled_rights(5) & sandbox.IOCTL_DEV and not sandbox.rules(policy, 5).scoped
    assert sandbox.rules(policy, 6).scoped == sandbox.SCOPE_SIGNAL | sandbox.SCOPE_ABSTRACT_UNIX_SOCKET


def test_a_files_rule_keeps_only_a_files_rights_and_a_missing_path_gets_none(tmp_path):
    (tmp_path / "own-model").mkdir()
    weights = tmp_path / "own-model" / "model.safetensors"
    weights.write_bytes(b"x")
    policy = policy_for(tmp_path, model_dirs=[weights, tmp_path / "gone"], own_dirs=[tmp_path])
    rules = dict(sandbox.rules(policy, 6).rules)
    assert rules[str(weights)] == sandbox.READ_FILE
    assert str(tmp_path / "gone") not in rules
    assert (
        rules[str(tmp_path)] & sandbox.MAKE_SOCK
    )  # vLLM's sockets between its processes go in its own folder


def test_shared_memory_is_never_listable_nor_anything_above_it_granted():
    rules = dict(sandbox.rules(SandboxPolicy(devices=tuple(sandbox.device_nodes())), 6).rules)
    assert rules["/dev/shm"] == sandbox.SHARED_MEMORY and not rules["/dev/shm"] & sandbox.READ_DIR
    assert not [path for path in rules if path in ("/", "/dev")]


def test_no_rule_reaches_the_agents_data_another_models_folder_or_its_settings(tmp_path):
    data_dir = tmp_path / "agent"
    other_model = data_dir / "weights" / "other-tenant"
    own_model = data_dir / "weights" / "own-tenant"
    for folder in (other_model, own_model):
        folder.mkdir(parents=True)
    policy = policy_for(tmp_path, model_dirs=[own_model])
    for path, _rights in sandbox.rules(policy, 6).rules:
        for private in (other_model, data_dir, Path("/etc/inferplane"), Path.home()):
            assert not private.is_relative_to(path), (path, private)


def test_a_policy_travels_as_json_and_a_bad_mode_is_refused_with_the_choices():
    policy = SandboxPolicy(
        mode=SandboxMode.BEST_EFFORT, read=("/a",), read_write=("/b",), shared_read_write=("/c",)
    )
    assert SandboxPolicy.from_json(policy.to_json()) == policy
    with pytest.raises(ValueError, match="required, best-effort, off"):
        sandbox.parse_mode("strict")
    with pytest.raises(ValueError, match="absolute"):
        SandboxPolicy(read=("relative",))


def test_the_node_says_what_confines_its_engines_when_it_registers():
    assert sandbox.node_fact(SandboxMode.OFF).startswith("none: ")
    fact = sandbox.node_fact(SandboxMode.BEST_EFFORT)
    landlock, isolation = fact.split("; ")
    assert landlock == f"landlock abi {LANDLOCK_ABI}" if LANDLOCK_ABI else landlock.startswith("none: ")
    missing = sandbox.namespaces_missing()
    assert isolation == (f"no namespaces: {missing}" if missing else "own pid, mount and user namespaces")
    request = RegisterRequest(
        join_token="t",
        name="n",
        gpu_type="cpu",
        num_gpus=0,
        gpu_memory_mb=0,
        num_cpus=1,
        memory_mb=1,
        agent_version="1",
        engine_sandbox=fact + "\x00" * 3 + "x" * 300,
    )
    assert "\x00" not in request.engine_sandbox and len(request.engine_sandbox) == 200


def test_a_nodes_fact_weakens_when_it_gains_a_part_that_confines_nothing():
    confined = "landlock abi 7; own pid, mount and user namespaces"
    shared = "landlock abi 7; no namespaces: unshare refused (EPERM)"
    assert engine_sandbox_weakened(confined, shared)
    assert engine_sandbox_weakened(confined, sandbox.node_fact(SandboxMode.OFF))
    assert engine_sandbox_weakened("", "none: the kernel has no Landlock (ENOSYS); own pid, mount and user namespaces")
    assert not engine_sandbox_weakened(shared, "landlock abi 7; no namespaces: unshare refused (ENOSPC)")
    assert not engine_sandbox_weakened(shared, confined)  # a node that recovered
    assert not engine_sandbox_weakened("", confined)  # a node first heard of from an older agent's registration


# --- A confined process -----------------------------------------------------------------------------------


def confined_script(body: str) -> str:
    """`body` after `sandbox.apply` of the policy in argv[1], with `attempt` to fill `seen` with what it could do."""
    return (
        textwrap.dedent("""
        import json, os, signal, sys
        from gpu_agent.runtime import process, sandbox
        seen = {"confined_by": sandbox.apply(sandbox.SandboxPolicy.from_json(sys.argv[1]))}
        def attempt(name, call):
            try:
                seen[name] = call()
            except OSError as exc:
                seen[name] = f"refused: {exc.strerror}"
    """)
        + textwrap.dedent(body)
        + "\nprint(json.dumps(seen))\n"
    )


def run_confined(tmp_path: Path, policy: SandboxPolicy, body: str, env: dict[str, str] | None = None) -> dict:
    """Run `body` in a fresh Python after `sandbox.apply(policy)`; it fills `seen` with what it could do."""
    done = subprocess.run([sys.executable, "-c", confined_script(body), policy.to_json()], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).parents[2], env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@needs_landlock
def test_a_confined_process_reads_its_own_model_and_not_another_tenants_beside_it(tmp_path):
    for folder in ("own-model", "other-model", "own-work"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(folder)
    seen = run_confined(
        tmp_path,
        policy_for(tmp_path),
        f"""
        attempt("own", lambda: open("{tmp_path}/own-model/config.json").read())
        attempt("other", lambda: open("{tmp_path}/other-model/config.json").read())
        attempt("list_other", lambda: os.listdir("{tmp_path}/other-model"))
        attempt("write_own_model", lambda: open("{tmp_path}/own-model/x", "w").close())
        attempt("write_work", lambda: open("{tmp_path}/own-work/x", "w").write("done") == 4)
        attempt("agent_state", lambda: open("{tmp_path}/replicas.json", "w").close())
    """,
    )
    assert seen["confined_by"].startswith(f"landlock abi {LANDLOCK_ABI}")
    assert seen["own"] == "own-model" and seen["write_work"] is True
    assert seen["other"] == seen["list_other"] == "refused: Permission denied"
    assert seen["write_own_model"] == seen["agent_state"] == "refused: Permission denied"


@needs_landlock
def test_a_confined_process_cannot_list_shared_memory_but_uses_its_own_segments(tmp_path):
    seen = run_confined(
        tmp_path,
        policy_for(tmp_path),
        """
        from multiprocessing import shared_memory
        attempt("listing", lambda: os.listdir("/dev/shm"))
        def own_segment():
            segment = shared_memory.SharedMemory(create=True, size=4096)
            segment.buf[:2] = b"ok"
            again = shared_memory.SharedMemory(name=segment.name)
            value = bytes(again.buf[:2]).decode()
            again.close(); segment.close(); segment.unlink()
            return value
        attempt("own_segment", own_segment)
    """,
    )
    assert seen["listing"] == "refused: Permission denied"
    assert seen["own_segment"] == "ok"


@needs_landlock
def test_an_engine_with_gpus_lets_its_later_children_name_their_threads_as_cudas_driver_does(tmp_path, monkeypatch):
    """CUDA's driver names each thread it starts by opening `/proc/self/task/<tid>/comm` to write (and truncate):
    where that was refused its cuInit failed (304), and every engine confined on an H200 saw no GPU
    (`bench/results/gpu_sandbox_check-h200-before.json`; read-only /proc). The write happens in vLLM's EngineCore
    and workers, processes started after the rule was made: an engine with NVIDIA's device nodes may write files in
    /proc, one without GPUs may not."""
    monkeypatch.setattr(sandbox, "device_nodes", lambda: [*sandbox.DEVICE_NODES, "/dev/nvidia0", "/dev/nvidiactl"])
    gpu_policy = policy_for(tmp_path)
    monkeypatch.undo()
    cpu_policy = policy_for(tmp_path)
    assert gpu_policy.proc_writable and not cpu_policy.proc_writable
    assert SandboxPolicy.from_json(gpu_policy.to_json()) == gpu_policy
    assert not SandboxPolicy.from_json(json.dumps({**json.loads(gpu_policy.to_json()), "proc_writable": None})).proc_writable
    body = """
        import subprocess
        def a_child_names_a_thread():
            # NOTE: a daemon thread, alive (asleep) while its name is written: the process exits once it has printed,
            # where it waited out the sleep.
            script = ("import threading, time; thread = threading.Thread(target=time.sleep, args=(2,), daemon=True); "
                      "thread.start(); "
                      "path = f'/proc/self/task/{thread.native_id}/comm'; open(path, 'w').write('cuda-EvtHandlr'); "
                      "print(open(path).read().strip())")
            done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
            return done.stdout.strip() or done.stderr.strip().splitlines()[-1]
        attempt("named", a_child_names_a_thread)
    """
    assert run_confined(tmp_path, gpu_policy, body)["named"] == "cuda-EvtHandlr"
    assert "Permission denied" in run_confined(tmp_path, cpu_policy, body)["named"]


@pytest.mark.skipif(LANDLOCK_ABI < 6, reason="Landlock scopes signals from ABI 6")
def test_a_confined_process_cannot_signal_a_process_outside_but_signals_its_own_child(tmp_path):
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        seen = run_confined(
            tmp_path,
            policy_for(tmp_path),
            f"""
            import subprocess
            attempt("outside", lambda: os.kill({outside.pid}, signal.SIGTERM))
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            attempt("own_child", lambda: os.kill(child.pid, signal.SIGKILL))
            child.wait()
        """,
        )
        assert seen["outside"] == "refused: Operation not permitted" and outside.poll() is None
        assert seen["own_child"] is None
    finally:
        outside.kill()
        outside.wait()


def confined_as_an_engine(tmp_path: Path, name: str) -> tuple[SandboxPolicy, dict[str, str]]:
    """The policy and environment the supervisor gives one launch (`Supervisor._confined`), with its own folders."""
    scratch = sandbox.make_scratch_folder(tmp_path / "agent", f"r-{name}")
    cache = tmp_path / "engine-caches" / name
    cache.mkdir(parents=True)
    policy = policy_for(tmp_path, model_dirs=[], own_dirs=[scratch, cache])
    return policy, {**os.environ, **sandbox.engine_folder_env(scratch, cache, policy.mode)}


@pytest.mark.skipif(LANDLOCK_ABI < 6, reason="Landlock scopes abstract Unix sockets from ABI 6")
def test_a_confined_engine_cannot_reach_another_engines_vllm_sockets_and_its_own_processes_still_do(tmp_path):
    # vLLM's processes talk over unauthenticated ZeroMQ `ipc://` sockets. Bound to a path in the scratch folder, they
    # were open to every engine on the node (Landlock does not govern connecting to a path's socket, and
    # /proc/net/unix lists them): one tenant's engine could send requests into another's, or read its outputs.
    policy_b, env_b = confined_as_an_engine(tmp_path, "b")
    policy_a, env_a = confined_as_an_engine(tmp_path, "a")
    engine_b = confined_script("""
        import subprocess, zmq
        from vllm.utils.network_utils import get_open_zmq_ipc_path
        address = get_open_zmq_ipc_path()
        server = zmq.Context().socket(zmq.REP)
        server.bind(address)
        client = ("import zmq; client = zmq.Context().socket(zmq.REQ); client.setsockopt(zmq.RCVTIMEO, 10000); "
                  f"client.connect({address!r}); client.send(b'own process'); print(client.recv().decode())")
        child = subprocess.Popen([sys.executable, "-c", client], stdout=subprocess.PIPE, text=True)
        server.setsockopt(zmq.RCVTIMEO, 10000)
        received = [server.recv().decode()]
        server.send(b"answered")
        seen["own_child"] = child.communicate(timeout=30)[0].strip()
        print(address, flush=True)
        sys.stdin.read()  # until the other engine has tried
        while server.poll(500):
            received.append(server.recv().decode())
            server.send(b"answered")
        seen["received"] = received
    """)
    b = subprocess.Popen([sys.executable, "-c", engine_b, policy_b.to_json()], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env_b, cwd=Path(__file__).parents[2])  # fmt: skip
    try:
        address = b.stdout.readline().strip()
        assert address.startswith("ipc://"), address
        seen = run_confined(
            tmp_path,
            policy_a,
            f"""
            import socket, zmq
            name = {address!r}.removeprefix("ipc://")
            raw = socket.socket(socket.AF_UNIX)
            attempt("connect", lambda: raw.connect("\\0" + name[1:] if name.startswith("@") else name))
            intruder = zmq.Context().socket(zmq.REQ)
            intruder.setsockopt(zmq.RCVTIMEO, 2000)
            intruder.setsockopt(zmq.LINGER, 0)
            intruder.connect({address!r})
            intruder.send(b"another engine")
            try:
                seen["answer"] = intruder.recv().decode()
            except zmq.Again:
                seen["answer"] = None
            """,
            env=env_a,
        )
        b_seen = json.loads(b.communicate(timeout=60)[0].splitlines()[-1])
    finally:
        b.kill()
        b.wait()
        for env in (env_a, env_b):
            shutil.rmtree(env["TMPDIR"], ignore_errors=True)
    assert b_seen["own_child"] == "answered"  # the engine's own processes still talk
    assert seen["connect"] == "refused: Operation not permitted" and seen["answer"] is None
    assert b_seen["received"] == ["own process"]


def test_vllms_sockets_are_abstract_where_landlock_scopes_them_and_in_the_scratch_folder_below(
    tmp_path, monkeypatch
):
    scratch, other = tmp_path / "inferplane-engine-1", tmp_path / "inferplane-engine-2"
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: (6, ""))
    base = sandbox.engine_folder_env(scratch, tmp_path, SandboxMode.BEST_EFFORT)["VLLM_RPC_BASE_PATH"]
    assert base.startswith(sandbox.ABSTRACT_SOCKET_PREFIX)
    assert base != sandbox.rpc_base_path(other, SandboxMode.REQUIRED)
    assert len(f"{base}/{uuid.uuid4()}".encode()) <= 108  # sun_path's size ("@" stands for its leading NUL)
    # an engine left unconfined: no scope would guard an abstract name
    assert sandbox.engine_folder_env(scratch, tmp_path, SandboxMode.OFF)["VLLM_RPC_BASE_PATH"] == str(scratch)
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: (5, ""))
    assert sandbox.engine_folder_env(scratch, tmp_path, SandboxMode.BEST_EFFORT)["VLLM_RPC_BASE_PATH"] == str(scratch)


def confine_from_environment(mode: SandboxMode, landlock_missing: bool) -> subprocess.CompletedProcess:
    """An engine's start (`apply_from_environment`) as it runs where Landlock is missing, or not."""
    script = textwrap.dedent(f"""
        from gpu_agent.runtime import process, sandbox
        if {landlock_missing}:
            sandbox.landlock_abi = lambda: (0, "the kernel has no Landlock (ENOSYS)")
        sandbox.apply_from_environment()
        print("vLLM would start now")
    """)
    env = {**os.environ, sandbox.POLICY_ENV: SandboxPolicy(mode=mode).to_json()}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60,
                          cwd=Path(__file__).parents[2])  # fmt: skip


def test_an_engine_that_cannot_be_confined_stops_if_required_and_says_so_either_way():
    required = confine_from_environment(SandboxMode.REQUIRED, landlock_missing=True)
    assert required.returncode == 78 and "vLLM would start now" not in required.stdout
    assert f"{sandbox.APPLIED_LINE} none: the kernel has no Landlock (ENOSYS)" in required.stderr
    best_effort = confine_from_environment(SandboxMode.BEST_EFFORT, landlock_missing=True)
    assert best_effort.returncode == 0 and "vLLM would start now" in best_effort.stdout
    assert "running unconfined" in best_effort.stderr


@pytest.fixture
def make_supervisor(tmp_path):
    """Supervisors of fake engines; whatever they started is gone after the test, passed or failed."""
    made = []

    def make(data_dir: Path | None = None, **options) -> Supervisor:
        made.append(
            Supervisor(data_dir or tmp_path / "agent", command_factory=fake_engine_factory(), **options)
        )
        return made[-1]

    yield make
    for supervisor in made:
        supervisor.shutdown(timeout_s=5)
        process.kill_orphans(supervisor.data_dir, set())


def test_a_replica_fails_with_the_reason_when_its_engine_must_be_confined_and_cannot_be(
    make_supervisor, tmp_path, monkeypatch
):
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: (0, "Landlock is not enabled at boot (EOPNOTSUPP)"))
    supervisor = make_supervisor(sandbox_mode=SandboxMode.REQUIRED)
    supervisor.start(make_spec("r-required"), tmp_path)
    wait_for_state(supervisor, "r-required", ReplicaState.FAILED, timeout_s=10)
    reason = supervisor.get("r-required").failure_reason
    assert "INFERPLANE_ENGINE_SANDBOX=required" in reason and "EOPNOTSUPP" in reason
    supervisor.shutdown(timeout_s=5)


def test_every_engine_is_started_through_the_entry_point_that_confines_it(tmp_path):
    command = build_engine_command(make_spec(), tmp_path, port=8123, device="cpu")
    assert command.argv[5:7] == ["-m", "gpu_agent.runtime.engine_main"]
    assert server_args(command)[:2] == ["--model", str(tmp_path)]  # the standby and zygote take it too


def test_an_engine_gets_its_own_folders_and_policy_and_they_go_with_it(make_supervisor, tmp_path):
    supervisor = make_supervisor()
    supervisor.start(make_spec("r-folders"), tmp_path / "model")
    wait_for_state(supervisor, "r-folders", ReplicaState.READY, timeout_s=30)
    env = supervisor.get("r-folders").command.env
    scratch = Path(env["TMPDIR"])
    policy = SandboxPolicy.from_json(env[sandbox.POLICY_ENV])
    assert env["HOME"] == str(scratch) and scratch.is_dir()
    assert env["VLLM_CACHE_ROOT"] == str(supervisor.data_dir / "engine-caches" / "e-1" / "vllm")
    assert str(scratch) in policy.read_write and str(tmp_path / "model") in policy.read
    assert not [path for path in policy.read + policy.read_write if Path(path) == supervisor.data_dir]
    supervisor.shutdown(timeout_s=5)
    assert not scratch.exists()


@needs_landlock
def test_an_engine_makes_no_socket_nor_fifo_in_its_endpoints_shared_cache_folder_and_does_in_its_scratch(
    make_supervisor, tmp_path
):
    # An endpoint's replicas on a node share its cache folder. Two of a hostile tenant's met on a socket there and
    # passed each other files of their own /dev/shm (Landlock does not govern connecting to a socket bound to a path),
    # each file keeping a stopped engine's whole tmpfs; vLLM's and torch's caches there are files.
    supervisor = make_supervisor()
    supervisor.command_factory = fake_engine_factory("--confine", "--give-shm-fd", "XDG_CACHE_HOME",
                                                     "--give-shm-fd", "TMPDIR")  # fmt: skip
    supervisor.start(make_spec("r-pass"), tmp_path / "model")
    wait_for_state(supervisor, "r-pass", ReplicaState.READY, timeout_s=30)
    replica = supervisor.get("r-pass")

    def logged_makes() -> dict:  # folder -> what it could make there, as the engine logged it
        lines = [line for line in replica.log_path.read_text().splitlines() if line.startswith("==> give ")]
        entries = [json.loads(line.removeprefix("==> give ")) for line in lines]
        return {entry.pop("folder"): entry for entry in entries}

    made = wait_until(lambda: len(logged_makes()) == 2 and logged_makes(), timeout_s=10)
    cache, scratch = replica.command.env["XDG_CACHE_HOME"], replica.command.env["TMPDIR"]
    assert made[cache] == {"socket": "refused: Permission denied", "fifo": "refused: Permission denied"}
    # its own processes' (vLLM's below Landlock ABI 6)
    assert made[scratch] == {"socket": "made", "fifo": "made"}
    assert str(scratch) in SandboxPolicy.from_json(replica.command.env[sandbox.POLICY_ENV]).read_write
    supervisor.shutdown(timeout_s=5)


def test_an_endpoint_id_that_is_not_a_plain_name_makes_its_cache_folder_inside_the_caches_folder(
    make_supervisor, tmp_path
):
    supervisor = make_supervisor()
    supervisor.start(make_spec("r-odd", endpoint_id="../../weights"), tmp_path / "model")
    wait_for_state(supervisor, "r-odd", ReplicaState.READY, timeout_s=30)
    cache = Path(supervisor.get("r-odd").command.env["XDG_CACHE_HOME"])
    assert cache.parent == supervisor.data_dir / "engine-caches" and cache.name.startswith("id-")
    assert (
        sandbox.folder_name("0b6f3c52-2a4e-4c4e-9d7e-3f1e1a2b3c4d") == "0b6f3c52-2a4e-4c4e-9d7e-3f1e1a2b3c4d"
    )
    supervisor.shutdown(timeout_s=5)


def test_an_adapter_is_staged_in_the_engines_own_folder_and_read_only_there(make_supervisor, tmp_path):
    supervisor = make_supervisor()
    adapter = build_tiny_lora_adapter(tmp_path / "cache" / "adapter-key")
    supervisor.start(make_spec("r-adapters"), tmp_path / "model")
    wait_for_state(supervisor, "r-adapters", ReplicaState.READY, timeout_s=30)
    staged = supervisor.stage_adapter("r-adapters", adapter)
    policy = SandboxPolicy.from_json(supervisor.get("r-adapters").command.env[sandbox.POLICY_ENV])
    assert staged.parent == supervisor.data_dir / "engine-adapters" / "r-adapters"
    assert str(staged.parent) in policy.read and str(staged.parent) not in policy.read_write
    assert (staged / "adapter_config.json").read_bytes() == (adapter / "adapter_config.json").read_bytes()
    assert supervisor.stage_adapter("r-adapters", adapter) == staged
    supervisor.shutdown(timeout_s=5)
    assert not staged.exists() and (adapter / "adapter_config.json").exists()


def test_an_engine_adopted_by_a_new_agent_keeps_its_folders_and_they_go_with_it(make_supervisor, tmp_path):
    data_dir = tmp_path / "agent"
    first = make_supervisor(data_dir)
    first.start(make_spec("r-kept"), tmp_path / "model")
    first.start(make_spec("r-gone"), tmp_path / "model")
    wait_until(lambda: {r.state for r in first.statuses()} == {ReplicaState.READY}, 30, poll=first.poll)
    scratch = Path(first.get("r-kept").command.env["TMPDIR"])
    killed_scratch = Path(first.get("r-gone").command.env["TMPDIR"])
    first._probe.close()  # the old agent vanishes without stopping its engines
    first._replicas.clear()

    second = make_supervisor(data_dir)
    assert second.recover({"r-kept": make_spec("r-kept")}) == (["r-kept"], ["r-gone"])
    adapter = build_tiny_lora_adapter(tmp_path / "cache" / "adapter-key")
    # Staged where the adopted engine may read, not handed over from the weights cache it may not.
    assert second.stage_adapter("r-kept", adapter).parent == data_dir / "engine-adapters" / "r-kept"
    assert not (data_dir / "engine-adapters" / "r-gone").exists() and not killed_scratch.exists()
    assert scratch.exists()
    second.shutdown(timeout_s=5)
    assert not scratch.exists() and not (data_dir / "engine-adapters" / "r-kept").exists()


def test_an_engines_staged_adapters_are_bounded_to_what_it_holds_at_once(tmp_path):
    # Each adapter named was staged (hard-linked) for the engine and kept: the copies outlived their cache entries,
    # whose bytes the cache counted as freed, and a tenant naming adapter after adapter filled the node's disk outside
    # the cache's budget (the review of the sandbox).
    folder = tmp_path / "engine-adapters" / "r1"
    folder.mkdir(parents=True)
    adapters = [build_tiny_lora_adapter(tmp_path / "cache" / f"key-{number}") for number in range(6)]
    for adapter in adapters:
        sandbox.stage_adapter(adapter, folder, keep=2)
    assert sorted(path.name for path in folder.iterdir()) == ["key-4", "key-5"]
    sandbox.stage_adapter(adapters[4], folder, keep=2)  # used again: kept ahead of key-5
    sandbox.stage_adapter(adapters[0], folder, keep=2)
    assert sorted(path.name for path in folder.iterdir()) == ["key-0", "key-4"]


def test_a_replicas_adapters_are_staged_with_its_engines_adapter_slots_as_the_bound(tmp_path):
    from gpu_agent.protocol import AdapterSpec
    from gpu_agent.runtime.adapters import ReplicaAdapters

    adapter = build_tiny_lora_adapter(tmp_path / "cache" / "key")
    staged = []
    adapters = ReplicaAdapters(lambda spec: adapter,
                               stage=lambda replica_id, path, keep=None: staged.append(keep) or path)
    spec = make_spec("r-slots", max_loras=3, max_lora_rank=16,
                     adapters=[AdapterSpec(name="a", source="s3://b/a", credentials=None, weights_scope="org-1",
                                           wanted_at=1.0)])
    adapters._run(spec, AdapterSlots("http://127.0.0.1:9", "key", 3))
    assert staged == [3]


def test_a_new_agent_adopts_no_scratch_folder_an_engine_names_but_its_own(make_supervisor, tmp_path):
    # The folder comes from the engine's environment block, which a compromised engine may rewrite: one naming another
    # engine's live folder had it removed when it ended itself (the review of the sandbox).
    data_dir = tmp_path / "agent"
    own = sandbox.make_scratch_folder(data_dir, "r-a")
    victim = sandbox.make_scratch_folder(data_dir, "r-b")
    try:
        assert sandbox.is_scratch_folder(own, "r-a", data_dir)
        assert not sandbox.is_scratch_folder(victim, "r-a", data_dir)
        assert not sandbox.is_scratch_folder(own, "r-a", tmp_path / "another-agent")
    finally:
        for folder in (own, victim):
            subprocess.run(["rm", "-rf", str(folder)], check=True)


def _vanish(agent: Supervisor) -> None:
    """The agent is killed: its engines run on, and its state file stays as it last wrote it."""
    agent._probe.close()
    agent._replicas.clear()


@pytest.mark.parametrize("engine_hides", ["its owner file removed", "its TMPDIR rewritten"])
def test_an_adopted_engine_that_hides_its_scratch_folder_is_measured_there_and_it_goes_with_it(
    make_supervisor, tmp_path, monkeypatch, engine_hides
):
    """Before, the new agent found an adopted engine's scratch by the engine's owner file and environment, both the
    engine's to rewrite: with the file removed the engine wrote 5 MB past a 1 MB bound and stayed READY, its folder
    left after the agent's exit; with its TMPDIR rewritten, the new agent's start removed its live folder as a killed
    agent's leftover. Now the folder is the one the agent's own state file records."""
    from gpu_agent.runtime import supervisor as supervisor_module
    from gpu_agent.runtime.engine_disk import EngineDiskBounds

    data_dir = tmp_path / "agent"
    bounds = EngineDiskBounds(engine_max_bytes=1_000_000, check_interval_s=0.01)
    first = make_supervisor(data_dir, disk_bounds=bounds)
    first.start(make_spec("r-kept"), tmp_path / "model")
    wait_until(lambda: {r.state for r in first.statuses()} == {ReplicaState.READY}, 30, poll=first.poll)
    scratch = Path(first.get("r-kept").command.env["TMPDIR"])
    _vanish(first)
    if engine_hides == "its owner file removed":
        (scratch / sandbox.SCRATCH_OWNER_FILE).unlink()  # the engine's own folder: its to write
    else:  # as the new agent reads the engine's environment block, which the engine rewrote
        decoy = sandbox.make_scratch_folder(data_dir, "r-kept")
        shutil.rmtree(decoy)
        environ = psutil.Process.environ
        monkeypatch.setattr(supervisor_module.psutil.Process, "environ",
                            lambda self: {**environ(self), "TMPDIR": str(decoy)})

    second = make_supervisor(data_dir, disk_bounds=bounds)
    assert second.recover({"r-kept": make_spec("r-kept")}) == (["r-kept"], [])
    wait_until(lambda: not second._removals.pending(), 10)
    assert scratch.is_dir() and second.get("r-kept").state == ReplicaState.READY  # its live folder kept
    (scratch / "fill.bin").write_bytes(os.urandom(5_000_000))  # the engine writes 5x its bound there
    second.check_disk()
    assert second.get("r-kept").state == ReplicaState.FAILED
    second.shutdown(timeout_s=5)
    assert not scratch.exists()


def test_a_killed_engine_that_removed_its_owner_file_has_its_scratch_folder_removed_by_the_next_agent(
    make_supervisor, tmp_path
):
    """Before, the next agent found a killed agent's engines' folders by their owner files (or names set aside): an
    engine that removed its file kept its folder on the node's disk past both agents. Now its record names it."""
    data_dir = tmp_path / "agent"
    first = make_supervisor(data_dir)
    first.start(make_spec("r-gone"), tmp_path / "model")
    wait_until(lambda: {r.state for r in first.statuses()} == {ReplicaState.READY}, 30, poll=first.poll)
    scratch = Path(first.get("r-gone").command.env["TMPDIR"])
    _vanish(first)
    (scratch / sandbox.SCRATCH_OWNER_FILE).unlink()
    (scratch / "fill.bin").write_bytes(b"x" * 1000)

    second = make_supervisor(data_dir)
    try:
        assert second.recover({}) == ([], ["r-gone"])
        wait_until(lambda: not scratch.exists() and not sandbox.scratch_set_aside_of(data_dir), 10)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class _AgentKilled(BaseException):
    """The agent is killed here: nothing of it runs after (no handler of its own catches this)."""


@pytest.mark.parametrize("sent_to", ["a plain launch", "the zygote"])
def test_a_scratch_folder_made_before_its_agent_was_killed_is_removed_by_the_next_agent_whatever_its_owner_file(
    make_supervisor, tmp_path, monkeypatch, sent_to
):
    """Before, a launch's scratch folder was named in the state file only with its engine's record, at the end of the
    launch: an agent killed after making it (on the zygote's path the engine forks at once) left a folder only the
    engine-writable owner file named, and with that file removed the next agent's start kept it for ever (the folder
    was still there after its removals were done). Now the state file names it before any engine starts."""
    data_dir = tmp_path / "agent"
    first = make_supervisor(data_dir)
    made = []
    confined = first._confined

    def killed_after(replica, command):
        command = confined(replica, command)
        made.append(Path(command.env["TMPDIR"]))
        raise _AgentKilled

    monkeypatch.setattr(first, "_confined", killed_after)
    first.start(make_spec("r-made"), tmp_path / "model")
    if sent_to == "the zygote":  # as `_send_due_to_zygote` does with each replica due, before the fork
        first._build_due()
        with pytest.raises(_AgentKilled):
            first._confined(first.get("r-made"), first._built["r-made"][1])
    else:
        with pytest.raises(_AgentKilled):
            wait_until(lambda: False, 10, poll=first.poll)
    scratch = made[0]
    assert scratch.is_dir() and first.get("r-made").pid is None  # made, no engine
    _vanish(first)
    (scratch / sandbox.SCRATCH_OWNER_FILE).unlink()  # an engine started in it may remove it

    second = make_supervisor(data_dir)
    try:
        assert second.recover({}) == ([], [])
        wait_until(lambda: not second._removals.pending(), 10)
        assert not scratch.exists() and not sandbox.scratch_set_aside_of(data_dir)
        assert "scratch folders made for engines not yet recorded" not in json.loads(second.state_path.read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_full_disk_fails_each_launch_whose_scratch_cannot_be_recorded_removes_that_folder_and_the_poll_goes_on(
    make_supervisor, tmp_path, monkeypatch
):
    """Before (the review of fix-fleet8), `StateFile.save` let the OSError through: the save before a launch raised,
    the poll failed the replica, whose own save raised again out of `poll`: the replicas after it were never stepped
    (here: `poll` raised ENOSPC, the second launch never came). Now a save that fails is logged; a launch whose
    scratch folder could not be recorded fails and that folder goes (no engine ever runs with a folder no record
    names), and the rest of the poll goes on."""
    import errno

    from gpu_agent.runtime import state_file

    supervisor = make_supervisor(tmp_path / "agent")
    if supervisor.sandbox_mode == SandboxMode.OFF:
        pytest.skip("engines get no scratch folder with the sandbox off")
    supervisor.start(make_spec("r-up"), tmp_path / "model")
    wait_for_state(supervisor, "r-up", ReplicaState.READY, timeout_s=30)
    made = []
    make_scratch_folder = sandbox.make_scratch_folder

    def recorded(data_dir, replica_id):
        made.append(make_scratch_folder(data_dir, replica_id))
        return made[-1]

    def disk_full(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sandbox, "make_scratch_folder", recorded)
    monkeypatch.setattr(state_file.StateFile, "_write", disk_full)
    supervisor.start(make_spec("r-new"), tmp_path / "model")
    supervisor.start(make_spec("r-later"), tmp_path / "model")
    wait_until(lambda: all(supervisor.get(replica_id).state == ReplicaState.FAILED for replica_id in ("r-new", "r-later")),
               30, poll=supervisor.poll)  # fmt: skip
    for replica_id in ("r-new", "r-later"):
        assert "could not be written" in supervisor.get(replica_id).failure_reason
        assert not processes_with_marker(replica_id)  # no engine started with an unrecorded folder
    assert len(made) >= 2 and not supervisor._scratch_dirs.keys() & {"r-new", "r-later"}
    wait_until(lambda: not supervisor._removals.pending(), 10)
    assert not any(folder.exists() for folder in made)
    assert not sandbox.scratch_set_aside_of(supervisor.data_dir)
    supervisor.poll()
    assert supervisor.get("r-up").state == ReplicaState.READY  # the running engine is still stepped


def test_a_scratch_folder_a_record_names_is_taken_only_where_the_agent_makes_that_replicas(tmp_path):
    # The state file is the agent's own, but a path read back from it never names a folder outside the temporary
    # folder, another replica's, or one set aside.
    own = sandbox.make_scratch_folder(tmp_path / "agent", "r-a")
    try:
        assert sandbox.recorded_scratch_folder(str(own), "r-a") == own
        gone = own.with_name(own.name + "x")  # not there: nothing to adopt or remove, and no error
        assert sandbox.recorded_scratch_folder(str(gone), "r-a") == gone
        for recorded in [str(tmp_path / own.name), f"{own.parent}/../{own.parent.name}/{own.name}", f"{own}/sub",
                         f"{own.parent}//{own.name}", str(own.parent), own.name, "", 7, [str(own)]]:
            assert sandbox.recorded_scratch_folder(recorded, "r-a") is None, recorded
        assert sandbox.recorded_scratch_folder(str(own), "r-b") is None
        aside = sandbox.set_scratch_aside(sandbox.make_scratch_folder(tmp_path / "agent", "r-a"), tmp_path / "agent")
        assert sandbox.recorded_scratch_folder(str(aside), "r-a") is None
        shutil.rmtree(aside)
    finally:
        shutil.rmtree(own)


# A new agent looking for what a killed one's engines left (`scratch_folders_of`, at its start, under the supervisor's
# lock) and adopting a live engine's folder (`is_scratch_folder`, the path from the engine's own environment), in a
# child held to this much memory: what it reads of an owner file is a path.
_FIND_SCRATCH_FOLDERS = """
import resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, (512 * 1024**2, 512 * 1024**2))
from gpu_agent.runtime import sandbox
data_dir = Path(sys.argv[1])
print(sorted(folder.name for folder in sandbox.scratch_folders_of(data_dir)))
print(sandbox.is_scratch_folder(Path(sys.argv[2]), "r-hostile", data_dir))
"""


@pytest.mark.parametrize("owner_file", ["a FIFO", "a link to /dev/zero"])
def test_an_engine_that_swaps_its_folders_owner_file_for_a_fifo_or_an_endless_file_never_holds_up_a_new_agent(
    tmp_path, monkeypatch, owner_file
):
    """Its scratch folder is the engine's to write: Landlock lets it make a FIFO or a link there. Before, the next agent
    opened the FIFO and waited for a writer for ever (every restart of the node's agent hung, the node OFFLINE), or
    read /dev/zero until it ran out of memory."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(sandbox.tempfile, "tempdir", os.fspath(temporary))
    data_dir = tmp_path / "agent"
    own = sandbox.make_scratch_folder(data_dir, "r-own")
    hostile = sandbox.make_scratch_folder(data_dir, "r-hostile")
    owner = hostile / sandbox.SCRATCH_OWNER_FILE
    owner.unlink()
    if owner_file == "a FIFO":
        os.mkfifo(owner)
    else:
        owner.symlink_to("/dev/zero")

    found = subprocess.run(
        [sys.executable, "-c", _FIND_SCRATCH_FOLDERS, os.fspath(data_dir), os.fspath(hostile)],
        env=os.environ | {"TMPDIR": os.fspath(temporary)}, cwd=Path(sandbox.__file__).resolve().parents[2],
        capture_output=True, text=True, timeout=60,  # NOTE: a hang's bound, not a timing: it answers at once
    )

    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.splitlines() == [repr([own.name]), "False"], "the hostile folder is not taken as the agent's"


def test_a_link_an_engine_left_in_its_endpoints_cache_folder_never_has_the_agent_write_where_it_points(tmp_path):
    """The cache folder is its endpoints' engines' to write: one made its `vllm` folder a link to another tenant's cached
    model, and the next launch had the agent make its `modelinfos` link there (before: in the other tenant's folder)."""
    cache_dir = tmp_path / "engine-caches" / "endpoint"
    other_tenants_model = tmp_path / "weights" / "key"
    other_tenants_model.mkdir(parents=True)
    cache_dir.mkdir(parents=True)
    (cache_dir / "vllm").symlink_to(other_tenants_model, target_is_directory=True)

    sandbox.prepare_cache_folder(cache_dir, tmp_path / "shared")

    assert list(other_tenants_model.iterdir()) == []
    assert (cache_dir / "vllm").is_dir() and not (cache_dir / "vllm").is_symlink()
    assert (cache_dir / "vllm" / "modelinfos").readlink() == tmp_path / "shared" / "modelinfos"


@pytest.mark.parametrize("mode", [SandboxMode.BEST_EFFORT, SandboxMode.OFF])
def test_while_engines_are_confined_the_zygote_loads_no_tenants_look_ups_ahead(tmp_path, monkeypatch, mode):
    # The zygote loaded the look-ups engines recorded (one tenant's config, tokenizer, chat template) and every engine
    # it forked afterwards had them in its heap, which the confinement otherwise keeps apart; a confined engine could
    # not append to the record either (the review of the sandbox).
    from gpu_agent.runtime import zygote_models
    from gpu_agent.runtime.engine import DATA_DIR_ENV_MARKER, ZYGOTE_WARM_ENV

    data_dir = tmp_path / "agent"
    data_dir.mkdir()
    (data_dir / zygote_models.RECORD_NAME).write_text('{"lookup": "get_config", "call": "[]"}\n')  # from before
    supervisor = Supervisor(data_dir, command_factory=fake_engine_factory(), standby=True, zygote=True,
                            sandbox_mode=mode)
    confined = mode != SandboxMode.OFF
    assert (supervisor.standby.env.get(ZYGOTE_WARM_ENV) == "0") == confined
    assert (data_dir / zygote_models.RECORD_NAME).exists() != confined
    monkeypatch.setenv(DATA_DIR_ENV_MARKER, str(data_dir))
    for name, value in supervisor.standby.env.items():
        monkeypatch.setenv(name, value)
    assert (zygote_models.record_path() is None) == confined


# --- Real engines ---------------------------------------------------------------------------------------------


def complete(replica) -> dict:
    body = {"model": replica.spec.served_model_name, "prompt": "hello world", "max_tokens": 4}
    response = httpx.post(f"{replica.address}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {replica.spec.engine_api_key}"})  # fmt: skip
    response.raise_for_status()
    return response.json()


def confinement_line(replica) -> str:
    lines = [
        line for line in replica.log_path.read_text().splitlines() if line.startswith(sandbox.APPLIED_LINE)
    ]
    return lines[-1] if lines else ""


def no_new_privileges(pid: int) -> bool:
    """Whether the process set no_new_privs, which Landlock needs (nothing else in an engine sets it)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return "NoNewPrivs:\t1" in status


def unix_socket_names(processes) -> set[str]:
    """The names of the Unix sockets `processes` hold open ("@..." abstract, "/..." bound to a path)."""
    inodes = set()
    for found in processes:
        for fd in Path(f"/proc/{found.pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    names = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[6] in inodes:
            names.add(fields[7])
    return names


def engine_processes(replica) -> list[psutil.Process]:
    """The API server, its EngineCore and worker; the reaper above them is the agent's, and stays unconfined."""
    top = psutil.Process(replica.pid)
    found = [top, *top.children(recursive=True)]
    return [process for process in found if "reaper" not in " ".join(process.cmdline())]


def assert_only_abstract_sockets_of_its_own(replica) -> None:
    # NOTE: a socket bound to a path is reachable by every engine on the node (Landlock does not govern connecting to
    # it); an abstract one only from the engine's own Landlock domain.
    base = replica.command.env["VLLM_RPC_BASE_PATH"]
    names = unix_socket_names(engine_processes(replica))
    assert base.startswith(sandbox.ABSTRACT_SOCKET_PREFIX) and names
    assert all(name.startswith(base + "/") for name in names), names


def assert_hides_the_machines_sockets_in_its_own_namespaces(replica) -> None:
    """An engine in namespaces of its own serves with the machine's socket folders hidden (`test_engine_unix_sockets`)."""
    line = confinement_line(replica)
    if "no namespaces: " not in line:
        assert f"the machine's sockets hidden: {', '.join(sandbox.MACHINE_SOCKET_FOLDERS)}" in line, line


def assert_holds_nothing_of_its_folders_unlinked(node: Supervisor, replica) -> None:
    """A real engine holds no file of its folders' disks with no name left: its disk bound counts what it did before
    (`shared_memory.held_by`'s `disk_devices`)."""
    folders = [Path(replica.command.env[name]) for name in ("TMPDIR", "XDG_CACHE_HOME")]
    with_disks = shared_memory.held_by_tree(replica.pid, node.shared_memory_dir, engine_disk.devices_of(folders))
    held = shared_memory.held_by_tree(replica.pid, node.shared_memory_dir)
    assert (with_disks.num_bytes, with_disks.num_files) == (held.num_bytes, held.num_files)


@pytest.mark.vllm
@needs_landlock
def test_an_engine_forked_by_the_zygote_serves_confined_and_reads_no_adapter_outside_its_own_folder(
    engine_node, tiny_model_dir, tmp_path
):
    from tests.engines import serve_engine

    outside = build_tiny_lora_adapter(tmp_path / "another-tenants-folder")
    spec = make_spec("r-zygote-confined", endpoint_id="e-zygote", served_model_name="tiny", max_num_seqs=4,
                     max_loras=1, max_lora_rank=8)  # fmt: skip
    with serve_engine(engine_node, spec, tiny_model_dir) as replica:
        assert replica.from_standby and complete(replica)["usage"]["completion_tokens"] == 4
        assert confinement_line(replica).startswith(f"{sandbox.APPLIED_LINE} landlock abi {LANDLOCK_ABI}")
        if LANDLOCK_ABI >= sandbox.TCP_ABI:
            assert f"tcp: ports {replica.command.port} and " in confinement_line(replica)
        assert_hides_the_machines_sockets_in_its_own_namespaces(replica)
        if LANDLOCK_ABI >= 6:
            assert_only_abstract_sockets_of_its_own(replica)
        assert_holds_nothing_of_its_folders_unlinked(engine_node, replica)
        slots = AdapterSlots(replica.address, spec.engine_api_key, max_loras=1)
        # NOTE: what the agent's own loads go through (`ReplicaAdapters`): a copy in the engine's folder.
        slots.ensure("staged", engine_node.stage_adapter(spec.replica_id, outside))
        with pytest.raises(AdapterLoadError):
            slots.ensure("outside", outside)  # a folder the engine may not read, as any other tenant's
