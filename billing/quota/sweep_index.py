"""Which organisations the reservation sweeper reads (`billing.quota.sweeper`): an index of them by when their first
reservation deadline or replay registration may fall due (`SWEEP_DUE_KEY`, a sorted set scored on Redis's clock), so
that a sweep reads only the organisations with something due, not every organisation every run.

NOTE: a sweep read the deadlines and registrations of every organisation in the database every 30 s: its cost grew
with the number of organisations, not with the work due (the review of presence at scale).

An organisation's score is never later than any of its deadlines or registrations (lowered only: `ZADD LT`). Who
writes a deadline or a registration lists its organisation after it:
- a gateway's beat, for the organisations of the calls it began tracking or held again since the last beat
  (`endpoints.gateway.presence`), a second at most after the admission wrote the deadline (15 minutes away), and
  due at once for a call whose end could not reach Redis (`presence.end_later`: an admission whose reply was lost
  may have held one its process never tracked);
- the dead-gateway sweep, for each organisation whose requests it releases (a gateway killed before its beat listed
  them: `presence.sweep_dead_gateways`), due at once, before it releases them;
- a replay, before registering its rows (`replayed.register_replaying`), by when they lapse.
The last two list first: one killed between its write and its listing left a hold or a registration the index never
named (found only by the rolling audit).
A deadline pushed on by a beat only moves later, so its score stays early enough. The sweeper takes the organisations
due out of the index (`claim_due`) before it reads them, then lists each again by what it still holds (`list_next`):
a deadline written after its read was listed after its claim by its writer, so none is lost between the two. A
sweep that raises lists every organisation it claimed and did not read through due at once (`sweeper`).

A lost index is rebuilt (`audit`): the marker `SWEEP_DUE_BUILT_KEY` lives in the index's slot (one Redis Cluster node)
and is set once a whole pass over every organisation listed them all; a sweep that finds it missing (Redis lost its
memory, or the index was never built) reads every organisation first, as the sweep did before, and lists each. Each
sweep also reads `AUDIT_PER_RUN` organisations more in turn (`SWEEP_AUDIT_CURSOR_KEY`): what only a moment of the
index was lost (its node came back a moment in the past, a sweeper killed between a claim and its listing, a writer
killed between its deadline and its listing) is found by that rolling pass, within `number of organisations /
AUDIT_PER_RUN` runs (20,000 organisations: 20 runs, 10 minutes at one run every 30 s).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from controlplane.redis_client import as_text, get_async_redis
from controlplane.redis_keys import (
    SWEEP_AUDIT_CURSOR_KEY,
    SWEEP_DUE_BUILT_KEY,
    SWEEP_DUE_KEY,
    deadlines_key,
    replaying_key,
)

# Organisations a round trip reads or lists (one pipeline).
ORGS_PER_PIPELINE = 1000
# Organisations the rolling audit reads each sweep, before it takes the due ones.
AUDIT_PER_RUN = 1000
# Organisations a sweep takes from the index at most; those left are due at the next.
CLAIMED_PER_RUN = 20 * ORGS_PER_PIPELINE


def _chunks(items: list, size: int) -> Iterable[list]:
    for first in range(0, len(items), size):
        yield items[first : first + size]


def list_due(client, due: Mapping[int, float]) -> None:
    """List organisations (id -> when something of theirs may fall due, Redis's clock) in the index, each only ever
    earlier than it is listed (sync client)."""
    items = list(due.items())
    for part in _chunks(items, ORGS_PER_PIPELINE):
        client.zadd(SWEEP_DUE_KEY, {str(organization_id): when for organization_id, when in part}, lt=True)


async def list_due_async(due: Mapping[int, float]) -> None:
    """`list_due` from the gateway's loop (its async client): `ORGS_PER_PIPELINE` organisations a command."""
    redis = get_async_redis()
    items = list(due.items())
    for part in _chunks(items, ORGS_PER_PIPELINE):
        await redis.zadd(
            SWEEP_DUE_KEY, {str(organization_id): when for organization_id, when in part}, lt=True
        )


def claim_due(client, now: float) -> list[int]:
    """The organisations due at `now` (the earliest first, `CLAIMED_PER_RUN` at most), taken out of the index: the
    sweeper lists each again once it has read it (`list_next`)."""
    due = client.zrangebyscore(SWEEP_DUE_KEY, "-inf", now, start=0, num=CLAIMED_PER_RUN)
    for part in _chunks(due, ORGS_PER_PIPELINE):
        client.zrem(SWEEP_DUE_KEY, *part)
    return [int(organization_id) for organization_id in due]


def held(client, organization_ids: list[int], *, lapsed_before: float | None = None) -> dict[int, float]:
    """When something of each organisation falls due: its first reservation deadline, or its first registration (past
    `lapsed_before` only, when given: those lapsed before were read by the sweep that gives it); organisations with
    nothing are left out. One pipeline a `ORGS_PER_PIPELINE` organisations."""
    due: dict[int, float] = {}
    for part in _chunks(organization_ids, ORGS_PER_PIPELINE):
        pipe = client.pipeline(transaction=False)
        for organization_id in part:
            pipe.zrange(deadlines_key(organization_id), 0, 0, withscores=True)
            pipe.hvals(replaying_key(organization_id))
        answers = pipe.execute()
        for organization_id, first, registrations in zip(part, answers[::2], answers[1::2], strict=True):
            times = [score for _, score in first]
            times += [
                until
                for until in (_registered_until(value) for value in registrations)
                if lapsed_before is None or until >= lapsed_before
            ]
            if times:
                due[organization_id] = min(times)
    return due


def list_next(client, organization_ids: list[int], now: float) -> None:
    """List again the organisations a sweep at `now` read through (`claim_due`), by what they still hold: a deadline
    passed but left (to its count) is due at the next sweep, a registration that lapsed before `now` was read by this
    one. Only once their read finished: one that raised is listed due at once (`sweeper`)."""
    list_due(client, held(client, organization_ids, lapsed_before=now))


def audit(client, all_organization_ids) -> bool:
    """Rebuild the index if it was lost (its marker missing): every organisation read and listed, then the marker
    set; else read `AUDIT_PER_RUN` organisations in turn (`SWEEP_AUDIT_CURSOR_KEY`). `all_organization_ids`: a
    callable (after: int, limit: int | None) -> ascending ids. Returns whether it rebuilt the whole index."""
    if not client.exists(SWEEP_DUE_BUILT_KEY):
        after = 0
        while part := list(all_organization_ids(after, ORGS_PER_PIPELINE)):
            list_due(client, held(client, part))
            after = part[-1]
        client.set(SWEEP_DUE_BUILT_KEY, "1")
        return True
    if AUDIT_PER_RUN <= 0:
        return False
    after = int(client.get(SWEEP_AUDIT_CURSOR_KEY) or 0)
    part = list(all_organization_ids(after, AUDIT_PER_RUN))
    if part:
        list_due(client, held(client, part))
    client.set(
        SWEEP_AUDIT_CURSOR_KEY, part[-1] if len(part) == AUDIT_PER_RUN else 0
    )  # from the start when done
    return False


def _registered_until(value: bytes | str) -> float:
    """A registration's deadline (`<deadline>.<token>`: `billing.quota.replayed`)."""
    return float(as_text(value).partition(".")[0])
