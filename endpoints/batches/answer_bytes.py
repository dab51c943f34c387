"""The bytes of batch lines' answers a worker process holds, bounded across its lines in flight, every read included.

A line's answer (embeddings of long inputs, `n`, logprobs) is held by its run from its first byte read until its row is
in S3. A run has as many lines in flight as its endpoint's READY replicas have spare slots, and nothing bounded what
their answers held together: eight lines answering 64 MiB at once held over 1 GiB (each copied again while checked and
written), in a batch worker of 1 GiB that runs four runs (`infra/k8s/base/batch-worker.yaml`), and the worker was
killed with every run in it.

Counted as the gateway counts an organisation's whole answers (`endpoints.gateway.delivery.Holding`): a line's answer
from before its first byte is read (`upstream.Response.read` takes them) until its run is done with it
(`LineAnswer.release`: its row stored, its line to be tried again, or its run ended), once, at the size of what the
line keeps (its engine's bytes, then its row: `LineAnswer.keep`). A read that fails gives its bytes back at once.
`BATCH_ANSWER_BYTES` is everything the process's lines hold in memory, every read included:

- every read of an answer is taken from the bound before it is made: a line starts only with the room of its first
  read (`READ_BYTES`, the most a connection reads at a time) taken for it (`LineAnswer`, `room`), and an answer reads
  on only with the room of its next read taken (`take`). Before, each answer's first read came in before it could be
  paused, in no bound: many lines in flight answering at once each held one past it;
- an answer holds at most `largest_answer_bytes()` in memory, half the bound: one larger goes on to a temporary file
  (`spool.Spool`, up to the gateway's own limit, 64 MiB, as an interactive call's), its bytes in memory given back,
  and its row is read from the file as it is stored (`spool.SpooledRow`). A process spools `num_spools()` answers at
  once (`BATCH_SPOOL_BYTES` of disk); another waits for one of them to be stored, its connection paused. Before, such
  an answer failed with `response_too_large`, billed, though the same request succeeds outside a batch;
- past the other half held in the process (less a read), its runs start no line (`room`), and its answers still being
  read pause (their connections stop reading: the data waits in the engine), except one at a time: that one reads on
  into the half kept for it, and is let start only while the others hold within their half (or hold nothing read
  whole, which would be given back), so that it always finishes, alone, or goes on to disk; the parked go on one at a
  time as bytes are given back (stores always end).

So the lines' answers hold at most the bound; what a line copies beside its answer held in memory (its read joined,
its check, its row: an answer at most) is made in the run's event loop, one line at a time (`runner.run_line`), and
boto3 holds up to 2 MiB beside each row it stores. One budget per process, shared by every run in it (a prefork child
runs one at a time; runs in threads share it under its lock, a parked read resumed in its own event loop). Bytes still
held as a run starts with none of the process's running are a leak: logged and forgotten (`run_started`).
"""

from __future__ import annotations

import asyncio
import logging
import threading

from django.conf import settings

from endpoints.batches import spool
from endpoints.gateway import upstream

logger = logging.getLogger("inferplane.batches")

# NOTE: the most one read of an upstream connection brings (asyncio's selector transports read up to 256 KiB at a
# time): taken from the bound before each read. What came in with an answer's headers, before its read began, is one
# read (the call reads on in the step of its task that its headers woke); were it more (up to
# `upstream.HIGH_WATER_BYTES` and a read), the rest is counted all the same as it is taken, past the room taken for it.
READ_BYTES = 256 * 1024


def largest_answer_bytes(budget_bytes: int | None = None) -> int:
    """The most one line's answer may hold in memory in a process whose lines hold at most `budget_bytes`
    (`BATCH_ANSWER_BYTES` unless given): half of it, and never more than the gateway's own limit on a whole answer.
    A larger one goes on to disk (`spool`)."""
    budget_bytes = settings.BATCH_ANSWER_BYTES if budget_bytes is None else budget_bytes
    return min(upstream.MAX_WHOLE_BODY_BYTES, budget_bytes // 2)


def num_spools() -> int:
    """How many answers past `largest_answer_bytes` a process keeps on disk at once: `BATCH_SPOOL_BYTES` in answers of
    the largest size a whole answer may be (`upstream.MAX_WHOLE_BODY_BYTES`)."""
    return settings.BATCH_SPOOL_BYTES // upstream.MAX_WHOLE_BODY_BYTES


def _starts_below() -> int:
    """Lines start, and their answers read on at once, while the process holds less than this: the bound less the
    room kept for the one answer read on past it (the largest, and a read past it before it goes on to disk)."""
    return settings.BATCH_ANSWER_BYTES - largest_answer_bytes() - READ_BYTES


class _Budget:
    """What the process's batch lines hold."""

    __slots__ = ("lock", "held", "reading", "reader", "parked", "num_spooled", "waiting_for_disk")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held = 0
        self.reading = 0  # of `held`, the bytes of answers still being read (and of the reads taken for them)
        # the one answer read on while the process is past its starts' half
        self.reader: LineAnswer | None = None
        # the paused connections of the others with their answers, oldest first (`upstream._Connection`)
        self.parked: list[tuple[object, LineAnswer]] = []
        self.num_spooled = 0  # answers on disk (`spool`), until released
        # NOTE: the one answer past the largest waiting for a spool, its connection paused: only the reader reads past
        # the starts' half, so only it can pass the largest.
        self.waiting_for_disk: tuple[object, LineAnswer] | None = None

    def over(self) -> bool:
        return self.held >= _starts_below()

    def may_read_one(self, answer: LineAnswer) -> bool:
        """Whether `answer` may read on though the process is past its starts' half: while what the others hold leaves
        it the room of the largest answer, or when none of it was read whole (nothing would be given back: they are
        all waiting for a reader)."""
        return self.held - answer.num_bytes < _starts_below() or self.held == self.reading

    def grant(self, answer: LineAnswer) -> bool:
        """Take the room of `answer`'s next read (`READ_BYTES` with what is left of the last one's) if it may read on:
        while the process holds less than its starts' half with it, or as the one reader. False: it must wait."""
        wanted = READ_BYTES - answer.num_unread
        if self.held + wanted < _starts_below():
            pass
        elif self.reader is answer:
            pass
        elif self.reader is None and self.may_read_one(answer):
            self.reader = answer
        else:
            return False
        if wanted > 0:
            self.held += wanted
            self.reading += wanted
            answer.num_bytes += wanted
            answer.num_unread += wanted
        return True

    def to_resume(self) -> list:
        """The parked connection to go on now, if any (taken off the list, the room of its next read taken; resumed
        by the caller, out of the lock).

        NOTE: one at a time, as `delivery` does: all at once, each read a piece before parking again, every time."""
        while self.parked:
            connection, answer = self.parked[0]
            # NOTE: a closed one, or one whose read ended while it waited (failed, or its run ended), would take the
            # turn of one that reads on. Not whether it is paused yet: it is parked here under the lock and paused just
            # after, outside it, on its own loop; another run's thread in between dropped it as "not paused", and it
            # was never resumed. Its resume runs on its own loop (`_resume`), so after its pause.
            if connection.closed or not answer._reading:
                self.parked.pop(0)
                continue
            if not self.grant(answer):
                return []
            self.parked.pop(0)
            return [connection]
        return []


_budget = _Budget()
_runs_lock = threading.Lock()
_num_runs = 0  # the process's runs running now (`run_started`, `run_ended`)


def run_started(batch_id: str) -> None:
    """A run of this process begins (before its first line): bytes still held while none of its runs is running are
    a leak (a line's answer never released), logged and forgotten. `run_ended` must follow, once its lines are released.

    NOTE: a batch worker (Celery prefork) runs one run a process: a leak made every later run of the process give up
    with "no_room" (`runner.run`), for good, until its pod restarted. The answers leaked keep counting in the budget
    they were made under, not in the new one."""
    global _budget, _num_runs
    with _runs_lock:
        if not _num_runs and (_budget.held or _budget.num_spooled):
            logger.error("batch %s: this process's batch lines held %d bytes of answers and %d answer(s) on disk with "
                         "none of its runs running: leaked (a line's answer never released); counted from zero again",
                         batch_id, _budget.held, _budget.num_spooled)
            _budget = _Budget()
        _num_runs += 1


def run_ended() -> None:
    """A run of this process ended, its lines' answers released (`run_started`)."""
    global _num_runs
    with _runs_lock:
        _num_runs -= 1


def held_bytes() -> int:
    """The bytes of line answers this process holds now (and of the reads taken for them)."""
    return _budget.held


def num_spooled() -> int:
    """The answers this process holds on disk now."""
    return _budget.num_spooled


def room() -> bool:
    """Whether a run may start a line: its first read leaves the process's lines under `BATCH_ANSWER_BYTES` less the
    room kept for the largest answer (or they hold nothing)."""
    held = _budget.held
    return held + READ_BYTES < _starts_below() or not held


def _resume(connections: list) -> None:
    for connection in connections:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if connection.loop is running:
            connection.resume()
            continue
        try:
            connection.loop.call_soon_threadsafe(connection.resume)
        except RuntimeError:  # its run's loop has ended: nothing reads on it any more
            pass


class LineAnswer:
    """One line's answer, counted against the process's bound from before its first read: its `InferenceCall`'s
    holding while it reads (`take`, `give`, `sent`, `done_reading`, `close`), then the run's (`keep`, `release`).
    `release` gives back every count, and its spool, and nothing is counted after it (a line still running as its
    run ends on an error). Made with the room of its first read taken (`room` says whether a line may start)."""

    __slots__ = ("num_bytes", "num_unread", "spool", "_reading", "_num_sent", "_released", "_budget")

    def __init__(self) -> None:
        self.num_bytes = 0  # counted against the bound: what it holds, and `num_unread`
        self.num_unread = 0  # of `num_bytes`, the room taken for reads not made yet
        self.spool: spool.Spool | None = None  # where it goes on past the largest answer
        self._reading = True
        self._num_sent = 0  # handed to the line's own `send`, which keeps them
        self._released = False
        # NOTE: the budget it is counted in, kept: one forgotten as leaked (`run_started`) is never given back to the next
        self._budget = budget = _budget
        with budget.lock:
            budget.held += READ_BYTES
            budget.reading += READ_BYTES
            self.num_bytes = self.num_unread = READ_BYTES

    @property
    def max_answer_bytes(self) -> int:
        """The most this answer may be (`InferenceCall` names it in the line's error past it): as outside a batch, when
        the process may spool answers; else the most it holds in memory."""
        return upstream.MAX_WHOLE_BODY_BYTES if num_spools() else largest_answer_bytes()

    @property
    def kept_on_disk(self) -> bool:
        """Whether its whole answer, past the largest kept in memory, is in its spool (`InferenceCall` answers it)."""
        return self.spool is not None and self.spool.whole

    def take(self, num_bytes: int, connection) -> bool:
        """Count bytes just read on `connection` (from the room taken for them); True when it must pause (it is parked,
        resumed as bytes are given back). Past `largest_answer_bytes`, its bytes are given back and the rest of it goes
        on to a spool (`connection.drop_whole_answer`), or, with none free, it waits for one."""
        budget = self._budget
        to_spool = too_large = False
        with budget.lock:
            if self._released or not self._reading or self.spool is not None:
                return False
            covered = min(num_bytes, self.num_unread)
            self.num_unread -= covered
            # NOTE: past the room taken (none should be): counted all the same
            budget.held += num_bytes - covered
            budget.reading += num_bytes - covered
            self.num_bytes += num_bytes - covered
            if self.num_bytes - self.num_unread > largest_answer_bytes():
                pause, resume = False, []
                if not num_spools():
                    too_large = True
                elif budget.num_spooled < num_spools():
                    to_spool = True
                    budget.num_spooled += 1
                    if budget.waiting_for_disk is not None and budget.waiting_for_disk[1] is self:
                        budget.waiting_for_disk = None
                else:
                    budget.waiting_for_disk = (connection, self)
                    return True
                # NOTE: given back here, under the lock, before its connection hands what it buffered on (`give`, then
                # a no-op): no other answer is let read into bytes this one still seems to hold.
                budget.held -= self.num_bytes
                budget.reading -= self.num_bytes
                self.num_bytes = self.num_unread = 0
                if budget.reader is self:
                    budget.reader = None
                if too_large:
                    self._reading = False
                resume = budget.to_resume()
            elif budget.grant(self):
                resume, pause = budget.to_resume() if not budget.over() else [], False
            else:
                if not any(parked is connection for parked, _ in budget.parked):
                    budget.parked.append((connection, self))
                resume, pause = [], True
        if to_spool:
            self.spool = spool.Spool()
            connection.drop_whole_answer(keep=self.spool.write)
        elif too_large:
            connection.drop_whole_answer()
        _resume(resume)
        return pause

    def give(self, num_bytes: int) -> None:
        """Bytes the read dropped (handed on past what it keeps in memory)."""
        held = self.num_bytes - self.num_unread
        self._count(self.num_bytes - min(num_bytes, held))

    def sent(self, num_bytes: int) -> None:
        """Bytes the call handed to the line's `send`: the line keeps them, counted until `release`."""
        self._num_sent += num_bytes

    def done_reading(self) -> None:
        """Its read ended (whole, failed or abandoned): its bytes are held whole now, the room taken for reads it will
        not make is given back, and the reader's slot is free."""
        budget = self._budget
        with budget.lock:
            if not self._reading:
                return
            self._reading = False
            budget.reading -= self.num_bytes
            budget.held -= self.num_unread
            self.num_bytes -= self.num_unread
            self.num_unread = 0
            if budget.reader is self:
                budget.reader = None
            if budget.waiting_for_disk is not None and budget.waiting_for_disk[1] is self:
                budget.waiting_for_disk = None  # read whole while it waited: held as any answer read whole
            resume = budget.to_resume()
        _resume(resume)

    def close(self) -> None:
        """The call ended: what it read and did not hand to the line (a read that failed) is given back."""
        self.done_reading()
        self._count(min(self.num_bytes, self._num_sent))

    def keep(self, num_bytes: int) -> None:
        """What the line keeps of its answer from now on: `num_bytes` (its row), counted in place of what it read."""
        self.done_reading()
        self._count(num_bytes)

    def release(self) -> None:
        """The line is done with its answer (stored, to be tried again, or its run ended): all of it given back, and
        its spool's disk."""
        self.done_reading()
        self._count(0)
        self._released = True
        if self.spool is None:
            return
        self.spool.close()
        self.spool = None
        budget = self._budget
        with budget.lock:
            budget.num_spooled -= 1
            waiting, budget.waiting_for_disk = budget.waiting_for_disk, None
        if waiting is not None:
            _resume([waiting[0]])  # NOTE: its next read goes on to the spool given back (`take`)

    def _count(self, num_bytes: int) -> None:
        budget = self._budget
        with budget.lock:
            if self._released:
                return
            change, self.num_bytes = num_bytes - self.num_bytes, num_bytes
            budget.held += change
            if self._reading:
                budget.reading += change
            resume = budget.to_resume() if change < 0 else []
        _resume(resume)
