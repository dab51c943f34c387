"""How tests/run.sh's two pytest-xdist workers (`-n 2 --dist loadgroup`) share the suite.

The CPU-heavy tests, the "engines" (real vLLM engines, marker `vllm`, and every user of the shared
`vllm_engine`; chaos runs that kill workers, marker `heavy`), run one module at a time on one worker, in
order, while the other worker runs every other test module (largest first), a module at a time: two engine
starts never compete for the two cores while light modules are left. Once no light module is left, the
light worker takes engine modules from the end of the engines' queue (the two workers meet in the middle)
instead of idling while the engines worker runs the rest alone. The shared engine's users form one unit
(its one engine starts once, on one worker) at the head of the queue, the chaos runs right after it: the
modules taken from the tail are single-engine ones. Where the last run left its timeline (tests/timeline.py,
<INFERPLANE_DATA_DIR>/timeline.jsonl), both queues are ordered longest first by its times (after the
shared engine and the chaos runs), so that the units left at the end, when the workers meet, are short
ones; without one (a clean clone), light modules go largest first by their number of tests and engine
modules in collection order. The order changes when each test runs, never whether it does.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import pytest

from tests.timeline import TIMELINE

ENGINES = "engines"
SHARED_ENGINE_UNIT = f"{ENGINES}::shared vllm_engine"
HEAVY_UNITS = "engine-units-{}.json"


def engine_unit(item) -> str | None:
    """The unit of work of an engine test (None for a light test): its module, or the shared engine's unit."""
    if "vllm_engine" in getattr(item, "fixturenames", ()):
        return SHARED_ENGINE_UNIT
    if item.get_closest_marker("vllm") is None and item.get_closest_marker("heavy") is None:
        return None
    module = item.nodeid.split("::", 1)[0]
    return f"{ENGINES}::{'heavy ' if item.get_closest_marker('heavy') else ''}{module}"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # NOTE: xdist's own `xdist_group` marks do nothing under pytest 9 (xdist rewrites `item._nodeid`, which
    # pytest 9's nodeid no longer reads), so each worker writes its engine tests' units where the controller's
    # scheduler (below) reads them: the controller's temporary folder, the parent of each worker's.
    worker_input = getattr(config, "workerinput", None)
    if worker_input is not None:
        folder = config._tmp_path_factory.getbasetemp().parent
        units = {item.nodeid: unit for item in items if (unit := engine_unit(item)) is not None}
        partial = folder / f".{HEAVY_UNITS.format(worker_input['workerid'])}"
        partial.write_text(json.dumps(units))
        partial.rename(folder / HEAVY_UNITS.format(worker_input["workerid"]))


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadgroup":
        return None
    units: dict[str, str] = {}

    def read_units() -> dict[str, str]:
        # NOTE: called once every worker has collected (and written its map); the maps are equal.
        if not units:
            for path in config._tmp_path_factory.getbasetemp().glob(HEAVY_UNITS.format("*")):
                units.update(json.loads(path.read_text()))
        return units

    return engines_scheduling(config, log, read_units, last_run_seconds())


def last_run_seconds() -> dict[str, float]:
    """Each test's seconds (setup, call and teardown) in the last run's timeline; empty without one."""
    seconds: dict[str, float] = {}
    try:
        lines = (Path(os.environ.get("INFERPLANE_DATA_DIR", ".data/test")) / TIMELINE).read_text().splitlines()
        for line in lines:
            phase = json.loads(line)
            seconds[phase["nodeid"]] = seconds.get(phase["nodeid"], 0.0) + phase["stop"] - phase["start"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return seconds


def engines_scheduling(config, log, read_units, seconds: dict[str, float] | None = None):
    """The scheduler (module docstring) over xdist's LoadScopeScheduling; `read_units` maps each engine
    test's node id to its unit (`engine_unit`), `seconds` each test's time in the last run."""
    seconds = seconds or {}

    def longest_first(scope_units: list) -> list:
        # NOTE: a unit the last run did not have (a new module) goes first: it may be long.
        return sorted(scope_units, key=lambda scope_unit: -sum(seconds.get(nodeid, 1e6) for nodeid in scope_unit[1]))

    from xdist.scheduler import LoadScopeScheduling

    class EnginesFromBothEnds(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.engines: OrderedDict[str, dict[str, bool]] = OrderedDict()  # not handed out yet, in order
            self.engines_node = None  # the worker that takes the engines from the head

        def _split_scope(self, nodeid: str) -> str:
            return read_units().get(nodeid) or nodeid.split("::", 1)[0]

        @property
        def tests_finished(self) -> bool:
            return not self.engines and super().tests_finished

        @property
        def has_pending(self) -> bool:
            return bool(self.engines) or super().has_pending

        def schedule(self) -> None:
            if self.collection is not None or not self.collection_is_completed:
                return super().schedule()
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            work: dict[str, dict[str, bool]] = {}
            for nodeid in self.collection:
                work.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            light = [(scope, unit) for scope, unit in work.items() if not scope.startswith(f"{ENGINES}::")]
            if seconds:
                light = longest_first(light)
            elif self.config.option.loadscopereorder:
                light.sort(key=lambda scope_unit: -len(scope_unit[1]))
            self.workqueue.update(light)
            # The shared engine's unit first, then the chaos runs, then the single-engine modules.
            engines = [(scope, unit) for scope, unit in work.items() if scope.startswith(f"{ENGINES}::")]
            if seconds:
                engines = longest_first(engines)
            rank = {SHARED_ENGINE_UNIT: 0}
            engines.sort(key=lambda scope_unit: rank.get(scope_unit[0], 1 if scope_unit[0].startswith(f"{ENGINES}::heavy ") else 2))
            self.engines.update(engines)
            for node in self.nodes:
                self._reschedule(node)

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue and not self.engines:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) > 2:
                return
            self._assign_work_unit(node)

        def _assign_work_unit(self, node) -> None:
            if self.engines and self.engines_node in (None, node):
                self.engines_node = node
                scope, unit = self.engines.popitem(last=False)
            elif self.workqueue:
                scope, unit = self.workqueue.popitem(last=False)
            else:  # no light module left: an engine module from the tail
                scope, unit = self.engines.popitem(last=True)
            self.assigned_work.setdefault(node, {})[scope] = unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in unit.items() if not done])

        def remove_node(self, node):
            # A crashed worker's unfinished units go back: engine units to the head of the engines' queue.
            workload = dict(self.assigned_work.get(node, {}))
            engines = [scope for scope in workload if scope.startswith(f"{ENGINES}::")]
            crashed = super().remove_node(node)  # puts every unfinished unit back in self.workqueue
            for scope in reversed(engines):
                if scope in self.workqueue:
                    self.engines[scope] = self.workqueue.pop(scope)
                    self.engines.move_to_end(scope, last=False)
            if node is self.engines_node:
                self.engines_node = None
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

    return EnginesFromBothEnds(config, log)
