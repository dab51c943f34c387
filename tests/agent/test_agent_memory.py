"""The agent's own memory and environment are kept from its engines, which run as its user.

A process reads another's `/proc/<pid>/environ`, `maps` and `mem` when both run as one user and the other is
dumpable; Landlock leaves `/proc` readable to engines, so a compromised engine read the agent's environment (its join
token, cloud credentials given there)."""

import subprocess
import sys

PROBE = """
import ctypes, subprocess, sys
from gpu_agent.runtime.cli import keep_memory_from_engines
ok = keep_memory_from_engines()
own = ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
child = subprocess.run([sys.executable, "-c", "import ctypes; print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))"],
                       capture_output=True, text=True).stdout.strip()
print(ok, own, child)
"""


def test_the_agent_is_not_dumpable_and_what_it_starts_still_is():
    answer = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    # Not dumpable itself; an engine it starts (exec'd) is, so the agent still reads each engine's replica marker.
    assert answer.stdout.split() == ["True", "0", "1"]
