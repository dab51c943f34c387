"""The warm standby never initialises CUDA before it becomes an engine (issue 21), checked on CPU.

A standby that had initialised CUDA would put its engine on the GPUs it saw then (CUDA reads the
replica's `CUDA_VISIBLE_DEVICES` once, at initialisation) and could not fork vLLM's EngineCore.
The real standby process runs here with a tripwire on torch's CUDA initialisation
(`cuda_tripwire_standby.py`); a standby whose torch reports CUDA initialised refuses, says why, and
the agent keeps no standby from then on (its replicas start the plain way).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from gpu_agent.runtime import engine, standby, standby_process
from gpu_agent.runtime.standby import EXIT_CUDA_INITIALISED, READY_LINE, REFUSED_PREFIX, Standby
from gpu_agent.runtime.zygote import STARTED_WORD

from .conftest import make_spec, wait_until

ZYGOTE_ENV = "TRIPWIRE_ZYGOTE"  # as in cuda_tripwire_standby.py (which imports torch)

TIMEOUT_S = 300


def run_tripwired_standby(
    tmp_path, *preload_modules: str, env: dict | None = None, stdin: bytes = b""
) -> tuple[bytes, dict]:
    """The standby's status output and the tripwire's report; `stdin` is all it reads, then EOF."""
    report_path = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "tests.agent.cuda_tripwire_standby", str(report_path), *preload_modules],
        input=stdin, capture_output=True, timeout=TIMEOUT_S, env=env,
    )  # fmt: skip
    assert report_path.exists(), result.stderr.decode(errors="replace")[-3000:]
    return result.stdout, json.loads(report_path.read_text())


def test_the_standby_imports_vllm_for_cuda_without_initialising_cuda(tmp_path):
    status, report = run_tripwired_standby(tmp_path)
    assert report["tripwire_calls"] == [], "CUDA initialised in the standby by:\n" + "\n".join(
        report["tripwire_calls"]
    )
    assert status == READY_LINE and report["exit_code"] == 0
    assert report["cuda_initialised"] is False
    assert "vllm.v1.engine.core" in report["vllm_modules_imported"], "the real import path ran"
    # torch's is_available() would call cuInit: the standby has it count GPUs through NVML instead
    assert report["nvml_based_cuda_check"] == "1"


def test_the_zygote_forks_an_engine_for_cuda_without_having_initialised_cuda(tmp_path):
    handoff = standby.Handoff(
        replica_id="r-cuda-fork", args=["--model", str(tmp_path)], env={}, log_path=str(tmp_path / "engine.log")
    )
    line = json.dumps(dataclasses.asdict(handoff)).encode() + b"\n"
    env = {**os.environ, ZYGOTE_ENV: "1"}
    status, report = run_tripwired_standby(tmp_path, env=env, stdin=line)
    assert report["tripwire_calls"] == [], "CUDA initialised in the zygote by:\n" + "\n".join(
        report["tripwire_calls"]
    )
    assert status.startswith(READY_LINE + f"{STARTED_WORD} r-cuda-fork ".encode()), status
    assert report["exit_code"] == 0 and report["cuda_initialised"] is False


def test_a_cuda_call_in_the_standbys_imports_makes_it_refuse_with_the_reason(tmp_path):
    toucher = tmp_path / "touches_cuda_at_import.py"
    toucher.write_text("import torch\ntorch.cuda.current_device()\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    status, report = run_tripwired_standby(tmp_path, "touches_cuda_at_import", env=env)
    assert len(report["tripwire_calls"]) == 1 and "touches_cuda_at_import" in report["tripwire_calls"][0]
    assert report["exit_code"] == EXIT_CUDA_INITIALISED
    assert status.startswith(REFUSED_PREFIX + b"CUDA was initialised in the standby while importing")
    assert b"CUDA_VISIBLE_DEVICES" in status


def test_an_agent_whose_standby_finds_cuda_initialised_keeps_none_and_starts_replicas_plainly(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(standby, "STANDBY_MODULE", "tests.agent.cuda_poisoned_standby")
    warm = Standby(tmp_path / "agent", device="cuda", min_respawn_backoff_s=0.0)
    try:
        warm.ensure()
        wait_until(
            lambda: warm.ensure() or (warm.refused_reason and warm.process is None), TIMEOUT_S, step_s=0.2
        )
        assert warm.refused_reason.startswith("CUDA was initialised in the standby while importing")
        assert "refusing" in (tmp_path / "agent" / "logs" / "standby.log").read_text()
        for _ in range(5):
            warm.ensure()
        assert warm.num_spawned == 1 and warm.process is None, "no standby is spawned again"
        command = engine.build_engine_command(
            make_spec("r-cold"), tmp_path, port=8123, device=engine.DEVICE_CPU
        )
        # what the supervisor asks before waiting for, or handing a replica to, the standby
        assert not warm.warming and not warm.can_take(command)
        assert warm.hand_off("r-cold", command, {}, tmp_path / "r-cold.log") is None
    finally:
        warm.stop()


def test_the_standby_checks_torchs_own_flag(monkeypatch):
    import torch

    assert standby_process.refuse_if_cuda_initialised("while importing") is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    reason = standby_process.refuse_if_cuda_initialised("before the handoff")
    assert reason.startswith("CUDA was initialised in the standby before the handoff")
