"""The bytes of batch lines' answers a worker process holds, bounded across its lines in flight, the largest included.

A line's answer (embeddings of long inputs, `n`, logprobs) is held by its run from its first byte read until its row is
in S3. A run has as many lines in flight as its endpoint's READY replicas have spare slots, and nothing bounded what
their answers held together: eight lines answering 64 MiB at once held over 1 GiB (each copied again while checked and
written), in a batch worker of 1 GiB that runs four runs (`infra/k8s/base/batch-worker.yaml`), and the worker was
killed with every run in it. Bounded, but with one answer of up to 64 MiB read on past the bound, four processes each at
their worst (the bound, that answer and its copy) still passed the container's limit together.

Counted as the gateway counts an organisation's whole answers (`endpoints.gateway.delivery.Holding`): a line's answer
from its first byte read (`upstream.Response.read` takes them) until its run is done with it (`LineAnswer.release`:
its row stored, its line to be tried again, or its run ended), once, at the size of what the line keeps (its engine's
bytes, then its row: `LineAnswer.keep`). A read that fails gives its bytes back at once. `BATCH_ANSWER_BYTES` is
everything the process's lines hold, the largest answer included:

- a line's answer is at most `largest_answer_bytes()`, half the bound (64 MiB at most, the gateway's own limit): one
  larger is read on to its end without being held, for the usage it carries, and the line fails with
  `response_too_large` (its error is the line's, in the error file);
- past the other half held in the process, its runs start no line (`room`), and its answers still being read pause
  (their connections stop reading: the data waits in the engine), except one at a time: that one reads on into the
  half kept for it, and is let start only while the others hold within their half (or hold nothing read whole, which
  would be given back), so that it always finishes, alone; the parked go on one at a time as bytes are given back
  (stores always end).

So the lines' answers hold at most the bound and the first read (up to 256 KiB) of each answer being read; what a line
copies beside its answer (its read joined, its check, its row: an answer at most) is made in the run's event loop, one
line at a time (`runner.run_line`), and boto3 holds up to 2 MiB beside each row it stores. One budget per process, shared by every run in it (a prefork child runs one at a
time; runs in threads share it under its lock, a parked read resumed in its own event loop).
"""

from __future__ import annotations

import asyncio
import threading

from django.conf import settings

from endpoints.gateway import upstream


def largest_answer_bytes(budget_bytes: int | None = None) -> int:
    """The most one line's answer may hold in a process whose lines hold at most `budget_bytes` (`BATCH_ANSWER_BYTES`
    unless given): half of it, and never more than the gateway's own limit on a whole answer."""
    budget_bytes = settings.BATCH_ANSWER_BYTES if budget_bytes is None else budget_bytes
    return min(upstream.MAX_WHOLE_BODY_BYTES, budget_bytes // 2)


def _starts_below() -> int:
    """Lines start, and their answers read on at once, while the process holds less than this: the bound less the
    room kept for the one answer read on past it."""
    return settings.BATCH_ANSWER_BYTES - largest_answer_bytes()


class _Budget:
    """What the process's batch lines hold."""

    __slots__ = ("lock", "held", "reading", "reader", "parked")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held = 0
        self.reading = 0  # of `held`, the bytes of answers still being read
        # the one answer read on while the process is past its starts' half
        self.reader: LineAnswer | None = None
        # the paused connections of the others with their answers, oldest first (`upstream._Connection`)
        self.parked: list[tuple[object, LineAnswer]] = []

    def over(self) -> bool:
        return self.held >= _starts_below()

    def may_read_one(self, answer: LineAnswer) -> bool:
        """Whether `answer` may read on though the process is past its starts' half: while what the others hold leaves
        it the room of the largest answer, or when none of it was read whole (nothing would be given back: they are
        all waiting for a reader, and hold within their half but for their first reads)."""
        return self.held - answer.num_bytes < _starts_below() or self.held == self.reading

    def to_resume(self) -> list:
        """The parked connection to go on now, if any (taken off the list; resumed by the caller, out of the lock).

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
            if self.over() and not (self.reader is None and self.may_read_one(answer)):
                return []
            self.parked.pop(0)
            return [connection]
        return []


_budget = _Budget()


def held_bytes() -> int:
    """The bytes of line answers this process holds now."""
    return _budget.held


def room() -> bool:
    """Whether a run may start a line: the process's lines hold less than `BATCH_ANSWER_BYTES` less the room kept for
    the largest answer."""
    return not _budget.over()


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
    """One line's answer, counted against the process's bound: its `InferenceCall`'s holding while it reads (`take`,
    `give`, `sent`, `done_reading`, `close`), then the run's (`keep`, `release`). `release` gives back every count,
    and nothing is counted after it (a line still running as its run ends on an error)."""

    __slots__ = ("num_bytes", "_reading", "_num_sent", "_released")

    def __init__(self) -> None:
        self.num_bytes = 0
        self._reading = True
        self._num_sent = 0  # handed to the line's own `send`, which keeps them
        self._released = False

    @property
    def max_answer_bytes(self) -> int:
        """The most this answer may hold (`InferenceCall` names it in the line's error past it)."""
        return largest_answer_bytes()

    def take(self, num_bytes: int, connection) -> bool:
        """Count bytes just read on `connection`; True when it must pause (it is parked, resumed as bytes are given
        back). Past `largest_answer_bytes`, its bytes are given back and the rest of it read on without being held
        (`connection.drop_whole_answer`)."""
        budget = _budget
        too_large = False
        with budget.lock:
            if self._released or not self._reading:
                return False
            budget.held += num_bytes
            budget.reading += num_bytes
            self.num_bytes += num_bytes
            if self.num_bytes > largest_answer_bytes():
                # NOTE: given back here, under the lock, before its connection drops what it buffered (`give`, then
                # a no-op): no other answer is let read into bytes this one still seems to hold.
                too_large, pause = True, False
                budget.held -= self.num_bytes
                budget.reading -= self.num_bytes
                self.num_bytes = 0
                self._reading = False
                if budget.reader is self:
                    budget.reader = None
                resume = budget.to_resume()
            elif not budget.over():
                resume, pause = budget.to_resume(), False
            elif budget.reader is self:
                resume, pause = [], False
            elif budget.reader is None and budget.may_read_one(self):
                budget.reader = self
                resume, pause = [], False
            else:
                if not any(parked is connection for parked, _ in budget.parked):
                    budget.parked.append((connection, self))
                resume, pause = [], True
        if too_large:
            connection.drop_whole_answer()
        _resume(resume)
        return pause

    def give(self, num_bytes: int) -> None:
        """Bytes the read dropped (an answer past the largest, read on without being held)."""
        self._count(self.num_bytes - min(num_bytes, self.num_bytes))

    def sent(self, num_bytes: int) -> None:
        """Bytes the call handed to the line's `send`: the line keeps them, counted until `release`."""
        self._num_sent += num_bytes

    def done_reading(self) -> None:
        """Its read ended (whole, failed or abandoned): its bytes are held whole now, and the reader's slot is free."""
        budget = _budget
        with budget.lock:
            if not self._reading:
                return
            self._reading = False
            budget.reading -= self.num_bytes
            if budget.reader is self:
                budget.reader = None
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
        """The line is done with its answer (stored, to be tried again, or its run ended): all of it given back."""
        self.done_reading()
        self._count(0)
        self._released = True

    def _count(self, num_bytes: int) -> None:
        budget = _budget
        with budget.lock:
            if self._released:
                return
            change, self.num_bytes = num_bytes - self.num_bytes, num_bytes
            budget.held += change
            if self._reading:
                budget.reading += change
            resume = budget.to_resume() if change < 0 else []
        _resume(resume)
