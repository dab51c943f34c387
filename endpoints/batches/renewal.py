"""A lease kept by a thread while its process works under it: an idempotency key's claim (`idempotency.held`), an
upload's place in the storage quota (`services.upload_held`).

It is renewed every third of its length however long a step takes (an S3 part, its completion, SlowDown retries),
and stops with the work; a process that dies takes the thread with it, and its lease lapses.
NOTE: an upload's lease was renewed between its body's chunks only: a slow S3 completion outlasted it, its row stopped
counting, and a concurrent upload was stored beside it past the quota.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.db import DatabaseError, connections

logger = logging.getLogger("inferplane.batches")


class Renewal:
    """Calls `renew` every third of `lease_s` from `start` to `stop` (or as a `with` block), until it says False (the
    lease no longer this holder's: ended, or taken over). A database error is logged and tried again at the next turn."""

    def __init__(self, renew: Callable[[], bool], *, lease_s: float, name: str) -> None:
        self.renew, self.lease_s, self.name = renew, lease_s, name
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Renewal:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Renew no more; returns once the thread has ended. Safe to call twice, or never started."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Renewal:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            while not self._done.wait(self.lease_s / 3):
                try:
                    if not self.renew():
                        return
                except DatabaseError:
                    logger.warning("could not renew the lease of %s; trying again", self.name, exc_info=True)
        finally:
            connections.close_all()  # this thread's own
