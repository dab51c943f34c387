"""The benchmarks' CPU accounting (`bench/proc_cpu.py`): a server's CPU is its own process tree's (its workers, live
or ended), never that of another process with the same command name: other engineers' test servers share the machine
(bench/results/gateway_profile.md, round 18)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.proc_cpu import cpu_s, preemptions, server_pids, tree_cpu_s, user_system_s

# A "server": starts workers running `program`, reaps them on a first line on stdin, ends on a second.
SERVER = """
import subprocess, sys
workers = [subprocess.Popen([sys.executable, "-c", sys.argv[1]]) for _ in range(int(sys.argv[2]))]
print("started", flush=True)
sys.stdin.readline()
for worker in workers:
    worker.wait()
print("reaped", flush=True)
sys.stdin.readline()
"""


def burn(seconds: float) -> str:
    return f"import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass"


def _server(program: str, num_workers: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, program, str(num_workers)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout.readline().strip() == "started"
    return server


def _until(condition, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_servers_cpu_counts_its_live_workers():
    server = _server(burn(0.6), 1)
    try:
        before = tree_cpu_s(server.pid)
        assert _until(lambda: tree_cpu_s(server.pid) - before >= 0.3)
    finally:
        server.communicate("\n\n", timeout=30)


def test_another_process_with_the_same_command_name_is_not_counted():
    server = _server("import time\ntime.sleep(30)", 1)
    stranger = subprocess.Popen([sys.executable, "-c", burn(1.0)])  # a python too, not the server's
    try:
        time.sleep(0.3)  # the worker's start-up is over
        before = tree_cpu_s(server.pid)
        assert _until(lambda: cpu_s(stranger.pid) >= 0.4)
        assert tree_cpu_s(server.pid) - before < 0.1
    finally:
        stranger.kill()
        stranger.wait()
        for worker in Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split():
            os.kill(int(worker), signal.SIGKILL)  # the sleeping worker, by its pid: the server then reaps it
        server.communicate("\n\n", timeout=30)


def test_a_worker_that_ended_and_was_reaped_mid_run_still_counts():
    server = _server(burn(0.3), 2)
    try:
        before = tree_cpu_s(server.pid)
        server.stdin.write("\n")
        server.stdin.flush()
        assert server.stdout.readline().strip() == "reaped"
        after = tree_cpu_s(server.pid)
        # both workers' 0.3 s moved into the server's reaped children's figure: the count never falls
        assert after >= before
        assert after >= 0.55
    finally:
        server.communicate("\n", timeout=30)


def test_server_pids_reads_an_embedded_data_folders_pid_files(tmp_path):
    assert server_pids(tmp_path) == (None, None)
    (tmp_path / "redis").mkdir()
    (tmp_path / "redis" / "redis.pid").write_text("4242\n")
    (tmp_path / "postgres").mkdir()
    (tmp_path / "postgres" / "postmaster.pid").write_text("5151\n/data/postgres\n1733300000\n5432\n")
    assert server_pids(tmp_path) == (4242, 5151)


def _run_until_done(program: str, **popen) -> subprocess.Popen:
    """`program`, then a line on stdout, then it waits for stdin to close (so its figures can be read)."""
    return subprocess.Popen(
        [sys.executable, "-c", program + "\nprint('done', flush=True)\nimport sys\nsys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        **popen,
    )


def test_user_and_system_time_are_told_apart():
    # user time: arithmetic only (`burn` reads the process's CPU clock, a system call on some machines)
    burner = _run_until_done("total = 0\nfor number in range(8_000_000): total += number")
    # system time: reading the kernel's zeros a megabyte at a time (each read a copy done in the kernel)
    reader = _run_until_done(
        "import os, time\nfd = os.open('/dev/zero', os.O_RDONLY)\nend = time.process_time() + 0.4\n"
        "while time.process_time() < end: os.read(fd, 1 << 20)"
    )
    try:
        assert burner.stdout.readline().strip() == "done" and reader.stdout.readline().strip() == "done"
        burner_user, burner_system = user_system_s(burner.pid)
        reader_user, reader_system = user_system_s(reader.pid)
        assert burner_user >= 0.2 and burner_system < burner_user / 4
        assert reader_system > reader_user
        assert abs(burner_user + burner_system - cpu_s(burner.pid)) < 0.02  # the same ticks, split
    finally:
        for process in (burner, reader):
            process.communicate("", timeout=30)


def test_preemptions_count_a_loop_taken_off_its_core_by_another_process():
    one_core = {min(os.sched_getaffinity(0))}
    spin = "import time\nend = time.monotonic() + 0.6\nwhile time.monotonic() < end: pass"
    first = _run_until_done(spin, preexec_fn=lambda: os.sched_setaffinity(0, one_core))
    second = _run_until_done(spin, preexec_fn=lambda: os.sched_setaffinity(0, one_core))
    try:
        for process in (first, second):
            assert process.stdout.readline().strip() == "done"
        # two busy processes on one core take turns (a few ms each): each was preempted many times
        assert preemptions(first.pid) >= 10 and preemptions(second.pid) >= 10
    finally:
        for process in (first, second):
            process.communicate("", timeout=30)
