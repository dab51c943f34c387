"""A killed engine leaves no shared memory behind (`process.kill_group`).

vLLM's API server, EngineCore and workers talk through `multiprocessing.shared_memory` segments
(`/dev/shm/psm_*`), unlinked only when the engine exits gracefully; an engine SIGKILLed (an idle drain
past its 1 s grace, a stuck stop) used to leave them until the machine rebooted: hundreds of them on a
busy node. The engine here is a real process group doing what vLLM's does: a parent and a child
process, each holding a segment it created.
"""

import signal
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

from gpu_agent.runtime import process

ENGINE = """
import multiprocessing as mp, sys, time
from multiprocessing import shared_memory

def worker(queue):
    segment = shared_memory.SharedMemory(create=True, size=1 << 16)
    queue.put(segment.name)
    time.sleep(600)

if __name__ == "__main__":
    mp.set_start_method("fork")
    own = shared_memory.SharedMemory(create=True, size=1 << 16)
    queue = mp.Queue()
    mp.Process(target=worker, args=(queue,)).start()
    print(own.name, queue.get(), flush=True)
    time.sleep(600)
"""


def _start_engine(tmp_path: Path):
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    log_path = tmp_path / "engine.log"
    with open(log_path, "ab") as log:
        engine = process.spawn([sys.executable, str(script)], {"PATH": "/usr/bin:/bin"}, log, die_with_agent=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(log_path.read_text().split()) < 2:
        time.sleep(0.05)
    names = log_path.read_text().split()
    assert len(names) == 2, log_path.read_text()
    return engine, [Path("/dev/shm") / name for name in names]


def test_a_killed_engine_s_shared_memory_is_unlinked(tmp_path):
    engine, segments = _start_engine(tmp_path)
    assert all(segment.exists() for segment in segments)
    process.kill_group(engine.pid, engine, "replica-shm", tmp_path, signal.SIGKILL)
    assert engine.poll() is not None
    assert [segment for segment in segments if segment.exists()] == []


def test_shared_memory_of_other_processes_is_left_alone(tmp_path):
    mine = shared_memory.SharedMemory(create=True, size=4096)
    try:
        engine, segments = _start_engine(tmp_path)
        process.kill_group(engine.pid, engine, "replica-shm", tmp_path, signal.SIGKILL)
        assert not any(segment.exists() for segment in segments)
        assert (Path("/dev/shm") / mine.name).exists()
    finally:
        mine.close()
        mine.unlink()


def test_a_gentle_signal_unlinks_nothing(tmp_path):
    engine, segments = _start_engine(tmp_path)
    try:
        process.kill_group(engine.pid, engine, "replica-shm", tmp_path, signal.SIGSTOP)
        assert all(segment.exists() for segment in segments)
    finally:
        process.kill_group(engine.pid, engine, "replica-shm", tmp_path, signal.SIGKILL)
