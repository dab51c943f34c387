"""A fork server for the tests' web servers: Django and the gateway imported once per test session.

Most gateway and console tests start their own uvicorn process on the test database, and each
spent ~3 s importing Django, the gateway and their dependencies before answering `/healthz`. The
zygote (`python -m tests.web_zygote SOCKET`) imports `controlplane.asgi` once, opens no connection
and starts no thread, then forks a fresh server per request: every test still gets its own process
(its own caches, connections, metrics and gateway id), in a fraction of a second.

Servers started with the session's plain environment come from here (`tests.conftest`'s `gateway` and
`live_server_url` fixtures). Settings are read at import, so a fixture that passes the zygote an environment
of its own gets a sibling zygote started with that environment (`WebZygote.for_env`), kept for the next
server of the same environment. A test that does not pass the zygote, or runs several workers, starts a
server the ordinary way.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _serve_forever(socket_path: str) -> None:
    import uvicorn
    from django.urls import get_resolver

    from controlplane.asgi import application  # noqa: F401 - the point: imported before any fork

    get_resolver().reverse_dict  # noqa: B018 - imports the URLconf and every view, as a first request would
    # NOTE: what the zygote imported is frozen before any fork: each server's startup collects and freezes what it
    # holds (`endpoints.gateway.app._freeze_startup_objects`), a full collection of ~170,000 objects (~0.1 s of CPU a
    # server, hundreds of servers a run); frozen here, the child's collection walks only what it made since the fork.
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the servers: no zombies here
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            request = json.loads(conn.makefile("r").readline())
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                _become_server(request, uvicorn)
            conn.sendall(f"{pid}\n".encode())


def _become_server(request: dict, uvicorn) -> None:
    try:
        os.setsid()  # its own group, stopped as a whole, as `tests.processes.ChildProcess` does
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log = os.open(request["log_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        from controlplane.asgi import application

        uvicorn.run(application, host="127.0.0.1", port=request["port"], log_level="warning", access_log=False)
        code = 0
    except BaseException:  # noqa: BLE001 - whatever happened is in the log; never return into the zygote's loop
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Handle:
    """What `subprocess.Popen` offers that the tests use, for a process that is not our child."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        try:
            with open(f"/proc/{self.pid}/stat") as stat:
                alive = stat.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
            alive = False
        return None if alive else 0


class ForkedServer:
    """A server forked by the zygote, with `tests.processes.ChildProcess`'s interface."""

    def __init__(self, pid: int, log_path: Path):
        self.process = _Handle(pid)
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_text()[-num_chars:]

    def kill(self, sig=signal.SIGKILL) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout_s: float = 10) -> None:
        if self.process.poll() is None:
            self.kill(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.process.poll() is None:
                self.kill(signal.SIGKILL)
                while self.process.poll() is None and time.monotonic() < deadline + 5:
                    time.sleep(0.05)


# The zygotes of other environments (`WebZygote.for_env`) kept at once: each holds an imported Django (~150 MB).
MAX_SIBLINGS = 3


def _plain(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key != "PYTEST_CURRENT_TEST"}


class WebZygote:
    """The pytest side: starts the zygote on first use, asks it for servers, stops it at the end."""

    def __init__(self, env: dict[str, str], work_dir: Path):
        from tests.processes import ChildProcess

        work_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir = work_dir
        self._siblings: dict[tuple, WebZygote] = {}
        self._num_siblings_started = 0
        self.socket_path = str(work_dir / "web-zygote.sock")
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self.env = env
        self.child = ChildProcess([sys.executable, "-m", "tests.web_zygote", self.socket_path], env,
                                  work_dir / "web-zygote.log")
        deadline = time.monotonic() + 120
        while "ready" not in self.child.log_text():
            if self.child.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the web zygote did not start:\n{self.child.log_tail()}")
            time.sleep(0.05)

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a server for `env` may come from here: the zygote's own environment (but for the
        name of the test running, which pytest keeps in it)."""
        return _plain(env) == _plain(self.env)

    def for_env(self, env: dict[str, str]) -> WebZygote:
        """This zygote where it `serves` `env`, else its sibling for `env`: started on first use (one import, as a
        plain start pays), kept for the next server of that environment, the least recently used of more than
        `MAX_SIBLINGS` stopped."""
        if self.serves(env):
            return self
        key = tuple(sorted(_plain(env).items()))
        sibling = self._siblings.pop(key, None)
        if sibling is None:
            sibling = WebZygote(env, self.work_dir / f"sibling-{self._num_siblings_started}")
            self._num_siblings_started += 1
        self._siblings[key] = sibling  # the most recently used last
        while len(self._siblings) > MAX_SIBLINGS:
            self._siblings.pop(next(iter(self._siblings))).stop()
        return sibling

    def fork(self, port: int, log_path: Path) -> ForkedServer:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(self.socket_path)
            conn.sendall((json.dumps({"port": port, "log_path": str(log_path)}) + "\n").encode())
            pid = int(conn.makefile("r").readline())
        return ForkedServer(pid, log_path)

    def stop(self) -> None:
        for sibling in self._siblings.values():
            sibling.stop()
        self._siblings.clear()
        self.child.stop()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)


def main() -> int:
    # NOTE: dies with the test session that started it, whatever way that ends.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    _serve_forever(sys.argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
