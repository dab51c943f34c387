"""The tiny test model builds offline, deterministically, with a tokenizer vLLM can serve."""

import json

from tokenizers import Tokenizer

from gpu_agent.protocol import ModelTask
from gpu_agent.runtime.model_info import model_task
from gpu_agent.runtime.tiny_model import build_tiny_model


def test_tiny_model_builds_with_weights_tokenizer_and_chat_template(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["max_position_embeddings"] == 2048
    assert config["hidden_size"] // config["num_attention_heads"] in (32, 64, 128)  # CPU attention head sizes
    assert (tiny_model_dir / "model.safetensors").stat().st_size < 5_000_000
    tokenizer_config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] and tokenizer_config["eos_token"] == "</s>"
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert 1000 <= tokenizer.get_vocab_size() <= 2000
    ids = tokenizer.encode("hello world, tell me a story").ids
    assert ids[0] == tokenizer.token_to_id("<s>")
    assert tokenizer.decode(ids) == "hello world, tell me a story"


def test_tiny_model_is_deterministic(tiny_model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_tiny_embedding_model_is_a_bare_llama_body_with_matryoshka_dimensions(tiny_embedding_model_dir):
    config = json.loads((tiny_embedding_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaModel"] and config["hidden_size"] == 128
    assert config["matryoshka_dimensions"] == [32, 64, 128]
    assert model_task(tiny_embedding_model_dir) == ModelTask.EMBED
    assert (tiny_embedding_model_dir / "tokenizer.json").is_file()
