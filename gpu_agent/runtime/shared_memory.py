"""Engines' shared memory (/dev/shm): the segments one leaves behind when it is killed, what a live one holds
(counted in its bound), and the files nobody holds.

vLLM's API server, EngineCore and workers talk through `multiprocessing.shared_memory` segments
(`/dev/shm/psm_*`), which only a graceful exit unlinks: every SIGKILLed engine used to leave its own
until the machine rebooted. Whoever kills an engine (`process.kill_group`, the `reaper`) notes the
segments its processes hold first and unlinks them after. Standard library only: the reaper imports it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import stat
import time
from dataclasses import dataclass, replace
from pathlib import Path

SHARED_MEMORY_DIR = Path("/dev/shm")
SHARED_MEMORY_PREFIX = "psm_"  # multiprocessing.shared_memory's names; vLLM's ring buffers use them


def in_own_mount_namespace(pid: int) -> bool:
    """Whether the process sees the file system as this one does: a path it names is the same file here.

    NOTE: an engine in namespaces of its own (`namespaces.py`) has its own /dev/shm, a tmpfs that goes with its last
    process: a name it holds there is not the file of that name here, which may be anyone's."""
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return False


def segments_of(pids) -> set[Path]:
    """The `/dev/shm/psm_*` segments these processes have mapped or open (those of processes that see this /dev/shm:
    `in_own_mount_namespace`)."""
    found = set()
    for pid in set(pids):
        paths = []
        if not in_own_mount_namespace(pid):
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                paths += [
                    line.split(maxsplit=5)[5].strip()
                    for line in maps
                    if "/dev/shm/" in line and line.count(" ") >= 5
                ]
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
            if (
                path.parent == SHARED_MEMORY_DIR
                and path.name.startswith(SHARED_MEMORY_PREFIX)
                and " " not in path.name
            ):
                found.add(path)
    return found


def unlink(segments) -> None:
    """Remove the segments' names; memory still mapped by a dying process is freed when it exits."""
    for segment in segments:
        try:
            segment.unlink()
        except OSError:  # already unlinked by the engine itself
            pass


# --- What a live engine holds there, and what nobody holds ---------------------------------------------------
#
# An engine may create files in /dev/shm (`sandbox.SHARED_MEMORY`; vLLM's ring buffers, NCCL's segments) but not
# list it: RAM (tmpfs), outside its folders' disk bound, until the machine rebooted. The agent, unconfined, reads
# what each engine's processes hold open (`/proc/<pid>/fd`) or map (`/proc/<pid>/maps`, a file unlinked but still
# mapped included) and counts it in that engine's bound (`Supervisor.check_disk`); a file no process holds goes
# after a grace period (`remove_orphans`). An engine in namespaces of its own has a /dev/shm of its own: all of it is
# counted (`statvfs` through `/proc/<pid>/root`: what it closed too, which it kept for its whole life before).
# NOTE: a file of another engine's /dev/shm, passed over a Unix socket (SCM_RIGHTS), keeps that engine's whole tmpfs
# (every file, closed ones too) for as long as one process holds it, after that engine is gone; its path then names
# nothing here (`/tiny`, not `/dev/shm/tiny`). Any file an engine's processes hold open or mapped on a tmpfs the agent
# does not see mounted (another engine's own /dev/shm, live or gone) counts that whole tmpfs once (`_PrivateTmpfs`).


@dataclass(slots=True, frozen=True)
class HeldMemory:
    """What some processes hold in the shared-memory folder."""

    # each file once: its blocks, or for one unlinked and only mapped, its largest mapping; and each tmpfs not mounted
    # here (their own /dev/shm, another engine's they hold a file of) whole, once; and each file of `disk_devices`
    # they hold with no name left (`held_by`), the same way
    num_bytes: int
    num_files: int  # the files of those tmpfs, held or not, and the unnamed files of `disk_devices`; 0 for /dev/shm
    paths: frozenset[Path]  # the names they hold that still exist (removed when their engine is stopped)
    inodes: frozenset[tuple[int, int]]  # (device, inode) of every file they hold
    hidden: bool  # a process of theirs would not show its files (not dumpable): what it holds is unknown
    # "<path> (device <major>:<minor>)" of each device of memory mounted neither here nor where the process mapping it
    # sees it, that they hold only mapped, which the agent could not measure (its `map_files` link refused: no
    # CAP_CHECKPOINT_RESTORE): what it pins is unknown, not 0
    unmeasured: tuple[str, ...] = ()
    # a process of theirs exited (or a mapping of it went) while the walk asked it, and some of theirs live on: what
    # it held may have passed to one not walked (a mapping relayed by fork and exit), so the figures may miss it
    incomplete: bool = False


MAX_TREE_WALKS = 3  # of one engine's tree by `held_by_tree`, until one is complete
# of /proc by one `process_tree`: new processes at each (a fork storm) leave it incomplete
MAX_PROCESS_LISTINGS = 8


def process_tree(pid: int) -> set[int]:
    """`pid`, every process below it and every process of its group: an engine's processes (its reaper is a
    subreaper, so what its children orphan stays below it). `_scan_tree`'s processes."""
    return _scan_tree(pid)[0]


def _scan_tree(pid: int) -> tuple[set[int], bool]:
    """`process_tree`'s processes, and whether the scan is complete: /proc is listed again for the processes born
    since it was last listed, and those whose parent exited meanwhile are asked again (their new parent, the reaper),
    until one listing finds none (at most `MAX_PROCESS_LISTINGS`).

    NOTE: read once, a process that forked and exited between the listing and the reading of its parent's line was
    not found, nor was its child, born after the listing: a mapping relayed from process to process that way was on no
    process of the tree in 7 walks of 40 that were taken as complete."""
    parent_of: dict[int, int] = {}
    group = set()
    gone: set[int] = set()
    complete = False
    for _ in range(MAX_PROCESS_LISTINGS):
        listed = {int(entry) for entry in os.listdir("/proc") if entry.isdigit()}
        asked = {each for each in listed if each not in parent_of and each not in gone}
        asked |= {child for child, parent in parent_of.items() if parent in gone}  # reparented meanwhile
        if not asked:
            complete = True
            break
        for each in sorted(asked):
            try:
                with open(f"/proc/{each}/stat", "rb") as stat_file:
                    fields = stat_file.read().rsplit(b")", 1)[1].split()
            except OSError:
                gone.add(each)  # gone meanwhile
                parent_of.pop(each, None)
                continue
            parent_of[each] = int(fields[1])
            if int(fields[2]) == pid:
                group.add(each)
    children: dict[int, list[int]] = {}
    for child, parent in parent_of.items():
        children.setdefault(parent, []).append(child)
    found, pending = {pid}, [pid]
    while pending:
        for child in children.get(pending.pop(), ()):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found | group, complete


_TMPFS_MAGIC = 0x01021994  # `statfs`'s f_type of a tmpfs (linux/magic.h)
# of the kernel's dma-buf file system, mounted nowhere (buffers a GPU driver exports)
_DMA_BUF_MAGIC = 0x444D4142
# NOTE: what a mount of these types holds is memory, measured whole through its mount point (`_measure_mounted`).
MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "shm", "ramfs", "hugetlbfs", "devtmpfs"})
# NOTE: fail closed: only a mount of these types is known to hold files whose pages the kernel may drop or write back
# to a disk (not counted). Any other (overlay, whose upper folder may be a tmpfs; fuse.*, whose server may keep its
# files in memory; a type unknown here) is unmeasured where no link measures it.
DISK_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "jfs", "reiserfs", "vfat", "exfat",
                               "ntfs", "ntfs3", "zfs", "nfs", "nfs4", "cifs", "smb3", "ceph", "squashfs", "erofs",
                               "iso9660"})  # fmt: skip


def _mounted_devices() -> set[int]:
    """The devices of the file systems mounted where this process sees them (`/proc/self/mountinfo`)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mountinfo:
            numbers = [line.split(maxsplit=3)[2].split(":") for line in mountinfo]
    except OSError:
        return set()
    return {os.makedev(int(major), int(minor)) for major, minor in numbers}


def _usage(path: str | int) -> tuple[int, int]:
    """Bytes and files used on the file system of `path` (or of the open file `path`), less its root folder."""
    usage = os.statvfs(path)
    return (usage.f_blocks - usage.f_bfree) * usage.f_frsize, max(0, usage.f_files - usage.f_ffree - 1)


def _file_system_type(fd: int) -> int:
    """`fstatfs`'s f_type of the file system of the open file `fd` (an `O_PATH` one too)."""
    found = ctypes.create_string_buffer(256)  # a `struct statfs`, its f_type (a C long) first
    if ctypes.CDLL(None, use_errno=True).fstatfs(fd, found) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return ctypes.c_long.from_buffer(found).value & 0xFFFFFFFF


def _tmpfs_usage(path: str) -> tuple[int, tuple[int, int] | None]:
    """The device of the file `path` names (a `/proc/<pid>/fd/<n>` or `map_files` link: the open file itself) and
    `_usage` of it if a tmpfs; None for another file system or a tmpfs of no size (the kernel's own: memfd's, SysV's,
    counted as memory).

    NOTE: the link is opened once and every question asked of that one open file: asked of the path twice, an engine
    could `dup2` another file onto its fd between the answers (a tmpfs of another engine's, its device then learned as
    dma-buf's, kernel-own, for the agent's life)."""
    opened = os.open(path, os.O_PATH)
    try:
        device = os.fstat(opened).st_dev
        file_system = _file_system_type(opened)
        if file_system == _DMA_BUF_MAGIC:
            _learn_kernel_device(device)
        if file_system != _TMPFS_MAGIC:
            return device, None
        return device, _usage(opened) if os.statvfs(opened).f_blocks else None
    finally:
        os.close(opened)


_kernel_devices_found: frozenset[int] | None = None
# dma-buf's, from a link that answered (no file of it can be made here)
_kernel_devices_learned: set[int] = set()


def _learn_kernel_device(device: int) -> None:
    """Note `device` as one of the kernel's own (`_kernel_devices`), for every later check."""
    global _kernel_devices_found
    _kernel_devices_learned.add(device)
    if _kernel_devices_found is not None:
        _kernel_devices_found |= {device}


MAX_PATH_CHARS_SHOWN = 200  # of an unmeasured mapping's path (the engine's to name), in its replica's reason


def _huge_page_flags() -> list[int]:
    """`memfd_create`'s flags for a hugetlbfs memfd of each huge page size this kernel has (`MFD_HUGE_SHIFT`)."""
    try:
        sizes = [int(entry.removeprefix("hugepages-").removesuffix("kB")) * 1024
                 for entry in os.listdir("/sys/kernel/mm/hugepages")]  # fmt: skip
    except (OSError, ValueError):
        return []
    return [os.MFD_HUGETLB | ((size.bit_length() - 1) << 26) for size in sizes if size & (size - 1) == 0]


def _kernel_devices() -> frozenset[int]:
    """The devices of the kernel's own internal file systems, mounted nowhere: its tmpfs of no size (every memfd,
    shared anonymous mapping and SysV segment is a file of it, counted as memory), its hugetlbfs of each huge page
    size (a `MFD_HUGETLB` memfd's, from the huge page pool: the process's own, gone with it), that of anonymous inodes
    and dma-buf's once seen (`_learn_kernel_device`). Asked once, of a memfd of each kind and an eventfd of this
    process's own (a hugetlbfs memfd costs no page until written).

    NOTE: kept only when every probe answered: one refused (no fd left, no memory, a seccomp filter) is asked again at
    the next call. Kept, one failed probe at the agent's start made every engine's shared anonymous mapping
    (`/dev/zero (deleted)`, vLLM's) unmeasured, and stopped every engine at each sweep until the agent restarted."""
    global _kernel_devices_found
    if _kernel_devices_found is None:
        found = set(_kernel_devices_learned)
        hugetlb = [lambda flags=flags: os.memfd_create("inferplane-probe", flags)
                   for flags in _huge_page_flags()]  # fmt: skip
        complete = True
        for make in (lambda: os.memfd_create("inferplane-probe"), lambda: os.eventfd(0), *hugetlb):
            try:
                fd = make()
            except (OSError, AttributeError):
                complete = False
                continue
            try:
                found.add(os.fstat(fd).st_dev)
            finally:
                os.close(fd)
        if not complete:
            return frozenset(found)
        _kernel_devices_found = frozenset(found)
    return _kernel_devices_found


class _PrivateTmpfs:
    """The tmpfs file systems some processes hold files of that the agent does not see mounted: engines' own
    /dev/shm (`namespaces.py`), theirs or one another engine passed them a file of. Each device is asked once."""

    def __init__(self) -> None:
        self.mounted = _mounted_devices()
        self.usage: dict[int, tuple[int, int]] = {}  # device -> (bytes, files)
        self.uncounted: set[int] = set()  # not a tmpfs, or one of no size
        # device -> the path of a mapping of it whose `map_files` link was refused
        self.refused: dict[int, str] = {}
        self.mounts_of: dict[int, dict[int, tuple[str, str]]] = {}  # pid -> its `_mounts`, read once
        # a link asked was gone (its process exited, its file unmapped) or named another file than a moment before
        self.vanished = False

    def unmeasured(self, known) -> tuple[str, ...]:
        """The mappings of devices that no link answered for, less `known` ones (measured another way) and the
        kernel's own (`_kernel_devices`): "<path> (device <major>:<minor>)"."""
        return tuple(sorted(f"{path} (device {os.major(device)}:{os.minor(device)})"
                            for device, path in self.refused.items()
                            if device not in self.usage and device not in self.uncounted and device not in known
                            and device not in _kernel_devices()))  # fmt: skip

    def measure(
        self, device: int, link: str, *, mapped_as: str | None = None, pid: int | None = None
    ) -> None:
        """Note `device` through `link`, a file of it, unless it is a device mounted here or known already.

        NOTE: only an answer about the device is kept; a link that fails (gone meanwhile, or a `map_files` link
        refused to an agent without CAP_CHECKPOINT_RESTORE) says nothing of it: the next link of it is asked. Kept,
        one refused mapping walked first hid a file of that tmpfs held open elsewhere, and the whole tmpfs counted 0.
        A mapping's link refused (`mapped_as`, its path) is asked of the mounts of `pid`, the process mapping it
        (`_measure_mounted`); a device mounted nowhere it sees is noted in `refused`: unless another link answers,
        that tmpfs is unmeasured (`unmeasured`), which stops its engine; before, it counted 0."""
        if (
            device in self.mounted
            or device in self.usage
            or device in self.uncounted
            or os.major(device) != 0
        ):
            return  # NOTE: a tmpfs has an anonymous device (major 0)
        try:
            opened_device, usage = _tmpfs_usage(link)
        except OSError as exc:
            if mapped_as is not None and exc.errno in (errno.EPERM, errno.EACCES):
                if pid is None or not self._measure_mounted(device, pid):
                    self.refused.setdefault(device, mapped_as[:MAX_PATH_CHARS_SHOWN])
            elif exc.errno in (errno.ENOENT, errno.ESRCH):
                self.vanished = True
            return
        if opened_device != device:
            self.vanished = True  # the link names another file than a moment ago: `device` is asked again
            return
        if usage is None:
            self.uncounted.add(device)
        else:
            self.usage[device] = usage

    def _measure_mounted(self, device: int, pid: int) -> bool:
        """Whether `device`, mapped by `pid` through a link refused to this agent, is known from what `pid` sees
        mounted (`/proc/<pid>/mountinfo`, which needs no capability): a file system of another type than
        `DISK_FILE_SYSTEMS` holds no memory (not counted); a tmpfs is measured whole through its mount point there
        (`/proc/<pid>/root/<mount point>`, opened once, and counted only if that is the device: a mount stacked over
        it, or a path its engine swapped meanwhile, names another). A device mounted nowhere `pid` sees (a file
        passed by fd from another engine's tmpfs), one of another type (overlay, fuse.*, unknown), or a memory file
        system not measured so, is not known: False."""
        if pid not in self.mounts_of:
            self.mounts_of[pid] = _mounts(pid)
        fstype, mount_point = self.mounts_of[pid].get(device, ("", ""))
        if not fstype:
            return False
        if fstype in DISK_FILE_SYSTEMS:
            self.uncounted.add(device)
            return True
        if fstype not in MEMORY_FILE_SYSTEMS:
            return False  # overlay, fuse.*, or unknown: it may hold memory (`DISK_FILE_SYSTEMS`)
        try:
            opened_device, usage = _tmpfs_usage(f"/proc/{pid}/root{mount_point}")
        except OSError:
            return False
        if opened_device != device:
            usage = None
        if usage is not None:
            self.usage[device] = usage
        return usage is not None


def _mounts(pid: int) -> dict[int, tuple[str, str]]:
    """The devices mounted where `pid` sees them: device -> (file system type, mount point in its root); {} if
    unreadable. NOTE: a device mounted at several points keeps its first."""
    found: dict[int, tuple[str, str]] = {}
    try:
        with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="surrogateescape") as mountinfo:
            lines = mountinfo.readlines()
    except OSError:
        return found
    for line in lines:
        mount, separator, source = line.partition(" - ")
        fields = mount.split()
        if not separator or len(fields) < 5 or not source.split():
            continue
        major, _, minor = fields[2].partition(":")
        # NOTE: the kernel writes a space, tab, newline or backslash of a mount point as an octal escape
        mount_point = re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape[1], 8)), fields[4])
        try:
            found.setdefault(os.makedev(int(major), int(minor)), (source.split()[0], mount_point))
        except ValueError:
            continue
    return found


def held_by(pids, folder: Path = SHARED_MEMORY_DIR, disk_devices=frozenset()) -> HeldMemory:
    """What `pids` hold open or mapped in `folder` (files directly in it: an engine may make no folder there), and
    the files of `disk_devices` (those of an engine's own folders) they hold open or mapped that have no name left.

    A process in a mount namespace of its own (`namespaces.py`) has a `folder` of its own, a tmpfs: all of it is
    counted, held or not (its blocks and files: `statvfs` through `/proc/<pid>/root`), and the names of its files are
    not returned, which name other files here. So is, once, every other tmpfs not mounted here that `pids` hold a
    file of, whatever its path (another engine's /dev/shm: `_PrivateTmpfs`), measured through the open file itself
    (`/proc/<pid>/fd/<n>`, and `/proc/<pid>/map_files/<range>` for a file only mapped, which the kernel shows only
    to an agent with CAP_CHECKPOINT_RESTORE: without, a file only mapped counts only by its path, as in `folder`,
    and one of another tmpfs that no link of theirs measures, mounted nowhere they see, is `unmeasured`).

    NOTE: a file an engine unlinked in its folders while it holds it keeps its blocks on the disk, and no walk of the
    folders meets it: before, its engine wrote on through it past its bound (20 MB held, 4 kB counted: the review of
    the weights). Each one of `disk_devices` counts, once however many of `pids` hold it, by its blocks (`fstat`
    through `/proc/<pid>/fd/<n>`, `st_nlink` 0), or, held only mapped (its descriptor closed), by its largest
    mapping: the kernel lets no agent without CAP_CHECKPOINT_RESTORE `stat` a mapping's file."""
    own_folders: dict[int, tuple[int, int]] = {}  # device -> (bytes, files) of the processes' own `folder`s
    private = _PrivateTmpfs()
    try:
        # NOTE: a process's new mount namespace holds the node's `folder` until its init mounts its own there
        node_device = os.stat(folder).st_dev
    except OSError:
        node_device = None
    sizes: dict[tuple[int, int], int] = {}
    mapped: dict[tuple[int, int], int] = {}  # unlinked files known only by their mappings: the largest
    unnamed: dict[tuple[int, int], int] = {}  # files of `disk_devices` with no name left: blocks, or largest mapping
    unnamed_open: set[tuple[int, int]] = set()  # those measured by their blocks
    paths = set()
    hidden = False
    vanished = False  # a process gone while it was asked
    prefix = f"{folder}/"
    for pid in set(pids):
        fd_dir = f"/proc/{pid}/fd"
        own_view = in_own_mount_namespace(pid)
        root = "" if own_view else f"/proc/{pid}/root"
        if not own_view:
            try:
                device = os.stat(f"{root}{folder}").st_dev
                if device != node_device and device not in own_folders:
                    own_folders[device] = _usage(f"{root}{folder}")
            except PermissionError:
                hidden = True
                continue
            except OSError:
                pass  # gone, or no such folder: what it holds is counted below
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            hidden = True
            continue
        except OSError:
            vanished = True  # gone
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
                if not target.startswith("/"):
                    continue  # a socket, a pipe, an anonymous inode
                info = os.stat(f"{fd_dir}/{fd}")  # the open file itself, unlinked or not
            except OSError:
                continue
            private.measure(info.st_dev, f"{fd_dir}/{fd}")
            if not target.startswith(prefix):
                if info.st_dev in disk_devices and info.st_nlink == 0 and stat.S_ISREG(info.st_mode):
                    unnamed[(info.st_dev, info.st_ino)] = info.st_blocks * 512
                    unnamed_open.add((info.st_dev, info.st_ino))
                continue
            sizes[(info.st_dev, info.st_ino)] = info.st_blocks * 512
            if own_view and not target.endswith(" (deleted)"):
                paths.add(Path(target))
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                # a file of `folder`, or of a file system with an anonymous device (a tmpfs's: `_PrivateTmpfs`)
                lines = [parts for parts in (line.split(maxsplit=5) for line in maps)
                         if len(parts) == 6 and parts[4] != "0" and (parts[3].startswith("00:") or prefix in parts[5]
                                                                     or (disk_devices and " (deleted)" in parts[5]))]  # fmt: skip
        except PermissionError:
            hidden = True
            continue
        except OSError:
            vanished = True  # gone
            continue
        for parts in lines:
            start, end = (int(value, 16) for value in parts[0].split("-"))
            major, minor = (int(value, 16) for value in parts[3].split(":"))
            inode = (os.makedev(major, minor), int(parts[4]))
            if inode[0] in disk_devices and not parts[5].startswith(prefix):
                if inode not in unnamed_open and parts[5].rstrip("\n").endswith(" (deleted)"):
                    unnamed[inode] = max(unnamed.get(inode, 0), end - start)
                continue
            link = f"/proc/{pid}/map_files/{start:x}-{end:x}"
            private.measure(inode[0], link, mapped_as=parts[5].rstrip("\n"), pid=pid)
            if not parts[5].startswith(prefix):
                continue
            path = parts[5].rstrip("\n")
            if inode in sizes:
                continue
            if not path.endswith(" (deleted)"):
                try:
                    info = os.stat(root + path, follow_symlinks=False)
                except OSError:
                    info = None
                if info is not None and (info.st_dev, info.st_ino) == inode:
                    sizes[inode] = info.st_blocks * 512
                    if own_view:
                        paths.add(Path(path))
                    continue
            mapped[inode] = max(mapped.get(inode, 0), end - start)
    # each file once, by its blocks where known; each tmpfs not mounted here whole, once
    counted = {**mapped, **sizes}
    whole = {**{device: usage for device, usage in private.usage.items() if device not in own_folders},
             **own_folders}  # fmt: skip
    num_bytes = sum(size for (device, _), size in counted.items() if device not in whole)
    num_bytes += sum(num_bytes for num_bytes, _ in whole.values())
    num_files = sum(num_files for _, num_files in whole.values())
    num_bytes += sum(unnamed.values())
    num_files += len(unnamed)
    # NOTE: a whole tree gone meanwhile (its engine exited) holds nothing; one living on may hold what the gone held
    incomplete = (vanished or private.vanished) and any(os.path.exists(f"/proc/{pid}") for pid in set(pids))
    return HeldMemory(num_bytes, num_files, frozenset(paths), frozenset(sizes) | frozenset(mapped), hidden,
                      private.unmeasured(known=own_folders), incomplete)  # fmt: skip


def held_by_tree(pid: int, folder: Path = SHARED_MEMORY_DIR, disk_devices=frozenset()) -> HeldMemory:
    """`held_by` the processes of `pid`'s tree (`process_tree`: an engine's), `incomplete` too when the tree has a
    process after the walk that it did not have before: one born meanwhile, which may hold what one walked gave it.

    Walked again, up to `MAX_TREE_WALKS` times, until a walk is complete: a compiler a JIT runs now and then is born
    or exits during one walk, not during each of them.

    NOTE: a mapping relayed by fork and exit every millisecond was on a process gone by the time the walk asked it, or
    born after the tree was listed: 31 walks in 40 found neither its memory nor anything unmeasured."""
    for _ in range(MAX_TREE_WALKS):
        tree, complete = _scan_tree(pid)
        held = held_by(tree, folder, disk_devices)
        after, complete_after = _scan_tree(pid)
        if not held.incomplete and complete and complete_after and not after - tree:
            return held
    return replace(held, incomplete=True)


def remove_orphans(
    folder: Path, unheld_since: dict[tuple[int, int], float], *, older_than_s: float, now: float | None = None
) -> list[Path]:
    """Remove this user's files in `folder` that no process this user can read has held open or mapped at any of
    these calls for `older_than_s`: what an engine created and closed, or left when it was killed.

    `unheld_since` is the caller's record, (device, inode) -> when a call first found the file held by nobody
    (monotonic), updated here. NOTE: the agent's record, not the file's times, which its engine sets at will: one
    that touched its closed files kept them for ever. Every process readable is asked, not only engines: the agent's
    own, a zygote's or another program's of this user keep theirs. A file held only by another user's process loses
    its name, not its memory."""
    now = time.monotonic() if now is None else now
    uid = os.getuid()
    files: dict[tuple[int, int], Path] = {}
    try:
        entries = list(os.scandir(folder))
    except OSError:
        entries = []
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if info.st_uid == uid and stat.S_ISREG(info.st_mode):
            files[(info.st_dev, info.st_ino)] = Path(entry.path)
    held = frozenset()
    if files:
        held = held_by([int(entry) for entry in os.listdir("/proc") if entry.isdigit()], folder).inodes
    for inode in [inode for inode in unheld_since if inode not in files or inode in held]:
        del unheld_since[inode]
    removed = []
    for inode, path in files.items():
        if inode in held or now - unheld_since.setdefault(inode, now) < older_than_s:
            continue
        try:
            info = os.stat(path, follow_symlinks=False)
            if (info.st_dev, info.st_ino) == inode:  # not replaced meanwhile
                path.unlink()
                removed.append(path)
        except OSError:
            pass
        del unheld_since[inode]
    return removed
