"""Runs one engine so that nothing of it can outlive the agent.

    python -m gpu_agent.runtime.reaper -- python -m vllm.entrypoints.openai.api_server …

vLLM's API server starts its EngineCore (and workers) as child processes, and
those keep running for minutes, holding memory, when the API server is killed
(measured here: still alive 120 s after a SIGKILL). So the agent starts this
small reaper instead, as the leader of a new process group:

- it asks the kernel for SIGUSR1 when the agent dies (PR_SET_PDEATHSIG), unless
  the agent keeps its engines on exit (`OUTLIVES_AGENT_ENV`), and becomes a
  child subreaper, so every descendant stays in reach;
- it runs the engine in its own process group, forwards SIGTERM and SIGINT to
  it (a graceful stop), and exits with the engine's code;
- whenever the engine exits, or the agent dies, it SIGKILLs the whole group and
  every descendant in another group (a zygote's engines, `zygote.py`), itself last,
  and unlinks the shared memory they held (`shared_memory.py`);
- it raises its own `oom_score_adj` before it starts the engine (`OOM_SCORE_ADJ_RAISE`), so the kernel's OOM
  killer takes an engine's process, never the agent: the agent's death takes every engine of the node (the death
  signal above), what the bare-metal unit's `OOMPolicy=continue` is there to avoid.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

from gpu_agent.runtime import shared_memory

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

REAPER_MODULE = "gpu_agent.runtime.reaper"
# "1" in a reaper's environment: its engine outlives the agent (`--keep-engines-on-exit`, for the next agent to
# adopt); the reaper still stops it with its group when the engine itself exits. Not passed on to the engine.
OUTLIVES_AGENT_ENV = "INFERPLANE_ENGINE_OUTLIVES_AGENT"


# Added to the agent's `oom_score_adj` for every process under a reaper (engines, the standby, the zygote and its forks):
# the OOM killer's score is a process's share of the memory (resident, swap, page tables) in thousandths plus this, so
# an engine's process of any size scores above an agent of less than half the memory. NOTE: engines run in several
# processes (API server, EngineCore, workers) and a tenant's code may fork as many small ones as it likes: by size
# alone the agent (a few hundred MB) could be the largest. Raising needs no privilege; lowering again below the value
# its parent had (`oom_score_adj_min`) needs CAP_SYS_RESOURCE, so a tenant's engine can bring its own back to the
# agent's, never below it: the other engines still score above the agent.
OOM_SCORE_ADJ_RAISE = 500
OOM_SCORE_ADJ_MAX = 1000


def _raise_oom_score_adj(by: int = OOM_SCORE_ADJ_RAISE) -> None:
    path = "/proc/self/oom_score_adj"
    if not sys.platform.startswith("linux"):
        return
    try:
        with open(path) as current:
            score = int(current.read())
        with open(path, "w") as raised:
            raised.write(str(min(OOM_SCORE_ADJ_MAX, score + by)))
    except (OSError, ValueError) as error:  # no /proc: nothing to raise
        print(f"reaper: could not raise {path}: {error}", file=sys.stderr)


def runs_under_reaper(argv: list[str]) -> bool:
    """Whether `argv` is `python -m gpu_agent.runtime.reaper -- …` (an engine's command, or a standby's)."""
    return len(argv) >= 4 and argv[1:4] == ["-m", REAPER_MODULE, "--"]


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value, 0, 0, 0)
    except OSError:  # not Linux: the agent's own cleanup is the only guard
        pass


def _kill_group() -> None:
    segments = shared_memory.segments_of([*_descendants(), *_group_members()])
    _kill_descendants()
    shared_memory.unlink(segments)  # NOTE: before the group kill below, which takes this process too
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m gpu_agent.runtime.reaper -- COMMAND …", file=sys.stderr)
        return 2
    # NOTE: armed here, after exec, rather than by the agent between its fork and exec (`preexec_fn`), where
    # Python code in a child of a threaded process may deadlock.
    if os.environ.pop(OUTLIVES_AGENT_ENV, "") != "1":
        agent_pid = os.getppid()
        signal.signal(signal.SIGUSR1, lambda *_: _kill_group())
        _prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1)
        if os.getppid() != agent_pid:  # the agent died before the death signal was armed
            _kill_group()
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _raise_oom_score_adj()  # inherited by the engine and everything it starts
    engine = subprocess.Popen(argv)

    def forward(signum, _frame):
        try:
            engine.send_signal(signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = _wait_reaping_others(engine)
    # NOTE: the engine is gone; whatever it started (EngineCore, workers) goes with it.
    _kill_others()
    return code if code >= 0 else 128 - code


def group_members(pgid: int) -> list[int]:
    """Live processes of the process group `pgid` (an engine's reaper leads its own; `process.kill_group` asks too)."""
    members = []
    for entry in os.listdir("/proc") if sys.platform.startswith("linux") else ():
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    members.append(int(entry))
            except (ProcessLookupError, PermissionError):
                continue
    return members


def _group_members() -> list[int]:
    """Every other process of this process group."""
    me = os.getpid()
    return [pid for pid in group_members(os.getpgrp()) if pid != me]


def _descendants() -> list[int]:
    """Every process below this one. NOTE: complete because we are a subreaper: orphans come to us."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
            parent = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, queue = [], [os.getpid()]
    while queue:
        for child in children.get(queue.pop(), ()):
            found.append(child)
            queue.append(child)
    return found


def _kill_descendants() -> None:
    """SIGKILL every descendant, in whatever process group: a zygote's engines each have their own."""
    for pid in _descendants():
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


def _wait_reaping_others(engine: subprocess.Popen) -> int:
    """Wait for the engine, reaping every other child on the way.

    NOTE: as a subreaper we inherit a zygote's orphaned grandchildren (a drained engine's EngineCore);
    waiting on the engine's pid alone would leave them zombies until the zygote exits.
    """
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return engine.wait()
        if pid == engine.pid:
            engine.returncode = os.waitstatus_to_exitcode(status)
            return engine.returncode


def _kill_others() -> None:
    """SIGKILL every other process of this group and every descendant, unlink the shared memory they held,
    and reap what was re-parented to us."""
    others = _group_members()
    segments = shared_memory.segments_of([*_descendants(), *others])
    _kill_descendants()
    for pid in others:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
    shared_memory.unlink(segments)
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
