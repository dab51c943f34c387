"""Gateway processes' heartbeats, and what happens to the requests of one that dies or that Redis forgot.

Each gateway process refreshes `gw:alive:<gateway>` (TTL `ALIVE_TTL_S`) every `BEAT_S`, and reads
Redis's clock for its offset to it (`controlplane.clock.redis_now`: the rate limits' minutes); its
requests sit in one hash per organisation, `gw:{org:<id>}:requests:<gateway>` (written by the
admission and finish scripts, `endpoints.gateway.traffic`), each listed in `gw:gateways`. The beat
also writes the endpoints it served since the last one to `gw:recent_endpoints`. Two repairs follow:

- **A dead gateway** (killed, OOM, its machine gone) stops beating. `sweep_dead_gateways` (each
  autoscaler tick) releases its requests within seconds: out of the endpoints' in-flight and
  waiting sets, and each replica's outstanding count back down by one. Before, they counted for an
  hour (`traffic.STALE_AFTER_S`), which kept the endpoint from scaling to zero.
- **Redis lost its memory** (a restart without persistence, a flush, a failover). A live gateway's
  next beat finds its alive key gone and puts back every request it is still serving: in flight on
  its endpoint, one outstanding on its replica, and its reservation against the caps and credit
  (`billing.quota.counters.restore_reservations`). So the autoscaler sees the load that is really
  there, instead of idle endpoints whose streams it would drain, and new calls are admitted against
  what the running ones still hold, not against counters rebuilt from the ledger as if nothing ran.
  Calls admitted in the second before that beat are not held back by them.
- **Redis came back a moment in the past** (an append-only file fsynced every second, a replica
  promoted with lag): the alive key is kept, the last moment's writes are not. Every
  `RECONCILE_EVERY_BEATS` beats the gateway compares what Redis holds for it with what it serves
  (`_reconcile`): it puts back what is missing, as above, and releases what it no longer serves
  (a call that ended in the lost moment, back in flight) once two reconciles found it unchanged. It reads
  the organisations it serves, and those it served until two reconciles found nothing of theirs. The organisations
  whose part failed are reconciled again, alone, by the next beats (`_Repair.retry`).

- **Redis is another server** (a replica promoted, a restart from its files) that may lack the last counts added to
  spend counters that still exist: the beat drops them, each rebuilt from the ledger by its next call
  (`billing.quota.server_change`, `_check_server_beside`).

Requests whose end could not reach Redis (it was down) are kept here and ended by a later beat: their entries released
(only their own call's, by its token: `traffic.new_call_token`) and their unused tokens given back (`end_later`).

A beat also records, next to each call's reservation, the usage its stream has been answered so far (`_record_progress`,
`billing.quota.counters.record_progress`): a gateway killed mid-stream (SIGKILL, OOM) then leaves what it delivered,
which the sweeper bills when the call's hold lapses (`billing.quota.sweeper`), less what was answered after its last beat.
Like the reconcile, it runs beside the beats (`_record_progress_beside`), `CHUNK` organisations at once (`_by_chunks`).

A beat also pushes on the spend reservation deadlines (`billing.quota.sweeper`) of the requests this process
has served for a while: a live gateway's long call (a stream of many tokens, a non-streamed answer waited for
while its engine generates) keeps its hold on the caps and credit until its own end. Before, its hold was
released at the deadline (`BILLING_RESERVATION_TTL_S`, 15 min) while it still ran, and the caller could have
as much again admitted against the same credit. Only a gateway that stops beating (dead, or frozen past the
deadline) has its calls' holds lapse; a call is pushed on for `GATEWAY_MAX_ANSWER_WAIT_S` (6 h) at most, so
its hold lasts that plus one deadline, and the call is cut off a third of a deadline before that (`endpoints.gateway.delivery`).

NOTE: a gateway that only froze past `ALIVE_TTL_S` (a stalled event loop; not a long reconcile, which runs beside the
beats: `_reconcile_beside`) is swept like a dead one;
when it beats again it finds its key gone and puts its requests back, so its counts come back and
are released once, by the request's own end. The sweeper reads the alive key just before each
organisation's release script, not inside it (another slot on Redis Cluster): a gateway that resumes
in between has requests released that it still serves, which its next reconcile puts back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from django.conf import settings
from redis.exceptions import RedisClusterException, RedisError

from billing.ledger import UsageReport
from billing.quota import counters, server_change, sweep_index
from controlplane import clock, redis_keys
from controlplane.cancellation import end_if_cancelled
from controlplane.hot_settings import hot
from controlplane.per_loop import PerLoop
from controlplane.redis_client import get_async_redis, get_redis, redis_time
from controlplane.redis_scripts import Script
from endpoints.gateway import limits, traffic

logger = logging.getLogger("inferplane.gateway")
T = TypeVar("T")

BEAT_S = 1.0
ALIVE_TTL_S = 5
SWEEP_BATCH = 200
# The errors that are Redis's or the network's, not a bug: a reconcile that meets one tries again next beat.
# NOTE: redis-py's Redis Cluster errors (`SlotNotCoveredError`, a node's slots moving) are no `RedisError`: one was
# raised as a bug, aborting every organisation's part of the reconcile, and clearing `_Repair.due` (found by review).
# OSError holds ConnectionError and TimeoutError.
REDIS_FAILURES = (RedisError, RedisClusterException, OSError)
# Organisations a beat's parts send to Redis at once (`_by_chunks`: a reconcile's, the progress recorded): between
# chunks the loop runs; so too between this many calls of one organisation handled on the loop.
CHUNK = 250

# One organisation's keys per call (one Redis Cluster slot). KEYS: the gateway's requests hash of the
# organisation, the no-replica placeholder, then per request: in-flight set, waiting set, the
# outstanding counter it held (or the placeholder). ARGV: per request: request id, the hash value
# read. Releases each request still held as read; returns how many, and how many the hash still holds.
_RELEASE_REQUESTS = Script(traffic.TRAFFIC_LUA + """
local released = 0
for i = 1, #ARGV, 2 do
  local base = 3 + 3 * ((i - 1) / 2)
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[base], ARGV[i])
    redis.call('ZREM', KEYS[base + 1], ARGV[i])
    if KEYS[base + 2] ~= KEYS[2] then traffic_release({KEYS[base + 2]}) end
    released = released + 1
  end
end
return {released, redis.call('HLEN', KEYS[1])}
""")

# One organisation's keys per call. KEYS: the gateway's requests hash of the organisation, the
# no-replica placeholder, then per request: in-flight set, the outstanding counter (or the placeholder).
# ARGV: counter TTL, then per request: request id, hash value. Puts back each request the hash
# does not hold (Redis forgot it, or a sweeper released it), in flight since now (Redis's clock, `traffic`).
# Returns the ids put back, and the hash's other entries (id, value, ...): requests this gateway no longer serves.
_RESTORE_REQUESTS = Script(traffic.TRAFFIC_LUA + """
local restored, served = {}, {}
local now = traffic_now()
for i = 2, #ARGV, 2 do
  local base = 3 + 2 * ((i - 2) / 2)
  served[ARGV[i]] = true
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    redis.call('ZADD', KEYS[base], now, ARGV[i])
    if KEYS[base + 1] ~= KEYS[2] then
      redis.call('INCR', KEYS[base + 1])
      redis.call('EXPIRE', KEYS[base + 1], ARGV[1])
    end
    restored[#restored + 1] = ARGV[i]
  end
end
local unserved = {}
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  if not served[entries[i]] then
    unserved[#unserved + 1] = entries[i]
    unserved[#unserved + 1] = entries[i + 1]
  end
end
return {restored, unserved}
""")


@dataclass(slots=True)
class Held:
    """A request this process serves: its organisation, endpoint and the replica whose outstanding count it holds."""

    organization_id: int
    endpoint_id: str
    replica_id: str | None = None
    since: float = field(default_factory=time.monotonic)  # when this process began serving it
    reservation: counters.Reservation | None = None  # what it holds against the caps and credit
    # From when (Redis's clock, s) its reservation may have lapsed: a second before the deadline its admission, or the
    # last beat that pushed it on, set. Past it, the sweeper may have swept the hold: its settled marker tells whether
    # it counted the call, for as long as it lives (`counters.told_until`); after that, it is not held again
    # (`_hold_again`) and its settlement drops what it cannot tell it counted (`counters.SETTLE_LUA`).
    lapses_at: float | None = None
    # Its usage row as it would be written if this process were lost now (None while it has none to bill), the
    # tokens (prompt, cached, completion) of the last one a beat recorded (`_record_progress`), and of the last one a
    # beat sent, recorded or not: one the script did not record (its reservation lapsed and not held again) is built
    # and sent again only once its tokens change, or once it is held again (`record_again`).
    progress: Callable[[tuple[int, int, int] | None], UsageReport | None] | None = None
    progress_recorded: tuple[int, int, int] | None = None
    call_token: str = ""  # its call's (`traffic.new_call_token`): its entry is put back as its own
    # Its usage row is being written (it may be in the ledger): a hold again drops the counters rebuilt since it was
    # last known held, whose snapshot may have it (`counters.restore_reservations`; so too, whatever this says, for a
    # call past its `lapses_at` on Redis's clock: the sweeper's `gateway_lost` row may be there).
    writes_row: bool = False
    progress_sent: tuple[int, int, int] | None = None

    def value(self) -> str:
        counter = redis_keys.outstanding_key(self.organization_id, self.replica_id) if self.replica_id else ""
        return f"{self.endpoint_id}|{counter}|{self.call_token}"

    def counter(self) -> str:
        if self.replica_id is None:
            return redis_keys.no_replica_placeholder(self.organization_id)
        return redis_keys.outstanding_key(self.organization_id, self.replica_id)

    def record_again(self) -> None:
        """Its progress is to be recorded by the next beat whatever its tokens (Redis lost it, or it is held again)."""
        self.progress_recorded = self.progress_sent = None


@dataclass(slots=True, frozen=True)
class Unfinished:
    """A call whose end did not reach Redis: its token (only its entry is released, never a later try's under its
    request id) and its tokens' give-back (`limits.Window.give_back_keys_and_args`), if it has one."""

    call_token: str
    give_back: tuple[list[str], list] | None = None


# The requests this process serves (request id -> Held), and the calls whose end did not reach Redis
# ((organisation id, request id, call token) -> `Unfinished`).
# NOTE: keyed by the call's token too: two tries of one request id (a batch line) whose ends both missed Redis before a
# beat are two calls to end; keyed by the request id alone, the second's end replaced the first's, and the first's
# unused tokens were never given back.
serving: dict[str, Held] = {}
unfinished: dict[tuple[int, str, str], Unfinished] = {}
# Those of them whose usage row waits in this process's journal (the ledger refused it): their progress is dropped
# with their end, so the sweeper never bills them from it (`end_later`).
unfinished_journaled: set[tuple[int, str, str]] = set()
# The organisations of the calls tracked or held again since the last beat, with when the first of those holds may
# lapse (Redis's clock): the beat lists them in the sweeper's index (`billing.quota.sweep_index`, `_list_due`).
to_list: dict[int, float] = {}


@dataclass(slots=True)
class _Beating:
    task: asyncio.Task | None = None  # this loop's heartbeat
    reconcile: asyncio.Task | None = None  # its reconcile, while one runs (`_reconcile_beside`)
    progress: asyncio.Task | None = None  # its calls' progress being recorded (`_record_progress_beside`)
    deadlines: asyncio.Task | None = None  # its calls' reservation deadlines being pushed on (`_push_deadlines_beside`)
    server: asyncio.Task | None = None  # its check of which Redis server it is, and a drop of counters (`_check_server`)


_beats: PerLoop[_Beating] = PerLoop(_Beating)


def track(request_id: str, organization_id: int, endpoint_id: str, replica_id: str | None,
          reservation: counters.Reservation | None = None,
          progress: Callable[[tuple[int, int, int] | None], UsageReport | None] | None = None,
          call_token: str = "") -> Held:
    held = serving[request_id] = Held(organization_id, endpoint_id, replica_id, reservation=reservation,
                                      progress=progress, call_token=call_token)
    if reservation is not None:
        held.lapses_at = clock.redis_now() + hot.BILLING_RESERVATION_TTL_S - 1
        _list_later(organization_id, held.lapses_at)
    return held


def _list_later(organization_id: int, lapses_at: float) -> None:
    if lapses_at < to_list.get(organization_id, math.inf):
        to_list[organization_id] = lapses_at


async def _list_due(gateway: str) -> None:
    """List in the sweeper's index the organisations of the calls tracked or held again since the last beat (`to_list`):
    their holds lapse at their deadlines only if a sweep reads them then. Those not listed (Redis) are by the next beat.

    NOTE: a second at most after their admission wrote their deadlines (15 minutes away); a gateway killed before has its
    requests released by the dead-gateway sweep, which lists their organisations (`sweep_dead_gateways`)."""
    if not to_list:
        return
    due = dict(to_list)
    to_list.clear()
    try:
        await sweep_index.list_due_async(due)
    except Exception as exc:  # noqa: BLE001 - listed by the next beat
        for organization_id, lapses_at in due.items():
            _list_later(organization_id, lapses_at)
        logger.warning("gateway %s: could not list its calls' organisations for the sweeper: %r", gateway, exc)


def untrack(request_id: str) -> None:
    _let_go(serving.pop(request_id, None))


def _let_go(held: Held | None) -> None:
    """NOTE: a call's progress is its own method (`InferenceCall.progress`), and the call holds its `Held`: a cycle
    that kept each ended call, and the answer bytes it held, until the garbage collector ran (a batch run's six lines
    of 6 MiB held 42 MiB at once, past their bound; found by tests/batches/test_batch_answer_bytes.py)."""
    if held is not None:
        held.progress = None


def end_later(organization_id: int, request_id: str, *, call_token: str, row_journaled: bool = False,
              give_back: tuple[list[str], list] | None = None) -> None:
    """The end of the request's call of `call_token` could not reach Redis: a later beat releases its entry (as a
    sweeper would), never another call's under the same id, and gives back the tokens it did not use (`give_back`:
    `limits.Window.give_back_keys_and_args`; once, should its finish have run after all, its reply lost);
    `row_journaled`: its usage row is in this process's journal, and that beat also drops its progress.

    NOTE: its reservation is left to lapse, and the sweeper bills a lapsed hold with no ledger row from its progress
    (`billing.quota.sweeper`): a stream whose row waited in the journal (PostgreSQL down) when its settlement failed
    was billed from its last beat's progress, and the journal's replay of its whole row, coming after, was refused
    as a duplicate (found by the review of the lost-gateway billing). Its row is the one that bills it."""
    held = serving.get(request_id)
    if held is not None and held.call_token == call_token:  # never another live call's under the id
        _let_go(serving.pop(request_id, None))
    unfinished[(organization_id, request_id, call_token)] = Unfinished(call_token, give_back)
    # NOTE: its hold, if any, is left to lapse: listed due now for the sweeper (`_list_due`), which lists it again by its
    # deadline. An admission whose reply was lost (`admission.admit`) may have held one its process never tracked.
    _list_later(organization_id, clock.redis_now())
    if row_journaled:
        unfinished_journaled.add((organization_id, request_id, call_token))


def ended_unreleased(organization_id: int, request_id: str, call_token: str) -> bool:
    """Whether this process knows the request's call of `call_token` ended, its end not yet in Redis (`end_later`)."""
    return (organization_id, request_id, call_token) in unfinished


@dataclass(slots=True)
class _Extended:
    at: float = 0.0  # when the last beat pushed deadlines on (monotonic)


_extended = _Extended()


def _deadlines_due(now: float) -> list[tuple[int, list[str]]] | None:
    """The requests whose reservation deadlines to push on now (organisation, request ids), every third of the
    reservation's time (a minute at most): those served at least that long, and no longer than the longest a call is
    waited for (`GATEWAY_MAX_ANSWER_WAIT_S`): one left here by a bug never holds a caller's credit for good. The
    organisations whose holds lapse first come first (`Held.lapses_at`)."""
    every_s = min(60.0, settings.BILLING_RESERVATION_TTL_S / 3)
    if now - _extended.at < every_s:
        return None  # not yet: the last push stands
    oldest = now - settings.GATEWAY_MAX_ANSWER_WAIT_S
    due: dict[int, list[str]] = {}
    first_lapse: dict[int, float] = {}
    for request_id, held in list(serving.items()):
        if oldest <= held.since <= now - every_s:
            due.setdefault(held.organization_id, []).append(request_id)
            lapses_at = math.inf if held.lapses_at is None else held.lapses_at
            first_lapse[held.organization_id] = min(first_lapse.get(held.organization_id, math.inf), lapses_at)
    return sorted(due.items(), key=lambda item: first_lapse[item[0]])


async def _push_deadlines_on(redis, now: float | None = None) -> None:
    """Push on the reservation deadlines due (`_deadlines_due`): `CHUNK` organisations a pipeline, the loop let run
    between, the first to lapse first; all of them now, one chunk after another, so none waits for a later push.

    NOTE: one pipeline of every organisation's push, once a minute: 20,000 organisations with calls in flight were one
    20,000-command pipeline, packed on the loop and answered by Redis at once (a stall of both; the review of presence
    at scale). Each chunk's deadline is the one read before the first (so never later than a whole push's would be:
    the chunks after it give a call no less time than one pipeline did) and a hold is taken as still there only if
    Redis's clock after its chunk's push is still before its lapse (`Held.lapses_at`)."""
    now = time.monotonic() if now is None else now
    due = _deadlines_due(now)
    if due is None:
        return
    if due:
        # NOTE: Redis's clock, as the admission's own deadline and the sweeper's (`billing.quota.sweeper`).
        seconds, _ = await redis.time()
        deadline = int(seconds) + 1 + math.ceil(settings.BILLING_RESERVATION_TTL_S)
        for first in range(0, len(due), CHUNK):
            part = due[first:first + CHUNK]
            # NOTE: only a deadline still there (XX: a settled or released reservation is not made again), never
            # earlier (GT); each read back in the same round trip: a call is known held only where its deadline is there.
            async with redis.pipeline(transaction=False) as pipe:
                for organization_id, request_ids in part:
                    pipe.zadd(redis_keys.deadlines_key(organization_id), dict.fromkeys(request_ids, deadline),
                              xx=True, gt=True)
                    pipe.zmscore(redis_keys.deadlines_key(organization_id), request_ids)
                answers = await pipe.execute()
            pushed_by, _ = await redis.time()
            # NOTE: only a hold that had not lapsed when pushed is known to be there still (the sweeper takes one only
            # past its deadline): a push after a freeze past it (XX) made nothing again, and its call must not think it
            # holds. Nor one whose hold Redis lost (a flush, a failover): XX pushed nothing, and its settlement's "held
            # since" (`counters.SETTLE_LUA`) must stay when it was last known held. NOTE: it moved on all the same, and
            # a counter rebuilt after the loss and before the push (its snapshot with the row, the call not reserved)
            # was not dropped by the call's settlement, which added its cost again.
            for (_, request_ids), scores in zip(part, answers[1::2], strict=True):
                for request_id, score in zip(request_ids, scores, strict=True):
                    held = serving.get(request_id)
                    if (held is not None and held.lapses_at is not None and pushed_by < held.lapses_at
                            and score is not None and score >= deadline):
                        held.lapses_at = deadline - 1
            await asyncio.sleep(0)
    _extended.at = now  # NOTE: only once due and pushed: a beat in between (every second) never moves it on


async def _by_chunks(part: Callable[..., Awaitable[T]], items: list[tuple]) -> list[T | BaseException]:
    """`part(*item)` for each of `items`, `CHUNK` at once, the loop let run between chunks: each part's result or its
    error, in order (one's failure loses no other's).

    NOTE: one gather of every organisation's parts stalled the loop for seconds (20,000 organisations: the reconcile's
    up to 3.7 s, the progress recorded 1.7-2.2 s), the alive key missing to the sweeper beside the beats."""
    results: list[T | BaseException] = []
    for first in range(0, len(items), CHUNK):
        results += await asyncio.gather(*(part(*item) for item in items[first:first + CHUNK]), return_exceptions=True)
        await asyncio.sleep(0)
    return results


async def _record_progress() -> int:
    """Record, next to their reservations, the usage so far of the calls this process serves whose tokens grew since
    the last beat recorded them (`counters.record_progress`): one script per organisation, `CHUNK` organisations at
    once (`_by_chunks`). Returns how many were recorded; an organisation's Redis error stops no other's (its calls are
    recorded by the next beat), and is raised once the others are done.

    NOTE: on the beat, never per chunk: a stream's chunks cost no Redis write. What a call is answered after the last
    beat before its gateway is lost (a second's worth, `BEAT_S`) is not billed."""
    by_organization: dict[int, list[Held]] = {}
    for held in list(serving.values()):
        if held.progress is not None:
            by_organization.setdefault(held.organization_id, []).append(held)
    failures = _Failures()
    counts = await _by_chunks(_record_organization_progress, list(by_organization.items()))
    recorded = sum(count for (organization_id, _), count in zip(by_organization.items(), counts, strict=True)
                   if not failures.failed(count, f"organisation {organization_id}'s"))
    if failures.first is not None:
        raise failures.first
    return recorded


async def _record_organization_progress(organization_id: int, calls: list[Held]) -> int:
    """`_record_progress` for one organisation's calls: their rows built here, in their organisation's chunk (~110 µs
    each: built all at once, they too stalled the loop)."""
    due: list[tuple[Held, tuple[int, int, int], UsageReport]] = []
    for num, held in enumerate(calls):
        if num and not num % CHUNK:
            await asyncio.sleep(0)  # one organisation's 20,000 streams: 0.2-0.4 s of rows built at once
        try:
            if held.progress is None or (report := held.progress(held.progress_sent)) is None:
                continue
        except ValueError:  # NOTE: one odd call (the wall clock stepped back past its start) stops no other's
            continue
        tokens = (report.prompt_tokens, report.cached_tokens, report.completion_tokens)
        if tokens != held.progress_sent:
            due.append((held, tokens, report))
    if not due:
        return 0
    # NOTE: `CHUNK` calls a script: one organisation's 20,000 rows encoded at once (~40 µs each, loaded) stalled the
    # loop 0.8 s.
    num_recorded = 0
    for first in range(0, len(due), CHUNK):
        part = due[first:first + CHUNK]
        # NOTE: marked sent before the reply: one the script refuses (its reservation lapsed, not held again) is not
        # built and sent again each beat while its tokens stay (~110 µs each, for as long as it runs: the review of
        # presence at scale); one held again meanwhile (`_hold_again`: `record_again`) is sent again by the next beat.
        for held, tokens, _ in part:
            held.progress_sent = tokens
        try:
            recorded = set(await counters.record_progress(organization_id, [report for _, _, report in part]))
        except BaseException:
            for held, _, _ in part:
                held.progress_sent = None  # sent again by the next beat
            raise
        # NOTE: only the calls the script recorded (still reserved): one whose reservation Redis had lost was marked
        # recorded all the same when `_hold_again` held it again (and reset its mark) before this reply came, and a
        # stream stalled since then had no progress for the sweeper until the next reconcile (found by fix-beat's
        # author), its gateway's loss then unbilled.
        for held, tokens, report in part:
            if report.request_id in recorded:
                held.progress_recorded = tokens
        num_recorded += len(recorded)
    return num_recorded


# A beat compares what Redis holds for this gateway with what it serves every this many beats (and at once when Redis
# forgot its alive key).
RECONCILE_EVERY_BEATS = 5


@dataclass(slots=True)
class _Repair:
    due: bool = False  # Redis forgot this gateway, and what it serves is not all put back yet
    num_forgotten: int = 0  # beats that found its alive key gone (`_reconcile_done`)
    num_beats: int = 0  # beats since the last reconcile
    # What the last reconcile found in this gateway's requests hashes that it does not serve ((organisation id,
    # request id) -> hash value): released if the next one finds it still there, unchanged.
    unserved: dict[tuple[int, str], str] = field(default_factory=dict)
    # The organisations it serves nothing for whose requests hashes the last reconcile found empty: forgotten if the
    # next one finds them empty too (`traffic.unregister_requests_key`).
    empty: set[int] = field(default_factory=set)
    # The requests put back whose reservations are not yet held again (`counters.restore_reservations` failed, or has
    # not answered yet): the next reconcile holds them again while they are served (`_hold_again`).
    unheld: set[str] = field(default_factory=set)
    # The organisations a part of the last reconcile failed for (Redis's or the network's error), the others' done: the
    # next beats reconcile them alone (as forgotten while `due`) until they pass, the others at their own pace.
    retry: set[int] = field(default_factory=set)
    # `num_forgotten` when the last whole reconcile began: a beat that found the alive key gone since has the next whole.
    num_forgotten_compared: int = 0

    def whole_due(self) -> bool:
        """Whether the next reconcile compares every organisation: at its own pace, and once Redis forgot this gateway
        since the last whole one began (or one did not end, `_reconcile_once`); else only `retry`, if any."""
        return self.num_beats >= RECONCILE_EVERY_BEATS or self.due and (
            self.num_forgotten != self.num_forgotten_compared or not self.retry)


_repair = _Repair()


def _release_unserved(unserved: dict[tuple[int, str], str]) -> int:
    """Release requests found in this gateway's requests hashes that it no longer serves (each only if its hash
    still holds the value it was found with, and only once: `release_requests`)."""
    by_organization: dict[int, list[str]] = {}
    for (organization_id, request_id), _ in unserved.items():
        if request_id not in serving:
            by_organization.setdefault(organization_id, []).append(request_id)
    return sum(release_requests(traffic.gateway_requests_key(organization_id), request_ids, only_if_dead=False)
               for organization_id, request_ids in by_organization.items())


async def _restore_requests(organization_id: int, snapshot: list[tuple[str, Held]]) -> tuple[list[str], list[str]]:
    """`_RESTORE_REQUESTS` for the requests of one organisation this process serves: the ids put back, and the hash's
    other entries (id, value, ...)."""
    keys = [traffic.gateway_requests_key(organization_id), redis_keys.no_replica_placeholder(organization_id)]
    args = [traffic.OUTSTANDING_TTL_S]
    for request_id, held in snapshot:
        keys += [redis_keys.inflight_key(organization_id, held.endpoint_id), held.counter()]
        args += [request_id, held.value()]
    return await _RESTORE_REQUESTS(keys=keys, args=args)


async def _restore_organization(organization_id: int, snapshot: list[tuple[str, Held]]
                                ) -> list[tuple[list[str], list[str]] | BaseException]:
    """`_restore_requests`, and what Redis lost of the reservations and progress of the calls that hold one
    (`counters.holds_lost`), both sent at once; each part's result or its error (one's failure loses no result of the
    other's: the reservations of requests put back are held again all the same)."""
    calls = [(request_id, held.progress_recorded is not None) for request_id, held in snapshot
             if held.reservation is not None]
    return await asyncio.gather(_restore_requests(organization_id, snapshot),
                                counters.holds_lost(organization_id, calls), return_exceptions=True)


async def _hold_again(organization_id: int, holds: list[tuple[str, Held]]) -> int:
    """`counters.restore_reservations` for the calls of one organisation this process serves (`holds`): once held
    again, each is no longer left to the next reconcile (`_Repair.unheld`), and its progress is recorded again by this
    beat (`_record_progress`: lost with its reservation). Returns how many it held again.

    NOTE: `CHUNK` calls a script, as their progress (`_record_organization_progress`): one organisation's 20,000
    reservations prepared at once held the loop up to 0.3 s."""
    held_again = 0
    for first in range(0, len(holds), CHUNK):
        part = holds[first:first + CHUNK]
        now = clock.redis_now()
        held_again += await counters.restore_reservations(organization_id, [held.reservation for _, held in part],
                                                          [held.lapses_at for _, held in part],
                                                          [held.writes_row for _, held in part])
        for request_id, held in part:
            held.record_again()
            _repair.unheld.discard(request_id)
            # held again (or still), with a new deadline; or settled by the sweeper (its marker: its settlement adds
            # nothing)
            if held.lapses_at is not None and now < counters.told_until(held.lapses_at):
                held.lapses_at = max(held.lapses_at, now + settings.BILLING_RESERVATION_TTL_S - 1)
        # NOTE: its deadline is new (Redis lost it, and the sweeper's index with it, likely): listed by the next beat
        _list_later(organization_id, now + settings.BILLING_RESERVATION_TTL_S - 1)
    return held_again


async def _read_idle(registered: list[int], idle: list[int]) -> list[dict[str, str]]:
    """List this process's requests hashes (`registered`) in `GATEWAYS_KEY` again, and read those of the organisations
    it serves nothing for (`idle`): one pipeline (one round trip per Cluster node)."""
    if not registered:
        return []
    redis = get_async_redis()
    async with redis.pipeline(transaction=False) as pipe:
        # NOTE: Redis lost the gateways set (or the moment an organisation's hash was listed in it), or a sweeper
        # dropped this gateway's emptied hashes while it was frozen: list them again.
        pipe.sadd(redis_keys.GATEWAYS_KEY, *[traffic.gateway_requests_key(organization_id)
                                             for organization_id in registered])
        for organization_id in idle:
            pipe.hgetall(traffic.gateway_requests_key(organization_id))
        return (await pipe.execute())[1:]


async def _forget_idle(empty: set[int]) -> set[int]:
    """Forget this process's requests hashes of the organisations two reconciles found empty (`empty`) and that it
    still serves nothing for, and take them out of `GATEWAYS_KEY`; returns those forgotten.

    NOTE: a call admitted for one of them meanwhile lists its hash again (`traffic.register_requests_key`); should that reach Redis
    before this takes it out (another pooled connection), the next reconcile lists it again (`_read_idle`)."""
    busy = {held.organization_id for held in list(serving.values())} | {
        organization_id for organization_id, _, _ in list(unfinished)}
    forgotten = {organization_id for organization_id in empty - busy
                 if traffic.unregister_requests_key(organization_id)}
    if forgotten:
        await get_async_redis().srem(redis_keys.GATEWAYS_KEY, *[traffic.gateway_requests_key(organization_id)
                                                                for organization_id in forgotten])
    return forgotten


async def _reconcile(gateway: str, *, forgotten: bool = False, only: set[int] | None = None) -> set[int] | None:
    """Make what Redis holds for this gateway what it serves: put back the requests it still serves that Redis does
    not hold (each in flight on its endpoint and outstanding on its replica, and its reservation against the caps and
    credit, with its progress: `_record_progress`), hold again the reservation Redis lost of any call it serves and
    record again the progress it lost of one whose reservation it kept (`counters.holds_lost`), list its requests
    hashes again in `GATEWAYS_KEY`, and release the requests Redis holds that it no longer serves. Two scripts per
    organisation it serves and a read of each other hash it registered, sent `CHUNK` organisations at once (`_by_chunks`)
    (a round trip a chunk, and one more per `CHUNK` calls of an organisation whose reservations it holds again), the
    loop let run between chunks. `forgotten`: Redis forgot this gateway's alive key, so every
    reservation of what it serves is held again where missing, not only those found missing; and a reservation a
    reconcile failed to hold again (a Redis error, a timeout, after its request was put back) is held again by the next
    (`_Repair.unheld`). `only`: these organisations alone (those whose parts failed: `_Repair.retry`), neither the
    hashes of the idle ones read nor any it no longer serves released (left to the next whole reconcile). Returns the
    organisations whose part failed (Redis's or the network's error, logged in one line: the next beat reconciles them
    again), None when a part of the whole failed (the next reconcile is whole); any other error is raised.

    NOTE: a part that failed for one organisation had every organisation reconciled again on every beat until it passed
    (a Redis Cluster node failing over: each beat the whole reconcile, seconds of it with thousands served).

    NOTE: a reservation is held again where Redis is found to have lost it (`counters.holds_lost`), not only where this
    reconcile put its request back: a put-back whose result never reached it (the other part of its organisation
    failed and discarded it; its reply lost; redis-py's one retry after a dropped connection ran it again and found
    nothing to put back) or Redis coming back a moment in the past between the put-back and the hold again left the
    call's entry there, and no later reconcile held it: the call ran unheld against the caps and credit, with no
    deadline or progress for the sweeper, up to `GATEWAY_MAX_ANSWER_WAIT_S` (6 h).

    NOTE: one organisation's failure (its Redis Cluster node failing over, a timeout) stops no other's: the whole
    reconcile failed with it, so every other organisation's reservations put back waited for the next beat, and so
    did one that failed the same way every time.

    NOTE: what it reads is bounded by what it serves: an organisation it serves nothing for, whose requests hash two
    reconciles found empty, is forgotten (`traffic.unregister_requests_key`, registered again by its next call). Every
    organisation it had ever served was read every `RECONCILE_EVERY_BEATS` beats: a gateway up a week that had served
    50,000 of them read 50,000 hashes every 5 s. Left: Redis coming back more than two reconciles in the past (a replica
    promoted with that much lag) with an entry of an organisation forgotten since is not released by this process
    (its in-flight readers ignore it after `traffic.STALE_AFTER_S`; a sweeper releases it when this process dies).

    NOTE: the alive key is written by the beat that finds it gone, so a reconcile that failed then (Redis down again)
    is tried again by the next beats (`_repair.due`) rather than only `RECONCILE_EVERY_BEATS` later.

    NOTE: Redis may forget part of what it held, not only all of it: restarted from an append-only file fsynced every
    second, or a replica promoted with lag, it comes back a moment in the past with this gateway's alive key still
    there. A call that ended in the lost moment is back in flight and outstanding (for `traffic.STALE_AFTER_S`, an
    hour, the endpoint never scaled to zero); one admitted in it and still running counts nowhere (the autoscaler could
    drain its replica under it), its reservation is gone (new calls were admitted against what it holds), and so is
    its progress (recorded again only once its tokens grew: a stream stalled across the loss, its gateway then lost,
    had what it delivered unbilled). Its progress alone may be lost too (written after its reservation, and after the
    moment Redis came back to): each reconcile asks which of the calls whose progress it recorded lost it while their
    reservations stayed (`counters.holds_lost`), and the beat records it again.

    NOTE: races with calls that start or end meanwhile. A call's hash entry is written by its admission before this
    process tracks it, and its end untracks it before its finish removes the entry: an entry not served is released
    only when two reconciles (`RECONCILE_EVERY_BEATS` apart) found it with the same value. A call that ends between the
    snapshot and its organisation's script is put back by it: released at once (no longer in `serving`); the
    release and the call's own finish each remove the entry only if it is there, so its counter drops once. Its
    reservation is held again only while it is still served; one put back as it settled either finds its marker
    (and is not held again) or, a try that recorded nothing, lapses at its deadline (`billing.quota.sweeper`), as
    does a call's that ended in the lost moment."""
    by_organization: dict[int, list[tuple[str, Held]]] = {}
    for request_id, held in list(serving.items()):
        if only is None or held.organization_id in only:
            by_organization.setdefault(held.organization_id, []).append((request_id, held))
    registered = traffic.registered_organizations() if only is None else []
    idle = [organization_id for organization_id in registered if organization_id not in by_organization]
    failures = _Failures()
    failed: set[int] = set()  # the organisations whose requests were not compared
    retry: set[int] = set()  # those and the organisations whose other parts failed
    parts: list[tuple] = []  # per organisation: (ids put back, the hash's other entries), (unreserved, progress lost)
    idle_read = asyncio.ensure_future(_read_idle(registered, idle))
    organizations = list(by_organization.items())
    try:
        results = await _by_chunks(_restore_organization, organizations)
        for (organization_id, _), result in zip(organizations, results, strict=True):
            restored_part, lost_part = (result, ([], [])) if isinstance(result, BaseException) else result
            if failures.failed(restored_part, f"organisation {organization_id}'s requests"):
                failed.add(organization_id)
                restored_part = ([], [])
            if failures.failed(lost_part, f"organisation {organization_id}'s reservations and progress"):
                retry.add(organization_id)
                lost_part = ([], [])
            parts.append((restored_part, lost_part))
    except BaseException:
        idle_read.cancel()
        raise
    idle_entries = (await asyncio.gather(idle_read, return_exceptions=True))[0]
    whole_failed = failures.failed(idle_entries, "the requests of organisations it serves nothing for")
    if whole_failed:
        idle, idle_entries = [], []
    unserved: dict[tuple[int, str], str] = {}
    ended: dict[tuple[int, str], str] = {}
    to_hold: dict[int, list[tuple[str, Held]]] = {}
    restored = 0
    now = clock.redis_now()
    for num, ((organization_id, snapshot), ((put_back, found), (unreserved, progress_lost))) in enumerate(zip(
            organizations, parts, strict=True)):
        if num and not num % CHUNK:
            await asyncio.sleep(0)
        restored += len(put_back)
        # NOTE: sets: tested per call as lists, one organisation's 20,000 calls that Redis lost stalled the loop 4-7 s.
        put_back, unreserved = set(put_back), set(unreserved)
        for request_id in progress_lost:  # recorded again by the beat (`_record_progress`)
            if (held := serving.get(request_id)) is not None:
                held.record_again()
        for request_id, value in zip(found[::2], found[1::2], strict=True):
            unserved[(organization_id, request_id)] = value
        for request_id, held in snapshot:
            if request_id not in serving:
                if request_id in put_back:  # it ended after the snapshot: its own end found nothing to release
                    ended[(organization_id, request_id)] = held.value()
            elif held.reservation is not None and (
                    forgotten or request_id in put_back or request_id in _repair.unheld
                    or (request_id in unreserved and (held.lapses_at is None or now < held.lapses_at))):
                to_hold.setdefault(organization_id, []).append((request_id, held))
    empty: set[int] = set()
    for organization_id, entries in zip(idle, idle_entries, strict=True):
        if not entries:
            empty.add(organization_id)
        for request_id, value in entries.items():
            unserved[(organization_id, request_id)] = value
    if ended:
        await asyncio.to_thread(_release_unserved, ended)
    # NOTE: remembered before they are tried: its entry is back, so a later reconcile no longer finds its request
    # missing; a restore that failed (a Redis error, a timeout) left the call in flight holding nothing against the caps
    # and credit (new calls admitted against what it held; no hold for the sweeper should its gateway die). Trying one
    # again holds it at most once (the script leaves a reservation still there, or one whose call settled).
    _repair.unheld.intersection_update(serving)
    _repair.unheld.update(request_id for holds in to_hold.values() for request_id, _ in holds)
    holding = list(to_hold.items())
    held_again = await _by_chunks(_hold_again, holding)
    num_held_again = 0
    for (organization_id, _), result in zip(holding, held_again, strict=True):
        if failures.failed(result, f"organisation {organization_id}'s reservations"):
            retry.add(organization_id)
        else:
            num_held_again += result
    released = 0
    if only is None:
        confirmed = {item: value for item, value in unserved.items() if _repair.unserved.get(item) == value}
        released = await asyncio.to_thread(_release_unserved, confirmed) if confirmed else 0
        _repair.unserved = {item: value for item, value in unserved.items() if item not in confirmed} | {
            item: value for item, value in _repair.unserved.items() if item[0] in failed}
        _repair.empty = empty - await _forget_idle(empty & _repair.empty)
    if restored or num_held_again or released:
        logger.warning("gateway %s: put back %d request(s) and %d reservation(s) Redis had lost, released %d it had "
                       "kept after they ended", gateway, restored, num_held_again, released)
    failures.log(gateway)
    return None if whole_failed else retry | failed


# A reconcile's failed parts named in its log line: the first few (one line per beat, whatever the number).
FAILURES_NAMED = 5


@dataclass(slots=True)
class _Failures:
    """The parts of one reconcile that failed (Redis or the network: the next beat reconciles again), logged as one
    line (`log`).

    NOTE: one warning per part flooded the log during a Redis Cluster failover (thousands a second: one per
    organisation served, every beat), and every error counted as Redis's: a programming error (a TypeError) was logged
    as "trying again next beat", without its traceback, and reconciled again every beat for good."""

    parts: list[str] = field(default_factory=list)
    first: BaseException | None = None

    def failed(self, result, what: str) -> bool:
        """Whether `result` (one part's, from `asyncio.gather(..., return_exceptions=True)`) is Redis's or the network's
        error (noted); any other error, or a cancellation, is raised."""
        if not isinstance(result, BaseException):
            return False
        if not isinstance(result, REDIS_FAILURES):
            raise result
        self.parts.append(what)
        self.first = self.first or result
        return True

    def log(self, gateway: str) -> None:
        if self.parts:
            named = ", ".join(self.parts[:FAILURES_NAMED]) + (", ..." if len(self.parts) > FAILURES_NAMED else "")
            logger.warning("gateway %s: could not put back %d part(s) of what Redis forgot (%s); trying again next "
                           "beat: %r", gateway, len(self.parts), named, self.first)


async def beat(*, web: bool = False) -> None:
    """One heartbeat: stay alive, reconcile what Redis holds for this gateway with what it serves (`_reconcile`, beside
    the beats once it takes longer than one: `_reconcile_beside`), push on the reservation deadlines of long calls, end
    what could not be ended and record the calls' progress (beside the beats too: `_record_progress_beside`); a web
    process's (`web`) also counts for the web tier (`WEB_BEATS_KEY`)."""
    redis = get_async_redis()
    gateway = traffic.gateway_id()
    recent = traffic.take_recent()
    # NOTE: each beat writes a value of its own: redis-py's retry after a lost reply sends the pipeline again, whose SET
    # then reads this beat's value back. Read as alive, a key Redis had forgotten put nothing back until the next
    # reconcile at its own pace; what the first SET read is unknown, so it is taken as forgotten (a reconcile that
    # holds again only what is missing).
    beat_value = secrets.token_hex(8)
    try:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.set(redis_keys.gateway_alive_key(gateway), beat_value, ex=ALIVE_TTL_S, get=True)
            if web:  # NOTE: not a batch worker's: its lines say nothing of who hears the agents
                pipe.incr(redis_keys.WEB_BEATS_KEY)  # the web tier is up (`scheduler.web_tier_silent`)
            if recent:
                pipe.zadd(redis_keys.RECENT_ENDPOINTS_KEY, recent, gt=True)
            was_alive = (await pipe.execute())[0]
    except BaseException:
        for endpoint_id in recent:
            traffic.note_recent(endpoint_id)  # the next beat writes them
        raise
    try:
        await clock.read_offset(redis)
        await clock.record_offset(redis)  # for `/metrics`, once a minute
    except Exception as exc:  # noqa: BLE001 - the offset last read stands until the next beat reads it
        logger.warning("gateway %s: could not read Redis's clock: %r", gateway, exc)
    if was_alive is None or was_alive == beat_value:
        _repair.due = True
        _repair.num_forgotten += 1
    await _list_due(gateway)
    _repair.num_beats += 1
    # NOTE: the parts beside the beat share one wait of `BEAT_S` (`_waited_for`): each waited up to `BEAT_S` of its
    # own, four slow ones (a loaded Redis) kept a beat 4 s from the next, and with the sleep between beats the alive key
    # (`ALIVE_TTL_S`) lapsed on a live gateway, whose calls the sweeper then released and billed as lost.
    until = asyncio.get_running_loop().time() + BEAT_S
    await _check_server_beside(redis, until)
    if _repair.whole_due():
        await _reconcile_beside(gateway, None, until)
    elif _repair.retry:
        await _reconcile_beside(gateway, set(_repair.retry), until)
    await _push_deadlines_beside(gateway, redis, until)
    await _record_progress_beside(gateway, redis, until)


async def _waited_for(task: asyncio.Task, until: float) -> None:
    """Wait for `task` (a part of the beat run beside it) until the loop's time `until`, at most: one not done by
    then goes on beside the beats."""
    await asyncio.wait({task}, timeout=max(0.0, until - asyncio.get_running_loop().time()))


async def _push_deadlines_beside(gateway: str, redis, until: float) -> None:
    """Push on the calls' reservation deadlines (`_push_deadlines_on`) as a task of its own (one at a time per loop),
    waited for within the beat's `BEAT_S`: one that takes longer (many organisations' chunks, a loaded Redis) goes on beside the
    beats, which keep the alive key meanwhile; a push that fails is tried again by the next beat."""
    beating = _beats.get()
    if beating.deadlines is not None and not beating.deadlines.done():
        return
    beating.deadlines = asyncio.get_running_loop().create_task(_push_deadlines_once(gateway, redis))
    await _waited_for(beating.deadlines, until)


async def _push_deadlines_once(gateway: str, redis) -> None:
    try:
        await _push_deadlines_on(redis)
    except Exception as exc:  # noqa: BLE001 - the next beat tries again; the requests' own ends go on
        logger.warning("gateway %s: could not push on its calls' reservation deadlines: %r", gateway, exc)


async def _check_server_beside(redis, until: float) -> None:
    """Drop the spend counters once Redis is another server than the one they were counted on (a replica promoted, a
    restart that may have lost the last writes: `billing.quota.server_change`), as its own task (one at a time per
    loop), waited for within the beat's `BEAT_S`: a drop (a scan of the keyspace) that takes longer goes on beside the beats."""
    beating = _beats.get()
    if beating.server is not None and not beating.server.done():
        return
    beating.server = asyncio.get_running_loop().create_task(_check_server(redis))
    await _waited_for(beating.server, until)


async def _check_server(redis) -> None:
    try:
        await server_change.check_server(redis)
    except Exception as exc:  # noqa: BLE001 - the next beat checks again (a drop's lease lapses if this one held it)
        logger.warning("could not check which Redis server the spend counters were counted on: %r", exc)


async def _record_progress_beside(gateway: str, redis, until: float) -> None:
    """End what could not be ended (`end_later`), then record the calls' progress (`_record_progress`), as one task of
    its own (one at a time per loop), waited for within the beat's `BEAT_S`: one that takes longer goes on beside the beats.

    NOTE: as the reconcile (`_reconcile_beside`): inside the beat, 20,000 organisations' streams recorded in chunks
    (2-3 s, longer under load) spaced the beats past the alive key's life, though the loop ran between chunks; so did
    the ends of 9,000 organisations' calls after a Redis blip (7 s, a thread hop each), and the sweeper released the
    live gateway's calls. NOTE: the ends only while no recording runs, just before the next: a journaled call's
    progress, dropped by its end, would otherwise be written again by a recording that read it before (the sweeper
    then billing it from that progress)."""
    beating = _beats.get()
    if beating.progress is not None and not beating.progress.done():
        return  # the next beat after it ends ends what waits, and records again
    beating.progress = asyncio.get_running_loop().create_task(_end_and_record_once(gateway, redis))
    await _waited_for(beating.progress, until)


async def _end_and_record_once(gateway: str, redis) -> None:
    try:
        await _end_unfinished(redis, gateway)
    except Exception as exc:  # noqa: BLE001 - those not ended are ended by the next beat; the progress is recorded
        logger.warning("gateway %s: could not end the calls whose end did not reach Redis: %r", gateway, exc)
    try:
        await _record_progress()
    except Exception as exc:  # noqa: BLE001 - the next beat records it; the calls' own ends bill them whole
        logger.warning("gateway %s: could not record its calls' progress: %r", gateway, exc)


async def _end_unfinished(redis, gateway: str) -> None:
    """Release the requests whose end could not reach Redis (`end_later`), and drop the progress of those whose usage
    row waits in this process's journal: `CHUNK` organisations a thread hop and a pipeline, the loop let run between.
    Those of a chunk that failed stay for the next beat (a release is the end's own: done once)."""
    if not unfinished:
        return
    by_organization: dict[int, list[tuple[str, Unfinished]]] = {}
    for (organization_id, request_id, _), call in list(unfinished.items()):
        by_organization.setdefault(organization_id, []).append((request_id, call))
    organizations = list(by_organization.items())
    for first in range(0, len(organizations), CHUNK):
        part = organizations[first:first + CHUNK]
        await asyncio.to_thread(_release_ended, gateway, part)
        journaled = [(organization_id, [request_id for request_id, call in calls
                                        if (organization_id, request_id, call.call_token) in unfinished_journaled])
                     for organization_id, calls in part]
        if journaled := [(organization_id, ids) for organization_id, ids in journaled if ids]:
            async with redis.pipeline(transaction=False) as pipe:
                for organization_id, ids in journaled:
                    pipe.hdel(redis_keys.progress_key(organization_id), *ids)
                await pipe.execute()
        for organization_id, calls in part:
            for request_id, call in calls:
                key = (organization_id, request_id, call.call_token)
                if unfinished.get(key) is call:
                    del unfinished[key]
                    unfinished_journaled.discard(key)


def _release_ended(gateway: str, organizations: list[tuple[int, list[tuple[str, Unfinished]]]]) -> None:
    """Release the entries of the calls whose end did not reach Redis, and give back their unused tokens."""
    for organization_id, calls in organizations:
        call_tokens: dict[str, set[str]] = {}
        for request_id, call in calls:
            call_tokens.setdefault(request_id, set()).add(call.call_token)
        release_requests(traffic.gateway_requests_key(organization_id, gateway), list(call_tokens), only_if_dead=False,
                         call_tokens=call_tokens)
        for _, call in calls:
            if call.give_back is not None:
                limits.give_back_alone(call.give_back)


async def _reconcile_beside(gateway: str, only: set[int] | None, until: float) -> None:
    """Start a reconcile (of `only`'s organisations, or all) as its own task (one at a time per loop), and wait for it within the beat's `BEAT_S`: one that takes
    longer goes on beside the beats, which keep this gateway's alive key while it runs.

    NOTE: run inside the beat, a reconcile that outlasted `ALIVE_TTL_S` (10,000 organisations in flight on a loaded
    machine: 2-4.4 s; the first after Redis forgot them: 8-10 s) let the alive key of a live gateway lapse: the sweeper
    released its requests and billed its live calls as lost (`billing.quota.sweeper`), and the next beat, finding the
    key gone, reconciled again as if Redis had forgotten it, beat after beat. A gateway whose loop is stalled still
    beats not at all, and is swept like a dead one."""
    beating = _beats.get()
    if beating.reconcile is not None and not beating.reconcile.done():
        return  # the next beat after it ends starts another if one is still due
    beating.reconcile = asyncio.get_running_loop().create_task(_reconcile_once(gateway, only))
    await _waited_for(beating.reconcile, until)


async def _reconcile_once(gateway: str, only: set[int] | None) -> None:
    """`_reconcile`, in forgotten mode while `_Repair.due`; its outcome noted in `_repair` (a Redis error: the next beat
    reconciles again, the organisations that failed alone when the others were done)."""
    num_forgotten = _repair.num_forgotten
    # NOTE: a reconcile that fails leaves the beats to go on (deadlines pushed on, ends released): one failing the same
    # way every time stopped the long calls' deadlines, and the sweeper released live holds.
    try:
        retry = await _reconcile(gateway, forgotten=_repair.due, only=only)
    except REDIS_FAILURES as exc:  # tried again by the next beat
        logger.warning("gateway %s: could not put back what Redis forgot: %r", gateway, exc)
        return
    except Exception:  # noqa: BLE001 - a bug, not Redis: logged with its traceback
        # NOTE: tried again at the reconcile's own pace, not every beat (a traceback a second, for good): what Redis
        # forgot is found all the same then (a missing reservation: `counters.holds_lost`).
        logger.exception("gateway %s: its reconcile failed", gateway)
        retry = set()
    if retry is not None:
        _reconcile_done(num_forgotten, retry, whole=only is None)


def _reconcile_done(num_forgotten: int, retry: set[int], *, whole: bool) -> None:
    """The organisations whose part failed (`retry`) are reconciled again by the next beat; the next whole reconcile is
    due `RECONCILE_EVERY_BEATS` beats after the last (`whole`), and at once if a beat found the alive key gone since
    it began (`num_forgotten`): what it put back may be gone again, so the next beat reconciles all as forgotten."""
    if whole:
        _repair.num_beats = 0
        _repair.num_forgotten_compared = num_forgotten
    _repair.retry = retry
    if not retry and _repair.num_forgotten == _repair.num_forgotten_compared:
        _repair.due = False


async def _beat_forever(*, web: bool = False) -> None:
    """Beat every `BEAT_S` until cancelled.

    NOTE: a cancellation that came as one of its Redis writes finished was dropped (`controlplane.cancellation`): a
    loop's end cancelled the beat once, the beat went on, and the loop waited for it for good (a whole-suite run hung
    600 s in the slow-rebuild test's second `asyncio.run`)."""
    while True:
        try:
            await beat(web=web)
        except Exception as exc:  # noqa: BLE001 - Redis down: beat again, the requests are still served
            logger.warning("gateway heartbeat failed: %r", exc)
        end_if_cancelled()
        await asyncio.sleep(BEAT_S)


async def start(*, web: bool = False) -> None:
    """Beat once now (so this gateway is known before it admits anything), then every `BEAT_S`; `web`: this is a web
    process (the gateway's server, which hears the agents too), not a batch worker."""
    beating = _beats.get()
    if beating.task is not None and not beating.task.done():
        return
    try:
        await beat(web=web)
    except Exception as exc:  # noqa: BLE001 - Redis may be down at start; the loop keeps trying
        logger.warning("gateway heartbeat failed: %r", exc)
    beating.task = asyncio.get_running_loop().create_task(_beat_forever(web=web))


def ensure_started() -> None:
    """Start beating on this loop if nothing started it (a server without lifespan events)."""
    beating = _beats.get()
    if beating.task is None or beating.task.done():
        beating.task = asyncio.get_running_loop().create_task(_beat_forever())


# --- the sweeper (control plane side) -------------------------------------------------------------

def _release_keys_and_args(requests_key: str, items: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """`_RELEASE_REQUESTS`'s keys and arguments for entries (request id, value) of one requests hash."""
    organization_id = redis_keys.organization_of_key(requests_key)
    placeholder = redis_keys.no_replica_placeholder(organization_id)
    keys, args = [requests_key, placeholder], []
    for request_id, value in items:
        endpoint_id = value.partition("|")[0]
        keys += [redis_keys.inflight_key(organization_id, endpoint_id), redis_keys.waiting_key(organization_id, endpoint_id),
                 traffic.entry_counter(value) or placeholder]
        args += [request_id, value]
    return keys, args


async def release_leftover(organization_id: int, request_id: str, entry: str) -> None:
    """Release the entry an earlier try under `request_id` left in this gateway's requests hash, whose end this process
    knows and has not yet taken to Redis (`ended_unreleased`), as its end would, if it is still `entry`: a new call under
    the id is admitted in its place."""
    keys, args = _release_keys_and_args(traffic.gateway_requests_key(organization_id), [(request_id, entry)])
    await _RELEASE_REQUESTS(keys=keys, args=args)


def release_requests(requests_key: str, request_ids: list[str] | None = None, *, only_if_dead: bool,
                     call_tokens: dict[str, set[str]] | None = None) -> int:
    """Release the requests (all, or `request_ids`) of a gateway's requests hash of one organisation as
    their own end would; -1 if `only_if_dead` and the gateway is alive. `call_tokens` (request id -> call tokens): only
    those calls' entries, not another try's under the same id."""
    client = get_redis()
    gateway = redis_keys.gateway_of_requests_key(requests_key)
    entries = client.hgetall(requests_key) if request_ids is None else dict(
        zip(request_ids, client.hmget(requests_key, request_ids), strict=True))
    items = [(request_id, value) for request_id, value in entries.items() if value is not None and (
        call_tokens is None or traffic.entry_call_token(value) in call_tokens[request_id])]
    released, num_left = 0, len(items)
    for first in range(0, len(items), SWEEP_BATCH):
        if only_if_dead and client.exists(redis_keys.gateway_alive_key(gateway)):
            return -1
        keys, args = _release_keys_and_args(requests_key, items[first:first + SWEEP_BATCH])
        count, num_left = _RELEASE_REQUESTS.run_sync(keys=keys, args=args)
        released += count
    if only_if_dead and not num_left and not client.hlen(requests_key):
        client.srem(redis_keys.GATEWAYS_KEY, requests_key)
    return released


def sweep_dead_gateways() -> int:
    """Release the requests of every gateway whose heartbeat stopped; returns how many were released."""
    client = get_redis()
    released = 0
    for requests_key in client.smembers(redis_keys.GATEWAYS_KEY):
        gateway = redis_keys.gateway_of_requests_key(requests_key)
        if client.exists(redis_keys.gateway_alive_key(gateway)):
            continue
        # NOTE: a gateway killed before its beat listed its calls' organisations for the reservation sweeper
        # (`_list_due`): their holds would never lapse. Listed due now, they are read by the next sweep and listed
        # again by their first deadline; listed before the release: a sweep killed between the two left them unlisted.
        sweep_index.list_due(client, {redis_keys.organization_of_key(requests_key): redis_time(client)})
        count = release_requests(requests_key, only_if_dead=True)
        if count > 0:
            logger.warning("gateway %s stopped beating: released %d of its request(s)", gateway, count)
            released += count
    return released
