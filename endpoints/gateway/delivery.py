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
- **Unsent bytes per organisation.** A whole answer larger than `PIECE_BYTES` is handed to the server a
  piece at a time, each once the client has taken the one before, and what is not yet handed over is
  counted against its organisation (per process). Past `GATEWAY_UNSENT_BYTES_PER_ORG`, the
  organisation's new calls are refused (429 `unread_answers`) until its clients read or leave.
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
class _Outbox:
    unsent: dict[int, int] = field(default_factory=dict)  # organisation → bytes of whole answers not handed over
    watched: dict[int, Sending] = field(default_factory=dict)  # by id(): calls are dataclasses, not hashable
    sweeper: asyncio.Task | None = None


_outboxes: PerLoop[_Outbox] = PerLoop(_Outbox)


def refuse_if_over(organization_id: int) -> None:
    """A 429 for an organisation whose clients have left more than its share of answers unread here."""
    held = _outboxes.get().unsent.get(organization_id)
    if held is not None and held >= settings.GATEWAY_UNSENT_BYTES_PER_ORG:
        raise errors.OpenAIError(
            429, f"This organisation's clients have {held // 2**20} MiB of answers they have not read yet on this server "
                 f"(at most {settings.GATEWAY_UNSENT_BYTES_PER_ORG // 2**20} MiB): read them, or close their connections, "
                 "before sending more.", type="requests", code=UNREAD_ANSWERS, headers={"retry-after": "5"})


def unsent_bytes(organization_id: int) -> int:
    return _outboxes.get().unsent.get(organization_id, 0)


def hold(organization_id: int, num_bytes: int) -> None:
    """Count `num_bytes` of an answer not yet handed to the server against its organisation."""
    unsent = _outboxes.get().unsent
    unsent[organization_id] = unsent.get(organization_id, 0) + num_bytes


def release(organization_id: int, num_bytes: int) -> None:
    unsent = _outboxes.get().unsent
    left = unsent.get(organization_id, 0) - num_bytes
    if left > 0:
        unsent[organization_id] = left
    else:
        unsent.pop(organization_id, None)


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
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None or not hasattr(transport, "abort"):
        return False
    transport.abort()
    return True
