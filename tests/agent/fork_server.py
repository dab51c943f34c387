"""The loop of the tests' fork servers (`vllm_fork_server`, `tokenizer_loader_fork_server`): modules imported once by
the server, then each request (one JSON line on stdin) run in a child forked from that state."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable


def serve(run: Callable[[dict], None], *, answer_pid: bool = False) -> None:
    """Answer "ready", then fork a child per request that runs `run(request)` (it never returns: it ends the child
    with `os._exit`), and answer the child's pid (with `answer_pid`) and its exit code, each on a line of its own."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # NOTE: a line printed by the imports never reaches the test as an answer
    answers.write("ready\n")
    answers.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answers.close()
            run(request)
        if answer_pid:
            answers.write(f"{pid}\n")
            answers.flush()
        answers.write(f"{os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}\n")
        answers.flush()
