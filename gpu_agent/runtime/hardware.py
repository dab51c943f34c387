"""What this machine has: each GPU as `nvidia-smi` reports it, otherwise an honest CPU report."""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

import psutil

from gpu_agent.protocol import GpuStatus, MigSlice

logger = logging.getLogger(__name__)

MIB = 1024 * 1024

# Catalogue names the control plane knows, matched against the driver's product names.
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


# One CSV line per GPU; the order of these fields is what `parse_gpu_query` reads.
NVIDIA_SMI_QUERY = ("index", "uuid", "name", "memory.total", "memory.used", "utilization.gpu", "temperature.gpu")
NVIDIA_SMI_TIMEOUT_S = 10.0
_LISTED_GPU = re.compile(r"^GPU\s+\d+:.*\(UUID:\s*(?P<uuid>[^)\s]+)\)")
_LISTED_MIG = re.compile(r"^\s+MIG\s+(?P<profile>\S+)\s+Device\s+\d+:\s*\(UUID:\s*(?P<uuid>[^)\s]+)\)")
_MIG_PROFILE_MEMORY = re.compile(r"\.(\d+)gb", re.IGNORECASE)


def _number(text: str) -> float | None:
    """A figure of nvidia-smi's CSV, None for "[N/A]", "[Not Supported]" and the like (and a non-finite one, which the
    protocol refuses)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_mig_listing(listing: str) -> dict[str, list[MigSlice]]:
    """MIG slices per GPU UUID from `nvidia-smi -L` (GPUs without MIG are absent)."""
    slices: dict[str, list[MigSlice]] = {}
    gpu_uuid = None
    for line in listing.splitlines():
        if match := _LISTED_GPU.match(line):
            gpu_uuid = match["uuid"]
        elif (match := _LISTED_MIG.match(line)) and gpu_uuid is not None:
            memory = _MIG_PROFILE_MEMORY.search(match["profile"])
            slices.setdefault(gpu_uuid, []).append(
                MigSlice(uuid=match["uuid"], profile=match["profile"], memory_mb=int(memory[1]) * 1024 if memory else 0)
            )
    return slices


def parse_gpu_query(query_csv: str, listing: str = "") -> list[GpuStatus]:
    """One status per GPU from `nvidia-smi --query-gpu=<NVIDIA_SMI_QUERY> --format=csv,noheader,nounits`,
    with the MIG slices `nvidia-smi -L` lists under each."""
    slices = parse_mig_listing(listing)
    statuses = []
    for row in csv.reader(io.StringIO(query_csv), skipinitialspace=True):
        if len(row) < len(NVIDIA_SMI_QUERY):
            continue
        index, uuid, name, total, used, utilization, temperature = (value.strip() for value in row[: len(NVIDIA_SMI_QUERY)])
        statuses.append(
            GpuStatus(
                index=int(index),
                uuid=uuid,
                name=name,
                memory_total_mb=int(_number(total) or 0),
                memory_used_mb=int(_number(used) or 0),
                utilization_percent=_number(utilization) or 0.0,
                temperature_c=_number(temperature),
                mig_slices=slices.get(uuid, []),
            )
        )
    return sorted(statuses, key=lambda status: status.index)


def _nvidia_smi(*args: str) -> str:
    return subprocess.run(
        ["nvidia-smi", *args], capture_output=True, text=True, check=True, timeout=NVIDIA_SMI_TIMEOUT_S
    ).stdout


def gpu_statuses() -> list[GpuStatus]:
    """One status per NVIDIA GPU (index, UUID, memory, load, MIG slices); empty without a driver or GPUs.

    NOTE: read through `nvidia-smi`, which ships with the driver (and is mounted into containers
    with it), so the agent needs no NVML binding of its own.
    """
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        query = _nvidia_smi(f"--query-gpu={','.join(NVIDIA_SMI_QUERY)}", "--format=csv,noheader,nounits")
        listing = _nvidia_smi("-L")
    except (OSError, subprocess.SubprocessError) as exc:  # a driver that does not answer: report no GPUs
        logger.warning("nvidia-smi failed: %s", exc)
        return []
    return parse_gpu_query(query, listing)


CPU_ENGINE_MEMORY_FRACTION = 0.6
# Where the kernel says which control group this process is in, and what each group may use.
PROC_SELF_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"


def memory_limit_mb() -> int:
    """The memory this agent and its engines may use together: the machine's, or less where their control group (a
    Kubernetes container's limit, a systemd unit's `MemoryMax`, or a group above it) is limited to less.

    NOTE: the machine's alone, a pod limited to 256 GiB on a host of 2 TiB registered 2 TiB: the control plane let
    sleeping replicas' weights (host memory) fill past the limit, and the kubelet killed the container, every engine of
    the node with it."""
    total_mb = int(psutil.virtual_memory().total // MIB)
    limit = _cgroup_limit_bytes()
    return total_mb if limit is None else min(total_mb, max(1, limit // MIB))


def _cgroup_limit_bytes() -> int | None:
    """The smallest memory limit of this process's control group and the groups above it (cgroup v2, or v1's memory
    controller); None when none is limited or none can be read."""
    limiting = _limiting_cgroup()
    return None if limiting is None else limiting[0]


def _limiting_cgroup() -> tuple[int, str] | None:
    """(The smallest memory limit of this process's control group and the groups above it, in bytes; the file that
    says what that group uses now), for cgroup v2 or v1's memory controller; None when none is limited or none can be
    read.

    NOTE: inside a container with a cgroup namespace its own group is the root here ("0::/"): the root's file is then
    the container's limit (a host's root has none)."""
    try:
        with open(PROC_SELF_CGROUP) as lines:
            groups = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError:
        return None
    limits = []
    for hierarchy, controllers, path in (group for group in groups if len(group) == 3):
        if hierarchy == "0" and not controllers:
            root, name, usage = CGROUP_ROOT, "memory.max", "memory.current"  # "max" where unlimited
        elif "memory" in controllers.split(","):
            root, name, usage = os.path.join(CGROUP_ROOT, "memory"), "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        parts = [part for part in path.split("/") if part and part != ".."]
        for depth in range(len(parts) + 1):
            folder = os.path.join(root, *parts[:depth])
            try:
                with open(os.path.join(folder, name)) as file:
                    text = file.read().strip()
            except OSError:
                continue
            if text.isdigit():
                limits.append((int(text), os.path.join(folder, usage)))
    return min(limits) if limits else None


def _memory_used_bytes(total_bytes: int, available_bytes: int) -> int:
    """What this agent and its engines use of the memory it registered (`memory_limit_mb`): their control group's
    use where a limit below the machine's applies, else the machine's.

    NOTE: the machine's alone, a pod limited to 256 GiB on a busy host of 2 TiB said it used 1.5 TiB of its 256 GiB
    (the fleet page's meter at 600 %), and an idle one on a host of others' pods looked full (a review's finding)."""
    machine_used = total_bytes - available_bytes
    limiting = _limiting_cgroup()
    if limiting is None or limiting[0] >= total_bytes:
        return machine_used
    try:
        with open(limiting[1]) as file:
            text = file.read().strip()
    except OSError:
        return machine_used
    if not text.isdigit():
        return machine_used
    # As the kubelet judges a container (its working set): the page cache it may drop (inactive files) left out.
    inactive = 0
    try:
        with open(os.path.join(os.path.dirname(limiting[1]), "memory.stat")) as file:
            for line in file:
                key, _, value = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file") and value.strip().isdigit():
                    inactive = max(inactive, int(value))
    except OSError:
        pass
    return max(0, min(int(text), limiting[0]) - inactive)


def detect_hardware(*, force_cpu: bool = False, cpu_kv_cache_gib: int = 1) -> HardwareReport:
    num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory_mb = memory_limit_mb()
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
        memory_used_mb=int(_memory_used_bytes(memory.total, memory.available) // MIB),
        cpu_percent=float(psutil.cpu_percent(interval=None)),
        disk_free_mb=disk_free_mb,
    )
