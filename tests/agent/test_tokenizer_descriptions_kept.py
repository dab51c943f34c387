"""The agent describes a tokenizer's files once per content: the loader child (transformers' import, ~4.5 s of CPU) is
started again only for files it has not described, and a description is never handed to other files
(`gpu_agent.runtime.tokenizer_normalizer._content_key`).

The child is the agent's: its command, run by `tests.agent.tokenizer_loader_fork_server` in a process forked from one that
imported transformers (~4.5 s of CPU saved at each of ~20 starts); the tests count its starts by wrapping
`subprocess.run`, which still runs it. The agents of the upgrade tests below start the loader as the agent does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from gpu_agent.protocol import NormalizerStep, TokenizerNormalizer
from gpu_agent.runtime import tokenizer_normalizer
from gpu_agent.runtime.tokenizer_normalizer import read_tokenizer_normalizer

from .conftest import bytes_read_by_this_process

HOSTILE_REPLACE = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581" * 9}


@pytest.fixture(scope="module")
def tiny_models_answers(tiny_model_dir, loader_forks) -> OrderedDict:
    """What the agent keeps once it has described the tiny model's files (one child, shared by this module's tests)."""
    kept = OrderedDict()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(tokenizer_normalizer, "_remembered", kept, raising=False)
        monkeypatch.setattr(tokenizer_normalizer.subprocess, "run", loader_forks.run)
        read_tokenizer_normalizer(tiny_model_dir)
    return kept


@pytest.fixture
def loader_starts(monkeypatch, tiny_models_answers, loader_forks) -> list[str]:
    """The folders the loader child is started for, by an agent that has described the tiny model's files alone."""
    monkeypatch.setattr(tokenizer_normalizer, "_remembered", OrderedDict(tiny_models_answers), raising=False)
    starts = []
    real_run = loader_forks.run

    def counting_run(command, *args, **kwargs):
        starts.append(command[5])  # [python, -E, -s, -m, module, folder, ...]
        return real_run(command, *args, **kwargs)

    monkeypatch.setattr(tokenizer_normalizer.subprocess, "run", counting_run)
    return starts


def _copy(tiny_model_dir: Path, folder: Path) -> Path:
    shutil.copytree(tiny_model_dir, folder)
    return folder


def _with_normalizer(model_dir: Path, normalizer, file_name: str = "tokenizer.json") -> Path:
    path = model_dir / file_name
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    path.write_text(json.dumps(tokenizer | {"normalizer": normalizer}))
    return model_dir


def test_the_same_files_in_another_folder_are_described_without_starting_the_loader_again(
    tiny_model_dir, tmp_path, loader_starts
):
    described = read_tokenizer_normalizer(_copy(tiny_model_dir, tmp_path / "another-tenant"))

    assert described == TokenizerNormalizer(num_special_tokens=1)
    assert loader_starts == []


def test_a_file_removed_is_described_again(tiny_model_dir, tmp_path, loader_starts):
    # Without tokenizer.json the loader would convert a SentencePiece model (none here): unknown.
    model_dir = _copy(tiny_model_dir, tmp_path / "model")
    (model_dir / "tokenizer.json").unlink()

    assert read_tokenizer_normalizer(model_dir).unknown
    assert len(loader_starts) == 1


def test_a_changed_tokenizer_file_is_described_again_and_two_tenants_never_share_a_description(
    tiny_model_dir, tmp_path, loader_starts
):
    plain = _copy(tiny_model_dir, tmp_path / "tenant-a")
    lengthening = _with_normalizer(_copy(tiny_model_dir, tmp_path / "tenant-b"), HOSTILE_REPLACE)

    readings = [read_tokenizer_normalizer(folder) for folder in (plain, lengthening, plain, lengthening)]

    assert readings[0] == readings[2] == TokenizerNormalizer(num_special_tokens=1)
    hostile = [NormalizerStep(kind="replace", pattern=" ", content="\u2581" * 9)]
    assert readings[1].steps == readings[3].steps == hostile
    assert len(loader_starts) == 1


def test_weights_changed_alone_are_not_described_again(tiny_model_dir, tmp_path, loader_starts):
    model_dir = _copy(tiny_model_dir, tmp_path / "model")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(bytes(weights.stat().st_size))  # same size, other bytes: no tokenizer reads them

    assert read_tokenizer_normalizer(model_dir) == TokenizerNormalizer(num_special_tokens=1)
    assert loader_starts == []


@pytest.mark.parametrize(
    "versioned",
    [
        "tokenizer.4.0.0.json.safetensors",
        "tokenizer.4.0.json/model.safetensors",
        "tokenizer.4.0.json/../extra.bin",
    ],
)
def test_a_tokenizer_file_named_like_weights_is_hashed_by_its_content(
    tiny_model_dir, tmp_path, loader_starts, versioned
):
    # transformers picks a versioned file from fast_tokenizer_files (its whole name searched: a folder's name counts):
    # a file of the same size with another normalizer (NFD and NFC, one byte apart) must be described again, not taken
    # as weights. A review found the subfolder's file hashed by its size (a hostile Replace described as none).
    model_dir = _copy(tiny_model_dir, tmp_path / "model")
    (model_dir / "tokenizer.4.0.json").mkdir(exist_ok=True)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(config | {"fast_tokenizer_files": [versioned]})
    )
    _with_normalizer(model_dir, {"type": "NFD"}, versioned)
    assert read_tokenizer_normalizer(model_dir).steps == [NormalizerStep(kind="decompose")]

    _with_normalizer(model_dir, {"type": "NFC"}, versioned)

    assert read_tokenizer_normalizer(model_dir).steps == [NormalizerStep(kind="compose")]
    assert len(loader_starts) == 2


def test_a_folder_with_a_link_to_a_folder_is_described_at_each_reading(
    tiny_model_dir, tmp_path, loader_starts
):
    # The walk does not follow a link to a folder, the loader would: its files are not in the key, so nothing is kept.
    model_dir = _copy(tiny_model_dir, tmp_path / "model")
    (model_dir / "real").mkdir()
    (model_dir / "tokenizer.4.0.json").symlink_to("real", target_is_directory=True)

    read_tokenizer_normalizer(model_dir)
    read_tokenizer_normalizer(model_dir)

    assert len(loader_starts) == 2


def test_a_loader_that_gave_no_answer_is_started_again_next_time(
    tiny_model_dir, tmp_path, loader_starts, monkeypatch
):
    model_dir = _with_normalizer(_copy(tiny_model_dir, tmp_path / "model"), {"type": "NFKC"})
    monkeypatch.setattr(tokenizer_normalizer, "LOADER_TIMEOUT_S", 0.001)
    assert "took more than" in read_tokenizer_normalizer(model_dir).unknown

    monkeypatch.setattr(tokenizer_normalizer, "LOADER_TIMEOUT_S", 180)

    assert read_tokenizer_normalizer(model_dir).steps == [NormalizerStep(kind="compose")]
    assert len(loader_starts) == 2


def test_files_changed_while_the_loader_read_them_are_not_kept(tiny_model_dir, tmp_path, monkeypatch, loader_forks):
    # The answer was of the files before the change, or after, or of a mix: kept under neither content.
    monkeypatch.setattr(tokenizer_normalizer, "_remembered", OrderedDict(), raising=False)
    model_dir = _with_normalizer(_copy(tiny_model_dir, tmp_path / "model"), {"type": "NFKC"})
    starts = []
    real_run = loader_forks.run

    def run_then_change_the_files(command, *args, **kwargs):
        starts.append(command)
        finished = real_run(command, *args, **kwargs)
        if len(starts) == 1:
            _with_normalizer(model_dir, {"type": "NFD"})
        return finished

    monkeypatch.setattr(tokenizer_normalizer.subprocess, "run", run_then_change_the_files)
    assert read_tokenizer_normalizer(model_dir).steps == [NormalizerStep(kind="compose")]

    assert read_tokenizer_normalizer(model_dir).steps == [NormalizerStep(kind="decompose")]
    assert len(starts) == 2


def test_a_folder_past_the_bytes_the_agent_hashes_is_described_by_the_loader_at_each_reading(
    tiny_model_dir, tmp_path, loader_starts, monkeypatch
):
    monkeypatch.setattr(
        tokenizer_normalizer, "MAX_HASHED_BYTES", 1000
    )  # the tiny model's tokenizer.json is 55 kB

    described = read_tokenizer_normalizer(_copy(tiny_model_dir, tmp_path / "model"))

    assert described == TokenizerNormalizer(num_special_tokens=1)
    assert len(loader_starts) == 1


def test_a_fifo_in_the_folder_is_never_opened_by_the_agent(
    tiny_model_dir, tmp_path, loader_starts, monkeypatch
):
    # Opening a FIFO for reading waits for a writer: the loader child waits within its wall time; the agent never.
    model_dir = _copy(tiny_model_dir, tmp_path / "model")
    (model_dir / "tokenizer.json").unlink()
    os.mkfifo(model_dir / "tokenizer.json")
    monkeypatch.setattr(tokenizer_normalizer, "LOADER_TIMEOUT_S", 1)

    assert read_tokenizer_normalizer(model_dir).unknown
    assert len(loader_starts) == 1


# An agent whose package is replaced under it (upgraded in place): reads the folder, has its describer changed on
# disk (the child's load replaced by a fixed answer), reads the same folder again.
UPGRADED_IN_PLACE = """
import sys
from pathlib import Path
from gpu_agent.runtime.tokenizer_normalizer import read_tokenizer_normalizer
describer = Path("gpu_agent/runtime/tokenizer_normalizer.py")
print(read_tokenizer_normalizer(sys.argv[1]).unknown or "described")
source = describer.read_text()
loading = "described = describe_tokenizer(_load_tokenizer(Path(model_dir)))"
assert loading in source
describer.write_text(source.replace(loading, 'described = TokenizerNormalizer(unknown="the fixed describer")'))
print(read_tokenizer_normalizer(sys.argv[1]).unknown or "described")
"""


def test_an_agent_upgraded_in_place_describes_a_folder_it_described_before_with_its_new_describer(
    tiny_model_dir, tmp_path
):
    # Before: the memo's key left out the agent's own code, so the old description was served for good.
    agent_root = tmp_path / "agent"
    package = Path(tokenizer_normalizer.__file__).resolve().parents[1]
    shutil.copytree(package, agent_root / "gpu_agent", ignore=shutil.ignore_patterns("__pycache__"))

    agent = subprocess.run(  # noqa: S603 - our own interpreter and a script of this test
        [sys.executable, "-E", "-s", "-c", UPGRADED_IN_PLACE, os.fspath(tiny_model_dir)],
        cwd=agent_root,
        capture_output=True,
        text=True,
        timeout=600,
    )

    assert agent.returncode == 0, agent.stderr[-2000:]
    assert agent.stdout.split("\n")[:2] == ["described", "the fixed describer"]


def test_a_describer_file_rewritten_in_place_at_its_size_and_modification_time_changes_the_key(
    tmp_path, monkeypatch
):
    # As `cp -p` or `rsync --inplace -t` of a reproducible build does (fixed modification times): before, the size,
    # modification time and inode were the same, and the old describer's digest was kept until the agent restarted.
    root = tmp_path / "agent"
    for name in tokenizer_normalizer.DESCRIBER_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer_normalizer._package_root() / name, root / name)
    monkeypatch.setattr(tokenizer_normalizer, "_describer", None)
    before = tokenizer_normalizer._describer_digest(root)
    describer = root / "gpu_agent/runtime/tokenizer_normalizer.py"
    status = describer.stat()
    source = describer.read_bytes()
    fixed = source.replace(b"MAX_REMEMBERED_ANSWERS = 256", b"MAX_REMEMBERED_ANSWERS = 257", 1)
    assert fixed != source and len(fixed) == len(source)
    tick = tmp_path / "tick"
    while tick.touch() or tick.stat().st_ctime_ns == status.st_ctime_ns:
        pass  # NOTE: the file system's clock past the copy's change time, as any later upgrade is

    with open(describer, "r+b") as file:
        file.write(fixed)
    os.utime(describer, ns=(status.st_atime_ns, status.st_mtime_ns))

    rewritten = describer.stat()
    assert (rewritten.st_size, rewritten.st_mtime_ns, rewritten.st_ino) == (
        status.st_size,
        status.st_mtime_ns,
        status.st_ino,
    )
    assert tokenizer_normalizer._describer_digest(root) != before


# An agent installed as releases behind a link (`current -> v1`) flips the link to a new release and removes the old one
# before it is restarted; then it reads a folder it never described.
RELEASE_FLIPPED = """
import os, shutil, sys
from pathlib import Path
releases = Path(sys.argv[1])
sys.path.insert(0, os.fspath(releases / "current"))
from gpu_agent.runtime.tokenizer_normalizer import read_tokenizer_normalizer
os.symlink("v2", releases / "next")
os.replace(releases / "next", releases / "current")
shutil.rmtree(releases / "v1")
print(read_tokenizer_normalizer(sys.argv[2]).unknown or "described")
"""


def test_an_agent_whose_release_link_was_flipped_describes_with_the_new_release(tiny_model_dir, tmp_path):
    # Before: the package's folder was resolved once, at import: the child started in the removed release
    # ("the tokenizer loader could not start") for every new folder until the agent restarted.
    releases = tmp_path / "releases"
    package = tokenizer_normalizer._package_root() / "gpu_agent"
    for release in ("v1", "v2"):
        shutil.copytree(
            package, releases / release / "gpu_agent", ignore=shutil.ignore_patterns("__pycache__")
        )
    (releases / "current").symlink_to("v1")

    agent = subprocess.run(  # noqa: S603 - our own interpreter and a script of this test
        [sys.executable, "-E", "-s", "-c", RELEASE_FLIPPED, os.fspath(releases), os.fspath(tiny_model_dir)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )

    assert agent.returncode == 0, agent.stderr[-2000:]
    assert agent.stdout.strip() == "described"


def test_the_describers_source_in_the_key_is_every_agent_module_the_loader_child_imports():
    imported = subprocess.run(  # noqa: S603 - our own interpreter
        [
            sys.executable,
            "-E",
            "-s",
            "-c",
            "import sys, runpy; sys.argv = ['child']; "
            "runpy.run_module('gpu_agent.runtime.tokenizer_normalizer', run_name='child'); "
            "print(' '.join(sys.modules[name].__file__ for name in sys.modules if name.startswith('gpu_agent')))",
        ],
        cwd=tokenizer_normalizer._package_root(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )

    root = tokenizer_normalizer._package_root()
    files = {os.fspath(Path(name).resolve().relative_to(root)) for name in imported.stdout.split()}
    assert files | {"gpu_agent/runtime/tokenizer_normalizer.py"} == set(tokenizer_normalizer.DESCRIBER_FILES)


# What hashing a folder (`_content_key`) may take of the agent's memory: far more than 4 MiB of JSON parses, far less
# than the tens of times its size that parsing a tenant's 48 MiB `tokenizer_config.json` took (1.26 GB, 1.3 s of the
# GIL, twice a reading).
AGENT_HASHING_MEMORY_BYTES = 768 * 1024**2
_HASH_WITHIN_A_MEMORY_LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
from gpu_agent.runtime import tokenizer_normalizer
print(tokenizer_normalizer._content_key(sys.argv[1]))
"""


def _hashed_within_the_agents_memory(model_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            _HASH_WITHIN_A_MEMORY_LIMIT,
            os.fspath(model_dir),
            str(AGENT_HASHING_MEMORY_BYTES),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(tokenizer_normalizer.__file__).resolve().parents[2],
    )


def _big_tokenizer_config(model_dir: Path, *, fast_tokenizer_files: bool = False) -> Path:
    """A tokenizer_config.json of 48 MiB of empty objects (`added_tokens_decoder` grows a real one past 4 MiB)."""
    named = '"fast_tokenizer_files": ["tokenizer.json"], ' if fast_tokenizer_files else ""
    with open(model_dir / "tokenizer_config.json", "w") as handle:
        handle.write("{" + named + '"model_max_length": 2048, "padding": [' + "{}," * (16 * 1024**2) + "{}]}")
    return model_dir


def test_a_tokenizer_config_past_the_json_bound_is_never_parsed_by_the_agent_and_its_folder_is_not_keyed(
    tiny_model_dir, tmp_path
):
    """Before, the agent parsed the whole file to find `fast_tokenizer_files` (any size the weights budget allows):
    its memory past the limit here, a MemoryError, and the model refused as unreadable. Which files it names cannot be
    known unparsed (a scan of its bytes missed an escaped key): described by the loader child at each reading."""
    model_dir = _big_tokenizer_config(_copy(tiny_model_dir, tmp_path / "model"))

    hashed = _hashed_within_the_agents_memory(model_dir)

    assert hashed.returncode == 0, hashed.stderr[-2000:]
    assert hashed.stdout.strip() == "None"


def _naming_weights_as_its_tokenizer(model_dir: Path, normalizer, *, key: str) -> Path:
    """A folder whose tokenizer_config.json, past the JSON bound, names `tokenizer.1.json/../model.bin` (a weight-named
    file of the same size in every such folder) as its fast tokenizer file, the field's name spelled as `key`."""
    tokenizer = json.dumps(
        json.loads((model_dir / "tokenizer.json").read_text()) | {"normalizer": normalizer}
    )
    (model_dir / "model.bin").write_text(tokenizer + " " * (400_000 - len(tokenizer)))
    (model_dir / "tokenizer.1.json").mkdir()
    config = json.dumps(json.loads((model_dir / "tokenizer_config.json").read_text()))
    padding = '"x_padding": "' + "a" * (5 * 1024**2) + '"'
    (model_dir / "tokenizer_config.json").write_text(
        config[:-1] + f', {key}: ["tokenizer.1.json/../model.bin"], {padding}}}'
    )
    return model_dir


def test_two_folders_naming_different_tokenizers_under_an_escaped_key_never_share_a_description(
    tiny_model_dir, tmp_path, loader_starts
):
    """JSON may escape any character of a key, and the loader decodes `"fast\\u005ftokenizer_files"` to the field:
    a scan of the file's bytes for the field's name missed it, so both folders were keyed by model.bin's size alone,
    and the second was handed the first's description (a tenant chose its prompt bound and token counts)."""
    escaped = r'"fast\u005ftokenizer_files"'
    lowercase = _naming_weights_as_its_tokenizer(
        _copy(tiny_model_dir, tmp_path / "a"), {"type": "Lowercase"}, key=escaped
    )
    composed = _naming_weights_as_its_tokenizer(
        _copy(tiny_model_dir, tmp_path / "b"), {"type": "NFKC"}, key=escaped
    )

    assert read_tokenizer_normalizer(lowercase).steps == [NormalizerStep(kind="lowercase")]
    assert read_tokenizer_normalizer(composed).steps == [NormalizerStep(kind="compose")]
    assert tokenizer_normalizer._content_key(lowercase) is None


def test_a_tokenizer_config_past_the_scanned_bound_is_given_no_key_without_being_read(
    tiny_model_dir, tmp_path
):
    """Before, it was scanned to its end for the field's name (4 GiB, sparse: 58 s) to be given no key anyway."""
    model_dir = _copy(tiny_model_dir, tmp_path / "model")
    size = tokenizer_normalizer.MAX_HASHED_BYTES + 1024**2
    os.truncate(model_dir / "tokenizer_config.json", size)  # sparse: no disk, and no key written in it

    bytes_read_before = bytes_read_by_this_process()
    assert tokenizer_normalizer._content_key(model_dir) is None
    assert bytes_read_by_this_process() - bytes_read_before < 64 * 1024**2


def test_a_tokenizer_config_past_the_json_bound_that_names_tokenizer_files_is_not_keyed(
    tiny_model_dir, tmp_path
):
    """Which files it names cannot be known without parsing it: described by the loader child at each reading (and
    refused before that by `model_info.refuse_paths_outside_model`)."""
    model_dir = _big_tokenizer_config(_copy(tiny_model_dir, tmp_path / "model"), fast_tokenizer_files=True)

    hashed = _hashed_within_the_agents_memory(model_dir)

    assert hashed.returncode == 0, hashed.stderr[-2000:]
    assert hashed.stdout.strip() == "None"


def test_a_tokenizer_config_nested_past_the_parsers_depth_is_keyed_as_json_that_names_nothing(
    tiny_model_dir, tmp_path
):
    """As a file that is not JSON: the loader cannot read it either. Before, its RecursionError left the reading."""
    model_dir = _copy(tiny_model_dir, tmp_path / "model")
    (model_dir / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)

    assert len(tokenizer_normalizer._content_key(model_dir)) == 64
