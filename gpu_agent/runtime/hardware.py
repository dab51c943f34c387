"""What this machine has: GPUs through NVML, otherwise an honest CPU report."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field

import psutil

from gpu_agent.protocol import GpuStatus

logger = logging.getLogger(__name__)

MIB = 1024 * 1024

# Catalogue names the control plane knows, matched against NVML product names.
_GPU_CATALOGUE = (
    ("H200", "h200"),
    ("H100", "h100-80gb"),
    ("A100", "a100-80gb"),
    ("A10G", "a10g"),
    ("L4", "l4"),
)


@dataclass(slots=True)
class HardwareReport:
    gpu_type: str  # catalogue name, "cpu" without GPUs
    num_gpus: int
    gpu_memory_mb: int  # per GPU; on CPU nodes the memory the engine may use for its KV cache
    num_cpus: int
    memory_mb: int
    gpus: list[GpuStatus] = field(default_factory=list)

    @property
    def is_cpu(self) -> bool:
        return self.gpu_type == "cpu"


def catalogue_gpu_type(product_name: str) -> str:
    upper = product_name.upper()
    for marker, name in _GPU_CATALOGUE:
        if marker in upper:
            return name
    return product_name.lower().replace("nvidia ", "").replace(" ", "-")


def gpu_statuses() -> list[GpuStatus]:
    """One status per NVIDIA GPU; empty when NVML is missing or finds none."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: a CPU machine
        return []
    statuses = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            utilization = pynvml.nvmlDeviceGetUtilizationRates(handle)
            try:
                temperature = float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
            except Exception:
                temperature = None
            statuses.append(
                GpuStatus(
                    index=index,
                    name=name.decode() if isinstance(name, bytes) else name,
                    utilization_percent=float(utilization.gpu),
                    memory_used_mb=int(memory.used // MIB),
                    memory_total_mb=int(memory.total // MIB),
                    temperature_c=temperature,
                )
            )
    finally:
        pynvml.nvmlShutdown()
    return statuses


CPU_ENGINE_MEMORY_FRACTION = 0.6


def detect_hardware(*, force_cpu: bool = False, cpu_kv_cache_gib: int = 1) -> HardwareReport:
    num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory_mb = int(psutil.virtual_memory().total // MIB)
    gpus = [] if force_cpu else gpu_statuses()
    if not gpus:
        return HardwareReport(
            gpu_type="cpu",
            num_gpus=0,
            # NOTE: the "GPU memory" of a CPU node is the RAM its engines may use together;
            # placement fits replicas (weights + KV cache + engine overhead) into it.
            gpu_memory_mb=int(memory_mb * CPU_ENGINE_MEMORY_FRACTION),
            num_cpus=num_cpus,
            memory_mb=memory_mb,
        )
    return HardwareReport(
        gpu_type=catalogue_gpu_type(gpus[0].name),
        num_gpus=len(gpus),
        gpu_memory_mb=gpus[0].memory_total_mb,
        num_cpus=num_cpus,
        memory_mb=memory_mb,
        gpus=gpus,
    )


@dataclass(slots=True)
class HostUsage:
    memory_used_mb: int
    cpu_percent: float
    disk_free_mb: int | None


def host_usage(data_dir: str) -> HostUsage:
    try:
        disk_free_mb = int(shutil.disk_usage(data_dir).free // MIB)
    except OSError:
        disk_free_mb = None
    memory = psutil.virtual_memory()
    return HostUsage(
        memory_used_mb=int((memory.total - memory.available) // MIB),
        cpu_percent=float(psutil.cpu_percent(interval=None)),
        disk_free_mb=disk_free_mb,
    )
