"""The context the agent describes (what the gateway reserves and bills by, `Endpoint.context_length`, and what the
engine is launched with) is what vLLM derives from the same files, checked against the installed vLLM: else an honest
model's engine refuses the figure, or serves less than it could. Before, the agent read config.json alone, by rules
of its own: 2,048 described where vLLM derives 65,536 (`model_max_length`, Mistral's params.json, a
sentence-transformers `max_seq_length`), 16,384 (a RoPE "default" factor) or 2,048 (YaRN, 1,024 described)."""
import json
import shutil

import pytest

from gpu_agent.runtime.model_info import read_config_info
from gpu_agent.runtime.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("model_max_length")  # a hostile tenant's tokenizer_config names none
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("change", [
    {"model_max_length": 65536},  # vLLM: Command-R's key overrides the others; the agent takes the min
    {"rope_scaling": {"rope_type": "default", "factor": 8.0}},  # vLLM multiplies; the agent skips "default"
    {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512}},  # vLLM: as is
    {"model_max_length": 1024},  # ... smaller as well
    {"rope_scaling": None, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    {"rope_scaling": {"type": "dynamic", "factor": 0.5}},  # a factor below 1 shortens it
    {"max_position_embeddings": None, "n_positions": 1024, "max_seq_len": 4096},  # the smallest of the keys
], ids=["model_max_length", "rope_default_factor", "yarn_original", "model_max_length_smaller", "rope_parameters_linear",
        "rope_legacy_type_below_one", "smallest_key"])
def test_described_context_is_what_vllm_serves(tiny, tmp_path, change):
    from vllm.config import ModelConfig

    model = tmp_path / "hostile"
    shutil.copytree(tiny, model)
    config = json.loads((model / "config.json").read_text())
    config.update(change)
    config = {key: value for key, value in config.items() if value is not None}
    (model / "config.json").write_text(json.dumps(config))
    served = ModelConfig(model=str(model), tokenizer=str(model), dtype="bfloat16").max_model_len
    assert read_config_info(model).max_model_len == served


def test_embedding_context_is_what_vllm_serves(tmp_path):
    """vLLM's pooling runner takes sentence_bert_config.json's max_seq_length as the context, whatever config.json
    says (`vllm.config.model._get_and_verify_max_len`, `encoder_config`); the agent never reads that file."""
    from vllm.config import ModelConfig

    from gpu_agent.runtime.tiny_model import build_tiny_embedding_model

    model = build_tiny_embedding_model(tmp_path / "embed")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("model_max_length")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 65536, "do_lower_case": False}))
    served = ModelConfig(model=str(model), tokenizer=str(model), dtype="bfloat16", runner="pooling",
                         convert="embed").max_model_len
    assert read_config_info(model).max_model_len == served


@pytest.mark.parametrize("window", [{"max_position_embeddings": 65536}, {}, {"max_seq_len": 8192}],
                         ids=["given", "vllms_default", "max_seq_len"])
def test_mistral_format_context_is_what_vllm_serves(tiny, tmp_path, window):
    """With a `consolidated*.safetensors` and a `params.json`, vLLM (`get_config`, config_format auto) reads params.json,
    not config.json: its architecture, its quantization and its context. The agent reads config.json alone."""
    from vllm.config import ModelConfig

    model = tmp_path / "mistral"
    shutil.copytree(tiny, model)
    config = json.loads((model / "config.json").read_text())
    shutil.copy(model / "model.safetensors", model / "consolidated.safetensors")
    (model / "params.json").write_text(json.dumps({
        "dim": config["hidden_size"], "n_layers": config["num_hidden_layers"],
        "head_dim": config["hidden_size"] // config["num_attention_heads"], "hidden_dim": config["intermediate_size"],
        "n_heads": config["num_attention_heads"], "n_kv_heads": config["num_key_value_heads"], "norm_eps": 1e-5,
        "vocab_size": config["vocab_size"], "rope_theta": 10000.0, **window}))
    served = ModelConfig(model=str(model), tokenizer=str(model), dtype="bfloat16").max_model_len
    assert read_config_info(model).max_model_len == served
