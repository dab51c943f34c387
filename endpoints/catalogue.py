"""The GPU catalogue: what an endpoint may ask for, what it costs, and what it can run.

One table, read by validation (API and console), placement and default prices.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal


@dataclass(slots=True, frozen=True)
class GpuType:
    name: str
    label: str
    memory_gb: int  # per GPU
    hourly_cost: Decimal  # what a replica costs us per hour, shown in the wizard
    quantizations: tuple[str, ...]  # endpoint `quantization` values an engine on this device supports
    # Default prices per million tokens for endpoints on this GPU type (staff may edit per endpoint).
    price_input_per_million: Decimal
    price_cached_input_per_million: Decimal
    price_output_per_million: Decimal

    def __post_init__(self) -> None:
        if not self.quantizations or self.quantizations[0] != "none":
            raise ValueError("every GPU type supports 'none' first")


# Quantization values, with the engine behaviour behind each (the agent maps them to vLLM flags):
QUANTIZATIONS: dict[str, str] = {
    "none": "Weights as stored (bf16/fp16).",
    "fp8": "FP8 weights and activations, quantized at load (Hopper/Ada; weight-only on Ampere).",
    "fp8_per_channel": "FP8 weights with per-channel scales, quantized at load (also runs on CPUs).",
    "int8": "INT8 weights (torchao weight-only on CPU, W8A8 on GPU).",
    "awq": "Pre-quantized AWQ 4-bit checkpoint.",
    "gptq": "Pre-quantized GPTQ 4-bit checkpoint.",
}

_GPU_QUANT = ("none", "fp8", "fp8_per_channel", "int8", "awq", "gptq")

GPU_TYPES: dict[str, GpuType] = {
    gpu.name: gpu
    for gpu in (
        GpuType("cpu", "CPU (development)", 16, Decimal("0.10"), ("none", "fp8_per_channel", "int8"),
                Decimal("0.05"), Decimal("0.025"), Decimal("0.10")),
        GpuType("l4", "NVIDIA L4 24 GB", 24, Decimal("0.80"), _GPU_QUANT,
                Decimal("0.10"), Decimal("0.05"), Decimal("0.30")),
        GpuType("a10g", "NVIDIA A10G 24 GB", 24, Decimal("1.21"), _GPU_QUANT,
                Decimal("0.15"), Decimal("0.075"), Decimal("0.45")),
        GpuType("a100-80gb", "NVIDIA A100 80 GB", 80, Decimal("2.50"), _GPU_QUANT,
                Decimal("0.40"), Decimal("0.20"), Decimal("1.20")),
        GpuType("h100-80gb", "NVIDIA H100 80 GB", 80, Decimal("4.00"), _GPU_QUANT,
                Decimal("0.60"), Decimal("0.30"), Decimal("1.80")),
        GpuType("h200", "NVIDIA H200 141 GB", 141, Decimal("5.00"), _GPU_QUANT,
                Decimal("0.70"), Decimal("0.35"), Decimal("2.10")),
    )
}


def gpu_type(name: str) -> GpuType:
    return GPU_TYPES[name]
