"""`make run`'s command (`manage.py run_local`) as a new user meets it when this machine's port is taken."""

import contextlib
import socket
import subprocess
import sys
from io import StringIO
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.core.management import CommandError, call_command

from controlplane.management.commands.run_local import Command
from controlplane.restarts import Supervised, Supervisor


def test_a_taken_port_stops_make_run_at_once_and_names_the_variable_that_picks_another(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERPLANE_DATA_DIR", str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CommandError) as refused:
            call_command("run_local", "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in str(refused.value)
    assert f"INFERPLANE_PORT={port + 1} make run" in str(refused.value)
    assert not (tmp_path / "logs").exists()  # nothing migrated, seeded or started first


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_out_of_range_is_a_one_line_error_that_names_the_range(monkeypatch, tmp_path, port):
    """`bind` raised an OverflowError for it: a traceback."""
    monkeypatch.setenv("INFERPLANE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("INFERPLANE_PORT", port)
    with pytest.raises(CommandError) as refused:
        call_command("run_local")
    assert (
        str(refused.value)
        == f"cannot listen on 127.0.0.1:{port}: INFERPLANE_PORT must be a port from 1 to 65535."
    )
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("host", ["no-such-host.invalid", "[::1]"])
def test_a_host_this_machine_cannot_listen_on_is_named_and_no_other_port_is_suggested(
    monkeypatch, tmp_path, host
):
    """It was told to choose another port, which changed nothing."""
    monkeypatch.setenv("INFERPLANE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("INFERPLANE_HOST", host)
    with pytest.raises(CommandError) as refused:
        call_command("run_local", "--port", "8000")
    message = str(refused.value)
    assert (
        message.startswith(f"cannot listen on {host}:8000 (")
        and "INFERPLANE_HOST must be an address" in message
    )
    assert "INFERPLANE_PORT" not in message
    assert not (tmp_path / "logs").exists()


def test_a_bad_port_variable_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("INFERPLANE_PORT", "80OO")
    with pytest.raises(CommandError, match="argument --port: invalid int value: '80OO'"):
        call_command("run_local")


def test_the_banner_says_where_the_mail_a_new_user_waits_for_is(settings, tmp_path):
    settings.EMAIL_HOST = None
    out = StringIO()
    demo = SimpleNamespace(password="pw", api_key="ip_key")
    Command(stdout=out)._print_banner("http://127.0.0.1:8000", demo, tmp_path / "logs", no_agent=False)
    assert f"Mail        printed to {tmp_path / 'logs'}/web.log (sign-up links, invitations" in out.getvalue()


def _printed(banner: str, starts: str) -> str:
    return next(line.strip() for line in banner.splitlines() if line.strip().startswith(starts))


@pytest.mark.parametrize("no_agent", [False, True])
def test_the_banners_commands_find_the_data_folder_make_run_was_given(settings, tmp_path, monkeypatch, no_agent):
    # Before: `INFERPLANE_DATA_DIR=/x make run` printed "manage.py demo_code" and "make stop" bare: typed as printed,
    # they read the repository's .data (no demo.json there: "No demo authenticator"; `make stop` stopped nothing of
    # this run), and the --no-agent hint sent the user to .data/demo.json for the join token.
    import shlex

    from controlplane import embedded

    data_dir = tmp_path / "elsewhere"
    monkeypatch.setenv("INFERPLANE_DATA_DIR", str(data_dir))
    out = StringIO()
    Command(stdout=out)._print_banner("http://127.0.0.1:8000", SimpleNamespace(password="pw", api_key="ip_key"),
                                      data_dir / "logs", no_agent=no_agent)
    banner = out.getvalue()
    for command in (_printed(banner, "Staff code").removeprefix("Staff code"), _printed(banner, "Ctrl-C stops")):
        words = shlex.split(command.split("(")[0].split("`")[-2] if "`" in command else command.split("(")[0])
        typed_in = dict(word.split("=", 1) for word in words if "=" in word and word.split("=")[0].isupper())
        monkeypatch.delenv("INFERPLANE_DATA_DIR")  # a new terminal: only what the printed line sets
        for name, value in typed_in.items():
            monkeypatch.setenv(name, value)
        assert embedded.data_dir() == data_dir.resolve(), command
        monkeypatch.setenv("INFERPLANE_DATA_DIR", str(data_dir))
    if no_agent:
        assert f"{data_dir}/demo.json" in banner and "<join_token in .data/demo.json>" not in banner
        # a bare `python` is not the virtualenv's (no gpu_agent there): the hint names the interpreter make run used
        assert " python -m gpu_agent" not in banner and "python -m gpu_agent run --cpu" in banner


def test_the_banners_commands_stay_bare_for_the_default_data_folder(settings, monkeypatch):
    monkeypatch.delenv("INFERPLANE_DATA_DIR", raising=False)
    out = StringIO()
    Command(stdout=out)._print_banner("http://127.0.0.1:8000", SimpleNamespace(password="pw", api_key="ip_key"),
                                      Path(".data/logs"), no_agent=False)
    assert "INFERPLANE_DATA_DIR" not in out.getvalue()


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _exited() -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    child.wait()
    return child


def _supervising(children: dict[str, subprocess.Popen], started_at: float, start=lambda name: _sleeper()):
    lines: list[str] = []
    supervisor = Supervisor(start, lines.append)
    for name, child in children.items():
        supervisor.processes[name] = Supervised(name, child, started_at)
    return supervisor, lines


def _stop(supervisor: Supervisor) -> None:
    for child in supervisor.children():
        child.kill()
        child.wait()


def test_a_worker_that_dies_after_a_long_run_is_started_again_at_once_and_make_run_goes_on():
    supervisor, lines = _supervising(
        {"web": _sleeper(), "worker": _exited(), "beat": _sleeper()}, started_at=0.0
    )
    try:
        assert not supervisor.check(600.0, lambda name: f"{name}.log")
        assert supervisor.processes["worker"].child.poll() is None
        assert lines == ["worker exited with 1; see worker.log", "worker started again"]
    finally:
        _stop(supervisor)


def test_the_web_server_exiting_or_a_worker_that_cannot_start_stops_make_run():
    for name, age_s in (("web", 60), ("worker", 1)):
        supervisor, _ = _supervising({name: _exited()}, started_at=0.0)
        assert supervisor.check(age_s, lambda name: f"{name}.log")


def test_a_worker_that_keeps_dying_waits_twice_as_long_before_each_start_up_to_a_minute_then_at_once_after_a_long_run():
    """It was started again at once each time, for ever, however often it died (each 10 s or more after its start)."""
    supervisor, lines = _supervising({"worker": _exited()}, started_at=0.0, start=lambda name: _exited())
    worker, now, waits = supervisor.processes["worker"], 0.0, []
    try:
        for _ in range(8):
            now = worker.started_at + 15  # each run ends 15 s after its start
            assert not supervisor.check(now, lambda name: f"{name}.log")
            assert worker.started_at < now  # not started again yet: it waits
            waits.append(worker.restart_at - now)
            assert not supervisor.check(worker.restart_at - 0.1, lambda name: f"{name}.log")
            assert worker.restart_at is not None
            assert not supervisor.check(worker.restart_at, lambda name: f"{name}.log")
            assert worker.restart_at is None and worker.started_at == now + waits[-1]
        assert waits == [1, 2, 4, 8, 16, 32, 60, 60]
        assert "worker starts again in 4 s: its run 3 in a row shorter than 120 s" in "\n".join(lines)
        # A run of 2 minutes or more: the next exit starts it again at once, and the wait doubles from 1 s again.
        assert not supervisor.check(worker.started_at + 130, lambda name: f"{name}.log")
        assert worker.restart_at is None and worker.num_short_runs == 0
        now = worker.started_at + 15
        supervisor.check(now, lambda name: f"{name}.log")
        assert worker.restart_at - now == 1
    finally:
        _stop(supervisor)


class _ChildThatDiesAt:
    """A worker's process as the supervisor sees it (`poll`, `returncode`): it exits once the test's clock passes."""

    def __init__(self, clock: list[float], run_s: float):
        self.clock, self.exits_at, self.returncode = clock, clock[0] + run_s, None

    def poll(self) -> int | None:
        if self.clock[0] >= self.exits_at:
            self.returncode = 1
        return self.returncode


def test_a_worker_that_keeps_dying_for_a_day_still_waits_a_minute_before_each_start_and_make_run_goes_on():
    """The wait was `2 ** (runs - 1)` s before its bound: past 1,024 short runs in a row (about 20 h of a crash
    loop) that is no float, and the OverflowError stopped `make run`."""
    clock = [0.0]
    supervisor, lines = _supervising({}, started_at=0.0, start=lambda name: _ChildThatDiesAt(clock, 15.0))
    supervisor.launch("worker", clock[0])
    worker = supervisor.processes["worker"]
    for _ in range(1100):
        clock[0] = worker.child.exits_at
        assert not supervisor.check(clock[0], lambda name: f"{name}.log")
        assert worker.restart_at - clock[0] <= 60
        clock[0] = worker.restart_at
        assert not supervisor.check(clock[0], lambda name: f"{name}.log")
    assert worker.num_short_runs == 1100 and clock[0] > 20 * 3600
    assert lines[-2:] == [
        "worker starts again in 60 s: its run 1100 in a row shorter than 120 s (the wait doubles up to 60 s)",
        "worker started again",
    ]


def test_a_file_stored_under_make_run_is_read_back_after_a_second_make_run_and_make_stop_leaves_no_store(
        tmp_path, monkeypatch, settings):
    """Before, `make run` named no S3 store: every `/v1/files` upload and console batch was a 503."""
    from controlplane import embedded
    from controlplane.management.commands import run_local
    from endpoints.batches import storage

    for name in ("INFERPLANE_FILES_S3_ENDPOINT_URL", "INFERPLANE_FILES_S3_BUCKET", *run_local.AWS_CREDENTIAL_VARIABLES,
                 "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # a machine with no ~/.aws of its own
    try:
        env = run_local.files_store_env(tmp_path)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", env["AWS_ACCESS_KEY_ID"])  # as the web and worker processes get them
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", env["AWS_SECRET_ACCESS_KEY"])
        settings.FILES_S3_ENDPOINT_URL = env["INFERPLANE_FILES_S3_ENDPOINT_URL"]
        storage.forget_clients()
        storage.put_bytes("files/1/file-abc", b'{"custom_id": "a"}\n')

        second = run_local.files_store_env(tmp_path)  # a second `make run` finds the same store
        assert second["INFERPLANE_FILES_S3_ENDPOINT_URL"] == env["INFERPLANE_FILES_S3_ENDPOINT_URL"]
        storage.forget_clients()
        assert storage.read_bytes("files/1/file-abc") == b'{"custom_id": "a"}\n'
    finally:
        storage.forget_clients()
        embedded.stop_s3(tmp_path)
    port = int((tmp_path / "s3" / "port").read_text())
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # `make stop` leaves nothing listening


def test_closing_the_terminal_stops_make_run_and_what_it_started_as_ctrl_c_does():
    """Before, a hang-up (the terminal closed, an SSH session dropped) ended make run at once and left web, worker and
    beat running, holding the port."""
    import os
    import signal

    from controlplane.management.commands import run_local

    stopped = []
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a terminal's (the tests may run under nohup)
        run_local.stop_on_signals(lambda signum, frame: stopped.append(signal.Signals(signum).name))
        for sig in (signal.SIGINT, signal.SIGHUP):
            os.kill(os.getpid(), sig)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert stopped == ["SIGINT", "SIGHUP"]


def test_a_line_make_run_cannot_write_to_its_closed_terminal_is_dropped_so_the_stopping_goes_on():
    """After a hang-up a write to the closed terminal fails (EIO): "Stopping…" raised before the children were
    signalled, and they were left running."""
    class GoneTerminal:
        def write(self, *_args, **_kwargs):
            raise OSError(5, "Input/output error")

    command = Command(stdout=StringIO())
    command.stdout = GoneTerminal()
    command._say("Stopping…")  # no error: the stopping goes on


def test_a_second_ctrl_c_stops_at_once_what_is_still_finishing_its_requests():
    """Before, a second Ctrl-C did nothing: "Stopping…" held the terminal up to 40 s (the web server waiting out an
    agent's 25 s long poll)."""
    import time

    from controlplane.management.commands import run_local

    finishing = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"],
        start_new_session=True)
    time.sleep(0.5)  # its handler is in place
    started = time.monotonic()
    run_local.stop_children([finishing], 40, hurried=lambda: time.monotonic() > started + 0.5)
    assert finishing.poll() is not None
    assert time.monotonic() - started < 5


def test_make_run_keeps_the_aws_credentials_its_environment_names_for_its_other_calls(tmp_path, monkeypatch):
    from controlplane import embedded
    from controlplane.management.commands import run_local

    for name in ("INFERPLANE_FILES_S3_ENDPOINT_URL", "INFERPLANE_FILES_S3_BUCKET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUSERSOWN")
    try:
        env = run_local.files_store_env(tmp_path)
    finally:
        embedded.stop_s3(tmp_path)
    assert "AWS_ACCESS_KEY_ID" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["INFERPLANE_FILES_S3_ENDPOINT_URL"].startswith("http://127.0.0.1:")


def test_make_run_prints_no_log_line_of_its_own_wait_for_the_web_server(caplog):
    """Before, httpx's INFO line for the health check ("HTTP Request: GET …/healthz") was printed above the banner."""
    import http.server
    import logging
    import threading

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    web = _sleeper()
    try:
        with caplog.at_level(logging.DEBUG):
            Command(stdout=StringIO())._wait_for(f"http://127.0.0.1:{server.server_port}", web, Path("web.log"))
    finally:
        server.shutdown()
        web.kill()
        web.wait()
    assert not [record for record in caplog.records if "healthz" in record.getMessage()]


def test_make_run_started_under_nohup_keeps_running_when_its_terminal_closes():
    """`nohup make run &` asks for a run that outlives the terminal (SIGHUP ignored, as make itself keeps it). The
    hang-up handler replaced the ignore: logging out stopped web, worker and beat."""
    import os
    import signal

    from controlplane.management.commands import run_local

    stopped = []
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
        run_local.stop_on_signals(lambda signum, frame: stopped.append(signal.Signals(signum).name))
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGTERM)  # a `kill` still stops it
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert stopped == ["SIGTERM"]


def test_make_run_keeps_the_aws_credentials_of_the_users_credentials_file_for_its_other_calls(tmp_path, monkeypatch):
    """`aws configure` writes ~/.aws/credentials and names nothing in the environment: the placeholders went to web,
    worker and the local pool's agents, ahead of that file in boto3's chain, and an EC2 node pool's calls (an agent's
    weights from S3) were refused for their key."""
    from controlplane import embedded
    from controlplane.management.commands import run_local

    for name in ("INFERPLANE_FILES_S3_ENDPOINT_URL", "INFERPLANE_FILES_S3_BUCKET", "AWS_ACCESS_KEY_ID", "AWS_PROFILE",
                 "AWS_DEFAULT_PROFILE", "AWS_CONFIG_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "home" / ".aws").mkdir(parents=True)
    (tmp_path / "home" / ".aws" / "credentials").write_text(
        "[default]\naws_access_key_id = AKIAUSERSOWN\naws_secret_access_key = users-own\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("AWS_SHARED_CREDENTIALS_FILE", raising=False)
    try:
        env = run_local.files_store_env(tmp_path)
        monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))  # a user with no credentials anywhere gets them
        without = run_local.files_store_env(tmp_path)
    finally:
        embedded.stop_s3(tmp_path)
    assert "AWS_ACCESS_KEY_ID" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert without["AWS_ACCESS_KEY_ID"] == embedded.S3_LOCAL_CREDENTIALS["AWS_ACCESS_KEY_ID"]


def test_a_ctrl_c_while_the_s3_store_starts_leaves_no_store_running_that_make_stop_cannot_find(tmp_path):
    """The store's pid was written as it started, its port only once it answered: a Ctrl-C in between (moto's server
    takes seconds to start) left it running, and the next make run started another over its pid file, so that
    `make stop` never stopped the first."""
    import os
    import signal
    import time

    starting = subprocess.Popen(
        [sys.executable, "-c", "import sys; from controlplane import embedded; from pathlib import Path; "
                               "embedded.ensure_s3('inferplane-files', Path(sys.argv[1]))", str(tmp_path)],
        stderr=subprocess.DEVNULL)
    pid_file = tmp_path / "s3" / "s3.pid"
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.01)
    store = int(pid_file.read_text())
    assert not (tmp_path / "s3" / "port").exists()  # still starting
    starting.send_signal(signal.SIGINT)
    starting.wait(30)
    deadline = time.monotonic() + 10
    try:
        while time.monotonic() < deadline:
            try:
                os.kill(store, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the S3 store started before the Ctrl-C is still running")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(store, signal.SIGKILL)
    assert not pid_file.exists()


def test_a_ctrl_c_while_the_web_server_starts_stops_make_run_without_starting_the_rest_or_saying_it_runs():
    """Before, a Ctrl-C was seen only once the web server answered (up to 60 s): worker and beat were started after
    it and "Inferplane is running." was printed, then everything stopped."""
    import time

    started: list[str] = []

    def start(name):
        started.append(name)
        return _sleeper()  # a web server that never answers

    supervisor = Supervisor(start, lambda line: None)
    stop_at = time.monotonic() + 0.5  # the Ctrl-C
    began = time.monotonic()
    try:
        running = Command(stdout=StringIO())._start(
            supervisor, {"web": [], "worker": [], "beat": []}, f"http://127.0.0.1:{_free_port()}", Path("logs"),
            stopped=lambda: time.monotonic() > stop_at)
    finally:
        for child in supervisor.children():
            child.kill()
            child.wait()
    assert (running, started) == (False, ["web"])
    assert time.monotonic() - began < 5


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_make_run_takes_no_other_folders_s3_store_found_on_its_recorded_port_and_make_stop_signals_no_stranger(
        tmp_path):
    """The store was known by its port answering moto's API: after a reboot, another clone's store (or a test's) on
    the port recorded here was taken as this folder's (its files written among the other's), and `make stop` sent
    SIGTERM to the pid recorded before the reboot, now any process's."""
    import os
    import time

    from controlplane import embedded

    other = tmp_path / "other-clone"
    other.mkdir()
    theirs = embedded.ensure_s3("inferplane-files", other)
    stranger = _sleeper()  # the process that has this folder's recorded pid after the reboot
    try:
        (tmp_path / "s3").mkdir()
        (tmp_path / "s3" / "port").write_text(theirs.rsplit(":", 1)[1])
        (tmp_path / "s3" / "s3.pid").write_text(str(stranger.pid))
        embedded.stop_s3(tmp_path)
        time.sleep(0.3)
        assert stranger.poll() is None  # not signalled
        (tmp_path / "s3" / "s3.pid").write_text(str(stranger.pid))
        ours = embedded.ensure_s3("inferplane-files", tmp_path)
        assert ours != theirs
        embedded.stop_s3(tmp_path)
        assert embedded._s3_answers(int(theirs.rsplit(":", 1)[1]))  # the other clone's store still serves it
    finally:
        stranger.kill()
        stranger.wait()
        embedded.stop_s3(tmp_path)
        embedded.stop_s3(other)
    assert os.path.exists(other / "s3" / "port")


def test_building_the_demos_model_prints_nothing_above_the_banner(tmp_path, capfd):
    # Before: the model's build printed its safetensors progress bar and its bare path ("…/models/tiny-llama") between
    # "Building the demo…" and the banner: noise a newcomer read as output to act on.
    from controlplane.demo import build_tiny_model

    path = build_tiny_model(tmp_path / "models")
    assert (path / "config.json").exists()
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
