"""A confined engine on a real GPU: what Landlock (`gpu_agent/runtime/sandbox.py`) leaves a CUDA engine able to do.

The engine sandbox's GPU paths (/dev/nvidia*, CUDA's and Triton's caches, NCCL's shared memory) were allowed by
reasoning; this runs, on a machine with an NVIDIA GPU and PyTorch, the work a vLLM engine does on its GPU in a
child process confined exactly as the agent confines an engine (`sandbox.engine_policy` with the folders
`Supervisor._confined` makes, `sandbox.engine_folder_env`, `sandbox.apply_from_environment` first thing), and
the same work unconfined beside it. No vLLM is needed: the machine may have no package index to install it from.

    python3 bench/gpu_sandbox_check.py [--out results.json] [--quick]

Steps (each PASS, FAIL with the error, or SKIP with why): CUDA visible, a bf16 matrix product, a CUDA graph
captured and replayed, a Triton kernel compiled (its cache in the endpoint's folder), `torch.compile` (Inductor,
its compile workers), a spawned child using CUDA and answering through a queue (vLLM's EngineCore is one),
a CUDA tensor shared with a spawned child (CUDA IPC), NCCL with one rank over TCP (vLLM starts it for one GPU
too), NVML read as vLLM reads it; and, confined, that another tenant's folder, the agent's data and /etc's
agent settings stay out of reach, and that the engine runs in namespaces of its own (`namespaces.py`: PID 2 of
its own /proc, which still has /proc/driver/nvidia, and a /dev/shm of its own). Also the agent's own hardware report (`hardware.gpu_statuses`) against
PyTorch's view. On a machine with no GPU the CUDA steps SKIP and the rest runs on the CPU. Exit status 0 when
no step failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENGINE_SCRIPT = "engine_check.py"  # this file, copied into the engine's scratch folder: bench/ is out of its reach

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
STEP_TIMEOUT_S = 240.0
SECRET = "a tenant's secret"


# --- In the engine's place (the child) ------------------------------------------------------------------------


def _step(name, results, function):
    started = time.monotonic()
    try:
        outcome = function()
        status, detail = (SKIP, outcome[5:]) if isinstance(outcome, str) and outcome.startswith("SKIP:") else (
            PASS, outcome or "")
    except BaseException as exc:  # noqa: BLE001 - every failure is a finding, reported by name
        status, detail = FAIL, f"{type(exc).__name__}: {exc}"[:600]
    results.append({"step": name, "status": status, "detail": str(detail), "seconds": round(time.monotonic() - started, 3)})
    print(json.dumps(results[-1]), flush=True)


def _spawned_cuda_child(queue, device):
    import torch

    x = torch.ones(1024, device=device)
    queue.put(float(x.sum().item()))


def _ipc_child(queue, tensor):
    queue.put(float(tensor.sum().item()))


def engine_workload(outside: list[str], quick: bool) -> list[dict]:
    """What an engine does on its GPU, step by step; `outside` are files a confined engine must not read.

    NOTE: spawned children import this file again (as `__mp_main__`), confined: it imports nothing of the
    repository at its top, and runs from the engine's own scratch folder."""
    from gpu_agent.runtime import sandbox

    sandbox.apply_from_environment()  # as `engine_main` does, before anything of the tenant's is read
    results: list[dict] = []
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"

    def visible():
        if not cuda and os.environ.get("INFERPLANE_CHECK_EXPECT_CUDA") == "1":
            raise AssertionError("PyTorch sees no CUDA device, where nvidia-smi lists one")
        if not cuda:
            return "SKIP:no CUDA device (the CPU runs the rest)"
        return f"{torch.cuda.device_count()} device(s): {torch.cuda.get_device_name(0)}"

    def matmul():
        size = 8192 if cuda else 512
        dtype = torch.bfloat16 if cuda else torch.float32
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        started = time.perf_counter()
        for _ in range(5):
            c = a @ b
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - started) / 5
        return f"{2 * size**3 / seconds / 1e12:.1f} TFLOP/s, checksum {float(c.float().abs().mean()):.3f}"

    def cuda_graph():
        if not cuda:
            return "SKIP:CUDA graphs need CUDA"
        static = torch.zeros(1024, device=device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            static.add_(1)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static.add_(1)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert float(static[0]) == 4.0, float(static[0])  # one before the capture (which runs nothing), three replays
        return "captured and replayed"

    def triton_kernel():
        if not cuda:
            return "SKIP:Triton's GPU kernels need CUDA"
        import triton
        import triton.language as tl

        @triton.jit
        def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n
            tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask),
                     mask=mask)

        x, y = torch.ones(4096, device=device), torch.full((4096,), 2.0, device=device)
        out = torch.empty_like(x)
        add[(4,)](x, y, out, 4096, BLOCK=1024)
        torch.cuda.synchronize()
        assert float(out.sum()) == 3 * 4096
        cache = os.environ.get("TRITON_CACHE_DIR", "")
        written = sum(1 for _ in Path(cache).rglob("*")) if cache and os.path.isdir(cache) else 0
        return f"compiled and ran; {written} entries in TRITON_CACHE_DIR"

    def compiled():
        if quick:
            return "SKIP:--quick"

        @torch.compile
        def fused(x):
            return torch.nn.functional.gelu(x) * 2 + 1

        x = torch.randn(4096, device=device)
        assert torch.allclose(fused(x), torch.nn.functional.gelu(x) * 2 + 1, atol=1e-4)
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
        written = sum(1 for _ in Path(cache).rglob("*")) if cache and os.path.isdir(cache) else 0
        return f"Inductor compiled and ran; {written} entries in TORCHINDUCTOR_CACHE_DIR"

    def spawned_child():
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=_spawned_cuda_child, args=(queue, device))
        child.start()
        value = queue.get(timeout=STEP_TIMEOUT_S)
        child.join(timeout=30)
        assert value == 1024.0 and child.exitcode == 0, (value, child.exitcode)
        return "a spawned child used the device and answered through a queue"

    def cuda_ipc():
        if not cuda:
            return "SKIP:CUDA IPC needs CUDA"
        import torch.multiprocessing as torch_mp

        context = torch_mp.get_context("spawn")
        queue = context.Queue()
        tensor = torch.ones(2048, device=device)
        child = context.Process(target=_ipc_child, args=(queue, tensor))
        child.start()
        value = queue.get(timeout=STEP_TIMEOUT_S)
        child.join(timeout=30)
        assert value == 2048.0, value
        return "a CUDA tensor read by a spawned child"

    def nccl_one_rank():
        import socket

        import torch.distributed as dist

        if not cuda:
            return "SKIP:NCCL needs CUDA (gloo is CPU's, unconfined by Landlock's file rules)"
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        try:
            x = torch.ones(16, device=device)
            dist.all_reduce(x)
            torch.cuda.synchronize()
            assert float(x.sum()) == 16.0
        finally:
            dist.destroy_process_group()
        return "init, all_reduce, destroy"

    def nvml():
        if not cuda:
            return "SKIP:NVML needs NVIDIA's driver"
        try:
            import pynvml
        except ImportError:
            return "SKIP:no pynvml (nvidia-ml-py) here"
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return f"{pynvml.nvmlDeviceGetName(handle)}, {memory.total / 2**30:.0f} GiB"
        finally:
            pynvml.nvmlShutdown()

    def out_of_reach():
        confined = os.environ.get("INFERPLANE_CHECK_CONFINED") == "1"
        read = []
        for path in outside:
            try:
                Path(path).read_text()
                read.append(path)
            except OSError:
                pass
        if confined and read:
            raise AssertionError(f"a confined engine read {read}")
        residual = ""
        parent = int(os.environ["INFERPLANE_CHECK_AGENT_PID"])  # NOTE: its outer pid; in namespaces, none inside
        try:  # the residual the sandbox's NOTE names: a neighbour's oom_score_adj raised (here: to what it was)
            current = Path(f"/proc/{parent}/oom_score_adj").read_text().strip()
            Path(f"/proc/{parent}/oom_score_adj").write_text(current)
            residual = f"; wrote the agent side's oom_score_adj (as it was: {current})"
        except OSError as exc:
            residual = f"; the agent side's oom_score_adj refused ({exc.strerror})"
        if not confined:
            return f"unconfined: read {len(read)} of {len(outside)} (expected: nothing stops it){residual}"
        return f"refused all {len(outside)}: another tenant's model, the agent's data, /etc's agent settings{residual}"

    def own_namespaces():
        """In its own PID and mount namespaces (`namespaces.py`): it sees only its processes (the agent's side is not
        in its /proc), NVIDIA's driver still shows in its fresh /proc, its /dev/shm is its own tmpfs of few files
        (`sandbox.SHARED_MEMORY_MAX_FILES`: after CUDA's, NCCL's and Triton's steps above), and it can make no user
        namespace (its namespace's limits are 0)."""
        if os.environ.get("INFERPLANE_CHECK_NAMESPACES") != "1":
            return "SKIP:no namespaces of its own (unconfined, or refused here: see the machine's report)"
        pids = sorted(int(entry) for entry in os.listdir("/proc") if entry.isdigit())
        if os.getpid() != 2 or int(os.environ["INFERPLANE_CHECK_AGENT_PID"]) in pids:
            raise AssertionError(f"not in namespaces of its own: pid {os.getpid()}, /proc lists {pids[:20]}")
        if cuda and not os.path.isdir("/proc/driver/nvidia"):
            raise AssertionError("its /proc has no driver/nvidia")
        shm = os.statvfs("/dev/shm")
        if shm.f_files > sandbox.SHARED_MEMORY_MAX_FILES:
            raise AssertionError(f"its /dev/shm holds up to {shm.f_files} files")
        nested = subprocess.run([sys.executable, "-c", "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
                                 "print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))"],
                                capture_output=True, text=True, timeout=60).stdout.strip()  # fmt: skip
        if not nested.startswith("-1 "):
            raise AssertionError(f"it made a user namespace of its own: {nested}")
        # The machine's sockets hidden (`sandbox.MACHINE_SOCKET_FOLDERS`), after the CUDA and NCCL steps above ran so.
        reached = [path for path in ("/var/run/docker.sock", "/run/containerd/containerd.sock",
                                     "/run/dbus/system_bus_socket", "/run/systemd/private") if os.path.exists(path)]
        if reached:
            raise AssertionError(f"the machine's sockets are in its reach: {reached}")
        kept = sorted(glob.glob("/run/nvidia-*/*"))
        return (f"machine's sockets hidden, NVIDIA's kept: {kept or 'none'}; "
                f"pid 2 of {len(pids)} it sees; /proc/driver/nvidia {'present' if cuda else 'not checked (no CUDA)'};"
                f" /dev/shm {shm.f_blocks * shm.f_frsize / 2**30:.1f} GiB, {shm.f_bfree * shm.f_frsize / 2**30:.1f} free,"
                f" {shm.f_files - shm.f_ffree} of {shm.f_files} files; a user namespace refused ({nested[3:]})")

    for name, function in (("cuda-visible", visible), ("matmul", matmul), ("cuda-graph", cuda_graph),
                           ("triton-kernel", triton_kernel), ("torch-compile", compiled),
                           ("spawned-child", spawned_child), ("cuda-ipc", cuda_ipc), ("nccl-one-rank", nccl_one_rank),
                           ("nvml", nvml), ("out-of-reach", out_of_reach), ("own-namespaces", own_namespaces)):
        _step(name, results, function)
    return results


# --- The agent's side -----------------------------------------------------------------------------------------


def _folders(root: Path) -> dict[str, Path]:
    """The folders an agent's data directory holds for one engine, as `Supervisor._confined` makes them, and what
    must stay out of its reach: another tenant's model and the agent's own state."""
    from gpu_agent.runtime import sandbox

    data_dir = root / "agent-data"
    model = data_dir / "models" / "tenant-a"
    other_model = data_dir / "models" / "tenant-b"
    for folder in (model, other_model):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(SECRET)
    (data_dir / "state.json").write_text(SECRET)
    scratch = sandbox.make_scratch_folder(data_dir, "replica-check")
    adapters = data_dir / "engine-adapters" / sandbox.folder_name("replica-check")
    adapters.mkdir(parents=True)
    cache = data_dir / "engine-caches" / sandbox.folder_name("endpoint-check")
    shared_cache = sandbox.shared_vllm_cache_root({"VLLM_CACHE_ROOT": str(data_dir / "vllm-shared")})
    sandbox.prepare_cache_folder(cache, shared_cache)
    return {"data": data_dir, "model": model, "other_model": other_model, "scratch": scratch, "adapters": adapters,
            "cache": cache, "shared": shared_cache}


def run_engine(mode: str, root: Path, quick: bool) -> dict:
    from gpu_agent.runtime import sandbox

    folders = _folders(root / mode)
    script = folders["scratch"] / ENGINE_SCRIPT
    shutil.copyfile(__file__, script)
    outside = [str(folders["other_model"] / "config.json"), str(folders["data"] / "state.json")]
    if os.path.isdir("/etc/inferplane"):
        outside += [str(path) for path in Path("/etc/inferplane").iterdir() if path.is_file()]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "INFERPLANE_CHECK_AGENT_PID": str(os.getpid()),
           "INFERPLANE_CHECK_EXPECT_CUDA": "1" if _nvidia_smi_lists_a_gpu() else "0"}
    env.pop(sandbox.POLICY_ENV, None)
    if mode == "confined":
        # NOTE: where the kernel has no Landlock (gVisor) or refuses namespaces (a container's seccomp), `required`
        # would stop the engine at once: best-effort runs it without and says so, as a node set so would.
        confinable = sandbox.landlock_abi()[0] > 0
        policy = sandbox.engine_policy(
            sandbox.SandboxMode.REQUIRED if confinable and not sandbox.namespaces_missing()
            else sandbox.SandboxMode.BEST_EFFORT, model_dirs=[folders["model"], folders["adapters"]],
            own_dirs=[folders["scratch"]], shared_dirs=[folders["cache"]], shared_read=[folders["shared"] / "modelinfos"],
            shared_memory_max_bytes=20 * 10**9,  # the agent's default bound for one engine (`engine_disk`)
        )  # fmt: skip
        env.update(sandbox.engine_folder_env(folders["scratch"], folders["cache"], policy.mode))
        env[sandbox.POLICY_ENV] = policy.to_json()
        env["INFERPLANE_CHECK_CONFINED"] = "1" if confinable else "0"
        env["INFERPLANE_CHECK_NAMESPACES"] = "0" if sandbox.namespaces_missing() else "1"
    else:
        env.update(sandbox.engine_folder_env(folders["scratch"], folders["cache"], sandbox.SandboxMode.OFF))
    command = [sys.executable, str(script), "--engine", json.dumps(outside)]
    if quick:
        command.append("--quick")
    started = time.monotonic()
    try:
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S * 3,
                                   cwd=folders["scratch"])
    except subprocess.TimeoutExpired as exc:
        return {"mode": mode, "status": FAIL, "detail": f"timed out after {exc.timeout} s", "steps": []}
    steps = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    applied = [line for line in completed.stderr.splitlines() if line.startswith(sandbox.APPLIED_LINE)]
    return {
        "mode": mode, "exit_status": completed.returncode, "seconds": round(time.monotonic() - started, 1),
        "applied": applied, "steps": steps,
        "stderr_tail": completed.stderr[-3000:] if completed.returncode or any(
            step["status"] == FAIL for step in steps) else "",
    }


def hardware_report() -> dict:
    from gpu_agent.runtime import hardware

    statuses = hardware.gpu_statuses()
    report = {"agent": [{"index": status.index, "uuid": status.uuid, "name": status.name,
                         "memory_total_mb": status.memory_total_mb,
                         "gpu_type": hardware.catalogue_gpu_type(status.name)} for status in statuses]}
    try:
        import torch

        report["torch"] = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
    except Exception as exc:  # noqa: BLE001
        report["torch"] = f"{type(exc).__name__}: {exc}"
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout if _has("nvidia-smi") else ""
    report["nvidia_smi_uuids"] = [line.split("UUID:")[1].strip(" )") for line in listed.splitlines() if "UUID:" in line]
    agent_uuids = [gpu["uuid"] for gpu in report["agent"]]
    report["status"] = (SKIP if not listed else PASS if agent_uuids == report["nvidia_smi_uuids"] else FAIL)
    return report


def _nvidia_smi_lists_a_gpu() -> bool:
    if not _has("nvidia-smi"):
        return False
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return listed.returncode == 0 and "UUID:" in listed.stdout


def _has(program: str) -> bool:
    return shutil.which(program) is not None


# --- Where confinement and CUDA disagree (--diagnose) ---------------------------------------------------------


def _opened_by_cuda() -> dict:
    """Unconfined: every file CUDA's initialisation mapped or holds open, and how CUDA initialised."""
    import torch

    try:
        torch.cuda.init()
    except Exception as exc:  # noqa: BLE001 - reported: no CUDA here, the listing still says what was opened
        print(f"torch.cuda.init: {exc}", file=sys.stderr)
    paths = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            paths.add(parts[5].replace(" (deleted)", ""))
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/"):
            paths.add(target)
    return {"paths": sorted(paths), "device_count": torch.cuda.device_count(),
            "ld_library_path": os.environ.get("LD_LIBRARY_PATH", "")}


def _cu_init() -> str:
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"libcuda.so.1 not loaded: {exc}"
    status = libcuda.cuInit(0)
    count = ctypes.c_int(0)
    count_status = libcuda.cuDeviceGetCount(ctypes.byref(count)) if status == 0 else -1
    return f"cuInit {status}, cuDeviceGetCount {count_status}: {count.value} device(s)"


def _probe_confined(paths: list[str]) -> dict:
    """Confined (the policy in the environment): which of `paths` open, and whether CUDA initialises."""
    from gpu_agent.runtime import sandbox

    forced_abi = int(os.environ.get("INFERPLANE_CHECK_ABI", "0"))
    if forced_abi:  # what a kernel of this ABI would confine: tells which rights CUDA needs
        sandbox.landlock_abi = lambda: (forced_abi, "")
    sandbox.apply_from_environment()
    refused = {}
    for path in paths:
        try:
            mode = os.stat(path).st_mode
            flags = os.O_RDWR if stat.S_ISCHR(mode) else os.O_RDONLY
            os.close(os.open(path, flags))
        except OSError as exc:
            refused[path] = f"{type(exc).__name__}: {exc.strerror}"
    return {"refused": refused, "cu_init": _cu_init()}


def diagnose(root: Path) -> dict:
    """Which files CUDA needs that the engine's policy refuses, and whether allowing them mends it."""
    from gpu_agent.runtime import sandbox

    folders = _folders(root / "diagnose")
    script = folders["scratch"] / ENGINE_SCRIPT
    shutil.copyfile(__file__, script)
    base_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
                **sandbox.engine_folder_env(folders["scratch"], folders["cache"], sandbox.SandboxMode.OFF)}

    def child(flag: str, payload: str, policy=None) -> dict:
        env = dict(base_env)
        if policy is not None:
            env[sandbox.POLICY_ENV] = policy.to_json()
        completed = subprocess.run([sys.executable, str(script), flag, payload], env=env, capture_output=True,
                                   text=True, timeout=STEP_TIMEOUT_S, cwd=folders["scratch"])
        lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
        if not lines:
            return {"error": completed.stderr[-2000:]}
        return json.loads(lines[-1])

    opened = child("--opened", "{}")
    report = {"opened": opened}
    policy = sandbox.engine_policy(  # NOTE: best-effort where namespaces are refused, as in `run_engine`
        sandbox.SandboxMode.BEST_EFFORT if sandbox.namespaces_missing() else sandbox.SandboxMode.REQUIRED,
        model_dirs=[folders["model"], folders["adapters"]],
        own_dirs=[folders["scratch"]], shared_dirs=[folders["cache"]], shared_read=[folders["shared"] / "modelinfos"],
    )  # fmt: skip
    report["policy"] = json.loads(policy.to_json())
    paths = opened.get("paths", [])
    report["confined"] = child("--probe", json.dumps(paths), policy)
    refused = sorted(report["confined"].get("refused", {}))
    if refused:
        devices = tuple(path for path in refused if stat.S_ISCHR(os.stat(path).st_mode))
        files = tuple(path for path in refused if path not in devices)
        mended = dataclasses.replace(policy, read_execute=(*policy.read_execute, *files),
                                     devices=(*policy.devices, *devices))
        report["confined_with_refused_allowed"] = child("--probe", json.dumps(paths), mended)
    variants = {
        "abi 5: no scopes": ({"INFERPLANE_CHECK_ABI": "5"}, policy),
        "abi 4: no device ioctl rights, no scopes": ({"INFERPLANE_CHECK_ABI": "4"}, policy),
        "+ / read and write": ({}, dataclasses.replace(policy, read_write=(*policy.read_write, "/"))),
        "+ /dev read, device rights": ({}, dataclasses.replace(policy, read=(*policy.read, "/dev"),
                                                                devices=(*policy.devices, "/dev"))),
        "+ /tmp read and write": ({}, dataclasses.replace(policy, read_write=(*policy.read_write, "/tmp"))),
        "+ /dev/shm listed": ({}, dataclasses.replace(policy, read=(*policy.read, "/dev/shm"))),
        "+ / read": ({}, dataclasses.replace(policy, read=(*policy.read, "/"))),
        **{f"+ {folder} read and write": ({}, dataclasses.replace(policy, read_write=(*policy.read_write, folder)))
           for folder in ("/proc", "/sys", "/dev/shm", "/dev", "/run", "/var", "/root", "/usr", "/etc", "/opt")},
    }
    # Which entry of /proc: the system's, and the engine's own (/proc/self resolves in the engine, to itself).
    entries = [f"/proc/{name}" for name in sorted(os.listdir("/proc")) if not name.isdigit()]
    entries += [f"/proc/self/{name}" for name in sorted(os.listdir("/proc/self"))]
    for entry in entries:
        variants[f"+ {entry} read and write"] = ({}, dataclasses.replace(policy, read_write=(*policy.read_write,
                                                                                            entry)))
    report["variants"] = {}
    for name, (extra_env, variant) in variants.items():
        base_env.update(extra_env)
        try:
            report["variants"][name] = child("--probe", "[]", variant).get("cu_init")
        except subprocess.TimeoutExpired:
            report["variants"][name] = "timed out"
        for key in extra_env:
            base_env.pop(key)
    return report



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="skip torch.compile (the slowest step)")
    parser.add_argument("--diagnose", action="store_true", help="which files CUDA needs that confinement refuses")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--opened", help=argparse.SUPPRESS)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.opened is not None:
        print(json.dumps(_opened_by_cuda()), flush=True)
        return 0
    if args.probe is not None:
        print(json.dumps(_probe_confined(json.loads(args.probe))), flush=True)
        return 0
    if args.engine is not None:
        results = engine_workload(json.loads(args.engine), args.quick)
        return 1 if any(step["status"] == FAIL for step in results) else 0
    sys.path.insert(0, str(REPO))
    from gpu_agent.runtime import sandbox

    if args.diagnose:
        with tempfile.TemporaryDirectory(prefix="inferplane-sandbox-diagnose-") as root:
            report = diagnose(Path(root))
        print(json.dumps(report, indent=1))
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))
        return 0
    abi, why = sandbox.landlock_abi()
    report = {"machine": {"kernel": platform.release(), "python": platform.python_version(),
                          "landlock_abi": abi, "landlock": why or f"abi {abi}",
                          "namespaces": sandbox.namespaces_missing() or "available"},
              "hardware": hardware_report()}
    print(json.dumps(report["machine"]), flush=True)
    print(json.dumps({"hardware": report["hardware"]}), flush=True)
    with tempfile.TemporaryDirectory(prefix="inferplane-sandbox-check-") as root:
        report["engines"] = [run_engine(mode, Path(root), args.quick) for mode in ("unconfined", "confined")]
    failed = [engine["mode"] for engine in report["engines"]
              if engine.get("exit_status") != 0 or any(step["status"] == FAIL for step in engine["steps"])]
    report["status"] = FAIL if failed or report["hardware"]["status"] == FAIL else PASS
    for engine in report["engines"]:
        print(f"== {engine['mode']} ({engine.get('seconds')} s, exit {engine.get('exit_status')}): "
              f"{'; '.join(engine.get('applied') or ['no sandbox line'])}")
        for step in engine["steps"]:
            print(f"  {step['status']:4} {step['step']:14} {step['seconds']:7.2f} s  {step['detail']}")
        if engine.get("stderr_tail"):
            print("  stderr:", engine["stderr_tail"][-1500:])
    print(f"hardware report: {report['hardware']['status']}; overall: {report['status']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0 if report["status"] == PASS else 1


if __name__ == "__main__":
    sys.exit(main())
