"""What a model's tokenizer does to text before it splits it (its `normalizer`, and a `Metaspace` or prefix-space
`ByteLevel` pre-tokenizer's rewrite), as a length goes.

The gateway bounds a prompt's tokens by its UTF-8 bytes after normalization (`endpoints.gateway.estimate`), and some
normalizers lengthen text: NFD and NFKD decompose text already composed ("가", 3 bytes, is 9 as jamo), `Replace`
(" " by "▁", Llama's and SentencePiece's: 1 byte to 3) and `Prepend` add bytes of their own. The agent reads the
normalizer once, with the model's other facts (`model_info.read_model`), into a `protocol.TokenizerNormalizer`.

NOTE: read what the engine reads. The tokenizer is loaded as vLLM loads it (transformers' `AutoTokenizer`, no remote
code; `tokenizers` on tokenizer.json where transformers is not installed) and described from the library's own
canonical JSON (`backend_tokenizer.to_str()`): a file of the agent's own parsing disagreed with the engine's (a
duplicate "normalizer" key, of which `tokenizers` keeps the last; `fast_tokenizer_files` naming another file), and
a SentencePiece-only folder converted to a fast tokenizer is described instead of unknown.

NOTE: the files are the tenant's. They are loaded in a child process (`python -m
gpu_agent.runtime.tokenizer_normalizer <folder>`) with `MAX_LOADER_CPU_S` of CPU, `MAX_LOADER_MEMORY_BYTES` of
address space and `LOADER_TIMEOUT_S` of wall time, as the safetensors headers are (`safetensors_headers`); the
agent's thread waits on a pipe. Whatever fails to load, or cannot be described (a type the protocol does not know,
a field of the wrong type, text that is not UTF-8), makes the normalizer unknown, which the gateway reserves as the
context. Nothing the child finds is run in the agent: a regular expression is reported as text.

NOTE: the child costs ~4.5 s of CPU (transformers' import), at every reading of a model. What it answered is kept in
the agent, by the SHA-256 of what it read (`_content_key`: every file of the folder by name and content, weights by
name and size alone, the libraries' versions, and the source of the agent's own modules the child runs:
`_describer_digest`), so the same files are described once per agent and describer. A tenant cannot
reach another's entry: a key is the content itself, and an answer is kept only when the files hashed the same before
and after the child read them. A timeout or a child that could not start or ended badly is never kept.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import logging
import os
import re
import resource
import stat
import subprocess
import sys
import threading
from collections import OrderedDict
from importlib import metadata
from pathlib import Path

from gpu_agent.protocol import (
    MAX_NORMALIZER_STEPS,
    MAX_NORMALIZER_TEXT_CHARS,
    MAX_SEGMENT_STARTS,
    NormalizerStep,
    TokenizerNormalizer,
)
from gpu_agent.runtime.model_json import ModelJsonTooLarge, read_model_json

logger = logging.getLogger(__name__)

# tokenizer.json's normalizer types (Hugging Face `tokenizers`), by what they may do to a text's length.
_KINDS = {
    "NFC": "compose",
    "NFKC": "compose",
    "NFD": "decompose",
    "NFKD": "decompose",
    "Lowercase": "lowercase",
    "Strip": "shortens",
    "StripAccents": "shortens",
}
# The characters that become a space besides what NFKD makes one: BERT's clean-up (Unicode whitespace, and Python's
# `isspace` is a superset of what `tokenizers` counts) and sentencepiece's nmt_nfkc maps (found by normalizing every
# code point with the map, `tokenizers.normalizers.Precompiled`). A later replacement of " " counts them too.
_WHITESPACE = "".join(chr(code) for code in range(0x110000) if chr(code).isspace() and code != 0x20)
_NMT_SPACES = "\t\n\x0c\r\u061c\u1680\u200b\u200c\u200e\u200f\u2028\u2029\u2581\ufeff\ufffd"
# sentencepiece's builtin character maps by the SHA-256 of their decoded bytes (its `normalization_rule_name`s,
# built by sentencepiece 0.2 from a trained model's `normalizer_spec.precompiled_charsmap`; identity is empty). NOTE:
# any other map is a tenant's own, which may send a character to anything ("a space to 40 x '▁'"): unknown.
_PRECOMPILED_MAPS = {
    "1e2c7b43d3ee9755ceaa2ac335e253d8703604e0249ee1e81156c92b46423844": ("nmt_nfkc", ("compose",)),
    "2c03512e62f9ed965ec90d85314211b63b5b8aa0395311ea2147eec9ff738907": (
        "nmt_nfkc_cf",
        ("compose", "lowercase"),
    ),
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855": ("identity", ()),
}
_SEQUENCE_DEPTH = 4  # a Sequence inside a Sequence is flattened this deep at most
# The loader child's limits. transformers' import and a tiny model's tokenizer take ~3.5 s of CPU and ~400 MB; a
# 250,000-piece vocabulary a few seconds more. Past them the normalizer is unknown.
MAX_LOADER_CPU_S = 60
MAX_LOADER_MEMORY_BYTES = 3 * 1024**3
LOADER_TIMEOUT_S = 180
MAX_ANSWER_BYTES = 64 * 1024  # a description is a few hundred bytes
# The child's answers kept (`_remembered`): a few hundred bytes each.
MAX_REMEMBERED_ANSWERS = 256
# Files hashed by name and size alone: weights (`weights_formats`' suffixes: safetensors, pickles, other frameworks'),
# whose names no tokenizer class reads, unless transformers may pick one as a versioned tokenizer file
# (`tokenization_utils_base._re_tokenizer_file`, searched in a `fast_tokenizer_files` name:
# "tokenizer.4.0.json.safetensors" is one).
_WEIGHTS_SUFFIXES = (
    ".safetensors",
    *(".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"),
    *(".h5", ".msgpack", ".onnx", ".onnx_data", ".gguf", ".tflite", ".mlmodel", ".ot"),
)
_VERSIONED_TOKENIZER_FILE = re.compile(r"tokenizer\.(.*)\.json")
# How a tokenizer_config.json names the files a fast tokenizer is read from (the loader's field), as its bytes hold it.
FAST_TOKENIZER_FILES_KEY = b'"fast_tokenizer_files"'
# Past this many bytes of other files (a tokenizer.json is 34 MB at most), the folder is not hashed: described by
# the child at each reading, as before, never a long read in the agent.
MAX_HASHED_BYTES = 256 * 1024**2
# The libraries whose versions change what the child answers (loading, conversion of a SentencePiece model).
_LIBRARIES = ("transformers", "tokenizers", "sentencepiece", "protobuf", "tiktoken")
_HASH_CHUNK_BYTES = 1024 * 1024
# The agent's own modules the child runs to describe a tokenizer (this one as `-m`, and what it imports of the agent),
# relative to the folder the child starts in: their source is in every content key (`_describer_digest`).
# NOTE: the child reads them from disk at each start. An agent upgraded in place (its package replaced under the
# running agent) ran a fixed describer in its children while its memo kept serving the old one's answers for every
# folder it had described: `tests/agent/test_tokenizer_descriptions_kept.py` checks this list is what the child imports.
DESCRIBER_FILES = (
    "gpu_agent/__init__.py",
    "gpu_agent/protocol.py",
    "gpu_agent/runtime/__init__.py",
    "gpu_agent/runtime/model_json.py",
    "gpu_agent/runtime/tokenizer_normalizer.py",
)
# The describer's files' root and stat signature, and the digest of their source then (`_describer_digest`).
_describer: tuple[tuple, bytes] | None = None
_remembered: OrderedDict[str, str] = OrderedDict()  # content key -> the child's answer (JSON text)
_remembered_lock = threading.Lock()


class _Unknown(Exception):
    """Why a normalizer cannot be described."""


def read_tokenizer_normalizer(model_dir: str | Path) -> TokenizerNormalizer:
    """The normalizer of the tokenizer the engine would load from `model_dir`, described by a child process within
    the loader's limits (once per content: `_content_key`); unknown when it does not load there or cannot be
    described. Never raises."""
    # NOTE: one root for the key and the child: the describer hashed is the one that runs
    root = _package_root()
    key = _content_key(model_dir, root)
    if key is not None:
        with _remembered_lock:
            answer = _remembered.get(key)
            if answer is not None:
                _remembered.move_to_end(key)
        if answer is not None:
            return TokenizerNormalizer.from_dict(json.loads(answer))
    described, answer = _describe_in_child(model_dir, root)
    # NOTE: kept only when the files the child read are the ones hashed: never an answer under another content's key.
    if answer is not None and key is not None and _content_key(model_dir, root) == key:
        with _remembered_lock:
            _remembered[key] = answer
            while len(_remembered) > MAX_REMEMBERED_ANSWERS:
                _remembered.popitem(last=False)
    return described


def _package_root() -> Path:
    """The folder of the agent's package, its links resolved now, not at import: an install whose link was flipped to a
    new release (`current -> v2`, the old release removed) runs and hashes the new release's describer. Resolved once,
    a removed release was the child's folder until the agent restarted: every new model's tokenizer unknown."""
    return Path(__file__).resolve().parents[2]


def _describe_in_child(
    model_dir: str | Path, package_root: Path | None = None
) -> tuple[TokenizerNormalizer, str | None]:
    """The child's description, and its answer as JSON text when it answered (None: a timeout, a child that could not
    start or ended badly, an answer that could not be read). `package_root`: the agent's folder (`_package_root()`)."""
    # NOTE: the child imports this same agent (its folder first on the path), wherever the agent was started.
    package_root = package_root or _package_root()
    environment = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    try:
        finished = subprocess.run(  # noqa: S603 - our own interpreter and module, the folder as one argument
            [
                sys.executable,
                "-E",
                "-s",
                "-m",
                __name__,
                os.fspath(model_dir),
                str(MAX_LOADER_CPU_S),
                str(MAX_LOADER_MEMORY_BYTES),
            ],
            cwd=package_root,
            env=environment,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=LOADER_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return TokenizerNormalizer(unknown=f"its tokenizer took more than {LOADER_TIMEOUT_S} s to load"), None
    except OSError as exc:
        logger.exception("could not start the tokenizer loader for %s", Path(model_dir).name)
        return TokenizerNormalizer(
            unknown=f"the tokenizer loader could not start ({exc.strerror or 'error'})"
        ), None
    if finished.returncode != 0:
        logger.warning(
            "the tokenizer loader for %s ended with %s: %s",
            Path(model_dir).name,
            finished.returncode,
            finished.stderr[-2000:].decode(errors="replace"),
        )
        return TokenizerNormalizer(
            unknown=f"its tokenizer does not load within the node's limits (exit {finished.returncode})"
        ), None
    try:
        answer = json.loads(finished.stdout[:MAX_ANSWER_BYTES])
        return TokenizerNormalizer.from_dict(answer), json.dumps(answer)
    except (ValueError, TypeError, KeyError):
        logger.warning("the tokenizer loader for %s answered %r", Path(model_dir).name, finished.stdout[:200])
        return TokenizerNormalizer(unknown="the tokenizer loader's answer could not be read"), None


def _content_key(model_dir: str | Path, package_root: Path | None = None) -> str | None:
    """The SHA-256 of everything the child's answer may depend on: the libraries' versions, and every entry of the
    folder by relative name, kind and link target, each file's content (links followed, as the loader opens them) or,
    for weights, its size (unless its relative path may be a versioned tokenizer file, or `fast_tokenizer_files` names
    it: "tokenizer.4.0.json/model.safetensors" is read as a tokenizer); a FIFO or device by its kind alone. None when
    the folder cannot be read whole, holds a link to a folder (the walk does not follow it; the loader would), names a
    tokenizer file outside itself, or holds more than `MAX_HASHED_BYTES` to hash: nothing is kept or looked up then.
    `package_root`: the agent's folder whose describer is hashed (`_package_root()`)."""
    digest = hashlib.sha256(_describer_digest(package_root or _package_root()))
    for library in _LIBRARIES:
        try:
            version = metadata.version(library)
        except metadata.PackageNotFoundError:
            version = ""
        digest.update(f"{library}={version}\0".encode())
    root = Path(model_dir)
    num_hashed_bytes = 0
    try:
        named = _named_tokenizer_files(root)
        for folder, folder_names, file_names in os.walk(root, onerror=_raise):
            folder_names.sort()  # NOTE: walked, and hashed, in this order
            base = Path(folder)
            for name in folder_names:
                path = base / name
                relative = os.fsencode(path.relative_to(root))
                digest.update(b"d\0" + relative + b"\0")
                # NOTE: a link to a folder: the loader reads through it, the walk does not (its files unhashed)
                if path.is_symlink():
                    return None
            for name in sorted(file_names):
                path = base / name
                relative = os.fsencode(path.relative_to(root))
                digest.update(b"f\0" + relative + b"\0")
                if path.is_symlink():
                    digest.update(b"l\0" + os.fsencode(os.readlink(path)) + b"\0")
                if not path.exists():
                    digest.update(b"dangling\0")
                    continue
                status = path.stat()
                if not stat.S_ISREG(status.st_mode):  # NOTE: a FIFO or a device is never opened here
                    digest.update(b"special %o\0" % status.st_mode)
                elif name.endswith(_WEIGHTS_SUFFIXES) and not (
                    _VERSIONED_TOKENIZER_FILE.search(os.fsdecode(relative)) or path.resolve() in named
                ):
                    digest.update(b"s%d\0" % status.st_size)
                else:
                    num_hashed_bytes += status.st_size
                    if num_hashed_bytes > MAX_HASHED_BYTES:
                        return None
                    digest.update(b"c%d:" % status.st_size + _file_digest(path, status.st_size) + b"\0")
    except (OSError, ValueError):
        return None
    return digest.hexdigest()


def _describer_digest(package_root: Path) -> bytes:
    """The SHA-256 of the source of `DESCRIBER_FILES` under `package_root` as the child would import them now: hashed
    once per version of the files (their size, modification time, inode and change time), a stat of each at every key.
    A file that cannot be read hashes as missing (the child then fails, and its answer is not kept).

    NOTE: the change time too: a file rewritten in place at its size with its modification time put back (`cp -p` or
    `rsync --inplace -t` of a reproducible build) kept its size, modification time and inode, and the old digest."""
    global _describer
    signature = [package_root]
    for name in DESCRIBER_FILES:
        try:
            status = (package_root / name).stat()
            signature.append((name, status.st_size, status.st_mtime_ns, status.st_ino, status.st_ctime_ns))
        except OSError:
            signature.append((name, None))
    signature = tuple(signature)
    if _describer is not None and _describer[0] == signature:
        return _describer[1]
    digest = hashlib.sha256()
    for name in DESCRIBER_FILES:
        try:
            source = (package_root / name).read_bytes()
        except OSError:
            digest.update(b"missing %s\0" % name.encode())
            continue
        digest.update(b"%s %d:" % (name.encode(), len(source)) + source + b"\0")
    _describer = (signature, digest.digest())
    return _describer[1]


def _named_tokenizer_files(root: Path) -> set[Path]:
    """The files a tokenizer_config.json's `fast_tokenizer_files` names, resolved as the loader opens them
    (`os.path.join(folder, name)`, links and `..` followed): hashed by content whatever their names. A name whose
    file is outside the folder, or a tokenizer_config.json past `MAX_MODEL_JSON_BYTES`, raises ValueError (no key).

    NOTE: read within the bound every tenant JSON file the agent parses is held to (`model_json`), a larger one not at
    all: parsed whole, 48 MiB of `{},` (a tokenizer_config.json may be any size the weights budget allows, a real one
    grown past 4 MiB by its added tokens) took the agent 1.26 GB and 1.3 s of the GIL, twice a reading, and a deeper
    one than the parser's recursion raised out of this "never raises" reading. A scan of its bytes for the field's name
    missed a JSON-escaped one (`"fast\\u005ftokenizer_files"`, which the loader decodes): two folders whose named
    tokenizers differed shared a key, and so a description."""
    path = root / "tokenizer_config.json"
    try:
        config = read_model_json(path)
    except ModelJsonTooLarge:
        raise ValueError("a tokenizer_config.json too large to read may name tokenizer files") from None
    except (OSError, ValueError, RecursionError):
        return set()
    names = config.get("fast_tokenizer_files") if isinstance(config, dict) else None
    if not isinstance(names, list):
        return set()
    resolved_root = root.resolve()
    named = set()
    for name in names:
        if not isinstance(name, str):
            continue
        path = Path(os.path.join(root, name)).resolve()
        if not path.is_relative_to(resolved_root):
            raise ValueError(f"{name!r} is outside the folder")
        named.add(path)
    return named


def _raise(error: OSError) -> None:
    raise error


def _file_digest(path: Path, num_bytes: int) -> bytes:
    """The SHA-256 of a file's first `num_bytes` (its size when it was listed; one grown since hashes differently
    by that size the next time)."""
    file_digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while num_bytes > 0 and (chunk := handle.read(min(_HASH_CHUNK_BYTES, num_bytes))):
            file_digest.update(chunk)
            num_bytes -= len(chunk)
    return file_digest.digest()


def describe_tokenizer(tokenizer: object) -> TokenizerNormalizer:
    """The normalizer of a tokenizer as `tokenizers` writes it (`Tokenizer.to_str()`, parsed): its `normalizer` and
    `pre_tokenizer`, and the first characters of its added tokens. Never raises."""
    try:
        if not isinstance(tokenizer, dict):
            raise _Unknown("a tokenizer that is not a JSON object")
        normalizing = _steps(tokenizer.get("normalizer"), 0)
        pre_tokenizing = _pre_tokenizer_steps(tokenizer.get("pre_tokenizer"), 0)
        added_tokens = tokenizer.get("added_tokens")
        # NOTE: an added token marked `normalized` is split out of the normalized text, before pre-tokenizing: a
        # pre-tokenizer's prepend is made to each piece after one too ("ax" x 190, "x" such a token, behind Metaspace
        # was 1,050 tokens against a bound of 470). Counted by its first character in the text as sent when nothing
        # normalizes it; else the prepend is made before every character.
        normalized_starts = _segment_starts(added_tokens, normalized=True)
        if normalized_starts and normalizing:
            pre_tokenizing = [
                NormalizerStep(kind="prepend_each", content=step.content) if step.kind == "prepend" else step
                for step in pre_tokenizing
            ]
        steps = normalizing + pre_tokenizing
        if len(steps) > MAX_NORMALIZER_STEPS:
            raise _Unknown(f"more than {MAX_NORMALIZER_STEPS} steps")
        starts = ""
        if any(step.kind == "prepend" for step in steps):
            starts = _segment_starts(added_tokens)
            if any(step.kind == "prepend" for step in pre_tokenizing):
                starts = "".join(sorted(set(starts + normalized_starts)))
                if len(starts) > MAX_SEGMENT_STARTS:
                    raise _Unknown("added tokens with too many first characters to count pieces by")
        return TokenizerNormalizer(
            steps=steps,
            segment_starts=starts,
            num_special_tokens=_special_tokens(tokenizer.get("post_processor"), 0),
        )
    except _Unknown as exc:
        return TokenizerNormalizer(unknown=str(exc))
    except (ValueError, RecursionError, TypeError, AttributeError):
        return TokenizerNormalizer(unknown="its tokenizer is not JSON as a tokenizer writes it")


def describe_normalizer(normalizer: object, pre_tokenizer: object = None) -> TokenizerNormalizer:
    """`describe_tokenizer` of a tokenizer's `normalizer` and `pre_tokenizer` values alone."""
    return describe_tokenizer({"normalizer": normalizer, "pre_tokenizer": pre_tokenizer})


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
    elif kind == "Precompiled":
        steps = _precompiled(normalizer)
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


def _pre_tokenizer_steps(
    pre_tokenizer: object, depth: int, split: list[bool] | None = None
) -> list[NormalizerStep]:
    """A pre-tokenizer's rewrites, after the normalizer's: `Metaspace` (newer conversions of Llama's and Mistral's
    SentencePiece tokenizers, T5's, XLM-R's) replaces each space by its `replacement` ("▁", 3 bytes) and prepends one
    unless its scheme is "never"; `ByteLevel` with `add_prefix_space` prepends a space; the others only split
    (`ByteLevel` maps each byte to one character, which its byte-level vocabulary counts as one byte).

    NOTE: a pre-tokenizer's prepend is made to each piece it is given: after a splitter earlier in a Sequence (`split`,
    `Digits` before `Metaspace`, a `Split` before a prefix-space `ByteLevel`) a piece may be one character, so such a
    prepend is reported as "prepend_each" (its content before every character). Before, one per text was counted:
    "0123456789" x 38 behind Digits and Metaspace was 1,623 tokens against a bound of 470."""
    split = [False] if split is None else split
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
            for step in _pre_tokenizer_steps(item, depth + 1, split)
        ]
    if kind == "Metaspace":
        replacement = _text(pre_tokenizer.get("replacement", "\u2581"), "Metaspace's replacement")
        scheme = pre_tokenizer.get(
            "prepend_scheme", "always" if pre_tokenizer.get("add_prefix_space", True) else "never"
        )
        if scheme not in ("always", "first", "never"):
            raise _Unknown("a Metaspace whose prepend_scheme is none of always, first, never")
        steps = [NormalizerStep(kind="replace", pattern=" ", content=replacement)]
        if scheme != "never":  # NOTE: "first" prepends to the text's first piece alone, however it was split
            prepend = "prepend_each" if split[0] and scheme == "always" else "prepend"
            steps.append(NormalizerStep(kind=prepend, content=replacement))
        split[0] = split[0] or pre_tokenizer.get("split", True) is not False
        return steps
    if kind == "ByteLevel":
        add_prefix_space = pre_tokenizer.get("add_prefix_space", True)
        if not isinstance(add_prefix_space, bool):
            raise _Unknown("a ByteLevel whose add_prefix_space is not true or false")
        steps = (
            [NormalizerStep(kind="prepend_each" if split[0] else "prepend", content=" ")]
            if add_prefix_space
            else []
        )
        split[0] = split[0] or pre_tokenizer.get("use_regex", True) is not False
        return steps
    if kind in _SPLITTING_PRE_TOKENIZERS:
        split[0] = True
        return []
    raise _Unknown(f"a pre-tokenizer of type {str(kind)[:40]!r}")


# Post-processors that hand on each encoding they are given as it came, adding nothing (`ByteLevel` trims offsets).
# Any other adds tokens (`TemplateProcessing`, `BertProcessing`, `RobertaProcessing`), and one at most may stand in a
# Sequence: `_special_tokens`.
_PASSING_POST_PROCESSORS = frozenset({"ByteLevel"})
# Adding processors of a fixed count (`TemplateProcessing` counts by its template).
_ADDING_POST_PROCESSORS = {"BertProcessing": 2, "RobertaProcessing": 2}


def _special_tokens(post_processor: object, depth: int) -> int:
    """The special tokens a post-processor adds to one sequence (`TemplateProcessing`'s `single`, each of its special
    tokens as many ids as it has; BERT's and RoBERTa's two), known for the shapes below alone.

    NOTE: in a Sequence, an adding processor hands the next one an encoding per piece of its template (`tokenizers`
    0.23), which a second adding processor takes as a pair: [`<s> $A`, then `$A` | pair `$A $B` x 20] made a 999-byte
    prompt 10,001 tokens against a bound of 1,007. Known: any number of `ByteLevel`s and one adding processor at most,
    nested or not; anything else is unknown."""
    processors = _post_processors(post_processor, depth)
    adding = [item for item in processors if item.get("type") not in _PASSING_POST_PROCESSORS]
    if len(adding) > 1:
        raise _Unknown("a post-processor Sequence of more than one processor that adds tokens")
    if not adding:
        return 0
    kind = adding[0].get("type")
    if kind == "TemplateProcessing":
        return _template_special_tokens(adding[0])
    if kind in _ADDING_POST_PROCESSORS:
        return _ADDING_POST_PROCESSORS[kind]
    raise _Unknown(f"a post-processor of type {str(kind)[:40]!r}")


def _post_processors(post_processor: object, depth: int) -> list[dict]:
    """A post-processor as the list of processors it runs in turn, Sequences flattened."""
    if post_processor is None:
        return []
    if not isinstance(post_processor, dict):
        raise _Unknown("a post-processor that is not an object")
    if post_processor.get("type") != "Sequence":
        return [post_processor]
    inner = post_processor.get("processors")
    if not isinstance(inner, list) or depth >= _SEQUENCE_DEPTH:
        raise _Unknown("a post-processor Sequence that is not a list, or nested too deep")
    return [item for each in inner for item in _post_processors(each, depth + 1)]


def _template_special_tokens(template: dict) -> int:
    """`TemplateProcessing`'s special tokens in `single`, when `single` names the text (`$A`) once at most and `pair`
    each text once at most.

    NOTE: `tokenizers` repeats a text its template names more than once, special tokens asked for or not (a chat's
    too): [`<s>`, `$A` x 20] made a 204-token bound 860 tokens in vLLM; and a `pair` is applied whenever the processor
    is handed two encodings."""
    special = template.get("special_tokens") or {}
    single, pair = template.get("single") or [], template.get("pair") or []
    if not isinstance(special, dict) or not isinstance(single, list) or not isinstance(pair, list):
        raise _Unknown("a TemplateProcessing that is not lists of pieces")
    if _texts(single) not in ([], ["A"]) or len(set(_texts(pair))) != len(_texts(pair)):
        raise _Unknown("a post-processor template that repeats the text")
    total = 0
    for piece in single:
        if "SpecialToken" in piece:
            ids = special.get(piece["SpecialToken"].get("id"), {}).get("ids")
            total += len(ids) if isinstance(ids, list) else 1
    return total


def _texts(template: list) -> list[str]:
    """The texts a template names (`$A`, `$B`), in order; unknown for a piece neither a text nor a special token."""
    texts = []
    for piece in template:
        if not isinstance(piece, dict) or len(piece) != 1 or not isinstance(next(iter(piece.values())), dict):
            raise _Unknown("a post-processor template piece that is not a text or a special token")
        if "Sequence" in piece:
            texts.append(piece["Sequence"].get("id"))
        elif "SpecialToken" not in piece:
            raise _Unknown("a post-processor template piece that is not a text or a special token")
    return texts


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


def _precompiled(normalizer: dict) -> list[NormalizerStep]:
    """A SentencePiece character map (T5's, XLM-R's) as steps, when it is one of sentencepiece's own."""
    charsmap = normalizer.get("precompiled_charsmap")
    try:
        digest = hashlib.sha256(base64.b64decode(charsmap or "", validate=True)).hexdigest()
    except (ValueError, TypeError):
        raise _Unknown("a Precompiled character map that is not base64") from None
    if digest not in _PRECOMPILED_MAPS:
        raise _Unknown(
            "a Precompiled character map that is none of sentencepiece's nmt_nfkc, nmt_nfkc_cf, identity"
        )
    name, kinds = _PRECOMPILED_MAPS[digest]
    steps = [NormalizerStep(kind=kind) for kind in kinds]
    if name != "identity":
        steps += [NormalizerStep(kind="shortens"), NormalizerStep(kind="spaces", pattern=_NMT_SPACES)]
    return steps


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
    steps = (
        [NormalizerStep(kind="shortens"), NormalizerStep(kind="spaces", pattern=_WHITESPACE)]
        if flags["clean_text"]
        else []
    )
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


def _segment_starts(added_tokens: object, *, normalized: bool = False) -> str:
    """The first characters of the added tokens the tokenizer splits out of the raw text (those not `normalized`):
    the normalizer runs on each piece between them; with `normalized`, of those split out of the normalized text."""
    if added_tokens is None:
        return ""
    if not isinstance(added_tokens, list):
        raise _Unknown("added_tokens is not a list")
    starts = set()
    for token in added_tokens:
        if not isinstance(token, dict) or not isinstance(token.get("content"), str):
            raise _Unknown("an added token without content")
        if token["content"] and (token.get("normalized") is True) == normalized:
            _require_utf8(token["content"][0], "an added token's first character")
            starts.add(token["content"][0])
        if len(starts) > MAX_SEGMENT_STARTS:
            raise _Unknown("added tokens with too many first characters to count pieces by")
    return "".join(sorted(starts))


def _loads_through_mistral_common(model_dir: Path) -> bool:
    """Whether vLLM (`--tokenizer-mode auto`, as engines run) loads the folder's tokenizer through mistral_common: a
    `consolidated*.safetensors` and a `tekken.json` or `tokenizer.model.v*` anywhere in it
    (`vllm.tokenizers.registry.resolve_tokenizer_args`)."""
    names = [path.name for path in model_dir.rglob("*") if path.is_file()]
    return any(fnmatch.fnmatch(name, "consolidated*.safetensors") for name in names) and any(
        name == "tekken.json" or fnmatch.fnmatch(name, "tokenizer.model.v*") for name in names
    )


def _mistral_tokenizer(model_dir: Path) -> dict:
    """The tokenizer mistral_common loads from the folder (the file it picks of those at its top: `tekken.json`, else
    the last SentencePiece model by name), as a tokenizer.json would describe it: Tekken is byte-level BPE with no
    normalizer (nothing to add); a SentencePiece model is its own `normalizer_spec` (its character map as a
    `Precompiled` normalizer, so a tenant's own is unknown; its dummy prefix and escaped spaces as Llama's `Prepend`
    and `Replace` of "\u2581")."""
    from mistral_common.tokens.tokenizers.utils import get_one_valid_tokenizer_file
    from sentencepiece import sentencepiece_model_pb2

    chosen = model_dir / get_one_valid_tokenizer_file(os.listdir(model_dir))
    if chosen.name == "tekken.json":
        return {}
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(chosen.read_bytes())
    spec = model.normalizer_spec
    steps: list[dict] = [
        {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(spec.precompiled_charsmap).decode()}
    ]
    if spec.remove_extra_whitespaces:
        steps.append({"type": "Strip"})
    if spec.add_dummy_prefix:
        steps.append({"type": "Prepend", "prepend": "\u2581"})
    if spec.escape_whitespaces:
        steps.append({"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"})
    return {"normalizer": {"type": "Sequence", "normalizers": steps}}


def _load_tokenizer(model_dir: Path) -> dict:
    """The child's work: the tokenizer the engine would load from `model_dir`, as `tokenizers` writes it.

    NOTE: vLLM loads a Mistral-format folder's tokenizer through mistral_common, not transformers: described from
    its own file (`_mistral_tokenizer`). Before, its tokenizer.json was: a tenant's SentencePiece model mapping a space
    to 40 x "\u2581" beside an empty consolidated.safetensors made a 40-byte chat 784 tokens in vLLM's tokenizer."""
    if _loads_through_mistral_common(model_dir):
        return _mistral_tokenizer(model_dir)
    try:
        from transformers import AutoTokenizer
    except ImportError:  # an agent without the engine
        return _load_tokenizer_file(model_dir)
    # NOTE: as vLLM's `get_tokenizer` calls it: no remote code, the folder alone.
    tokenizer = AutoTokenizer.from_pretrained(
        os.fspath(model_dir), trust_remote_code=False, local_files_only=True
    )
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise _Unknown(f"the engine's tokenizer ({type(tokenizer).__name__[:60]}) is not a fast one")
    return json.loads(backend.to_str())


def _load_tokenizer_file(model_dir: Path) -> dict:
    """The file transformers would read, where it can be told which without transformers."""
    from tokenizers import Tokenizer

    config_path = model_dir / "tokenizer_config.json"
    if config_path.exists() and "fast_tokenizer_files" in json.loads(config_path.read_text(encoding="utf-8")):
        raise _Unknown("its tokenizer_config.json names fast_tokenizer_files (transformers picks among them)")
    return json.loads(Tokenizer.from_file(os.fspath(model_dir / "tokenizer.json")).to_str())


def _main(model_dir: str, cpu_s: int, memory_bytes: int) -> None:
    """The child: limit itself, load, describe, print one line of JSON."""
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        described = describe_tokenizer(_load_tokenizer(Path(model_dir)))
    except _Unknown as exc:
        described = TokenizerNormalizer(unknown=str(exc))
    except Exception as exc:  # noqa: BLE001 - NOTE: whatever the tenant's files make the libraries raise
        described = TokenizerNormalizer(unknown=f"its tokenizer does not load ({type(exc).__name__})")
    sys.stdout.write(json.dumps(described.to_dict()))  # NOTE: ASCII: a lone surrogate stays escaped


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
