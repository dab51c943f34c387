"""The environment an engine starts with: the machine's settings, never the fleet's credentials, and offline.

The agent's own environment holds the node's join token (`INFERPLANE_JOIN_TOKEN`) and the fleet's Hugging
Face token and S3 keys (`HF_TOKEN`, `AWS_*`: `infra/k8s/base/agent-daemonset.yaml`). An engine runs one
tenant's model and reads that tenant's files (config.json, tokenizer files, a chat template), so it inherits
none of them: every engine, the warm standby and the zygote (whose forks are engines) start from the names
and prefixes below, what vLLM, torch, CUDA, OpenMP and Python read, less vLLM's that fetch from the network
or share files between tenants (`ENGINE_ENV_LEFT_OUT`), plus their own variables (the replica's key and
markers, `engine.build_engine_command`).

NOTE: engines are offline (`HF_HUB_OFFLINE`, `TRANSFORMERS_OFFLINE`). The agent fetches every file a replica
needs, with the replica's own credentials (`weights.py`), before its engine starts; a model whose files name
another model for vLLM to load (a hub name it would download into the node's cache, with whatever token it
found) gets nothing from the network. `model_info.refuse_model_redirect` refuses the one such field vLLM
follows for a primary model before anything else (a speculators checkpoint's verifier), and
`model_info.refuse_paths_outside_model` the fields that name files outside the model's folder on the node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# Passed from the agent's environment as they are.
ENGINE_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "TMP", "TEMP",
    "PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED",
    "PYTHONFAULTHANDLER", "PYTHONPROFILEIMPORTTIME", "VIRTUAL_ENV",
    "HF_HOME", "HF_HUB_CACHE", "HF_HUB_DISABLE_TELEMETRY", "TOKENIZERS_PARALLELISM",
    # The test suite tells apart the engines of its parallel workers by it (tests/agent/conftest.py).
    "PYTEST_XDIST_WORKER",
})  # fmt: skip
ENGINE_ENV_PREFIXES = (
    "LC_", "XDG_", "VLLM_", "CUDA_", "NVIDIA_", "NCCL_", "GLOO_", "UCX_", "CUDNN_", "TORCH", "PYTORCH_",
    "TRITON_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "ONEDNN_", "DNNL_", "LD_", "MALLOC_",
)  # fmt: skip
# NOTE: vLLM also reports usage statistics to its makers' server unless told not to: an engine that is offline sends
# nothing anywhere (found by the review of engines' media fetches).
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
               "DO_NOT_TRACK": "1"}
# vLLM's variables no engine inherits, though they start with `VLLM_`: each makes an engine fetch from the
# network, or share files on the node with other tenants' engines under names a request chooses. (vLLM's
# own caches and kernel tunings, `VLLM_CACHE_ROOT` and the like, still pass: what vLLM computes, shared
# under HOME anyway.)
ENGINE_ENV_LEFT_OUT = frozenset({
    # One folder of fetched media for every engine, keyed by URL (moot while engines fetch none).
    "VLLM_MEDIA_CACHE",
    # A plug-in's media loader in place of vLLM's, which keeps to `--allowed-media-domains`.
    "VLLM_MEDIA_CONNECTOR",
    # `engine.MEDIA_URL_ENV` sets it off.
    "VLLM_MEDIA_URL_ALLOW_REDIRECTS",
    # `engine.build_engine_command` sets it for an engine with adapters; on every engine it would also turn on
    # the LoRA resolvers below, which load a request's unknown `model` as an adapter.
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "VLLM_LORA_RESOLVER_CACHE_DIR",  # ... from a folder of the node: every tenant's adapters, if shared
    "VLLM_LORA_RESOLVER_HF_REPO_LIST",  # ... downloaded from these hub repositories
    # Lets an engine serve a `--max-model-len` past what it derives from the model's files: the engine is launched
    # with the context the control plane bills by (`engine.engine_context_length`), and one that cannot serve it
    # fails, never serves positions its model has none for.
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN",
    # A file that maps a model's name to another folder on the node than the replica's own.
    "VLLM_MODEL_REDIRECT_PATH",
    # Models from ModelScope, which `HF_HUB_OFFLINE` does not stop.
    "VLLM_USE_MODELSCOPE",
    # One unbounded disk cache of compiled grammars for every engine: "not safe to use in an environment with
    # potentially malicious users", vLLM's own words.
    "VLLM_V1_USE_OUTLINES_CACHE",
    # vLLM's ports between its own processes, from this one upward: an engine binds and connects only to its serving
    # port and the kernel's ephemeral range (`sandbox.port_rules`), and every engine on the node would start from it.
    "VLLM_PORT",
})  # fmt: skip


def engine_environment(agent_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What an engine (or the standby or zygote it comes from) inherits of `agent_env` (the agent's own by
    default), offline; the caller adds the engine's own variables."""
    agent_env = os.environ if agent_env is None else agent_env
    inherited = {
        name: value for name, value in agent_env.items()
        if (name in ENGINE_ENV_NAMES or name.startswith(ENGINE_ENV_PREFIXES))
        and name not in ENGINE_ENV_LEFT_OUT
    }  # fmt: skip
    return inherited | OFFLINE_ENV
