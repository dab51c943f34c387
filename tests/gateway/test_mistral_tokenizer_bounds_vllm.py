"""A Mistral-format model's prompts are bounded by what vLLM's own tokenizer for it (mistral_common's) counts.

vLLM (`--tokenizer-mode auto`, as engines run) loads a folder's tokenizer through mistral_common when the folder holds a
`consolidated*.safetensors` (an empty one will do) and a `tekken.json` or `tokenizer.model.v*`. The agent described
the folder's tokenizer.json (what transformers loads) instead, so a tenant's SentencePiece model beside it, mapping a
space to 40 x "▁", was counted as the tiny model's byte-level BPE: a 40-byte chat was 784 tokens against ~120.

Each folder is a copy of the tiny model with such files added; vLLM's own `get_tokenizer` counts (no engine needed).
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from endpoints.gateway.estimate import worst_case
from endpoints.gateway.normalizers import prompt_normalizer
from gpu_agent.runtime.model_info import read_model
from tests.engines import tiny_model_copy

pytestmark = [pytest.mark.vllm]

CONTEXT = 4096
CONTROL_TOKENS = [
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
]
FORTY_MARKS = "20\t" + " ".join(["2581"] * 40) + "\n"
TEXTS = ["a " * 20, "hello world\n\t" * 30]


def _sentencepiece_model(work, **options) -> bytes:
    import sentencepiece

    corpus = work / "corpus.txt"
    corpus.write_text("\n".join(["helloworldthisisatestofthings"] * 200))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(work / "m"),
        vocab_size=300,
        hard_vocab_limit=False,
        minloglevel=2,
        byte_fallback=True,
        control_symbols=CONTROL_TOKENS,
        **options,
    )
    return (work / "m.model").read_bytes()


def _mistral_folder(tiny_model_dir, into, tokenizer_model: bytes, beside: bytes | None = None):
    """The tiny model with an empty consolidated.safetensors and `tokenizer_model` as tokenizer.model.v3 (and `beside`
    as tokenizer.model, as Mistral-7B-Instruct-v0.3 holds both: mistral_common picks the v3)."""
    model_dir = tiny_model_copy(tiny_model_dir, into)
    header = json.dumps({"__metadata__": {}}).encode()
    (model_dir / "consolidated.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (model_dir / "tokenizer.model.v3").write_bytes(tokenizer_model)
    if beside is not None:
        (model_dir / "tokenizer.model").write_bytes(beside)
    return model_dir


def _vllm_count(model_dir, text: str) -> int:
    from vllm.tokenizers.registry import get_tokenizer

    tokenizer = get_tokenizer(str(model_dir))
    assert type(tokenizer).__name__ == "MistralTokenizer"  # what the engine would run
    return len(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True))


def _bound(model_dir, text: str) -> int:
    normalizer = prompt_normalizer(read_model(model_dir).info.tokenizer_normalizer.to_dict())
    payload = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    return worst_case(payload, "chat", CONTEXT, normalizer=normalizer).num_prompt_tokens


def test_a_tenants_sentencepiece_model_read_by_mistral_common_is_bounded_by_what_vllm_counts(
    tiny_model_dir, tmp_path
):
    (tmp_path / "work").mkdir()
    rules = tmp_path / "work" / "rules.tsv"
    rules.write_text(FORTY_MARKS)
    model = _sentencepiece_model(tmp_path / "work", normalization_rule_tsv=str(rules))
    benign = _sentencepiece_model(tmp_path / "work")
    model_dir = _mistral_folder(tiny_model_dir, tmp_path / "hostile", model, beside=benign)

    for text in TEXTS:
        assert _bound(model_dir, text) >= min(_vllm_count(model_dir, text), CONTEXT), text[:12]


def test_sentencepieces_own_map_read_by_mistral_common_is_bounded_short_of_the_context(
    tiny_model_dir, tmp_path
):
    (tmp_path / "work").mkdir()
    model = _sentencepiece_model(tmp_path / "work")
    model_dir = _mistral_folder(tiny_model_dir, tmp_path / "nmt", model, beside=model)

    for text in TEXTS:
        counted = _vllm_count(model_dir, text)

        assert counted <= _bound(model_dir, text) < CONTEXT, text[:12]


def test_a_folder_without_consolidated_weights_is_described_as_transformers_loads_it(
    tiny_model_dir, tmp_path
):
    (tmp_path / "work").mkdir()
    model_dir = _mistral_folder(tiny_model_dir, tmp_path / "hf", _sentencepiece_model(tmp_path / "work"))
    (model_dir / "consolidated.safetensors").unlink()
    shutil.rmtree(tmp_path / "work")

    assert (
        read_model(model_dir).info.tokenizer_normalizer.to_dict()
        == read_model(tiny_model_dir).info.tokenizer_normalizer.to_dict()
    )
