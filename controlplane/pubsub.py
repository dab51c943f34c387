"""One Redis pub/sub connection per process (per event loop), shared by everyone waiting for a message.

Requests held for a cold start wait for their endpoint's READY message, and agents long-poll
(`/agent/v1/watch`) for their node's. Each used to take a pub/sub connection of its own from the
shared pool, so a few hundred held streams emptied the pool and every other Redis call in the
process failed. Here a channel is subscribed once per process however many wait on it, on one
connection outside the shared pool; it is dropped when its last waiter leaves. `subscribe(channel)` is
the one way code here waits for a channel (the gateway's cold-start hold, the agents' watch).

A lost message (a reconnect) costs only a waiter's own polling: every waiter also polls, and all of
them are woken after a reconnect to look again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import redis.asyncio
from django.conf import settings

from controlplane.cancellation import end_if_cancelled
from controlplane.per_loop import PerLoop

logger = logging.getLogger("inferplane.pubsub")

READ_TIMEOUT_S = 1.0
RECONNECT_DELAY_S = 0.5


class Signal:
    """What one waiter holds: set when a message arrives on its channel."""

    __slots__ = ("_arrived", "arrived_at")

    def __init__(self) -> None:
        self._arrived = asyncio.Event()
        # When (monotonic) the last message came: a read begun after it sees what it announced (`Memo.get`'s
        # `fresh_since`), so the waiters one message woke share one read.
        self.arrived_at = 0.0

    async def wait(self, timeout_s: float) -> bool:
        """Whether a message arrived within `timeout_s` (or since the last wait); consumes it."""
        if not self._arrived.is_set():
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout_s)
            except TimeoutError:
                return False
        self._arrived.clear()
        return True

    def _set(self) -> None:
        self.arrived_at = time.monotonic()
        self._arrived.set()


class Listener:
    """The process's subscriptions: channel → its waiters, fanned out from one connection."""

    def __init__(self, url: str):
        self._url = url
        self._waiters: dict[str, set[Signal]] = {}
        self._pubsub = None
        self._reader: asyncio.Task | None = None
        self._changes = asyncio.Lock()  # NOTE: keeps SUBSCRIBE/UNSUBSCRIBE in the order waiters asked
        self._has_channels = asyncio.Event()

    @property
    def num_channels(self) -> int:
        return len(self._waiters)

    @property
    def num_waiters(self) -> int:
        return sum(len(waiters) for waiters in self._waiters.values())

    @contextlib.asynccontextmanager
    async def subscribe(self, channel: str) -> AsyncIterator[Signal]:
        signal = Signal()
        waiters = self._waiters.setdefault(channel, set())
        waiters.add(signal)
        try:
            if len(waiters) == 1:
                await self._change("subscribe", channel)
            yield signal
        finally:
            waiters.discard(signal)
            if not waiters and self._waiters.get(channel) is waiters:
                del self._waiters[channel]
                await self._change("unsubscribe", channel)

    async def _change(self, command: str, channel: str) -> None:
        async with self._changes:
            try:
                pubsub = self._connected()
                await getattr(pubsub, command)(channel)
            except (redis.RedisError, OSError) as exc:
                # The reader reconnects and subscribes to whatever has waiters then.
                logger.warning("pub/sub %s %s failed: %r", command, channel, exc)
        if self._waiters:
            self._has_channels.set()

    def _connected(self):
        if self._pubsub is None:
            # NOTE: its own client and connection: never one of the shared pool's.
            client = redis.asyncio.Redis.from_url(self._url, decode_responses=True, max_connections=2)
            self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read())
        return self._pubsub

    async def _read(self) -> None:
        while True:
            end_if_cancelled()  # NOTE: a cancellation a read dropped as its answer came: the loop's end waited for good
            if not self._waiters or self._pubsub is None or not self._pubsub.subscribed:
                self._has_channels.clear()
                await self._has_channels.wait()
                continue
            try:
                message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=READ_TIMEOUT_S)
            except (redis.RedisError, OSError) as exc:
                logger.warning("pub/sub connection lost: %r; reconnecting", exc)
                await self._reconnect()
                continue
            if message is None or message.get("type") != "message":
                continue
            waiters = self._waiters.get(message["channel"])
            for signal in waiters or ():
                signal._set()
            if not waiters:  # a waiter left without its UNSUBSCRIBE getting through
                asyncio.ensure_future(self._change("unsubscribe", message["channel"]))

    async def close(self) -> None:
        """Its connection closed (its loop is ending: its reader was cancelled with the loop's tasks)."""
        if self._reader is not None:
            self._reader.cancel()
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            await pubsub.aclose()

    async def _reconnect(self) -> None:
        await asyncio.sleep(RECONNECT_DELAY_S)
        async with self._changes:
            old, self._pubsub = self._pubsub, None
            if old is not None:
                with contextlib.suppress(Exception):
                    await old.aclose()
            try:
                pubsub = self._connected()
                if self._waiters:
                    await pubsub.subscribe(*self._waiters)
            except (redis.RedisError, OSError) as exc:
                logger.warning("pub/sub reconnect failed: %r", exc)
        for waiters in list(self._waiters.values()):  # they may have missed a message: look again
            for signal in waiters:
                signal._set()


# NOTE: one per event loop: an asyncio connection belongs to the loop that made it, and is closed as it ends.
_listeners: PerLoop[Listener] = PerLoop(lambda: Listener(settings.REDIS_URL), close=Listener.close)


def subscribe(channel: str) -> contextlib.AbstractAsyncContextManager[Signal]:
    """Wait for messages on `channel` (`async with subscribe(channel) as signal: await signal.wait(s)`),
    on this process's one shared pub/sub connection: the one way anything here waits for a channel."""
    return _listeners.get().subscribe(channel)
