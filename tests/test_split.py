"""The two xdist workers' split (tests/split.py), driven with stand-in workers: the engines run from the
head of their queue on one worker, the light modules on the other, which then takes engine modules from
the tail; no engine module is ever split, every test runs once."""

from __future__ import annotations

from types import SimpleNamespace

from tests.split import ENGINES, SHARED_ENGINE_UNIT, engines_scheduling

LIGHT = {"tests/test_a.py": 4, "tests/test_b.py": 2, "tests/test_c.py": 1, "tests/test_d.py": 3, "tests/test_e.py": 2, "tests/test_f.py": 1}
ENGINE_MODULES = ["tests/agent/test_one_vllm.py", "tests/agent/test_two_vllm.py", "tests/test_three_vllm.py"]
HEAVY_MODULE = "tests/billing/test_kills.py"
SHARED = ["tests/batches/test_batch_vllm.py::test_batch", "tests/gateway/test_gateway_vllm.py::test_chat"]


class Worker:
    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.queue: list[int] = []
        self.ran: list[str] = []

    def send_runtest_some(self, indices):
        assert not self.shutting_down
        self.queue.extend(indices)

    def shutdown(self):
        self.shutting_down = True


def collection() -> tuple[list[str], dict[str, str]]:
    nodeids, units = [], {}
    for module in ENGINE_MODULES[:2]:
        for n in range(2):
            nodeids.append(f"{module}::test_{n}")
            units[nodeids[-1]] = f"{ENGINES}::{module}"
    nodeids.append(f"{HEAVY_MODULE}::test_kill")
    units[nodeids[-1]] = f"{ENGINES}::heavy {HEAVY_MODULE}"
    for nodeid in SHARED:
        nodeids.append(nodeid)
        units[nodeid] = SHARED_ENGINE_UNIT
    for module, count in LIGHT.items():
        nodeids.extend(f"{module}::test_{n}" for n in range(count))
    nodeids.append(f"{ENGINE_MODULES[2]}::test_0")
    units[nodeids[-1]] = f"{ENGINES}::{ENGINE_MODULES[2]}"
    return nodeids, units


def run(engine_ticks: int, seconds: dict[str, float] | None = None) -> tuple[Worker, Worker, dict[str, str]]:
    """Both workers run their queues in lockstep (a light test takes a tick, an engine test `engine_ticks`)."""
    nodeids, units = collection()
    config = SimpleNamespace(getvalue=lambda name: ["2*popen"], option=SimpleNamespace(loadscopereorder=True))
    scheduler = engines_scheduling(config, None, lambda: units, seconds)
    workers = [Worker("gw0"), Worker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, nodeids)
    scheduler.schedule()
    busy = {worker.gateway.id: 0 for worker in workers}
    for _tick in range(1000):
        if all(worker.shutting_down and not worker.queue for worker in workers):
            break
        for worker in workers:
            if not worker.queue:
                continue
            busy[worker.gateway.id] += 1
            nodeid = nodeids[worker.queue[0]]
            if busy[worker.gateway.id] < (engine_ticks if nodeid in units else 1):
                continue
            busy[worker.gateway.id] = 0
            worker.ran.append(nodeids[worker.queue.pop(0)])
            scheduler.mark_test_complete(worker, nodeids.index(worker.ran[-1]))
    assert scheduler.tests_finished and not scheduler.has_pending
    assert sorted(workers[0].ran + workers[1].ran) == sorted(nodeids)  # every test once
    return workers[0], workers[1], units


def test_the_light_worker_takes_engine_modules_from_the_tail_once_no_light_module_is_left():
    engines, light, units = run(engine_ticks=5)
    assert engines.ran[: len(SHARED)] == SHARED  # the shared engine's unit first, on one worker
    assert engines.ran[len(SHARED)] == f"{HEAVY_MODULE}::test_kill"  # then the chaos runs
    assert not any(nodeid in units for nodeid in engines.ran if nodeid.split("::")[0] in LIGHT)
    # The light worker: every light test, then engine modules from the end of the queue.
    first_engine = next(i for i, nodeid in enumerate(light.ran) if nodeid in units)
    assert all(nodeid not in units for nodeid in light.ran[:first_engine])
    assert all(nodeid in units for nodeid in light.ran[first_engine:])
    assert sum(nodeid not in units for nodeid in light.ran) == sum(LIGHT.values())
    assert light.ran[first_engine] == f"{ENGINE_MODULES[2]}::test_0"  # the last engine module
    for module in [*ENGINE_MODULES, HEAVY_MODULE]:  # an engine module never split between workers
        assert not (any(n.startswith(module) for n in engines.ran) and any(n.startswith(module) for n in light.ran))


def test_fast_engines_leave_the_light_modules_to_both_workers():
    engines, light, units = run(engine_ticks=1)
    assert all(nodeid in units for nodeid in engines.ran[:7])  # every engine test, from the head
    assert not any(nodeid in units for nodeid in light.ran)
    assert any(nodeid.split("::")[0] in LIGHT for nodeid in engines.ran)  # then light modules


def test_with_the_last_runs_timeline_both_queues_go_longest_first_and_the_tail_is_the_shortest_engine_module():
    nodeids, units = collection()
    seconds = dict.fromkeys(nodeids, 1.0)
    seconds[f"{ENGINE_MODULES[2]}::test_0"] = 100.0  # the last collected engine module is the longest
    seconds["tests/test_c.py::test_0"] = 50.0  # the smallest light module is the longest
    engines, light, units = run(engine_ticks=5, seconds=seconds)
    assert engines.ran[: len(SHARED) + 1] == [*SHARED, f"{HEAVY_MODULE}::test_kill"]  # as without one
    assert engines.ran[len(SHARED) + 1] == f"{ENGINE_MODULES[2]}::test_0"  # then the longest module
    assert light.ran[0] == "tests/test_c.py::test_0"
    first_engine = next(nodeid for nodeid in light.ran if nodeid in units)
    assert first_engine.startswith(ENGINE_MODULES[1])  # the tail: the last of the equally short modules
    assert sorted(engines.ran + light.ran) == sorted(nodeids)
