"""What a model's tokenizer does to text before it splits it: tokenizer.json's `normalizer` (and a `Metaspace`
pre-tokenizer's rewrite), as a length goes.

The gateway bounds a prompt's tokens by its UTF-8 bytes after normalization (`endpoints.gateway.estimate`), and some
normalizers lengthen text: NFD and NFKD decompose text already composed ("가", 3 bytes, is 9 as jamo), `Replace`
(" " by "▁", Llama's and SentencePiece's: 1 byte to 3) and `Prepend` add bytes of their own. The agent reads the
normalizer once, with the model's other facts (`model_info.read_model`), into a `protocol.TokenizerNormalizer`.

NOTE: the file is the tenant's. It is read up to `model_json.MAX_MODEL_JSON_BYTES` (real ones run to tens of MB, but
their `normalizer` and `added_tokens` come first, before the vocabulary), key by key at the top level, and nothing in
it is run: a regular expression is reported as text, never compiled. Whatever cannot be read (past the cap, not JSON,
nested too deep, a type the protocol does not know, a field of the wrong type) makes the normalizer unknown, which the
gateway reserves as the context.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpu_agent.protocol import (
    MAX_NORMALIZER_STEPS,
    MAX_NORMALIZER_TEXT_CHARS,
    MAX_SEGMENT_STARTS,
    NormalizerStep,
    TokenizerNormalizer,
)
from gpu_agent.runtime.model_json import MAX_MODEL_JSON_BYTES

# tokenizer.json's normalizer types (Hugging Face `tokenizers`), by what they may do to a text's length.
_KINDS = {
    "NFC": "compose",
    "NFKC": "compose",
    "Precompiled": "compose",
    "NFD": "decompose",
    "NFKD": "decompose",
    "Lowercase": "lowercase",
    "Strip": "shortens",
    "StripAccents": "shortens",
}
_SEQUENCE_DEPTH = 4  # a Sequence inside a Sequence is flattened this deep at most


class _Unknown(Exception):
    """Why a normalizer cannot be described."""


def read_tokenizer_normalizer(model_dir: str | Path) -> TokenizerNormalizer:
    """The normalizer of `model_dir`'s tokenizer.json; unknown when the folder has none (the engine would then build
    a tokenizer from a SentencePiece model, whose conversion may add `Replace` and `Prepend`) or it cannot be read.
    Never raises."""
    path = Path(model_dir) / "tokenizer.json"
    try:
        fields = _top_level_fields(path, ("normalizer", "pre_tokenizer", "added_tokens"))
        if "normalizer" not in fields or "pre_tokenizer" not in fields:
            raise _Unknown(
                "its tokenizer.json has no normalizer or pre-tokenizer before the cap on what is read"
            )
        steps = _steps(fields["normalizer"], 0) + _pre_tokenizer_steps(fields["pre_tokenizer"], 0)
        if len(steps) > MAX_NORMALIZER_STEPS:
            raise _Unknown(f"more than {MAX_NORMALIZER_STEPS} steps")
        starts = (
            _segment_starts(fields.get("added_tokens"))
            if any(step.kind == "prepend" for step in steps)
            else ""
        )
        return TokenizerNormalizer(steps=steps, segment_starts=starts)
    except _Unknown as exc:
        return TokenizerNormalizer(unknown=str(exc))
    except OSError:
        return TokenizerNormalizer(unknown="no readable tokenizer.json")
    except (ValueError, RecursionError, TypeError, AttributeError):
        return TokenizerNormalizer(unknown="its tokenizer.json is not JSON as a tokenizer writes it")


def describe_normalizer(normalizer: object, pre_tokenizer: object = None) -> TokenizerNormalizer:
    """`read_tokenizer_normalizer` of a tokenizer.json's `normalizer` and `pre_tokenizer` values already parsed."""
    try:
        steps = _steps(normalizer, 0) + _pre_tokenizer_steps(pre_tokenizer, 0)
        if len(steps) > MAX_NORMALIZER_STEPS:
            raise _Unknown(f"more than {MAX_NORMALIZER_STEPS} steps")
        return TokenizerNormalizer(steps=steps)
    except _Unknown as exc:
        return TokenizerNormalizer(unknown=str(exc))


def _top_level_fields(path: Path, names: tuple[str, ...]) -> dict:
    """The values of `names` in the JSON object at `path`, parsed one top-level field at a time and no further than
    the last of them (or `MAX_MODEL_JSON_BYTES`): the vocabulary that follows is never parsed."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        data = handle.read(MAX_MODEL_JSON_BYTES)
    text = data.decode("utf-8", "ignore" if size > len(data) else "strict")
    decoder = json.JSONDecoder()
    position = _skip_space(text, 0)
    if text[position : position + 1] != "{":
        raise _Unknown("its tokenizer.json is not a JSON object")
    position += 1
    found: dict = {}
    while len(found) < len(names):
        position = _skip_space(text, position)
        if text[position : position + 1] == "}":
            return {name: None for name in names} | found  # the whole object read: what it lacks it has not
        try:
            key, position = decoder.raw_decode(text, position)
            position = _skip_space(text, position)
            if text[position : position + 1] != ":":
                raise ValueError("':' expected")
            value, position = decoder.raw_decode(text, _skip_space(text, position + 1))
        except ValueError:
            if size > len(data):
                return found  # NOTE: the cap cut the file: what came before it stands, the rest is unknown
            raise
        if key in names and key not in found:
            found[key] = value
        position = _skip_space(text, position)
        if text[position : position + 1] == ",":
            position += 1
    return found


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _steps(normalizer: object, depth: int) -> list[NormalizerStep]:
    if normalizer is None:
        return []
    if not isinstance(normalizer, dict):
        raise _Unknown("a normalizer that is not an object")
    kind = normalizer.get("type")
    if kind == "Sequence":
        inner = normalizer.get("normalizers")
        if not isinstance(inner, list) or depth >= _SEQUENCE_DEPTH:
            raise _Unknown("a Sequence that is not a list of normalizers, or nested too deep")
        steps = [step for item in inner[: MAX_NORMALIZER_STEPS + 1] for step in _steps(item, depth + 1)]
    elif kind in _KINDS:
        steps = [NormalizerStep(kind=_KINDS[kind])]
    elif kind == "Replace":
        steps = [_replace(normalizer)]
    elif kind == "Prepend":
        steps = [
            NormalizerStep(kind="prepend", content=_text(normalizer.get("prepend"), "Prepend's prepend"))
        ]
    elif kind == "BertNormalizer":
        steps = _bert(normalizer)
    else:
        raise _Unknown(f"a normalizer of type {str(kind)[:40]!r}")
    if len(steps) > MAX_NORMALIZER_STEPS:
        raise _Unknown(f"more than {MAX_NORMALIZER_STEPS} steps")
    return steps


# Pre-tokenizers that only split text (`tokenizers`' types): they add nothing to its length.
_SPLITTING_PRE_TOKENIZERS = frozenset(
    {
        "BertPreTokenizer",
        "ByteLevel",
        "CharDelimiterSplit",
        "Whitespace",
        "WhitespaceSplit",
        "Split",
        "Punctuation",
        "Digits",
        "UnicodeScripts",
        "FixedLength",
    }
)


def _pre_tokenizer_steps(pre_tokenizer: object, depth: int) -> list[NormalizerStep]:
    """A pre-tokenizer's rewrites, after the normalizer's: `Metaspace` (newer conversions of Llama's and Mistral's
    SentencePiece tokenizers, T5's, XLM-R's) replaces each space by its `replacement` ("▁", 3 bytes) and prepends one
    unless its scheme is "never"; the others only split (`ByteLevel` maps each byte to one character, which its
    byte-level vocabulary counts as one byte)."""
    if pre_tokenizer is None:
        return []
    if not isinstance(pre_tokenizer, dict):
        raise _Unknown("a pre-tokenizer that is not an object")
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        inner = pre_tokenizer.get("pretokenizers")
        if not isinstance(inner, list) or depth >= _SEQUENCE_DEPTH:
            raise _Unknown("a pre-tokenizer Sequence that is not a list, or nested too deep")
        return [
            step
            for item in inner[: MAX_NORMALIZER_STEPS + 1]
            for step in _pre_tokenizer_steps(item, depth + 1)
        ]
    if kind == "Metaspace":
        replacement = _text(pre_tokenizer.get("replacement", "\u2581"), "Metaspace's replacement")
        scheme = pre_tokenizer.get(
            "prepend_scheme", "always" if pre_tokenizer.get("add_prefix_space", True) else "never"
        )
        if scheme not in ("always", "first", "never"):
            raise _Unknown("a Metaspace whose prepend_scheme is none of always, first, never")
        steps = [NormalizerStep(kind="replace", pattern=" ", content=replacement)]
        return steps + ([NormalizerStep(kind="prepend", content=replacement)] if scheme != "never" else [])
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return []
    raise _Unknown(f"a pre-tokenizer of type {str(kind)[:40]!r}")


def _replace(normalizer: dict) -> NormalizerStep:
    pattern = normalizer.get("pattern")
    content = _text(normalizer.get("content"), "Replace's content")
    if isinstance(pattern, dict) and len(pattern) == 1 and "String" in pattern:
        return NormalizerStep(
            kind="replace", pattern=_text(pattern["String"], "Replace's pattern"), content=content
        )
    if isinstance(pattern, dict) and len(pattern) == 1 and "Regex" in pattern:
        return NormalizerStep(
            kind="replace_regex", pattern=_text(pattern["Regex"], "Replace's pattern"), content=content
        )
    raise _Unknown("a Replace whose pattern is neither a String nor a Regex")


def _bert(normalizer: dict) -> list[NormalizerStep]:
    """BERT's normalizer as steps: clean-up (control characters dropped, whitespace a space), a space either side of
    each CJK ideograph, accents stripped (NFD, then combining marks dropped), lowercase; `strip_accents` unset
    follows `lowercase`, as `tokenizers` does."""
    flags = {
        name: normalizer.get(name, default)
        for name, default in (
            ("clean_text", True),
            ("handle_chinese_chars", True),
            ("strip_accents", None),
            ("lowercase", True),
        )
    }
    if not all(value is None or isinstance(value, bool) for value in flags.values()):
        raise _Unknown("a BertNormalizer whose flags are not true or false")
    strip_accents = flags["lowercase"] if flags["strip_accents"] is None else flags["strip_accents"]
    steps = [NormalizerStep(kind="shortens")] if flags["clean_text"] else []
    if flags["handle_chinese_chars"]:
        steps.append(NormalizerStep(kind="cjk_spaces"))
    if strip_accents:
        steps += [NormalizerStep(kind="decompose"), NormalizerStep(kind="shortens")]
    if flags["lowercase"]:
        steps.append(NormalizerStep(kind="lowercase"))
    return steps


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise _Unknown(f"{name} is not text")
    if len(value) > MAX_NORMALIZER_TEXT_CHARS:
        raise _Unknown(f"{name} is past {MAX_NORMALIZER_TEXT_CHARS} characters")
    _require_utf8(value, name)
    return value


def _require_utf8(value: str, name: str) -> None:
    """NOTE: JSON may escape a lone surrogate ("\\ud800"), which no UTF-8 body carries: in a report, the agent's
    heartbeat could not be sent at all (the node offline, with every tenant's replicas on it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _Unknown(f"{name} is not UTF-8 (a lone surrogate)") from None


def _segment_starts(added_tokens: object) -> str:
    """The first characters of the added tokens the tokenizer splits out of the raw text (those not `normalized`):
    the normalizer runs on each piece between them."""
    if added_tokens is None:
        return ""
    if not isinstance(added_tokens, list):
        raise _Unknown("added_tokens is not a list")
    starts = set()
    for token in added_tokens:
        if not isinstance(token, dict) or not isinstance(token.get("content"), str):
            raise _Unknown("an added token without content")
        if token["content"] and token.get("normalized") is not True:
            _require_utf8(token["content"][0], "an added token's first character")
            starts.add(token["content"][0])
        if len(starts) > MAX_SEGMENT_STARTS:
            raise _Unknown("added tokens with too many first characters to count pieces by")
    return "".join(sorted(starts))
