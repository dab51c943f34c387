"""Engines (and the zygote they are forked from) inherit none of the fleet's credentials, and are offline.

Nor vLLM's variables that make an engine fetch from the network or share files with other tenants'
engines: before, every `VLLM_*` of the agent passed, so an operator's `VLLM_MEDIA_CACHE` gave every
tenant's engine on a node one cache of fetched media keyed by URL.
"""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime import standby
from gpu_agent.runtime.engine import DATA_DIR_ENV_MARKER, REPLICA_ENV_MARKER
from gpu_agent.runtime.engine_environment import OFFLINE_ENV, engine_environment
from gpu_agent.runtime.engine_guard import ENGINE_API_KEY_ENV
from gpu_agent.runtime.supervisor import Supervisor, SupervisorPolicy
from gpu_agent.runtime.zygote import Zygote

from .conftest import fake_engine_factory, make_spec, wait_until

# What the agent's DaemonSet gives the agent itself (infra/k8s/base/agent-daemonset.yaml).
FLEET_SECRETS = {
    "INFERPLANE_JOIN_TOKEN": "jt_fleet_join_token",
    "HF_TOKEN": "hf_fleet_token",
    "HUGGING_FACE_HUB_TOKEN": "hf_fleet_token",
    "AWS_ACCESS_KEY_ID": "AKIAFLEET",
    "AWS_SECRET_ACCESS_KEY": "fleet-secret",
    "AWS_SESSION_TOKEN": "fleet-session",
}
# vLLM's variables an operator may set on the agent that no engine gets (`ENGINE_ENV_LEFT_OUT`).
SHARED_OR_REMOTE = {
    "VLLM_MEDIA_CACHE": "/var/cache/vllm-media",
    "VLLM_MEDIA_CONNECTOR": "my_connector",
    "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "1",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
    "VLLM_LORA_RESOLVER_CACHE_DIR": "/var/lib/adapters",
    "VLLM_LORA_RESOLVER_HF_REPO_LIST": "someone/adapters",
    "VLLM_MODEL_REDIRECT_PATH": "/etc/vllm/redirects.json",
    "VLLM_USE_MODELSCOPE": "1",
    "VLLM_V1_USE_OUTLINES_CACHE": "1",
}


@pytest.fixture
def fleet_secrets(monkeypatch):
    for name, value in FLEET_SECRETS.items():
        monkeypatch.setenv(name, value)
    for name, value in SHARED_OR_REMOTE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the operator's engine settings still pass
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def assert_engine_environment(environ: dict[str, str]) -> None:
    assert not set(FLEET_SECRETS) & set(environ), sorted(set(FLEET_SECRETS) & set(environ))
    assert not any(value in FLEET_SECRETS.values() for value in environ.values())
    assert environ["HF_HUB_OFFLINE"] == "1" and environ["TRANSFORMERS_OFFLINE"] == "1"
    assert environ["VLLM_NO_USAGE_STATS"] == environ["VLLM_DO_NOT_TRACK"] == environ["DO_NOT_TRACK"] == "1"  # no reports
    assert environ["VLLM_CPU_KVCACHE_SPACE"] == "1" and environ["PATH"]
    # None of the operator's values (an engine sets VLLM_MEDIA_URL_ALLOW_REDIRECTS off itself).
    assert not [name for name, value in SHARED_OR_REMOTE.items() if environ.get(name) == value]


def test_vllms_variables_that_fetch_or_share_files_between_tenants_are_left_out_and_the_rest_pass():
    # vLLM's own caches, a plug-in filter (which only narrows what loads) and its settings still pass.
    passed = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CACHE_ROOT": "/cache/vllm", "VLLM_PLUGINS": "", "PATH": "/bin"}

    environ = engine_environment(SHARED_OR_REMOTE | passed)

    assert environ == passed | OFFLINE_ENV


def test_an_engine_inherits_none_of_the_fleets_credentials_and_is_offline(fleet_secrets, tmp_path):
    supervisor = Supervisor(
        tmp_path / "agent", command_factory=fake_engine_factory(), policy=SupervisorPolicy(stop_timeout_s=2.0)
    )
    try:
        supervisor.start(make_spec("r-env"), "/models/x")
        wait_until(lambda: supervisor.get("r-env").state == ReplicaState.READY, 10, poll=supervisor.poll)
        environ = psutil.Process(supervisor.get("r-env").pid).environ()
        assert_engine_environment(environ)
        # What is its own: its key and the markers the agent finds it by.
        assert environ[ENGINE_API_KEY_ENV] == "engine-key-of-r-env"
        assert environ[REPLICA_ENV_MARKER] == "r-env" and environ[DATA_DIR_ENV_MARKER] == str(supervisor.data_dir)
    finally:
        supervisor.shutdown(timeout_s=1)


def test_the_zygote_whose_forks_are_engines_inherits_none_of_the_fleets_credentials(
    fleet_secrets, tmp_path, monkeypatch
):
    spawned = []
    popen = subprocess.Popen

    def spawn(argv, **options):  # the zygote's own command, with a process that only waits for its stdin
        spawned.append(options["env"])
        return popen([sys.executable, "-c", "import sys; sys.stdin.read()"], **options)

    monkeypatch.setattr(standby.subprocess, "Popen", spawn)
    zygote = Zygote(tmp_path / "agent", device="cpu")
    try:
        zygote.ensure()
        [env] = spawned
        assert_engine_environment(env)
        # Popen returns once exec has begun; the kernel shows the new environment a moment later (empty until then).
        assert_engine_environment(wait_until(lambda: psutil.Process(zygote.pid).environ(), 10, step_s=0.01))
        assert env[DATA_DIR_ENV_MARKER] == str(tmp_path / "agent")
    finally:
        zygote.stop()


# A zygote whose idle-time look-up (`zygote_models.Warmer`) sets a variable process-wide, as vLLM's `get_config` does
# for a config asking for UE8M0 scales, then forks an engine; `_serve` writes the engine's environment out instead.
LEAKY_ZYGOTE = r"""
import json, os, sys, time
from pathlib import Path
from gpu_agent.runtime import standby_process, zygote_models

out = Path(sys.argv[1])


class LeakyWarmer:
    def warm_next(self):
        if not (out.parent / "warmed").exists():
            os.environ["VLLM_USE_DEEP_GEMM_E8M0"] = "1"
            (out.parent / "warmed").touch()
        return False


def serve(handoff, device):
    import setproctitle  # as vLLM names its processes

    setproctitle.setproctitle("VLLM::probe")
    title = Path("/proc/self/cmdline").read_bytes().split(b"\0")[0].decode()
    (out.parent / "environ.tmp").write_text(json.dumps({**os.environ, "TITLE_SET": title}))
    (out.parent / "environ.tmp").rename(out)


zygote_models.Warmer = LeakyWarmer
standby_process._serve = serve
sys.exit(standby_process.serve_forks(os.fdopen(os.dup(1), "wb", buffering=0), "cpu", time.monotonic()))
"""


def test_an_engine_forked_after_a_look_up_changed_the_zygotes_environment_starts_from_the_zygotes_own(
    tmp_path,
):
    # One tenant's config.json made the zygote's environment carry VLLM_USE_DEEP_GEMM_E8M0=1 (vLLM sets it while
    # loading such a config), and every engine forked afterwards, any tenant's, inherited it: the handoff's
    # variables were added to the zygote's environment, never a fresh copy of it.
    import dataclasses
    import json
    import os

    out = tmp_path / "environ.json"
    zygote = subprocess.Popen(
        [sys.executable, "-c", LEAKY_ZYGOTE, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, REPLICA_ENV_MARKER: standby.STANDBY_MARKER_VALUE, "INFERPLANE_ZYGOTE_OWN": "kept"},
    )
    try:
        assert wait_until(lambda: (tmp_path / "warmed").exists(), timeout_s=60)
        handoff = standby.Handoff(
            replica_id="replica-b",
            args=[],
            env={"INFERPLANE_HANDOFF_OWN": "given"},
            log_path=str(tmp_path / "b.log"),
        )
        zygote.stdin.write(json.dumps(dataclasses.asdict(handoff)).encode() + b"\n")
        zygote.stdin.flush()
        assert wait_until(out.exists, timeout_s=60), (tmp_path / "b.log").read_text()
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=30)
    environ = json.loads(out.read_text())
    assert "VLLM_USE_DEEP_GEMM_E8M0" not in environ
    assert environ["INFERPLANE_ZYGOTE_OWN"] == "kept" and environ["INFERPLANE_HANDOFF_OWN"] == "given"
    assert environ[REPLICA_ENV_MARKER] == "replica-b"
    # NOTE: `setproctitle` finds the command line from where the environment lies: refilled elsewhere, vLLM's
    # processes kept the zygote's command line as their title.
    assert environ["TITLE_SET"].startswith("VLLM::probe"), environ["TITLE_SET"]
