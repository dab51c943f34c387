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
import select
import signal
import subprocess
import sys
import traceback
from pathlib import Path

from tests.agent.fork_server import serve

LOADER_MODULE = "gpu_agent.runtime.tokenizer_normalizer"  # NOTE: not imported here: the children import it


def main() -> None:
    import transformers.models.auto.tokenization_auto  # noqa: F401 - the point: imported before any fork
    from transformers import AutoTokenizer  # noqa: F401

    serve(_run, answer_pid=True)


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


_REAL_RUN = subprocess.run


class LoaderForks:
    """`subprocess.run` for the agent's loader command, run by the fork server, started in the environment of the
    command (its imports read it; pytest's own variable naming the test aside), again when that changes; any other
    command runs as it is."""

    TIMEOUT_S = 300

    def __init__(self, folder: Path):
        self.folder, self.server, self.env = folder, None, None

    def run(self, command, *args, cwd=None, env=None, timeout=None, **kwargs):
        loader = [sys.executable, "-E", "-s", "-m", LOADER_MODULE]
        if command[:5] != loader or args or set(kwargs) - {"stdin", "capture_output"}:
            return _REAL_RUN(command, *args, cwd=cwd, env=env, timeout=timeout, **kwargs)
        if self.server is not None and _but_pytests(env) != _but_pytests(self.env):
            self.close()
        if self.server is None:
            self.env = env
            self.server = subprocess.Popen(
                [sys.executable, "-m", "tests.agent.tokenizer_loader_fork_server"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True,
            )  # fmt: skip
            assert self._answer(self.TIMEOUT_S) == "ready"
        stdout_path, stderr_path = self.folder / "stdout", self.folder / "stderr"
        request = {"module": command[4], "args": command[5:], "cwd": os.fspath(cwd or os.getcwd()), "env": env,
                   "stdout_path": os.fspath(stdout_path), "stderr_path": os.fspath(stderr_path)}  # fmt: skip
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        pid = int(self._answer(self.TIMEOUT_S))
        try:
            code = int(self._answer(timeout))
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)  # as `subprocess.run` kills its child at the timeout
            self._answer(self.TIMEOUT_S)
            raise subprocess.TimeoutExpired(command, timeout) from None
        return subprocess.CompletedProcess(command, code, stdout_path.read_bytes(), stderr_path.read_bytes())

    def _answer(self, timeout_s: float | None) -> str:
        if not select.select([self.server.stdout], [], [], timeout_s)[0]:
            raise TimeoutError(f"no answer from the loader's fork server in {timeout_s} s")
        return self.server.stdout.readline().strip()

    def close(self) -> None:
        if self.server is not None:
            os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait()
            self.server = None


def _but_pytests(env: dict | None) -> dict | None:
    return None if env is None else {name: value for name, value in env.items() if name != "PYTEST_CURRENT_TEST"}


if __name__ == "__main__":
    main()
