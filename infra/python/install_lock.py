"""Install a lock file into this virtualenv: with uv where it works, else with pip, the same files either way.

pip installs the ~235 wheels of a lock one after the other and byte-compiles them on one core: about four
minutes of a fresh `make test` on two cores. uv installs and compiles the same lock in parallel. Both get
the same arguments' meaning: exact versions, every hash required, no dependency resolution (`--no-deps`),
so what ends up installed does not depend on the installer.

uv reads none of pip's configuration: the sources pip is configured with (its index, extra indexes and
find-links, from `pip config list`, environment variables included, folders that do not exist left out)
are passed to uv, and uv picks, like pip, the best match across all of them (`unsafe-best-match`: every
file must still match a hash of the lock). uv itself comes from `uv.txt` (pinned, hashed). If uv cannot be
installed, or it fails, pip installs the lock as before and says so.

    python infra/python/install_lock.py [--python TARGET] LOCK [EXTRA_ARGS...]   # e.g. --extra-index-url URL

TARGET is the interpreter whose environment gets the lock (default: the one running this script, whose
pip and uv do the work).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

UV_LOCK = Path(__file__).with_name("uv.txt")
# pip's settings that name where packages come from, and the option each is for uv.
SOURCES = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}
SETTINGS = (*SOURCES, "no-index")
# pip's precedence, lowest first: a later scope's value replaces an earlier one's (lists are not merged).
SCOPES = ("global", "install", ":env:")


def pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", *args]


def pip_sources(config_list: str) -> dict[str, list[str]]:
    """`pip config list` output -> {setting: values}, each setting from its highest-precedence scope."""
    found: dict[str, tuple[int, list[str]]] = {}
    for line in config_list.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        if name not in SETTINGS or scope not in SCOPES:
            continue
        rank = SCOPES.index(scope)
        if name not in found or rank >= found[name][0]:
            found[name] = (rank, shlex.split(value.strip().strip("'\"")))
    return {name: values for name, (_rank, values) in found.items()}


def exists(location: str) -> bool:
    """A local folder or file:// location that is missing is skipped (pip only warns; uv would fail)."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path)).exists()
    if not parsed.scheme:
        return Path(location).exists()
    return True


def uv_source_args(sources: dict[str, list[str]]) -> list[str]:
    no_index = any(value.lower() in ("1", "true", "yes", "on") for value in sources.get("no-index", []))
    args = ["--no-index"] if no_index else []
    for name, option in SOURCES.items():
        if no_index and name != "find-links":
            continue
        args += [arg for location in sources.get(name, []) if exists(location) for arg in (option, location)]
    return args


def install_with_uv(target: str, lock: str, extra: list[str]) -> bool:
    uv = Path(sys.executable).with_name("uv")
    if not uv.exists():
        installed = subprocess.run(pip("install", "--quiet", "--require-hashes", "--no-deps", "-r", str(UV_LOCK)),
                                   capture_output=True, text=True)
        if installed.returncode != 0 or not uv.exists():
            print(f"install_lock: uv is not installable here ({installed.stderr.strip()[-300:]}); pip installs",
                  file=sys.stderr)
            return False
    config = subprocess.run(pip("config", "list"), capture_output=True, text=True)
    command = [str(uv), "pip", "install", "--python", target, "--require-hashes", "--no-deps",
               "--compile-bytecode", "--index-strategy", "unsafe-best-match", "--quiet",
               *uv_source_args(pip_sources(config.stdout)), *extra, "-r", lock]
    env = dict(os.environ)
    if "SSL_CERT_FILE" not in env and os.environ.get("PIP_CERT"):
        env["SSL_CERT_FILE"] = os.environ["PIP_CERT"]  # uv's own certificate store otherwise
    started = time.monotonic()
    done = subprocess.run(command, env=env)
    if done.returncode != 0:
        print(f"install_lock: uv failed (exit {done.returncode}); pip installs", file=sys.stderr)
        return False
    print(f"install_lock: {lock} installed by uv in {time.monotonic() - started:.0f} s")
    return True


def main(argv: list[str]) -> int:
    target = sys.executable
    if argv[:1] == ["--python"] and len(argv) > 1:
        target, argv = argv[1], argv[2:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    lock, extra = argv[0], argv[1:]
    if os.environ.get("INFERPLANE_INSTALL_WITH", "uv") == "uv" and install_with_uv(target, lock, extra):
        return 0
    return subprocess.run(pip("--python", target, "install", "--quiet", "--require-hashes", "--no-deps", *extra,
                              "-r", lock)).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
