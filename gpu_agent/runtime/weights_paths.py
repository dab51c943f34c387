"""Where a model's files may go: strictly inside their download folder.

Object keys and Hub file names come from whoever controls the source, a customer. Every name is
checked before anything is fetched (`model_file_parts`), and every file is then created through
directory file descriptors opened with O_NOFOLLOW (`DownloadFolder`), so neither a crafted name
(`p//etc/x`, `..`) nor a symbolic link planted in the folder while it fills can send bytes elsewhere.
A local model directory must resolve outside the agent's own files (`check_local_model_dir`).
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Iterable
from pathlib import Path

from gpu_agent.runtime import durable
from gpu_agent.runtime.weights_access import UnsafeModelPath, WeightsError

_MAX_NAME_BYTES = 255
_MAX_PATH_BYTES = 1024
# NOTE: folders and empty files cost disk blocks and inodes that their sizes (0) do not say: a listing may
# nest at most this deep and make at most this many folders, and each file and folder is charged at least
# `MIN_DISK_BYTES` against the weights budget (`disk_bytes`). Real models have a handful of each.
MAX_PATH_DEPTH = 8
MAX_MODEL_FOLDERS = 1000
MIN_DISK_BYTES = 4096
# Names Windows maps to devices; harmless on Linux, refused so a model stays portable and boring.
_DEVICE_NAMES = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))}
# The kernel's pseudo file systems: never a model directory.
_SYSTEM_DIRS = (Path("/proc"), Path("/sys"), Path("/dev"))
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _refuse(name: str, why: str) -> UnsafeModelPath:
    shown = name if len(name) <= 200 else name[:200] + "…"
    return UnsafeModelPath(f"refusing the model file name {shown!r}: {why}")


def model_file_parts(name: str) -> tuple[str, ...]:
    """The components of a file name relative to the model folder, or UnsafeModelPath.

    Names must already be in normal form: a name that normalising would change (`a//b`, `a/./b`,
    `a/../b`, a leading or trailing `/`) is refused rather than guessed at.
    """
    if not name:
        raise _refuse(name, "it is empty")
    if "\x00" in name or any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        raise _refuse(name, "it contains a control character")
    if "\\" in name:
        raise _refuse(name, "it contains a backslash")
    if name.startswith("/"):
        raise _refuse(name, "it is an absolute path")
    if len(name.encode()) > _MAX_PATH_BYTES:
        raise _refuse(name, f"it is longer than {_MAX_PATH_BYTES} bytes")
    parts = tuple(name.split("/"))
    if len(parts) > MAX_PATH_DEPTH:
        raise _refuse(name, f"it is nested deeper than {MAX_PATH_DEPTH} levels")
    for part in parts:
        if part == "":
            raise _refuse(name, "it has an empty path component ('//' or a trailing '/')")
        if part in (".", ".."):
            raise _refuse(name, f"it has a {part!r} component")
        if len(part.encode()) > _MAX_NAME_BYTES:
            raise _refuse(name, f"a component is longer than {_MAX_NAME_BYTES} bytes")
        if part.split(".")[0].lower() in _DEVICE_NAMES:
            raise _refuse(name, "it names a device")
    return parts


def check_model_file_names(names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Validate a whole listing before anything is fetched: each name, and no name both a file and a folder."""
    parts_by_name: dict[str, tuple[str, ...]] = {}
    for name in names:
        if name in parts_by_name:
            raise _refuse(name, "the listing names it twice")
        parts_by_name[name] = model_file_parts(name)
    folders = _folders(parts_by_name.values())
    if len(folders) > MAX_MODEL_FOLDERS:
        raise UnsafeModelPath(f"refusing the model: its files are in more than {MAX_MODEL_FOLDERS} folders")
    for name, parts in parts_by_name.items():
        if parts in folders:
            raise _refuse(name, "it is both a file and a folder")
    return parts_by_name


def disk_bytes(files: Iterable[tuple[tuple[str, ...], int]]) -> int:
    """What a model's files (their parts and sizes) are charged on disk: each file and each folder at least
    `MIN_DISK_BYTES`, so ten thousand empty files are not free."""
    files = list(files)
    return sum(max(size, MIN_DISK_BYTES) for _, size in files) + MIN_DISK_BYTES * len(_folders(parts for parts, _ in files))


def _folders(all_parts: Iterable[tuple[str, ...]]) -> set[tuple[str, ...]]:
    return {parts[:depth] for parts in all_parts for depth in range(1, len(parts))}


class DownloadFolder:
    """A new, empty folder filled by name, never through a symbolic link.

    The folder is opened once; every file is created relative to that descriptor, one component
    at a time with O_NOFOLLOW and the file itself with O_EXCL, so a link planted anywhere inside
    (or the folder itself swapped for a link) is refused, never followed.
    """

    def __init__(self, path: Path, *, resume: bool = False) -> None:
        """Make the folder, or with `resume` reopen the one a failed download left (never through a link)."""
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            if not resume:
                raise
        self.path = path
        try:
            self._fd = os.open(path, _DIRECTORY_FLAGS)
        except OSError:  # ELOOP, ENOTDIR: not a folder of ours any more
            raise UnsafeModelPath("the download folder was replaced while the model was downloading") from None
        info = os.fstat(self._fd)
        self._identity = (info.st_dev, info.st_ino)

    def open_file(self, parts: tuple[str, ...], *, exclusive: bool = True) -> int:
        """A read-write descriptor of the file at `parts` (from `model_file_parts`), made if missing.

        `exclusive` (a fresh download) refuses a file that is already there; a resumed download
        reopens the one it wrote before, still never through a symbolic link.
        """
        name = "/".join(parts)
        directory = self._walk(parts, create=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_EXCL if exclusive else 0)
        try:
            return os.open(parts[-1], flags, 0o644, dir_fd=directory)
        except FileExistsError:
            raise _refuse(name, "something (a duplicate or a symbolic link) is already there") from None
        except OSError:  # ELOOP: a symbolic link where a resumed file was
            raise _refuse(name, "something (a duplicate or a symbolic link) is already there") from None
        finally:
            os.close(directory)

    def check_file(self, parts: tuple[str, ...], fd: int) -> None:
        """Raise unless `parts`, looked up afresh without following links, is still the file `fd` wrote."""
        name = "/".join(parts)
        directory = self._walk(parts, create=False)
        try:
            info = os.stat(parts[-1], dir_fd=directory, follow_symlinks=False)
        except OSError:
            info = None
        finally:
            os.close(directory)
        written = os.fstat(fd)
        if info is None or not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != (
            written.st_dev, written.st_ino
        ):
            raise _refuse(name, "the file was moved or replaced while it downloaded")

    def _walk(self, parts: tuple[str, ...], *, create: bool) -> int:
        """A descriptor of the folder holding `parts`, reached one component at a time with O_NOFOLLOW."""
        name = "/".join(parts)
        directory = os.dup(self._fd)
        try:
            for part in parts[:-1]:
                if create:
                    try:
                        os.mkdir(part, 0o755, dir_fd=directory)
                    except FileExistsError:
                        pass
                try:
                    child = os.open(part, _DIRECTORY_FLAGS, dir_fd=directory)
                except OSError:  # ELOOP: a symbolic link; ENOTDIR: a file
                    raise _refuse(name, "a folder on its way is a symbolic link or a file") from None
                os.close(directory)
                directory = child
        except BaseException:
            os.close(directory)
            raise
        return directory

    def sync_folders(self, files: Iterable[tuple[str, ...]]) -> None:
        """Make the names in every folder holding one of `files` (their parts) durable, and the folder's own: each
        folder is `fsync`ed, reached as `open_file` reaches it (`durable`)."""
        folders = {(), *(parts[:depth] for parts in files for depth in range(len(parts)))}
        for folder in sorted(folders, key=len, reverse=True):  # the deepest first, the folder itself last
            directory = self._walk((*folder, "-"), create=False)
            try:
                durable.sync_folder_fd(directory)
            finally:
                os.close(directory)

    def check_in_place(self, path: Path | None = None) -> None:
        """Raise unless `path` (default: where the folder was made) is still this very folder."""
        try:
            info = os.lstat(path or self.path)
        except FileNotFoundError:
            info = None
        if info is None or not stat.S_ISDIR(info.st_mode) or (info.st_dev, info.st_ino) != self._identity:
            raise UnsafeModelPath("the download folder was replaced while the model was downloading")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def check_local_model_dir(location: str, private_dirs: Iterable[Path]) -> Path:
    """The real directory a local `model_source` names, if it is one a replica may read.

    The control plane decides whether local paths are allowed at all; here a path must be
    absolute and normal, resolve (links followed) to a directory, and neither lie inside nor
    contain the agent's own files (its secret, other tenants' cached weights) or /proc, /sys, /dev.
    """
    if "\x00" in location or not location.startswith("/") or posixpath.normpath(location) != location:
        raise UnsafeModelPath(
            f"refusing the model directory {location!r}: it must be an absolute, normal path"
        )
    resolved = Path(location).resolve()
    if not resolved.is_dir():
        raise WeightsError(f"model directory {location} does not exist or is not a directory")
    for private in (*_SYSTEM_DIRS, *(Path(p).resolve() for p in private_dirs)):
        if resolved == private or private in resolved.parents or resolved in private.parents:
            raise UnsafeModelPath(f"refusing the model directory {location}: it holds the node's own files")
    return resolved
