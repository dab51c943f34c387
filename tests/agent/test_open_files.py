"""The agent's open files: a download holds one per file of its model, for as long as the tenant's store takes.

Under a container's default soft limit (1,024) one slow download of a model of many small files left every
other thread of the agent failing with EMFILE. The agent raises its soft limit to the hard one at start, and
waits on its zygote's pipe with `poll` (`select` refuses descriptors numbered 1,024 or more)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap

from gpu_agent.runtime.zygote import wait_readable

SOFT_LIMIT_OF_A_CONTAINER = 1024


def test_the_agent_raises_its_open_files_limit_to_the_hard_one_at_start(tmp_path):
    code = textwrap.dedent(f"""
        import resource
        from gpu_agent.runtime import agent, cli
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, ({SOFT_LIMIT_OF_A_CONTAINER}, hard))
        agent.Agent = lambda config, **options: None
        cli.run_until_signalled = lambda _agent: print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)
        cli.main(["run", "--control-plane", "http://127.0.0.1:9", "--join-token", "token", "--data-dir", {str(tmp_path)!r}, "--cpu"])
    """)
    answer = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    soft, hard = (int(word) for word in answer.stdout.split()[-2:])
    assert hard > SOFT_LIMIT_OF_A_CONTAINER  # the test machine's hard limit leaves room to raise it
    assert soft == min(hard, 1_048_576)


def test_a_pipe_numbered_past_1024_is_waited_on_without_error():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    read_end, write_end = os.pipe()
    try:
        assert read_end >= 1024
        os.write(write_end, b"started r-1 42\n")
        with os.fdopen(read_end, "rb", buffering=0, closefd=False) as reader:
            wait_readable(reader, 5)  # `select.select` raised ValueError here
            assert reader.read(64) == b"started r-1 42\n"
    finally:
        for fd in held + [read_end, write_end]:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
