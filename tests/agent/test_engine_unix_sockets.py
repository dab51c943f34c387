"""An engine connects to no Unix socket of the machine: its mount namespace hides the folders that hold them.

Landlock does not govern connecting to a socket bound to a path, so before, a confined engine (a tenant's code)
connected to any socket it could name: Docker's `/var/run/docker.sock` (root on the host where the agent's user is in
the `docker` group), PostgreSQL's under /run/postgresql, a local Redis's, D-Bus's, systemd's, and, below Landlock ABI 6,
another engine's vLLM sockets in its scratch folder under /tmp. Now each of the machine's socket folders is covered
by an empty read-only tmpfs in the engine's own mount namespace, and only what its policy names below them is bound
back (`namespaces._hide_socket_folders`). The real engines, plain and forked by the zygote, still serve confined
(`tests/agent/test_engine_sandbox.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from gpu_agent.runtime import namespaces, sandbox
from gpu_agent.runtime.sandbox import SandboxMode

from .test_engine_sandbox import needs_landlock, policy_for

REPOSITORY = Path(__file__).parents[2]
needs_namespaces = pytest.mark.skipif(bool(namespaces.find().missing), reason="no namespaces here")


@contextlib.contextmanager
def listening_unix_socket(path: Path):
    """A Unix socket listening at `path`, as a daemon's would (Docker's, PostgreSQL's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen()
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)


def a_run_folder_the_test_may_write() -> Path | None:
    """A fresh folder under the machine's /run where this user may write (None: shown with a folder of the test's)."""
    folder = Path("/run") / f"inferplane-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir()
    except OSError:
        return None
    return folder


def run_as_engine(policy: sandbox.SandboxPolicy, body: str, cwd: Path = REPOSITORY) -> tuple[dict, str]:
    """`body` in a fresh Python after an engine's start (`apply_from_environment`: its namespaces, then Landlock);
    it fills `seen` with what it could do. Returns `seen` and the engine's log."""
    script = textwrap.dedent("""
        import json, os, socket
        from gpu_agent.runtime import sandbox
        sandbox.apply_from_environment()
        seen = {}
        def attempt(name, call):
            try:
                seen[name] = call()
            except OSError as exc:
                seen[name] = f"refused: {exc.strerror}"
        def connect(path):
            with socket.socket(socket.AF_UNIX) as client:
                client.connect(path)
                return "connected"
    """) + textwrap.dedent(body) + "\nprint(json.dumps(seen))\n"
    environment = {**os.environ, sandbox.POLICY_ENV: policy.to_json(), "PYTHONPATH": str(REPOSITORY)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=cwd,
                          env=environment)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def engine_policy_hiding(tmp_path: Path, *folders: Path) -> sandbox.SandboxPolicy:
    for folder in ("own-model", "own-work"):
        (tmp_path / folder).mkdir(exist_ok=True)
    policy = policy_for(tmp_path, namespaces_missing="")
    return dataclasses.replace(policy, socket_folders=(*policy.socket_folders, *map(str, folders)))


def test_every_engines_policy_hides_the_machines_socket_folders_and_keeps_what_it_names(tmp_path):
    policy = policy_for(tmp_path)
    assert {"/run", "/var/run", "/tmp", "/var/lib"} <= set(policy.socket_folders)
    assert sandbox.SandboxPolicy.from_json(policy.to_json()) == policy
    kept = sandbox.socket_folders_kept(policy)
    assert str(tmp_path / "own-model") in kept and str(tmp_path / "own-work") in kept and "/etc/resolv.conf" in kept
    assert not [path for path in kept if path in policy.socket_folders]


@needs_landlock
@needs_namespaces
def test_a_confined_engine_cannot_connect_to_the_machines_unix_sockets_and_still_makes_and_reaches_its_own(tmp_path):
    machine_run = tmp_path / "machine-run"  # the machine's socket folder where the test may not write /run
    run_folder = a_run_folder_the_test_may_write()
    try:
        with contextlib.ExitStack() as stack:
            sockets = {
                "docker": stack.enter_context(listening_unix_socket(machine_run / "docker.sock")),
                "postgresql": stack.enter_context(listening_unix_socket(tmp_path / "postgresql" / ".s.PGSQL.5432")),
            }
            if run_folder is not None:
                sockets["run"] = stack.enter_context(listening_unix_socket(run_folder / "redis.sock"))
            for path in sockets.values():  # reachable outside an engine
                with socket.socket(socket.AF_UNIX) as client:
                    client.connect(str(path))
            seen, log = run_as_engine(engine_policy_hiding(tmp_path, machine_run), f"""
                sockets = {json.dumps({name: str(path) for name, path in sockets.items()})}
                for name, path in sockets.items():
                    attempt(name, lambda: connect(path))
                attempt("listed", lambda: os.listdir("{machine_run}"))
                own = "{tmp_path}/own-work/engine.sock"
                with socket.socket(socket.AF_UNIX) as listener:
                    listener.bind(own)
                    listener.listen()
                    attempt("own", lambda: connect(own))
                attempt("model", lambda: os.listdir("{tmp_path}/own-model"))
            """)  # fmt: skip
    finally:
        if run_folder is not None:
            run_folder.rmdir()
    assert {name: seen[name] for name in sockets} == {name: "refused: No such file or directory" for name in sockets}
    assert seen["listed"] == [] or seen["listed"].startswith("refused")
    assert seen["own"] == "connected" and seen["model"] == []
    assert "the machine's sockets hidden: /run, /var/run, /tmp" in log


@needs_landlock
@needs_namespaces
def test_a_confined_engine_reaches_no_hidden_socket_relative_to_the_folder_it_started_in(tmp_path):
    started_in = tmp_path / "started-in"
    started_in.mkdir()
    with listening_unix_socket(tmp_path / "neighbour" / "vllm.sock"):
        seen, _log = run_as_engine(engine_policy_hiding(tmp_path), """
            attempt("relative", lambda: connect("../neighbour/vllm.sock"))
            attempt("cwd", os.getcwd)
        """, cwd=started_in)  # fmt: skip
    assert seen["relative"] == "refused: No such file or directory" and seen["cwd"] == "/"


@needs_landlock
@needs_namespaces
def test_a_confined_engine_still_resolves_localhost_and_reads_the_resolvers_settings(tmp_path):
    seen, _log = run_as_engine(engine_policy_hiding(tmp_path), """
        attempt("localhost", lambda: sorted({found[4][0] for found in socket.getaddrinfo("localhost", 80)}))
        attempt("resolv_conf", lambda: open("/etc/resolv.conf").read())
        attempt("hosts", lambda: open("/etc/hosts").read())
    """)  # fmt: skip
    assert "127.0.0.1" in seen["localhost"]
    assert seen["resolv_conf"] == Path("/etc/resolv.conf").read_text()
    assert seen["hosts"] == Path("/etc/hosts").read_text()


def test_an_engine_without_namespaces_says_it_shares_the_machines_unix_sockets_and_required_refuses():
    script = "from gpu_agent.runtime import sandbox\nsandbox.apply_from_environment()\nprint('vLLM would start now')"
    results = {}
    for mode in (SandboxMode.BEST_EFFORT, SandboxMode.REQUIRED):
        policy = sandbox.SandboxPolicy(mode=mode, namespaces_missing="unshare refused (EPERM)",
                                       socket_folders=sandbox.MACHINE_SOCKET_FOLDERS)  # fmt: skip
        results[mode] = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                                       cwd=REPOSITORY, env={**os.environ, sandbox.POLICY_ENV: policy.to_json()})  # fmt: skip
    assert "sharing /proc, /dev/shm and the machine's Unix sockets" in results[SandboxMode.BEST_EFFORT].stderr
    assert results[SandboxMode.REQUIRED].returncode == sandbox.EXIT_REFUSED
    assert "vLLM would start now" not in results[SandboxMode.REQUIRED].stdout


@needs_landlock
@needs_namespaces
def test_an_engine_starts_where_dev_log_links_into_a_hidden_folder_and_reaches_syslog_by_neither_name(tmp_path):
    # As on systemd's machines: /dev/log is a link to journald's socket under /run, hidden with /run. Its covering
    # (/dev/null bound on the socket's own path) was tried once /run was covered, where that path names nothing:
    # the init failed (ENOENT) and every engine on the node refused to start, "namespaces half set up".
    # NOTE: a short folder of its own: under a fresh clone's pytest folder, named for this test, journald's path is
    # longer than a Unix socket's 107 bytes
    short = Path(tempfile.mkdtemp(prefix="ip-", dir="/tmp"))
    machine_run = short / "machine-run"
    dev_log = short / "dev-log"
    try:
        with listening_unix_socket(machine_run / "systemd" / "journal" / "dev-log") as journal:
            dev_log.symlink_to(journal)
            seen, log = run_as_engine(engine_policy_hiding(tmp_path, machine_run, dev_log), f"""
                attempt("dev_log", lambda: connect("{dev_log}"))
                attempt("journal", lambda: connect("{journal}"))
            """)  # fmt: skip
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert seen == {"dev_log": "refused: No such file or directory", "journal": "refused: No such file or directory"}
    assert f"the machine's sockets hidden: {', '.join(sandbox.MACHINE_SOCKET_FOLDERS)}, {machine_run}" in log


@contextlib.contextmanager
def fresh_folders_the_test_may_write(parents: tuple[str, ...]):
    """A fresh folder in each of `parents` where this user may write (one it may not, or missing, left out)."""
    made = []
    try:
        for parent in parents:
            folder = Path(parent) / f"inferplane-test-{uuid.uuid4().hex[:8]}"
            with contextlib.suppress(OSError):
                folder.mkdir()
                made.append(folder)
        yield made
    finally:
        for folder in made:
            for path in folder.iterdir():
                path.unlink()
            folder.rmdir()


@needs_landlock
@needs_namespaces
def test_a_confined_engine_connects_to_no_socket_in_home_folders_srv_the_spool_or_snaps_folders(tmp_path):
    # LXD installed as a snap listens at /var/snap/lxd/common/lxd/unix.socket (root on the host for its group, as
    # Docker's), Docker Desktop and user services under home folders, postfix's public sockets under /var/spool.
    parents = ("/home", "/root", "/srv", "/var/spool", "/var/snap")
    assert set(parents) <= set(sandbox.MACHINE_SOCKET_FOLDERS)
    with fresh_folders_the_test_may_write(parents) as folders, contextlib.ExitStack() as stack:
        if not folders:
            pytest.skip("this user may write in none of the machine's folders")
        sockets = [str(stack.enter_context(listening_unix_socket(folder / "unix.socket"))) for folder in folders]
        seen, _log = run_as_engine(engine_policy_hiding(tmp_path), f"""
            for path in {sockets!r}:
                attempt(path, lambda: connect(path))
        """)  # fmt: skip
    assert seen == {path: "refused: No such file or directory" for path in sockets}
