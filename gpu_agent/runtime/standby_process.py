"""The standby process: import vLLM ahead of time, then become one replica's engine.

Started by the agent's `Standby` (`standby.py`, which explains the whole scheme) as
`python -m gpu_agent.runtime.standby_process`, under the reaper. It imports what a replica would
import at start, writes `READY_LINE` on its stdout, and blocks on stdin for one `Handoff`. It then
takes the replica's identity (rewriting the marker in its environment block, `rewrite_environ_block`),
sends its output to the replica's log and runs vLLM's OpenAI server in process; on CPU vLLM's
children are forked from it rather than spawned (`_force_fork_children`).

NOTE: on CUDA the standby must not have initialised CUDA before its handoff. The replica's
`CUDA_VISIBLE_DEVICES` arrives with the handoff, and CUDA reads it once, when it initialises: a standby
that had already initialised it would put its engine on the GPUs it saw then (every GPU, so GPU 0),
hold a CUDA context there, and could not fork the EngineCore. vLLM's imports probe the GPUs through
NVML only; torch's `is_available()` would call `cuInit`, so the standby asks torch for the NVML-based
check (`NVML_BASED_CUDA_CHECK_ENV`) until the handoff. The standby checks `torch.cuda.is_initialized()`
after its imports and again at the handoff, and refuses (`refuse_if_cuda_initialised`) rather than serve
from a poisoned process: the agent then starts its replicas the plain way.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import select
import signal
import sys
import tempfile
import time
import traceback

from gpu_agent.runtime import sandbox
from gpu_agent.runtime.engine import DEVICE_CPU, REPLICA_ENV_MARKER
from gpu_agent.runtime.standby import EXIT_CUDA_INITIALISED, READY_LINE, REFUSED_PREFIX, Handoff
from gpu_agent.runtime.zygote import EXITED_WORD, STARTED_WORD, ZYGOTE_REAP_INTERVAL_S

# Modules a replica would otherwise import at start, API server and EngineCore alike.
PRELOAD_MODULES = (
    "vllm.entrypoints.launchers.api_server.entry",
    "vllm.entrypoints.launchers.cli_args",
    "vllm.utils.argparse_utils",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen2",
    "vllm.model_executor.models.qwen3",
    "uvloop",
    # What an engine still imported after its fork (`PYTHONPROFILEIMPORTTIME=1` in a replica's log,
    # tiny CPU model): ~0.9 s per replica, every one of four starting at once paying it again.
    "vllm.model_executor.layers.quantization.online.base",  # compressed_tensors: 0.29 s, in the worker
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.executor.multiproc_executor",
    "vllm.distributed.elastic_ep.elastic_execute",
    "vllm.transformers_utils.chat_templates",
    "vllm.entrypoints.launchers.app",  # the API server's routers, imported as it builds its app
    "vllm.entrypoints.serve.profile.api_router",
    "vllm.entrypoints.serve.tokenize.api_router",
    "vllm.entrypoints.serve.lora.api_router",
    "vllm.entrypoints.serve.elastic_ep.api_router",
    "vllm.entrypoints.serve.instrumentator.metrics",
    "vllm.entrypoints.serve.instrumentator.offline_docs",
    "vllm.entrypoints.openai.responses.api_router",
    "vllm.entrypoints.openai.chat_completion.api_router",
    "vllm.entrypoints.openai.completion.api_router",
    "vllm.entrypoints.anthropic.api_router",
    "vllm.entrypoints.cohere.api_router",
    "vllm.entrypoints.generate.api_router",
    "vllm.entrypoints.generate.structured_decisions.api_router",
    "vllm.entrypoints.generate.generative_scoring.api_router",
    "vllm.entrypoints.scale_out.factories",
    "vllm.entrypoints.scale_out.render.api_router",
    "vllm.entrypoints.scale_out.derender.api_router",
    "vllm.entrypoints.scale_out.token_in_token_out.api_router",
    "model_hosting_container_standards.sagemaker",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.websockets_sansio_impl",
)
PRELOAD_MODULES_BY_DEVICE = {
    DEVICE_CPU: (
        "vllm.v1.worker.cpu_worker",
        "vllm.v1.worker.cpu_model_runner",
        "vllm.utils.cpu_triton_utils",
        "vllm.v1.attention.backends.zentorch_sdpa",
        # Still imported by every forked engine (py-spy, round 4): the attention backend its layers resolve by
        # name, and the late-interaction pooler's kernels its model runner imports (~10 ms of CPU each).
        "vllm.v1.attention.backends.cpu_attn",
        "vllm.v1.pool.flash_maxsim",
    ),
    "cuda": ("vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner"),
}
# torch's `cuda.is_available()` calls `cudaGetDeviceCount`, which initialises the CUDA driver (`cuInit`)
# and fixes the visible devices; with this set it counts devices through NVML instead, as vLLM does.
NVML_BASED_CUDA_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
NVML_CHECK_BEFORE_ENV = "INFERPLANE_STANDBY_NVML_CHECK_BEFORE"  # its value before the standby set it


def cuda_initialised() -> bool:
    """Whether this process has initialised CUDA through torch (never, when torch is not imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def refuse_if_cuda_initialised(when: str) -> str | None:
    """The reason this process may not become an engine, or None when CUDA is still untouched."""
    if not cuda_initialised():
        return None
    return (
        f"CUDA was initialised in the standby {when}: its engine would ignore the replica's "
        "CUDA_VISIBLE_DEVICES and could not fork; refusing (the agent starts replicas the plain way)"
    )


def rewrite_environ_block(name: str, value: str) -> bool:
    """Overwrite `name`'s value in this process's initial environment block (what /proc shows).

    The new value must fit the old one's width; the remainder becomes a filler entry
    without '=', which environment parsers (psutil, glibc) skip.
    """
    try:
        with open("/proc/self/stat", "rb") as handle:
            stat = handle.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        env_start, env_end = int(fields[47]), int(fields[48])  # fields 50 and 51 of proc(5)
    except (OSError, ValueError, IndexError):
        return False
    block = ctypes.string_at(env_start, env_end - env_start)
    key = name.encode() + b"="
    if block.startswith(key):
        position = 0
    else:
        found = block.find(b"\0" + key)
        if found < 0:
            return False
        position = found + 1
    value_start = position + len(key)
    width = block.index(b"\0", value_start) - value_start
    encoded = value.encode()
    if len(encoded) + 2 > width:
        return False
    payload = encoded + b"\0" + b"_" * (width - len(encoded) - 1)
    ctypes.memmove(env_start + value_start, payload, width)
    return True


def _force_fork_children(modules=None) -> None:
    """On CPU, start the EngineCore and its worker by fork: they inherit every import.

    vLLM's CPU platform sets the `spawn` start method unconditionally, which makes
    each child import vLLM again. Every module that took `get_mp_context` by name
    gets a fork context instead; forked children inherit the patch. `modules`: the (name, module) pairs to
    look at, every one of `sys.modules` by default (a forked engine: `_modules_imported_since_patch()`).
    """
    import multiprocessing

    import vllm.utils.system_utils as system_utils
    import vllm.v1.engine.utils  # noqa: F401 - make sure the users are imported before patching
    import vllm.v1.executor.multiproc_executor  # noqa: F401

    original = getattr(system_utils.get_mp_context, "__wrapped__", system_utils.get_mp_context)

    def fork_context():
        return multiprocessing.get_context("fork")

    fork_context.__wrapped__ = original
    for name, module in list(sys.modules.items()) if modules is None else modules:
        # NOTE: look in __dict__ only: getattr on lazy modules (transformers) imports things.
        if name.startswith("vllm") and vars(module).get("get_mp_context") is original:
            module.get_mp_context = fork_context


def _preload(device: str) -> None:
    import importlib

    for module in (*PRELOAD_MODULES, *PRELOAD_MODULES_BY_DEVICE.get(device, ())):
        started_at = time.monotonic()
        try:
            importlib.import_module(module)
        except Exception as exc:  # an optional module of this vLLM build; the server imports what it needs
            print(f"standby: could not preload {module}: {exc!r}", file=sys.stderr)
            continue
        print(f"standby: imported {module} in {time.monotonic() - started_at:.1f}s", file=sys.stderr)


def _warm_model_info_cache() -> None:
    """Write vLLM's on-disk facts about each preloaded model class, so no engine inspects one itself.

    vLLM reads them (supports LoRA, pooling, ...) from `VLLM_CACHE_ROOT/modelinfos`, keyed by the
    model module's hash; on a miss it inspects the class in a fresh interpreter that imports vLLM
    again: 21.8 s of the first cold start of an architecture on a node (tiny CPU model, quiet
    machine), and a replica of every concurrent cold start paid it. The classes of the preloaded
    modules are imported here already, so they are inspected in this process, once per node and
    vLLM version. NOTE: that subprocess exists to keep CUDA uninitialised; the checks after the
    imports (`refuse_if_cuda_initialised`) run after this too.
    """
    try:
        from vllm.model_executor.models import registry
    except Exception as exc:  # a vLLM build without it: its engines inspect as they always did
        print(f"standby: no model registry to warm ({exc!r})", file=sys.stderr)
        return
    started_at = time.monotonic()
    run_in_subprocess = registry._run_in_subprocess
    registry._run_in_subprocess = lambda inspect: inspect()
    num_inspected = 0
    try:
        for architecture, model in registry.ModelRegistry.models.items():
            if getattr(model, "module_name", None) not in sys.modules:
                continue  # its module is not imported here: importing it is its engine's business
            try:
                model.inspect_model_cls()
            except Exception as exc:  # noqa: BLE001 - the engine inspects it the usual way
                print(f"standby: could not inspect {architecture}: {exc!r}", file=sys.stderr)
                continue
            num_inspected += 1
    finally:
        registry._run_in_subprocess = run_in_subprocess
    print(
        f"standby: model info of {num_inspected} architectures cached in {time.monotonic() - started_at:.1f}s",
        file=sys.stderr,
    )


def _prepare_engine_start(device: str) -> None:
    """Do here, once, the start-up steps that are the same for every engine forked from this process.

    Each one cost every replica its CPU again (py-spy of one forked engine, tiny CPU model):
    - vLLM's logging set-up as the server's default arguments give it (a `dictConfig` over every
      logger of vLLM and torch, ~0.2 s): the server finds it active and skips it, and its forked
      EngineCore skips its own too (`_skip_inherited_logging_setup`);
    - on CPU, vLLM's C++ stand-ins for Triton kernels: registering them scans every module's namespace
      (~0.4 s in each worker); registered here, the worker's own call is skipped.
    """
    try:
        from vllm.logger import configure_logging_from_args

        configure_logging_from_args(_make_server_parser().parse_args(["--model", "-"]))
    except Exception as exc:  # noqa: BLE001 - each engine configures its logging as usual
        print(f"standby: could not set up vLLM's logging ahead ({exc!r})", file=sys.stderr)
    _warm_app_build()
    # NOTE: not multiprocessing's resource tracker (~0.2 s an engine): shared from here, it left the
    # engines' own children without their replica's marker (what orphan cleanup finds them by), and it
    # would tie every tenant's engine on the node to one process.
    if device == DEVICE_CPU:
        _keep_uniproc_executor()
        _share_one_gloo_device()
        try:
            from vllm.platforms.cpu import CpuPlatform

            CpuPlatform.register_triton_kernel_overrides()
            CpuPlatform.register_triton_kernel_overrides = classmethod(lambda cls: None)
        except Exception as exc:  # noqa: BLE001 - each worker registers them as usual
            print(f"standby: could not register the CPU kernel overrides ahead ({exc!r})", file=sys.stderr)


def _warm_app_build() -> None:
    """Build the API server's app once here (every router, generation and pooling), then drop it.

    The first `build_app` in a process took 0.45 s of CPU and later ones 0.03 to 0.08 s (pydantic and
    FastAPI build their schemas and validators on first use and keep them on the classes): each forked
    engine built its app first, ~0.35 s of its ~1 s of CPU to READY (tiny CPU model). The routes and
    middleware of an engine's own app are the same either way; nothing here starts a thread, an event
    loop or touches CUDA (the checks after this still refuse a zygote that did).
    """
    try:
        import warnings

        from vllm.entrypoints.launchers.app import build_app
        from vllm.tasks import GENERATION_TASKS, POOLING_TASKS

        started_at = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            app = build_app(
                _make_server_parser().parse_args(["--model", "-"]),
                (*GENERATION_TASKS, *POOLING_TASKS),
                None,
            )
        _read_endpoint_sources(app)
        print(f"standby: API server app built once in {time.monotonic() - started_at:.1f}s", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - each engine builds its app from cold, as before
        print(f"standby: could not build the API server app ahead ({exc!r})", file=sys.stderr)


def _read_endpoint_sources(app) -> None:
    """Let FastAPI read each route's source position here, once (`_extract_endpoint_context`).

    FastAPI reads an endpoint function's source file from disk the first time a request reaches it, and
    keeps the answer by the function's identity: every forked engine's first chat request read
    `api_router.py` (~0.05 s of its first request in py-spy at load 6). The route functions are the
    modules' own, the same objects in every engine forked from here, so the answers read here are theirs.
    """
    try:
        from fastapi.routing import _extract_endpoint_context
    except ImportError:  # another FastAPI: each engine reads them on first use, as before
        return
    for route in app.routes:
        dependant = getattr(route, "dependant", None)
        if dependant is not None and dependant.call is not None:
            _extract_endpoint_context(dependant.call)


def _keep_uniproc_executor() -> None:
    """On CPU, let an engine forked from here run its model in the EngineCore (`--distributed-executor-backend uni`).

    vLLM's CPU platform turns a requested "uni" into "mp" (a separate worker process) because a spawned
    worker is the only place it can set OpenMP's environment (thread count, `GOMP_CPU_AFFINITY`) before
    libgomp reads it. An engine forked from this process inherits libgomp already initialised by the
    torch import here, so its forked worker ignores that environment too: the worker process buys nothing
    and costs each engine a third process (its own start-up, the shared-memory queue and its tracker, vLLM's
    1 s spin per message between the two). The engine command asks for "uni" on CPU (`engine.py`); this
    keeps it, for one-process (world size 1) engines only. OpenMP threads stay unbound, as in the forked
    worker: engines sharing a node's cores must not each pin themselves to the same ones.
    """
    try:
        from vllm.platforms.cpu import CpuPlatform
    except Exception as exc:  # noqa: BLE001 - engines keep vLLM's own choice
        print(f"standby: could not keep the one-process executor ({exc!r})", file=sys.stderr)
        return
    check_and_update_config = CpuPlatform.check_and_update_config.__func__

    def keep_uniproc(cls, vllm_config) -> None:
        parallel_config = vllm_config.parallel_config
        requested = parallel_config.distributed_executor_backend
        check_and_update_config(cls, vllm_config)
        if requested == "uni" and parallel_config.world_size == 1:
            parallel_config.distributed_executor_backend = "uni"

    CpuPlatform.check_and_update_config = classmethod(keep_uniproc)


def _share_one_gloo_device() -> None:
    """On CPU, let an engine's one-rank gloo process groups share one gloo device (one network loop thread).

    vLLM's CPU engine makes ~9 process groups (world, tensor-, pipeline-, data-, expert-parallel...), each of one
    rank, and torch gave each its own gloo device, whose loop thread wakes every 10 ms: an idle READY engine
    burned ~0.02 CPU-s/s in nine such threads (per-thread `/proc` stat, round 4), taken from the engines starting
    beside it. A one-rank group never connects to a peer, so one device serves them all; groups of several ranks
    keep torch's own. The device is made in the engine process that first needs one (never in the zygote: its
    thread would not survive the fork).
    """
    try:
        import torch.distributed.distributed_c10d as c10d
    except Exception as exc:  # noqa: BLE001 - a torch without gloo: nothing to share
        print(f"standby: could not share a gloo device ({exc!r})", file=sys.stderr)
        return
    base = getattr(c10d, "ProcessGroupGloo", None)
    if base is None or getattr(base, "shares_one_device", False):
        return
    shared: dict[int, object] = {}  # pid -> the device made in that process

    class OneDeviceGloo(base):
        shares_one_device = True

        def __init__(self, store, rank, size, timeout=c10d.default_pg_timeout):
            if size != 1:
                super().__init__(store, rank, size, timeout=timeout)
                return
            device = shared.get(os.getpid())
            if device is None:
                device = shared[os.getpid()] = base.create_default_device()
            options = base._Options()
            options._timeout = timeout
            options._devices = [device]
            options._threads = 1  # a one-rank collective is a local copy
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = OneDeviceGloo


def _skip_inherited_logging_setup(modules=None) -> None:
    """In forked engine processes, skip vLLM's logging set-up when the configuration is the one inherited.

    The EngineCore and its worker call `configure_logging` unconditionally (they are usually spawned);
    forked, they already have the server's configuration, and redoing it costs each ~0.2 s of CPU.
    `modules` as for `_force_fork_children`.
    """
    import vllm.logger

    # NOTE: not `vllm.logger` itself: `configure_logging_if_needed` calls its module's `configure_logging`
    # (it would call itself), and patched first, it hid the original from the comparison below, so no
    # other module was patched and every forked EngineCore set its logging up again (~0.5 s of CPU each:
    # `Logger.setLevel` clears the cache of every logger of vLLM, torch and transformers).
    configure_logging = vllm.logger.configure_logging
    for name, module in list(sys.modules.items()) if modules is None else modules:
        if name == "vllm.logger" or not name.startswith("vllm"):
            continue
        if vars(module).get("configure_logging") is configure_logging:
            module.configure_logging = vllm.logger.configure_logging_if_needed


# `sys.modules` as `_patch_forked_engines` left it: its size and its last module's name.
_patched_modules: tuple[int, str | None] = (0, None)
_replaced_lookups: dict = {}  # `zygote_models.install`'s answer: what `zygote_models.rebind` points at


def _patch_forked_engines(device: str) -> None:
    """Make, once, the patches every engine forked from this process used to make for itself.

    Each walked `sys.modules` (thousands of modules) in its API server: ~0.15 s of one forked engine's
    start in py-spy at load 5 (tiny CPU model). An engine then only looks at what it imported since.
    """
    global _patched_modules
    if device == DEVICE_CPU:
        try:
            _force_fork_children()
            _skip_inherited_logging_setup()
        except Exception as exc:  # noqa: BLE001 - each engine patches every module, as before
            print(f"standby: could not patch vLLM's modules ahead ({exc!r})", file=sys.stderr)
            return
    _patched_modules = (len(sys.modules), next(reversed(sys.modules)))


def _modules_imported_since_patch() -> list:
    """The (name, module) pairs added to `sys.modules` after `_patch_forked_engines`, newest first.

    NOTE: read from the end, never touching an older entry: a forked engine that listed all of `sys.modules`
    wrote to every module's reference count and so copied thousands of the zygote's pages (4,600 page faults,
    27 ms of CPU on a quiet machine, 0.06 to 0.14 s of a start in py-spy at load), twice (both walks above).
    Every module when the zygote's last one is no longer where it was (a module removed since).
    """
    count, last = _patched_modules
    if last is None:
        return list(sys.modules.items())
    found = []
    for name, module in reversed(sys.modules.items()):
        if name == last and len(sys.modules) - len(found) == count:
            return found
        found.append((name, module))
    return found


def _share_model_independent_lookups() -> None:
    """Answer, from this process, two look-ups every engine repeated with the same answer.

    - Installed packages' entry points (`importlib.metadata.entry_points`): vLLM's API server and
      EngineCore each look up three plugin groups (stat loggers, endpoint plugins, logits processors),
      and each look-up reads every installed distribution's metadata from disk: ~6% of a forked engine's
      start. The packages an engine can import are the ones this process imported from, so they are
      read once here.
    - The server's `system_fingerprint` (`get_system_fingerprint`): every serving class of the API
      server hashes the whole engine configuration again for the same config object (~6%); the last
      answer is kept per config object and fingerprint mode.
    """
    import importlib.metadata as metadata
    import itertools

    try:  # NOTE: as `entry_points` itself does it (Python 3.11)
        found = tuple(
            itertools.chain.from_iterable(dist.entry_points for dist in metadata._unique(metadata.distributions()))
        )

        def entry_points(**params):
            return metadata.SelectableGroups.load(found).select(**params)

        entry_points.__wrapped__ = metadata.entry_points
        metadata.entry_points = entry_points
    except Exception as exc:  # noqa: BLE001 - another Python: each engine reads them itself
        print(f"standby: could not read the entry points ahead ({exc!r})", file=sys.stderr)
    try:
        from vllm.entrypoints.serve.utils import fingerprint

        original = fingerprint.get_system_fingerprint
        last: list = []

        def get_system_fingerprint(vllm_config):
            mode = (fingerprint._DEFAULT_MODE, fingerprint._CUSTOM_VALUE)
            if not last or last[0] is not vllm_config or last[1] != mode:
                last[:] = [vllm_config, mode, original(vllm_config)]
            return last[2]

        get_system_fingerprint.__wrapped__ = original
        fingerprint.get_system_fingerprint = get_system_fingerprint
    except Exception as exc:  # noqa: BLE001 - each serving class computes it, as before
        print(f"standby: could not share the system fingerprint ({exc!r})", file=sys.stderr)


# The modules on a forked engine's stack when torch seeds its generators (`set_random_seed` in the worker's
# `init_device`): torch's CUDA, XPU and MTIA seeding, deferred until those initialise, records the whole stack
# with its source lines (`traceback.format_stack` in `_lazy_call`), and reading those source files cost every
# engine ~30 ms of CPU (py-spy, round 4). Read here once, the lines are in every forked engine's `linecache`.
SEED_STACK_MODULES = (
    "asyncio.runners", "contextlib", "multiprocessing.context", "multiprocessing.popen_fork",
    "multiprocessing.process", "torch._compile", "torch._dynamo.eval_frame", "torch.cuda", "torch.cuda.random",
    "torch.random", "torch.xpu", "torch.xpu.random", "torch.mtia", "uvloop",
    "vllm.entrypoints.launchers.api_server.entry", "vllm.tracing.otel", "vllm.utils.torch_utils",
    "vllm.v1.engine.async_llm", "vllm.v1.engine.core", "vllm.v1.engine.core_client", "vllm.v1.engine.utils",
    "vllm.v1.executor.abstract", "vllm.v1.executor.uniproc_executor", "vllm.v1.serial_utils",
    "vllm.v1.worker.cpu_worker", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.worker_base", __name__,
)  # fmt: skip


def _read_seed_stack_sources() -> None:
    """Put the source lines of `SEED_STACK_MODULES` in `linecache` (a few MB, shared with the forked engines)."""
    import linecache

    for name in SEED_STACK_MODULES:
        module = sys.modules.get(name)
        filename = getattr(module, "__file__", None)
        if filename:
            linecache.getlines(filename)


def _install_model_lookups() -> None:
    """Answer vLLM's per-model look-ups from memory for unchanged model directories (`zygote_models.py`)."""
    global _replaced_lookups
    from gpu_agent.runtime import zygote_models

    try:
        _replaced_lookups = zygote_models.install()
    except Exception as exc:  # noqa: BLE001 - another vLLM: each engine loads them from disk, as before
        print(f"standby: could not wrap the per-model look-ups ({exc!r})", file=sys.stderr)


def _freeze_heap() -> None:
    """Collect once, then move every object alive now out of the collector's sight (`gc.freeze`).

    NOTE: vLLM collects the whole heap several times while an engine starts (twice after loading
    weights in the worker, `freeze_gc_heap` in the EngineCore and in the API server's start-up): with
    vLLM and torch imported that is ~0.6 s of CPU each, ~2.7 s of the ~6 s of CPU a start took (tiny CPU model),
    and the CPU-bound part that engines starting at once queue for. Objects frozen here (the imports,
    shared by every engine forked from this process) are never scanned again, so each collection in
    an engine walks only what that engine made; nor does a collection write to their pages, which
    stay shared with the zygote instead of being copied into every engine.
    """
    gc.collect()
    gc.freeze()


_server_parser = None  # vLLM's server argument parser, built once (`_prepare_engine_start`)


def _make_server_parser():
    """vLLM's OpenAI server argument parser: ~40 ms of CPU to build (deep copies of every option's default),
    which each forked engine paid again; built here once, each engine only parses its own arguments with it."""
    global _server_parser
    if _server_parser is None:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        _server_parser = make_arg_parser(
            FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server.")
        )
    return _server_parser


def _serve(handoff: Handoff, device: str) -> None:
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.logger import configure_logging_from_args

    from gpu_agent.runtime import zygote_models

    args = _make_server_parser().parse_args(handoff.args)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    late_modules = _modules_imported_since_patch()  # what was imported since the zygote patched its modules
    if device == DEVICE_CPU:
        _force_fork_children(late_modules)
        _skip_inherited_logging_setup(late_modules)
    zygote_models.rebind(_replaced_lookups, late_modules)
    uvloop.run(run_server(args))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="inferplane-standby")
    parser.add_argument("--device", default=DEVICE_CPU)
    parser.add_argument(
        "--zygote", action="store_true", help="fork one engine per handoff and keep waiting (zygote.py)"
    )
    options = parser.parse_args(argv)

    # stdout is the status pipe to the agent; everything else printed goes to the log (stderr).
    status = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    started_at = time.monotonic()
    if options.device != DEVICE_CPU:
        # Remembered in the environment, so a zygote's forked children restore it too.
        os.environ[NVML_CHECK_BEFORE_ENV] = os.environ.get(NVML_BASED_CUDA_CHECK_ENV, "")
        os.environ[NVML_BASED_CUDA_CHECK_ENV] = "1"
    _preload(options.device)
    _warm_model_info_cache()
    _prepare_engine_start(options.device)
    _share_model_independent_lookups()
    _install_model_lookups()
    _read_seed_stack_sources()
    _patch_forked_engines(options.device)
    _freeze_heap()
    refusal = refuse_if_cuda_initialised("while importing")
    if refusal is not None:
        print(f"standby: {refusal}", file=sys.stderr, flush=True)
        status.write(REFUSED_PREFIX + refusal.encode() + b"\n")
        return EXIT_CUDA_INITIALISED
    print(f"standby: ready after {time.monotonic() - started_at:.1f}s", file=sys.stderr, flush=True)
    status.write(READY_LINE)

    if options.zygote:
        return serve_forks(status, options.device, started_at)
    line = sys.stdin.buffer.readline()  # blocks until a handoff; EOF when the agent goes away
    if not line.strip():
        return 0
    handoff = Handoff(**json.loads(line))
    status.close()
    return become_engine(handoff, options.device, started_at)


def serve_forks(status, device: str, started_at: float) -> int:
    """The zygote's loop: fork one engine per handoff line on stdin, report each start and exit on `status`.

    Lines written: `started <replica_id> <pid>` once the child exists, `exited <pid> <code>` once it is
    reaped. EOF on stdin (the agent stopped it or went away) ends the loop; the reaper then takes the
    children down (`reaper.py`). NOTE: after its imports this process runs no vLLM code but the per-model
    look-ups of `zygote_models.Warmer`, between handoffs (file reads and parsing: no thread, no OpenMP pool,
    no CUDA), so every child is forked from the same clean state: no OpenMP pool, no event loop, no CUDA context.
    """
    from gpu_agent.runtime import zygote_models

    global _engine_environ
    # NOTE: taken before the first look-up is loaded ahead: each engine starts from this, plus its handoff's env.
    _engine_environ = dict(os.environ)
    warmer = zygote_models.Warmer()
    buffer = b""
    busy = False  # whether the last idle wake-up loaded something (there may be more to load)
    try:
        while True:
            _report_exits(status)
            readable, _, _ = select.select([0], [], [], 0 if busy else ZYGOTE_REAP_INTERVAL_S)
            if not readable:
                # NOTE: one look-up per wake-up (~20 ms): a handoff arriving meanwhile waits for that one only.
                busy = warmer.warm_next()
                if busy:
                    gc.freeze()  # what it loaded is shared by the engines forked next: out of their collections too
                continue
            chunk = os.read(0, 65536)
            if not chunk:
                return 0
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if not line.strip():
                    continue
                handoff = Handoff(**json.loads(line))
                refusal = refuse_if_cuda_initialised("before forking an engine")
                if refusal is not None:
                    print(f"zygote: {refusal}", file=sys.stderr, flush=True)
                    status.write(REFUSED_PREFIX + refusal.encode() + b"\n")
                    return EXIT_CUDA_INITIALISED
                pid = os.fork()
                if pid == 0:
                    _run_child(status, handoff, device, started_at)
                status.write(f"{STARTED_WORD} {handoff.replica_id} {pid}\n".encode())
    except (BrokenPipeError, OSError) as exc:  # the agent is gone
        print(f"zygote: status pipe closed ({exc!r}); exiting", file=sys.stderr, flush=True)
        return 0


def _run_child(status, handoff: Handoff, device: str, started_at: float) -> None:
    """In a zygote's fresh child: become the replica's engine, never return into the zygote's loop."""
    code = 1
    try:
        status.close()
        # Its own session, hence its own process group: the supervisor signals this engine and its children
        # together. NOTE: a session, not only a group, as a plain launch has (`start_new_session`): with the
        # kernel's autogroup scheduling (on by default in most distributions) CPU time is shared out per
        # session, so engines forked into the zygote's session shared one engine's share between them;
        # four starting at once on a busy 2-core node took 4x one.
        os.setsid()
        code = become_engine(handoff, device, started_at)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _report_exits(status) -> None:
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status.write(f"{EXITED_WORD} {pid} {os.waitstatus_to_exitcode(wait_status)}\n".encode())


# A zygote's environment as it was before it loaded anything ahead (`serve_forks`); None in a plain standby.
_engine_environ: dict[str, str] | None = None


def _go_on_in_a_child() -> None:
    """In a one-shot standby with threads of its own (its imports started them): go on as a forked child, which
    has only this thread, and make this process wait for it and exit with its code.

    NOTE: the child stays in this process group, which the supervisor signals (a drain's SIGTERM reaches the
    engine itself), and this process ignores SIGTERM and SIGINT so that it outlives the engine's graceful stop.
    """
    pid = os.fork()
    if pid == 0:
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
        except InterruptedError:
            continue
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)


def _follow_the_engines_temporary_folder() -> None:
    """Point what torch fixed under the zygote's temporary folder when imported at a folder of the engine's own: its
    precompiled C++ headers under inductor's cache (`TORCHINDUCTOR_CACHE_DIR`, the endpoint's cache on this node:
    `sandbox.engine_folder_env`), else under the engine's temporary folder (`tempfile` must answer the engine's TMPDIR
    first), as a plain launch, which imports torch with that TMPDIR, has it.

    NOTE: torch's inductor keeps its precompiled C++ headers in `codecache._HEADER_DIR`, under `gettempdir()` at
    import: in a zygote's child, the zygote's /tmp, where a confined engine may not write. The first kernel torch
    compiled for the CPU there (vLLM's sampler ranks each token with one for `logprobs`) raised a PermissionError in
    the EngineCore, which died, and the engine with it: one call asking for logprobs stopped a CPU replica. Under the
    engine's temporary folder each replica built the header again (~60 s on 2 cores, every call on the replica held
    behind its first call asking for logprobs, a review found); under the endpoint's cache it is built once a node
    (its name is a hash of its content and flags; inductor's lock serialises two replicas building it)."""
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is None or not hasattr(codecache, "_HEADER_DIR"):
        return
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    codecache._HEADER_DIR = os.path.join(cache_dir(), "precompiled_headers")
    codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")


def become_engine(handoff: Handoff, device: str, started_at: float) -> int:
    """Take the replica's identity and run its engine in this process (a standby, or a zygote's child)."""
    if not rewrite_environ_block(REPLICA_ENV_MARKER, handoff.replica_id):
        print("standby: cannot set the replica marker; refusing the handoff", file=sys.stderr, flush=True)
        return 75  # the agent sees an early exit and launches this replica naively
    # The engine sees the environment a plain launch would give it. NOTE: in a zygote's child, rebuilt from the
    # zygote's own before it loaded anything ahead: a look-up's library code may set variables process-wide
    # (vLLM's `get_config` does, for one tenant's config), which every engine forked later would inherit.
    if _engine_environ is not None:
        from gpu_agent.runtime.zygote_models import restore_environ

        restore_environ(_engine_environ)
    nvml_check_before = os.environ.pop(NVML_CHECK_BEFORE_ENV, None)  # None: the standby did not set it
    if nvml_check_before == "":
        os.environ.pop(NVML_BASED_CUDA_CHECK_ENV, None)
    elif nvml_check_before is not None:
        os.environ[NVML_BASED_CUDA_CHECK_ENV] = nvml_check_before
    os.environ.update(handoff.env)
    os.environ[REPLICA_ENV_MARKER] = handoff.replica_id
    # NOTE: `tempfile` keeps the first answer of `gettempdir()`, the zygote's: the engine's TMPDIR is its own
    # folder (`sandbox.engine_folder_env`), where vLLM's rendezvous file and sockets must go.
    tempfile.tempdir = None
    _follow_the_engines_temporary_folder()
    sys.stdout.flush()
    sys.stderr.flush()
    log_fd = os.open(handoff.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.close(null_fd)
    print(
        f"standby: pid {os.getpid()} serves replica {handoff.replica_id} "
        f"(spawned {time.monotonic() - started_at:.1f}s ago)",
        flush=True,
    )
    # Checked again in the replica's log: its failure reason then says why the standby gave up.
    refusal = refuse_if_cuda_initialised("before the handoff")
    if refusal is not None:
        print(f"standby: {refusal}", flush=True)
        return EXIT_CUDA_INITIALISED
    # NOTE: confined here, before vLLM reads anything of the tenant's (`sandbox.py`, in namespaces of its own first:
    # `namespaces.py`, whose outer process keeps this pid); a zygote's child is single-threaded this soon after its
    # fork, as Landlock and `unshare(CLONE_NEWUSER)` need, and a one-shot standby forks one.
    if _engine_environ is None and os.environ.get(sandbox.POLICY_ENV) and sandbox.num_threads() > 1:
        _go_on_in_a_child()
    sandbox.apply_from_environment()
    _serve(handoff, device)
    # The server has shut down and stopped its engine processes. Skip the interpreter's teardown
    # (seconds of vLLM's and Triton's module finalisers on CPU): the replica counts as STOPPED only
    # once this process is gone, and scale to zero is measured to that moment.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
