"""A seccomp filter that refuses an engine the sockets Landlock's TCP rules do not govern and that reach a TCP server.

Landlock governs `bind` and `connect` of TCP sockets only (`sandbox.py`): an MPTCP socket
(`socket(AF_INET, SOCK_STREAM, IPPROTO_MPTCP)`) falls back to plain TCP with a server that speaks no MPTCP, and
Landlock does not check it (seen on 6.18: a confined process refused port 5432 reached it over MPTCP). So an engine
whose TCP ports are ruled is refused creating one (EPROTONOSUPPORT, what a kernel without MPTCP answers, so
programs fall back to TCP), and refused `io_uring_setup` (ENOSYS, as Docker's default profile does: io_uring's
IORING_OP_SOCKET creates a socket without the `socket` system call a filter sees; libuv and the like fall back to
threads). System calls of another ABI than the process's own (x86_64's i386 and x32 entries) are refused whole: their
`socket` has other numbers, and an engine runs none.

NOTE: installed after `PR_SET_NO_NEW_PRIVS` (which an unprivileged filter needs), on the single thread of a process
that then starts every other (`sandbox.apply`): a filter binds the calling thread and what it starts.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

IPPROTO_MPTCP = 262
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
# The architecture seccomp reports for this process's own system calls, and their numbers (socket, io_uring_setup).
_NATIVE = {
    "x86_64": (0xC000003E, 41, 425),
    "aarch64": (0xC00000B7, 198, 425),
}
_X32_SYSCALL_BIT = 0x40000000
# Offsets in `struct seccomp_data`: nr, arch, args[2]'s low half (little-endian; `protocol` is an int).
_NR, _ARCH, _ARG2_LOW = 0, 4, 16 + 2 * 8
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Filter))]


def program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter's instructions (code, jump if true, jump if false, k) for `machine` (`platform.machine()`)."""
    arch, socket_nr, io_uring_setup_nr = _NATIVE[machine]
    refuse = _RET_ERRNO | errno.EPERM
    return [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 1, 0, arch),
        (_RET_K, 0, 0, refuse),  # another ABI's system call
        (_LD_W_ABS, 0, 0, _NR),
        (_JGE_K, 0, 1, _X32_SYSCALL_BIT),
        (_RET_K, 0, 0, refuse),  # x32's
        (_JEQ_K, 0, 1, io_uring_setup_nr),
        (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS),
        (_JEQ_K, 1, 0, socket_nr),
        (_RET_K, 0, 0, _RET_ALLOW),
        (_LD_W_ABS, 0, 0, _ARG2_LOW),
        (_JEQ_K, 0, 1, IPPROTO_MPTCP),
        (_RET_K, 0, 0, _RET_ERRNO | errno.EPROTONOSUPPORT),
        (_RET_K, 0, 0, _RET_ALLOW),
    ]


def supported() -> bool:
    return platform.machine() in _NATIVE and struct.calcsize("P") == 8


def install(libc) -> None:
    """Refuse this thread and what it starts MPTCP sockets and io_uring; OSError where the kernel refuses the filter.
    NOTE: `PR_SET_NO_NEW_PRIVS` must be set already."""
    instructions = program(platform.machine())
    filters = (_Filter * len(instructions))(*(_Filter(*instruction) for instruction in instructions))
    prog = _Program(len(instructions), ctypes.cast(filters, ctypes.POINTER(_Filter)))
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) < 0:
        number = ctypes.get_errno()
        raise OSError(number, f"seccomp filter refused: {errno.errorcode.get(number, number)}")
