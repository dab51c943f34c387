"""A fork server for `test_zygote_models.py`: vLLM's look-up modules imported once per module, a fresh process forked
for each test's script.

Each of those tests ran its script in a fresh interpreter (`python -c`), which spent ~8 s importing vLLM before its
first line. Here (`python -m tests.agent.vllm_fork_server`) the modules the script imports are imported once, with
nothing patched and nothing loaded; each request (one JSON line on stdin: the script, its arguments, the variables
added to its environment, its log) is run in a child forked from that pristine state, as the agent's zygote forks its
engines, so no test sees another's wrappers, answers or environment. The server answers each request with the
child's exit code on a line of its own; the child's output goes to the request's log.
"""

from __future__ import annotations

import os
import sys
import traceback

from tests.agent.fork_server import serve


def main() -> None:
    from vllm.tokenizers import registry  # noqa: F401 - the point: imported before any fork
    from vllm.transformers_utils import config  # noqa: F401

    serve(_run)


def _run(request: dict) -> None:
    code = 1
    try:
        log = os.open(request["log_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        sys.stdin.close()
        os.environ.update(request["env"])
        sys.argv = ["-c", *request["argv"]]
        exec(compile(request["code"], "<test script>", "exec"), {"__name__": "__main__"})  # noqa: S102 - the test's
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - whatever happened is in the log; never return into the server's loop
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
