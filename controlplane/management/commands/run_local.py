"""`make run`: the whole platform on this machine.

Migrates, seeds the demo, then starts and supervises the web server (ASGI),
one Celery worker and one Celery beat, each logging to `.data/logs/`. The GPU agent
is not started here: the demo's `local` node pool launches it (an agent process in
CPU mode, `endpoints.fleet.providers.local`) as any pool launches a machine, and
releases a second one when idle. Ctrl-C stops the control plane; the pool's agents
are machines and keep running (`make stop` stops them).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from controlplane import embedded
from controlplane.demo import DEMO_EMAIL, DEMO_ENDPOINT, seed_demo
from controlplane.restarts import Supervisor


class Command(BaseCommand):
    help = "Run the web server, Celery worker and beat, with a seeded demo whose local node pool starts a CPU agent."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("INFERPLANE_HOST", "127.0.0.1"))
        # NOTE: a string default goes through `type`: a bad INFERPLANE_PORT is argparse's one-line error, not a traceback.
        parser.add_argument("--port", type=int, default=os.environ.get("INFERPLANE_PORT", "8000"))
        parser.add_argument("--no-agent", action="store_true",
                            help="no local GPU agent: the demo's local node pool launches no machine")

    def handle(self, *args, host: str, port: int, no_agent: bool, **options):
        if problem := port_problem(host, port):
            raise CommandError(problem)
        data_dir = embedded.data_dir()
        logs_dir = data_dir / "logs"
        logs_dir.mkdir(exist_ok=True)
        call_command("migrate", interactive=False, verbosity=0)
        self.stdout.write("Building the demo (tiny model, organisation, admin, key, endpoint)…")
        demo = seed_demo(data_dir, local_pool=not no_agent)

        base_url = f"http://{host}:{port}"
        env = os.environ | {
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "DATABASE_URL": settings.DATABASE_URL,
            "REDIS_URL": settings.REDIS_URL,
            "INFERPLANE_PUBLIC_URL": os.environ.get("INFERPLANE_PUBLIC_URL", base_url),
            # Where the agents the local pool launches register (this very server).
            "INFERPLANE_AGENT_CONTROL_PLANE_URL": os.environ.get("INFERPLANE_AGENT_CONTROL_PLANE_URL", base_url),
            "PYTHONUNBUFFERED": "1",
        } | files_store_env(data_dir)
        python = sys.executable
        commands = {
            # WEB_CONCURRENCY gateway processes on one port (default one per core), as in a pod.
            "web": [python, "-m", "controlplane.serve", "--host", host, "--port", str(port),
                    "--no-access-log", "--timeout-graceful-shutdown", "30"],
            "worker": [python, "-m", "celery", "-A", "controlplane", "worker", "--concurrency", "2", "--loglevel", "INFO",
                       "--without-gossip", "--without-mingle", "-n", "local@%h"],
            "beat": [python, "-m", "celery", "-A", "controlplane", "beat", "--loglevel", "INFO",
                     "--schedule", str(data_dir / "celerybeat-schedule")],
        }
        stopping = False

        def stop_all(*_):
            nonlocal stopping
            stopping = True

        stop_on_signals(stop_all)
        def start(name: str) -> subprocess.Popen:
            with open(logs_dir / f"{name}.log", "ab") as log:
                return subprocess.Popen(commands[name], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        supervisor = Supervisor(start, self.stderr.write)
        try:
            if self._start(supervisor, commands, base_url, logs_dir, stopped=lambda: stopping):
                self._print_banner(base_url, demo, logs_dir, no_agent)
            while not stopping:
                if supervisor.check(time.monotonic(), lambda name: logs_dir / f"{name}.log"):
                    stopping = True
                time.sleep(0.5)
        finally:
            self._say(f"Stopping… (requests in flight get up to {STOP_WAIT_S} s; Ctrl-C again stops at once)")
            hurry = []
            stop_on_signals(lambda *_: hurry.append(True))
            stop_children(supervisor.children(), STOP_WAIT_S, hurried=lambda: bool(hurry))
            self._say("Stopped. PostgreSQL, Redis and the local pool's agents keep running with your data; "
                              "`make stop` stops them.")

    def _say(self, text: str) -> None:
        """A line on make run's output, if it still has one: after a hang-up the terminal is gone, and a write to it
        (EIO) must not keep the children from being stopped."""
        with contextlib.suppress(OSError):
            self.stdout.write(text)

    def _start(self, supervisor: Supervisor, commands: dict, base_url: str, logs_dir: Path, *, stopped) -> bool:
        """Start each process in turn, the web server first, until it answers; False, with the rest not started,
        where `stopped()` (a Ctrl-C, a hang-up) came first. NOTE: a Ctrl-C while the web server started was seen only
        once it answered: worker and beat were started after it, and "Inferplane is running." printed, then stopped."""
        for name in commands:
            if stopped():
                return False
            child = supervisor.launch(name, time.monotonic())
            if name == "web":
                self._wait_for(base_url, child, logs_dir / "web.log", stopped=stopped)
        return not stopped()

    def _wait_for(self, base_url: str, child: subprocess.Popen, log: Path, *, stopped=lambda: False) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not stopped():
            if child.poll() is not None:
                raise SystemExit(f"the web server exited; see {log}")
            # NOTE: urllib, which logs nothing: httpx's INFO line for the answer ("HTTP Request: GET …/healthz") was
            # printed on make run's output above the banner.
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{base_url}/healthz", timeout=1) as answer:
                if answer.status == 200:
                    return
            time.sleep(0.2)
        if not stopped():
            raise SystemExit(f"the web server did not answer in 60 s; see {log}")

    def _print_banner(self, base_url: str, demo, logs_dir: Path, no_agent: bool) -> None:
        python_cmd = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
        in_data_dir = data_dir_assignment()
        agents = (f"none (--no-agent); start one with: {python_cmd} -m gpu_agent run --cpu --control-plane {base_url} "
                  f"--join-token <join_token in {embedded.data_dir() / 'demo.json'}>" if no_agent else
                  f"{settings.LOCAL_POOL_DIR}/<launch id>.log (started by the local node pool)")
        # The sign-up page says "We sent a mail": without SMTP it is the web log that holds the link.
        mail = (f"sent through {settings.EMAIL_HOST}" if settings.EMAIL_HOST else
                f"printed to {logs_dir}/web.log (sign-up links, invitations; set EMAIL_HOST to send)")
        where = ("It waits for capacity until an agent registers." if no_agent else
                 "The `local` node pool launches a CPU agent for it within\na few seconds (Fleet page); "
                 "its replica is READY once that agent has started vLLM.")
        self.stdout.write(self.style.SUCCESS(f"""
Inferplane is running.

  Console     {base_url}/            (log in as {DEMO_EMAIL} / {demo.password})
  Staff code  {in_data_dir}{python_cmd} manage.py demo_code   (the code the console asks next: staff pass a second factor)
  API docs    {base_url}/api/docs/
  API key     {demo.api_key}
  Logs        {logs_dir}/{{web,worker,beat}}.log
  Agent logs  {agents}
  Mail        {mail}

  curl -H "Authorization: Bearer {demo.api_key}" {base_url}/api/v1/endpoints/

  curl {base_url}/v1/chat/completions -H "Authorization: Bearer {demo.api_key}" \\
       -H "Content-Type: application/json" \\
       -d '{{"model": "{DEMO_ENDPOINT}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32}}'

The demo endpoint '{DEMO_ENDPOINT}' serves a tiny randomly initialised Llama built on this machine
(its answers are gibberish by design). {where}
Ctrl-C stops the control plane; `{in_data_dir}make stop` also stops the pool's agents.
"""))


def data_dir_assignment() -> str:
    """"INFERPLANE_DATA_DIR=<folder> " when make run was given a data folder other than the repository's `.data`, else "":
    the banner's commands, typed as printed in another terminal, must find this run's data.
    NOTE: before, they were printed bare: `manage.py demo_code` read the repository's .data ("No demo authenticator")
    and `make stop` stopped nothing of this run."""
    data_dir = embedded.data_dir()
    return "" if data_dir == (embedded.BASE_DIR / ".data").resolve() else f"INFERPLANE_DATA_DIR={shlex.quote(str(data_dir))} "


# NOTE: SIGHUP too: closing the terminal (or a dropped SSH session) hangs up make run. Unhandled, it ended make run at
# once, and web, worker and beat (each in a session of its own) went on running, holding the port: the next make run
# was told to pick another port, and `make stop` stopped none of them.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_on_signals(stop) -> None:
    """Ctrl-C, a `kill` and a hang-up each stop make run and everything it started (`stop` is called), but a hang-up
    its parent ignored. NOTE: `nohup make run &` asks to outlive the terminal (SIGHUP ignored, and make itself keeps
    the ignore): the hang-up handler replaced nohup's ignore, and logging out stopped everything."""
    for sig in STOP_SIGNALS:
        if not (sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN):
            signal.signal(sig, stop)


STOP_WAIT_S = 40  # the web server's graceful 30 s (an agent's long poll holds a request 25 s), and the rest


def stop_children(children: list[subprocess.Popen], wait_s: float, *, hurried) -> None:
    """SIGTERM to each child's process group, then up to `wait_s` for them to end, or until `hurried()` (a second
    Ctrl-C): whatever is left then is killed. NOTE: before, a second Ctrl-C did nothing, and "Stopping…" held the
    terminal up to 40 s (the web server waiting out an agent's 25 s long poll) with no way to hurry it."""
    for child in reversed(children):
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    for child in children:
        while child.poll() is None and time.monotonic() < deadline and not hurried():
            time.sleep(0.1)
        if child.poll() is None:
            _signal_group(child, signal.SIGKILL)
            child.wait()


def files_store_env(data_dir: Path) -> dict[str, str]:
    """The variables that give make run's processes a store for files and batch results: none when the environment
    names one (`INFERPLANE_FILES_S3_ENDPOINT_URL` or `INFERPLANE_FILES_S3_BUCKET`), else the embedded S3 store's.
    NOTE: before, nothing was named, and every `/v1/files` upload and console batch was a 503 (boto3 found no
    credentials, and no bucket was there), so the Files and Batch APIs never worked under `make run`."""
    if os.environ.get("INFERPLANE_FILES_S3_ENDPOINT_URL") or os.environ.get("INFERPLANE_FILES_S3_BUCKET"):
        return {}
    store = {"INFERPLANE_FILES_S3_ENDPOINT_URL": embedded.ensure_s3(settings.FILES_S3_BUCKET, data_dir)}
    # NOTE: placeholders only where the user has no AWS credentials of their own: the store takes any, and replacing a
    # user's would break what else they sign (an EC2 node pool, the local pool's agents' weights from S3).
    if not has_own_aws_credentials():
        store |= embedded.S3_LOCAL_CREDENTIALS
    return store


# The environment's names and a profile's keys by which boto3's chain finds credentials of the user's own.
AWS_CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")
AWS_PROFILE_CREDENTIAL_KEYS = ("aws_access_key_id", "role_arn", "credential_process", "credential_source",
                               "sso_session", "sso_start_url", "web_identity_token_file")


def has_own_aws_credentials() -> bool:
    """Whether boto3's chain would find credentials of the user's own: named in the environment, or in the default
    profile of ~/.aws/credentials or ~/.aws/config (`aws configure`, SSO, a role). Read from the files only: nothing
    is asked of the network or run (an EC2 instance's role is not seen: name it with a profile, `credential_source`).
    NOTE: only AWS_ACCESS_KEY_ID and AWS_PROFILE were looked at: a user of `aws configure` got the placeholders, which
    come first in the chain, and their own calls were refused."""
    if any(os.environ.get(name) for name in AWS_CREDENTIAL_VARIABLES):
        return True
    import botocore.session  # boto3's, installed with it

    with contextlib.suppress(Exception):  # an unreadable file is not the user's credentials
        profile = botocore.session.Session().full_config.get("profiles", {}).get("default", {})
        return any(profile.get(key) for key in AWS_PROFILE_CREDENTIAL_KEYS)
    return False


def port_problem(host: str, port: int) -> str:
    """Why the web server could not listen on host:port ("" if it can), with the way out. Checked before
    migrating and seeding: else the web server died at its start and the banner said only "see web.log".
    Another port is suggested only when this one is taken; a port out of range or a host this machine cannot
    listen on is named as such (a port past 65535 was an OverflowError traceback)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        try:
            probe.bind((host, port))
        except OverflowError:
            return f"cannot listen on {host}:{port}: INFERPLANE_PORT must be a port from 1 to 65535."
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return (f"cannot listen on {host}:{port} ({error.strerror}). Choose another port: "
                        f"INFERPLANE_PORT={port + 1} make run")
            if error.errno == errno.EACCES:
                return (f"cannot listen on {host}:{port} ({error.strerror}): a port below 1024 needs privileges. "
                        "Choose another port: INFERPLANE_PORT=8000 make run")
            return (f"cannot listen on {host}:{port} ({error.strerror}): INFERPLANE_HOST must be an address of this "
                    "machine, e.g. 127.0.0.1 or 0.0.0.0 (an IPv6 one without brackets).")
    return ""


def _signal_group(child: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(child.pid, sig)
    except ProcessLookupError:
        pass
