"""How a task that must go on through failures still ends when cancelled.

NOTE: Python 3.11's `asyncio.wait_for`, cancelled just as what it waits for finishes, returns its result and drops the
CancelledError (fixed in 3.12), and redis-py writes every command through it. A loop that catches the failures of
such writes (Redis down, PostgreSQL down) and tries again then never ends: a loop's end (`asyncio.run`: a batch run's
slice, a test; a server's shutdown) cancels its tasks once and waits for them, for good. Such a loop calls
`end_if_cancelled()` on each turn.
"""

from __future__ import annotations

import asyncio


def end_if_cancelled() -> None:
    """Raise CancelledError when a cancellation is still asked of the running task (`cancelling()`; one handled, as by
    `asyncio.timeout`, is taken back), though what it awaited dropped it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()
