"""When each pytest-xdist worker ran what: the controller's summary says, per worker, how long it was busy and
when its last test ended (the other worker idles from then on), and writes every phase's start and end to
<INFERPLANE_DATA_DIR>/timeline.jsonl (one JSON object a line: worker, nodeid, when, start, stop; seconds
since the session started). Only under xdist: one process has no one to wait for."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

TIMELINE = "timeline.jsonl"  # under INFERPLANE_DATA_DIR; tests/split.py orders the next run by it
_phases: list[dict] = []
_session_start = [time.time()]


def pytest_sessionstart(session):
    _session_start[0] = time.time()


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # set by xdist's controller only
    if node is None:
        return
    _phases.append({
        "worker": node.gateway.id, "nodeid": report.nodeid, "when": report.when,
        "start": round(report.start - _session_start[0], 2), "stop": round(report.stop - _session_start[0], 2),
    })


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    if not _phases:
        return
    workers: dict[str, dict] = {}
    for phase in _phases:
        seen = workers.setdefault(phase["worker"], {"first": phase["start"], "last": 0.0, "busy": 0.0, "tests": set()})
        seen["first"] = min(seen["first"], phase["start"])
        seen["last"] = max(seen["last"], phase["stop"])
        seen["busy"] += phase["stop"] - phase["start"]
        seen["tests"].add(phase["nodeid"])
    end = max(seen["last"] for seen in workers.values())
    terminalreporter.section("worker timeline")
    for worker, seen in sorted(workers.items()):
        terminalreporter.write_line(
            f"{worker}: {len(seen['tests'])} tests, first at {seen['first']:.0f} s, last ended at {seen['last']:.0f} s "
            f"({end - seen['last']:.0f} s idle at the end), {seen['busy']:.0f} s in tests")
    path = Path(os.environ.get("INFERPLANE_DATA_DIR", ".data/test")) / TIMELINE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(phase) + "\n" for phase in _phases))
        terminalreporter.write_line(f"every phase: {path}")
    except OSError as error:
        terminalreporter.write_line(f"timeline not written: {error}")
