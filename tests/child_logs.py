"""A failed test that started child processes (web, worker, beat, agents: tests/processes.py, each logging to
a `*.log` in the test's `tmp_path`) shows the end of each log in its report, beside pytest's captured output.

A failure seen only in CI otherwise says what the test saw and nothing of what the platform did meanwhile:
the logs lie in a temporary directory of a machine that is gone. Loaded by tests/conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TAIL_CHARS = 3000  # of each log
ALL_TAILS_CHARS = 15000  # of all of a test's logs together, the newest written first


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if not isinstance(tmp_path, Path):
        return
    for title, text in log_tails(tmp_path):
        report.sections.append((f"child process log {title} (its end)", text))


def log_tails(directory: Path) -> list[tuple[str, str]]:
    """(name, tail) of each `*.log` under `directory`, the most recently written first, within the bounds."""
    try:
        logs = sorted(directory.rglob("*.log"), key=lambda path: path.stat().st_mtime, reverse=True)
    except OSError:
        return []
    tails, left = [], ALL_TAILS_CHARS
    for path in logs:
        if left <= 0:
            break
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        tail = text[-min(TAIL_CHARS, left) :]
        left -= len(tail)
        tails.append((str(path.relative_to(directory)), tail))
    return tails
