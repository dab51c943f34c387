"""The agent reads each model's own limits from its files, reports them, and refuses a spec past them before launching."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess

import pytest

from gpu_agent.protocol import MAX_MODEL_CONTEXT_TOKENS, MAX_MODEL_NUM_PARAMS, ModelInfo, ReplicaState
from gpu_agent.runtime import safetensors_headers, weights
from gpu_agent.runtime.model_info import context_length, kv_cache_bytes_per_token, read_model, read_model_info
from gpu_agent.runtime.model_json import MAX_MODEL_JSON_BYTES
from gpu_agent.runtime.tiny_model import MAX_POSITION_EMBEDDINGS
from gpu_agent.runtime.weights import WeightsCache

from .conftest import (
    cpu_used_s,
    make_spec,
    processes_with_marker,
    wait_until,
    with_peak_memory,
    write_json_of_empty_objects,
)
from .test_agent_loop import control_plane, running_agent  # noqa: F401  (fixtures)
from .test_safetensors_header_cost import readers_answering
from .test_weights_agent import reported
from .test_weights_cache import s3, s3_endpoint  # noqa: F401  (fixtures)


def test_the_tiny_models_context_architecture_and_size_come_from_its_files(tiny_model_dir):
    info = read_model_info(tiny_model_dir)
    assert info.max_model_len == MAX_POSITION_EMBEDDINGS == 2048
    assert info.architecture == "LlamaForCausalLM"
    config = json.loads((tiny_model_dir / "config.json").read_text())
    embeddings = config["vocab_size"] * config["hidden_size"]
    assert info.num_params > embeddings


def test_context_length_follows_vllms_reading_of_the_config():
    assert context_length({"max_position_embeddings": 4096, "n_positions": 1024}) == 1024
    assert context_length({"text_config": {"max_position_embeddings": 8192}}) == 8192
    # vLLM 0.32 takes YaRN's and Llama 3's figure as it stands (the factor is in it); before, the agent multiplied the
    # original window by YaRN's factor: 131,072 described for 32,768 served. Any other type's factor multiplies it.
    yarn = {"max_position_embeddings": 32768, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 32768}}
    assert context_length(yarn) == 32768
    llama3 = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert context_length(llama3) == 131072
    assert context_length({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "linear", "factor": 2}}) == 8192
    # Command-R's model_max_length replaces the others; a config naming none is vLLM's 2,048.
    assert context_length({"max_position_embeddings": 8192, "model_max_length": 131072}) == 131072
    assert context_length({"hidden_size": 64}) == 2048


def test_kv_cache_bytes_per_token_come_from_the_attention_geometry(tiny_model_dir, tmp_path):
    # 2 layers x 2 KV heads x head_dim 64, K and V: 512 values a token (vLLM: 524,288 tokens in 1 GiB in float32).
    assert kv_cache_bytes_per_token(tiny_model_dir, "float32") == 2048
    assert kv_cache_bytes_per_token(tiny_model_dir, "bfloat16") == 1024

    def per_token(config: dict, dtype: str = "float16") -> int | None:
        (tmp_path / "config.json").write_text(json.dumps(config))
        return kv_cache_bytes_per_token(tmp_path, dtype)

    gqa = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert per_token(gqa) == 2 * 32 * 8 * 128 * 2  # head_dim from hidden_size / heads
    assert per_token({**gqa, "layer_types": ["full_attention", "sliding_attention"]}) == 2 * 32 * 8 * 128 * 2
    # Anything else keeps the caller's fixed size: hybrid or state-space layers, multimodal, unknown dtype.
    assert per_token({**gqa, "layer_types": ["full_attention", "linear_attention"]}) is None
    assert per_token({**gqa, "mamba_d_state": 16}) is None
    assert per_token({"text_config": gqa}) is None
    assert per_token(gqa, dtype="fp8") is None
    assert per_token({"hidden_size": 64}) is None
    assert kv_cache_bytes_per_token(tmp_path / "missing", "float32") is None


def test_a_directory_without_a_config_has_no_model_info(tmp_path):
    assert read_model_info(tmp_path) is None


def test_a_model_folder_that_is_not_there_is_refused_not_passed_unchecked(tmp_path):
    """Before, it read as a model without a config (no figures, no problem): every check of its files passed."""
    reading = read_model(tmp_path / "gone")
    assert reading.problem == "the model's files are not on this node (its folder is gone)"
    assert reading.info is None


def test_a_spec_past_the_models_context_fails_before_any_engine_starts_and_the_heartbeat_reports_the_model(
    control_plane,  # noqa: F811
    running_agent,  # noqa: F811
    tiny_model_dir,
):
    control_plane.desired = [make_spec("r-too-long", model_source=str(tiny_model_dir), max_model_len=4096)]
    running_agent()
    status = reported(control_plane, "r-too-long", ReplicaState.FAILED)
    assert status.failure_permanent
    assert status.failure_reason == (
        "max_model_len 4096 is above this model's context of 2048 tokens (its config.json); "
        "lower max_model_len or leave it unset to use the model's own"
    )
    assert processes_with_marker("r-too-long") == []
    with control_plane.lock:
        weights = [w for w in control_plane.heartbeats[-1].weights if w.source == str(tiny_model_dir)]
    assert weights and weights[0].complete and weights[0].model_info.max_model_len == 2048
    assert weights[0].model_info.architecture == "LlamaForCausalLM" and weights[0].size_bytes > 0


def test_a_spec_within_the_models_context_starts_its_engine(control_plane, running_agent, tiny_model_dir):  # noqa: F811
    control_plane.desired = [make_spec("r-fits", model_source=str(tiny_model_dir), max_model_len=None)]
    running_agent()
    status = reported(control_plane, "r-fits", ReplicaState.READY)
    assert status.address


def write_safetensors_header(path, header) -> None:
    data = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(data)) + data)


# What a tenant may write in its own model files; each once stopped every heartbeat of the node it was fetched on.
MALFORMED_CONFIGS = {
    "architectures not a list": '{"architectures": 5}',
    "a YaRN window of 0": json.dumps({"max_position_embeddings": 4096, "rope_scaling": {
        "rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 0}}),
    "an infinite RoPE factor": '{"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "dynamic", "factor": Infinity}}',
    "a speculators checkpoint": json.dumps({"architectures": ["LlamaForCausalLM"], "speculators_config": {
        "verifier": {"name_or_path": "/var/lib/inferplane/weights/another-tenants-model"}}}),
}
MALFORMED_HEADERS = {
    "a negative dimension": {"w": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 0]}},
    "a shape of text": {"w": {"dtype": "F32", "shape": "4x4", "data_offsets": [0, 0]}},
    "a header that is a list": [1, 2],
}


@pytest.fixture(params=[*MALFORMED_CONFIGS, *MALFORMED_HEADERS])
def malformed_model(request, tiny_model_dir, tmp_path):
    model = shutil.copytree(tiny_model_dir, tmp_path / "malformed")
    if request.param in MALFORMED_CONFIGS:
        (model / "config.json").write_text(MALFORMED_CONFIGS[request.param])
    else:
        write_safetensors_header(model / "model.safetensors", MALFORMED_HEADERS[request.param])
    return model


def test_malformed_model_files_have_no_model_info_and_a_reason_and_never_raise(malformed_model, tmp_path):
    reading = read_model(malformed_model)
    assert reading.info is None and reading.problem.startswith("the model's files cannot be served: ")
    assert read_model_info(malformed_model) is None
    # What every heartbeat reports: the model, without facts (read once, not at every heartbeat).
    cache = WeightsCache(tmp_path / "weights")
    cache.fetch(str(malformed_model))
    [status] = cache.statuses()
    assert status.complete and status.model_info is None
    assert cache.read_model(malformed_model) is cache.read_model(malformed_model)


def test_a_config_nested_past_the_parsers_depth_is_no_config(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert read_model(tmp_path).info is None
    assert kv_cache_bytes_per_token(tmp_path, "float32") is None


def test_a_config_past_the_size_cap_is_refused_unread_with_a_reason_and_the_heartbeat_goes_on(tiny_model_dir, tmp_path):
    # Parsed whole on the heartbeat thread, these 30 MB took ~760 MB; a GB stalled the heartbeat for minutes.
    model = shutil.copytree(tiny_model_dir, tmp_path / "huge-config")
    write_json_of_empty_objects(model / "config.json", {"architectures": ["LlamaForCausalLM"]})
    reading, peak = with_peak_memory(lambda: read_model(model))
    assert reading.info is None
    assert reading.problem == "the model's files cannot be served: its config.json is larger than 4 MiB"
    assert peak < MAX_MODEL_JSON_BYTES
    assert kv_cache_bytes_per_token(model, "float32") is None
    cache = WeightsCache(tmp_path / "weights")
    cache.fetch(str(model))
    [status], peak = with_peak_memory(cache.statuses)
    assert status.complete and status.model_info is None and peak < MAX_MODEL_JSON_BYTES


def test_a_config_that_grows_after_its_size_is_read_is_read_no_further_than_the_cap(tmp_path, monkeypatch):
    write_json_of_empty_objects(tmp_path / "config.json", {"architectures": ["LlamaForCausalLM"]},
                                num_bytes=MAX_MODEL_JSON_BYTES + 1024)
    fstat = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result((*fstat(fd)[:6], 100, *fstat(fd)[7:10])))
    reading = read_model(tmp_path)
    assert reading.info is None and reading.problem.endswith("its config.json is larger than 4 MiB")


def test_layer_types_that_are_not_a_list_of_names_give_no_kv_cache_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64, "layer_types": 5}))
    assert kv_cache_bytes_per_token(tmp_path, "float32") is None


def test_model_figures_past_what_the_control_plane_keeps_are_clamped(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Llama\u0000ForCausalLM" + "x" * 300], "max_position_embeddings": 3_000_000_000,
        "quantization_config": {"quant_method": "awq\u0000"},
    }))
    write_safetensors_header(tmp_path / "model.safetensors", {"w": {"shape": [2**40, 2**40], "data_offsets": [0, 0]}})
    info = read_model_info(tmp_path)
    assert info.max_model_len == MAX_MODEL_CONTEXT_TOKENS == 2**31 - 1
    assert info.num_params == MAX_MODEL_NUM_PARAMS
    assert info.architecture.startswith("LlamaForCausalLMx") and len(info.architecture) == 200
    assert info.quantization.quant_method == "awq"
    huge_rope = {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "dynamic", "factor": 1e308}}
    assert context_length(huge_rope) == MAX_MODEL_CONTEXT_TOKENS
    # An older agent's report, parsed by the control plane, is clamped alike.
    assert ModelInfo.from_dict({"max_model_len": 3_000_000_000, "num_params": 2**70}).max_model_len == 2**31 - 1


def test_a_header_of_huge_sizes_is_refused_as_it_is_read_not_multiplied_out(tmp_path):
    # The product of 600 sizes of 4,299 digits each took ~20 s of one C call holding the GIL: the agent's
    # heartbeat, which reads the model, stopped with it, and its node went offline.
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    write_safetensors_header(tmp_path / "model.safetensors",
                             {"w": {"dtype": "F32", "shape": [int("9" * 4299)] * 600, "data_offsets": [0, 0]}})
    started = cpu_used_s()  # the reader's child included
    reading = read_model(tmp_path)
    assert cpu_used_s() - started < 5
    assert reading.problem == ("the model's files cannot be served: the safetensors header of model.safetensors has "
                               "a number too large for safetensors")


def test_a_product_of_sizes_past_the_count_stops_at_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    write_safetensors_header(tmp_path / "a.safetensors", {"w": {"shape": [2**62, 2**62, 2**62, 0], "data_offsets": [0, 0]},
                                                          "v": {"shape": [3, 4], "data_offsets": [0, 0]}})
    write_safetensors_header(tmp_path / "b.safetensors", {"w": {"shape": [2**60] * 40, "data_offsets": [0, 0]}})
    assert read_model_info(tmp_path).num_params == MAX_MODEL_NUM_PARAMS


def test_a_malformed_model_fails_its_replica_before_launch_and_the_heartbeats_go_on(
    control_plane,  # noqa: F811
    running_agent,  # noqa: F811
    tiny_model_dir,
    tmp_path,
):
    model = shutil.copytree(tiny_model_dir, tmp_path / "tenant-model")
    (model / "config.json").write_text('{"architectures": 5}')
    control_plane.desired = [make_spec("r-malformed", model_source=str(model), max_model_len=None)]
    running_agent()
    status = reported(control_plane, "r-malformed", ReplicaState.FAILED)
    assert status.failure_permanent
    assert status.failure_reason == (
        "the model's files cannot be served: architectures in its config.json is not a list of names"
    )
    assert processes_with_marker("r-malformed") == []
    with control_plane.lock:
        num_beats = len(control_plane.heartbeats)
    wait_until(lambda: len(control_plane.heartbeats) >= num_beats + 2, 10)
    with control_plane.lock:
        weights = [w for w in control_plane.heartbeats[-1].weights if w.source == str(model)]
    assert weights and weights[0].complete and weights[0].model_info is None


def test_a_speculators_checkpoint_fails_its_replica_before_launch(control_plane, running_agent, tiny_model_dir, tmp_path):  # noqa: F811
    # vLLM would serve its verifier instead: a hub model it downloads itself, or another tenant's cached weights.
    model = shutil.copytree(tiny_model_dir, tmp_path / "speculator")
    config = json.loads((model / "config.json").read_text())
    config["speculators_config"] = {"verifier": {"name_or_path": str(tmp_path / "another-tenants-model")}}
    (model / "config.json").write_text(json.dumps(config))
    control_plane.desired = [make_spec("r-speculator", model_source=str(model), max_model_len=None)]
    running_agent()
    status = reported(control_plane, "r-speculator", ReplicaState.FAILED)
    assert status.failure_permanent and "speculators checkpoint" in status.failure_reason
    assert processes_with_marker("r-speculator") == []


def test_a_header_reader_past_its_wall_time_delays_the_replica_and_never_refuses_the_model(
    control_plane,  # noqa: F811
    running_agent,  # noqa: F811
    tiny_model_dir,
    monkeypatch,
):
    # A loaded node: the reader's first run passes its wall time. Before, the model was refused on that node for
    # the agent's life (`failure_permanent`); now the replica waits, says why, and starts once the files are read.
    monkeypatch.setattr(weights, "UNSETTLED_RETRY_S", (1.0,))
    started = readers_answering(monkeypatch, subprocess.TimeoutExpired("reader", 60))
    control_plane.desired = [make_spec("r-slow-reader", model_source=str(tiny_model_dir), max_model_len=None)]
    running_agent()
    waiting = reported(control_plane, "r-slow-reader", ReplicaState.STARTING)
    assert reported(control_plane, "r-slow-reader", ReplicaState.READY).address
    assert len(started) == 2
    with control_plane.lock:
        progress = [status.progress for beat in control_plane.heartbeats for status in beat.replicas]
    assert waiting and "checking the model's files again in 1 s (its safetensors headers took more than" in str(progress)


def test_a_header_reader_that_never_answers_fails_its_replica_but_not_permanently(
    control_plane,  # noqa: F811
    running_agent,  # noqa: F811
    tiny_model_dir,
    monkeypatch,
):
    monkeypatch.setattr(weights, "UNSETTLED_RETRY_S", (0.2, 0.2))
    monkeypatch.setattr(safetensors_headers, "READER_TIMEOUT_S", 0.001)
    # NOTE: every reader past its wall time, as `subprocess.run` says it: with a real 1 ms timeout, a reader whose agent
    # thread waited for the GIL until the child had exited was read whole, and the replica served (a fresh run's
    # failure); the real timeout is tests/agent/test_safetensors_header_cost.py's
    readers_answering(monkeypatch, *[subprocess.TimeoutExpired("reader", 0.001)] * 10)
    control_plane.desired = [make_spec("r-no-answer", model_source=str(tiny_model_dir), max_model_len=None)]
    running_agent()
    status = reported(control_plane, "r-no-answer", ReplicaState.FAILED)
    assert not status.failure_permanent  # the control plane may try again, here or on another node
    assert status.failure_reason == (
        "the model's files could not be checked on this node (its safetensors headers took more than 0.001 s to "
        "read; tried 3 times)"
    )
    assert processes_with_marker("r-no-answer") == []
