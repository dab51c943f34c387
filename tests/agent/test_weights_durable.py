"""A power loss never leaves a record saying "complete" beside what it vouches for lost (`gpu_agent.runtime.durable`).

The syscalls are recorded through wrappers of `os.fsync`, `os.pwrite`, `os.replace` and `os.rename` installed for the
test: a manifest is renamed into place only after every file and folder of its copy was `fsync`ed (after its last
write), itself `fsync`ed before its rename and its folder after; a parts journal names only parts `fsync`ed after their
last write; and a manifest an older agent wrote without any of that, left empty or cut short, is no manifest.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest

from gpu_agent.runtime import state_file
from gpu_agent.runtime.config import AgentConfig
from gpu_agent.runtime.control_plane import ControlPlaneClient
from gpu_agent.runtime.hardware import HardwareReport
from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_transfer import TransferSettings
from tests.agent.test_weights_cache import s3, s3_endpoint, upload_model  # noqa: F401

PART_BYTES = 256 * 1024


class Syscalls:
    """What the process asked of the disk, in order: ("write", inode, start, end), ("fsync", inode, is_folder),
    ("replace", source path, source inode, destination path, what the source held if it is a journal)."""

    def __init__(self, monkeypatch, *, fail_fsync=None) -> None:
        self.events: list[tuple] = []
        self.fail_fsync = fail_fsync  # (path, is_folder) -> whether this fsync fails with EIO
        real_fsync, real_pwrite, real_replace, real_rename = os.fsync, os.pwrite, os.replace, os.rename

        def fsync(fd):
            info = os.fstat(fd)
            path = os.readlink(f"/proc/self/fd/{fd}")
            if self.fail_fsync is not None and self.fail_fsync(path, stat.S_ISDIR(info.st_mode)):
                raise OSError(errno.EIO, "Input/output error")
            real_fsync(fd)
            self.events.append(("fsync", info.st_ino, stat.S_ISDIR(info.st_mode)))

        def pwrite(fd, data, offset):
            written = real_pwrite(fd, data, offset)
            self.events.append(("write", os.fstat(fd).st_ino, offset, offset + written))
            return written

        def moved(real):
            def move(src, dst, **kwargs):
                inode = os.lstat(src, dir_fd=kwargs.get("src_dir_fd")).st_ino
                held = None
                if str(dst).endswith(".json") and Path(dst).parent.name == ".parts":
                    held = json.loads(Path(src).read_text())
                real(src, dst, **kwargs)
                self.events.append(("replace", str(src), inode, str(dst), held))
            return move

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.setattr(os, "replace", moved(real_replace))
        monkeypatch.setattr(os, "rename", moved(real_rename))

    def synced_after(self, inode: int, since: int, until: int) -> bool:
        return any(event[0] == "fsync" and event[1] == inode for event in self.events[since:until])

    def last_write(self, inode: int, start: int = 0, end: int | None = None, *, until: int | None = None) -> int:
        """The index of the last write to `inode` (overlapping [start, end)) before `until`; -1 if none."""
        found = -1
        for index, event in enumerate(self.events[:until]):
            if event[0] == "write" and event[1] == inode and event[2] < (end if end is not None else event[3] + 1) \
                    and event[3] > start:
                found = index
        return found

    def index_of(self, kind: str, destination: Path) -> int:
        matches = [i for i, event in enumerate(self.events) if event[0] == kind and event[3] == str(destination)]
        assert matches, f"no {kind} onto {destination}"
        return matches[-1]


def test_a_manifest_is_written_only_after_every_byte_and_name_it_vouches_for_is_durable(s3, s3_endpoint, tmp_path,  # noqa: F811
                                                                                        monkeypatch):
    upload_model(s3, "durable-a", "m", num_bytes=1_000_000)
    root = tmp_path / "weights"
    cache = WeightsCache(root, s3_endpoint_url=s3_endpoint, transfer=TransferSettings(part_bytes=PART_BYTES))
    calls = Syscalls(monkeypatch)

    path = cache.fetch("s3://durable-a/m")

    manifest = root / f"{path.name}.json"
    written = calls.index_of("replace", manifest)
    moved_in = calls.index_of("replace", path)  # the folder renamed from .tmp into place
    assert moved_in < written
    everything = [path, *path.rglob("*")]
    assert {p.relative_to(path).as_posix() for p in everything if p.is_file()} == {
        "config.json", "model.safetensors", "sub/tokenizer.json"}
    for item in everything:  # its bytes (after their last write) and the names in each folder
        inode = item.lstat().st_ino
        assert calls.synced_after(inode, calls.last_write(inode, until=written) + 1, moved_in), item
    assert calls.synced_after(root.stat().st_ino, moved_in, written), "the folder's new name was not made durable"
    manifest_inode = calls.events[written][2]
    assert calls.synced_after(manifest_inode, 0, written), "the manifest's bytes were not durable before its rename"
    assert calls.synced_after(root.stat().st_ino, written, len(calls.events)), "the manifest's name was not durable"
    assert json.loads(manifest.read_text())["cache_key"] == path.name


def test_a_parts_journal_names_only_parts_whose_bytes_are_durable(s3, s3_endpoint, tmp_path, monkeypatch):  # noqa: F811
    upload_model(s3, "durable-j", "m", num_bytes=1_500_000)
    root = tmp_path / "weights"
    cache = WeightsCache(root, s3_endpoint_url=s3_endpoint,
                         transfer=TransferSettings(part_bytes=PART_BYTES, max_concurrency=4))
    calls = Syscalls(monkeypatch)

    path = cache.fetch("s3://durable-j/m")

    inode = (path / "model.safetensors").stat().st_ino  # the same file it was in .tmp
    journals = [(i, event) for i, event in enumerate(calls.events)
                if event[0] == "replace" and event[4] is not None]
    assert journals
    for index, (_, _, source_inode, _, held) in journals:
        assert calls.synced_after(source_inode, 0, index), "a journal's bytes were not durable before its rename"
        for part in held["done"].get("model.safetensors", []):
            start, end = part * PART_BYTES, min((part + 1) * PART_BYTES, 1_500_000)
            last = calls.last_write(inode, start, end, until=index)
            assert last >= 0 and calls.synced_after(inode, last + 1, index), f"part {part} named before it was durable"


@pytest.mark.parametrize("failing", ["the weights file", "its folder", "the cache's folder"])
def test_a_manifest_never_names_a_copy_whose_fsync_did_not_return(s3, s3_endpoint, tmp_path, monkeypatch,  # noqa: F811
                                                                  failing):
    upload_model(s3, "durable-f", "m", num_bytes=300_000)
    root = tmp_path / "weights"
    cache = WeightsCache(root, s3_endpoint_url=s3_endpoint, transfer=TransferSettings(part_bytes=PART_BYTES))

    def fails(path: str, is_folder: bool) -> bool:
        if failing == "the weights file":
            return path.endswith("/model.safetensors")
        if failing == "its folder":
            return is_folder and path.endswith(".partial")
        return is_folder and path == str(root)

    calls = Syscalls(monkeypatch, fail_fsync=fails)
    with pytest.raises(OSError):
        cache.fetch("s3://durable-f/m")

    assert list(root.glob("*.json")) == []
    assert cache.statuses() == []
    # nothing left on the disk that nobody counts (a folder renamed into place whose name was not made durable)
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == []
    assert list((root / ".tmp").iterdir()) == [] and list((root / ".parts").iterdir()) == []
    calls.fail_fsync = None  # the same content, fetched again once the disk answers: whole
    again = WeightsCache(root, s3_endpoint_url=s3_endpoint)
    path = again.fetch("s3://durable-f/m")
    assert again.num_downloads == 1 and (path / "model.safetensors").stat().st_size == 300_000


@pytest.mark.parametrize("left", ["empty", "cut short", "zeros", "not an object"])
def test_a_manifest_an_older_agent_left_cut_short_is_none_and_its_copy_is_fetched_again(s3, s3_endpoint,  # noqa: F811
                                                                                        tmp_path, left):
    # An older agent wrote manifests without fsync: after a power loss one could survive empty or cut short, beside
    # weights that did not survive whole (here: zero-filled). It was a manifest all the same: the copy was served as
    # complete (its checksums verified once, from the page cache), never counted nor evicted, never fetched again.
    upload_model(s3, "durable-m", "m", num_bytes=200_000)
    root = tmp_path / "weights"
    path = WeightsCache(root, s3_endpoint_url=s3_endpoint).fetch("s3://durable-m/m")
    original = (path / "model.safetensors").read_bytes()
    manifest = root / f"{path.name}.json"
    text = manifest.read_bytes()
    manifest.write_bytes({"empty": b"", "cut short": text[: len(text) // 2], "zeros": b"\0" * len(text),
                          "not an object": b"null"}[left])
    (path / "model.safetensors").write_bytes(b"\0" * len(original))  # the bytes that did not reach the disk

    cache = WeightsCache(root, s3_endpoint_url=s3_endpoint)  # the next agent, after the reboot

    assert not path.exists() and not manifest.exists()  # nothing left that nobody counts
    assert cache.statuses() == []
    fetched = cache.fetch("s3://durable-m/m")
    assert fetched == path and cache.num_downloads == 1
    assert (fetched / "model.safetensors").read_bytes() == original


def test_a_manifest_cut_short_while_the_cache_is_open_is_fetched_again_not_served(s3, s3_endpoint, tmp_path):  # noqa: F811
    upload_model(s3, "durable-o", "m", num_bytes=100_000)
    root = tmp_path / "weights"
    cache = WeightsCache(root, s3_endpoint_url=s3_endpoint)
    path = cache.fetch("s3://durable-o/m")
    (root / f"{path.name}.json").write_bytes(b'{"source": "s3://dur')
    (path / "model.safetensors").write_bytes(b"")

    assert cache.fetch("s3://durable-o/m") == path
    assert cache.num_downloads == 2 and (path / "model.safetensors").stat().st_size == 100_000
    assert [status.complete for status in cache.statuses()] == [True]
def test_the_agents_state_file_is_durable_before_and_after_its_rename(tmp_path, monkeypatch):
    calls = Syscalls(monkeypatch)
    path = tmp_path / "replicas.json"
    state = state_file.StateFile(path)

    state.save_reading("a reading", {"x": 1})

    written = calls.index_of("replace", path)
    assert calls.synced_after(calls.events[written][2], 0, written)
    assert calls.synced_after(tmp_path.stat().st_ino, written, len(calls.events))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert state_file.StateFile(path).readings() == {"a reading": {"x": 1}}


def test_the_nodes_credentials_are_durable_before_and_after_their_rename(tmp_path, monkeypatch):
    # An empty node.json after a power loss (its rename durable, its bytes not) made the next agent register as a new
    # node, its engines' replicas left on the old one.
    config = AgentConfig(control_plane_url="http://control-plane.invalid", join_token="t", data_dir=tmp_path)
    client = ControlPlaneClient(config, HardwareReport("cpu", 0, 0, 1, 1), device="cpu")
    client.node_id, client.node_secret = "node-1", "secret"
    calls = Syscalls(monkeypatch)

    client._save_credentials()

    written = calls.index_of("replace", tmp_path / "node.json")
    assert calls.synced_after(calls.events[written][2], 0, written)
    assert calls.synced_after(tmp_path.stat().st_ino, written, len(calls.events))
    assert stat.S_IMODE((tmp_path / "node.json").stat().st_mode) == 0o600
    again = ControlPlaneClient(config, HardwareReport("cpu", 0, 0, 1, 1), device="cpu")
    assert (again.node_id, again.node_secret) == ("node-1", "secret")


def test_a_file_system_that_cannot_fsync_a_folder_still_takes_downloads(s3, s3_endpoint, tmp_path, monkeypatch):  # noqa: F811
    # Some (FUSE) file systems answer EINVAL to a folder's fsync: nothing more can be asked of them, and failing every
    # download and state write there would leave the agent unusable. A file's fsync failing still fails the fetch.
    upload_model(s3, "durable-e", "m", num_bytes=100_000)
    root = tmp_path / "weights"
    cache = WeightsCache(root, s3_endpoint_url=s3_endpoint)
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = cache.fetch("s3://durable-e/m")
    assert cache.num_downloads == 1 and (path / "model.safetensors").stat().st_size == 100_000
    assert state_file.StateFile(tmp_path / "replicas.json").save([]) is True
