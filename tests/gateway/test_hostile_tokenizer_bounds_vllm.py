"""A tenant's tokenizer built to be counted cheaper than the engine runs it is bounded by what the engine counts.

Each model is a copy of the tiny model with a hostile tokenizer (a review's proofs): a real vLLM engine's `/tokenize`
counts a prompt, and the gateway's bound comes from what the agent reports of the same folder (`read_model`). Before,
the agent parsed tokenizer.json itself and the gateway counted one prepend per text: a duplicate "normalizer" key
(the agent kept the first, `tokenizers` the last), `fast_tokenizer_files`, a tenant's own SentencePiece map, BERT's
clean-up making spaces a replacement lengthens, and a pre-tokenizer's prepend after a split or a normalized added token
were each counted under what vLLM counted (1,723 tokens against a bound of 270, 1,912 against 154, 2,442 against 124).

NOTE: a prompt past the context is refused by the engine, so an unknown normalizer's bound (the context) bounds
whatever the engine would accept: `min(count, CONTEXT)`.
"""

from __future__ import annotations

import json

import httpx
import pytest

from endpoints.gateway.estimate import worst_case
from endpoints.gateway.normalizers import prompt_normalizer
from gpu_agent.runtime.model_info import read_model
from tests.agent.conftest import sentencepiece_charsmap
from tests.engines import serve_small_engine, tiny_model_copy

pytestmark = [pytest.mark.vllm]

KEY, CONTEXT = "key-of-the-hostile-tokenizers", 2048
NINE_MARKS = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581" * 9}
DIGITS_THEN_METASPACE = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
    ],
}
BERT_CLEAN_THEN_NINE_MARKS = {
    "type": "Sequence",
    "normalizers": [
        {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": False, "lowercase": False},
        NINE_MARKS,
    ],
}


def _duplicate_normalizer_key(model_dir):
    # null first (what the agent's own parser kept), the hostile one last (what `tokenizers` keeps); a normalized
    # added token "x" and Digits before Metaspace split pieces the prepend is made to.
    path = model_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text()) | {"normalizer": None, "pre_tokenizer": DIGITS_THEN_METASPACE}
    next_id = max(token["id"] for token in tokenizer["added_tokens"]) + 1
    tokenizer["added_tokens"].append(
        {
            "id": next_id,
            "content": "x",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": True,
            "special": False,
        }
    )
    text = json.dumps(tokenizer)
    path.write_text(text[:-1] + ', "normalizer": ' + json.dumps(BERT_CLEAN_THEN_NINE_MARKS) + "}")


def _fast_tokenizer_files(model_dir):
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    (model_dir / "tokenizer.4.0.0.json").write_text(json.dumps(tokenizer | {"normalizer": NINE_MARKS}))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["fast_tokenizer_files"] = ["tokenizer.4.0.0.json"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


def _changed(**fields):
    def change(model_dir):
        path = model_dir / "tokenizer.json"
        path.write_text(
            json.dumps(json.loads(path.read_text()) | {name: make() for name, make in fields.items()})
        )

    return change


MODELS = {
    "duplicate normalizer key": (
        _duplicate_normalizer_key,
        [" " * 60, "\n" * 60, "0123456789" * 38, "ax" * 190],
    ),
    "fast_tokenizer_files": (_fast_tokenizer_files, [" " * 70]),
    "a tenant's own precompiled map": (
        _changed(
            normalizer=lambda: {
                "type": "Precompiled",
                "precompiled_charsmap": sentencepiece_charsmap(
                    rules_tsv="20\t" + " ".join(["2581"] * 40) + "\n"
                ),
            }
        ),
        ["a " * 20],
    ),
    "BERT's clean-up, then a replacement": (
        _changed(
            normalizer=lambda: {
                "type": "Sequence",
                "normalizers": [
                    BERT_CLEAN_THEN_NINE_MARKS["normalizers"][0],
                    {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
                ],
            }
        ),
        ["\n\t" * 250],
    ),
    "a Split, then a prefix-space ByteLevel": (
        _changed(
            pre_tokenizer=lambda: {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": False},
                    {
                        "type": "ByteLevel",
                        "add_prefix_space": True,
                        "trim_offsets": False,
                        "use_regex": False,
                    },
                ],
            }
        ),
        ["~" * 800],
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def hostile_engine(request, engine_node, tiny_model_dir, tmp_path_factory):
    name = request.param
    model_dir = tiny_model_copy(tiny_model_dir, tmp_path_factory.mktemp("hostile-tokenizer"))
    MODELS[name][0](model_dir)
    served = "hostile-" + "-".join(name.split()).replace("'", "")[:40]
    with serve_small_engine(engine_node, served, model_dir, KEY, CONTEXT) as address:
        yield name, served, model_dir, address


def test_a_hostile_tokenizers_prompts_are_bounded_by_what_the_engine_counts(hostile_engine):
    name, served, model_dir, address = hostile_engine
    described = read_model(model_dir).info.tokenizer_normalizer
    normalizer = prompt_normalizer(described.to_dict())
    for text in MODELS[name][1]:
        messages = [{"role": "user", "content": text}]
        answer = httpx.post(
            f"{address}/tokenize",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": served, "messages": messages, "add_generation_prompt": True},
            timeout=60,
        )
        answer.raise_for_status()
        counted = answer.json()["count"]
        payload = {"model": served, "max_tokens": 1, "messages": messages}
        bound = worst_case(payload, "chat", CONTEXT, normalizer=normalizer).num_prompt_tokens

        assert bound >= min(counted, CONTEXT), (
            f"{name} {text[:12]!r}: vLLM {counted} > bound {bound} ({described})"
        )
