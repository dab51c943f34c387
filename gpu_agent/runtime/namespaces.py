"""Each engine in its own user, PID and mount namespaces: its own /proc, and its own /dev/shm.

Engines on a node run as one Unix user and, before, shared /proc and /dev/shm. On a GPU node the sandbox lets an
engine write files in /proc (`sandbox.PROC_WRITE`: CUDA's driver names its threads there), so an engine could raise
a neighbour's `oom_score_adj` or renice its autogroup; and a neighbour that read a segment's name in
`/proc/<pid>/maps` could open and grow it in the shared /dev/shm, where it counted against its holder's bound.

`enter` runs in the engine's process (`sandbox.apply_from_environment`, before Landlock), single-threaded as
`unshare(CLONE_NEWUSER)` needs, and splits it in three:

    outer (the pid the agent knows)   new user + mount namespaces; waits for the init, forwards SIGTERM/SIGINT,
      |                               exits with its code
      init (PID 1 inside)             mounts a fresh procfs on /proc and a tmpfs of `max_bytes` and `max_files` on
        |                             /dev/shm, sets its namespace's `max_*_namespaces` to 0, then reaps, forwards
        |                             SIGTERM/SIGINT to the engine, exits with the engine's code
        engine (PID 2 inside)         returns from `enter` with no capabilities, and runs vLLM

The outer uid and gid map to themselves (not root). PID 1 gets only the signals it has a handler for, hence the
init; its exit makes the kernel kill everything left in the namespace (vLLM's EngineCore and workers), and with the
last process the namespace's /dev/shm and its memory go. The agent still sees every process by its outer pid (its
/proc is the host's), so its signals, its process-tree kill, its guards and a next agent's adoption work as before.
The init dies with the outer process (PR_SET_PDEATHSIG), so no namespace outlives the pid the agent holds.

In the same mount namespace the init hides the machine's Unix sockets (`_hide_socket_folders`): Landlock does not
govern connecting to a socket bound to a path, so an engine connected to any it could name (Docker's, containerd's,
PostgreSQL's, a local Redis's, D-Bus's, systemd's, another engine's vLLM sockets in its scratch folder under /tmp). Each
folder it is given (`MACHINE_SOCKET_FOLDERS`) is covered by an empty tmpfs, read-only, and only the paths the
engine is to reach below it are bound back (its own folders and model, what glibc's resolver and NVIDIA's driver read:
`sandbox.socket_folders_kept`); a socket that is not in a folder (/dev/log) is covered by /dev/null.

The engine, without capabilities, could still make user namespaces of its own (nested in its own: no capability is
needed), each counted against the node's `user.max_user_namespaces` of the one uid the agent and every engine share:
~7,000 a second, and then every next engine's `unshare` failed (ENOSPC). The init sets its user namespace's
`max_*_namespaces` to 0 (`NAMESPACE_LIMITS`; the engine cannot set them back, it has no CAP_SYS_RESOURCE), so the
engine makes none; and the tmpfs's `nr_inodes` bounds its files (300,000 empty files were ~300 MiB of the kernel's
memory that no byte bound counted).

Standard library only (the reaper and a zygote's child import it).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_CAPABILITY_VERSION_3 = 0x20080522
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DESCRIPTION = "own pid, mount and user namespaces"  # what the engine's log and the node's facts say
# The init's exit code when it could not set the namespaces up (the outer process then goes on without them).
EXIT_NOT_STARTED = 78
# The init's user namespace may make no namespaces below it: `max_<kind>_namespaces` of each kind set to 0. "user" must
# hold (the others need a capability the engine has not, or a user namespace first); a kernel without one (time
# before 5.6) lacks its file.
NAMESPACE_LIMITS = ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup", "time")
# The errors that refuse namespaces here (not allowed, not built in, the user's count of them reached), from `unshare`,
# the user's maps or the init's mounts and limits; any other (ENOMEM, EAGAIN) says nothing of them.
REFUSING_ERRNOS = frozenset({errno.EPERM, errno.EINVAL, errno.ENOSPC, errno.EUSERS})
# The machine's folders (and a socket of its own) that hold Unix sockets, hidden in an engine's mount namespace
# (`_hide_socket_folders`): Landlock does not govern connecting to a socket bound to a path. /run (and /var/run where it
# is not a link to it): Docker's, containerd's, PostgreSQL's, Redis's, D-Bus's, systemd's and journald's, and
# /run/user's; /tmp and /var/tmp: other engines' scratch folders (vLLM's sockets below Landlock ABI 6), PostgreSQL's
# where built so, tmux's and X11's; /var/lib: LXD's, MySQL's, the kubelet's, and the agent's data dir; /dev/log:
# syslog's, where it is a socket rather than a link into /run; /home and /root: user services' and Docker Desktop's;
# /srv; /var/spool: postfix's public sockets; /var/snap: snaps' (LXD's unix.socket, root on the host for its group, as
# Docker's); /dev/lxd: an LXD guest's API to its host (its configuration, cloud-init's user data). Landlock lets an
# engine read nothing there but its policy's paths, so hiding them takes away only the sockets. What the engine's
# policy names below them (its scratch folder, its model, the venv or a checkout under /tmp, an agent's data dir in a
# home folder) is bound back (`sandbox.socket_folders_kept`). /opt, which engines read and execute, stays.
MACHINE_SOCKET_FOLDERS = ("/run", "/var/run", "/tmp", "/var/tmp", "/var/lib", "/dev/log", "/home", "/root", "/srv",
                          "/var/spool", "/var/snap", "/dev/lxd")  # fmt: skip
# The empty tmpfs over each socket folder holds only the mount points of what is bound back: a few dozen.
HIDING_TMPFS = "size=1m,nr_inodes=1024,mode=0755"
TEST_TIMEOUT_S = 30  # the agent's test (`find`): past it, nothing is known
# How a tried set-up's child answers (`_tried_in_a_child`): the kernel refused, or something else stopped it.
_REFUSED, _NOT_KNOWN = b"R", b"U"


class NamespacesUnavailable(Exception):
    """The engine cannot have namespaces of its own here; the message says why."""


class NamespacesBroken(Exception):
    """The set-up failed half done: this process must not go on. `code`: the kernel's errno (None where not known); a
    refusal of namespaces only where it is one of `REFUSING_ERRNOS`."""

    def __init__(self, why: str, code: int | None) -> None:
        super().__init__(why)
        self.code = code

    @property
    def refused(self) -> bool:
        return self.code in REFUSING_ERRNOS


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result < 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _mount(libc, source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                   data.encode() if data else None),
        f"mounting {target}",
    )  # fmt: skip


def drop_capabilities() -> None:
    """Give up every capability (those of the new user namespace): what runs next cannot unmount its /proc to find
    the host's below it, nor mount anything else; and an `execve` gains none back (empty bounding set)."""
    libc = _libc()
    try:
        with open("/proc/sys/kernel/cap_last_cap") as handle:
            last = int(handle.read())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        # NOTE: fails only for a capability the kernel does not know
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    data = (_CapData * 2)()
    _check(libc.capset(ctypes.byref(_CapHeader(_CAPABILITY_VERSION_3, 0)), data), "capset")


@dataclass(slots=True, frozen=True)
class Finding:
    """What one test of namespaces here found: `missing` "" where they work, else why not; `known` False where the test
    itself could not answer (its process not started, killed, past its time, a fork refused for want of pids or
    memory): nothing is learnt of the kernel's answer then."""

    missing: str = ""
    known: bool = True


def find() -> Finding:
    """Whether this machine can give an engine namespaces of its own (the whole set-up, tried in a child process).

    A refusal is known only where the kernel said so (`unshare`, the user's maps or a mount refused with one of
    `REFUSING_ERRNOS`); a spawn error, a timeout, or any other error of the test (EAGAIN on a fork under a node's pid
    pressure, ENOMEM on a map write or a mount under its memory pressure) is not a refusal: `known` is False."""
    if not sys.platform.startswith("linux"):
        return Finding(f"not Linux ({sys.platform})")
    if platform.machine() not in ("x86_64", "aarch64"):
        return Finding(f"not known here for {platform.machine()}")
    script = "from gpu_agent.runtime import namespaces; namespaces._answer_test()"
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TEST_TIMEOUT_S,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return Finding(f"the test of namespaces did not run ({exc})", known=False)
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        return Finding(str(answer["missing"]), known=bool(answer["known"]))
    except (IndexError, ValueError, KeyError, TypeError):
        lines = done.stderr.strip().splitlines()
        why = lines[-1] if lines else f"exited with {done.returncode}"
        return Finding(f"the test of namespaces did not answer ({why})", known=False)


def _answer_test() -> None:
    """The test's child process (`find`): one line of JSON, its `Finding`."""
    finding = _tried_in_a_child()
    print(json.dumps({"missing": finding.missing, "known": finding.known}), flush=True)


def enter(max_bytes: int | None, *, max_files: int | None = None, tested: bool = False,
          hidden: tuple[str, ...] = (), kept: tuple[str, ...] = ()) -> str:
    """Move this process's future into new user, PID and mount namespaces (see the module's docstring); returns, in
    the engine (PID 2 inside, no capabilities), what isolates it. `max_bytes` and `max_files`: the size of its
    /dev/shm and how many files it holds (None: the kernel's default, half the memory and half its pages). `hidden`:
    the machine's socket folders to cover, and `kept` the paths below them bound back (`_hide_socket_folders`).

    NOTE: the process must be single-threaded (a fresh interpreter, or a fork's child). Raises NamespacesUnavailable
    where the kernel refuses them, with nothing changed here. Unless the agent `tested` them on this node already
    (`find`), the whole set-up is tried first in a child that then exits (`_tried_in_a_child`: ~8 ms in a
    fresh interpreter, ~150 ms in a zygote's fork, whose every fork copies vLLM's memory map; the set-up itself took 48
    ms there). Raises NamespacesBroken where it fails half done (a process left in a PID namespace whose init is gone
    cannot fork): this process must then end."""
    if not tested:
        why = _tried_in_a_child().missing
        if why:
            raise NamespacesUnavailable(why)
    return _split(max_bytes, max_files, hidden, kept)


def _tried_in_a_child() -> Finding:
    """Whether `_split` works here, the machine's socket folders hidden: tried in a child (and its own init and engine)
    that exit at once. The kernel's refusals (`NamespacesUnavailable`, `NamespacesBroken.refused`) are known; any other
    error (a fork refused, a map write or a mount short of memory) is not."""
    pid, pipe_end = _fork_with_pipe()
    if pid == 0:
        try:
            _split(4096, 16, MACHINE_SOCKET_FOLDERS)
        except NamespacesUnavailable as exc:
            os.write(pipe_end, _REFUSED + str(exc).encode())
        except NamespacesBroken as exc:
            os.write(pipe_end, (_REFUSED if exc.refused else _NOT_KNOWN) + str(exc).encode())
        except BaseException as exc:  # noqa: BLE001 - whatever stops it is the reason, and this child must end here
            os.write(pipe_end, _NOT_KNOWN + repr(exc).encode())
        os._exit(0)
    why = _read_to_end(pipe_end)
    os.waitpid(pid, 0)
    if not why:
        return Finding()
    return Finding(why[1:].decode(errors="replace"), known=why[:1] == _REFUSED)


def _fork_with_pipe() -> tuple[int, int]:
    """`os.fork` with a pipe from the child to this process, through which the child says why it stopped (nothing
    written and the pipe closed: it went on). Returns, in the child, 0 and the pipe's write end; here, the child's pid
    and the read end (`_read_to_end`). NOTE: stdout and stderr are flushed first, else the child writes their buffers
    again."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        return 0, write_end
    os.close(write_end)
    return pid, read_end


def _read_to_end(read_end: int) -> bytes:
    """All the child wrote to `_fork_with_pipe`'s pipe, once every copy of its write end is closed."""
    with os.fdopen(read_end, "rb") as answer:
        return answer.read()


def _split(max_bytes: int | None, max_files: int | None, hidden: tuple[str, ...] = (),
           kept: tuple[str, ...] = ()) -> str:
    """Unshare, map the user, fork the init (which forks the engine); wait here as the outer process. Raises
    NamespacesUnavailable where `unshare` is refused (nothing changed), NamespacesBroken on a later failure."""
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    previous = {signum: signal.getsignal(signum) for signum in FORWARDED_SIGNALS}
    # NOTE: the outer process and the init run only this module's code, and never gain a privilege either.
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    # NOTE: an IPC namespace too, not named in `DESCRIPTION` (the node's fact the control plane reads): in the node's,
    # a System V segment no process removed outlived its engine until the machine restarted, counted in no bound, and
    # any engine attached another's by its key. The namespace's segments and queues go with its last process.
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC) < 0:
        code = ctypes.get_errno()
        if code not in REFUSING_ERRNOS:  # short of memory: not the kernel's answer about namespaces
            raise OSError(code, f"unshare failed ({os.strerror(code)})")
        raise NamespacesUnavailable(f"unshare refused ({os.strerror(code)})")
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    except OSError as exc:
        raise NamespacesBroken(f"mapping the user failed ({exc.strerror})", exc.errno) from None
    init_pid, pipe_end = _fork_with_pipe()
    if init_pid == 0:
        return _run_init(libc, pipe_end, max_bytes, max_files, previous, hidden, kept)
    why = _read_to_end(pipe_end).decode(errors="replace")
    if why:  # the init stopped before the engine: "<errno> <why>"
        os.waitpid(init_pid, 0)
        code, _, message = why.partition(" ")
        raise NamespacesBroken(message, int(code) if code.isdigit() else None)
    _wait_forwarding(init_pid)


def _run_init(libc, answer_fd: int, max_bytes: int | None, max_files: int | None, previous,
              hidden: tuple[str, ...] = (), kept: tuple[str, ...] = ()) -> str:
    """PID 1 inside: mount, start the engine, then reap and forward until the engine exits. Returns in the engine."""
    # NOTE: armed while the outer process is alive: it waits for this process's answer.
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        _mount(libc, "none", "/", None, _MS_REC | _MS_PRIVATE)
        _mount(libc, "proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        size = f"size={max_bytes}," if max_bytes else ""
        size += f"nr_inodes={max_files}," if max_files else ""
        _mount(libc, "tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, f"{size}mode=1777")
        _hide_socket_folders(libc, hidden, kept)
        _forbid_namespaces()
    except OSError as exc:
        os.write(answer_fd, f"{exc.errno or 0} {exc.strerror}".encode())
        os._exit(EXIT_NOT_STARTED)
    engine = {"pid": None, "pending": []}

    def forward(signum, _frame):
        if engine["pid"] is None:
            engine["pending"].append(signum)
            return
        try:
            os.kill(engine["pid"], signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    pid = os.fork()
    if pid == 0:
        os.close(answer_fd)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        drop_capabilities()
        return DESCRIPTION
    engine["pid"] = pid
    os.close(answer_fd)  # nothing written: the engine runs
    for signum in engine["pending"]:
        forward(signum, None)
    while True:
        try:
            reaped, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if reaped == pid:
            code = os.waitstatus_to_exitcode(status)
            # NOTE: PID 1's exit makes the kernel kill whatever is left in the namespace.
            os._exit(code if code >= 0 else 128 - code)


def _hide_socket_folders(libc, hidden: tuple[str, ...], kept: tuple[str, ...]) -> None:
    """In the init: cover each of `hidden` (a folder: an empty tmpfs, read-only once the paths of `kept` below it are
    bound back on it; a socket or other file: /dev/null) and move to the working folder as it now is.

    NOTE: every path is resolved before anything is covered (a kept path below a covered folder is reached through a
    descriptor opened first), and the working folder is entered again by its name at the end: a process whose working
    folder stayed in a covered mount reached everything below it by relative paths ("../other-engine/socket")."""
    folders, files = [], []
    for path in dict.fromkeys(os.path.realpath(path) for path in hidden):
        if not os.path.lexists(path):
            continue
        (folders if os.path.isdir(path) else files).append(path)
    # NOTE: a folder or file below a hidden folder is covered with it (/var/run, a link to /run, resolved above; /dev/log,
    # on systemd's machines a link to journald's socket under /run, whose path names nothing once /run is covered).
    folders = [path for path in folders if not any(_beneath(path, other) for other in folders if other != path)]
    files = [path for path in files if not any(_beneath(path, folder) for folder in folders)]
    # Each kept path by its name and by where it leads, resolved once (~170 paths, ~1 ms; once per folder, 10 ms).
    resolved = {*map(os.path.abspath, kept), *map(os.path.realpath, kept)}
    mounts: list[tuple[str, list[tuple[str, int, bool]]]] = []
    try:
        for folder in folders:
            below = sorted(path for path in resolved if _beneath(path, folder) and path != folder)
            outermost = [path for index, path in enumerate(below) if not any(_beneath(path, other)
                                                                            for other in below[:index])]  # fmt: skip
            opened = []
            for path in outermost:
                try:
                    descriptor = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue  # not there: nothing to keep
                opened.append((path, descriptor, _is_folder(descriptor)))
            mounts.append((folder, opened))
        for folder, opened in mounts:
            _mount(libc, "tmpfs", folder, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, HIDING_TMPFS)
            for path, descriptor, is_dir in opened:
                if is_dir:
                    os.makedirs(path, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
                # NOTE: recursive: a mount below a kept path comes with it (and the kernel refuses a plain bind of a
                # tree holding mounts this user namespace did not make).
                _mount(libc, f"/proc/self/fd/{descriptor}", path, None, _MS_BIND | _MS_REC)
            _mount(libc, "none", folder, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    finally:
        for _folder, opened in mounts:
            for _path, descriptor, _is_dir in opened:
                os.close(descriptor)
    for path in files:
        _mount(libc, "/dev/null", path, None, _MS_BIND)
    try:
        os.chdir(os.getcwd())
    except OSError:  # covered: nothing of it is the engine's
        os.chdir("/")


def _is_folder(descriptor: int) -> bool:
    return stat.S_ISDIR(os.fstat(descriptor).st_mode)


def _beneath(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _forbid_namespaces() -> None:
    """In the init (capable in its user namespace): no process below may make namespaces (`NAMESPACE_LIMITS`)."""
    for kind in NAMESPACE_LIMITS:
        try:
            _write(f"/proc/sys/user/max_{kind}_namespaces", "0")
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and kind != "user":
                continue
            raise OSError(exc.errno, f"limiting {kind} namespaces: {exc.strerror}") from None


def _wait_forwarding(init_pid: int) -> None:
    """The outer process: forward SIGTERM and SIGINT to the init (the agent's, or the reaper's), exit with its code."""

    def forward(signum, _frame):
        try:
            os.kill(init_pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    while True:
        _, status = os.waitpid(init_pid, 0)
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
