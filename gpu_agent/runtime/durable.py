"""Writes that survive a power loss or a kernel panic in the order they were made: one helper for every record.

A record that says "this is complete" (a weights manifest, the parts journal of a download, the agent's state file)
must reach the disk only after what it vouches for, and whole or not at all. A rename is atomic for readers of a
running system, but the kernel may write a new file's name before its bytes: after a crash a manifest could survive
while the weights it names were zero-filled or cut short (their checksums had been verified from the page cache),
or a record could survive empty. So:
  - `sync_file` each file a record vouches for once written (`os.fsync`), and `sync_folder` each folder a file was
    made in or renamed into or out of;
  - `write_atomic` a record: a new temporary file (O_EXCL, never one someone else made) written, `os.fsync`ed, renamed
    over the record (`os.replace`), then its folder `os.fsync`ed.
An `OSError` of any of them (EIO: the bytes did not reach the disk) propagates: the record is not written.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
import time
from pathlib import Path


def sync_file(fd: int) -> None:
    """Make what was written through `fd` (its bytes and its size) durable."""
    os.fsync(fd)


def sync_folder(path: str | Path) -> None:
    """Make the names made, renamed or removed in the folder at `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sync_folder_fd(fd)
    finally:
        os.close(fd)


def sync_folder_fd(fd: int) -> None:
    """`sync_folder` of the folder open as `fd`."""
    try:
        os.fsync(fd)
    except OSError as exc:
        # NOTE: a file system that cannot fsync a folder (some FUSE ones) says EINVAL: there is nothing more to ask of
        # it, and failing every download and state write there would make the agent unusable on it.
        if exc.errno != errno.EINVAL:
            raise


def write_atomic(path: str | Path, data: str | bytes, *, mode: int = 0o600) -> None:
    """Replace the file at `path` with `data`, durably: readers (and a reboot) see the old content or the new one,
    whole, never a mix, an empty file or a name without its bytes. The file gets `mode`."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            if mode != 0o600:
                os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            sync_file(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


LEFTOVER_AGE_S = 60.0  # a write takes well under a second: a temporary file older than this is no write in progress


def remove_leftovers(path: str | Path, *, older_than_s: float = LEFTOVER_AGE_S) -> int:
    """Remove the temporary files of `write_atomic`s of `path` killed before their rename (SIGKILL, the OOM killer, a
    power loss): only files of its very pattern (`.<name>.<8 characters>.tmp`), regular, this user's and older than
    `older_than_s`. Returns how many went; never raises.

    NOTE: never removed before: one more beside the record for each agent killed mid-write, for good."""
    path = Path(path)
    pattern = re.compile(re.escape(f".{path.name}.") + r"[a-z0-9_]{8}\.tmp")
    cutoff = time.time() - older_than_s
    removed = 0
    try:
        names = os.listdir(path.parent)
    except OSError:
        return 0
    for name in names:
        if not pattern.fullmatch(name):
            continue
        leftover = path.parent / name
        try:
            info = os.lstat(leftover)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and info.st_mtime < cutoff:
                leftover.unlink()
                removed += 1
        except OSError:
            continue
    return removed
