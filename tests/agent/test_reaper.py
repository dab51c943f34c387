"""The reaper: an engine's whole process tree dies with the engine, or with the agent."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

# A stand-in engine that, like vLLM's API server, starts a child that would outlive it.
ENGINE = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # gone, also between a look-up and the read of its status
        return False


def _wait_gone(pids, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


# A stand-in zygote: its child (an engine) leads its own process group, out of reach of a group kill.
ZYGOTE = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], process_group=0)
    print(child.pid, flush=True)
    time.sleep(600)
""")


def _agent_with_engine(tmp_path, engine=ENGINE):
    """A fake agent process that starts the reaper (as the supervisor does) and prints the pids."""
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        reaper = subprocess.Popen([sys.executable, "-m", "gpu_agent.runtime.reaper", "--", sys.executable, "-c", {engine!r}],
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
        grandchild = reaper.stdout.readline().strip()
        print(reaper.pid, grandchild, flush=True)
        time.sleep(600)
    """))
    agent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    reaper_pid, grandchild_pid = map(int, agent.stdout.readline().split())
    engine_pid = [c.pid for c in psutil.Process(reaper_pid).children()][0]
    return agent, reaper_pid, engine_pid, grandchild_pid


def test_a_killed_agent_takes_the_engine_and_its_children_along(tmp_path):
    agent, reaper_pid, engine_pid, grandchild_pid = _agent_with_engine(tmp_path)
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    assert _wait_gone([reaper_pid, engine_pid, grandchild_pid]) == []


def test_an_engine_that_exits_leaves_no_children_and_a_stop_is_graceful(tmp_path):
    agent, reaper_pid, engine_pid, grandchild_pid = _agent_with_engine(tmp_path)
    try:
        os.kill(engine_pid, signal.SIGKILL)  # the engine crashes; its child would linger
        assert _wait_gone([engine_pid, grandchild_pid, reaper_pid]) == []
    finally:
        agent.kill()
        agent.wait()


def test_a_killed_agent_takes_a_zygotes_engines_in_their_own_process_groups_along(tmp_path):
    agent, reaper_pid, zygote_pid, engine_pid = _agent_with_engine(tmp_path, ZYGOTE)
    assert os.getpgid(engine_pid) == engine_pid != os.getpgid(zygote_pid)
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    assert _wait_gone([reaper_pid, zygote_pid, engine_pid]) == []


def test_a_killed_zygote_leaves_none_of_its_engines_behind(tmp_path):
    agent, reaper_pid, zygote_pid, engine_pid = _agent_with_engine(tmp_path, ZYGOTE)
    try:
        os.kill(zygote_pid, signal.SIGKILL)
        assert _wait_gone([zygote_pid, engine_pid, reaper_pid]) == []
    finally:
        agent.kill()
        agent.wait()


# A stand-in engine holding shared memory as vLLM's does (a queue segment its tracker does not know of), and a child.
SHM_ENGINE = textwrap.dedent("""
    import subprocess, sys, time
    from multiprocessing import resource_tracker, shared_memory
    segment = shared_memory.SharedMemory(create=True, size=1 << 16)
    resource_tracker.unregister(segment._name, "shared_memory")  # only a graceful close unlinks it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, segment.name, flush=True)
    time.sleep(600)
""")


def test_a_killed_agent_s_engine_leaves_no_shared_memory_behind(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        reaper = subprocess.Popen([sys.executable, "-m", "gpu_agent.runtime.reaper", "--", sys.executable, "-c", {SHM_ENGINE!r}],
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
        print(reaper.pid, reaper.stdout.readline().strip(), flush=True)
        time.sleep(600)
    """))
    agent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    reaper_pid, grandchild_pid, name = agent.stdout.readline().split()
    segment = f"/dev/shm/{name}"
    assert os.path.exists(segment)
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    assert _wait_gone([int(reaper_pid), int(grandchild_pid)]) == []
    assert not os.path.exists(segment)


def test_the_kernel_s_oom_killer_takes_an_engine_before_the_agent():
    """The bare-metal unit says `OOMPolicy=continue` so that a node out of memory loses the engine the OOM killer takes,
    not every engine of the node. But the OOM killer takes the process of the highest score (its resident memory), and
    engines run in several processes (API server, EngineCore, workers; a tenant's code may fork as many small ones as
    it likes): with the agent's score no lower than theirs, the agent (a few hundred MB) could be the largest, and its
    death takes every engine of the node (each reaper's death signal), which `continue` was there to avoid. Every
    process under a reaper (engines, the standby, the zygote and its forks) now scores higher than the agent."""
    if not sys.platform.startswith("linux"):
        return
    with open("/proc/self/oom_score_adj") as own:
        agent = int(own.read())
    if agent >= 1000:
        return  # nothing scores higher
    engine = subprocess.run(
        [sys.executable, "-m", "gpu_agent.runtime.reaper", "--", sys.executable, "-c",
         "print(open('/proc/self/oom_score_adj').read().strip())"],
        capture_output=True, text=True, timeout=60, check=True, start_new_session=True)  # its group, as the agent's
    assert int(engine.stdout.strip()) >= min(1000, agent + 500), engine
