"""The shared-memory segments an engine leaves behind when it is killed.

vLLM's API server, EngineCore and workers talk through `multiprocessing.shared_memory` segments
(`/dev/shm/psm_*`), which only a graceful exit unlinks: every SIGKILLed engine used to leave its own
until the machine rebooted. Whoever kills an engine (`process.kill_group`, the `reaper`) notes the
segments its processes hold first and unlinks them after. Standard library only: the reaper imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

SHARED_MEMORY_DIR = Path("/dev/shm")
SHARED_MEMORY_PREFIX = "psm_"  # multiprocessing.shared_memory's names; vLLM's ring buffers use them


def segments_of(pids) -> set[Path]:
    """The `/dev/shm/psm_*` segments these processes have mapped or open."""
    found = set()
    for pid in set(pids):
        paths = []
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                paths += [line.split(maxsplit=5)[5].strip() for line in maps if "/dev/shm/" in line and line.count(" ") >= 5]
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                try:
                    paths.append(os.readlink(f"{fd_dir}/{fd}"))
                except OSError:
                    continue
        except OSError:  # gone, or not ours to read
            continue
        for path in map(Path, paths):
            # NOTE: " (deleted)" marks a segment already unlinked.
            if path.parent == SHARED_MEMORY_DIR and path.name.startswith(SHARED_MEMORY_PREFIX) and " " not in path.name:
                found.add(path)
    return found


def unlink(segments) -> None:
    """Remove the segments' names; memory still mapped by a dying process is freed when it exits."""
    for segment in segments:
        try:
            segment.unlink()
        except OSError:  # already unlinked by the engine itself
            pass
