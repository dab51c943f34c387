"""A fork server for the tokenizer loader children of `test_tokenizer_descriptions_kept.py`: transformers imported
once, the loader's module run in a child forked for each start.

The agent starts `python -E -s -m gpu_agent.runtime.tokenizer_normalizer FOLDER CPU MEMORY` for each folder it has
not described (`tokenizer_normalizer._describe_in_child`), ~4.5 s of CPU importing transformers before it reads a
byte; that file's tests count those starts, ~20 of them. Here (`python -m tests.agent.tokenizer_loader_fork_server`,
started in the loader's environment) transformers is imported once and nothing of the agent; each request (one JSON
line on stdin: the module, its arguments, folder and environment, where its output goes) is run by `runpy` in a child forked from
that state, as `-m` runs it, its exit code what `python -m` would have ended with. The server answers a request with
the child's pid, then its exit code, each on a line of its own. The child's own limits, reading and answer are the
agent's (`tokenizer_normalizer._main`); its isolation flags and fresh interpreter are not this server's to give, and
`test_tokenizer_normalizer.py` runs the loader as the agent does.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback


def main() -> None:
    import transformers.models.auto.tokenization_auto  # noqa: F401 - the point: imported before any fork
    from transformers import AutoTokenizer  # noqa: F401

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # NOTE: a line printed by the imports never reaches the test as an answer
    answers.write("ready\n")
    answers.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answers.close()
            _run(request)
        answers.write(f"{pid}\n")
        answers.flush()
        answers.write(f"{os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}\n")
        answers.flush()


def _run(request: dict) -> None:
    code = 1
    try:
        for fd, path in ((1, request["stdout_path"]), (2, request["stderr_path"])):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin.close()
        if request["env"] is not None:
            os.environ.clear()
            os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # NOTE: as `-m` puts the folder it starts in first
        sys.argv = ["-m", *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - as `python -m` ends: the traceback on stderr, exit 1
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
