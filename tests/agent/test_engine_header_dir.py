"""Where an engine forked from the zygote builds torch's precompiled C++ headers (`standby_process
._follow_the_engines_temporary_folder`): never the zygote's temporary folder (a confined engine may not write there: its
first call asking for logprobs killed it), and under the endpoint's inductor cache where the engine has one, so a node
builds the header once (~60 s on 2 cores), not once per replica with every call on it held behind the build."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import os, sys, tempfile
zygote_tmp, engine_tmp, inductor_cache = sys.argv[1:4]
os.environ["TMPDIR"] = zygote_tmp
tempfile.tempdir = None
import torch._inductor.codecache as codecache  # imported by the zygote, under its own temporary folder
assert codecache._HEADER_DIR.startswith(zygote_tmp), codecache._HEADER_DIR
os.environ["TMPDIR"] = engine_tmp  # the engine's environment, as `become_engine` takes it
if inductor_cache:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache
else:
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
tempfile.tempdir = None
from gpu_agent.runtime.standby_process import _follow_the_engines_temporary_folder
_follow_the_engines_temporary_folder()
print(codecache._HEADER_DIR)
print(codecache._HEADER_LOCK_DIR)
"""


def _header_dirs(tmp_path, inductor_cache: str) -> list[str]:
    zygote_tmp, engine_tmp = tmp_path / "zygote-tmp", tmp_path / "engine-tmp"
    zygote_tmp.mkdir()
    engine_tmp.mkdir()
    done = subprocess.run([sys.executable, "-c", _PROBE, str(zygote_tmp), str(engine_tmp), inductor_cache],
                          capture_output=True, text=True, timeout=300, check=True)
    return done.stdout.split()


def test_an_engine_with_an_inductor_cache_builds_its_headers_there_once_for_its_endpoint(tmp_path):
    cache = tmp_path / "endpoint-cache" / "torchinductor"
    header_dir, lock_dir = _header_dirs(tmp_path, str(cache))
    assert header_dir == str(cache / "precompiled_headers")
    assert lock_dir == str(cache / "precompiled_headers" / "locks")


def test_an_engine_without_one_builds_them_under_its_own_temporary_folder_never_the_zygotes(tmp_path):
    header_dir, _ = _header_dirs(tmp_path, "")
    assert header_dir.startswith(str(tmp_path / "engine-tmp") + "/")
    assert "zygote-tmp" not in header_dir
