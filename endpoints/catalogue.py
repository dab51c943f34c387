"""The GPU catalogue: what an endpoint may ask for, what it costs, and what it can run.

One table, read by validation (API and console), placement and default prices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal

from gpu_agent.protocol import QUANTIZATION_FACTS, quantizations_for


@dataclass(slots=True, frozen=True)
class GpuType:
    name: str
    label: str
    memory_gb: int  # per GPU, as sold (the label)
    # Per GPU as CUDA reports it (MiB), below the label: what a spec's estimate must fit into.
    # A CPU "GPU" is the development default of the agent's share of RAM.
    memory_mb: int
    hourly_cost: Decimal  # what a replica costs us per hour, shown in the wizard
    # CUDA compute capability, major*10+minor (80 Ampere A100, 86 Ampere A10G, 89 Ada L4, 90 Hopper);
    # None for CPU engines. What each quantization means here follows from it.
    compute_capability: int | None
    # Default prices per million tokens for endpoints on this GPU type (staff may edit per endpoint).
    price_input_per_million: Decimal
    price_cached_input_per_million: Decimal
    price_output_per_million: Decimal
    # Endpoint `quantization` values an engine on this device runs ("none" first), from the shared table.
    quantizations: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantizations", quantizations_for(self.compute_capability))
        if not self.quantizations or self.quantizations[0] != "none":
            raise ValueError("every GPU type supports 'none' first")

    def quantization_mode(self, quantization: str) -> str:
        """How a value runs here: "as stored", "weight-only", "weights and activations"; "" where it does not."""
        facts = QUANTIZATION_FACTS.get(quantization)
        return facts.mode(self.compute_capability) if facts else ""


# Quantization values, with the engine behaviour behind each (`gpu_agent.protocol.QUANTIZATION_FACTS`).
QUANTIZATIONS: dict[str, str] = {name: facts.summary for name, facts in QUANTIZATION_FACTS.items()}

GPU_TYPES: dict[str, GpuType] = {
    gpu.name: gpu
    for gpu in (
        GpuType("cpu", "CPU (development)", 16, 16 * 1024, Decimal("0.10"), None,
                Decimal("0.05"), Decimal("0.025"), Decimal("0.10")),
        GpuType("l4", "NVIDIA L4 24 GB", 24, 23_034, Decimal("0.80"), 89,
                Decimal("0.10"), Decimal("0.05"), Decimal("0.30")),
        GpuType("a10g", "NVIDIA A10G 24 GB", 24, 22_731, Decimal("1.21"), 86,
                Decimal("0.15"), Decimal("0.075"), Decimal("0.45")),
        GpuType("a100-80gb", "NVIDIA A100 80 GB", 80, 81_920, Decimal("2.50"), 80,
                Decimal("0.40"), Decimal("0.20"), Decimal("1.20")),
        GpuType("h100-80gb", "NVIDIA H100 80 GB", 80, 81_559, Decimal("4.00"), 90,
                Decimal("0.60"), Decimal("0.30"), Decimal("1.80")),
        GpuType("h200", "NVIDIA H200 141 GB", 141, 143_771, Decimal("5.00"), 90,
                Decimal("0.70"), Decimal("0.35"), Decimal("2.10")),
    )
}


def gpu_type(name: str) -> GpuType:
    return GPU_TYPES[name]


# GPUs one replica may ask for: more than one runs the model tensor parallel over that many GPUs of one node.
GPUS_PER_REPLICA: tuple[int, ...] = (1, 2, 4, 8)



# --- tool calling and reasoning ------------------------------------------------------------
# vLLM's tool-call and reasoning parsers by name (`--tool-call-parser`, `--reasoning-parser`).
# NOTE: the control plane never imports vLLM; `tests/test_tool_parsers.py` checks these lists
# against the registries of the vLLM we ship, so an engine never meets a name it does not know.
TOOL_CALL_PARSERS: tuple[str, ...] = (
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4",
    "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47", "granite",
    "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "internlm", "jamba",
    "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json", "llama4_json", "llama4_pythonic", "longcat",
    "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral", "muse_glimmer", "olmo3", "openai", "phi4_mini_json",
    "plamo3", "poolside_v1", "pythonic", "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5",
    "xlam",
)  # fmt: skip
REASONING_PARSERS: tuple[str, ...] = (
    "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41", "ernie45",
    "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2", "hunyuan_a13b", "hy_v3", "hy_v4",
    "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo", "minicpmv", "minimax_m2",
    "minimax_m2_append_think", "minimax_m3", "mistral", "muse_glimmer", "nemotron_v3", "olmo3", "openai_gptoss",
    "plamo3", "poolside_v1", "qwen3", "seed_oss", "step3", "step3p5",
)  # fmt: skip

# The spec value that asks for the model family's parser (what an endpoint gets when it names none).
AUTO_PARSER = "auto"

# Model families, most specific first: (words all found in the model's name or architecture, parser).
# From vLLM's tool-calling guide; a family not listed gets no parser ("" = tool calling off).
_TOOL_CALL_FAMILIES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("hermes",), "hermes"),  # Nous Hermes fine-tunes of Llama speak Hermes, not Llama
    (("llama-4",), "llama4_pythonic"), (("llama4",), "llama4_pythonic"),
    (("llama-3",), "llama3_json"), (("llama3",), "llama3_json"),
    (("qwen3", "coder"), "qwen3_coder"), (("qwen",), "hermes"), (("qwq",), "hermes"),
    (("mistral",), "mistral"), (("mixtral",), "mistral"), (("ministral",), "mistral"), (("codestral",), "mistral"),
    (("deepseek", "v3.1"), "deepseek_v31"), (("deepseek", "v3"), "deepseek_v3"),
    (("granite-4",), "granite4"), (("granite",), "granite"),
    (("phi-4-mini",), "phi4_mini_json"), (("internlm",), "internlm"), (("jamba",), "jamba"),
    (("kimi-k2",), "kimi_k2"), (("glm-4.5",), "glm45"), (("glm-4.7",), "glm47"), (("gpt-oss",), "openai"),
    (("minimax-m2",), "minimax_m2"), (("xlam",), "xlam"), (("functiongemma",), "functiongemma"),
)  # fmt: skip
_REASONING_FAMILIES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("deepseek-r1",), "deepseek_r1"), (("qwq",), "deepseek_r1"), (("qwen3", "thinking"), "qwen3"),
    (("gpt-oss",), "openai_gptoss"),
)  # fmt: skip


def _family(model_source: str, architecture: str) -> str:
    # `hf:meta-llama/Meta-Llama-3.1-8B-Instruct@main` -> "meta-llama/meta-llama-3.1-8b-instruct llamaforcausallm"
    name = model_source.split("@", 1)[0].removeprefix("hf:").lower()
    return f"{name} {architecture.lower()}"


def _match(families, model_source: str, architecture: str) -> str:
    family = _family(model_source, architecture)
    for words, parser in families:
        if all(word in family for word in words):
            return parser
    return ""


def default_tool_call_parser(model_source: str, architecture: str = "") -> str:
    """The vLLM tool-call parser for a model, from its name (and architecture when known); "" when unknown."""
    return _match(_TOOL_CALL_FAMILIES, model_source, architecture)


def default_reasoning_parser(model_source: str, architecture: str = "") -> str:
    """The vLLM reasoning parser for a model that thinks before it answers; "" for every other model."""
    return _match(_REASONING_FAMILIES, model_source, architecture)
