"""Under CI (`CI` set to a true value) a skipped test is a failed test.

A browser test skips on a developer's machine without chromium; in CI the same skip would turn
a missing browser into a green run. Loaded by tests/conftest.py.
"""

from __future__ import annotations

import os

import pytest

TRUE = {"1", "true", "yes", "on"}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in TRUE


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which must run every test: {reason}"
