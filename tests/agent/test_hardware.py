"""CPU nodes report honest figures; the CLI builds the tiny model."""

import os
import subprocess
import sys

import psutil

from gpu_agent.runtime.hardware import (
    CPU_ENGINE_MEMORY_FRACTION,
    catalogue_gpu_type,
    detect_hardware,
    host_usage,
)


def test_cpu_mode_reports_real_cpu_count_and_memory(tmp_path):
    report = detect_hardware(force_cpu=True, cpu_kv_cache_gib=2)
    assert report.gpu_type == "cpu" and report.num_gpus == 0 and report.gpus == []
    assert report.num_cpus == len(os.sched_getaffinity(0))
    assert report.memory_mb == psutil.virtual_memory().total // (1024 * 1024)
    # the RAM its engines may use together (placement fits replicas into it)
    assert report.gpu_memory_mb == int(report.memory_mb * CPU_ENGINE_MEMORY_FRACTION)
    usage = host_usage(str(tmp_path))
    assert 0 < usage.memory_used_mb < report.memory_mb and usage.disk_free_mb > 0


def test_nvml_product_names_map_to_catalogue_types():
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
