"""A durable write killed before its rename (`durable.write_atomic`: the agent's SIGTERM or OOM kill, a power loss)
leaves its temporary file, `.<cache key>.json.XXXXXXXX.tmp`, beside the manifests or in `.parts`: one per kill, never
removed. The next cache removes those of a key nobody holds the lock of, and nothing else."""

from __future__ import annotations

import os

from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_index import CacheIndex

KEY, HELD = "a" * 32, "b" * 32


def test_a_killed_writes_temporary_files_are_removed_at_start_and_nothing_else(tmp_path):
    root = tmp_path / "weights"
    (root / ".parts").mkdir(parents=True)
    (root / ".locks").mkdir()
    leftovers = [root / f".{KEY}.json.k3_9zqab.tmp", root / ".parts" / f".{KEY}.json.x1y2z3w4.tmp",
                 root / f".{KEY}.json.0a1b2c3d"]  # the last: as the release before named them
    held = root / f".{HELD}.json.abcdefgh.tmp"  # another process writes that key's manifest now
    others = [root / "notes.tmp", root / f".{KEY}.json", root / ".parts" / f"{KEY}.json.tmp", root / ".x.json.abcdefgh.tmp"]
    for path in (*leftovers, held, *others):
        path.write_text("{")
    holder = CacheIndex(root).key_lock(HELD)
    try:
        WeightsCache(root)
    finally:
        holder.close()
    assert [path for path in leftovers if path.exists()] == []
    assert held.exists()
    assert all(path.exists() for path in others)
    assert sorted(os.listdir(root / ".parts")) == [f"{KEY}.json.tmp"]
