"""Each engine confined with Linux Landlock: it reads its own model, writes its own folder, and nothing else.

Every engine on a node runs as the agent's Unix user, so without this an engine (vLLM reading one tenant's
files, or tricked by them) could read every other tenant's cached weights, the agent's state, other engines'
logs, open other engines' `/dev/shm` segments, and signal or trace other engines. The agent describes what
one engine may touch (`engine_policy`) and hands it to the engine in its environment (`POLICY_ENV`); the
engine applies it to itself (`apply_from_environment`) before vLLM reads anything of the tenant's: in
`engine_main` (a plain launch) and in `standby_process.become_engine` (a standby's handoff, a zygote's fork).
vLLM's own children (EngineCore, workers) inherit it. No root is needed; Landlock only ever takes rights away.
First, the engine moves into user, PID and mount namespaces of its own (`namespaces.py`): its own /proc, in which it
sees only its own processes, its own /dev/shm, bounded by the node's bound for one engine, and the machine's socket
folders hidden (`MACHINE_SOCKET_FOLDERS`: Landlock does not govern connecting to a socket bound to a path).

What an engine may do (`rules`):
- read and execute the system (/usr, /lib*, /bin, /sbin, /opt), Python's prefixes and the venv, and the agent's
  own package; read /proc and /sys, and each entry of /etc but the agent's settings (`ETC_LEFT_OUT`);
- read its model's folder, its draft model's, and the folder its LoRA adapters are staged in;
- read and write its own folders: a scratch folder made for each launch (HOME, TMPDIR) and its endpoint's cache
  folder (`engine_folder_env`), which the endpoint's replicas on the node share, and where none makes a socket or a
  FIFO (`SHARED_READ_WRITE`);
- read, write and ioctl the device nodes a GPU needs (`DEVICE_NODES`, `DEVICE_FOLDERS`), and create, open
  and remove files in /dev/shm, which it cannot list: the names there are random, so another engine's
  segments are out of reach without a listing;
- bind and connect TCP only to its serving port and the kernel's ephemeral range (`port_rules`, ABI 4: vLLM's,
  torch's and NCCL's ports between its own processes), never the metadata service, the control plane's stores or any
  HTTPS host, and make no socket but TCP, UDP, Unix and netlink ones (not MPTCP nor SMC, which Landlock leaves
  unruled and which fall back to TCP) nor io_uring (`socket_filter`);
- signal and connect to abstract Unix sockets only within its own processes (Landlock's scopes, ABI 6). vLLM's
  ZeroMQ sockets between its processes are made abstract there (`rpc_base_path`), so no other engine reaches
  them: Landlock does not govern connecting to a socket bound to a path, and below ABI 6 they are bound in the
  scratch folder, where another engine that learns their paths (`/proc/net/unix`) connects to them.

What stays shared, and why: vLLM's facts about its own model classes (`<VLLM_CACHE_ROOT>/modelinfos`, written
by the zygote before any engine starts and keyed by the hash of vLLM's code, not by anything a tenant names)
are read-only to engines: without them each cold start inspected its model class again (~20 s on CPU). vLLM's
and torch's compile caches (torch.compile, Inductor, Triton, CUDA's JIT cache) are per endpoint: a cache
written by one tenant's engine and loaded by another's would run the first tenant's code in the second's
engine, and a per-launch cache would compile again at every cold start. Nothing else an engine writes is seen
by another endpoint's engine.

The kernel's ABI decides what can be confined ("best effort", as the kernel's documentation advises): ABI 1
leaves renames across folders always refused (REFER comes with ABI 2), truncation unconfined before ABI 3,
TCP ports before ABI 4 (`required` refuses such a kernel, `best-effort` says "no tcp rules"), device ioctls before
ABI 5, signals and abstract sockets before ABI 6. The agent's `INFERPLANE_ENGINE_SANDBOX`
chooses what happens where Landlock is missing: `best-effort` (the default) starts engines unconfined and says
so in one log line and in the node's facts, `required` fails the replica with the reason, `off` confines
nothing. GPU paths (/dev/nvidia*, CUDA's caches, NCCL's /dev/shm segments, and writes in /proc: `PROC_WRITE`) were
checked on an H200 by `bench/gpu_sandbox_check.py` (CUDA, a CUDA graph, Triton, Inductor, a spawned CUDA child, CUDA
IPC, NCCL, NVML, all confined); no GPU runs the tests. The TCP rules came after that run: NCCL's bootstrap (it listens
on port 0 and connects to its ranks' ephemeral ports) is allowed by reasoning and by gloo's two ranks on CPU
(`tests/agent/test_engine_network_sandbox.py`); the bench's NCCL step now runs under them.
"""

from __future__ import annotations

import ctypes
import enum
import glob
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gpu_agent
from gpu_agent.runtime import namespaces, socket_filter

logger = logging.getLogger(__name__)

MODE_ENV = "INFERPLANE_ENGINE_SANDBOX"  # the agent's setting: a `SandboxMode`
POLICY_ENV = "INFERPLANE_ENGINE_SANDBOX_POLICY"  # one engine's `SandboxPolicy` as JSON, set by the agent
APPLIED_LINE = "inferplane: engine sandbox:"  # how the engine's log says what confines it
EXIT_REFUSED = 78  # an engine that would not start unconfined (`apply_from_environment`)
EXIT_NAMESPACES_REFUSED = 79  # ... refused namespaces the agent had found working: the agent tests them again


class SandboxMode(str, enum.Enum):  # noqa: UP042 - str() and format() of members stay as they are
    REQUIRED = "required"  # an engine that cannot be confined does not start
    BEST_EFFORT = "best-effort"  # confined where the kernel can; one clear line where it cannot
    OFF = "off"


DEFAULT_MODE = SandboxMode.BEST_EFFORT


class SandboxUnavailable(Exception):
    """Landlock cannot confine this process; the message says why."""


def parse_mode(text: str) -> SandboxMode:
    try:
        return SandboxMode(text.strip().lower())
    except ValueError:
        choices = ", ".join(mode.value for mode in SandboxMode)
        raise ValueError(f"{MODE_ENV} must be one of {choices}, not {text!r}") from None


# --- Landlock's interface (include/uapi/linux/landlock.h) ---------------------------------------------------

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # x86_64 and aarch64 alike
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2
TRUNCATE = 1 << 14  # ABI 3
IOCTL_DEV = 1 << 15  # ABI 5
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1  # ABI 6
BIND_TCP = 1 << 0  # ABI 4, a port's rule
CONNECT_TCP = 1 << 1  # ABI 4
TCP_ABI = 4
_RULE_NET_PORT = 2

# Rights that make sense on a file (the kernel refuses a file's rule with any other).
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
READ = READ_FILE | READ_DIR
READ_EXECUTE = READ | EXECUTE
READ_WRITE = (
    READ | WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO | MAKE_SYM
    | REFER | TRUNCATE
)  # fmt: skip
# NOTE: an endpoint's cache folder, which its replicas on a node share: no socket nor FIFO (vLLM's and torch's caches
# are files). Landlock does not govern connecting to a socket bound to a path, so replicas that met on one passed each
# other files of their own /dev/shm (SCM_RIGHTS), each keeping a stopped engine's whole tmpfs (`shared_memory.py`).
SHARED_READ_WRITE = READ_WRITE & ~(MAKE_SOCK | MAKE_FIFO)
DEVICE = READ_FILE | WRITE_FILE | IOCTL_DEV
# NOTE: no READ_DIR: an engine creates and opens its segments by name, and never learns another engine's.
SHARED_MEMORY = READ_FILE | WRITE_FILE | MAKE_REG | REMOVE_FILE | TRUNCATE
# NOTE: CUDA's driver names the threads it starts by writing `/proc/self/task/<tid>/comm`, and its cuInit fails
# (CUDA_ERROR_OPERATING_SYSTEM, 304: "no CUDA device" to PyTorch and vLLM) where that write is refused: seen on an
# H200 (`bench/gpu_sandbox_check.py`), where every engine confined with /proc read-only ran without its GPU. A
# rule names a path, and /proc/self resolves when the rule is made, to the process that makes it, never to
# vLLM's EngineCore and workers it spawns later: so an engine with GPUs may write files in /proc (never create or
# remove: /proc has no such thing). What that left, on another dumpable process of the same user (another
# engine's; the agent is not dumpable, its /proc files are root's): raising (never lowering) its `oom_score_adj`,
# its `coredump_filter` and `clear_refs`, and renicing its autogroup (CPU, where engines share the root cpu cgroup).
# In its own PID namespace (`namespaces.py`) an engine's /proc holds only its own processes: that reaches no other.
PROC_WRITE = READ_FILE | WRITE_FILE | TRUNCATE


def handled_rights(abi: int) -> int:
    """Every file right this ABI knows: what the ruleset takes away unless a rule gives it back."""
    rights = (MAKE_SYM << 1) - 1
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


def scopes(abi: int) -> int:
    return SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0


def handled_net(abi: int) -> int:
    """The TCP rights this ABI governs: every port not ruled is refused binding and connecting to."""
    return BIND_TCP | CONNECT_TCP if abi >= TCP_ABI else 0


# What a node's fact and an engine's line say where the kernel governs no TCP port (`protocol.ENGINE_SANDBOX_GAPS`).
NO_TCP_RULES = "no tcp rules: "


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]  # fmt: skip


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPortAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> tuple[int, str]:
    """Landlock's ABI version here, and why there is none (0) otherwise."""
    if not sys.platform.startswith("linux"):
        return 0, f"not Linux ({sys.platform})"
    if platform.machine() not in ("x86_64", "aarch64"):
        return 0, f"Landlock's system call numbers are not known here for {platform.machine()}"
    libc = _libc()
    abi = libc.syscall(
        _SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION)
    )
    if abi < 0:
        errno = ctypes.get_errno()
        why = {38: "the kernel has no Landlock (ENOSYS)", 95: "Landlock is not enabled at boot (EOPNOTSUPP)"}
        return 0, why.get(errno, f"landlock_create_ruleset failed: {os.strerror(errno)}")
    return abi, ""


def node_fact(mode: SandboxMode) -> str:
    """What confines this node's engines, for the node's facts: "landlock abi 6; own pid, mount and user namespaces",
    or "none: <reason>" for either part."""
    if mode == SandboxMode.OFF:
        return f"none: {MODE_ENV}=off"
    abi, why = landlock_abi()
    missing = namespaces_missing()
    return "; ".join([f"landlock abi {abi}{tcp_gap(abi)}" if abi else f"none: {why}",
                      f"no namespaces: {missing}" if missing else namespaces.DESCRIPTION])  # fmt: skip


def tcp_gap(abi: int) -> str:
    """What a node's fact adds where its kernel's Landlock governs no TCP port ("" where it does)."""
    return "" if abi >= TCP_ABI else f" ({NO_TCP_RULES}abi {abi} governs none, abi {TCP_ABI} does)"


class NamespacesFact:
    """What this agent knows of namespaces on its node (`namespaces.find`): "" they work, else why not.

    Tested once, at first use; then again off every lock (`retest_when_due`, a thread of its own: a test takes up to
    `namespaces.TEST_TIMEOUT_S` per attempt), when an engine found them refused (`engine_refused`) at most once per
    `retest_interval_s`, and every `recheck_missing_s` while they are missing, so a node recovers.

    NOTE: an engine's exit 79 is the tenant's to forge (its code runs in the engine), and it chose when the one re-test
    ran (under pid pressure it made itself: the fork refused, the fact became "missing" for the agent's life: `required`
    failed every launch, `best-effort` ran engines on the node's /proc and /dev/shm). Now a refusal replaces a working
    fact only when every one of `num_attempts` tests says the kernel refused; a test that could not answer (a spawn
    error, a timeout, a fork refused) keeps the last known answer.

    A refusal the kernel confirmed is kept across an agent restart (`keep`, `restore`: the agent's state file, with
    when it was tested): before, the next agent forgot it and tested again at first use, `num_attempts` times. The
    restored refusal is re-tested on the same schedule, from when it was tested. A working answer is not kept: the
    next agent's first test finds it at once (one test, ~8 ms).
    """

    def __init__(self, *, num_attempts: int = 3, attempt_pause_s: float = 1.0, retest_interval_s: float = 60.0,
                 recheck_missing_s: float = 300.0) -> None:  # fmt: skip
        self.num_attempts = num_attempts
        self.attempt_pause_s = attempt_pause_s
        self.retest_interval_s = retest_interval_s
        self.recheck_missing_s = recheck_missing_s
        self.num_retests = 0
        self._missing: str | None = None  # None: not tested yet
        self._tested_at = 0.0
        self._wanted = False  # an engine found them refused since the last test
        self._lock = threading.Lock()  # the first test, and the fields below
        self._retest: threading.Thread | None = None
        # Called under the lock with what to keep across a restart after each test the kernel answered: a refusal's
        # `record`, or None once they work (the agent's state file: `Agent`).
        self.keep: Callable[[dict | None], None] | None = None

    def missing(self) -> str:
        """The last known answer; tested here the first time."""
        with self._lock:
            if self._missing is None:
                self._missing, known = self._test(None)
                self._tested_at = time.monotonic()
                self._kept(known)
            return self._missing

    def restore(self, record) -> bool:
        """Take the refusal a previous agent on this boot of the node kept (`keep`): {"missing": why, "tested_at": its
        test's time on this boot's monotonic clock}, unless this agent knows an answer already. Whether it was taken;
        a record not of that shape is ignored with a log line."""
        if record is None:
            return False
        now = time.monotonic()
        try:
            missing, tested_at = record["missing"], float(record["tested_at"])
        except (TypeError, KeyError, ValueError):
            missing, tested_at = None, -1.0
        if not isinstance(missing, str) or not missing or len(missing) > 4096 or not 0 <= tested_at <= now:
            logger.warning("the namespaces' refusal kept by a previous agent is not one: ignored")
            return False
        with self._lock:
            if self._missing is not None:
                return False
            self._missing, self._tested_at = missing, tested_at
        logger.warning("namespaces missing, as a previous agent found %.0f s ago (tested again when due): %s",
                       now - tested_at, missing)  # fmt: skip
        return True

    def _kept(self, known: bool) -> None:
        """Under the lock: hand what a restart must not forget to `keep` (a known answer only)."""
        if known and self.keep is not None:
            self.keep({"missing": self._missing, "tested_at": self._tested_at} if self._missing else None)

    def engine_refused(self) -> None:
        """An engine's namespaces were refused where this agent had found them working: test again, when due."""
        with self._lock:
            self._wanted = True

    def retest_when_due(self) -> bool:
        """Start a re-test on its own thread if one is due and none runs; whether one runs now."""
        with self._lock:
            if self._retest is not None and self._retest.is_alive():
                return True
            since = time.monotonic() - self._tested_at
            due = self._missing is not None and (
                (self._wanted and since >= self.retest_interval_s)
                or (bool(self._missing) and since >= self.recheck_missing_s)
            )
            if not due:
                return False
            self._wanted = False
            self._retest = threading.Thread(target=self.retest, name="namespaces-retest", daemon=True)
            self._retest.start()
            return True

    def retest(self) -> str:
        """Test again (on the calling thread) and keep what is known; returns the fact."""
        with self._lock:
            last = self._missing
        found, known = self._test(last)
        with self._lock:
            self._missing, self._tested_at = found, time.monotonic()
            self.num_retests += 1
            self._kept(known)
        logger.warning("namespaces tested again: %s", f"missing: {found}" if found else "they work")
        return found

    def _test(self, last: str | None) -> tuple[str, bool]:
        """`num_attempts` tests: "" as soon as one finds them working; a refusal only where every one found it; `last`
        where one could not answer (with nothing known yet, None: its reason, until a re-test). And whether the kernel
        answered."""
        for attempt in range(self.num_attempts):
            if attempt:
                time.sleep(self.attempt_pause_s)
            finding = namespaces.find()
            if not finding.missing:
                return "", True
            if not finding.known:
                logger.warning("the test of namespaces could not answer (%s): keeping %r", finding.missing, last)
                return (finding.missing if last is None else last), False
        return finding.missing, True


NAMESPACES = NamespacesFact()  # this agent's, for every engine it starts


def namespaces_missing() -> str:
    """Why engines here cannot have namespaces of their own (`namespaces.py`), "" if they can: the agent's last
    known answer (`NamespacesFact`)."""
    return NAMESPACES.missing()


# --- What one engine may touch ------------------------------------------------------------------------------

SYSTEM_PATHS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/opt")
# /etc's entries that no engine reads: the agent's own settings (its join token; infra/systemd).
ETC_LEFT_OUT = frozenset({"inferplane"})
DEVICE_NODES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
# GPUs' device nodes and folders (NVIDIA's, DRM's, InfiniBand's for NCCL): allowed by reasoning, no GPU here.
DEVICE_GLOBS = ("/dev/nvidia*",)
DEVICE_FOLDERS = ("/dev/nvidia-caps", "/dev/dri", "/dev/infiniband")
SHARED_MEMORY_DIR = "/dev/shm"
# The files an engine's own /dev/shm holds at most (`namespaces.enter`: its tmpfs's `nr_inodes`; each costs the kernel
# ~1 KiB that no byte bound counts): vLLM's ring buffers and NCCL's segments are tens.
SHARED_MEMORY_MAX_FILES = 4096
# The kernel's range of ephemeral ports (`ephemeral_ports`): what bind(port 0) takes, and what vLLM's `get_open_port`,
# torch's process groups (gloo) and NCCL's bootstrap bind and connect to between an engine's own processes.
EPHEMERAL_PORTS_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
# NOTE: ports no engine reaches even where an operator's ephemeral range covers them: the control plane's stores
# (PostgreSQL, PgBouncer, Redis and its Sentinel) and a cluster's control (etcd, the Kubernetes API, the kubelet).
# Every port below 1024 (the metadata service's 80, HTTPS, SMTP's 25/465/587, DNS) is out of any range too.
NEVER_REACHED_PORTS = frozenset({2379, 2380, 5432, 6379, 6432, 6443, 10250, 26379})
MIN_EPHEMERAL_PORT = 1024
MACHINE_SOCKET_FOLDERS = namespaces.MACHINE_SOCKET_FOLDERS  # hidden in an engine's mount namespace
# What an engine keeps of those folders beside its policy's paths, matched as globs in the engine (`glob`), each
# bound back where it exists: glibc's resolver (systemd-resolved's resolv.conf where /etc/resolv.conf links to it,
# nscd's socket, whose answers are those of /etc's files and DNS, which the engine reads anyway), and NVIDIA's
# daemons (nvidia-persistenced's socket, the fabric manager's folder, `/run/nvidia-*`), kept by reasoning: unrun on a
# GPU. /etc's entries that link into a hidden folder (/etc/resolv.conf into /run/resolvconf or NetworkManager's) are
# in the policy: bound back as files.
SOCKET_FOLDERS_KEPT = ("/run/systemd/resolve", "/run/nscd", "/var/run/nscd", "/run/nvidia-*", "/var/run/nvidia-*")


@dataclass(slots=True, frozen=True)
class SandboxPolicy:
    """What one engine may touch; the rest of the machine is out of its reach once applied."""

    mode: SandboxMode = DEFAULT_MODE
    read_execute: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    read_write: tuple[str, ...] = ()
    shared_read_write: tuple[str, ...] = ()  # written by other engines too: no socket nor FIFO there
    devices: tuple[str, ...] = ()
    shared_memory: str = SHARED_MEMORY_DIR
    proc_writable: bool = False  # an engine with GPUs: CUDA writes its threads' names (`PROC_WRITE`)
    # The size of the engine's own /dev/shm (`namespaces.enter`): the node's bound for one engine; None: the kernel's.
    shared_memory_max_bytes: int | None = None
    # How many files its own /dev/shm holds (`SHARED_MEMORY_MAX_FILES` at most); None: the kernel's default.
    shared_memory_max_files: int | None = None
    # What the agent found of namespaces on its node (`namespaces_missing`): "" they work, else why not; None: the
    # agent did not say, and the engine tries them in a child first.
    namespaces_missing: str | None = None
    # The TCP ports it may bind and connect to (Landlock ABI 4): its own serving port(s), and the kernel's ephemeral
    # range when the policy was made, first and last (`ephemeral_ports`; None: none). Every other port is refused.
    tcp_ports: tuple[int, ...] = ()
    ephemeral_ports: tuple[int, int] | None = None
    # The machine's folders holding Unix sockets that its mount namespace hides (`MACHINE_SOCKET_FOLDERS`); () none.
    socket_folders: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for path in (*self.read_execute, *self.read, *self.read_write, *self.shared_read_write, *self.devices,
                     self.shared_memory, *self.socket_folders):  # fmt: skip
            if not os.path.isabs(path):
                raise ValueError(f"a sandbox path must be absolute, not {path!r}")
        for name in ("shared_memory_max_bytes", "shared_memory_max_files"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive or None, not {getattr(self, name)}")
        for port in (*self.tcp_ports, *(self.ephemeral_ports or ())):
            if not 1 <= port <= 65535:
                raise ValueError(f"a TCP port is 1 to 65535, not {port}")
        if self.ephemeral_ports is not None and (len(self.ephemeral_ports) != 2
                                                 or self.ephemeral_ports[0] > self.ephemeral_ports[1]):
            raise ValueError(f"ephemeral_ports must be (first, last), not {self.ephemeral_ports}")

    def to_json(self) -> str:
        return json.dumps({
            "mode": self.mode.value, "read_execute": self.read_execute, "read": self.read,
            "read_write": self.read_write, "shared_read_write": self.shared_read_write, "devices": self.devices,
            "shared_memory": self.shared_memory,
            "proc_writable": self.proc_writable, "shared_memory_max_bytes": self.shared_memory_max_bytes,
            "shared_memory_max_files": self.shared_memory_max_files, "namespaces_missing": self.namespaces_missing,
            "tcp_ports": self.tcp_ports, "ephemeral_ports": self.ephemeral_ports,
            "socket_folders": self.socket_folders,
        })  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> SandboxPolicy:
        data = json.loads(text)
        return cls(
            mode=SandboxMode(data["mode"]),
            **{name: tuple(data[name]) for name in ("read_execute", "read", "read_write", "devices")},
            shared_read_write=tuple(data.get("shared_read_write", ())),
            shared_memory=data["shared_memory"],
            proc_writable=bool(data.get("proc_writable", False)),
            shared_memory_max_bytes=data.get("shared_memory_max_bytes"),
            shared_memory_max_files=data.get("shared_memory_max_files"),
            namespaces_missing=data.get("namespaces_missing"),
            tcp_ports=tuple(data.get("tcp_ports", ())),
            ephemeral_ports=tuple(data["ephemeral_ports"]) if data.get("ephemeral_ports") else None,
            socket_folders=tuple(data.get("socket_folders", ())),
        )


def system_read_execute() -> list[str]:
    """The system's programs and libraries, Python's prefixes (the venv's and the interpreter's) and the agent."""
    paths = [*SYSTEM_PATHS, sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
    paths.append(os.path.dirname(os.path.realpath(sys.executable)))
    # NOTE: the agent's package alone, never the folder above it: run from a checkout, that holds its data too.
    paths.append(os.path.dirname(os.path.abspath(gpu_agent.__file__)))
    return paths


def system_read() -> list[str]:
    """/proc, /sys and /etc, less the agent's settings in /etc."""
    paths = ["/proc", "/sys"]
    try:
        paths += [entry.path for entry in os.scandir("/etc") if entry.name not in ETC_LEFT_OUT]
    except OSError:
        pass
    return paths


def device_nodes() -> list[str]:
    found = [*DEVICE_NODES, *DEVICE_FOLDERS]
    for pattern in DEVICE_GLOBS:
        found += glob.glob(pattern)
    return found


def ephemeral_ports(path: str = EPHEMERAL_PORTS_FILE) -> tuple[int, int] | None:
    """The kernel's ephemeral port range (first, last) as it is now, from `MIN_EPHEMERAL_PORT` up; None where it
    cannot be read (then an engine binds and connects to its own ports only)."""
    try:
        with open(path) as found:
            first, last = (int(part) for part in found.read().split())
    except (OSError, ValueError):
        logger.warning("the kernel's ephemeral port range (%s) could not be read: engines get none", path)
        return None
    first, last = max(first, MIN_EPHEMERAL_PORT), min(last, 65535)
    return (first, last) if first <= last else None


def engine_policy(
    mode: SandboxMode, *, model_dirs, own_dirs, shared_dirs=(), shared_read=(),
    shared_memory_max_bytes=None, shared_memory_max_files=None, namespaces_missing=None, tcp_ports=(),
) -> SandboxPolicy:
    """The policy of one engine: its model folders (`model_dirs`: model, draft, adapters) and shared read-only
    caches to read, its own folders (`own_dirs`) to write, folders it writes with other engines (`shared_dirs`: its
    endpoint's cache) without a socket or FIFO there, its own /dev/shm's size and files (at most
    `SHARED_MEMORY_MAX_FILES`) and whether its namespaces work here (`namespaces_missing`, None: the engine tries),
    the TCP ports it serves on (`tcp_ports`; with the kernel's ephemeral range, the only ports it binds and connects
    to), and what every engine needs of the system."""
    devices = tuple(_unique(device_nodes()))
    return SandboxPolicy(
        mode=mode,
        read_execute=tuple(_unique(system_read_execute())),
        read=tuple(_unique([*system_read(), *map(str, model_dirs), *map(str, shared_read)])),
        read_write=tuple(_unique(map(str, own_dirs))),
        shared_read_write=tuple(_unique(map(str, shared_dirs))),
        devices=devices,
        proc_writable=has_nvidia_gpu(devices),
        shared_memory_max_bytes=shared_memory_max_bytes,
        shared_memory_max_files=min(shared_memory_max_files or SHARED_MEMORY_MAX_FILES, SHARED_MEMORY_MAX_FILES),
        namespaces_missing=namespaces_missing,
        tcp_ports=tuple(dict.fromkeys(int(port) for port in tcp_ports)),
        ephemeral_ports=ephemeral_ports(),
        socket_folders=MACHINE_SOCKET_FOLDERS,
    )


def socket_folders_kept(policy: SandboxPolicy) -> tuple[str, ...]:
    """What an engine's mount namespace binds back below the folders it hides (`SandboxPolicy.socket_folders`): every
    path its policy names (its Landlock rules' paths: those it reaches) and `SOCKET_FOLDERS_KEPT` where they exist."""
    kept = [*policy.read_execute, *policy.read, *policy.read_write, *policy.shared_read_write, *policy.devices]
    for pattern in SOCKET_FOLDERS_KEPT:
        kept += glob.glob(pattern)
    return tuple(dict.fromkeys(kept))


def has_nvidia_gpu(devices) -> bool:
    """Whether a GPU's or NVIDIA's control device node is among `devices` (found by `DEVICE_GLOBS`, so present):
    an engine here may run CUDA (`PROC_WRITE`)."""
    return any(_NVIDIA_NODE.fullmatch(os.path.basename(path)) for path in devices)


_NVIDIA_NODE = re.compile(r"nvidia(?:\d+|ctl)")


def _unique(paths) -> list[str]:
    return list(dict.fromkeys(os.path.abspath(path) for path in paths))


@dataclass(slots=True, frozen=True)
class Ruleset:
    handled: int
    scoped: int
    rules: tuple[tuple[str, int], ...]  # (path, rights), paths that exist only
    handled_net: int = 0
    port_rules: tuple[tuple[int, int], ...] = ()  # (port, rights); port 0: bind(port 0), an ephemeral port


def port_rules(policy: SandboxPolicy) -> tuple[tuple[int, int], ...]:
    """The TCP ports an engine binds and connects to: its own, and the ephemeral range less `NEVER_REACHED_PORTS`;
    and bind(port 0), which the kernel answers with a port of its ephemeral range.

    NOTE: one rule per port (Landlock has no ranges): the default range (32768-60999) makes 28,233 rules, ~115 ms
    to add on a 2-core CI machine, once per engine start."""
    ports = dict.fromkeys(policy.tcp_ports)
    if policy.ephemeral_ports is not None:
        first, last = policy.ephemeral_ports
        ports.update(dict.fromkeys(port for port in range(first, last + 1) if port not in NEVER_REACHED_PORTS))
    return ((0, BIND_TCP), *((port, BIND_TCP | CONNECT_TCP) for port in ports))


def rules(policy: SandboxPolicy, abi: int) -> Ruleset:
    """The Landlock rules of `policy` under this ABI: rights it does not know are dropped, a file's rule keeps
    only a file's rights, and a path that does not exist gets no rule (nothing to reach)."""
    handled = handled_rights(abi)
    wanted = [
        *((path, READ_EXECUTE) for path in policy.read_execute),
        *((path, READ) for path in policy.read),
        *((path, READ_WRITE) for path in policy.read_write),
        *((path, SHARED_READ_WRITE) for path in policy.shared_read_write),
        *((path, DEVICE) for path in policy.devices),
        (policy.shared_memory, SHARED_MEMORY),
        *((("/proc", PROC_WRITE),) if policy.proc_writable else ()),
    ]
    found = []
    for path, rights in wanted:
        try:
            is_dir = os.path.isdir(path)  # NOTE: follows links, as opening the path for the rule does
            if not (is_dir or os.path.exists(path)):
                continue
        except OSError:
            continue
        rights &= handled if is_dir else handled & FILE_RIGHTS
        if rights:
            found.append((path, rights))
    net = handled_net(abi)
    return Ruleset(handled=handled, scoped=scopes(abi), rules=tuple(found), handled_net=net,
                   port_rules=port_rules(policy) if net else ())  # fmt: skip


def num_threads() -> int:
    """How many threads this process has (Landlock confines only the thread that asks)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def apply(policy: SandboxPolicy) -> str:
    """Confine this process and everything it starts from now on; returns what confines it ("landlock abi 6").

    NOTE: the process must be single-threaded (a fork's child right after the fork, or a fresh interpreter):
    `landlock_restrict_self` confines the calling thread only, and a thread left out would keep every right.
    Raises SandboxUnavailable (nothing changed) when Landlock is missing or the process has threads, or, with a
    `required` policy, when it governs no TCP port (below ABI 4: `best-effort` confines the files and says so).
    Where TCP ports are ruled, sockets but TCP, UDP, Unix and netlink ones and io_uring are refused too
    (`socket_filter`: Landlock does not rule MPTCP nor SMC, which fall back to TCP).
    """
    abi, why = landlock_abi()
    if not abi:
        raise SandboxUnavailable(why)
    if abi < TCP_ABI and policy.mode == SandboxMode.REQUIRED:
        raise SandboxUnavailable(f"Landlock abi {abi} governs no TCP port (abi {TCP_ABI} does)")
    threads = num_threads()
    if threads != 1:
        raise SandboxUnavailable(f"the process has {threads} threads, and Landlock would confine one")
    ruleset = rules(policy, abi)
    if ruleset.handled_net and not socket_filter.supported():
        raise SandboxUnavailable(f"no seccomp filter for {platform.machine()}, and Landlock leaves MPTCP unruled")
    libc = _libc()
    attr = _RulesetAttr(ruleset.handled, ruleset.handled_net, ruleset.scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the fields this ABI knows
    ruleset_fd = libc.syscall(
        _SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)
    )
    if ruleset_fd < 0:
        raise SandboxUnavailable(f"landlock_create_ruleset failed: {os.strerror(ctypes.get_errno())}")
    try:
        for path, rights in ruleset.rules:
            try:
                path_fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # gone since `rules` looked: nothing to reach there
            try:
                beneath = _PathBeneathAttr(rights, path_fd)
                if libc.syscall(_SYS_ADD_RULE, ruleset_fd, _RULE_PATH_BENEATH, ctypes.byref(beneath), 0) < 0:
                    raise SandboxUnavailable(
                        f"landlock_add_rule({path}) failed: {os.strerror(ctypes.get_errno())}"
                    )
            finally:
                os.close(path_fd)
        for port, rights in ruleset.port_rules:
            attr_port = _NetPortAttr(rights, port)
            if libc.syscall(_SYS_ADD_RULE, ruleset_fd, _RULE_NET_PORT, ctypes.byref(attr_port), 0) < 0:
                raise SandboxUnavailable(f"landlock_add_rule(port {port}) failed: {os.strerror(ctypes.get_errno())}")
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0:
            raise SandboxUnavailable(f"PR_SET_NO_NEW_PRIVS failed: {os.strerror(ctypes.get_errno())}")
        if ruleset.handled_net:
            try:
                socket_filter.install(libc)
            except OSError as exc:
                raise SandboxUnavailable(str(exc)) from None
        if libc.syscall(_SYS_RESTRICT_SELF, ruleset_fd, 0) < 0:
            raise SandboxUnavailable(f"landlock_restrict_self failed: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset_fd)
    scoped = ", signals and abstract sockets scoped" if ruleset.scoped else ""
    return f"landlock abi {abi} ({len(ruleset.rules)} rules{scoped}; {describe_tcp(policy, abi)})"


def describe_tcp(policy: SandboxPolicy, abi: int) -> str:
    """What an engine's line says of its TCP ports: "tcp: ports 8123 and 32768-60999 only, no MPTCP"."""
    if abi < TCP_ABI:
        return f"{NO_TCP_RULES}abi {abi} governs none, abi {TCP_ABI} does"
    ranges = [str(port) for port in policy.tcp_ports]
    if policy.ephemeral_ports is not None:
        ranges.append("{}-{}".format(*policy.ephemeral_ports))
    return f"tcp: ports {' and '.join(ranges) or 'none'} only, no MPTCP"


def apply_from_environment() -> None:
    """In an engine, before vLLM reads anything of the tenant's: give it namespaces of its own (`namespaces.enter`:
    its own /proc and /dev/shm; this process then returns only in the engine), then apply the policy the agent set in
    `POLICY_ENV`.

    Writes one line saying what confines the engine (`APPLIED_LINE`). Where Landlock or the namespaces cannot be had,
    a `required` policy ends the process with the reason (the replica fails with it); `best-effort` goes on without,
    unless the agent found namespaces working on this node: their refusal now (a node's user namespaces exhausted)
    ends the process whatever the mode (`EXIT_NAMESPACES_REFUSED`: the agent tests them again), never a silent start
    without them.
    """
    text = os.environ.pop(POLICY_ENV, None)
    if not text:
        return  # not an engine the agent confines (sandbox off, or a command it did not build)
    policy = SandboxPolicy.from_json(text)
    try:
        if policy.namespaces_missing:  # the agent found them refused on this node: not tried again
            raise namespaces.NamespacesUnavailable(policy.namespaces_missing)
        isolated_by = namespaces.enter(policy.shared_memory_max_bytes, max_files=policy.shared_memory_max_files,
                                       tested=policy.namespaces_missing == "", hidden=policy.socket_folders,
                                       kept=socket_folders_kept(policy))  # fmt: skip
        if policy.socket_folders:
            isolated_by += f" (the machine's sockets hidden: {', '.join(policy.socket_folders)})"
    except namespaces.NamespacesUnavailable as exc:
        if policy.namespaces_missing == "":
            _refuse(f"no namespaces: {exc}", "though the agent found them working here, whatever the mode",
                    EXIT_NAMESPACES_REFUSED)  # fmt: skip
        if policy.mode == SandboxMode.REQUIRED:
            _refuse(f"no namespaces: {exc}")
        isolated_by = f"no namespaces: {exc} ({MODE_ENV}=best-effort: {SHARED_WITHOUT_NAMESPACES})"
    except namespaces.NamespacesBroken as exc:  # whatever the mode: this process cannot start vLLM's processes
        _refuse(f"namespaces half set up: {exc}", "whatever the mode")
    try:
        confined_by = apply(policy)
    except SandboxUnavailable as exc:
        if policy.mode == SandboxMode.REQUIRED:
            _refuse(str(exc))
        print(
            f"{APPLIED_LINE} none: {exc} ({MODE_ENV}=best-effort: running unconfined); {isolated_by}",
            file=sys.stderr,
            flush=True,
        )
        return
    print(f"{APPLIED_LINE} {confined_by}; {isolated_by}", file=sys.stderr, flush=True)


# What an engine without namespaces of its own shares with the machine (its log line; a node's fact says "no namespaces").
SHARED_WITHOUT_NAMESPACES = "sharing /proc, /dev/shm and the machine's Unix sockets"


def _refuse(why: str, because: str = f"{MODE_ENV}=required", exit_code: int = EXIT_REFUSED) -> None:
    print(f"{APPLIED_LINE} none: {why}; {because}: not starting", file=sys.stderr, flush=True)
    sys.stderr.flush()
    os._exit(exit_code)


# --- An engine's own folders ----------------------------------------------------------------------------------


def shared_vllm_cache_root(environ=None) -> Path:
    """vLLM's cache folder of the agent (and its zygote), as vLLM computes it."""
    environ = os.environ if environ is None else environ
    default = os.path.join(environ.get("XDG_CACHE_HOME", "~/.cache"), "vllm")
    return Path(os.path.expanduser(environ.get("VLLM_CACHE_ROOT", default)))


SCRATCH_PREFIX = "inferplane-engine-"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")


def folder_name(identifier: str) -> str:
    """A replica's or endpoint's id as one folder's name: as it is when plain (the control plane's UUIDs), else a
    digest of it, so that no id the control plane sends names a folder elsewhere in the data dir."""
    if _PLAIN_NAME.fullmatch(identifier):
        return identifier
    return "id-" + hashlib.sha256(identifier.encode()).hexdigest()[:32]


SCRATCH_OWNER_FILE = ".inferplane-data-dir"  # in a scratch folder: the data dir of the agent that made it


def _scratch_prefix(replica_id: str) -> str:
    return f"{SCRATCH_PREFIX}{hashlib.sha256(replica_id.encode()).hexdigest()[:12]}-"


def make_scratch_folder(data_dir: Path, replica_id: str) -> Path:
    """A new folder of one launch of `replica_id` (its HOME and TMPDIR), private to the agent's user, that names its
    agent, and whose name names the replica.

    NOTE: short, in the system's temporary folder rather than the data dir: below Landlock ABI 6, vLLM's processes
    talk over Unix sockets made here (`rpc_base_path`), whose paths may be at most 107 bytes.
    """
    folder = Path(tempfile.mkdtemp(prefix=_scratch_prefix(replica_id)))
    (folder / SCRATCH_OWNER_FILE).write_text(str(data_dir))
    return folder


def is_scratch_folder(path: Path, replica_id: str, data_dir: Path) -> bool:
    """Whether `path` is a folder `make_scratch_folder` made for `replica_id` by the agent of `data_dir` (an adopted
    engine's, to be removed with it).

    NOTE: the path comes from the engine's environment block, which the engine may rewrite: one that named another
    engine's live folder there had it removed when it ended itself (the review of the sandbox). Its name must be
    `replica_id`'s, which no other engine's is."""
    return (path.parent == Path(tempfile.gettempdir()) and path.name.startswith(_scratch_prefix(replica_id))
            and _scratch_owner(path) == str(data_dir))


def recorded_scratch_folder(recorded: object, replica_id: str) -> Path | None:
    """The scratch folder an agent's state file records for `replica_id` (`state_file.recorded_scratch`), when it is a
    name `make_scratch_folder` gives that replica: a direct child of the temporary folder with the replica's prefix
    (None otherwise, logged). It need not exist: removed meanwhile, it is nothing to adopt or remove.

    NOTE: the agent's own record, never the engine's owner file or environment block (both the engine's to rewrite).
    Before, a restarted agent went by those: an adopted engine that removed its owner file (or rewrote its TMPDIR) had
    its scratch unmeasured, written past every bound; one killed kept its folder for ever; and a rewritten TMPDIR had
    the live engine's real folder swept as a leftover (the review of the engines' folders). The state file is the
    agent's, but a path in it is taken only where this agent would have made it."""
    if recorded is None:
        return None
    path = Path(recorded) if isinstance(recorded, str) and recorded else None
    if (path is None or os.path.normpath(recorded) != recorded or path.parent != Path(tempfile.gettempdir())
            or not path.name.startswith(_scratch_prefix(replica_id))):
        logger.warning("replica %s: its record names %r as its scratch folder, which is not one this agent makes "
                       "for it: ignored", replica_id, recorded)  # fmt: skip
        return None
    return path


def scratch_folders_of(data_dir: Path) -> list[Path]:
    """The scratch folders the agent of `data_dir` made, by their owner files: a fallback for what no record names
    (an older agent's records, which named none; a folder made just before its agent was killed, before the agent's
    state file named it, no engine started in it yet). What the state file names (its engines' records, and the
    folders made for launches not yet recorded: `state_file.MADE_SCRATCH_KEY`) goes by it (`recorded_scratch_folder`),
    whatever the engine did to this file.

    NOTE: an engine can write only its own folder's owner file; it cannot make a folder here."""
    return [folder for folder in Path(tempfile.gettempdir()).glob(SCRATCH_PREFIX + "*")
            if _scratch_owner(folder) == str(data_dir)]


def _aside_prefix(data_dir: Path) -> str:
    return f"{SCRATCH_PREFIX}removing-{hashlib.sha256(str(data_dir).encode()).hexdigest()[:12]}-"


def set_scratch_aside(folder: Path | None, data_dir: Path) -> Path | None:
    """Rename an ended engine's scratch folder to a name that says which agent removes it (`scratch_set_aside_of`);
    None when there is nothing to rename. NOTE: under the supervisor's lock, before it is removed outside it: the
    name is the agent's, not the engine's owner file, which the engine may remove, and a walk that removed that file
    first and then stopped (a folder moved under it) left a folder no agent's sweep found again (the review)."""
    if folder is None:
        return None
    aside = folder.with_name(f"{_aside_prefix(data_dir)}{uuid.uuid4().hex[:12]}")
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return None
    return aside


def scratch_set_aside_of(data_dir: Path) -> list[Path]:
    """The scratch folders the agent of `data_dir` set aside and did not remove (killed meanwhile), by their names."""
    return list(Path(tempfile.gettempdir()).glob(_aside_prefix(data_dir) + "*"))


# The most of an owner file read: a data dir's path.
_MAX_OWNER_BYTES = 4096


def _scratch_owner(folder: Path) -> str | None:
    """What the folder's owner file says (the data dir of the agent that made it), or None when it is not a plain file.

    NOTE: the folder is its engine's to write, and Landlock lets it make a FIFO or a link there: read without following
    a link, never from a FIFO or a device, and no more than a path. Before, a new agent looking for what a killed one
    left (at its start, under the supervisor's lock) opened an engine's FIFO and waited for a writer for ever, every
    restart of the node's agent, or read a link to /dev/zero until it ran out of memory
    (`tests/agent/test_engine_sandbox.py`)."""
    try:
        descriptor = os.open(folder / SCRATCH_OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return None
        return os.read(descriptor, _MAX_OWNER_BYTES + 1).decode("utf-8", errors="replace")
    except OSError:
        return None
    finally:
        os.close(descriptor)


def prepare_cache_folder(cache_dir: Path, shared_cache_root: Path) -> None:
    """An endpoint's cache folder, with vLLM's model facts shared read-only from the zygote's cache.

    NOTE: the folder is its endpoint's engines' to write (others may run while a launch prepares it): its `vllm` is
    reached through a descriptor opened without following a link, and a link or file an engine left there goes.
    Before, the agent made its `modelinfos` link wherever such a link pointed (another tenant's cached model)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    folder = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        vllm_cache = _own_folder(folder, "vllm")
        try:
            os.symlink(shared_cache_root / "modelinfos", "modelinfos", target_is_directory=True, dir_fd=vllm_cache)
        except FileExistsError:
            pass
        finally:
            os.close(vllm_cache)
    finally:
        os.close(folder)


def _own_folder(parent: int, name: str) -> int:
    """A descriptor of the folder `name` in `parent`, made if missing; whatever else is there (a link) is removed."""
    for _ in range(3):
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            pass
        try:
            return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except OSError:  # ELOOP: a link; ENOTDIR: a file
            try:
                os.unlink(name, dir_fd=parent)
            except OSError:
                pass
    raise OSError(f"{name} keeps being replaced")


# The start of vLLM's IPC sockets' base in the abstract namespace (`rpc_base_path`).
ABSTRACT_SOCKET_PREFIX = "@inferplane-"


def rpc_base_path(scratch_dir: Path, mode: SandboxMode) -> str:
    """Where one launch's vLLM makes the ZeroMQ `ipc://` sockets between its processes (`VLLM_RPC_BASE_PATH`).

    Where the engine is to be confined (`mode` not off) and Landlock scopes abstract Unix sockets (ABI 6), an abstract
    name of this launch (`@inferplane-<digest of its
    scratch folder>`, which libzmq binds in the abstract namespace): another engine, in its own Landlock domain, is
    refused connecting to it. Below, the scratch folder: Landlock does not govern connecting to a socket bound to a
    path, so another engine that learns its path (`/proc/net/unix` lists them) reaches it. An engine left unconfined
(the mode off) keeps the scratch folder too: nothing would scope an abstract name.

    NOTE: an abstract socket has no file permissions: a process of another Unix user in the node's network namespace,
    and not confined, may connect to it, where the scratch folder (0700, under the agent's private /tmp) kept it out.
    vLLM's `make_zmq_listener` binds with Python's socket module, which takes "@" as a folder's name; only `vllm serve`
    with several API servers uses it, and an engine runs one (`engine_main`, the standby's handoff).
    """
    if mode is not SandboxMode.OFF and scopes(landlock_abi()[0]) & SCOPE_ABSTRACT_UNIX_SOCKET:
        return ABSTRACT_SOCKET_PREFIX + hashlib.sha256(str(scratch_dir).encode()).hexdigest()[:16]
    return str(scratch_dir)


def engine_folder_env(scratch_dir: Path, cache_dir: Path, mode: SandboxMode) -> dict[str, str]:
    """Where an engine's programs write: its scratch folder, and its endpoint's caches; and where vLLM's processes
    talk (`rpc_base_path`)."""
    scratch, cache = str(scratch_dir), str(cache_dir)
    return {
        "HOME": scratch, "TMPDIR": scratch, "TMP": scratch, "TEMP": scratch,
        "XDG_CACHE_HOME": cache, "XDG_CONFIG_HOME": os.path.join(scratch, ".config"),
        "VLLM_CACHE_ROOT": os.path.join(cache, "vllm"), "VLLM_CONFIG_ROOT": os.path.join(scratch, ".config", "vllm"),
        "VLLM_RPC_BASE_PATH": rpc_base_path(scratch_dir, mode),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "torchinductor"),
        "FLASHINFER_WORKSPACE_BASE": cache,
        "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
        "CUDA_CACHE_PATH": os.path.join(cache, "nv"),
        "HF_HOME": os.path.join(scratch, "huggingface"),
        "OUTLINES_CACHE_DIR": os.path.join(scratch, "outlines"),
    }  # fmt: skip


def stage_adapter(source: Path, folder: Path, *, keep: int | None = None) -> Path:
    """A copy of an adapter's cached folder in an engine's own adapters folder (`folder`, which it may only read):
    its files hard-linked where the file system allows, copied where it does not. With `keep`, at most that many
    copies stay in `folder` (the most recently staged): the engine reads an adapter's files when it loads it.

    NOTE: a confined engine reads no folder of the weights cache but its model's, and an adapter is loaded while
    the engine runs, after its rules are set. The same adapter's copy is kept for the engine's next load. Unbounded,
    the copies outlived their cache entries (a hard link keeps the bytes the cache counted as freed): a tenant
    naming adapter after adapter filled the node's disk outside the cache's budget, and the cache then evicted other
    tenants' models to make room (the review of the sandbox).
    """
    target = folder / source.name
    if target.is_dir():
        os.utime(target)
        _keep_newest(folder, keep)
        return target
    partial = folder / f".{source.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    # NOTE: never a folder above made (no `parents`): staged outside the supervisor's lock, this copy must fail
    # (FileNotFoundError) once its engine's folder was set aside, not make the folder again, which nothing then
    # removed (the review of the fleet fixes).
    for root, _dirs, files in os.walk(source):  # NOTE: links are not followed: the cache holds none
        into = partial / os.path.relpath(root, source)
        into.mkdir(exist_ok=True)  # NOTE: top-down: the folder above was made first
        for name in files:
            try:
                os.link(os.path.join(root, name), into / name)
            except OSError:
                shutil.copyfile(os.path.join(root, name), into / name)
    partial.rename(target)
    _keep_newest(folder, keep)
    return target


def _keep_newest(folder: Path, keep: int | None) -> None:
    if keep is None:
        return
    staged = sorted((path for path in folder.iterdir() if path.is_dir() and not path.name.startswith(".")),
                    key=lambda path: path.stat().st_mtime_ns, reverse=True)
    for path in staged[max(keep, 1):]:
        shutil.rmtree(path, ignore_errors=True)
