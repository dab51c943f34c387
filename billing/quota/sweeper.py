"""Reservations whose gateway died mid-request, released once their deadline passes (a crash never
holds a cap forever). Run by the `billing.sweep_expired_reservations` task.

A reservation whose request has a usage row was served and never settled: its gateway lost Redis (a
failover, a freeze past the timeout) or died between writing the row and settling. It is settled with
the row's cost in the period of the row's `finished_at` (drawing credit only for a row billed prepaid), as its
finish would have (`counters.SETTLE`, once per
request id by its settled marker), so the spend it made counts against caps and credit; released without it, caps
were passed for the month.

A reservation whose request has no usage row but a progress (`counters.record_progress`: its gateway's beat wrote the
usage its stream had been answered so far) was a call whose gateway was lost mid-stream (killed, OOM): its row is
written from that progress, marked `gateway_lost`, in the billing mode it was admitted under, and settled as above.
Once: the ledger's unique request id writes one row whoever writes it (the call's own, written by its gateway woken
from a freeze or replayed from its journal, supersedes it: `billing.ledger.supersede_lost_rows`, the difference counted
by `billing.quota.replayed.count_superseded`), and the settlement's marker counts its spend once (a woken gateway's
settlement finds it, and releases nothing twice; one woken after the marker expired drops the counters it cannot tell
counted it, rebuilt from the ledger: `counters.SETTLE_LUA`). Before, such a call was billed nothing for what it had streamed
(up to `GATEWAY_MAX_ANSWER_WAIT_S`). What was answered after the gateway's last beat is not billed.

A superseded row whose writer died between its supersede and its count (a woken gateway's own write has no journal
segment to replay) is counted once its registration lapsed (`replayed.count_lapsed_supersedes`).

Reservations live per organisation (in its Redis Cluster slot), so the sweep reads each organisation's deadlines and
registrations, `ORGS_PER_PIPELINE` organisations per round trip: only those the index says are due
(`billing.quota.sweep_index`), and `sweep_index.AUDIT_PER_RUN` more in turn; every organisation only when the index
was lost. Before, every organisation in the database was read every run."""

from __future__ import annotations

import json
import logging
from decimal import Decimal

from django.db import DataError, IntegrityError, transaction

from billing.ledger import UnknownEndpointError, record_usage_batch
from billing.models import UsageRecord
from billing.quota import counters, replayed, sweep_index
from billing.usage_journal import decode
from controlplane.accounts.models import Organization
from controlplane.redis_client import get_redis, redis_time
from controlplane.redis_keys import (
    deadlines_key,
    key_reserved_key,
    org_reserved_key,
    progress_key,
    replaying_key,
    reservations_key,
)
from controlplane.redis_scripts import Script
from controlplane.script_parts import ComposedScript, ScriptPart

# KEYS: reservations, deadlines, org reserved, key reserved, progress; ARGV: request id, has key, now
_RELEASE_EXPIRED = Script(counters.UNRESERVE_LUA + """
local deadline = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not deadline or tonumber(deadline) > tonumber(ARGV[3]) then return 0 end
local payload = redis.call('HGET', KEYS[1], ARGV[1])
if payload then
  local amount = cjson.decode(payload)['a']
  quota_unreserve(KEYS[3], amount)
  if ARGV[2] == '1' then quota_unreserve(KEYS[4], amount) end
  redis.call('HDEL', KEYS[1], ARGV[1])
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
return 1
""")


# Whether a reservation's deadline passed at the sweep's `now`, read in the script that settles it.
DEADLINE_PASSED = ScriptPart(
    "deadline_passed", keys=("deadlines",), args=("request id", "now (Redis's clock, s)"), lua="""
local function deadline_passed(K, A)
  local deadline = redis.call('ZSCORE', K[1], A[1])
  return deadline and tonumber(deadline) <= tonumber(A[2])
end
""")

# The reservation and its deadline are checked again in the script: its call may have settled it since the sweeper read
# it (the call's own marker stops a second count too, but only for minutes), or its gateway, woken from a freeze, pushed
# its deadline on (its beat, `presence._push_deadlines_on`) and kept its hold (its reconcile): the call runs on, held,
# and settles itself. NOTE: the sweeper settled such a call (with a lost row from its progress, and a day's marker):
# it ran on unheld to its end (up to `GATEWAY_MAX_ANSWER_WAIT_S`), calls beside it were admitted past the cap and the
# prepaid credit it no longer held, and the marker kept it from being held again.
_SETTLE_SERVED = ComposedScript([DEADLINE_PASSED, counters.SETTLE], glue="""
if not deadline_passed(deadline_passed_K, deadline_passed_A) then return 0 end
if redis.call('HEXISTS', quota_settle_K[1], quota_settle_A[1]) == 0 then return 0 end
return quota_settle(quota_settle_K, quota_settle_A)
""")

ORGS_PER_PIPELINE = sweep_index.ORGS_PER_PIPELINE

logger = logging.getLogger("inferplane.billing")


def sweep_expired_reservations(now: float | None = None, *, batch_size: int = 1000) -> int:
    """Release reservations whose deadline passed (their gateway died mid-request) at `now`, Redis's clock (read here
    when None), which the deadlines are set on: a worker whose own clock ran a deadline's 15 minutes ahead released the
    holds of calls still running. Reads the organisations the index says are due (`sweep_index.claim_due`), after its
    audit (the whole index rebuilt if it was lost), and lists each again by what it still holds. Returns how many."""
    now = redis_time() if now is None else now
    client = get_redis()
    sweep_index.audit(client, _organization_ids)
    due = sweep_index.claim_due(client, now)
    released = 0
    for first in range(0, len(due), ORGS_PER_PIPELINE):
        batch = due[first:first + ORGS_PER_PIPELINE]
        try:
            released += _sweep_organizations(batch, now, batch_size)
            sweep_index.list_next(client, batch, now)
        except BaseException:
            # NOTE: every organisation claimed and not read through (this batch and those after it) is due again at
            # once: listed by `list_next` only the batch was, those after it waited for the rolling audit (held for
            # good with none), and a registration that lapsed before `now`, its count failed, was never read again.
            sweep_index.list_due(client, dict.fromkeys(due[first:], now))
            raise
    return released


def _organization_ids(after: int, limit: int) -> list[int]:
    return list(Organization.objects.filter(pk__gt=after).order_by("pk").values_list("pk", flat=True)[:limit])


def _sweep_organizations(organization_ids: list[int], now: float, batch_size: int) -> int:
    client = get_redis()
    pipe = client.pipeline(transaction=False)
    for organization_id in organization_ids:
        pipe.zrangebyscore(deadlines_key(organization_id), "-inf", now, start=0, num=batch_size)
        pipe.hgetall(replaying_key(organization_id))
    answers = pipe.execute()
    released = 0
    for organization_id, expired, registrations in zip(organization_ids, answers[::2], answers[1::2], strict=True):
        while expired:
            released_now = _release(client, organization_id, expired, now)
            released += released_now
            if len(expired) < batch_size or not released_now:  # a batch all left to their counts is read again next run
                break
            expired = client.zrangebyscore(deadlines_key(organization_id), "-inf", now, start=0, num=batch_size)
        if registrations:  # a registration the release dropped meanwhile (`_registered`) counts nothing here
            replayed.count_lapsed_supersedes(organization_id, registrations, now)
    return released


def _release(client, organization_id: int, expired: list[str], now: float) -> int:
    released = 0
    rows = _rows(organization_id, expired)
    if missing := [request_id for request_id in expired if request_id not in rows]:
        if _record_lost_calls(client, organization_id, missing):
            rows = _rows(organization_id, expired)
    counted_later, lapsed = _registered(client, organization_id, list(rows), now)
    for request_id in expired:
        payload = client.hget(reservations_key(organization_id), request_id)
        held = json.loads(payload) if payload else None
        if request_id in counted_later:
            continue
        if held is not None and request_id in rows:
            if request_id in lapsed:
                client.hdel(replaying_key(organization_id), request_id)
            cost, finished_at, billing_mode = rows[request_id]
            reservation = counters.Reservation(request_id, organization_id, held["k"], Decimal(0), held["p"])
            _SETTLE_SERVED.run_sync(
                deadline_passed=([deadlines_key(organization_id)], [request_id, f"{now:.3f}"]),
                quota_settle=counters.settle_keys_and_args(reservation, cost, finished_at=finished_at,
                                                           billing_mode=billing_mode))
            released += 1
            continue
        api_key_id = held["k"] if held else None
        keys = [reservations_key(organization_id), deadlines_key(organization_id), org_reserved_key(organization_id),
                key_reserved_key(organization_id, api_key_id), progress_key(organization_id)]
        has_key = "1" if api_key_id is not None else "0"
        released += _RELEASE_EXPIRED.run_sync(keys=keys, args=[request_id, has_key, f"{now:.3f}"])
    return released


def _registered(client, organization_id: int, request_ids: list[str], now: float) -> tuple[set[str], set[str]]:
    """Of `request_ids` (calls whose row the ledger has, read before), those a replay registered and has not counted
    (`billing.quota.replayed`: before its INSERT, or before a supersede): whose registration lasts, and lapsed.

    A call whose registration lasts is left to its count: it counts the row once, whole while the hold is there (a
    replayed row sets the call's settled marker; a superseding one counts its whole cost and sets it), and the next
    sweep only releases the hold. NOTE: settled in the round trip between the commit and the count, the row's cost was
    counted twice: the sweeper's settlement (the whole row, read after the commit) and the count (the row again, or the
    difference from the lost row it superseded, as the hold was gone): $1.00 or $0.86 counted for $0.50
    (`tests/billing/test_lost_row_superseded.py`). Read after the row: a registration dropped meanwhile was counted,
    and the count set the marker the settlement then finds.

    A lapsed one (its replay killed between its commit and its count, or one whose INSERT failed) is dropped before
    the call is settled: the next replay of its rows finds it no longer owed and counts nothing more
    (`replayed.count_replayed`), or, dropping it first, counts the row and sets the marker the settlement finds."""
    if not request_ids:
        return set(), set()
    registrations = client.hmget(replaying_key(organization_id), request_ids)
    registered = {request_id: float(until_s) for request_id, until_s in zip(request_ids, registrations, strict=True)
                  if until_s is not None}
    lasting = {request_id for request_id, until_s in registered.items() if until_s >= now}
    return lasting, registered.keys() - lasting


def _rows(organization_id: int, request_ids: list[str]) -> dict[str, tuple]:
    return {request_id: (cost, finished_at, billing_mode) for request_id, cost, finished_at, billing_mode
            in UsageRecord.objects.filter(organization_id=organization_id, request_id__in=request_ids)
            .values_list("request_id", "cost", "finished_at", "billing_mode")}


def _record_lost_calls(client, organization_id: int, request_ids: list[str]) -> int:
    """Write the usage rows of the calls (no row yet) whose gateway recorded their progress: it was lost mid-call.
    Returns how many rows it wrote (a row written meanwhile by the call's own gateway is kept, not doubled)."""
    reports = []
    for request_id, payload in zip(request_ids, client.hmget(progress_key(organization_id), request_ids), strict=True):
        if payload is None:
            continue
        try:
            reports.append(decode(payload))
        except (ValueError, TypeError, KeyError):
            logger.exception("call %s: its progress cannot be read; its hold is released unbilled", request_id)
    if not reports:
        return 0
    written = _write_lost_rows(reports)
    if written:
        logger.warning("organisation %s: billed %d call(s) cut by a lost gateway from their last progress",
                       organization_id, len(written))
    return len(written)


def _write_lost_rows(reports: list) -> set[str]:
    """Write the rows of lost calls (`_record_lost_calls`); the request ids written.

    NOTE: a row PostgreSQL refuses (its data, or a key it names gone) is left unbilled, logged, and the others are
    written, one at a time once their batch was refused: raised, it stopped the sweep of every organisation after
    this one, on every run, for as long as its progress lasted (a day; found by the review of the lost-gateway
    billing). An outage (`OperationalError`) is raised: the next run tries again."""
    try:
        with transaction.atomic():
            try:
                return record_usage_batch(reports)
            except UnknownEndpointError as exc:  # its endpoint was deleted since: the others are written (committed)
                logger.error("calls %s of a lost gateway name an endpoint no longer there: not billed", exc.refused_ids)
                return exc.written_ids
    except (DataError, IntegrityError):
        if len(reports) == 1:
            logger.exception("call %s of a lost gateway: its row was refused; not billed", reports[0].request_id)
            return set()
    return set().union(*(_write_lost_rows([report]) for report in reports))
