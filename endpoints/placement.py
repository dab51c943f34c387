"""Placement: which node runs a new replica (the policy; `replicas.place_replica` creates it).

Best fit by free GPU memory on READY nodes of the endpoint's GPU type whose
engine supports the endpoint's quantization, preferring nodes that already hold
the weights and spreading one endpoint's replicas over nodes. Never
over-commits: a node's reservations never exceed its GPU memory.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from endpoints.models import Endpoint
from endpoints.nodes.models import Node
from gpu_agent.protocol import CPU_WEIGHT_FACTOR, QUANTIZATION_FACTS

# Without a size from an agent's weights cache or the model's name, assume a small model; the
# agent reports the real size after its first download and later placements use it.
DEFAULT_WEIGHTS_MB = 1024
BYTES_PER_PARAMETER = 2  # bf16 checkpoints
# KV cache per token scales with the model: about 128 KiB for an 8B Llama with GQA (16 GB of weights).
KV_BYTES_PER_TOKEN_PER_WEIGHT_BYTE = 8e-6
# CPU engines get a fixed KV cache (the agent's --cpu-kv-cache-gib, 1 GiB) plus Python and runtime.
CPU_KV_CACHE_MB = 1024
CPU_ENGINE_OVERHEAD_MB = 768
PARAMETERS_IN_NAME = re.compile(r"(?<![0-9.])(\d+(?:\.\d+)?)[bB](?![a-zA-Z])")


def reported_weights_size_mb(endpoint: Endpoint) -> int | None:
    """The largest size any agent reported for this model source's checkpoint (as stored); None if none did."""
    # NOTE: jsonb containment lets PostgreSQL pick the few nodes that hold this model, instead of
    # loading every node's heartbeat into Python on each placement.
    holders = Node.objects.filter(last_status__weights__contains=[{"source": endpoint.model_source}])
    sizes = [
        weights.get("size_bytes", 0)
        for status in holders.values_list("last_status", flat=True)
        for weights in status.get("weights", [])
        if weights.get("source") == endpoint.model_source
    ]
    return max(1, max(sizes) // (1024 * 1024)) if sizes and max(sizes) > 0 else None


def weights_size_mb(endpoint: Endpoint) -> int:
    """The largest size any agent reported for this model source; else what its name says (…-8B…); else a guess."""
    reported = reported_weights_size_mb(endpoint)
    return guessed_weights_size_mb(endpoint) if reported is None else reported


def guessed_weights_size_mb(endpoint: Endpoint) -> int:
    """A 16-bit checkpoint's size from the model's name (…-8B…); else a small model's."""
    match = PARAMETERS_IN_NAME.search(endpoint.model_source.rsplit("/", 1)[-1])
    if match:
        return int(float(match.group(1)) * 1e9 * BYTES_PER_PARAMETER / (1024 * 1024))
    return DEFAULT_WEIGHTS_MB


def weight_factor(quantization: str, gpu_type: str, *, checkpoint_is_quantized: bool = False) -> float:
    """Engine weight memory over a 16-bit checkpoint's size (`protocol.QUANTIZATION_FACTS`).

    A pre-quantized method (awq, gptq) applied to a checkpoint's reported size is 1.0: the files
    are already 4-bit; its factor applies only to a 16-bit size guessed from the model's name.
    """
    facts = QUANTIZATION_FACTS.get(quantization)
    if facts is None:
        return 1.0
    if facts.checkpoint_methods and checkpoint_is_quantized:
        return 1.0
    if gpu_type == "cpu":
        return CPU_WEIGHT_FACTOR.get(quantization, facts.weight_factor)
    return facts.weight_factor


def estimated_weights_mb(endpoint: Endpoint) -> int:
    """What placement expects the engine's weights to take (checked against the engine's own report)."""
    reported = reported_weights_size_mb(endpoint)
    size_mb = guessed_weights_size_mb(endpoint) if reported is None else reported
    return math.ceil(size_mb * weight_factor(endpoint.quantization, endpoint.gpu_type, checkpoint_is_quantized=reported is not None))


def memory_needed_mb(endpoint: Endpoint, weights_mb: int | None = None) -> int:
    """Memory one replica reserves on its node: weights (after quantization) plus its KV cache.

    `weights_mb`, when given, is the checkpoint's size as stored (what an agent reports).
    """
    reported = reported_weights_size_mb(endpoint) if weights_mb is None else weights_mb
    weights_mb = guessed_weights_size_mb(endpoint) if reported is None else reported
    factor = weight_factor(endpoint.quantization, endpoint.gpu_type, checkpoint_is_quantized=reported is not None)
    weights = weights_mb * factor
    facts = QUANTIZATION_FACTS.get(endpoint.quantization)
    if reported is not None and facts is not None and facts.checkpoint_methods:
        weights_mb = weights_mb / facts.weight_factor  # the KV cache follows the model's 16-bit size, not its 4-bit files
    if endpoint.gpu_type == "cpu":
        return math.ceil(weights + CPU_KV_CACHE_MB + CPU_ENGINE_OVERHEAD_MB)
    kv_per_token = weights_mb * 1024 * 1024 * KV_BYTES_PER_TOKEN_PER_WEIGHT_BYTE
    kv_cache = endpoint.context_length * min(endpoint.max_num_seqs, 32) * kv_per_token / (1024 * 1024)
    return math.ceil((weights + kv_cache) * 1.1)  # 10% for activations and the CUDA context


@dataclass(slots=True, frozen=True)
class PlacementDecision:
    node: Node | None
    reason: str  # why this node, or why none


def node_holds_weights(node: Node, source: str) -> bool:
    return any(w.get("source") == source and w.get("complete") for w in node.last_status.get("weights", []))


def choose_node(endpoint: Endpoint, needed_mb: int, candidates: list[Node], used_mb: dict, replicas_here: dict) -> PlacementDecision:
    if not candidates:
        return PlacementDecision(None, f"no READY node of GPU type {endpoint.gpu_type}")
    supported = [n for n in candidates if endpoint.quantization in n.quantizations]
    if not supported:
        return PlacementDecision(None, f"no {endpoint.gpu_type} node supports quantization {endpoint.quantization}")
    fitting = [n for n in supported if n.total_gpu_memory_mb - used_mb.get(n.pk, 0) >= needed_mb]
    if not fitting:
        largest = max(n.total_gpu_memory_mb - used_mb.get(n.pk, 0) for n in supported)
        return PlacementDecision(None, f"needs {needed_mb} MB of GPU memory, the most free on a {endpoint.gpu_type} node is {largest} MB")

    def preference(node: Node):
        free_after = node.total_gpu_memory_mb - used_mb.get(node.pk, 0) - needed_mb
        return (replicas_here.get(node.pk, 0), not node_holds_weights(node, endpoint.model_source), free_after, node.name)

    node = min(fitting, key=preference)
    return PlacementDecision(node, "best fit")
