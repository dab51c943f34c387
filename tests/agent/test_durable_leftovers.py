"""A record's write killed before its rename (`durable.write_atomic`: SIGKILL, the OOM killer, a power loss) left its
temporary file beside the agent's state file or `node.json`, one more for each such kill, for good. The next agent
removes those of its own pattern, its own and old enough to be no write in progress; nothing else."""

from __future__ import annotations

import os
import time

from gpu_agent.runtime import durable
from gpu_agent.runtime.state_file import StateFile


def _aged(path, content="{"):
    path.write_text(content)
    old = time.time() - 3600
    os.utime(path, (old, old))
    return path


def test_a_killed_writes_temporary_files_beside_the_state_file_are_removed_on_its_first_read(tmp_path):
    state = tmp_path / "replicas.json"
    state.write_text("{}")
    os.chmod(state, 0o600)
    leftovers = [_aged(tmp_path / ".replicas.json.k3_9zqab.tmp"), _aged(tmp_path / ".replicas.json.abcdefgh.tmp")]
    in_progress = tmp_path / ".replicas.json.zzzzzzzz.tmp"
    in_progress.write_text("{")  # just made: a write in progress
    others = [_aged(tmp_path / ".node.json.abcdefgh.tmp"), _aged(tmp_path / "replicas.json.abcdefgh.tmp"),
              _aged(tmp_path / ".replicas.json.abcdefghi.tmp"), _aged(tmp_path / "other")]
    os.symlink(tmp_path / "other", tmp_path / ".replicas.json.linklink.tmp")
    StateFile(state).records()
    assert [path for path in leftovers if path.exists()] == []
    assert in_progress.exists() and all(path.exists() for path in others)
    assert (tmp_path / ".replicas.json.linklink.tmp").is_symlink()


def test_remove_leftovers_never_raises_on_a_missing_folder(tmp_path):
    assert durable.remove_leftovers(tmp_path / "gone" / "node.json") == 0


def test_a_killed_writes_temporary_files_beside_node_json_are_removed_when_it_is_loaded(tmp_path):
    from gpu_agent.runtime.config import AgentConfig
    from gpu_agent.runtime.control_plane import ControlPlaneClient
    from gpu_agent.runtime.hardware import HardwareReport

    leftover = _aged(tmp_path / ".node.json.k3_9zqab.tmp")
    state = _aged(tmp_path / ".replicas.json.k3_9zqab.tmp")  # the state file's own: for it to remove
    config = AgentConfig(control_plane_url="http://control-plane.invalid", join_token="t", data_dir=tmp_path)
    ControlPlaneClient(config, HardwareReport("cpu", 0, 0, 1, 1), device="cpu")
    assert not leftover.exists() and state.exists()
