"""Fixtures for infra/: manifests rendered once per session by the real `kubectl kustomize`. No database."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT

INFRA_DIR = REPO_ROOT / "infra"
OVERLAYS = ("staging", "production")
BIN_DIR = Path(sys.executable).parent


def tool(name: str) -> str:
    """A command-line tool installed into the virtual environment by the `test` extra."""
    path = BIN_DIR / name
    if not path.exists():
        pytest.fail(f"{name} is missing from {BIN_DIR}: install the test extra (pip install -e '.[test]')")
    return str(path)


def run_tool(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, **kwargs)


class Rendered:
    """One overlay as `kubectl kustomize` renders it: the YAML text and its documents."""

    def __init__(self, overlay: str, text: str):
        self.overlay = overlay
        self.text = text
        self.documents = [doc for doc in yaml.safe_load_all(text) if doc]

    def all(self, kind: str) -> list[dict]:
        return [doc for doc in self.documents if doc["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [doc for doc in self.all(kind) if doc["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: expected one {kind} {name}, found {len(found)}"
        return found[0]

    def config_map(self, generated_name: str) -> dict:
        """A generated ConfigMap by its base name (kustomize appends a hash of the content)."""
        found = [
            doc for doc in self.all("ConfigMap") if doc["metadata"]["name"].startswith(generated_name + "-")
        ]
        assert len(found) == 1, f"{self.overlay}: expected one ConfigMap {generated_name}-<hash>"
        return found[0]


def render(overlay: str) -> Rendered:
    result = run_tool([tool("kubectl"), "kustomize", str(INFRA_DIR / "k8s" / "overlays" / overlay)])
    assert result.returncode == 0, f"kubectl kustomize {overlay} failed:\n{result.stderr}"
    return Rendered(overlay, result.stdout)


@pytest.fixture(scope="session")
def rendered_overlays() -> dict[str, Rendered]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


@pytest.fixture(params=OVERLAYS)
def rendered(request, rendered_overlays) -> Rendered:
    return rendered_overlays[request.param]


@pytest.fixture(autouse=True)
def _clean_redis():
    """Overrides the project-wide Redis flush: these tests read files and run tools, nothing else."""
    yield
