"""A seccomp filter that refuses an engine the sockets Landlock's TCP rules do not govern and that reach a TCP server.

Landlock governs `bind` and `connect` of TCP sockets only (`sandbox.py`): an MPTCP socket
(`socket(AF_INET, SOCK_STREAM, IPPROTO_MPTCP)`) falls back to plain TCP with a server that speaks no MPTCP, and
Landlock does not check it (seen on 6.18: a confined process refused port 5432 reached it over MPTCP); SMC (`AF_SMC`,
or `IPPROTO_SMC` on an inet socket from Linux 6.11, where the module is built) falls back to TCP alike. So an engine
whose TCP ports are ruled makes only the sockets vLLM, torch, NCCL and glibc make (`program`): TCP and UDP on IPv4
and IPv6, Unix sockets and netlink (interfaces' addresses). Another protocol on an inet socket (MPTCP, SMC, SCTP, a
raw socket: an engine left root without namespaces had CAP_NET_RAW) is refused EPROTONOSUPPORT, another family
(packet, vsock to a VM's host, SMC, RDS, TIPC) EAFNOSUPPORT: what a kernel without them answers, so programs fall
back. A send with MSG_FASTOPEN, which connects an unconnected TCP socket without the `connect` whose hook Landlock
rules ports in (landlock-lsm/linux issue 41), is refused EOPNOTSUPP, as a kernel with TCP Fast Open off refuses it.
`io_uring_setup` is refused (ENOSYS, as Docker's default profile does: io_uring's IORING_OP_SOCKET creates a
socket without the `socket` system call a filter sees; libuv and the like fall back to threads). System calls of
another ABI than the process's own (x86_64's i386 and x32 entries) are refused whole: their `socket` has other
numbers (i386's `socketcall`), and an engine runs none.

NOTE: installed after `PR_SET_NO_NEW_PRIVS` (which an unprivileged filter needs), on the single thread of a process
that then starts every other (`sandbox.apply`): a filter binds the calling thread and what it starts.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct
from typing import NamedTuple

IPPROTO_MPTCP = 262
MSG_FASTOPEN = 0x20000000
_AF_UNIX, _AF_INET, _AF_INET6, _AF_NETLINK = 1, 2, 10, 16
_SOCK_STREAM, _SOCK_DGRAM, _SOCK_TYPE_MASK = 1, 2, 0xF  # the type's other bits: SOCK_NONBLOCK, SOCK_CLOEXEC
_IPPROTO_DEFAULT, _IPPROTO_TCP = 0, 6
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000


class _Native(NamedTuple):
    """The architecture seccomp reports for this process's own system calls, and their numbers."""

    arch: int
    socket: int
    io_uring_setup: int
    sendto: int
    sendmsg: int
    sendmmsg: int


_NATIVE = {
    "x86_64": _Native(0xC000003E, socket=41, io_uring_setup=425, sendto=44, sendmsg=46, sendmmsg=307),
    "aarch64": _Native(0xC00000B7, socket=198, io_uring_setup=425, sendto=206, sendmsg=211, sendmmsg=269),
}
_X32_SYSCALL_BIT = 0x40000000
# Offsets in `struct seccomp_data`: nr, arch, and the low half of an argument (little-endian; socket's are ints).
_NR, _ARCH = 0, 4
_ARGS = 16
_LD_W_ABS, _AND_K, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x54, 0x15, 0x35, 0x45, 0x06


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Filter))]


def _argument(number: int) -> tuple:
    return (_LD_W_ABS, _ARGS + 8 * number)


def program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter's instructions (code, jump if true, jump if false, k) for `machine` (`platform.machine()`)."""
    native = _NATIVE[machine]
    # (code, k) runs on; (code, k, if true, if false) jumps to a label (None: the next instruction); a str labels.
    return _assembled([
        (_LD_W_ABS, _ARCH),
        (_JEQ_K, native.arch, None, "another abi"),
        (_LD_W_ABS, _NR),
        (_JGE_K, _X32_SYSCALL_BIT, "another abi", None),
        (_JEQ_K, native.io_uring_setup, "no io_uring", None),
        (_JEQ_K, native.sendto, "flags in the fourth", None),
        (_JEQ_K, native.sendmmsg, "flags in the fourth", None),
        (_JEQ_K, native.sendmsg, "flags in the third", None),
        (_JEQ_K, native.socket, None, "allow"),
        _argument(0),  # the family
        (_JEQ_K, _AF_UNIX, "allow", None),
        (_JEQ_K, _AF_NETLINK, "allow", None),
        (_JEQ_K, _AF_INET, "inet", None),
        (_JEQ_K, _AF_INET6, "inet", "no family"),
        "inet",
        _argument(1),  # the type
        (_AND_K, _SOCK_TYPE_MASK),
        (_JEQ_K, _SOCK_DGRAM, "allow", None),
        (_JEQ_K, _SOCK_STREAM, None, "no protocol"),
        _argument(2),  # the protocol: TCP's, which Landlock rules
        (_JEQ_K, _IPPROTO_DEFAULT, "allow", None),
        (_JEQ_K, _IPPROTO_TCP, "allow", "no protocol"),
        "flags in the fourth", _argument(3),
        (_JSET_K, MSG_FASTOPEN, "no fast open", "allow"),
        "flags in the third", _argument(2),
        (_JSET_K, MSG_FASTOPEN, "no fast open", "allow"),
        "allow", (_RET_K, _RET_ALLOW),
        "another abi", (_RET_K, _RET_ERRNO | errno.EPERM),
        "no io_uring", (_RET_K, _RET_ERRNO | errno.ENOSYS),
        "no family", (_RET_K, _RET_ERRNO | errno.EAFNOSUPPORT),
        "no protocol", (_RET_K, _RET_ERRNO | errno.EPROTONOSUPPORT),
        "no fast open", (_RET_K, _RET_ERRNO | errno.EOPNOTSUPP),
    ])  # fmt: skip


def _assembled(source: list) -> list[tuple[int, int, int, int]]:
    """`program`'s source with its labels made the relative jumps classic BPF takes."""
    at, labels = 0, {}
    for item in source:
        if isinstance(item, str):
            labels[item] = at
        else:
            at += 1
    instructions = []
    for item in (item for item in source if not isinstance(item, str)):
        code, k, *targets = item
        here = len(instructions) + 1  # a jump counts from the next instruction
        jumps = [0 if target is None else labels[target] - here for target in targets or (None, None)]
        if not all(0 <= jump < 256 for jump in jumps):  # NOTE: classic BPF jumps forward only, a byte's worth
            raise ValueError(f"a jump of {jumps} from instruction {here - 1}")
        instructions.append((code, *jumps, k))
    return instructions


def supported() -> bool:
    return platform.machine() in _NATIVE and struct.calcsize("P") == 8


def install(libc) -> None:
    """Refuse this thread and what it starts every socket but TCP, UDP, Unix and netlink ones, TCP Fast Open's
    sends, and io_uring; OSError
    where the kernel refuses the filter.
    NOTE: `PR_SET_NO_NEW_PRIVS` must be set already."""
    instructions = program(platform.machine())
    filters = (_Filter * len(instructions))(*(_Filter(*instruction) for instruction in instructions))
    prog = _Program(len(instructions), ctypes.cast(filters, ctypes.POINTER(_Filter)))
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) < 0:
        number = ctypes.get_errno()
        raise OSError(number, f"seccomp filter refused: {errno.errorcode.get(number, number)}")
