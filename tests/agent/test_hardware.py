"""CPU nodes report honest figures; GPU nodes each GPU as nvidia-smi lists it; the CLI builds the tiny model."""

import os
import subprocess
import sys

import psutil
import pytest

from gpu_agent.protocol import Heartbeat, RegisterRequest
from gpu_agent.runtime import hardware
from gpu_agent.runtime.hardware import (
    CPU_ENGINE_MEMORY_FRACTION,
    catalogue_gpu_type,
    detect_hardware,
    host_usage,
    parse_gpu_query,
)

MIB_BYTES = 1024 * 1024


def test_cpu_mode_reports_real_cpu_count_and_memory(tmp_path):
    report = detect_hardware(force_cpu=True, cpu_kv_cache_gib=2)
    assert report.gpu_type == "cpu" and report.num_gpus == 0 and report.gpus == []
    assert report.num_cpus == len(os.sched_getaffinity(0))
    assert report.memory_mb == hardware.memory_limit_mb() <= psutil.virtual_memory().total // (1024 * 1024)
    # the RAM its engines may use together (placement fits replicas into it)
    assert report.gpu_memory_mb == int(report.memory_mb * CPU_ENGINE_MEMORY_FRACTION)
    usage = host_usage(str(tmp_path))
    assert 0 < usage.memory_used_mb < report.memory_mb and usage.disk_free_mb > 0


def _cgroups(monkeypatch, tmp_path, membership: str, limits: dict[str, str]):
    """This process in the control groups `membership` (as /proc/self/cgroup lists them), with `limits` written under
    a cgroup root of its own (path: the limit file's content)."""
    (tmp_path / "self-cgroup").write_text(membership)
    for path, content in limits.items():
        (tmp_path / "cgroup" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "cgroup" / path).write_text(content + "\n")
    monkeypatch.setattr(hardware, "PROC_SELF_CGROUP", str(tmp_path / "self-cgroup"))
    monkeypatch.setattr(hardware, "CGROUP_ROOT", str(tmp_path / "cgroup"))


def test_an_agent_in_a_container_limited_below_the_hosts_memory_registers_the_containers_limit(monkeypatch, tmp_path):
    _cgroups(monkeypatch, tmp_path, "0::/\n", {"memory.max": str(1024 * 1024 * 1024)})  # a pod of 1 GiB, cgroup v2
    report = detect_hardware(force_cpu=True)
    assert report.memory_mb == 1024
    assert report.gpu_memory_mb == int(1024 * CPU_ENGINE_MEMORY_FRACTION)  # a CPU node's engines fit in it too


def test_a_systemd_units_memory_max_and_a_v1_parents_limit_bound_the_registered_memory(monkeypatch, tmp_path):
    _cgroups(monkeypatch, tmp_path, "0::/system.slice/inferplane-agent.service\n", {
        "system.slice/memory.max": "max", "system.slice/inferplane-agent.service/memory.max": str(2048 * 1024 * 1024)})
    assert hardware.memory_limit_mb() == 2048
    _cgroups(monkeypatch, tmp_path, "4:memory:/kubepods/pod-a/agent\n1:cpu:/\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712",
        "memory/kubepods/pod-a/memory.limit_in_bytes": str(512 * 1024 * 1024),
        "memory/kubepods/pod-a/agent/memory.limit_in_bytes": "9223372036854771712"})
    assert hardware.memory_limit_mb() == 512


def test_an_unlimited_or_unreadable_control_group_registers_the_machines_memory(monkeypatch, tmp_path):
    machine_mb = psutil.virtual_memory().total // (1024 * 1024)
    _cgroups(monkeypatch, tmp_path, "0::/agent.scope\n", {"agent.scope/memory.max": "max"})
    assert hardware.memory_limit_mb() == machine_mb
    monkeypatch.setattr(hardware, "PROC_SELF_CGROUP", str(tmp_path / "absent"))
    assert hardware.memory_limit_mb() == machine_mb


def test_driver_product_names_map_to_catalogue_types():
    assert catalogue_gpu_type("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert catalogue_gpu_type("NVIDIA L4") == "l4"
    assert catalogue_gpu_type("NVIDIA A10G") == "a10g"


def test_cli_builds_the_tiny_model(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "gpu_agent", "tiny-model", str(tmp_path / "tiny")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "tiny" / "model.safetensors").exists() and (
        tmp_path / "tiny" / "tokenizer.json"
    ).exists()


# `nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu,temperature.gpu
#  --format=csv,noheader,nounits` and `nvidia-smi -L`, in the driver's format.
ONE_H200 = "0, GPU-4d8c3f0a-2b1e-4f6a-9c7d-1e2f3a4b5c6d, NVIDIA H200, 143771, 0, 0, 28\n"
TWO_L4 = (
    "0, GPU-0b9e3c0e-6a51-4c47-8f6e-2a3d4b5c6d7e, NVIDIA L4, 23034, 0, 0, 36\n"
    "1, GPU-7f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f, NVIDIA L4, 23034, 1210, 87, 61\n"
)
EIGHT_H100 = "".join(
    f"{index}, GPU-{index:08x}-1111-2222-3333-444455556666, NVIDIA H100 80GB HBM3, 81559, {index * 1000}, {index * 10}, {30 + index}\n"
    for index in range(8)
)
MIG_A100_QUERY = (
    "0, GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77, NVIDIA A100-SXM4-80GB, 81920, 13, [N/A], 33\n"
    "1, GPU-9a8b7c6d-5e4f-3a2b-1c0d-9e8f7a6b5c4d, NVIDIA A100-SXM4-80GB, 81920, 0, 0, [N/A]\n"
)
MIG_A100_LISTING = """\
GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)
  MIG 3g.40gb     Device  0: (UUID: MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f)
  MIG 2g.20gb     Device  1: (UUID: MIG-1f3e9a8b-7c6d-5e4f-3a2b-1c0d9e8f7a6b)
  MIG 1g.10gb     Device  2: (UUID: MIG-0a1b2c3d-4e5f-6a7b-8c9d-0e1f2a3b4c5d)
GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-9a8b7c6d-5e4f-3a2b-1c0d-9e8f7a6b5c4d)
"""


def test_one_gpu_is_reported_with_its_uuid_and_memory():
    (gpu,) = parse_gpu_query(ONE_H200)
    assert (gpu.index, gpu.uuid, gpu.name) == (0, "GPU-4d8c3f0a-2b1e-4f6a-9c7d-1e2f3a4b5c6d", "NVIDIA H200")
    assert (gpu.memory_total_mb, gpu.memory_used_mb, gpu.temperature_c, gpu.mig_slices) == (143771, 0, 28.0, [])
    assert catalogue_gpu_type(gpu.name) == "h200"


def test_a_non_finite_figure_from_nvidia_smi_is_reported_as_unknown():
    (gpu,) = parse_gpu_query(ONE_H200.replace("0, 0, 28", "0, nan, inf"))
    assert (gpu.utilization_percent, gpu.temperature_c) == (0.0, None)


def test_two_gpus_are_reported_each_with_its_own_load():
    gpus = parse_gpu_query(TWO_L4)
    assert [gpu.index for gpu in gpus] == [0, 1] and len({gpu.uuid for gpu in gpus}) == 2
    assert (gpus[1].memory_used_mb, gpus[1].utilization_percent) == (1210, 87.0)


def test_eight_gpus_are_reported_in_index_order_and_pass_the_protocol():
    gpus = parse_gpu_query("".join(reversed(EIGHT_H100.splitlines(keepends=True))))
    assert [gpu.index for gpu in gpus] == list(range(8))
    assert all(gpu.memory_total_mb == 81559 for gpu in gpus)
    request = RegisterRequest(join_token="jt", name="n", gpu_type="h100-80gb", num_gpus=8, gpu_memory_mb=81559,
                              num_cpus=8, memory_mb=10**6, agent_version="x", gpus=gpus)
    assert RegisterRequest.from_dict(request.to_dict()).gpus == gpus


def test_mig_slices_are_listed_under_their_gpu_and_unsupported_figures_read_as_unknown():
    gpus = parse_gpu_query(MIG_A100_QUERY, MIG_A100_LISTING)
    assert [(s.profile, s.memory_mb) for s in gpus[0].mig_slices] == [("3g.40gb", 40960), ("2g.20gb", 20480), ("1g.10gb", 10240)]
    assert gpus[0].mig_slices[0].uuid == "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f"
    assert gpus[0].utilization_percent == 0.0 and gpus[1].temperature_c is None
    assert gpus[1].mig_slices == []


def test_a_gpu_list_that_repeats_an_index_or_disagrees_with_the_count_is_refused():
    gpus = parse_gpu_query(TWO_L4)
    base = {"join_token": "jt", "name": "n", "gpu_type": "l4", "gpu_memory_mb": 23034, "num_cpus": 8,
            "memory_mb": 10**5, "agent_version": "x"}
    with pytest.raises(ValueError, match="num_gpus"):
        RegisterRequest(**base, num_gpus=3, gpus=gpus)
    with pytest.raises(ValueError, match="distinct"):
        RegisterRequest(**base, num_gpus=2, gpus=[gpus[0], gpus[0]])
    with pytest.raises(ValueError, match="distinct"):
        Heartbeat.from_dict({"agent_version": "x", "num_cpus": 1, "memory_mb": 1, "memory_used_mb": 1,
                             "gpus": [gpus[1].to_dict(), gpus[1].to_dict()]})


def test_an_agent_in_a_limited_container_reports_its_containers_use_not_the_hosts(monkeypatch, tmp_path):
    """Its heartbeat's `memory_used_mb` is read against the memory it registered (the fleet page's meter): the
    container's working set (its use less the page cache it may drop), not the machine's use, which on a host busy
    with other pods passed the container's limit many times over."""
    machine = psutil.virtual_memory()
    limit = min(machine.total // 2, machine.total - machine.available + 1024 * 1024 * 1024) // MIB_BYTES * MIB_BYTES
    (tmp_path / "v2").mkdir(), (tmp_path / "v1").mkdir(), (tmp_path / "none").mkdir()
    _cgroups(monkeypatch, tmp_path / "v2", "0::/\n", {
        "memory.max": str(limit), "memory.current": str(300 * MIB_BYTES),
        "memory.stat": f"anon 200000000\nfile 104857600\ninactive_file {100 * MIB_BYTES}\n"})
    assert hardware.memory_limit_mb() == limit // MIB_BYTES
    assert host_usage(str(tmp_path)).memory_used_mb == 200
    # v1: the same, from its memory controller's files
    _cgroups(monkeypatch, tmp_path / "v1", "4:memory:/kubepods/pod-a\n", {
        "memory/kubepods/pod-a/memory.limit_in_bytes": str(limit),
        "memory/kubepods/pod-a/memory.usage_in_bytes": str(500 * MIB_BYTES),
        "memory/kubepods/pod-a/memory.stat": f"cache 0\ntotal_inactive_file {50 * MIB_BYTES}\n"})
    assert host_usage(str(tmp_path)).memory_used_mb == 450
    # unlimited: the machine's use, as before
    _cgroups(monkeypatch, tmp_path / "none", "0::/agent.scope\n", {"agent.scope/memory.max": "max"})
    assert abs(host_usage(str(tmp_path)).memory_used_mb - (machine.total - machine.available) // MIB_BYTES) < 2048
