"""What a model's own files say about it: context length, architecture, size, quantization.

Read from a cached model directory (`config.json` and the safetensors headers), after the weights
are fetched and before the engine starts, so the agent can refuse a spec the model cannot run
(a `max_model_len` past the model's context, `awq` on a checkpoint that is not AWQ) at once, with the reason, instead of letting vLLM
fail after a minute of loading. The control plane learns the figures from the heartbeat and uses
them as the endpoint's defaults and limits.

NOTE: imports nothing but the standard library and the protocol (the agent ships without Django).
"""

from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path

from gpu_agent.protocol import (
    CheckpointQuantization,
    ModelInfo,
    ModelTask,
    ReplicaSpec,
    checkpoint_quantization_problem,
    task_of_architecture,
)

logger = logging.getLogger(__name__)

# The config keys vLLM reads for the context length (`_get_and_verify_max_len`); the smallest wins.
CONTEXT_LENGTH_KEYS = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
    "max_sequence_length", "max_seq_length", "seq_len", "model_max_length",
)
# RoPE scalings whose factor is already part of max_position_embeddings (as vLLM treats them).
ROPE_TYPES_WITHOUT_EXTENSION = ("su", "longrope", "llama3", "mrope", "default")
MAX_HEADER_BYTES = 100 * 1024 * 1024
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def read_model_info(model_dir: str | Path) -> ModelInfo | None:
    """The model's context length, architecture and parameter count; None without a readable config."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    architectures = config.get("architectures") or []
    return ModelInfo(
        max_model_len=context_length(config),
        architecture=str(architectures[0]) if architectures else str(config.get("model_type", "")),
        num_params=count_parameters(model_dir),
        quantization=checkpoint_quantization(config),
    )


def model_task(model_dir: str | Path) -> ModelTask:
    """EMBED for an embedding model: a sentence-transformers layout (`modules.json`) or an embedding
    architecture in config.json (`protocol.task_of_architecture`); else GENERATE."""
    model_dir = Path(model_dir)
    if (model_dir / "modules.json").is_file():
        return ModelTask.EMBED
    info = read_model_info(model_dir)
    return task_of_architecture(info.architecture) if info else ModelTask.GENERATE


def checkpoint_quantization(config: dict) -> CheckpointQuantization:
    """The checkpoint's own `quantization_config` (quant_method, bits, group size), as vLLM reads it.

    Multimodal configs may keep it in `text_config`, as vLLM's `get_quant_config` looks.
    """
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) and isinstance(config.get("text_config"), dict):
        quant = config["text_config"].get("quantization_config")
    if not isinstance(quant, dict):
        return CheckpointQuantization()

    def number(*keys: str) -> int | None:
        for key in keys:
            value = quant.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    method = quant.get("quant_method")
    return CheckpointQuantization(
        quant_method=method.strip().lower()[:64] if isinstance(method, str) else "",
        bits=number("bits", "w_bit"),
        group_size=number("group_size", "q_group_size"),
    )


def context_length(config: dict) -> int | None:
    """The longest sequence vLLM would accept for this config, or None when it does not say."""
    # Multimodal configs keep the language model's figures in `text_config`.
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    lengths = [
        value for key in CONTEXT_LENGTH_KEYS
        for value in (text_config.get(key), config.get(key))
        if isinstance(value, int) and not isinstance(value, bool) and value > 0
    ]
    if not lengths:
        return None
    derived = min(lengths)
    rope = config.get("rope_scaling") or text_config.get("rope_scaling")
    if isinstance(rope, dict):
        rope_type = rope.get("rope_type") or rope.get("type") or ""
        factor = rope.get("factor")
        if rope_type not in ROPE_TYPES_WITHOUT_EXTENSION and isinstance(factor, (int, float)) and factor > 1:
            if rope_type == "yarn":
                derived = rope.get("original_max_position_embeddings", derived)
            derived = int(derived * factor)
    return derived


def kv_cache_bytes_per_token(model_dir: str | Path, dtype: str) -> int | None:
    """Bytes of K and V a token takes over every layer, for a plain attention decoder in `dtype`.

    None when the config says anything else (multimodal, state-space or hybrid layers, an unknown
    dtype): the caller then keeps its fixed size. Sliding-window and latent (MLA) attention take less
    than this, so it is an upper bound for them.
    """
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "text_config" in config:
        return None
    if any("mamba" in key or "ssm" in key for key in config) or set(config.get("layer_types") or ()) - {
        "full_attention", "sliding_attention",
    }:  # fmt: skip
        return None
    values = {
        key: config.get(key) for key in ("num_hidden_layers", "num_attention_heads", "hidden_size")
    }
    values["num_key_value_heads"] = config.get("num_key_value_heads", values["num_attention_heads"])
    if not all(isinstance(value, int) and not isinstance(value, bool) and value > 0 for value in values.values()):
        return None
    head_dim = config.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    element_bytes = DTYPE_BYTES.get(dtype)
    if not isinstance(head_dim, int) or head_dim <= 0 or element_bytes is None:
        return None
    return 2 * values["num_hidden_layers"] * values["num_key_value_heads"] * head_dim * element_bytes


def count_parameters(model_dir: Path) -> int | None:
    """Parameters in the model's safetensors files, from their headers alone (no tensor is read)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        try:
            with open(path, "rb") as handle:
                (header_len,) = struct.unpack("<Q", handle.read(8))
                if header_len > MAX_HEADER_BYTES:
                    return None
                header = json.loads(handle.read(header_len))
        except (OSError, ValueError, struct.error):
            logger.warning("could not read the safetensors header of %s", path.name)
            return None
        total += sum(
            math.prod(tensor.get("shape", []))
            for name, tensor in header.items()
            if name != "__metadata__" and isinstance(tensor, dict)
        )
    return total


def spec_problem(spec: ReplicaSpec, info: ModelInfo | None) -> str:
    """Why an engine started for this spec would refuse this model; "" when it would not (or unknown)."""
    return context_problem(spec.max_model_len, info) or checkpoint_quantization_problem(
        spec.quantization, info.quantization if info else None
    )


def context_problem(requested: int | None, info: ModelInfo | None) -> str:
    """Why an engine asked for `requested` tokens of context would refuse this model; "" when it would not."""
    if requested is None or info is None or info.max_model_len is None or requested <= info.max_model_len:
        return ""
    return (
        f"max_model_len {requested} is above this model's context of {info.max_model_len} tokens "
        f"(its config.json); lower max_model_len or leave it unset to use the model's own"
    )
