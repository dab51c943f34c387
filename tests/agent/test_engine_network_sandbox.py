"""An engine binds and connects only to its own TCP ports and the kernel's ephemeral range (Landlock ABI 4).

Before, an engine on a machine outside Kubernetes (no NetworkPolicy) could open TCP to the cloud's metadata service
(169.254.169.254:80: the machine's credentials, the fleet's), to PostgreSQL, Redis or PgBouncer where routable, or
anywhere over HTTPS to send a tenant's weights and prompts away: Landlock confined its files only. Landlock rules
ports, not addresses, so the tests listen on loopback on the refused ports, and a refused connect is EACCES
("Permission denied") whether or not anything listens. MPTCP, which Landlock does not rule and which falls back to
plain TCP, is refused by a seccomp filter (`socket_filter.py`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpu_agent.protocol import ReplicaState, engine_sandbox_weakened
from gpu_agent.runtime import process, sandbox, socket_filter
from gpu_agent.runtime.engine_environment import engine_environment
from gpu_agent.runtime.sandbox import SandboxMode, SandboxPolicy
from gpu_agent.runtime.supervisor import Supervisor

from .conftest import fake_engine_factory, make_spec, wait_for_state
from .test_engine_sandbox import LANDLOCK_ABI, policy_for, run_confined

needs_tcp_rules = pytest.mark.skipif(LANDLOCK_ABI < sandbox.TCP_ABI, reason="Landlock rules TCP ports from ABI 4")
# The metadata service's, HTTPS, SMTP's submission, PostgreSQL's, PgBouncer's, Redis's.
REFUSED_PORTS = (80, 443, 587, 5432, 6432, 6379)


@contextlib.contextmanager
def listening_on_loopback(ports):
    """A listener on 127.0.0.1 at each of `ports` that is free (one already taken is refused all the same)."""
    with contextlib.ExitStack() as stack:
        for port in ports:
            listener = stack.enter_context(socket.socket())
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind(("127.0.0.1", port))
                listener.listen()
            except OSError:
                continue
        yield


def a_free_port_outside_the_ephemeral_range() -> int:
    first, _last = sandbox.ephemeral_ports()
    for port in range(first - 1, 1024, -1):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise AssertionError("no free port below the ephemeral range")


# --- The rules as built ---------------------------------------------------------------------------------------


def test_an_engines_ports_are_its_own_and_the_kernels_ephemeral_range_read_when_its_policy_is_made(tmp_path):
    policy = policy_for(tmp_path, tcp_ports=[8123])
    first, last = (int(part) for part in Path(sandbox.EPHEMERAL_PORTS_FILE).read_text().split())
    assert policy.tcp_ports == (8123,) and policy.ephemeral_ports == (max(first, 1024), last)
    assert SandboxPolicy.from_json(policy.to_json()) == policy
    ruled = dict(sandbox.rules(policy, 4).port_rules)
    assert ruled[0] == sandbox.BIND_TCP  # bind(port 0): the kernel picks a port of its ephemeral range
    assert ruled[8123] == ruled[max(first, 1024)] == ruled[last] == sandbox.BIND_TCP | sandbox.CONNECT_TCP
    assert not set(REFUSED_PORTS) & set(ruled) and not set(ruled) & set(range(1, 1024))
    assert sandbox.rules(policy, 3).port_rules == () and sandbox.rules(policy, 3).handled_net == 0


def test_a_wide_ephemeral_range_never_opens_the_stores_ports_nor_those_below_1024(tmp_path):
    # An operator's `ip_local_port_range` of "1000 65535" covers PostgreSQL's, Redis's and PgBouncer's ports.
    wide = tmp_path / "ip_local_port_range"
    wide.write_text("1000\t65535\n")
    assert sandbox.ephemeral_ports(str(wide)) == (1024, 65535)
    policy = SandboxPolicy(tcp_ports=(8123,), ephemeral_ports=sandbox.ephemeral_ports(str(wide)))
    ruled = dict(sandbox.rules(policy, 7).port_rules)
    assert not (sandbox.NEVER_REACHED_PORTS | set(REFUSED_PORTS)) & set(ruled)
    assert 1024 in ruled and 65535 in ruled and 1023 not in ruled
    (tmp_path / "garbled").write_text("many")
    assert sandbox.ephemeral_ports(str(tmp_path / "garbled")) is None
    assert sandbox.ephemeral_ports(str(tmp_path / "missing")) is None


def test_an_operators_vllm_port_never_reaches_an_engine_whose_processes_pick_ephemeral_ports():
    # With it, vLLM's `get_open_port` binds ports from it upward, by number: outside the engine's rules, refused.
    environ = engine_environment({"VLLM_PORT": "5000", "VLLM_CPU_KVCACHE_SPACE": "4"})
    assert "VLLM_PORT" not in environ and environ["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_a_policy_with_a_port_out_of_range_is_refused():
    with pytest.raises(ValueError, match="1 to 65535"):
        SandboxPolicy(tcp_ports=(70000,))
    with pytest.raises(ValueError, match="first, last"):
        SandboxPolicy(ephemeral_ports=(40000, 30000))


def filter_answer(machine: str, number: int, args=(), arch: int | None = None) -> int:
    """What `socket_filter.program(machine)` answers a system call (`number`, its `args`), run as the kernel runs
    a classic BPF program on `struct seccomp_data`: whatever this machine's kernel has built in."""
    native_arch = socket_filter._NATIVE[machine][0]
    data = struct.pack("<IIQ6Q", number, native_arch if arch is None else arch, 0, *(list(args) + [0] * 6)[:6])
    instructions, accumulator, at = socket_filter.program(machine), 0, 0
    while True:
        code, jump_true, jump_false, k = instructions[at]
        at += 1
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            accumulator = struct.unpack_from("<I", data, k)[0]
        elif code == 0x54:  # BPF_ALU | BPF_AND | BPF_K
            accumulator &= k
        elif code in (0x15, 0x35, 0x45):  # BPF_JMP | BPF_JEQ / BPF_JGE / BPF_JSET | BPF_K
            taken = accumulator == k if code == 0x15 else accumulator >= k if code == 0x35 else bool(accumulator & k)
            at += jump_true if taken else jump_false
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        else:
            raise AssertionError(f"an instruction this evaluator does not know: {code:#x}")


def refused_with(number: int) -> int:
    return 0x00050000 | number


ALLOWED = 0x7FFF0000
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET, AF_RDS, AF_TIPC, AF_VSOCK, AF_SMC = 1, 2, 10, 16, 17, 21, 30, 40, 43
IPPROTO_TCP, IPPROTO_UDP, IPPROTO_SCTP, IPPROTO_SMC = 6, 17, 132, 256
SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, SOCK_SEQPACKET = 1, 2, 3, 5
SOCK_NONBLOCK_CLOEXEC = 0o4000 | 0o2000000


@pytest.mark.parametrize("machine", sorted(socket_filter._NATIVE))
def test_an_engine_makes_tcp_udp_unix_and_netlink_sockets_and_no_other_that_reaches_a_tcp_server(machine):
    # SMC (`AF_SMC`, or `IPPROTO_SMC` on an inet socket since Linux 6.11) falls back to plain TCP with a server that
    # speaks no SMC, as MPTCP does, and Landlock rules neither; SCTP, raw and packet sockets (an engine left with
    # CAP_NET_RAW where namespaces are refused and the agent is root), RDS, TIPC and vsock (the host of a VM) reach
    # what no TCP rule covers. Whether this kernel has them built in or not, the filter refuses them.
    socket_nr = socket_filter._NATIVE[machine][1]

    def socket_call(domain, kind, protocol=0):
        return filter_answer(machine, socket_nr, (domain, kind | SOCK_NONBLOCK_CLOEXEC, protocol))

    for domain in (AF_INET, AF_INET6):
        assert socket_call(domain, SOCK_STREAM) == socket_call(domain, SOCK_STREAM, IPPROTO_TCP) == ALLOWED
        assert socket_call(domain, SOCK_DGRAM) == socket_call(domain, SOCK_DGRAM, IPPROTO_UDP) == ALLOWED
        for protocol in (socket_filter.IPPROTO_MPTCP, IPPROTO_SMC, IPPROTO_SCTP):
            assert socket_call(domain, SOCK_STREAM, protocol) == refused_with(errno.EPROTONOSUPPORT), protocol
        assert socket_call(domain, SOCK_SEQPACKET, IPPROTO_SCTP) == refused_with(errno.EPROTONOSUPPORT)
        assert socket_call(domain, SOCK_RAW, IPPROTO_TCP) == refused_with(errno.EPROTONOSUPPORT)
    assert socket_call(AF_UNIX, SOCK_STREAM) == socket_call(AF_NETLINK, SOCK_DGRAM) == ALLOWED
    for domain in (AF_PACKET, AF_RDS, AF_TIPC, AF_VSOCK, AF_SMC):
        assert socket_call(domain, SOCK_STREAM) == refused_with(errno.EAFNOSUPPORT), domain
    # Its other system calls are its own; io_uring's sockets no filter sees, another ABI's `socket` has other numbers.
    assert filter_answer(machine, 0, (AF_VSOCK,)) == ALLOWED
    assert filter_answer(machine, socket_filter._NATIVE[machine][2]) == refused_with(errno.ENOSYS)
    assert filter_answer(machine, 102, arch=0x40000003) == refused_with(errno.EPERM)  # i386's socketcall
    assert filter_answer(machine, 0x40000000 | socket_nr, (AF_VSOCK,)) == refused_with(errno.EPERM)  # x32's socket


@pytest.mark.parametrize("machine", sorted(socket_filter._NATIVE))
def test_an_engine_sends_with_tcp_fast_open_never_as_a_connect_no_tcp_rule_sees(machine):
    # `sendto`/`sendmsg` with MSG_FASTOPEN on an unconnected TCP socket connects it without `connect`, whose hook is
    # where Landlock rules ports (landlock-lsm/linux issue 41): refused as a kernel with TCP Fast Open off refuses it,
    # so a program falls back to `connect`. Sends without it are the engine's own.
    sendto, sendmsg, sendmmsg = {"x86_64": (44, 46, 307), "aarch64": (206, 211, 269)}[machine]
    fast_open = 0x20000000
    for number, flags_at in ((sendto, 3), (sendmsg, 2), (sendmmsg, 3)):
        args = [5, 0, 0, 0]
        assert filter_answer(machine, number, args) == ALLOWED
        args[flags_at] = fast_open | 0x40  # with MSG_DONTWAIT
        assert filter_answer(machine, number, args) == refused_with(errno.EOPNOTSUPP), number
        args[flags_at] = 0x40
        assert filter_answer(machine, number, args) == ALLOWED


# --- A confined process -----------------------------------------------------------------------------------


@needs_tcp_rules
def test_a_confined_engine_cannot_connect_to_the_metadata_port_nor_the_stores_but_reaches_its_own_ports(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        serving_port = probe.getsockname()[1]  # a free port, as the agent picks its engine's
    outside = a_free_port_outside_the_ephemeral_range()
    with listening_on_loopback([*REFUSED_PORTS, outside]):
        seen = run_confined(
            tmp_path,
            policy_for(tmp_path, tcp_ports=[serving_port]),
            f"""
            import socket, subprocess
            def connect(port, protocol=0):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM, protocol) as client:
                    client.settimeout(5)
                    client.connect(("127.0.0.1", port))
                    return "connected"
            for port in {[*REFUSED_PORTS, outside]!r}:
                attempt(f"tcp {{port}}", lambda: connect(port))
                attempt(f"mptcp {{port}}", lambda: connect(port, 262))
            v6 = socket.socket(socket.AF_INET6)
            attempt("v4-mapped 5432", lambda: v6.connect(("::ffff:127.0.0.1", 5432)))
            attempt("bind 5432", lambda: socket.socket().bind(("127.0.0.1", 5432)))
            server = socket.socket()
            attempt("bind serving port", lambda: server.bind(("0.0.0.0", {serving_port})) or "bound")
            server.listen()
            attempt("own serving port", lambda: connect({serving_port}))
            # As vLLM's `get_open_port` and torch's store, gloo and NCCL's bootstrap do between an engine's processes:
            # a port of the ephemeral range, bound by number, and connected to from a child.
            with socket.socket() as picked:
                picked.bind(("", 0))
                port = picked.getsockname()[1]
            rendezvous = socket.socket()
            attempt("bind a picked port", lambda: rendezvous.bind(("127.0.0.1", port)) or "bound")
            rendezvous.listen()
            child = ("import socket; c = socket.create_connection(('127.0.0.1', %d), timeout=5); print('connected')"
                     % port)
            seen["child to own ephemeral port"] = subprocess.run([sys.executable, "-c", child], capture_output=True,
                                                                 text=True, timeout=30).stdout.strip()
            """,
        )
    assert seen["confined_by"].startswith(f"landlock abi {LANDLOCK_ABI}") and "no MPTCP" in seen["confined_by"]
    for port in (*REFUSED_PORTS, outside):
        assert seen[f"tcp {port}"] == "refused: Permission denied", (port, seen)
        assert seen[f"mptcp {port}"] == "refused: Protocol not supported", (port, seen)
    assert seen["v4-mapped 5432"] == seen["bind 5432"] == "refused: Permission denied"
    assert seen["bind serving port"] == seen["bind a picked port"] == "bound"
    assert seen["own serving port"] == "connected" and seen["child to own ephemeral port"] == "connected"


@needs_tcp_rules
def test_a_confined_engine_makes_no_vsock_nor_packet_socket_but_its_own_kinds_still(tmp_path):
    # A VM's engine reached its host's vsock services; one running as root without namespaces made raw and packet
    # sockets, and with them TCP to any port. The kinds vLLM, torch, NCCL and glibc use are made as before.
    seen = run_confined(
        tmp_path,
        policy_for(tmp_path, tcp_ports=[8123]),
        f"""
        import socket
        def make(*kind):
            with socket.socket(*kind):
                return "made"
        attempt("vsock", lambda: make({AF_VSOCK}, socket.SOCK_STREAM))
        attempt("packet", lambda: make({AF_PACKET}, socket.SOCK_RAW, 0))
        attempt("raw", lambda: make(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP))
        attempt("smc", lambda: make(socket.AF_INET, socket.SOCK_STREAM, {IPPROTO_SMC}))
        for name, kind in (("tcp", (socket.AF_INET, socket.SOCK_STREAM)), ("tcp6", (socket.AF_INET6,)),
                           ("udp", (socket.AF_INET, socket.SOCK_DGRAM)), ("unix", (socket.AF_UNIX,)),
                           ("netlink", (socket.AF_NETLINK, socket.SOCK_RAW, 0))):
            attempt(name, lambda: make(*kind))
        attempt("interfaces", lambda: len(socket.if_nameindex()) > 0)
        """,
    )
    assert seen["vsock"] == seen["packet"] == "refused: Address family not supported by protocol", seen
    assert seen["raw"] == seen["smc"] == "refused: Protocol not supported", seen
    assert all(seen[name] == "made" for name in ("tcp", "tcp6", "udp", "unix", "netlink")), seen
    assert seen["interfaces"] is True


@needs_tcp_rules
def test_a_confined_engine_sends_no_tcp_fast_open_even_to_its_own_port_and_connects_there_plainly(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        seen = run_confined(
            tmp_path,
            policy_for(tmp_path, tcp_ports=[port]),
            f"""
            import socket
            def send(flags):
                with socket.socket() as client:
                    client.settimeout(5)
                    if not flags:
                        client.connect(("127.0.0.1", {port}))
                    return client.sendto(b"hello", flags, ("127.0.0.1", {port})) if flags else client.send(b"hello")
            attempt("fast open", lambda: send({socket_filter.MSG_FASTOPEN}))
            attempt("plain", lambda: send(0))
            """,
        )
    assert seen["fast open"] == "refused: Operation not supported" and seen["plain"] == 5, seen


@needs_tcp_rules
def test_a_confined_engines_two_ranks_meet_over_torchs_store_and_gloo_as_a_tensor_parallel_engines_do(tmp_path):
    # vLLM's TP>1 engine: its workers' CPU process group is gloo (on the ephemeral ports each rank listens on), and a
    # TCP store (ROCm's AITER path) on a port vLLM's `get_open_port` picked; NCCL's bootstrap on GPUs is alike.
    seen = run_confined(
        tmp_path,
        policy_for(tmp_path, own_dirs=[tmp_path], tcp_ports=[8123]),
        """
        import socket, subprocess
        with socket.socket() as picked:
            picked.bind(("", 0))
            port = picked.getsockname()[1]
        rank = ("import datetime, sys, torch, torch.distributed as dist; "
                "dist.init_process_group('gloo', init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2, "
                "timeout=datetime.timedelta(seconds=30)); "
                "x = torch.ones(4) * (int(sys.argv[2]) + 1); dist.all_reduce(x); print(int(x[0])); "
                "dist.destroy_process_group()")
        ranks = [subprocess.Popen([sys.executable, "-c", rank, f"tcp://127.0.0.1:{port}", str(number)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for number in (0, 1)]
        try:
            outputs = [found.communicate(timeout=45) for found in ranks]
        finally:
            for found in ranks:  # NOTE: a rank that never met the other waits for it; none outlives the test
                found.kill()
        seen["sums"] = [output.strip() for output, _errors in outputs]
        seen["errors"] = [errors[-500:] for _output, errors in outputs]
        """,
        env={**os.environ, "TMPDIR": str(tmp_path), "GLOO_SOCKET_IFNAME": "lo"},
    )
    assert seen["sums"] == ["3", "3"], seen["errors"]


def confine_on_an_older_kernel(mode: SandboxMode) -> subprocess.CompletedProcess:
    """An engine's start (`apply_from_environment`) where the kernel's Landlock is ABI 3: files, no TCP ports."""
    script = textwrap.dedent("""
        from gpu_agent.runtime import sandbox
        sandbox.landlock_abi = lambda: (3, "")
        sandbox.apply_from_environment()
        print("vLLM would start now")
    """)
    policy = SandboxPolicy(mode=mode, tcp_ports=(8123,), ephemeral_ports=sandbox.ephemeral_ports())
    env = {**os.environ, sandbox.POLICY_ENV: policy.to_json()}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60,
                          cwd=Path(__file__).parents[2])  # fmt: skip


@pytest.mark.skipif(not LANDLOCK_ABI, reason="this kernel has no Landlock")
def test_an_engine_whose_kernel_rules_no_tcp_port_stops_if_required_and_says_so_under_best_effort(monkeypatch):
    required = confine_on_an_older_kernel(SandboxMode.REQUIRED)
    assert required.returncode == sandbox.EXIT_REFUSED and "vLLM would start now" not in required.stdout
    assert "Landlock abi 3 governs no TCP port (abi 4 does)" in required.stderr
    best_effort = confine_on_an_older_kernel(SandboxMode.BEST_EFFORT)
    assert best_effort.returncode == 0 and "vLLM would start now" in best_effort.stdout
    assert f"{sandbox.APPLIED_LINE} landlock abi 3 (" in best_effort.stderr  # its files confined all the same
    assert "no tcp rules: abi 3 governs none" in best_effort.stderr
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: (3, ""))
    fact = sandbox.node_fact(SandboxMode.BEST_EFFORT)
    assert fact.startswith("landlock abi 3 (no tcp rules: ") and len(fact.split("; ")) == 2
    assert engine_sandbox_weakened("landlock abi 7; own pid, mount and user namespaces", fact)
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: (4, ""))
    assert "no tcp rules" not in sandbox.node_fact(SandboxMode.BEST_EFFORT)


def test_the_supervisor_gives_an_engine_its_serving_port_and_the_ephemeral_range(tmp_path):
    supervisor = Supervisor(tmp_path / "agent", command_factory=fake_engine_factory(),
                            sandbox_mode=SandboxMode.REQUIRED)  # fmt: skip
    try:
        supervisor.start(make_spec("r-ports"), tmp_path / "model")
        wait_for_state(supervisor, "r-ports", ReplicaState.READY, timeout_s=30)  # it serves, confined
        command = supervisor.get("r-ports").command
    finally:
        supervisor.shutdown(timeout_s=5)
        process.kill_orphans(supervisor.data_dir, set())
    policy = SandboxPolicy.from_json(command.env[sandbox.POLICY_ENV])
    assert policy.tcp_ports == (command.port,) and policy.ephemeral_ports == sandbox.ephemeral_ports()
