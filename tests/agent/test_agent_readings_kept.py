"""What an agent read of its node that a restart must not forget is kept in its state file (`state_file.StateFile`): a
refusal of namespaces the kernel confirmed (`sandbox.NamespacesFact`), and the back-offs of safetensors readings that
gave no answer (`WeightsCache`). Before, a restarted agent re-learnt both: the refusal tested again at first use, and
every back-off back at its first step. A state file the agent did not write, a corrupt one, or readings of another boot
of the node are trusted for nothing, with a log line.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_agent.runtime import namespaces, safetensors_headers, sandbox, state_file
from gpu_agent.runtime.agent import Agent
from gpu_agent.runtime.config import AgentConfig

from .conftest import fake_engine_factory, wait_until
from .test_safetensors_header_cost import many_tensors_header, readers_answering, write_model

NAMESPACES_MISSING = namespaces.find().missing

# The first agent, on a node whose kernel refuses user namespaces (its own user namespace may make none): it finds
# them refused, and exits.
FIRST_AGENT = """
import json, sys
from gpu_agent.runtime import sandbox
from gpu_agent.runtime.agent import Agent
from gpu_agent.runtime.config import AgentConfig
sandbox.NAMESPACES.attempt_pause_s = 0
agent = Agent(AgentConfig("http://127.0.0.1:9", "token", sys.argv[1], force_cpu=True))
print(json.dumps(sandbox.namespaces_missing()))
agent.shutdown()
"""


@pytest.fixture
def fact(monkeypatch):
    """This agent's fact of namespaces, not tested yet; and the tests of namespaces it runs (their number)."""
    fresh = sandbox.NamespacesFact(attempt_pause_s=0)
    monkeypatch.setattr(sandbox, "NAMESPACES", fresh)
    real, calls = namespaces.find, []

    def counted():
        calls.append(1)
        return real()

    monkeypatch.setattr(namespaces, "find", counted)
    fresh.calls = calls
    return fresh


@pytest.fixture
def make_agent():
    made = []

    def make(data_dir: Path) -> Agent:
        made.append(Agent(AgentConfig("http://127.0.0.1:9", "token", data_dir, force_cpu=True),
                          command_factory=fake_engine_factory()))  # fmt: skip
        return made[-1]

    yield make
    for agent in made:
        agent.shutdown()


def refused_by_a_first_agent(data_dir: Path) -> str:
    """Run a first agent on `data_dir` where the kernel refuses it user namespaces; what it found."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare(1) to make a kernel that refuses namespaces")
    done = subprocess.run(
        ["unshare", "--user", "--map-current-user", "sh", "-c",
         'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" "$@"', sys.executable, "-c", FIRST_AGENT,
         str(data_dir)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip(f"no user namespace for the first agent: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    missing = json.loads(done.stdout.splitlines()[-1])
    assert missing.startswith("unshare refused"), missing
    return missing


@pytest.mark.skipif(bool(NAMESPACES_MISSING), reason=NAMESPACES_MISSING or "-")
def test_a_refusal_of_namespaces_confirmed_before_a_restart_is_kept_and_tested_again_only_when_due(
    tmp_path, fact, make_agent
):
    missing = refused_by_a_first_agent(tmp_path / "agent")

    make_agent(tmp_path / "agent")

    # Before, the restarted agent tested again at first use (here, where they work: "" after one test).
    assert sandbox.namespaces_missing() == missing and fact.calls == []
    # its re-test is due 5 minutes after the first agent's test
    assert not sandbox.NAMESPACES.retest_when_due()
    sandbox.NAMESPACES.recheck_missing_s = 0.0  # ... which have passed
    assert sandbox.NAMESPACES.retest_when_due()
    wait_until(lambda: sandbox.namespaces_missing() == "" and fact.calls, 60)
    # Working now: nothing kept for the next agent, which finds them working at its first test.
    assert "namespaces" not in state_file.StateFile(tmp_path / "agent" / "replicas.json").readings()


def kept_refusal(data_dir: Path, *, boot: str | None = None, mode: int = 0o600) -> None:
    """A state file holding a refusal of namespaces tested a moment ago, of this boot (or `boot`), with `mode`."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "replicas.json"
    readings = {"boot_id": state_file.boot_id() if boot is None else boot,
                "namespaces": {"missing": "unshare refused (kept)", "tested_at": 0.0}}  # fmt: skip
    path.write_text(json.dumps({state_file.READINGS_KEY: readings}))
    path.chmod(mode)


def test_a_state_file_another_user_could_write_is_trusted_for_nothing(tmp_path, fact, make_agent, caplog):
    kept_refusal(tmp_path / "agent", mode=0o622)
    caplog.set_level(logging.WARNING, logger=state_file.__name__)

    agent = make_agent(tmp_path / "agent")

    assert sandbox.namespaces_missing() == NAMESPACES_MISSING and len(fact.calls) >= 1  # tested here
    assert f"is not this agent's own (uid {os.getuid()}, mode 622): ignored" in caplog.text
    # nor are its engines' records taken (pids the agent would adopt)
    assert agent.supervisor.state.records() == {}


def test_readings_of_another_boot_of_the_node_are_ignored(tmp_path, fact, make_agent, caplog):
    kept_refusal(tmp_path / "agent", boot="another-boot")
    caplog.set_level(logging.INFO, logger=state_file.__name__)

    make_agent(tmp_path / "agent")

    assert sandbox.namespaces_missing() == NAMESPACES_MISSING and len(fact.calls) >= 1
    assert "holds readings of another boot: ignored" in caplog.text


def test_a_kept_refusal_of_this_boot_is_taken_by_the_next_agent(tmp_path, fact, make_agent):
    # Guard of the two above: the same file, the agent's own and of this boot, is taken.
    kept_refusal(tmp_path / "agent")
    make_agent(tmp_path / "agent")
    assert sandbox.namespaces_missing() == "unshare refused (kept)" and fact.calls == []


def test_a_corrupt_state_file_is_ignored_with_a_log_line_and_the_agent_starts(
    tmp_path, fact, make_agent, caplog
):
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "replicas.json").write_text('{"r-1": {"pid": 1')
    (tmp_path / "agent" / "replicas.json").chmod(0o600)
    caplog.set_level(logging.WARNING, logger=state_file.__name__)

    agent = make_agent(tmp_path / "agent")

    assert agent.supervisor.recover() == ([], [])
    assert "cannot be read" in caplog.text and "ignored" in caplog.text


def test_a_readers_back_off_outlives_a_restart(tmp_path, fact, make_agent, monkeypatch):
    model = write_model(tmp_path / "plain", many_tensors_header(10))
    first = make_agent(tmp_path / "agent")
    monkeypatch.setattr(safetensors_headers, "READER_TIMEOUT_S", 0.001)  # a real timeout, as under load
    # twice: its back-off is at the schedule's second step (60 s)
    assert first.weights.read_model(model).unsettled and first.weights.read_model(model).unsettled
    first.shutdown()
    monkeypatch.setattr(safetensors_headers, "READER_TIMEOUT_S", 60)
    started = readers_answering(monkeypatch)

    second = make_agent(tmp_path / "agent")

    assert second.weights.reading_made(model) is None
    reader = second.weights._background_reader
    if reader is not None:  # before: queued for the background reader at once, read again
        reader.join(30)
    assert started == []  # within the back-off the first agent reached
    # a pull's own read reads it; its back-off is forgotten
    assert second.weights.read_model(model).info.num_params > 0
    assert "unsettled" not in state_file.StateFile(tmp_path / "agent" / "replicas.json").readings()
