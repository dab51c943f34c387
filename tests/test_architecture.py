"""The layers, the agent's independence and the absence of import cycles hold (import-linter's
contracts in pyproject.toml), and the contracts are checked against the code, not vacuously."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([LINT_IMPORTS, "--no-cache", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_import_contracts_are_kept():
    result = lint()
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_a_cycle_or_an_agent_import_of_django_breaks_the_contracts(tmp_path):
    """The same contracts on a copy of the code with two violations planted: both are reported."""
    copy = tmp_path / "repo"
    copy.mkdir()
    for name in ("controlplane", "endpoints", "billing", "gpu_agent"):
        subprocess.run(["cp", "-r", ROOT / name, copy / name], check=True)
    (copy / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    runtime = copy / "gpu_agent" / "runtime" / "hardware.py"
    runtime.write_text("import django.conf\n" + runtime.read_text())
    accounts = copy / "controlplane" / "accounts" / "tokens_probe.py"
    accounts.write_text("import endpoints.models\n")
    result = subprocess.run(
        [LINT_IMPORTS, "--no-cache"], capture_output=True, text=True, cwd=copy, timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(copy)},
    )
    assert result.returncode != 0
    assert "gpu_agent.runtime.hardware -> django (l.1)" in result.stdout
    assert "controlplane.accounts.tokens_probe -> endpoints.models" in result.stdout
