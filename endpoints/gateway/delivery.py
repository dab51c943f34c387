"""Answers on their way to clients that may not read them.

A client that stops reading holds what the gateway still has to send it: a whole answer (up to
`upstream.MAX_WHOLE_BODY_BYTES`) sits in the process's memory, a stream stops reading its replica (whose
engine goes on generating into its own buffers), and the call holds its replica and its reservation. Cheap
answers can be large (embeddings of many inputs), so a tenant with a few hundred requests a minute could
fill a gateway process's memory for every other tenant. Bounds, as a reverse proxy's `send_timeout` and its
buffers give:

- **A send deadline.** A client that takes none of its answer for `GATEWAY_SEND_TIMEOUT_S` is cut off:
  its connection is dropped and its call ends as if it had left (`InferenceCall.cut_off`): billed for
  what its engine computed (a whole answer) or for the events it was sent (a stream), its replica and
  reservation released. A watchdog per event loop checks the calls that are sending once a second; a
  send costs the call two attribute writes, no timer.
- **The longest a call runs.** A call still sending its answer a third of a reservation's time past
  `GATEWAY_MAX_ANSWER_WAIT_S` from its start (a stream read just fast enough never to meet the deadline above) is cut
  off the same way, before its reservation lapses (`presence`).
- **Answer bytes per organisation.** A whole answer counts against its organisation (per process) from its first
  byte read from the engine until it is handed to the server: it goes out a piece of `PIECE_BYTES` at a time, each
  once the client took the one before. Past `GATEWAY_ANSWER_BYTES_PER_ORG`, the organisation's new calls are refused
  (429 `unread_answers`) and its answers still being read wait, their replicas' connections paused (the data waits in
  the tenant's own engine, not in the shared gateway), except one at a time, so that one always finishes and goes
  out: the bytes an organisation holds in a process stay within about twice the bound, one answer and a first piece
  (≤ 256 KiB) of each answer being read, however many of its calls answer at once (`tests/gateway/test_delivery_bound.py`). A first version counted an answer only once it was sent, and checked the bound only at a call's
  start: calls sent together were all admitted, and their answers, read at once, passed the bound by as many.
- **Answer bytes per process.** Sign-up is open, so many organisations (one tenant's, or many tenants' at once), each
  within its bound, held together far more than a process has (40 × 128 MiB in a pod of 1 GiB). Every whole answer
  counts against its process too, and past `GATEWAY_ANSWER_BYTES_PER_PROCESS` answers being read wait the same way,
  one (the process's reader) going on at a time while the answers read whole are within it. Paused answers go on as
  bytes are freed, one at a time and organisations in turn (round robin: an organisation with many paused answers gets
  no more turns than one with a single one), so none starves another. A new call is refused (429 `unread_answers`)
  only to an organisation holding an equal share of the process or more (its bytes times the organisations with
  answers open, at least the process's): an organisation under that is not refused for what others hold, and its
  answers wait their turn in its own engine instead. What a process holds stays within about twice this bound, an
  answer (and its copy joined as it is read whole) and a first piece of each answer being read, however many
  organisations answer at once. The first piece of an answer is read before it can be paused (counted, but held
  however many answers come at once), and a stream's buffer (`upstream.HIGH_WATER_BYTES`) is not counted: both grow
  with the calls in flight, which rate limits and reservations bound, not these bounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from controlplane.hot_settings import hot
from controlplane.per_loop import PerLoop
from endpoints.gateway import errors, upstream

logger = logging.getLogger("inferplane.gateway")

# A whole answer larger than this goes out in pieces of this size (smaller ones in one write).
PIECE_BYTES = 256 * 1024
SWEEP_EVERY_S = 1.0
UNREAD_ANSWERS = "unread_answers"


class Sending(Protocol):
    """A call the watchdog watches: when it began and when its current send began (monotonic; None between sends),
    and how to end it."""

    started_monotonic: float
    sending_since: float | None

    def cut_off(self, reason: str) -> None: ...


@dataclass(slots=True)
class _Share:
    """What one organisation's whole answers hold in this process."""

    held: int = 0
    reading: int = 0  # of `held`, the bytes of answers still being read
    reader: Holding | None = None  # the one answer read on while the organisation is past its bound
    # Its answers paused, oldest first (its reader, paused by the process's bound, first of all). One whose read ended
    # while paused is dropped when it comes up (its `_parked` is False then).
    parked: deque[Holding] = field(default_factory=deque)
    num_answers: int = 0  # its answers with a `Holding` open
    in_line: bool = False  # in the process's `line`

    def next_to_read(self) -> Holding | None:
        """The paused answer that the organisation's own bound lets read on now, if any: its oldest while it is under
        the bound; past it, its reader, or its oldest to be the reader while its answers read whole are within it."""
        parked = self.parked
        while parked and not parked[0]._parked:
            parked.popleft()
        if not parked:
            return None
        first = parked[0]
        if self.held < hot.GATEWAY_ANSWER_BYTES_PER_ORG or first is self.reader:
            return first
        if self.reader is None and self.held - self.reading < hot.GATEWAY_ANSWER_BYTES_PER_ORG:
            return first
        return None


@dataclass(slots=True)
class _Process:
    """What every organisation's whole answers hold in this process (its event loop's: a gateway process runs one)."""

    held: int = 0
    waiting: int = 0  # of `held`, the bytes of answers read whole, waiting for their clients
    reader: Holding | None = None  # the one answer read on while the process is past its bound
    # The organisations with paused answers, in turn (one whose own bound holds them leaves the line when it comes up,
    # and is put back by its own answers' next step).
    line: deque[_Share] = field(default_factory=deque)
    num_parked: int = 0  # answers paused, every organisation's
    num_orgs: int = 0  # organisations with an answer open (`refuse_if_over`'s equal share)

    def over(self) -> bool:
        return self.held >= hot.GATEWAY_ANSWER_BYTES_PER_PROCESS

    def resume_one(self) -> None:
        """The next organisation in line whose own bound lets one of its paused answers read on resumes that one, if
        the process's bound lets one: round robin, so that an organisation with many paused answers gets no more turns
        than one with a single one, and none waits behind another's.

        NOTE: one at a time: resuming all at once had each read a piece before parking again, every time a slot
        freed, and those pieces piled up past the bound (437 MiB against 8 in a review's simulation)."""
        over = self.over()
        if over and (self.reader is not None or self.waiting >= hot.GATEWAY_ANSWER_BYTES_PER_PROCESS):
            return
        line = self.line
        while line:
            share = line.popleft()
            holding = share.next_to_read()
            if holding is None:
                share.in_line = False
                continue
            share.parked.popleft()
            if share.parked:
                line.append(share)
            else:
                share.in_line = False
            holding._parked = False
            self.num_parked -= 1
            # NOTE: the slots are taken now, not at its next piece: another answer reading could take one first, and
            # this one would read a piece and park again.
            if share.held >= hot.GATEWAY_ANSWER_BYTES_PER_ORG:
                share.reader = holding
            if over:
                self.reader = holding
            holding._connection.resume()
            return


@dataclass(slots=True)
class _Outbox:
    shares: dict[int, _Share] = field(default_factory=dict)  # by organisation
    process: _Process = field(default_factory=_Process)
    watched: dict[int, Sending] = field(default_factory=dict)  # by id(): calls are dataclasses, not hashable
    sweeper: asyncio.Task | None = None


_outboxes: PerLoop[_Outbox] = PerLoop(_Outbox)


def refuse_if_over(organization_id: int) -> None:
    """A 429 for an organisation whose answers in this process (read or waiting for its clients) are past its bound, or
    that holds an equal share or more of a process past the process's bound (`Holding`)."""
    outbox = _outboxes.get()
    share = outbox.shares.get(organization_id)
    if share is None or not share.held:
        return
    if share.held >= hot.GATEWAY_ANSWER_BYTES_PER_ORG:
        raise errors.OpenAIError(
            429, f"This organisation's answers hold {share.held // 2**20} MiB on this server, answers its clients have "
                 f"not read yet included (at most {hot.GATEWAY_ANSWER_BYTES_PER_ORG // 2**20} MiB): read them, or "
                 "close their connections, before sending more.", type="requests", code=UNREAD_ANSWERS,
            headers={"retry-after": "5"})
    process = outbox.process
    if process.over() and share.held * process.num_orgs >= process.held:
        raise errors.OpenAIError(
            429, f"This server holds {process.held // 2**20} MiB of answers (at most "
                 f"{hot.GATEWAY_ANSWER_BYTES_PER_PROCESS // 2**20} MiB), and this organisation's, "
                 f"{share.held // 2**20} MiB with those its clients have not read yet, are an equal share of it or "
                 "more: read them, or close their connections, before sending more.", type="requests",
            code=UNREAD_ANSWERS, headers={"retry-after": "5"})


def held_bytes(organization_id: int) -> int:
    share = _outboxes.get().shares.get(organization_id)
    return share.held if share is not None else 0


class AnswerHolding(Protocol):
    """What counts a whole answer's bytes as it is read (`upstream.Response.read`: `take`, `give` for bytes dropped,
    `done_reading`) and sent (`InferenceCall`: `sent`, `close` at the call's end); `max_answer_bytes` is the most
    the answer may be (past it, `upstream.ResponseTooLarge`). `kept_on_disk`: the answer, past what the holding keeps
    in memory, was read whole into a file of its own (a batch line's, `endpoints.batches.answer_bytes`), though the
    read raised `ResponseTooLarge`: the call answers, and its holder hands the file on."""

    max_answer_bytes: int
    kept_on_disk: bool

    def take(self, num_bytes: int, connection) -> bool: ...

    def give(self, num_bytes: int) -> None: ...

    def sent(self, num_bytes: int) -> None: ...

    def done_reading(self) -> None: ...

    def close(self) -> None: ...


class Holding:
    """One whole answer's bytes, counted against its organisation and the process from the first read to the last
    piece handed over (`upstream.Response.read` takes them, `InferenceCall` gives them back); `close` gives back the
    rest.

    NOTE: past a bound, an answer being read pauses its connection unless it is that bound's one reader (the
    organisation's, or the process's), a slot taken only while the answers read whole (waiting for clients, cut off at
    the send deadline) are within the bound, and paused connections go on one at a time: so what an organisation, and
    the process, holds stays within about twice the bound and one answer (and a first piece of each answer), and
    something always moves (a reader reads on; a client reads, leaves or is cut off). The process's reader reads on
    past its organisation's bound too (an answer more for that organisation): it was let read while within it, and
    paused there it would hold the process's one slot, each bound waiting on the other."""

    __slots__ = ("_share", "_process", "num_bytes", "_reading", "_parked", "_connection", "_open")

    max_answer_bytes = upstream.MAX_WHOLE_BODY_BYTES
    kept_on_disk = False

    def __init__(self, organization_id: int):
        # NOTE: a share stays once made (one small object per organisation served by the process), so it is looked up
        # once per answer, not per piece read.
        outbox = _outboxes.get()
        shares = outbox.shares
        self._share = share = shares.get(organization_id) or shares.setdefault(organization_id, _Share())
        self._process = process = outbox.process
        self.num_bytes = 0
        self._reading = True
        self._parked = False  # in its share's `parked`, its connection paused
        self._connection = None  # the connection to resume, while parked
        self._open = True
        share.num_answers += 1
        if share.num_answers == 1:
            process.num_orgs += 1

    def take(self, num_bytes: int, connection) -> bool:
        """Count bytes just read on `connection`; True when it must pause (it is parked, resumed by `delivery`)."""
        share = self._share
        process = self._process
        share.held += num_bytes
        share.reading += num_bytes
        process.held += num_bytes
        self.num_bytes += num_bytes
        if (share.held < hot.GATEWAY_ANSWER_BYTES_PER_ORG
                and process.held < hot.GATEWAY_ANSWER_BYTES_PER_PROCESS):
            if process.num_parked:
                _settle(share, process)  # NOTE: under the bounds again: the paused go on one by one, each as one reads
            return False
        return self._past_a_bound(connection)

    def _past_a_bound(self, connection) -> bool:
        if self._parked:  # NOTE: more of the read that paused it (a chunk parsed after the pause): parked once only
            return True
        share = self._share
        process = self._process
        if (share.held >= hot.GATEWAY_ANSWER_BYTES_PER_ORG and share.reader is not self
                and process.reader is not self):
            if share.reader is None and share.held - share.reading < hot.GATEWAY_ANSWER_BYTES_PER_ORG:
                share.reader = self
            else:
                self._park(connection, first=False)
                return True
        if process.over() and process.reader is not self:
            if process.reader is None and process.waiting < hot.GATEWAY_ANSWER_BYTES_PER_PROCESS:
                process.reader = self
            else:
                # NOTE: its organisation's reader goes first when its turn comes: no other of its answers may read.
                self._park(connection, first=share.reader is self)
                if not share.in_line:
                    share.in_line = True
                    process.line.append(share)
                return True
        return False

    def _park(self, connection, *, first: bool) -> None:
        self._parked = True
        self._connection = connection
        self._process.num_parked += 1
        if first:
            self._share.parked.appendleft(self)
        else:
            self._share.parked.append(self)

    def give(self, num_bytes: int) -> None:
        num_bytes = min(num_bytes, self.num_bytes)
        if not num_bytes:
            return
        share = self._share
        process = self._process
        self.num_bytes -= num_bytes
        share.held -= num_bytes
        process.held -= num_bytes
        if self._reading:
            share.reading -= num_bytes
        else:
            process.waiting -= num_bytes
        if process.num_parked:
            _settle(share, process)

    def sent(self, num_bytes: int) -> None:
        """Bytes handed to the server: no longer this process's to hold (a client that takes none is cut off)."""
        self.give(num_bytes)

    def done_reading(self) -> None:
        """Its read ended (whole, failed or abandoned): its bytes wait for its client now, and its slots are free."""
        if not self._reading:
            return
        self._reading = False
        share = self._share
        process = self._process
        share.reading -= self.num_bytes
        process.waiting += self.num_bytes
        if share.reader is self:
            share.reader = None
        if process.reader is self:
            process.reader = None
        if self._parked:  # given up while paused (its call cut off, its replica failed): its turn is skipped
            self._parked = False
            process.num_parked -= 1
        self._connection = None
        if process.num_parked:
            _settle(share, process)

    def close(self) -> None:
        self.done_reading()
        self.give(self.num_bytes)
        if self._open:
            self._open = False
            self._share.num_answers -= 1
            if not self._share.num_answers:
                self._process.num_orgs -= 1


def _settle(share: _Share, process: _Process) -> None:
    """Bytes were freed, a slot given back, or a piece read under the bounds: one paused answer may go on."""
    if share.parked and not share.in_line:
        share.in_line = True
        process.line.append(share)
    process.resume_one()


def watch(call: Sending) -> None:
    """Cut `call` off if one of its sends waits longer than the send deadline (from now until `unwatch`)."""
    outbox = _outboxes.get()
    outbox.watched[id(call)] = call
    if outbox.sweeper is None or outbox.sweeper.done():
        outbox.sweeper = asyncio.get_running_loop().create_task(_sweep(outbox))


def unwatch(call: Sending) -> None:
    _outboxes.get().watched.pop(id(call), None)


async def _sweep(outbox: _Outbox) -> None:
    """Runs while some call is watched (then ends: an idle loop keeps no task)."""
    while outbox.watched:
        await asyncio.sleep(SWEEP_EVERY_S)
        now = time.monotonic()
        for call in list(outbox.watched.values()):
            reason = _why_cut(call, now)
            if reason is None:
                continue
            outbox.watched.pop(id(call), None)
            try:
                call.cut_off(reason)
            except Exception:  # noqa: BLE001 - one call's failure must not stop the watchdog of every other
                logger.exception("could not cut off a call (%s)", reason)


def _why_cut(call: Sending, now: float) -> str | None:
    if call.sending_since is not None and now - call.sending_since > hot.GATEWAY_SEND_TIMEOUT_S:
        return f"its client took none of its answer for {now - call.sending_since:.0f} s"
    # NOTE: the gateway holds a call's reservation up to `GATEWAY_MAX_ANSWER_WAIT_S` from its start, and it lapses one
    # reservation time later (`presence`): a call still answering a client that reads just fast enough would go on
    # with nothing held against the caps and credit. A third of that time is left for sending a whole answer that
    # came at the longest wait, and for the call's end.
    if now - call.started_monotonic > hot.GATEWAY_MAX_ANSWER_WAIT_S + hot.BILLING_RESERVATION_TTL_S / 3:
        return f"it ran for {now - call.started_monotonic:.0f} s, the longest a call may"
    return None


def drop_connection(send) -> bool:
    """Drop the client's connection at once, with whatever the server still buffers for it (a close would wait
    to send it first, and a client that reads nothing never lets it). Uvicorn's `send` is a bound method of the
    request's cycle, which holds the connection's transport; with another server, False (the caller's
    cancellation ends the call, and the server closes the connection its own way)."""
    cycle = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    if transport is None or not hasattr(transport, "abort"):
        return False
    transport.abort()
    # NOTE: the server hears of it a loop turn later; until then it would write to the closed connection (its own
    # 500 for a call cut off before its first byte, a RuntimeError in its task). Its own flag, as a lost connection sets.
    if hasattr(cycle, "disconnected"):
        cycle.disconnected = True
    return True
