"""Coalesces concurrent `arecord_usage` calls of one event loop into one INSERT statement.

Each caller still waits until its own row is committed (nothing is buffered past the answer,
so a crash loses nothing the gateway thought was written), and exactly-once still comes from the
unique request id. Under load, one commit carries many requests: that is what takes the ledger
from ~1,000 rows/s (a commit per request) to many thousands on two cores.

The writer talks to PostgreSQL on its own async psycopg connection (autocommit, the same
database settings as Django's), on the event loop itself: no worker thread, so the gateway's
loop never waits for the GIL behind a thread running the ORM.

When PostgreSQL cannot take a batch (down, restarting, or silent past `WRITE_TIMEOUT_S`), the
batch goes to the durable local journal (`billing.usage_journal`, fsync'd) and its callers hear
"written": the row is owed and safe on disk. For `OUTAGE_PROBE_S` after a failure, batches go
straight to the journal (a dead database is not waited for on every request) while one replay task
per writer probes the database and, once it answers, writes the journal into the ledger (exactly
once: the unique request id) and deletes it. The gateway also replays at start (`replay_soon`), so
a process that died with a backlog leaves it to the next one.

A journal past its limit (`UsageJournal.full`) stops the gateway admitting calls (`usage_recordable`, a flag read per
call, no I/O) until a replay brings it below again: the replay task goes on, listing the folder, while it is full.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from decimal import Decimal

import psycopg
from django.conf import settings
from django.db import connections

from billing import journal_shipping
from billing.ledger import (
    UnknownEndpointError,
    UsageReport,
    record_usage_batch_on,
    supersede_lost_rows_on,
    superseding,
)
from billing.quota import replayed
from billing.usage_journal import UsageJournal, read_segment
from controlplane.cancellation import end_if_cancelled
from controlplane.per_loop import PerLoop
from controlplane.worker_threads import in_worker_thread

logger = logging.getLogger("inferplane.billing")

MAX_BATCH = 500
# A batch waits this long for more rows before it is written: fewer, larger statements, so less CPU
# per row in the gateway (each statement's send and reply cost more than its rows) and in PostgreSQL.
# NOTE: nobody waits on it but the request's own end (its settlement in Redis follows the row): the
# answer has been sent by then.
BATCH_WINDOW_S = 0.01
WRITE_TIMEOUT_S = 5.0  # a database that does not commit a batch in this long is treated as down
CONNECT_TIMEOUT_S = 3
OUTAGE_PROBE_S = 1.0  # after a failure, batches go to the journal this long before PostgreSQL is tried again
REPLAY_RETRY_MAX_S = 5.0


class Recorded(enum.IntEnum):
    """What `arecord_usage` did with a report: false only for a request id written before."""

    DUPLICATE = 0
    WRITTEN = 1  # committed into the ledger (also over the sweeper's `gateway_lost` row of its call, superseded)
    # In the journal, owed to the ledger: its settlement marks the counters it counts it in, for its replay
    # (`billing.quota.replayed`), which counts it in those Redis rebuilt meanwhile from a ledger without it.
    JOURNALED = 2


class DatabaseUnavailable(Exception):
    """The ledger is in an outage window: the batch goes to the journal without trying PostgreSQL."""


class LedgerNotWritable(Exception):
    """PostgreSQL refused a batch for a reason that is not its rows': a server that turned read-only
    (a demoted primary after a failover, `default_transaction_read_only`), one shutting down or out of
    disk, a serialisation failure. The batch is owed, as in any outage."""


# The database is unreachable, restarting, silent or refusing writes: the batch is owed, so it goes to
# the journal. Only an error about the rows themselves (`_about_the_rows`) reaches the callers.
OUTAGES = (DatabaseUnavailable, LedgerNotWritable, psycopg.OperationalError, psycopg.InterfaceError, OSError,
           TimeoutError)
# SQLSTATE classes that judge what a row holds: 22 data exception, 23 integrity constraint violation.
ROW_ERROR_CLASSES = ("22", "23")


def _about_the_rows(exc: psycopg.Error) -> bool:
    """Whether the database refused the statement for what its rows hold (writing it again fails again)."""
    return (exc.sqlstate or "")[:2] in ROW_ERROR_CLASSES


def _as_outage(exc: psycopg.Error) -> Exception:
    """`exc`, or a `LedgerNotWritable` when it says the database cannot take writes now."""
    if isinstance(exc, psycopg.DatabaseError) and not isinstance(exc, psycopg.OperationalError) and not _about_the_rows(exc):
        return LedgerNotWritable(f"{type(exc).__name__} ({exc.sqlstate}): {exc}")
    return exc


@functools.cache
def journal() -> UsageJournal:
    """This process's usage journal (one for every event loop's writer)."""
    return UsageJournal(settings.USAGE_JOURNAL_DIR, max_bytes=settings.USAGE_JOURNAL_MAX_BYTES)


def usage_recordable() -> bool:
    """Whether a new call's usage row can be recorded: false while the journal is past its limit (PostgreSQL has
    taken no writes for a while). An attribute read: the gateway asks it on every call."""
    return not journal().full


PREPARE_ONLY_WHEN_ASKED = 2**31 - 1  # psycopg's prepare_threshold: never reached by a count of executions


def prepares_statements() -> bool:
    """Whether the writer's statement is prepared once per connection: not behind PgBouncer in
    transaction mode (`DATABASE_POOLER`), where a prepared statement may not exist on the next transaction's
    server connection."""
    return settings.DATABASE_POOLER == "none"


async def _connect() -> psycopg.AsyncConnection:
    params = connections["default"].get_connection_params()
    params.pop("cursor_factory", None)
    params.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
    # NOTE: with server-side binding the ledger's INSERT (four joins over a JSON recordset) is prepared once per
    # connection and every batch runs its plan (`record_usage_batch_on`), not parsed and planned per batch;
    # measured, that saved PostgreSQL less than its per-row work varies (bench/results/gateway_profile.md,
    # round 8). Behind a transaction pooler: client-side binding, as Django's own cursors, parsed each time.
    if prepares_statements():
        # only what asks for it (`prepare=True`: the INSERT) is prepared; psycopg's None would refuse even that
        params["prepare_threshold"] = PREPARE_ONLY_WHEN_ASKED
        return await psycopg.AsyncConnection.connect(**params, autocommit=True, cursor_factory=psycopg.AsyncCursor)
    return await psycopg.AsyncConnection.connect(**params, autocommit=True, cursor_factory=psycopg.AsyncClientCursor)


def _outcomes(reports: list[UsageReport], written: set[str], refused: dict[str, Exception]) -> list[Recorded | Exception]:
    outcomes: list[Recorded | Exception] = []
    seen = set()
    for report in reports:  # NOTE: a request id twice in one batch: only the first caller wrote it
        outcomes.append(refused.get(report.request_id)
                        or Recorded(report.request_id in written and report.request_id not in seen))
        seen.add(report.request_id)
    return outcomes


@dataclass
class UsageWriter:
    max_batch: int = MAX_BATCH
    _pending: list[tuple[UsageReport, asyncio.Future]] = field(default_factory=list)
    _flusher: asyncio.Task | None = None
    _connection: psycopg.AsyncConnection | None = None
    _down_until: float = 0.0  # monotonic: until then, batches go to the journal
    _replayer: asyncio.Task | None = None

    async def write(self, report: UsageReport) -> Recorded:
        """WRITTEN once the row is committed, JOURNALED once journaled (to be replayed), DUPLICATE if its id was
        written before."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((report, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _write_batch(self, reports: list[UsageReport]) -> list[Recorded | Exception]:
        """One statement for the batch; a refused report fails alone.

        NOTE: a connection that dropped (a PostgreSQL restart, a failover, an idle timeout) is
        replaced and the batch written again: safe, since a request id already written is skipped.
        """
        if time.monotonic() < self._down_until:
            raise DatabaseUnavailable()
        try:
            return await self._write_once(reports)
        except psycopg.OperationalError:
            return await self._write_once(reports)

    async def _write_once(self, reports: list[UsageReport]) -> list[Recorded | Exception]:
        try:
            written, refused, (superseded, registered) = await asyncio.wait_for(self._write_rows(reports),
                                                                                WRITE_TIMEOUT_S)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            # NOTE: a statement cut short by the timeout may still commit; its replay is then a no-op.
            self.close_now()  # the next write starts on a new connection
            outage = _as_outage(exc) if isinstance(exc, psycopg.Error) else exc
            if outage is not exc:
                raise outage from exc
            raise
        # NOTE: counted before its caller settles: a lost row the sweeper has not settled yet is counted whole here,
        # and the call's settlement then finds the marker set and only releases its hold (`replayed.count_superseded`).
        # Registered, it counts only if it drops the registration: the sweeper counts one whose writer died before
        # (`replayed.count_lapsed_supersedes`), and this one, frozen past it, then adds nothing again.
        await _count_superseded(superseded, registered=registered)
        return _outcomes(reports, written | superseded.keys(), refused)

    async def _write_rows(self, reports: list[UsageReport], *, supersede: bool = True,
                          ) -> tuple[set[str], dict[str, Exception], tuple[dict[str, Decimal], bool]]:
        """A batch into the ledger, a call's own or a journal's: the request ids written now, those refused
        (`UnknownEndpointError`), and the cost of each `gateway_lost` row it superseded
        (`billing.ledger.supersede_lost_rows`) with whether they were registered (`_supersede`).

        NOTE: a call's own row supersedes the sweeper's as a replayed one does: a gateway that froze (a long pause, a
        VM paused, cut from Redis and PostgreSQL) past its call's hold, then woke and finished the call, had its row
        refused as a duplicate, the tokens after its last beat never billed and the row marked lost."""
        if self._connection is None or self._connection.closed:
            self._connection = await _connect()
        try:
            written, refused = await record_usage_batch_on(self._connection, reports), {}
        except UnknownEndpointError as exc:
            written, refused = exc.written_ids, dict.fromkeys(exc.refused_ids, exc)
        return written, refused, await self._supersede(reports, written) if supersede else ({}, False)

    async def _supersede(self, reports: list[UsageReport], written: set[str], *,
                         registered: bool = False) -> tuple[dict[str, Decimal], bool]:
        """The cost of each `gateway_lost` row that the rows of `reports` not written now superseded, and whether they
        were registered (here, or `registered`: a replay's batch, registered before its INSERT).

        NOTE: each row that may supersede one is registered first, as a replay registers its rows (`replayed`): a
        counter rebuilt between the supersede and its count then counts the difference once (cheap: only rows not
        written now). Not again for a replay's: registered again and dropped here, a row another replay of the same
        segment wrote at once lost the registration its count goes by (`replayed.Registration`)."""
        if not (candidates := superseding(reports, written)):
            return {}, registered
        registration = None
        if not registered:
            registration = await _register_replaying(candidates)
        if self._connection is None or self._connection.closed:
            self._connection = await _connect()
        superseded = await supersede_lost_rows_on(self._connection, candidates)
        if not registered:
            # NOTE: a registration left would be taken for a killed replay's, owed a count (`replayed.count_replayed`).
            await _drop_registrations([report for report in candidates if report.request_id not in superseded])
        return superseded, registered or registration is not None

    async def _journal(self, reports: list[UsageReport]) -> list[Recorded]:
        await asyncio.to_thread(journal().append, reports)
        self.replay_soon()
        return [Recorded.JOURNALED] * len(reports)  # owed and durable: counted as written

    async def _flush(self) -> None:
        # NOTE: every coroutine that is ready to write, or gets there within the window, joins this batch.
        await asyncio.sleep(BATCH_WINDOW_S)
        while self._pending:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            reports = [report for report, _ in batch]
            try:
                outcomes = await self._write_batch(reports)
            except OUTAGES as exc:
                if not isinstance(exc, DatabaseUnavailable):
                    logger.warning("ledger unavailable (%r): %d usage row(s) go to the journal", exc, len(reports))
                    self._down_until = time.monotonic() + OUTAGE_PROBE_S
                try:
                    outcomes = await self._journal(reports)
                except Exception as journal_exc:  # noqa: BLE001 - neither database nor disk: every caller hears it
                    logger.error("usage journal failed too: %r", journal_exc)
                    outcomes = [journal_exc] * len(batch)
            except Exception as exc:  # noqa: BLE001 - a bug, not an outage: every caller hears it
                outcomes = [exc] * len(batch)
            for (_, future), outcome in zip(batch, outcomes, strict=True):
                if future.done():
                    continue
                if isinstance(outcome, Exception):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    # --- replaying the journal -------------------------------------------------------------------
    def replay_soon(self) -> asyncio.Task:
        """Start this writer's replay task unless one runs: it ends when the journal is empty."""
        if self._replayer is None or self._replayer.done():
            self._replayer = asyncio.get_running_loop().create_task(self._replay_until_empty())
        return self._replayer

    async def _replay_until_empty(self) -> None:
        """NOTE: a cancellation that came as one of the replay's Redis writes finished was dropped
        (`controlplane.cancellation`): the replay caught the outage and tried again for as long as the database was
        down, and a loop's end (`replay_before_the_loop_ends`, a gateway's shutdown) waited for it."""
        delay_s = OUTAGE_PROBE_S
        refused_since = None
        while True:
            end_if_cancelled()
            try:
                await self.replay()
            except OUTAGES as exc:
                end_if_cancelled()
                logger.info("usage journal replay waits for the database: %r", exc)
                self.close_now()
                refused_since = time.monotonic() if refused_since is None else refused_since
                if time.monotonic() - refused_since >= settings.USAGE_JOURNAL_SHIP_AFTER_S:
                    # NOTE: what this pod holds is in the bucket, should the pod go before the database is back.
                    await asyncio.to_thread(journal_shipping.ship, journal())
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, REPLAY_RETRY_MAX_S)
                continue
            self._down_until = 0.0
            # NOTE: a batch journaled while this replay ran opened a new segment: replay it too. A journal still full
            # (another live process's segments, which it replays itself) is listed again until it is not: its calls
            # are refused meanwhile.
            if journal().full:
                await asyncio.sleep(delay_s)
                continue
            if not journal().has_open_segment():
                return

    async def replay(self) -> int:
        """Write every segment this process may take into the ledger (its own, and those of dead
        processes); returns how many it left to live processes. Raises while the database is down."""
        usage_journal = journal()
        await asyncio.to_thread(usage_journal.seal)
        num_left = 0
        try:
            num_left = await self._replay_segments(usage_journal)
        finally:
            # NOTE: off the pod's volume, which dies with it, whenever it holds lines, not only those this call set
            # aside: before, a replay that met an outage after setting lines aside raised past its ship, and the
            # replay that followed shipped nothing it had not set aside itself (found by this stop's review). So a
            # ship that failed, or never came, is tried again at each replay. Never awaited here.
            if journal_shipping.enabled() and usage_journal.has_set_aside():
                ship_set_aside_soon()
        return num_left

    async def _replay_segments(self, usage_journal) -> int:
        """`replay`'s loop over the segments."""
        num_left = 0
        for path in await asyncio.to_thread(usage_journal.list_segments):
            with usage_journal.claim(path) as handle:
                if handle is None:
                    num_left += 1
                    continue
                segment = await asyncio.to_thread(read_segment, handle)
                reports = segment.reports
                rejected = []
                for first in range(0, len(reports), self.max_batch):
                    batch = reports[first:first + self.max_batch]
                    registration = await _register_replaying(batch)
                    try:
                        written, refused, _ = await asyncio.wait_for(self._write_rows(batch, supersede=False),
                                                                     WRITE_TIMEOUT_S)
                    except psycopg.DatabaseError as exc:
                        if not _about_the_rows(exc):  # down, read-only, shutting down: the segment waits
                            _raise_outage(exc)
                        # NOTE: rows the database refuses for what they hold would block the journal forever.
                        logger.error("usage journal: a batch refused by the ledger (%r) set aside", exc)
                        self.close_now()
                        rejected += batch
                        continue
                    rejected += [report for report in batch if report.request_id in refused]
                    await _count_replayed(written, batch=batch, registration=registration)
                    # NOTE: the rows written now are counted before the lost rows are superseded, never after both: a
                    # supersede that failed once the insert had committed left them uncounted for good (their retry
                    # writes nothing new; found by this stop's review). The segment waits, and its retry supersedes.
                    try:
                        superseded, _ = await asyncio.wait_for(
                            self._supersede(batch, written, registered=registration is not None), WRITE_TIMEOUT_S)
                    except psycopg.DatabaseError as exc:
                        self.close_now()
                        if not _about_the_rows(exc):
                            _raise_outage(exc)
                        logger.error("usage journal: a batch's lost rows not superseded (%r): billed as lost", exc)
                        continue
                    await _count_superseded(superseded, registered=registration is not None)
                await asyncio.to_thread(usage_journal.done, path, rejected, segment.unreadable)
                logger.info("usage journal: %d report(s) replayed from %s", len(reports) - len(rejected), path.name)
        return num_left

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and not connection.closed:
            await connection.close()

    def close_now(self) -> None:
        """Close the connection without a loop (its loop is gone)."""
        connection, self._connection = self._connection, None
        if connection is not None and not connection.closed:
            connection.pgconn.finish()


def _raise_outage(exc: psycopg.DatabaseError) -> None:
    """Raise `exc` as the outage it is (`_as_outage`): the segment waits for the next replay."""
    outage = _as_outage(exc)
    if outage is exc:
        raise exc
    raise outage from exc


async def _count_superseded(lost_costs: dict[str, Decimal], *, registered: bool = False) -> None:
    """The `gateway_lost` rows a write or a replay superseded now, their difference counted
    (`replayed.count_superseded`; `registered`: by a replay that registered them).

    NOTE: in a worker thread that closes its connection after (`in_worker_thread`): through asgiref's one
    process-wide thread (no request's context here) it kept a pooled connection checked out after each replay."""
    if not lost_costs:
        return
    try:
        await in_worker_thread(replayed.count_superseded)(lost_costs, registered=registered)
    except Exception as exc:  # noqa: BLE001 - as `_count_replayed`: a counter rebuilt from the ledger later counts them
        logger.warning("usage writer: %d superseded lost row(s) not counted in the quota counters: %r",
                       len(lost_costs), exc)


async def _register_replaying(reports: list[UsageReport]) -> replayed.Registration | None:
    """Before a replay writes `reports`: a counter rebuilt meanwhile counts each once (`billing.quota.replayed`).
    Returns what it registered (`replayed.count_replayed`), None if it could not."""
    try:
        return await replayed.register_replaying(reports)
    except Exception as exc:  # noqa: BLE001 - the ledger comes first: a counter rebuilt meanwhile may count one twice
        logger.warning("usage journal: %d row(s) replayed unregistered (%r)", len(reports), exc)
        return None


async def _drop_registrations(reports: list[UsageReport]) -> None:
    if not reports:
        return
    try:
        await replayed.drop_registrations(reports)
    except Exception as exc:  # noqa: BLE001 - left, they lapse (`replayed.REGISTRATION_KEPT_S`)
        logger.warning("usage writer: %d registration(s) not dropped (%r)", len(reports), exc)


async def _count_replayed(request_ids: set[str], *, batch: list[UsageReport],
                         registration: replayed.Registration | None) -> None:
    """The rows a replay wrote now, and those of its `batch` a killed replay before it wrote and left owed, counted
    in the quota counters rebuilt without them (`billing.quota.replayed`)."""
    try:
        await in_worker_thread(replayed.count_replayed)(request_ids, batch=batch, registration=registration)
    except Exception as exc:  # noqa: BLE001 - the rows are in the ledger: a counter rebuilt from it later counts them
        logger.warning("usage journal: %d replayed row(s) not counted in the quota counters: %r", len(request_ids), exc)


# NOTE: a loop that ends (asyncio.run in a batch run, a script or a test) closes its writer's connection.
_writers: PerLoop[UsageWriter] = PerLoop(UsageWriter, close=UsageWriter.close, on_loop_gone=UsageWriter.close_now)


def writer_for_this_loop() -> UsageWriter:
    return _writers.get()


async def replay_before_the_loop_ends(timeout_s: float, *, process_stops: bool = False,
                                      ship_until: float | None = None) -> None:
    """For an event loop about to end (a batch run's `asyncio.run`): replay this machine's journal into
    the ledger, for at most `timeout_s`; while the database is still down it waits in the journal for the
    next loop (the next run replays it first). `process_stops`: the process ends after (a gateway's shutdown), and
    what is left is shipped as `ship_what_is_left` says, until `ship_until` (`time.monotonic()`, the end of a
    signalled stop's budget) if one is given.

    NOTE: a writer's replay task lives on its loop, and `asyncio.run` cancels it as the loop ends. In a
    Celery worker nothing else replays: before, usage journaled during a database blip in a batch run
    stayed in the worker's journal, and was lost with its pod."""
    deadline = time.monotonic() + timeout_s
    if process_stops:  # NOTE: a replay loop's shipping in an outage, in a thread of its own, stops by then too
        journal_shipping.stop_shipping_by(_shipping_end(deadline, process_stops, ship_until))
    # NOTE: `list_segments` counts the folder again: a journal that another process replayed is not full any more.
    if not await asyncio.to_thread(journal().list_segments) and not journal().has_open_segment():
        if journal().has_set_aside():  # shipped at the set-aside, unless the bucket could not be reached then
            await _wait_for(ship_set_aside_soon(), _set_aside_wait_end(deadline, process_stops, ship_until))
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(writer_for_this_loop().replay_soon(), timeout_s)
    await ship_what_is_left(deadline, process_stops=process_stops, ship_until=ship_until)


# How long a process about to stop ships what it could not replay, whatever its replay took: segments while an upload
# (`journal_shipping.ONE_PUT_BOUND_S`, 27 s) still fits, the set-aside lines meanwhile; infra/k8s/base/web.yaml's grace
# period counts it.
SET_ASIDE_STOP_WAIT_S = 30.0


def _shipping_end(deadline: float, process_stops: bool, ship_until: float | None = None) -> float:
    """The end of a stopping process's shipping: a signalled stop's budget (`ship_until`, `drain.stop_budget_end`:
    from the signal, it counts the replay and `SET_ASIDE_STOP_WAIT_S` after it, capped by the pod's grace period), else
    `SET_ASIDE_STOP_WAIT_S` after its replay's own `deadline`.

    NOTE: after the replay's deadline, not after the moment it is asked: the bound is set before the replay
    (`replay_before_the_loop_ends`), which in an outage uses its whole time, and a floor counted from then left
    25 s < `journal_shipping.ONE_PUT_BOUND_S` (26 s then): no segment shipped at all. And no floor over a signalled stop's
    budget: it would undo the grace period's cap (both found by the fourth review of this shipping)."""
    if not process_stops:
        return deadline
    return deadline + SET_ASIDE_STOP_WAIT_S if ship_until is None else ship_until


def _set_aside_wait_end(deadline: float, process_stops: bool, ship_until: float | None = None) -> float:
    """How long a stopping process waits for its set-aside lines alone: `SET_ASIDE_STOP_WAIT_S` after its replay's
    deadline at most, whatever its stop's budget (`ship_what_is_left`)."""
    return min(_shipping_end(deadline, process_stops), _shipping_end(deadline, process_stops, ship_until))


async def ship_what_is_left(deadline: float, *, process_stops: bool = False, ship_until: float | None = None) -> int:
    """For a process about to stop (a gateway's shutdown, a batch run's end): what it could not replay goes to the
    files bucket (`journal_shipping`), since the pod, and the journal on its volume, may go before the database is
    back. Returns how many segments went. What was set aside is waited for until `deadline` (`time.monotonic()`)
    at most (`ship_set_aside_soon`). When the process ends after (`process_stops`): segments are shipped while an
    upload still fits before `SET_ASIDE_STOP_WAIT_S` after `deadline` (the replay's own), or before `ship_until` if
    one is given (the end of a signalled stop's budget), the set-aside lines by their shipper meanwhile (no part begun
    that could end past that bound either), waited for `SET_ASIDE_STOP_WAIT_S` after `deadline` at most. What is left
    stays in the journal, on the pod's emptyDir: replayed at the next start if only the container restarts, gone with
    the pod if it is deleted.

    NOTE: the shipper is a daemon thread, gone with the process: before, a gateway whose replay had used its time
    (`replay_before_the_loop_ends`) waited ~0 s for it and exited, and the lines stayed on the pod's emptyDir, lost
    with the pod (found by this stop's review). And a stop in an outage shipped every segment, then the set-aside
    parts inline, with no bound (27 s a put): past the pod's grace period, SIGKILL cut an upload (found by the second
    review of this shipping). And a fixed 30 s after the replay left segments unshipped, lost with the pod, while the
    grace period still had the drain's unused time (the first version of that bound): `ship_until` gives it to them."""
    usage_journal = journal()
    await asyncio.to_thread(usage_journal.seal)
    # NOTE: the set-aside lines alone are waited for 30 s at most: a bucket that never takes them (a wrong name,
    # credentials, an outage) held every signalled stop for the whole budget, an idle pod's too (the third review).
    set_aside_deadline = _set_aside_wait_end(deadline, process_stops, ship_until)
    deadline = _shipping_end(deadline, process_stops, ship_until)
    shipper = None
    if journal_shipping.enabled() and usage_journal.has_set_aside():
        shipper = ship_set_aside_soon()
    num_shipped = 0
    if await asyncio.to_thread(usage_journal.list_segments):
        bound = deadline if process_stops else None
        num_shipped = await asyncio.to_thread(journal_shipping.ship, usage_journal, deadline=bound)
    if shipper is not None:
        await _wait_for(shipper, set_aside_deadline)
    return num_shipped


_set_aside_shipper: threading.Thread | None = None
_set_aside_asked = False  # asked to ship since the shipper last began to read the file
_set_aside_shipper_lock = threading.Lock()
_set_aside_wake = threading.Event()  # set by an ask: a shipper waiting to retry tries at once
# While lines stay set aside after a ship (the bucket out of reach), the shipper tries again after this long, doubled
# after each failure up to the most (one warning a failure, `journal_shipping.ship_set_aside`: one a minute at most).
SET_ASIDE_RETRY_FIRST_S = 5.0
SET_ASIDE_RETRY_MAX_S = 60.0


def ship_set_aside_soon() -> threading.Thread:
    """Ship what this pod's replays set aside (`journal_shipping.ship_set_aside`) in a thread of its own, unless one
    ships it now, which then ships once more after; returns that thread. It lives until the file is empty (or the
    process ends): while a ship leaves lines there, it tries again after `SET_ASIDE_RETRY_FIRST_S` up to
    `SET_ASIDE_RETRY_MAX_S` (at once when asked again), so joining it waits for the file to reach the bucket.

    NOTE: never awaited whole: a slow or unreachable bucket (its attempts and timeouts, up to ~27 s) held a replay
    loop after each segment, and a loop's end past its `timeout_s`. A daemon thread, not the loop's executor, which
    `asyncio.run` waits for as it ends: a process that stops meanwhile leaves `rejected.jsonl` as it was (emptied only
    once the bucket has it), shipped next time (replayed twice, each row counts once: its request id). It ships again
    while it was asked meanwhile: before, a running shipper was returned as it was, though it may have read the file
    already, and lines appended after that read waited for a later trigger, maybe none. It retries by itself: before,
    lines a bucket blip left here waited for the next replay (a database outage, a process start) or stop, possibly
    for days with the database up, on a volume that dies with the pod (found by the second review of this shipping)."""
    global _set_aside_shipper, _set_aside_asked
    with _set_aside_shipper_lock:
        _set_aside_asked = True
        _set_aside_wake.set()
        if _set_aside_shipper is None or not _set_aside_shipper.is_alive():  # NOTE: dead: a forked child's copy
            _set_aside_shipper = threading.Thread(target=_ship_set_aside_while_asked, name="usage-set-aside-shipper",
                                                  daemon=True)
            _set_aside_shipper.start()
        return _set_aside_shipper


def _ship_set_aside_while_asked() -> None:
    global _set_aside_shipper, _set_aside_asked
    retry_s = SET_ASIDE_RETRY_FIRST_S
    try:
        while True:
            with _set_aside_shipper_lock:
                if not _set_aside_asked:
                    _set_aside_shipper = None  # NOTE: under the lock: a caller from now on starts a new one
                    return
                _set_aside_asked = False
                _set_aside_wake.clear()
            journal_shipping.ship_set_aside(journal())
            if not (journal_shipping.enabled() and journal().has_set_aside()):
                retry_s = SET_ASIDE_RETRY_FIRST_S
                continue
            if journal_shipping.no_time_for_a_put():
                # NOTE: the process stops before another upload could end (`stop_shipping_by`): what is left stays
                # in the file, for the next start. Before, this thread went on putting parts past the stop's bound.
                with _set_aside_shipper_lock:
                    _set_aside_shipper = None
                return
            # NOTE: the bucket took not all of it (or lines came meanwhile): tried again, whatever else asks
            _set_aside_wake.wait(retry_s)
            retry_s = min(retry_s * 2, SET_ASIDE_RETRY_MAX_S)
            with _set_aside_shipper_lock:
                _set_aside_asked = True
    except BaseException:
        with _set_aside_shipper_lock:
            _set_aside_shipper = None
        raise


def ship_set_aside_before_exit(*, start: bool) -> None:
    """For a process about to exit outside an event loop (a Celery worker's main process, `start`, or one of its pool
    children): wait up to `SET_ASIDE_STOP_WAIT_S` for the set-aside lines to reach the bucket (`ship_set_aside_soon`),
    in a child only for a shipper it runs (the main process ships the pod's file once the children are gone).

    NOTE: a child exits through `os._exit`, which kills the daemon shipper mid-upload: before, nothing waited, and
    lines a bucket blip left at a batch run's end stayed on the pod's emptyDir, lost with the pod at a rollout (found by
    the second review of this shipping)."""
    if not journal_shipping.enabled():
        return
    with _set_aside_shipper_lock:
        shipper = _set_aside_shipper if _set_aside_shipper is not None and _set_aside_shipper.is_alive() else None
    if start and shipper is None and journal().has_set_aside():
        shipper = ship_set_aside_soon()
    if shipper is not None:
        shipper.join(SET_ASIDE_STOP_WAIT_S)


async def _wait_for(thread: threading.Thread, deadline: float) -> None:
    """Wait for `thread` until `deadline` (`time.monotonic()`) at most; it goes on after."""
    await asyncio.to_thread(thread.join, max(0.0, deadline - time.monotonic()))


async def arecord_usage(report: UsageReport) -> Recorded:
    """`billing.ledger.record_usage` for async callers: returns once the row is committed (or
    journaled: `Recorded`). Concurrent calls in one event loop share a statement and a commit."""
    return await writer_for_this_loop().write(report)


def close_all() -> None:
    """Close every writer's connection now (a test session ends; its database is about to go)."""
    for writer in _writers.all():
        writer.close_now()
