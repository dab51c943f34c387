"""A pytest-xdist worker leaves at once when the controller lets it go.

At the session's end the controller asks each worker to exit and waits at most 10 s (xdist's `EXIT_TIMEOUT`)
before it kills it. A worker of the whole suite has imported torch, vLLM's tokenizers, Chromium's driver, boto and
the rest, and its interpreter's own shutdown (C-level atexit handlers and module teardown, no Python frame on its
stack) outlasted those 10 s: every run ended ~10 s after its last test, waiting for nothing. By then the worker
has sent every result and its session's fixtures are torn down (children stopped, the test database dropped):
there is nothing left for its shutdown to do that a test needs.
"""

from __future__ import annotations

import atexit
import os
import sys

import pytest


def _leave_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # NOTE: registered last, so it runs first of the atexit handlers: the controller has collected the results
    # (the worker exits only once `teardown_nodes` asked it to), and the exit status a worker returns is not read.
    if hasattr(config, "workerinput"):
        atexit.register(_leave_now)
