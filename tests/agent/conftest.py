"""Fixtures for the standalone agent runtime. Nothing here touches Django's database."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from gpu_agent.protocol import ReplicaSpec, ReplicaState
from gpu_agent.runtime import engine_disk
from gpu_agent.runtime.engine import EngineCommand
from gpu_agent.runtime.engine_guard import ENGINE_API_KEY_ENV
from gpu_agent.runtime.reaper import REAPER_MODULE

from .tokenizer_loader_fork_server import LoaderForks

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from gpu_agent.runtime.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def tokenizer_not_described(monkeypatch):
    """A model's reading without its tokenizer's description: that is a child of its own (transformers' import, ~4.5 s
    of CPU for each new folder), bounded by test_tokenizer_normalizer.py, for the tests whose claims lie elsewhere."""
    from gpu_agent.runtime import model_info

    monkeypatch.setattr(model_info, "read_tokenizer_normalizer", lambda model_dir: None)


@pytest.fixture(scope="module")
def loader_forks(tmp_path_factory):
    """`subprocess.run` for the tokenizer loader's command through a fork server
    (`tests.agent.tokenizer_loader_fork_server`): the module's loader children without transformers' import each."""
    forks = LoaderForks(tmp_path_factory.mktemp("loader-forks"))
    yield forks
    forks.close()


def write_json_of_empty_objects(path: Path, fields: dict, num_bytes: int = 30 * 1024 * 1024) -> None:
    """`fields` and a list of empty objects, `num_bytes` of JSON in all: what a tenant may write in its model's
    metadata files. Parsed whole it takes ~25 times its size (~760 MB for these 30 MB)."""
    head = json.dumps(fields)[:-1] + ', "x": ['
    path.write_text(head + "{}," * ((num_bytes - len(head)) // 3) + "{}]}")


def cpu_used_s() -> float:
    """The CPU seconds this process (all its threads) and the children it waited for have used so far.

    NOTE: for a bound on work, not on waiting: a loaded machine stretches the wall clock's time of the same work
    (CI's 2 cores saw a 1 s bound on a header's refusal missed), never its CPU time."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def with_peak_memory(call):
    """`call()`'s result and the most memory Python held while it ran, in bytes."""
    tracemalloc.start()
    try:
        return call(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def make_spec(replica_id: str = "r-1", **overrides) -> ReplicaSpec:
    values = {
        "replica_id": replica_id,
        "endpoint_id": "e-1",
        "served_model_name": "tiny",
        "model_source": "/nonexistent",
        "max_model_len": 512,
        "max_num_seqs": 32,
        "drain_timeout_s": 30.0,
        "engine_api_key": f"engine-key-of-{replica_id}",
    }
    values.update(overrides)
    return ReplicaSpec(**values)


def fake_engine_factory(*extra_args: str, under_reaper: bool = False, max_model_len: int | None = None):
    """A command factory for Supervisor/Agent that launches tests/agent/fake_engine.py (under the reaper, as
    every vLLM engine is, if `under_reaper`), its command saying it was launched with `max_model_len` (as
    `engine.build_engine_command`'s do) when one is given."""

    def factory(spec: ReplicaSpec, model_path: Path, port: int) -> EngineCommand:
        argv = [
            *([sys.executable, "-m", REAPER_MODULE, "--"] if under_reaper else []),
            sys.executable,
            str(FAKE_ENGINE),
            "--port",
            str(port),
            "--served-model-name",
            spec.served_model_name,
        ]
        return EngineCommand(
            argv=[*argv, *extra_args], port=port, env={ENGINE_API_KEY_ENV: spec.engine_api_key},
            max_model_len=max_model_len,
        )

    return factory


def wait_until(predicate, timeout_s: float, step_s: float = 0.1, poll=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if poll is not None:
            poll()
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    raise AssertionError(f"condition not met within {timeout_s}s")


def wait_for_state(supervisor, replica_id: str, state, timeout_s: float = 300, step_s: float = 0.2) -> None:
    """Poll the supervisor until the replica reaches `state`; a FAILED replica fails at once, with its reason."""

    def reached():
        replica = supervisor.get(replica_id)
        if replica.state == ReplicaState.FAILED and state != ReplicaState.FAILED:
            raise AssertionError(f"{replica_id} FAILED: {replica.failure_reason}")
        return replica.state == state

    wait_until(reached, timeout_s, step_s=step_s, poll=supervisor.poll)


def processes_with_marker(replica_id: str) -> list[psutil.Process]:
    """Live processes of this test's replica: its marker, and not started from another pytest-xdist worker
    (an engine inherits the agent's environment), whose replica of the same name must never count."""
    found = []
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    for process in psutil.process_iter(["pid"]):
        try:
            environ = process.environ()
            if (
                environ.get("INFERPLANE_REPLICA_ID") == replica_id
                and environ.get("PYTEST_XDIST_WORKER", worker) == worker
                and process.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


class UnsettledRuns:
    """The runs of unsettled measures in a row (`engine_disk.DiskUsage.settled`) among those given: how long each
    lasted, and how many measures."""

    def __init__(self) -> None:
        self.runs: list[tuple[float, int]] = []
        self.num_measures = 0
        self.last: engine_disk.DiskUsage | None = None
        self.since: float | None = None
        self.count = 0

    def add(self, usage: engine_disk.DiskUsage) -> None:
        self.num_measures += 1
        self.last = usage
        if not usage.settled:
            self.since, self.count = self.since or time.monotonic(), self.count + 1
        else:
            self.close()

    def close(self) -> None:
        if self.since is not None:
            self.runs.append((time.monotonic() - self.since, self.count))
        self.since, self.count = None, 0

    def longest(self) -> tuple[float, int]:
        self.close()
        return max(self.runs, default=(0.0, 0))


@contextmanager
def measuring_folders(folders, every_s: float = 0.2) -> Iterator[UnsettledRuns]:
    """Measure `folders()` (the folders as they are now: `engine_disk.measure`) every `every_s` on a thread of its own
    while the block runs, as `Supervisor.check_disk` does; the runs of unsettled measures among them. A measure that
    raised is raised again when the block ends."""
    runs, stop, errors = UnsettledRuns(), threading.Event(), []

    def measure():
        while not stop.is_set():
            try:
                runs.add(engine_disk.measure(folders()))
            except Exception as error:  # noqa: BLE001 - raised again on the test's thread
                errors.append(error)
                return
            stop.wait(every_s)

    thread = threading.Thread(target=measure, daemon=True)
    thread.start()
    try:
        yield runs
    finally:
        stop.set()
        thread.join(30)
    if errors:
        raise errors[0]


@pytest.fixture(autouse=True)
def _clean_redis():
    """Overrides the project-wide Redis flush: the agent runtime uses no Redis (and no database)."""
    yield


@pytest.fixture(autouse=True)
def _no_stray_env(monkeypatch):
    # A developer's AWS settings must not leak into the S3 tests.
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    # The tests' tenant stores are moto on loopback (`tests/agent/test_weights_credentials.py` checks the refusal).
    monkeypatch.setenv("INFERPLANE_AGENT_ALLOW_PRIVATE_STORES", "1")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


def sentencepiece_charsmap(rule: str = "nmt_nfkc", rules_tsv: str = "") -> str:
    """The base64 `precompiled_charsmap` sentencepiece builds for its builtin normalization `rule`, or for a rules
    file of one's own (`rules_tsv`: "source code points<TAB>target code points" lines), as a tokenizer.json holds it."""
    import base64
    import tempfile

    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2

    with tempfile.TemporaryDirectory() as work:
        corpus = Path(work) / "corpus.txt"
        corpus.write_text("\n".join(["hello world this is a test of things"] * 200))
        options = {"normalization_rule_name": rule}
        if rules_tsv:
            (Path(work) / "rules.tsv").write_text(rules_tsv)
            options = {"normalization_rule_tsv": str(Path(work) / "rules.tsv")}
        sentencepiece.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(Path(work) / "m"),
            vocab_size=20,
            hard_vocab_limit=False,
            minloglevel=2,
            **options,
        )
        model = sentencepiece_model_pb2.ModelProto()
        model.ParseFromString((Path(work) / "m.model").read_bytes())
    return base64.b64encode(model.normalizer_spec.precompiled_charsmap).decode()


def bytes_read_by_this_process() -> int:
    """What this process has read so far, from files or anything else (`rchar` of /proc/self/io)."""
    return int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0])
