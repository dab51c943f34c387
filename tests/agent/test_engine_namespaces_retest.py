"""An engine's "namespaces refused" (exit 79) is the tenant's to forge: the node's fact changes only where the agent's
own tests find the kernel refusing, never under the supervisor's lock, and a node whose namespaces went missing
finds them again.

Before, one forged exit 79 made the agent test namespaces once, at once, under the lock every heartbeat waits on; a
test that failed for a moment (a fork refused under pid pressure the tenant made itself, a timeout under load) left
the fact "missing" for the agent's life: `required` failed every later launch, and `best-effort` started every
tenant's engine on the node's shared /proc and /dev/shm.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys
import threading
import time

import pytest

from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime import namespaces, sandbox

from .conftest import make_spec, wait_for_state, wait_until
from .test_engine_namespaces import NAMESPACES_MISSING, logged, make_supervisor  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(bool(NAMESPACES_MISSING), reason=NAMESPACES_MISSING or "-")

# What an engine's sandbox line says of its isolation where it entered its namespaces (`apply_from_environment`), the
# machine's socket folders hidden in them; without, it says "no namespaces: <why>".
OWN_NAMESPACES = f"; {namespaces.DESCRIPTION} (the machine's sockets hidden: {', '.join(sandbox.MACHINE_SOCKET_FOLDERS)})"

# The tenant's code in a namespaced engine: exits as an engine whose namespaces were refused would.
FORGED = """
import os
from gpu_agent.runtime import sandbox
sandbox.apply_from_environment()
os._exit(sandbox.EXIT_NAMESPACES_REFUSED)
"""


@pytest.fixture
def fact(monkeypatch):
    """A node's fact of its own, tested at first use, re-tested with no wait once an engine found them refused."""
    fresh = sandbox.NamespacesFact(attempt_pause_s=0.05, retest_interval_s=0.0)
    monkeypatch.setattr(sandbox, "NAMESPACES", fresh, raising=False)
    return fresh


def agents_tests(monkeypatch, first):
    """The agent's tests of namespaces (their child processes), the first answered by `first` instead; the calls."""
    real = subprocess.run
    calls = []

    def run(argv, *args, **kwargs):
        if not (isinstance(argv, list) and argv[-1].startswith("from gpu_agent.runtime import namespaces")):
            return real(argv, *args, **kwargs)
        calls.append(time.monotonic())
        return first(real, argv, *args, **kwargs) if len(calls) == 1 else real(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def forging(supervisor, monkeypatch, replica_ids):
    factory = supervisor.command_factory

    def command(spec, model_path, port):
        built = factory(spec, model_path, port)
        if spec.replica_id not in replica_ids:
            return built
        return dataclasses.replace(built, argv=[sys.executable, "-c", FORGED, *built.argv])

    monkeypatch.setattr(supervisor, "command_factory", command)


def test_a_forged_refusal_whose_re_test_fails_for_a_moment_leaves_every_later_engine_its_namespaces(
    make_supervisor,  # noqa: F811
    tmp_path,
    monkeypatch,
    fact,
):
    supervisor = make_supervisor("agent", {})  # required
    assert sandbox.namespaces_missing() == ""

    def fork_refused(real, argv, *args, **kwargs):  # the uid's processes exhausted, for a moment
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")

    calls = agents_tests(monkeypatch, fork_refused)
    forging(supervisor, monkeypatch, {"r-forged"})
    supervisor.start(make_spec("r-forged", endpoint_id="e-forged"), tmp_path)
    wait_for_state(supervisor, "r-forged", ReplicaState.FAILED, timeout_s=30)
    assert (
        "namespaces were refused where this agent had found them working"
        in supervisor.get("r-forged").failure_reason
    )
    wait_until(lambda: calls, timeout_s=10, poll=supervisor.poll)  # the re-test ran, and its fork was refused
    time.sleep(0.5)
    assert sandbox.namespaces_missing() == ""  # not known to be refused: the last known answer stays
    supervisor.start(make_spec("r-next", endpoint_id="e-next"), tmp_path)
    wait_for_state(supervisor, "r-next", ReplicaState.READY, timeout_s=30)
    assert OWN_NAMESPACES in logged(supervisor.get("r-next"), sandbox.APPLIED_LINE)
    # The default mode: never a start on the node's shared /proc and /dev/shm.
    supervisor.sandbox_mode = sandbox.SandboxMode.BEST_EFFORT
    supervisor.start(make_spec("r-default", endpoint_id="e-default"), tmp_path)
    wait_for_state(supervisor, "r-default", ReplicaState.READY, timeout_s=30)
    assert OWN_NAMESPACES in logged(supervisor.get("r-default"), sandbox.APPLIED_LINE)


def test_the_re_test_after_a_refusal_never_holds_up_the_heartbeats(
    make_supervisor,  # noqa: F811
    tmp_path,
    monkeypatch,
    fact,
):
    supervisor = make_supervisor("agent", {})
    assert sandbox.namespaces_missing() == ""

    def slow(real, argv, *args, **kwargs):  # a test on a loaded node (up to its 30 s timeout)
        time.sleep(3)
        return real(argv, *args, **kwargs)

    calls = agents_tests(monkeypatch, slow)
    forging(supervisor, monkeypatch, {"r-forged"})
    supervisor.start(make_spec("r-forged", endpoint_id="e-forged"), tmp_path)
    waits, done = [], threading.Event()

    def heartbeats():
        while not done.is_set():
            began = time.monotonic()
            supervisor.statuses()
            waits.append(time.monotonic() - began)
            time.sleep(0.05)

    beating = threading.Thread(target=heartbeats)
    beating.start()
    try:
        wait_for_state(supervisor, "r-forged", ReplicaState.FAILED, timeout_s=30)
        wait_until(lambda: calls, timeout_s=10, poll=supervisor.poll)
        wait_until(lambda: time.monotonic() > calls[0] + 3.5, timeout_s=10, poll=supervisor.poll)
    finally:
        done.set()
        beating.join()
    assert max(waits) < 1.0, f"a heartbeat waited {max(waits):.1f} s on the supervisor's lock"
    assert sandbox.namespaces_missing() == ""


def findings(monkeypatch, *answers: namespaces.Finding):
    """`namespaces.find` answering these in turn, then as the kernel does."""
    real, queue = namespaces.find, list(answers)
    monkeypatch.setattr(namespaces, "find", lambda: queue.pop(0) if queue else real())
    return queue


REFUSED = namespaces.Finding("unshare refused (No space left on device)")
UNKNOWN = namespaces.Finding("the test of namespaces did not run (timed out after 30 seconds)", known=False)


def test_the_nodes_fact_turns_missing_only_where_every_attempt_finds_the_kernel_refusing(monkeypatch, fact):
    assert fact.missing() == ""
    findings(monkeypatch, REFUSED, namespaces.Finding())
    assert fact.retest() == ""  # refused once, then working: they work
    findings(monkeypatch, REFUSED, UNKNOWN)
    assert fact.retest() == ""  # a test that could not answer: the last known answer
    findings(monkeypatch, UNKNOWN)
    assert fact.retest() == ""
    findings(monkeypatch, REFUSED, REFUSED, REFUSED)
    assert fact.retest() == REFUSED.missing  # the agent confirmed it itself
    findings(monkeypatch, UNKNOWN)
    assert fact.retest() == REFUSED.missing


def test_forged_refusals_re_test_at_most_once_per_interval(monkeypatch):
    fact = sandbox.NamespacesFact(retest_interval_s=3600)
    monkeypatch.setattr(sandbox, "NAMESPACES", fact)
    assert fact.missing() == ""
    for _ in range(5):
        fact.engine_refused()
        assert not fact.retest_when_due()
    assert fact.num_retests == 0


def test_a_node_whose_namespaces_went_missing_finds_them_again(monkeypatch, fact):
    fact.recheck_missing_s = 0.2
    findings(monkeypatch, REFUSED, REFUSED, REFUSED)
    assert fact.missing() == REFUSED.missing
    assert sandbox.node_fact(sandbox.SandboxMode.BEST_EFFORT).endswith(f"no namespaces: {REFUSED.missing}")

    def recovered():
        fact.retest_when_due()  # as each poll of the supervisor does
        return fact.missing() == ""

    wait_until(recovered, timeout_s=10)
    assert sandbox.node_fact(sandbox.SandboxMode.BEST_EFFORT).endswith("; own pid, mount and user namespaces")


def test_a_fork_refused_in_the_test_is_not_the_kernel_refusing_namespaces(monkeypatch):
    real, num_forks = namespaces.os.fork, []

    def fork():  # the test's child forks; its init's fork is refused (the uid's processes exhausted)
        num_forks.append(1)
        if len(num_forks) > 1:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return real()

    monkeypatch.setattr(namespaces.os, "fork", fork)
    found = namespaces._tried_in_a_child()
    assert not found.known and "Resource temporarily unavailable" in found.missing
    monkeypatch.setattr(namespaces.os, "fork", real)
    assert namespaces._tried_in_a_child() == namespaces.Finding()


# The test's set-up whose first mount fails as under the node's memory pressure (a tenant's to make), the rest real.
SHORT_OF_MEMORY = """
import errno
from gpu_agent.runtime import namespaces
mount, num_mounts = namespaces._mount, []
def short(*args, **kwargs):
    num_mounts.append(1)
    if len(num_mounts) == 1:
        raise OSError(errno.ENOMEM, "mounting /: Cannot allocate memory")
    return mount(*args, **kwargs)
namespaces._mount = short
"""


def test_a_mount_short_of_memory_in_every_re_test_is_not_the_kernel_refusing_namespaces(monkeypatch):
    fact = sandbox.NamespacesFact(attempt_pause_s=0)
    assert fact.missing() == ""
    real, calls = subprocess.run, []

    def run(argv, *args, **kwargs):  # each of the agent's tests (its own process) short of memory once
        if isinstance(argv, list) and argv[-1].startswith("from gpu_agent.runtime import namespaces"):
            calls.append(1)
            argv = [*argv[:-1], SHORT_OF_MEMORY + argv[-1]]
        return real(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    # Before: three "refusals", the fact missing, every next engine on the node's /proc and /dev/shm.
    assert fact.retest() == ""
    assert namespaces.find() == namespaces.Finding("mounting /: Cannot allocate memory", known=False)
    assert len(calls) == 2  # the re-test's first attempt could not answer: the last known answer kept


@pytest.mark.parametrize(
    ("fails", "code", "known"),
    [
        ("mount", errno.ENOMEM, False),
        ("mount", errno.EAGAIN, False),
        ("uid_map", errno.ENOMEM, False),
        ("mount", errno.EPERM, True),  # a container's masked /proc: the kernel's answer
        ("uid_map", errno.EPERM, True),
    ],
)
def test_only_the_kernels_refusals_in_the_map_writes_and_mounts_are_known(monkeypatch, fails, code, known):
    mount, write = namespaces._mount, namespaces._write

    def failing_mount(libc, source, target, *rest):
        if fails == "mount" and target == "/dev/shm":
            raise OSError(code, f"mounting /dev/shm: {os.strerror(code)}")
        return mount(libc, source, target, *rest)

    def failing_write(path, text):
        if fails == "uid_map" and path.endswith("/uid_map"):
            raise OSError(code, os.strerror(code))
        return write(path, text)

    monkeypatch.setattr(namespaces, "_mount", failing_mount)
    monkeypatch.setattr(namespaces, "_write", failing_write)
    found = namespaces._tried_in_a_child()  # its fork, and its init's, fail as patched here
    assert found.known is known and os.strerror(code) in found.missing
