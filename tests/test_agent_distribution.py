"""The agent ships alone: `gpu_agent/` builds as its own distribution, and with only what that
distribution declares (no Django, nothing of the control plane) it imports and passes its own tests.

Installing the dependencies from the registry would cost minutes per run, so the test lends the new
virtual environment exactly the declared dependency closure, taken from this environment's installed
distributions by their metadata: a package the agent imports but does not declare is missing there,
and the agent's tests fail.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "gpu_agent"
# Unit tests of the runtime that need no engine: together they import every runtime module.
AGENT_TESTS = ["test_runtime_imports.py", "test_engine_command.py", "test_weights_paths.py", "test_hardware.py"]
# Building the tiny model needs torch, which comes with the engine extra, not the agent's own list.
NEEDS_ENGINE = [  # they build the tiny model, with torch: the engine extra
    "tests/agent/test_hardware.py::test_cli_builds_the_tiny_model",
    "tests/agent/test_engine_command.py::test_a_cpu_engines_kv_cache_is_sized_to_what_its_sequences_can_fill",
    "tests/agent/test_engine_command.py::test_the_fixed_cpu_kv_cache_stays_where_the_need_is_unknown_or_larger",
]


def _closure(requirements: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions these requirements need, transitively, with markers evaluated."""
    found: dict[str, metadata.Distribution] = {}
    # (requirement, the extras its dependant was asked for: they decide `extra == ...` markers)
    pending: list[tuple[Requirement, set[str]]] = [(Requirement(r), set()) for r in requirements]
    while pending:
        req, asked = pending.pop()
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in asked | {""}):
            continue
        name = req.name.lower().replace("_", "-")
        dist = found.get(name) or metadata.distribution(req.name)
        new_extras = set(req.extras) - getattr(dist, "_lent_extras", set())
        if name in found and not new_extras:
            continue
        found[name] = dist
        dist._lent_extras = getattr(dist, "_lent_extras", set()) | set(req.extras)
        pending.extend((Requirement(dep), set(req.extras)) for dep in dist.requires or [])
    return found


def _lend(dists: dict[str, metadata.Distribution], into: Path) -> None:
    into.mkdir()
    for dist in dists.values():
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in tops:
            source = Path(dist.locate_file(top))
            if top.endswith(".pth") or top in {"..", "bin"} or not source.exists():
                continue
            if not (into / top).exists():
                (into / top).symlink_to(source)


def test_agent_builds_alone_and_passes_its_tests_without_django(tmp_path):
    project = tomllib.loads((AGENT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["test"]
    dists = _closure(requirements)
    assert not {"django", "djangorestframework", "celery", "stripe", "psycopg"} & set(dists), sorted(dists)

    # Build the agent's own wheel from its own pyproject, and install it with no dependencies.
    source = tmp_path / "src"
    shutil.copytree(AGENT, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheels, source],
        check=True,
    )
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    site = next(env_dir.glob("lib/python3.*/site-packages"))
    lent = tmp_path / "lent"
    _lend(dists, lent)
    (site / "agent-dependencies.pth").write_text(f"{lent}\n")
    (wheel,) = wheels.glob("inferplane_agent-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", env_dir / "bin/python", "install", "--quiet", "--no-deps", wheel],
        check=True,
    )

    # The agent's tests, outside the repository (so `gpu_agent` is the installed one).
    tests = tmp_path / "suite" / "tests"
    shutil.copytree(ROOT / "tests" / "agent", tests / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    (tests / "__init__.py").write_text("")
    python = str(env_dir / "bin" / "python")
    clean_env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    probe = subprocess.run(
        [python, "-c", "import gpu_agent, importlib.util as u; print(gpu_agent.__file__, u.find_spec('django'))"],
        capture_output=True, text=True, cwd=tmp_path, env=clean_env,
    )
    assert probe.returncode == 0, probe.stderr
    installed_at, django = probe.stdout.split()
    assert installed_at.startswith(str(env_dir)) and django == "None"

    run = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not vllm", "-c", os.devnull,
         "--rootdir", tmp_path / "suite", *[f"tests/agent/{t}" for t in AGENT_TESTS],
         *[arg for test in NEEDS_ENGINE for arg in ("--deselect", test)]],
        capture_output=True, text=True, cwd=tmp_path / "suite", timeout=540,
        env=clean_env,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout
