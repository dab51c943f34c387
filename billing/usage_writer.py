"""Coalesces concurrent `arecord_usage` calls of one event loop into one INSERT statement.

Each caller still waits until its own row is committed (nothing is buffered past the answer,
so a crash loses nothing the gateway thought was written), and exactly-once still comes from the
unique request id. Under load, one commit carries many requests: that is what takes the ledger
from ~1,000 rows/s (a commit per request) to many thousands on two cores.

The writer talks to PostgreSQL on its own async psycopg connection (autocommit, the same
database settings as Django's), on the event loop itself: no worker thread, so the gateway's
loop never waits for the GIL behind a thread running the ORM.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass, field

import psycopg

from billing.ledger import UnknownEndpointError, UsageReport, record_usage_batch_on

MAX_BATCH = 500


async def _connect() -> psycopg.AsyncConnection:
    from django.db import connections

    params = connections["default"].get_connection_params()
    params.pop("cursor_factory", None)
    # NOTE: client-side binding, as Django's own cursors do, so the ledger's SQL runs the same way.
    return await psycopg.AsyncConnection.connect(**params, autocommit=True, cursor_factory=psycopg.AsyncClientCursor)


def _outcomes(reports: list[UsageReport], written: set[str], refused: dict[str, Exception]) -> list[bool | Exception]:
    outcomes: list[bool | Exception] = []
    seen = set()
    for report in reports:  # NOTE: a request id twice in one batch: only the first caller wrote it
        outcomes.append(refused.get(report.request_id) or (report.request_id in written and report.request_id not in seen))
        seen.add(report.request_id)
    return outcomes


@dataclass
class UsageWriter:
    max_batch: int = MAX_BATCH
    _pending: list[tuple[UsageReport, asyncio.Future]] = field(default_factory=list)
    _flusher: asyncio.Task | None = None
    _connection: psycopg.AsyncConnection | None = None

    async def write(self, report: UsageReport) -> bool:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((report, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _write_batch(self, reports: list[UsageReport]) -> list[bool | Exception]:
        """One statement for the batch; a refused report fails alone.

        NOTE: a connection that dropped (a PostgreSQL restart, a failover, an idle timeout) is
        replaced and the batch written again: safe, since a request id already written is skipped.
        """
        try:
            return await self._write_once(reports)
        except psycopg.OperationalError:
            return await self._write_once(reports)

    async def _write_once(self, reports: list[UsageReport]) -> list[bool | Exception]:
        if self._connection is None or self._connection.closed:
            self._connection = await _connect()
        try:
            written, refused = await record_usage_batch_on(self._connection, reports), {}
        except UnknownEndpointError as exc:
            written, refused = exc.written_ids, dict.fromkeys(exc.refused_ids, exc)
        except psycopg.Error:
            await self.close()  # the next write starts on a new connection
            raise
        return _outcomes(reports, written, refused)

    async def _flush(self) -> None:
        # NOTE: yielding once lets every coroutine that is ready to write join this batch.
        await asyncio.sleep(0)
        while self._pending:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            try:
                outcomes = await self._write_batch([report for report, _ in batch])
            except Exception as exc:  # the database is down: every caller hears it
                outcomes = [exc] * len(batch)
            for (_, future), outcome in zip(batch, outcomes, strict=True):
                if future.done():
                    continue
                if isinstance(outcome, Exception):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and not connection.closed:
            await connection.close()

    def close_now(self) -> None:
        """Close the connection without a loop (its loop is gone)."""
        connection, self._connection = self._connection, None
        if connection is not None and not connection.closed:
            connection.pgconn.finish()


_writers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, UsageWriter] = weakref.WeakKeyDictionary()
_latest: tuple = (lambda: None, None)  # (weak loop, writer): the gateway's one loop, without a weak-dict lookup


def writer_for_this_loop() -> UsageWriter:
    global _latest
    loop = asyncio.get_running_loop()
    if _latest[0]() is loop:
        return _latest[1]
    writer = _writers.get(loop)
    if writer is None:
        writer = _writers[loop] = UsageWriter()
        # NOTE: a loop that closes (asyncio.run in a script or a test) takes its connection along.
        weakref.finalize(loop, writer.close_now)
    _latest = (weakref.ref(loop), writer)
    return writer


def close_all() -> None:
    """Close every writer's connection now (a test session ends; its database is about to go)."""
    for writer in [*_writers.values(), _latest[1]]:
        if writer is not None:
            writer.close_now()
