"""The agent reads what a model's tokenizer normalizer does to a text's length, from the tokenizer the engine loads,
and a hostile file makes it "unknown", never a crash, a long read or anything run
(`gpu_agent.runtime.tokenizer_normalizer`).

The descriptions of each normalizer and pre-tokenizer are checked on the parsed file (`describe_tokenizer`, in this
process); what the loader child does with the folder (transformers' choice of file and class, a duplicate key, the
limits) through `read_tokenizer_normalizer`: the loader's command run in a child forked from a process that imported
transformers (`forked_loader`), but for the model's reading, which starts it as the agent does, a few seconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gpu_agent.protocol import ModelInfo, NormalizerStep, TokenizerNormalizer, WeightsStatus
from gpu_agent.runtime import tokenizer_normalizer
from gpu_agent.runtime.model_info import read_model
from gpu_agent.runtime.tokenizer_normalizer import (
    describe_normalizer,
    describe_tokenizer,
    read_tokenizer_normalizer,
)
from tests.agent.conftest import sentencepiece_charsmap

LLAMA = {
    "type": "Sequence",
    "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    ],
}


@pytest.fixture
def forked_loader(monkeypatch, loader_forks):
    """The loader's children forked by `tests.agent.tokenizer_loader_fork_server` (~4.5 s of CPU each saved)."""
    monkeypatch.setattr(tokenizer_normalizer.subprocess, "run", loader_forks.run)


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    return copy


def _with_normalizer(model_dir: Path, normalizer) -> Path:
    path = model_dir / "tokenizer.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"normalizer": normalizer}))
    return model_dir


def _described(model_dir: Path) -> TokenizerNormalizer:
    """What the loader child describes once the library has parsed the file (as written: no library's rewriting)."""
    return describe_tokenizer(json.loads((model_dir / "tokenizer.json").read_text()))


def _kinds(normalizer: TokenizerNormalizer) -> list[str]:
    return [step.kind for step in normalizer.steps]


def test_a_tokenizer_without_a_normalizer_is_known_to_add_nothing(model_copy, forked_loader):
    # The tiny model's post-processor adds its BOS to each sequence.
    assert read_tokenizer_normalizer(model_copy) == TokenizerNormalizer(num_special_tokens=1)


def test_the_model_reading_reports_its_normalizer_with_the_other_facts(model_copy):
    info = read_model(_with_normalizer(model_copy, {"type": "NFD"})).info

    assert info.tokenizer_normalizer == TokenizerNormalizer(
        steps=[NormalizerStep(kind="decompose")], num_special_tokens=1
    )
    assert (
        WeightsStatus.from_dict(
            WeightsStatus(source="s", cache_key="k", model_info=info).to_dict()
        ).model_info
        == info
    )


@pytest.mark.parametrize(
    ("normalizer", "kinds"),
    [
        ({"type": "NFD"}, ["decompose"]),
        ({"type": "NFKD"}, ["decompose"]),
        ({"type": "NFKC"}, ["compose"]),
        (LLAMA, ["prepend", "replace"]),
        (
            {
                "type": "Sequence",
                "normalizers": [
                    {"type": "Sequence", "normalizers": [{"type": "NFKD"}]},
                    {"type": "Lowercase"},
                ],
            },
            ["decompose", "lowercase"],
        ),
        (
            {
                "type": "BertNormalizer",
                "clean_text": True,
                "handle_chinese_chars": True,
                "strip_accents": None,
                "lowercase": True,
            },
            ["shortens", "spaces", "cjk_spaces", "decompose", "shortens", "lowercase"],
        ),
        ({"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}, ["replace_regex"]),
    ],
)
def test_each_normalizer_is_described_step_by_step(model_copy, normalizer, kinds):
    assert _kinds(_described(_with_normalizer(model_copy, normalizer))) == kinds


@pytest.mark.parametrize(
    ("pre_tokenizer", "kinds"),
    [
        # Mistral's and newer Llama conversions: the space replaced in pre-tokenizing, not normalizing
        (
            {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False},
            ["replace", "prepend"],
        ),
        (
            {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "never", "split": True},
            ["replace"],
        ),
        ({"type": "Metaspace", "replacement": "\u2581", "add_prefix_space": True}, ["replace", "prepend"]),
        (
            {
                "type": "Sequence",
                "pretokenizers": [{"type": "Digits"}, {"type": "ByteLevel", "add_prefix_space": False}],
            },
            [],
        ),
    ],
)
def test_a_metaspace_pre_tokenizer_is_described_as_the_replacement_it_makes(model_copy, pre_tokenizer, kinds):
    path = model_copy / "tokenizer.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"pre_tokenizer": pre_tokenizer}))

    assert _kinds(_described(model_copy)) == kinds


@pytest.mark.parametrize(
    "pre_tokenizer",
    [
        {"type": "SomethingNew"},
        {"type": "Metaspace", "prepend_scheme": "sometimes"},
        {"type": "Sequence"},
        "Metaspace",
    ],
)
def test_a_pre_tokenizer_of_an_unknown_type_or_wrong_shape_is_unknown(model_copy, pre_tokenizer):
    path = model_copy / "tokenizer.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"pre_tokenizer": pre_tokenizer}))

    assert _described(model_copy).unknown


def test_a_replacements_pattern_and_content_are_reported_as_text(model_copy):
    described = _described(_with_normalizer(model_copy, LLAMA))

    assert described.steps[1] == NormalizerStep(kind="replace", pattern=" ", content="\u2581")
    assert described.segment_starts == "<"  # <unk>, <s>, </s>, <pad>: split out before normalizing


@pytest.mark.parametrize(
    "normalizer",
    [
        {"type": "ByteLevel"},
        {"type": "SomethingNew"},
        "NFD",
        ["NFD"],
        5,
        {"type": 5},
        {"type": "Sequence", "normalizers": {"type": "NFD"}},
        {"type": "Replace", "pattern": {"String": 5}, "content": "x"},
        {"type": "Replace", "pattern": " ", "content": "x"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "x" * 10_000},
        {"type": "Replace", "pattern": {"String": "\u0000"}, "content": "xx"},
        {"type": "Prepend", "prepend": None},
        {"type": "BertNormalizer", "lowercase": "yes"},
        {"type": "Sequence", "normalizers": [{"type": "NFD"}] * 100},
    ],
)
def test_a_normalizer_of_an_unknown_type_or_wrong_shape_is_unknown(model_copy, normalizer):
    described = _described(_with_normalizer(model_copy, normalizer))

    assert described.unknown and described.steps == []


def test_a_normalizer_nested_ten_thousand_deep_is_unknown(model_copy, forked_loader):
    nested = '{"type": "Sequence", "normalizers": [' * 10_000 + "]}" * 10_000
    text = (model_copy / "tokenizer.json").read_text()
    (model_copy / "tokenizer.json").write_text('{"normalizer": ' + nested + ", " + text[1:])

    assert read_tokenizer_normalizer(model_copy).unknown


@pytest.mark.parametrize("content", ["not json", '{"normalizer": '])
def test_a_tokenizer_file_that_is_not_a_tokenizer_is_unknown(model_copy, content, forked_loader):
    (model_copy / "tokenizer.json").write_text(content)

    assert read_tokenizer_normalizer(model_copy).unknown


def test_a_model_without_a_tokenizer_file_has_an_unknown_normalizer(model_copy, forked_loader):
    # The engine would convert a SentencePiece model, which may add Replace and Prepend steps.
    (model_copy / "tokenizer.json").unlink()

    assert read_tokenizer_normalizer(model_copy).unknown


def test_a_regular_expression_is_never_compiled(model_copy, monkeypatch):
    import re

    def refuse(*args, **kwargs):
        raise AssertionError("a tenant's pattern was compiled")

    monkeypatch.setattr(re, "compile", refuse)
    described = _described(
        _with_normalizer(model_copy, {"type": "Replace", "pattern": {"Regex": "(a+)+$"}, "content": "b"})
    )

    assert described.steps == [NormalizerStep(kind="replace_regex", pattern="(a+)+$", content="b")]


@pytest.mark.parametrize(
    "report",
    [
        {"steps": [{"kind": "teleport"}]},
        {"steps": [{"kind": "decompose"}] * 17},
        {"steps": [{"kind": "replace", "pattern": " ", "content": "x" * 65}]},
        {"steps": [{"kind": "prepend", "content": "\u0000"}]},
        {"steps": [{"kind": "replace", "pattern": "a", "content": "\ud800"}]},
        {"segment_starts": "x" * 65},
        {"segment_starts": "<\udfff"},
        {"num_special_tokens": -1},
    ],
)
def test_a_report_the_protocol_cannot_hold_is_taken_as_unknown_not_refused(report):
    # A node's whole heartbeat is refused with a report it cannot read: a tenant's file must not do that.
    info = ModelInfo.from_dict({"tokenizer_normalizer": report})

    assert info.tokenizer_normalizer.unknown and info.tokenizer_normalizer.steps == []


def test_an_older_agents_report_says_nothing_of_the_normalizer():
    assert ModelInfo.from_dict({"max_model_len": 2048}).tokenizer_normalizer is None


# --- what the engine reads, not what a parser of the file's own reads ------------------------------------------------

HOSTILE_REPLACE = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581" * 9}


def test_of_two_normalizer_keys_the_one_the_tokenizers_library_keeps_is_reported(model_copy, forked_loader):
    # The agent's own parser kept the first (null: nothing added); `tokenizers`, and so vLLM, keeps the last.
    path = model_copy / "tokenizer.json"
    text = json.dumps(json.loads(path.read_text()) | {"normalizer": None})
    path.write_text(text[:-1] + ', "normalizer": ' + json.dumps(HOSTILE_REPLACE) + "}")

    described = read_tokenizer_normalizer(model_copy)

    assert described.steps == [NormalizerStep(kind="replace", pattern=" ", content="\u2581" * 9)]


def test_the_file_fast_tokenizer_files_names_is_the_one_reported(model_copy, forked_loader):
    # transformers (and so vLLM) loads tokenizer.4.0.0.json in place of tokenizer.json.
    tokenizer = json.loads((model_copy / "tokenizer.json").read_text())
    (model_copy / "tokenizer.4.0.0.json").write_text(json.dumps(tokenizer | {"normalizer": HOSTILE_REPLACE}))
    config = json.loads((model_copy / "tokenizer_config.json").read_text())
    (model_copy / "tokenizer_config.json").write_text(
        json.dumps(config | {"fast_tokenizer_files": ["tokenizer.4.0.0.json"]})
    )

    assert _kinds(read_tokenizer_normalizer(model_copy)) == ["replace"]


def test_a_tokenizer_class_that_builds_its_own_pipeline_is_reported_as_it_builds_it(model_copy, forked_loader):
    # transformers' LlamaTokenizer keeps tokenizer.json's vocabulary and sets its own Metaspace: the file's
    # normalizer (NFD here) is not what the engine runs.
    _with_normalizer(model_copy, {"type": "NFD"})
    config = json.loads((model_copy / "tokenizer_config.json").read_text())
    (model_copy / "tokenizer_config.json").write_text(
        json.dumps(config | {"tokenizer_class": "LlamaTokenizer"})
    )

    assert _kinds(read_tokenizer_normalizer(model_copy)) == ["replace", "prepend"]


def test_a_tokenizer_with_a_lone_surrogate_is_unknown(model_copy, forked_loader):
    path = model_copy / "tokenizer.json"
    text = json.dumps(json.loads(path.read_text()) | {"normalizer": None})
    replace = '{"type": "Replace", "pattern": {"String": "a"}, "content": "\\ud800"}'
    path.write_text(text.replace('"normalizer": null', '"normalizer": ' + replace, 1))

    assert read_tokenizer_normalizer(model_copy).unknown


# --- a SentencePiece character map is known only when it is one of sentencepiece's own -------------------------------


@pytest.mark.parametrize(
    ("rule", "kinds"), [("nmt_nfkc", ["compose"]), ("nmt_nfkc_cf", ["compose", "lowercase"])]
)
def test_sentencepieces_own_character_maps_are_described_as_the_normalization_they_are(rule, kinds):
    described = describe_normalizer(
        {"type": "Precompiled", "precompiled_charsmap": sentencepiece_charsmap(rule)}
    )

    assert _kinds(described) == [*kinds, "shortens", "spaces"]
    assert "\n" in described.steps[-1].pattern  # nmt maps a newline to a space


def test_a_tenants_own_character_map_is_unknown():
    # A map built from a rules file of one's own sends " " to 40 x "▁": it was taken as NFKC.
    charsmap = sentencepiece_charsmap(rules_tsv="20\t" + " ".join(["2581"] * 40) + "\n")

    assert describe_normalizer({"type": "Precompiled", "precompiled_charsmap": charsmap}).unknown


def test_berts_clean_up_is_described_as_making_spaces_of_whitespace():
    described = describe_normalizer({"type": "BertNormalizer", "clean_text": True, "lowercase": False})

    assert described.steps[1].kind == "spaces" and {"\n", "\t", "\u3000"} <= set(described.steps[1].pattern)


def test_a_sentencepiece_only_folder_is_described_as_transformers_converts_it(tiny_model_dir, tmp_path, forked_loader):
    # No tokenizer.json: the engine converts tokenizer.model; before, such a folder reserved the whole context.
    import sentencepiece

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["hello world this is a test of things"] * 200))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(model_dir / "tokenizer"),
        vocab_size=30,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    shutil.copy(tiny_model_dir / "config.json", model_dir)
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))

    assert _kinds(read_tokenizer_normalizer(model_dir)) == ["replace", "prepend"]


# --- a pre-tokenizer's prepend, once per piece --------------------------------------------------------------------

DIGITS_THEN_METASPACE = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": False},
    ],
}
NORMALIZED_X = {"id": 999, "content": "x", "normalized": True, "special": False}


@pytest.mark.parametrize(
    ("pre_tokenizer", "kinds"),
    [
        (DIGITS_THEN_METASPACE, ["replace", "prepend_each"]),
        ({"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}, ["prepend"]),
        (
            {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, {"type": "ByteLevel"}]},
            ["prepend_each"],
        ),
        (
            {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Digits"},
                    {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first"},
                ],
            },
            ["replace", "prepend"],
        ),
    ],
)
def test_a_pre_tokenizers_prepend_after_a_split_is_made_before_every_character(pre_tokenizer, kinds):
    assert _kinds(describe_tokenizer({"pre_tokenizer": pre_tokenizer})) == kinds


def test_an_added_token_split_out_of_normalized_text_starts_a_piece_for_a_pre_tokenizers_prepend():
    metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": False}

    plain = describe_tokenizer({"pre_tokenizer": metaspace, "added_tokens": [NORMALIZED_X]})
    normalized = describe_tokenizer(
        {"normalizer": {"type": "NFKC"}, "pre_tokenizer": metaspace, "added_tokens": [NORMALIZED_X]}
    )

    assert _kinds(plain) == ["replace", "prepend"] and plain.segment_starts == "x"
    assert _kinds(normalized) == ["compose", "replace", "prepend_each"]


# --- a post-processor's special tokens, and the shapes that repeat the text ------------------------------------------


def _post_processor(processor) -> dict:
    """A `tokenizers` post-processor as the library writes it in tokenizer.json."""
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.post_processor = processor
    return json.loads(tokenizer.to_str())["post_processor"]


def _template(single: str, pair: str):
    from tokenizers import processors

    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=[("<s>", 0), ("</s>", 1)])


def _sequence(*items):
    from tokenizers import processors

    return processors.Sequence(list(items))


def _roberta():
    from tokenizers import processors

    return processors.RobertaProcessing(("</s>", 1), ("<s>", 0))


def _byte_level():
    from tokenizers import processors

    return processors.ByteLevel(trim_offsets=False)


PAIR_OF_TWENTY = "$A " + " ".join(["$B"] * 20)


@pytest.mark.parametrize(
    "processor",
    [
        # the finding: the first hands the second two encodings, which it takes as a pair (a prompt 20 times over)
        lambda: _sequence(_template("<s> $A", "<s> $A $B"), _template("$A", PAIR_OF_TWENTY)),
        lambda: _sequence(_template("<s> $A", "<s> $A $B"), _roberta()),
        lambda: _sequence(_byte_level(), _sequence(_template("<s> $A", "<s> $A $B")), _roberta()),
        lambda: _template("<s> $A", PAIR_OF_TWENTY),
        lambda: _template("<s> $A", "$A $A $B"),
    ],
    ids=["two templates", "a template and roberta", "nested", "a pair of twenty", "a pair repeating A"],
)
def test_a_post_processor_that_can_repeat_the_text_is_unknown(processor):
    described = describe_tokenizer({"post_processor": _post_processor(processor())})

    assert described.unknown and described.num_special_tokens == 0


@pytest.mark.parametrize(
    "processor, num_special_tokens",
    [
        # Llama 3's: byte-level offsets, then a BOS
        (lambda: _sequence(_byte_level(), _template("<s> $A", "<s> $A <s> $B")), 1),
        (lambda: _sequence(_template("<s> $A </s>", "<s> $A </s> $B </s>"), _byte_level()), 2),
        # RoBERTa's own pair: a special token twice is no repeated text
        (lambda: _template("<s> $A </s>", "<s> $A </s> </s> $B </s>"), 2),
        (lambda: _sequence(_byte_level(), _roberta()), 2),
    ],
    ids=[
        "byte-level then a bos",
        "a template then byte-level",
        "roberta's template",
        "byte-level then roberta",
    ],
)
def test_a_post_processor_adding_once_behind_byte_level_is_counted_for_its_special_tokens(
    processor, num_special_tokens
):
    described = describe_tokenizer({"post_processor": _post_processor(processor())})

    assert not described.unknown and described.num_special_tokens == num_special_tokens
