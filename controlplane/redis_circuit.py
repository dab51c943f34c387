"""One circuit per process for a Redis that does not answer: open once a call's deadline passes, closed once Redis
answers a probe again.

NOTE: a Redis that accepts connections and never replies (a partition, a dead load balancer that sends no RST, a frozen
server) cost every call `REDIS_TIMEOUT_S` before its 503: each found the connection dropped by the one before and
opened a new one into the same silence, and a key new to the process waited out two more (redis-py's, for its shared
mark), so a gateway under load held every caller 2 to 4 s. While the circuit is open a caller on the gateway's path
is refused at once (the gateway's clean 503 with `Retry-After`); nothing is admitted without Redis, so never without
its limits. One probe at a time, on a connection of its own, asks Redis again every `PROBE_INTERVAL_S` with a short
deadline of its own (`PROBE_TIMEOUT_S`), so calls flow again within a second of Redis answering.

The probe runs on the event loop of a caller that found the circuit open; one whose loop ended (a test's, a thread's)
stops reporting, and the next caller on a loop starts another (`PROBE_LOST_S`). A caller with no loop (a worker
thread, a Celery task) is refused only while a probe runs; with none running its call goes to Redis as before, so a
process with no event loop (a Celery worker) is never shut out of Redis with nobody to notice its return.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import redis.asyncio
from django.conf import settings

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.1
PROBE_TIMEOUT_S = 0.5
PROBE_LOST_S = 2 * (PROBE_TIMEOUT_S + PROBE_INTERVAL_S)  # a probe silent this long has lost its loop


class RedisCircuit:
    """Whether this process sends calls to Redis now (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.is_open = False
        self._probe_seen_at = 0.0
        self._probe: asyncio.Task | None = None  # held: a task nobody references may be collected mid-probe

    def admits(self) -> bool:
        """Whether a call may go to Redis now. While the circuit is open, a caller on an event loop makes sure a probe
        runs (on that loop) and is refused; one without a loop is refused while a probe runs."""
        if not self.is_open:
            return True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            if not self.is_open:
                return True
            if time.monotonic() - self._probe_seen_at < PROBE_LOST_S:
                return False
            if loop is None:
                return True
            self._probe_seen_at = time.monotonic()
        self._probe = loop.create_task(self._probe_until_answered())
        return False

    def trip(self, why: BaseException) -> None:
        """A call's deadline passed: Redis is silent. Open until a probe is answered."""
        with self._lock:
            if self.is_open:
                return
            self.is_open = True
            self._probe_seen_at = 0.0
        logger.warning("Redis did not answer (%s): calls refused until it does", why)

    def close(self) -> None:
        """Redis answers: calls go to it again."""
        with self._lock:
            was_open, self.is_open = self.is_open, False
        if was_open:
            logger.warning("Redis answers again: calls sent to it again")

    async def _probe_until_answered(self) -> None:
        while self.is_open:
            self._probe_seen_at = time.monotonic()
            try:
                await asyncio.wait_for(_ping(), PROBE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - any failure is "not yet"; the probe never dies loud
                await asyncio.sleep(PROBE_INTERVAL_S)
                continue
            self.close()


async def _ping() -> None:
    """One PING on a connection of its own: never a caller's (which may be the silent one), nor one the circuit
    refuses."""
    client = redis.asyncio.Redis.from_url(settings.REDIS_URL, socket_timeout=PROBE_TIMEOUT_S,
                                          socket_connect_timeout=PROBE_TIMEOUT_S, single_connection_client=True)
    try:
        await client.ping()
    finally:
        await client.aclose()


circuit = RedisCircuit()
