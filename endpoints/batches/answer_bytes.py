"""The bytes of batch lines' answers a worker process holds, bounded across its lines in flight.

A line's answer (up to `upstream.MAX_WHOLE_BODY_BYTES`, 64 MiB: embeddings of long inputs, `n`, logprobs) is held by
its run from its first byte read until its row is in S3. A run has as many lines in flight as its endpoint's READY
replicas have spare slots, and nothing bounded what their answers held together: eight lines answering 64 MiB at once
held over 1 GiB (each copied again while checked and written), in a batch worker of 1 GiB that runs four runs
(`infra/k8s/base/batch-worker.yaml`), and the worker was killed with every run in it.

Counted as the gateway counts an organisation's whole answers (`endpoints.gateway.delivery.Holding`): a line's answer
from its first byte read (`upstream.Response.read` takes them) until its run is done with it (`LineAnswer.release`:
its row stored, its line to be tried again, or its run ended), once, at the size of what the line keeps (its engine's
bytes, then its row: `LineAnswer.keep`). A read that fails, or an answer past the 64 MiB that is read on without being
held (the line's error `response_too_large`), gives its bytes back at once. Past `BATCH_ANSWER_BYTES` held in the
process:

- its runs start no line (`room`), and
- its answers still being read pause (their connections stop reading: the data waits in the engine), except one at a
  time, and that one only while the answers read whole are within the bound, so that one always finishes, a line
  larger than the bound too, alone; the parked go on one at a time as bytes are given back (stores always end).

So the lines' answers hold at most the bound, one answer, and the first read (up to 256 KiB) of each answer being read;
what a line copies beside its answer (its check, its row) is made in the run's event loop, one line at a time
(`runner.run_line`). One budget per process, shared by every run in it (a prefork child runs one at a time; runs in
threads share it under its lock, a parked read resumed in its own event loop).
"""

from __future__ import annotations

import asyncio
import threading

from django.conf import settings


class _Budget:
    """What the process's batch lines hold."""

    __slots__ = ("lock", "held", "reading", "reader", "parked")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held = 0
        self.reading = 0  # of `held`, the bytes of answers still being read
        self.reader: LineAnswer | None = None  # the one answer read on while the process is past its bound
        self.parked: list = []  # the paused connections of the others, oldest first (`upstream._Connection`)

    def over(self) -> bool:
        return self.held >= settings.BATCH_ANSWER_BYTES

    def may_read_one(self) -> bool:
        """Whether one more answer may be read on though the process is past its bound: not while the answers read
        whole (stored as their threads get to them) are past it on their own."""
        return self.held - self.reading < settings.BATCH_ANSWER_BYTES

    def to_resume(self) -> list:
        """The parked connection to go on now, if any (taken off the list; resumed by the caller, out of the lock).

        NOTE: one at a time, as `delivery` does: all at once, each read a piece before parking again, every time."""
        if not self.parked or (self.over() and not (self.reader is None and self.may_read_one())):
            return []
        while self.parked:
            connection = self.parked.pop(0)
            # NOTE: a closed one would take the turn of one that reads on. Not whether it is paused yet: it is parked
            # here under the lock and paused just after, outside it, on its own loop; another run's thread in between
            # dropped it as "not paused", and it was never resumed. Its resume runs on its own loop (`_resume`), so
            # after its pause.
            if not connection.closed:
                return [connection]
        return []


_budget = _Budget()


def held_bytes() -> int:
    """The bytes of line answers this process holds now."""
    return _budget.held


def room() -> bool:
    """Whether a run may start a line: the process's lines hold less than `BATCH_ANSWER_BYTES`."""
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

    def take(self, num_bytes: int, connection) -> bool:
        """Count bytes just read on `connection`; True when it must pause (it is parked, resumed as bytes are given
        back)."""
        budget = _budget
        with budget.lock:
            if self._released:
                return False
            budget.held += num_bytes
            budget.reading += num_bytes
            self.num_bytes += num_bytes
            if not budget.over():
                resume, pause = budget.to_resume(), False
            elif budget.reader is self:
                resume, pause = [], False
            elif budget.reader is None and budget.may_read_one():
                budget.reader = self
                resume, pause = [], False
            else:
                if not any(parked is connection for parked in budget.parked):
                    budget.parked.append(connection)
                resume, pause = [], True
        _resume(resume)
        return pause

    def give(self, num_bytes: int) -> None:
        """Bytes the read dropped (an answer past `MAX_WHOLE_BODY_BYTES`, read on without being held)."""
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
