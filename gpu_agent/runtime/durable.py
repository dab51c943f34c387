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
import tempfile
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
