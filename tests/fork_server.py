"""Clean Python processes for the settings tests, forked from one that imported the heavy dependencies once.

A test of what the settings do with an environment needs a process of its own (settings are read once, at import), and
a fresh interpreter spent ~1.5 s of CPU importing Django, Celery, redis, psycopg and boto3 before it read a setting.
`ForkServer` (`python -m tests.fork_server`) imports only `DEPENDENCIES`, none of which reads the settings or the
environment the settings read, then forks a process per request: each child takes the request's environment, working
folder and `argv`, and runs it as `python ARGV...` would (`-c CODE` or a script such as `manage.py`), importing the
project and reading its settings fresh. What it writes and its exit status come back as a `subprocess.CompletedProcess`.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# NOTE: dependencies only: a module here that imported the project, configured Django's settings or read an
# environment variable the settings read would hand every child the server's view instead of its own. None of them
# imports the embedded servers (`test_settings.py` checks production never does).
DEPENDENCIES = (
    "django.apps",
    "django.db.models",
    "django.core.management",
    "django.core.mail",
    "django.urls",
    "django.utils.log",
    "psycopg",
    "psycopg_pool",
    "celery",
    "celery.app",
    "kombu",
    "redis",
    "boto3",
    "cryptography.fernet",
    "stripe",
    "botocore.client",
    "jinja2",
    "opentelemetry.trace",
    "rich",
    "httpx",
    "yaml",
)


def _serve() -> None:
    for name in DEPENDENCIES:
        importlib.import_module(name)
    from django.conf import settings

    if settings.configured:  # a dependency read the settings: every child would see this process's
        sys.exit("the fork server's dependencies configured Django's settings")
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        with tempfile.TemporaryDirectory(prefix="fork-server-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _become(request, out, err)
            _, status = os.waitpid(pid, 0)
            answer = {
                "returncode": os.waitstatus_to_exitcode(status),
                "stdout": out.read_text(errors="replace"),
                "stderr": err.read_text(errors="replace"),
            }
        print(json.dumps(answer), flush=True)


def _become(request: dict, out: Path, err: Path) -> None:
    """In the child: `python *argv` with the request's environment and folder; never returns into the server's loop."""
    code = 1
    try:
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY | os.O_CREAT),
                                (2, err, os.O_WRONLY | os.O_CREAT)):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0, /dev/null now: the requests' pipe stays the server's
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        argv = request["argv"]
        try:
            if argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                sys.path[0] = ""  # as `python -c`: the working folder first
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            else:
                sys.argv = list(argv)
                sys.path[0] = str(Path(argv[0]).resolve().parent)  # as `python SCRIPT`: the script's folder first
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as exit_:
            # as the interpreter: None is 0, an int is the status, anything else is printed and is 1
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - as the interpreter: the traceback on stderr, status 1
            sys.excepthook(*sys.exc_info())
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class ForkServer:
    """The pytest side: `run` as `subprocess.run([sys.executable, *argv], cwd=..., env=..., capture_output=True,
    text=True, timeout=...)` answers, one child at a time."""

    def __init__(self, env: dict[str, str], cwd: Path):
        # NOTE: its own session: a child that hangs past a timeout is stopped with the server (`stop`)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.fork_server"], cwd=cwd, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        if self._read_line(120) != "ready\n":
            self.stop()
            raise RuntimeError("the fork server did not start")

    def _read_line(self, timeout_s: float) -> str:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        return self.process.stdout.readline() if ready else ""

    def run(self, argv: list[str], *, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        self.process.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}) + "\n")
        self.process.stdin.flush()
        line = self._read_line(timeout)
        if not line:
            self.stop()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        answer = json.loads(line)
        return subprocess.CompletedProcess([sys.executable, *argv], answer["returncode"], answer["stdout"],
                                           answer["stderr"])

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(10)
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()


if __name__ == "__main__":
    _serve()
