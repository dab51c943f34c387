"""infra/systemd: the agent's unit for bare-metal GPU hosts passes systemd's own checks."""

from __future__ import annotations

import shutil

import pytest

from tests.infra.conftest import INFRA_DIR, run_tool

UNIT = INFRA_DIR / "systemd" / "inferplane-agent.service"


def _verify(unit_path) -> str:
    """What `systemd-analyze verify` says about a unit (it exits 0 even for unknown keys, so read it)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package `systemd`)")
    result = run_tool([analyze, "verify", "--man=no", str(unit_path)])
    return (
        (result.stdout + result.stderr).strip()
        if result.returncode == 0
        else f"exit {result.returncode}: {result.stderr}"
    )


def _unit_with_runnable_binary(tmp_path):
    # verify insists that ExecStart's binary exists; the unit names the venv on a GPU host.
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace("/opt/inferplane/venv/bin/inferplane-agent", "/bin/true"))
    return copy


def test_systemd_unit_verifies_cleanly(tmp_path):
    assert _verify(_unit_with_runnable_binary(tmp_path)) == ""


def test_systemd_verify_reports_a_mistake(tmp_path):
    broken = tmp_path / "broken.service"
    broken.write_text("[Service]\nExecStart=/bin/true\nRestartSecs=5\n")
    assert "RestartSecs" in _verify(broken)


def test_unit_runs_the_agent_with_its_cache_and_token_from_the_environment_file():
    text = UNIT.read_text()
    assert (
        "ExecStart=/opt/inferplane/venv/bin/inferplane-agent run --control-plane ${INFERPLANE_CONTROL_PLANE_URL}"
        in text
    )
    assert "--data-dir /var/lib/inferplane" in text and "StateDirectory=inferplane" in text
    assert "--join-token" not in text, "the token stays in the environment file, off the command line"
    assert "EnvironmentFile=/etc/inferplane/agent.env" in text
    example = (INFRA_DIR / "systemd" / "agent.env.example").read_text()
    assert "INFERPLANE_JOIN_TOKEN=" in example and "INFERPLANE_CONTROL_PLANE_URL=" in example


def _service_settings() -> dict[str, list[str]]:
    """The unit's [Service] settings, each key's values in order (systemd allows a key several times)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_an_engine_the_kernel_kills_for_memory_takes_no_other_tenants_engine_down_with_it():
    # Every engine is a process of the agent's unit, and the node's memory is shared: the kernel's OOM killer picks the
    # largest process, an engine. systemd's DefaultOOMPolicy (systemd-system.conf) is `stop`: the whole unit was then
    # stopped (its agent draining and stopping every engine of the node, then restarted by Restart=always), so one
    # tenant's engine that allocated past the host's memory took every other tenant's replicas on the node with it.
    # `continue`: the engine alone dies, and the agent reports its replica failed as for any engine that exits.
    assert _service_settings().get("OOMPolicy") == ["continue"]
