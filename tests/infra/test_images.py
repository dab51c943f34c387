"""infra/docker: the images' Dockerfiles lint clean, copy what they need, and collect static files at build."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.infra.conftest import INFRA_DIR, run_tool, tool

DOCKERFILES = sorted(
    path for path in (INFRA_DIR / "docker").glob("Dockerfile.*") if path.suffix != ".dockerignore"
)
# The packages each image carries: the agent's carries its own distribution and nothing else.
PACKAGES = {
    "Dockerfile.controlplane": {"controlplane", "endpoints", "billing", "gpu_agent"},
    "Dockerfile.agent": {"gpu_agent"},
}


def _hadolint(path) -> subprocess.CompletedProcess:
    # The strictest threshold: style findings fail too. Exceptions are inline `# hadolint ignore=` with a reason.
    return run_tool([tool("hadolint"), "--no-color", "--failure-threshold", "style", str(path)])


def test_there_are_two_images():
    assert [path.name for path in DOCKERFILES] == ["Dockerfile.agent", "Dockerfile.controlplane"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfile_passes_hadolint(dockerfile):
    result = _hadolint(dockerfile)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_careless_dockerfile(tmp_path):
    careless = tmp_path / "Dockerfile"
    careless.write_text(
        "FROM python\nRUN apt-get update && apt-get install -y curl\nRUN pip install django\n"
    )
    result = _hadolint(careless)
    assert result.returncode != 0
    assert "DL3006" in result.stdout  # untagged base image


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_image_runs_as_a_non_root_user_in_a_multi_stage_build(dockerfile):
    text = dockerfile.read_text()
    assert len(re.findall(r"^FROM ", text, re.MULTILINE)) >= 2
    final_stage = text.rsplit("\nFROM ", 1)[1]
    (user,) = re.findall(r"^USER (\S+)", final_stage, re.MULTILINE)
    assert not user.startswith(("root", "0")), user


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_build_context_keeps_every_file_the_image_copies(dockerfile):
    """The per-Dockerfile .dockerignore starts from `*` and lets through exactly what COPY needs."""
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore
    copied = set()
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            copied.update(path.rstrip("/") for path in shlex.split(line)[1:-1])
    assert copied == allowed, f"COPY {sorted(copied)} but the context keeps {sorted(allowed)}"
    packages = {path for path in copied if "/" not in path and (REPO_ROOT / path / "__init__.py").exists()}
    assert packages == PACKAGES[dockerfile.name]
    for path in copied:
        assert (REPO_ROOT / path).exists(), path


def _locked_install(dockerfile_name: str) -> str:
    """The lock file the image installs from, checked to install by hash and nothing beside it."""
    text = (INFRA_DIR / "docker" / dockerfile_name).read_text()
    (lock,) = re.findall(r"^COPY (infra/python/\S+\.txt) /tmp/requirements\.txt$", text, re.MULTILINE)
    assert "pip install --no-cache-dir --require-hashes --no-deps -r /tmp/requirements.txt" in text
    assert "tomllib" not in text  # nothing resolved from pyproject.toml at build time
    return lock


def test_agent_image_installs_the_agent_and_engine_lock_on_python_3_11():
    assert _locked_install("Dockerfile.agent") == "infra/python/agent.txt"
    text = (INFRA_DIR / "docker" / "Dockerfile.agent").read_text()
    assert re.findall(r"^FROM (\S+)", text, re.MULTILINE) == ["python:3.11-slim-bookworm"] * 2
    assert "NVIDIA_VISIBLE_DEVICES=all" in text and "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in text
    assert 'ENTRYPOINT ["/usr/bin/tini", "--"]' in text
    assert "RUN pip install --no-cache-dir --no-deps ./gpu_agent" in text


def test_controlplane_image_collects_static_files_with_placeholder_settings():
    """The build's collectstatic step loads the production settings without starting embedded servers."""
    assert _locked_install("Dockerfile.controlplane") == "infra/python/controlplane.txt"
    text = (INFRA_DIR / "docker" / "Dockerfile.controlplane").read_text()
    # The running image refuses to start without its database and Redis instead of debugging.
    assert re.search(r"^\s+DJANGO_DEBUG=0$", text.rsplit("\nFROM ", 1)[1], re.MULTILINE)
    step = re.search(
        r"^RUN (DJANGO_SETTINGS_MODULE=.*?manage\.py collectstatic[^\n]*)", text, re.MULTILINE | re.DOTALL
    ).group(1)
    words = shlex.split(step.replace("\\\n", " "))
    build_env = dict(word.split("=", 1) for word in words if re.match(r"^[A-Z_]+=", word))
    command = [word for word in words if not re.match(r"^[A-Z_]+=", word)]
    assert command[:3] == ["python", "manage.py", "collectstatic"]
    clean = {name: os.environ[name] for name in ("PATH", "HOME", "LANG", "TMPDIR") if name in os.environ}
    result = subprocess.run(
        [sys.executable, *command[1:], "--dry-run"],
        cwd=REPO_ROOT,
        env=clean | build_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
