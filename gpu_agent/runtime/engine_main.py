"""An engine's entry point: confine this process (`sandbox.py`), then run vLLM's OpenAI server in it.

    python -m gpu_agent.runtime.engine_main --model … (vLLM's OpenAI server arguments)

The agent starts every plainly launched engine this way (`engine.build_engine_command`, under the reaper).
A fresh interpreter is single-threaded, as `landlock_restrict_self` and `unshare(CLONE_NEWUSER)` need (the engine's
own namespaces, `namespaces.py`: this process stays, as their outer process, and vLLM runs in its child's child), and
has read nothing of the tenant's yet. vLLM's server module then runs as `__main__`, as `python -m` would run it, with the same
arguments, and every process it starts (EngineCore, workers) inherits the confinement.

NOTE: in process, not by `execve` (a Landlock domain would outlive it too): the agent's package stays
imported from where this process found it before it was confined, and vLLM's import of the key guard
(`--middleware`) finds it there; a fresh interpreter would look for it again, in folders it may no longer list.
"""

from __future__ import annotations

import runpy
import sys

from gpu_agent.runtime.sandbox import apply_from_environment

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def main(argv: list[str]) -> None:
    apply_from_environment()
    sys.argv = [SERVER_MODULE, *argv]
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
