"""`make run`'s command (`manage.py run_local`) as a new user meets it when this machine's port is taken."""

import socket
import subprocess
import sys
import time
from io import StringIO
from types import SimpleNamespace

import pytest
from django.core.management import CommandError, call_command

from controlplane.management.commands.run_local import Command


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


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _exited() -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    child.wait()
    return child


def test_a_worker_that_dies_is_started_again_and_make_run_goes_on(tmp_path):
    children = {"web": _sleeper(), "worker": _exited(), "beat": _sleeper()}
    started_at = dict.fromkeys(children, time.monotonic() - 60)
    err = StringIO()
    try:
        stop = Command(stderr=err)._restart_exited(children, started_at, lambda name: _sleeper(), tmp_path)
        assert not stop
        assert children["worker"].poll() is None
        assert "worker exited with 1" in err.getvalue() and "worker started again" in err.getvalue()
    finally:
        for child in children.values():
            child.kill()
            child.wait()


def test_the_web_server_exiting_or_a_worker_that_cannot_start_stops_make_run(tmp_path):
    for name, age_s in (("web", 60), ("worker", 1)):
        children = {name: _exited()}
        assert Command(stderr=StringIO())._restart_exited(
            children, {name: time.monotonic() - age_s}, lambda name: _sleeper(), tmp_path
        )
