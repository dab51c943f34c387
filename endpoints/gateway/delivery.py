"""Answers on their way to clients that may not read them.

A client that stops reading holds what the gateway still has to send it: a whole answer (up to
`upstream.MAX_WHOLE_BODY_BYTES`) sits in the process's memory, a stream stops reading its replica (whose
engine goes on generating into its own buffers), and the call holds its replica and its reservation. Cheap
answers can be large (embeddings of many inputs), so a tenant with a few hundred requests a minute could
fill a gateway process's memory for every other tenant. Two bounds, as a reverse proxy's `send_timeout`
and its buffers give:

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
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from django.conf import settings

from controlplane.per_loop import PerLoop
from endpoints.gateway import errors

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
    parked: list = field(default_factory=list)  # the paused connections of the others, oldest first (`upstream`)

    def over(self) -> bool:
        return self.held >= settings.GATEWAY_ANSWER_BYTES_PER_ORG

    def may_read_one(self) -> bool:
        """Whether one more answer may be read on though the organisation is past its bound: its answers read whole
        (waiting for its clients) are not, so what is past it is answers being read, of which one must go on."""
        return self.held - self.reading < settings.GATEWAY_ANSWER_BYTES_PER_ORG

    def resume_one(self) -> None:
        """The longest-parked connection reads on (it reads one piece at least before it may park again).

        NOTE: one at a time: resuming all at once had each read a piece before parking again, every time a slot
        freed, and those pieces piled up past the bound (437 MiB against 8 in a review's simulation)."""
        while self.parked:
            connection = self.parked.pop(0)
            if not connection.closed:
                connection.resume()
                return


@dataclass(slots=True)
class _Outbox:
    shares: dict[int, _Share] = field(default_factory=dict)  # by organisation
    watched: dict[int, Sending] = field(default_factory=dict)  # by id(): calls are dataclasses, not hashable
    sweeper: asyncio.Task | None = None


_outboxes: PerLoop[_Outbox] = PerLoop(_Outbox)


def refuse_if_over(organization_id: int) -> None:
    """A 429 for an organisation whose answers in this process (read or waiting for its clients) are past its bound."""
    share = _outboxes.get().shares.get(organization_id)
    if share is not None and share.over():
        raise errors.OpenAIError(
            429, f"This organisation's answers hold {share.held // 2**20} MiB on this server, answers its clients have "
                 f"not read yet included (at most {settings.GATEWAY_ANSWER_BYTES_PER_ORG // 2**20} MiB): read them, or "
                 "close their connections, before sending more.", type="requests", code=UNREAD_ANSWERS,
            headers={"retry-after": "5"})


def held_bytes(organization_id: int) -> int:
    share = _outboxes.get().shares.get(organization_id)
    return share.held if share is not None else 0


class AnswerHolding(Protocol):
    """What counts a whole answer's bytes as it is read (`upstream.Response.read`: `take`, `give` for bytes dropped,
    `done_reading`) and sent (`InferenceCall`: `sent`, `close` at the call's end)."""

    def take(self, num_bytes: int, connection) -> bool: ...

    def give(self, num_bytes: int) -> None: ...

    def sent(self, num_bytes: int) -> None: ...

    def done_reading(self) -> None: ...

    def close(self) -> None: ...


class Holding:
    """One whole answer's bytes, counted against its organisation from the first read to the last piece handed over
    (`upstream.Response.read` takes them, `InferenceCall` gives them back); `close` gives back the rest.

    NOTE: past the bound, an answer being read pauses its connection unless it is the organisation's one reader, a
    slot taken only while the answers read whole (waiting for clients, cut off at the send deadline) are within the
    bound, and parked connections go on one at a time: so what an organisation holds stays within about twice the
    bound and one answer (and a first piece of each answer), and something always moves (a reader reads on; a client
    reads, leaves or is cut off)."""

    __slots__ = ("_share", "num_bytes", "_reading")

    def __init__(self, organization_id: int):
        # NOTE: a share stays once made (one small object per organisation served by the process), so it is looked up
        # once per answer, not per piece read.
        shares = _outboxes.get().shares
        self._share = shares.get(organization_id) or shares.setdefault(organization_id, _Share())
        self.num_bytes = 0
        self._reading = True

    def take(self, num_bytes: int, connection) -> bool:
        """Count bytes just read on `connection`; True when it must pause (it is parked, resumed by `delivery`)."""
        share = self._share
        share.held += num_bytes
        share.reading += num_bytes
        self.num_bytes += num_bytes
        if not share.over():
            if share.parked:
                share.resume_one()  # NOTE: under the bound again: the parked go on one by one, each as one reads
            return False
        if share.reader is self:
            return False
        if share.reader is None and share.may_read_one():
            share.reader = self
            return False
        share.parked.append(connection)
        return True

    def give(self, num_bytes: int) -> None:
        num_bytes = min(num_bytes, self.num_bytes)
        if not num_bytes:
            return
        share = self._share
        self.num_bytes -= num_bytes
        share.held -= num_bytes
        if self._reading:
            share.reading -= num_bytes
        self._settle(share)

    def sent(self, num_bytes: int) -> None:
        """Bytes handed to the server: no longer this process's to hold (a client that takes none is cut off)."""
        self.give(num_bytes)

    def done_reading(self) -> None:
        """Its read ended (whole, failed or abandoned): its bytes wait for its client now, and the reader's slot is free."""
        if not self._reading:
            return
        self._reading = False
        share = self._share
        share.reading -= self.num_bytes
        if share.reader is self:
            share.reader = None
        self._settle(share)

    def close(self) -> None:
        self.done_reading()
        self.give(self.num_bytes)

    @staticmethod
    def _settle(share: _Share) -> None:
        if share.parked and (not share.over() or (share.reader is None and share.may_read_one())):
            share.resume_one()


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
    if call.sending_since is not None and now - call.sending_since > settings.GATEWAY_SEND_TIMEOUT_S:
        return f"its client took none of its answer for {now - call.sending_since:.0f} s"
    # NOTE: the gateway holds a call's reservation up to `GATEWAY_MAX_ANSWER_WAIT_S` from its start, and it lapses one
    # reservation time later (`presence`): a call still answering a client that reads just fast enough would go on
    # with nothing held against the caps and credit. A third of that time is left for sending a whole answer that
    # came at the longest wait, and for the call's end.
    if now - call.started_monotonic > settings.GATEWAY_MAX_ANSWER_WAIT_S + settings.BILLING_RESERVATION_TTL_S / 3:
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
