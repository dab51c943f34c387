"""Running a batch's lines through the gateway's own call path, in a Celery worker.

Each line is an `endpoints.gateway.call.InferenceCall`, driven in-process with a `send` that captures
the answer and a `receive` that never disconnects: the same admission (the creating key's rate limits,
the organisation's caps and credit), reservation, replica choice, usage row and journal as an
interactive call. What differs is only what a batch line is:

- its request id is `<batch id>-<line index>`, the same on every try, so a line re-run after a worker
  died mid-line writes no second usage row (the ledger's unique request id);
- its usage row carries the batch id and is priced at the endpoint's `batch_price_fraction`;
- its `body.model` is resolved as the gateway resolves a call's, on the batch's endpoint (`Batch.endpoint`, renamed
  or not): the endpoint, or one of its LoRA adapters (`"<endpoint>:<adapter>"`), run on a replica holding it and priced and metered as the
  gateway's call to it;
- it runs at `scheduling.BATCH_ENGINE_PRIORITY` at the engine, and is started only while the READY
  replicas have spare slots (`scheduling.batch_slots`), never held through a cold start.

A line's result is written to S3 as it finishes (`storage.put_result`); a run that is taken over
skips the lines already there. Its answer counts against the worker process's bound on the bytes of answers its lines
hold in memory (`answer_bytes`), from before its first byte is read until its row is stored; one larger than a line may
hold there goes on to disk (`spool`). Transient refusals (429, 5xx, an outage) leave the line pending for a later try,
but a 429 for a line past its key's whole minute of tokens (`errors.RequestTooLarge`) and an engine's own 500 on a replica still READY, `MAX_ENGINE_FAILURES` times over `ENGINE_FAILURES_MIN_SPAN_S`
(counted across runs); anything else is the line's answer, kept in the error file. A 402 met beside the run's other
lines in flight (their reservations) is tried once more, alone, once they have ended.
"""

from __future__ import annotations

import asyncio
import codecs
import heapq
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from decimal import Decimal

from django.conf import settings
from django.db import InterfaceError, OperationalError

from billing import usage_writer
from controlplane import clock
from controlplane.redis_client import get_async_redis
from controlplane.redis_keys import batch_engine_failures_key, outstanding_key
from controlplane.worker_threads import connections_checked, in_worker_thread
from endpoints.adapters import parse_model_name
from endpoints.batches import answer_bytes, scheduling, spool
from endpoints.batches.validation import Line
from endpoints.gateway import adapter_hold, directory, errors, presence, upstream
from endpoints.gateway.auth import Caller
from endpoints.gateway.call import InferenceCall
from endpoints.gateway.request import InferenceRequest

logger = logging.getLogger("inferplane.batches")

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
# PostgreSQL away (a restart, a failover, a cut connection): a run goes on through it, starting no line. NOTE: only
# these: any other database error (a bad query, a constraint) is a fault that must be seen, not an outage that ends
# every run quietly and queues the batch again at each tick.
DATABASE_AWAY = (OperationalError, InterfaceError)
CHECK_EVERY_S = 1.0  # how often a run renews its lease, writes its counts and reads a cancel
# While PostgreSQL is away a run checks again after 0.25 s, then twice as long each time, at most `CHECK_EVERY_S`,
# for up to `BATCH_OUTAGE_RETRY_S` (starting no line meanwhile) before it stops starting lines for the rest of its slice.
OUTAGE_FIRST_RETRY_S = 0.25
RETRY_PAUSE_S = 1.0  # after a transient refusal, no line starts for this long
# A line's answer is waited for at most this long from its run's read of the input, whatever its engine still
# generates (`InferenceCall.answer_deadline`): under the task's time limit (`services.RUN_TIME_LIMIT_S`), with
# time left for the files' assembly. Past it the line fails for good (`answer_wait_exceeded`): run again, it
# would be computed again and given up on again, unbilled, in every run until the batch expires.
LINES_END_WITHIN_S = 720.0
# A line starts only this long before `LINES_END_WITHIN_S` at the latest (the old fixed read timeout): one that
# fails for good at it has been waited for that long at least, never cut short for starting late in a run that
# spent its time reading the batch.
LINE_MIN_WAIT_S = 600.0

REPLAY_JOURNAL_FOR_S = 10.0  # at a run's end, the most it waits to replay usage journaled in this worker

# A line whose call the engine failed (an HTTP 500 of its own, or its connection closed unanswered, the engine dead on
# it, its replica still READY: `errors.EngineFailed`) this many
# times, the first and the last at least `ENGINE_FAILURES_MIN_SPAN_S` apart, fails for good, `upstream_error` in the
# error file. NOTE: such a request fails there again and again (a lone surrogate in `stop` did, before the gateway
# refused one): tried again every `RETRY_PAUSE_S` it was, for every run's slice until the batch expired, a day. A replica
# that went away (refused, reset: a drain, a scale-down, a node lost) is not counted: its line waits for another as
# before. Between tries a line holds no slot and no reservation, and waits `engine_failure_pause_s`.
MAX_ENGINE_FAILURES = 5
# NOTE: an engine that fails every request for a few seconds (a CUDA error it recovers from, a restart under way) is not
# the line's fault: counted alone, 500s for 6 s failed 2 of 3 healthy lines for good (5 tries, a second apart). The
# count and the first failure's time are kept in Redis across runs (`batch_engine_failures_key`), until the batch's
# window ends; a Redis that lost them only starts the count again.
ENGINE_FAILURES_MIN_SPAN_S = 60.0
ENGINE_FAILURE_MAX_PAUSE_S = 30.0  # the longest wait between tries of a line its engine failed


def outage_retry_pause_s(num_away_checks: int) -> float:
    """How long a run waits before its next check once `num_away_checks` checks in a row met PostgreSQL away (or a
    store did: 0)."""
    return min(OUTAGE_FIRST_RETRY_S * 2 ** min(max(num_away_checks - 1, 0), 16), CHECK_EVERY_S)


def engine_failure_pause_s(num_failures: int) -> float:
    """How long a line its engine failed `num_failures` times waits before its next try: `RETRY_PAUSE_S`, doubled at each
    failure, at most `ENGINE_FAILURE_MAX_PAUSE_S`."""
    return min(RETRY_PAUSE_S * 2 ** min(max(num_failures - 1, 0), 16), ENGINE_FAILURE_MAX_PAUSE_S)


async def count_engine_failure(batch_id: str, index: int, expires_at: float) -> tuple[int, float]:
    """Count a failure of line `index` at its engine (`errors.EngineFailed`): the number of them so far, across runs,
    and how long ago the first was, kept until `expires_at` (the batch's window's end).

    NOTE: the first's time is Redis's clock (`TIME`), read again by the run that counts the next: runs go to any
    worker, and one 10 minutes ahead of the worker that counted the first failures a moment before took them as 10
    minutes old (past `ENGINE_FAILURES_MIN_SPAN_S`) and failed the line for good at a blip of a few seconds."""
    key = batch_engine_failures_key(batch_id, index)
    client = get_async_redis()
    seconds, microseconds = await client.time()
    now = seconds + microseconds / 1_000_000
    async with client.pipeline(transaction=False) as pipe:  # one key: one run of a batch at a time
        pipe.hsetnx(key, "first_at", repr(now))
        pipe.hincrby(key, "num", 1)
        pipe.hget(key, "first_at")
        pipe.expire(key, max(1, int(expires_at - time.time()) + 1))  # NOTE: `expires_at` is on this process's clock
        _, num_failures, first_at, _ = await pipe.execute()
    return int(num_failures), now - float(first_at)


def line_request_id(batch_id: str, index: int) -> str:
    """The request id of a batch line: the same on every try (exactly-once usage)."""
    return f"{batch_id}-{index}"


@dataclass(slots=True, frozen=True)
class Work:
    batch_id: str
    organization_id: int
    endpoint_id: str  # the batch's endpoint (`Batch.endpoint`): another that took its name once it was deleted is not it
    model: str
    kind: str
    request_path: str
    caller: Caller
    price_fraction: Decimal
    target_concurrency: int
    expires_at: float  # unix time on this process's clock (`services._on_this_clock`): no line starts after it


def _row_around(batch_id: str, line: Line, status_code: int, request_id: str) -> tuple[bytes, bytes]:
    """What goes before and after a line's answer in its row (`answer_row`)."""
    head = json.dumps({"id": f"batch_req_{batch_id.removeprefix('batch_')}_{line.index}", "custom_id": line.custom_id,
                       "response": {"status_code": status_code, "request_id": request_id, "body": None},
                       "error": None})
    # NOTE: the body goes in as it came, in place of the `null` written for it: a 64 MiB answer written again
    # from its parsed objects took ~8 times its size.
    start = head.rindex(', "body": null}') + len(', "body": ')
    return head[:start].encode(), head[start + len("null"):].encode()


def answer_row(batch_id: str, line: Line, status_code: int, request_id: str, body: bytes) -> bytes:
    """The line as OpenAI writes it to the output (or error) file, one JSON text on one line, `body` (the answer's JSON
    text, on one line: `json_text`) its response's body."""
    head, tail = _row_around(batch_id, line, status_code, request_id)
    return b"".join((head, body, tail))


@dataclass(slots=True, frozen=True)
class LineOutcome:
    line: Line
    status_code: int
    # its row of the output (or error) file (`answer_row`): the one copy of its answer the line keeps, made in the loop
    # (the answer was kept, and its row made beside it in the thread storing it: two copies a line, many lines at once),
    # or read from the file its answer is in when it is stored (one larger than a worker keeps in memory: `spool`)
    row: bytes | spool.SpooledRow
    retry: bool = False
    engine_failed: bool = False  # its call failed at the engine itself (`errors.EngineFailed`)


def error_row(batch_id: str, index: int, custom_id: str | None, *, code: str, message: str) -> bytes:
    """The error file's row of a line that has no answer to give (never run, or its answer not kept), as OpenAI
    writes one (`custom_id` None: unknown, its input gone)."""
    return json.dumps({"id": f"batch_req_{batch_id.removeprefix('batch_')}_{index}", "custom_id": custom_id,
                       "response": None, "error": {"code": code, "message": message}}).encode()


@dataclass(slots=True, frozen=True)
class Stored:
    """What `store` did with a finished line: whether it counts as completed, and why the run should stop starting
    lines ("" to go on)."""

    ok: bool
    stop: str = ""
    kept: bool = True  # False: not stored at all (the run lost its lease), counted neither completed nor failed


def _dropped(pairs: list) -> None:
    return None


UTF8_CHECKED_BYTES = 1024 * 1024  # an answer's UTF-8 is checked this many bytes at a time (`json_text`)


def _utf8(data: bytes) -> bool:
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(data)
    try:
        for start in range(0, len(view), UTF8_CHECKED_BYTES):
            decoder.decode(view[start:start + UTF8_CHECKED_BYTES], final=start + UTF8_CHECKED_BYTES >= len(view))
    except UnicodeDecodeError:
        return False
    return True


def json_text(data: bytes) -> bytes | None:
    """`data` if it is one JSON text in UTF-8, on one line (line ends between its tokens taken out), or None.

    NOTE: checked without building it, with one copy of its size beside it: each object is dropped as it closes
    (`object_pairs_hook`), so what is held is one object's fields and the arrays of plain values around it, not the
    answer's ~8 times its size in objects; and its text is read as Latin-1, a character a byte, its UTF-8 checked
    apart a piece at a time (JSON's own characters are ASCII, which no byte of a longer UTF-8 character is): decoded
    whole, an answer with one emoji took 4 bytes a character, a 64 MiB answer 256 MiB. The same `data` is returned
    when it is on one line already (no copy)."""
    if not data.isascii() and not _utf8(data):
        return None
    try:
        json.loads(str(data, "latin-1"), object_pairs_hook=_dropped)
    except (ValueError, RecursionError):
        return None
    if b"\n" in data or b"\r" in data:  # outside its strings (where JSON allows no raw control character): spacing
        data = data.translate(None, b"\r\n")
    return bytes(data)


@dataclass(slots=True)
class Progress:
    num_completed: int
    num_failed: int
    # why the run stopped starting lines: "cancel", "lease", "slice", "expired", "cold", "full", "quota", "gone",
    # "outage" (PostgreSQL away: `run`), "unstored" (lines answered, their answers not stored: the batch must not end),
    # "no_room" (the process's answer bytes held by its other runs for `BATCH_NO_ROOM_GIVE_UP_S`, none by this run)
    stopped: str = ""
    # unix times: since when every try has been refused (a transient refusal, left pending), None once a line finished
    # after it; and the last refusal (`Batch.refused_since`, `Batch.last_refused_at`: `scheduling.stalled`)
    refused_since: float | None = None
    last_refused_at: float | None = None
    # the lines this run kept in flight over the last `scheduling.USE_WINDOW_S`, none refused (`scheduling.LineUse`),
    # at the unix time `line_concurrency_at`; None until it started a line (`Batch.line_concurrency`)
    line_concurrency: float | None = None
    line_concurrency_at: float | None = None

    def refused(self) -> None:
        now = time.time()
        # NOTE: refusals with no try for `STALL_S` between them are two streaks: a transient 503 hours ago, the endpoint
        # asleep since, must not make the first refusal after its wake read as a stall (its replica let go at once)
        if self.refused_since is None or self.last_refused_at is None or now - self.last_refused_at >= scheduling.STALL_S:
            self.refused_since = now
        self.last_refused_at = now

    def finished(self) -> None:
        self.refused_since = None


class _Capture:
    """The ASGI `send` of a batch line: keeps the status and the body (handed whole by `InferenceCall`: kept as it
    came, not copied)."""

    def __init__(self):
        self.status = 0
        self.pieces: list[bytes] = []

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body" and message.get("body"):
            self.pieces.append(message["body"])

    def take_body(self) -> bytes:
        pieces, self.pieces = self.pieces, []
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


async def _never_disconnects() -> dict:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


async def _route(work: Work, endpoint: directory.EndpointInfo, request: InferenceRequest,
                 ) -> tuple[directory.EndpointInfo, InferenceRequest, directory.AdapterInfo | None]:
    """The endpoint (priced for the adapter), the request and the adapter a line's `model` names, as the gateway
    resolves a call's (the adapter's name for the engine), or the 404 of an adapter the batch's endpoint no longer has
    (deleted since the batch's check: this line fails, not the batch).

    NOTE: the endpoint is the batch's own, `endpoint` (`Work.endpoint_id`, read by the run every second), never the
    one the line's endpoint part names now: the batch's check found it named the batch's endpoint, and after a rename
    its old name named none (every line left failed `model_not_found`) or another endpoint."""
    names = parse_model_name(request.model)
    if names is None:
        raise errors.model_not_found(request.model)
    adapter_name = names[1]
    if not adapter_name:
        # NOTE: renamed, its engines serve its new name (a rename restarts them: `ENGINE_FIELDS`)
        return endpoint, request if names[0] == endpoint.name else replace(request, engine_model=endpoint.name), None
    adapter = (await directory.endpoint_adapters(endpoint.id)).get(adapter_name)
    if adapter is None:
        # NOTE: the cached adapter list (`directory.endpoint_adapters`) may predate an adapter the batch's check found:
        # read again before the 404, which fails the line for good
        adapter = (await directory.endpoint_adapters(endpoint.id, fresh=True)).get(adapter_name)
    if adapter is None:
        raise errors.model_not_found(request.model)
    await _refuse_unless_held(endpoint, adapter)
    # NOTE: priced from the run's endpoint, read again every second (its engine generation), as the gateway prices it
    return adapter.priced(endpoint), replace(request, engine_model=adapter.name), adapter


async def _refuse_unless_held(endpoint: directory.EndpointInfo, adapter: directory.AdapterInfo) -> None:
    """Nothing if a READY replica holds `adapter`; else the line's refusal before it is admitted (no reservation, no
    slot, no hold: a batch line is never held through a load, as through a cold start): an adapter an engine refused
    fails the line (400 `adapter_failed`, its reason: `adapter_hold.refuse_if_failed`, the gateway's rule); one not
    loaded yet, or failed for a passing reason its agent tries again (`failure_retried`), is asked for and the line
    tried again later (503, as no slot now). NOTE: before, each line waited
    `cold_start_timeout_s` holding its reservation and a slot, then was tried again until the batch expired, a FAILED
    adapter's for ever."""
    replicas = await directory.ready_replicas(endpoint.id, generation=endpoint.engine_generation)
    if adapter_hold.held_by(adapter, replicas):
        return
    await adapter_hold.refuse_if_failed(endpoint, adapter)
    await adapter_hold.want(adapter)
    raise errors.OpenAIError(503, f"The adapter '{adapter.name}' is not loaded yet.", type="server_error",
                             code="adapter_loading")


async def run_line(work: Work, endpoint: directory.EndpointInfo, line: Line, client: upstream.UpstreamClient,
                   answer_deadline: float | None = None, answer: answer_bytes.LineAnswer | None = None) -> LineOutcome:
    """Run one line; its answer's bytes are counted by `answer` from the first read (`answer_bytes`), then as its row
    (`LineAnswer.keep`) until the caller releases it.

    NOTE: the answer's check (`json_text`) and its row are made here, in the run's event loop, one line at a time: the
    copies each takes beside the answer are never made by many lines at once."""
    request_id = line_request_id(work.batch_id, line.index)
    answer = answer or answer_bytes.LineAnswer()
    capture = _Capture()
    engine_failed = False
    try:
        request = replace(InferenceRequest.parse(json.dumps(line.body).encode(), kind=work.kind, path=work.request_path),
                          priority=scheduling.BATCH_ENGINE_PRIORITY)
        priced, request, adapter = await _route(work, endpoint, request)
        call = InferenceCall(request_id=request_id, request=request, caller=work.caller, endpoint=priced, client=client,
                             receive=_never_disconnects, send=capture.send, started_at=clock.redis_datetime(),
                             batch_id=work.batch_id, price_fraction=work.price_fraction, answer_deadline=answer_deadline,
                             answer_holding=answer, adapter=adapter)
        await call.run()
    except errors.OpenAIError as exc:
        # NOTE: a request past its key's whole minute of tokens is OpenAI's 429, which no retry admits: failed for good
        status, body = exc.status, exc.body()
        retry = exc.status in RETRY_STATUSES and not isinstance(exc, errors.RequestTooLarge)
        engine_failed = isinstance(exc, errors.EngineFailed)
    except Exception as exc:
        if not errors.is_outage(exc):
            raise
        errors.log_outage(logger, exc, "batch line %s: %s", request_id, repr(exc))  # a string (`_through_outages`)
        status, body, retry = 503, errors.service_unavailable().body(), True
    else:
        status, retry = capture.status or 502, capture.status in RETRY_STATUSES
        if answer.kept_on_disk and not retry:
            # NOTE: checked a piece at a time in a worker thread (never whole in memory), its row read from the file
            # when it is stored
            if await asyncio.to_thread(answer.spool.check_and_clean):
                head, tail = _row_around(work.batch_id, line, status, request_id)
                answer.keep(0)  # none of it in memory
                return LineOutcome(line, status, spool.SpooledRow(head, answer.spool, tail))
            body = None
        else:
            body = json_text(capture.take_body() or b"{}")
        if body is None:
            body = json.dumps({"error": {"message": "The engine's answer was not JSON.",
                                         "type": "server_error"}}).encode()
    if answer.spool is not None and answer.spool.failed is not None and status == 400:
        # NOTE: the worker's disk refused the answer (full): not the line's fault, tried again (its usage row, written
        # once under its request id, is not written again)
        logger.warning("batch line %s: its answer could not be spooled: %r", request_id, answer.spool.failed)
        status, body, retry = 503, errors.service_unavailable().body(), True
    row = answer_row(work.batch_id, line, status, request_id, body)
    del body  # NOTE: the row is the one copy of the answer the line keeps from here on
    answer.keep(len(row))
    return LineOutcome(line, status, row, retry=retry, engine_failed=engine_failed)


# A run that could start no line for this long (every slot of the endpoint's READY replicas taken by interactive
# calls) stops: it held a batch worker doing nothing for its whole slice, one tenant's many batches every worker.
NO_SLOT_GIVE_UP_S = 10.0


async def free_slots(organization_id: int, endpoint_id: str, *, target_concurrency: int,
                     num_batch_in_flight: int = 0) -> int | None:
    """Slots batch lines may use now on the endpoint's READY replicas; None when none is READY."""
    replicas = await directory.ready_replicas(endpoint_id)
    if not replicas:
        return None
    counts = await get_async_redis().mget([outstanding_key(organization_id, r.id) for r in replicas])
    return scheduling.batch_slots(num_ready=len(replicas), target_concurrency=target_concurrency,
                                  num_outstanding=sum(int(c or 0) for c in counts), num_batch_in_flight=num_batch_in_flight)


def _through_outages(keep_going: Callable[[Progress], str]) -> Callable:
    """`keep_going` (`run`) in a worker thread, its connection checked before and after (`in_worker_thread`); "outage"
    (no line starts) while PostgreSQL is away, instead of its error.

    NOTE: the error ended the run: a PostgreSQL restart of a second cut every line in flight mid-answer, each run again
    (its GPU work twice) by the next run. Now they finish and are kept; the lease is PostgreSQL's, which no other run
    can take while it is away."""
    checked = in_worker_thread(keep_going)

    async def check(progress: Progress) -> str:
        try:
            return await checked(progress)
        except DATABASE_AWAY as exc:
            # NOTE: logged as a string: a record that kept the exception (a handler, pytest's capture) kept, through
            # its traceback's frames, the worker thread's connection open for good (the test database never dropped)
            logger.warning("batch run: PostgreSQL is away (%s): no line starts until it is back", repr(exc))
            return "outage"

    return check


class _Pending:
    """The lines still to start: those to try again first (one its engine failed once its pause is over), then the
    input's next, read one ahead in a worker thread (the input comes from S3 a part at a time) while the run goes on. NOTE: never awaited in the run's loop: a slow
    read (S3 retrying, a long skip over the lines done) held up the lease's renewal and the run's checks, and the
    batch was taken over with its lines in flight. An error reading the input ends the reads; it is raised once the
    lines that run have ended (`raise_failure`)."""

    def __init__(self, fresh: Iterator[Line]):
        self._fresh = fresh
        self._again: deque[Line] = deque()
        self._later: list[tuple[float, int, Line]] = []  # lines to try again from a time (monotonic): a heap
        self._next: Line | None = None
        self.reading: asyncio.Future | None = None  # the read under way
        self._ended = False
        self.failure: Exception | None = None

    def read_ahead(self) -> None:
        """Keep a finished read's line; start the next read if no line waits and none is under way."""
        if self.reading is not None and self.reading.done():
            reading, self.reading = self.reading, None
            try:
                line = reading.result()
            except Exception as exc:  # raised by `raise_failure` once what runs has ended
                self.failure, self._ended = exc, True
            else:
                self._next, self._ended = line, line is None
        if self._next is None and self.reading is None and not self._ended:
            self.reading = asyncio.ensure_future(asyncio.to_thread(next, self._fresh, None))

    def ready(self) -> bool:
        while self._later and self._later[0][0] <= time.monotonic():
            self._again.append(heapq.heappop(self._later)[2])
        return bool(self._again) or self._next is not None

    def __bool__(self) -> bool:  # a line may still come
        return self.ready() or bool(self._later) or not self._ended

    def take(self) -> Line:
        if self.ready() and self._again:
            return self._again.popleft()
        line, self._next = self._next, None
        self.read_ahead()
        return line

    def again(self, line: Line, *, not_before: float = 0.0) -> None:
        """Try `line` again, not before `not_before` (monotonic)."""
        if not_before > time.monotonic():
            heapq.heappush(self._later, (not_before, line.index, line))
        else:
            self._again.append(line)

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure


async def run(work: Work, todo: Iterator[Line], progress: Progress, *, slice_s: float,
              keep_going: Callable[[Progress], str], store: Callable[[LineOutcome], Stored],
              lines_end_by: float | None = None) -> Progress:
    """Run `todo` (read as lines start) until done, stopped or out of time: lines start for `slice_s` and every line
    ends within `LINES_END_WITHIN_S`, both from the first line's start, and by `lines_end_by` (monotonic).
    `keep_going(progress)` (sync, ORM: renews the lease, writes the counts) returns "" to go on, or why to stop
    starting lines; `store` keeps a finished line, and may stop the run's starts (`Stored.stop`). An error reading
    `todo` stops the run's starts and is raised once its lines in flight have ended and been kept."""
    endpoint = await directory.find_endpoint(work.organization_id, work.model)
    if endpoint is None or endpoint.id != work.endpoint_id:
        progress.stopped = "gone"
        return progress
    check = _through_outages(keep_going)
    store = connections_checked(store)
    # NOTE: one beat before any line: it ends in Redis what an earlier run in this process left unended
    # (`presence.end_later`), before a line of the same id (a retry) is admitted again and confused with it.
    await presence.start()
    usage_writer.writer_for_this_loop().replay_soon()  # usage an earlier run (or a dead worker) journaled
    pending = _Pending(todo)
    # each line's answer counted against the process's bound (`answer_bytes`) from its first byte read until it is
    # stored, tried again or the run ends
    running: dict[asyncio.Task, tuple[Line, answer_bytes.LineAnswer]] = {}
    # NOTE: a finished line's result goes to S3 in a worker thread, never awaited in the loop: a put S3 was slow to
    # answer (boto3 retrying) held up the lease's renewal as a slow read did. Counted once stored.
    storing: dict[asyncio.Future, tuple[LineOutcome, answer_bytes.LineAnswer]] = {}
    # NOTE: finished lines whose store met PostgreSQL away, stored again after the next check that reached it: dropped
    # for the next run to run again, the line was lost (billed, in no file) when this run ended the batch (its endpoint
    # deleted, a cancel), as no run could run it again
    unstored: list[tuple[LineOutcome, answer_bytes.LineAnswer]] = []
    # NOTE: from the first line's start: a slow read of the input (S3, a long skip) is not counted against the lines
    ends_at = answer_deadline = None
    last_check, pause_until = 0.0, 0.0
    # NOTE: since when PostgreSQL is away (a check or a store met it), and the checks in a row that met it: no line
    # starts meanwhile, and past `BATCH_OUTAGE_RETRY_S` none for the rest of the slice. Before, a blip of a second
    # ended the slice's starts at once: the batch waited for the next tick and a free worker.
    away_since: float | None = None
    num_away_checks = 0
    renewed_at = time.monotonic()  # the lease's last renewal (about: its long-step hold came just before the run)
    no_slot_since: float | None = None  # since when no line could start and none ran
    # NOTE: since when the reads of free slots fail (PostgreSQL away, or a statement timeout, a deadlock: not met by the
    # checks), and those in a row: read again after `outage_retry_pause_s`, and past `BATCH_OUTAGE_RETRY_S` from the
    # first no line starts for the rest of the slice. Before, each failed read started the give-up's clock again and each
    # check that succeeded cleared it: a read that kept failing held the worker for its slice, a warning every 0.4 s.
    read_failing_since: float | None = None
    num_failed_reads, read_again_at = 0, 0.0
    no_room_since: float | None = None  # since when no line could start for the process's answer bytes, none its own
    # NOTE: a line's engine is first asked whether it still generates after this long of silence: at most the wait
    # a line is sure of, so that `LINES_END_WITHIN_S` holds whatever `GATEWAY_UPSTREAM_READ_TIMEOUT_S` is.
    client = upstream.UpstreamClient(read_timeout_s=min(settings.GATEWAY_UPSTREAM_READ_TIMEOUT_S, LINE_MIN_WAIT_S))
    latest_end = lines_end_by if lines_end_by is not None else float("inf")
    answer_bytes.run_started(work.batch_id)
    line_use: scheduling.LineUse | None = None  # from the first line's start
    started_at: dict[asyncio.Task, float] = {}  # each running line's start (monotonic)
    # NOTE: a line refused 402 (the cap or credit left) while other lines of this run were in flight may have been
    # refused for their reservations alone, which their ends give back: it waits for them to end and is tried once
    # more, alone (`waiting_alone`, then `tried_alone`); refused so, it fails for good. Failed at once, a batch whose
    # lines in flight reserved past the cap lost every line refused meanwhile, though they all fit its real spend.
    started_with_company: dict[asyncio.Task, bool] = {}
    waiting_alone: set[int] = set()
    tried_alone: set[int] = set()
    running_alone: set[asyncio.Task] = set()  # such a line's try alone: no line starts beside it till it ends

    def measure() -> None:  # what each check writes: the lines kept in flight of late
        if line_use is not None:
            progress.line_concurrency = line_use.concurrency(time.monotonic(), list(started_at.values()))
            progress.line_concurrency_at = time.time()

    try:
        while pending or running or storing or unstored:
            pending.read_ahead()
            now = time.monotonic()
            if now - last_check >= (CHECK_EVERY_S if away_since is None else outage_retry_pause_s(num_away_checks)):
                # NOTE: also while the last lines finish after a stop: the lease must outlive them.
                last_check = now
                measure()
                reason = await check(progress)  # "outage" while PostgreSQL is away
                if reason != "outage":
                    renewed_at = now
                    if unstored:
                        # NOTE: no line starts until a store tried again succeeds (below): a store that keeps failing
                        # while the checks succeed (a statement timeout, a lock on one row) started lines whose answers
                        # could not be stored, for the whole slice
                        num_away_checks += 1
                    else:
                        away_since, num_away_checks = None, 0
                    for outcome, answer in unstored:  # PostgreSQL reached: their stores tried again
                        storing[asyncio.ensure_future(asyncio.to_thread(store, outcome))] = outcome, answer
                    unstored.clear()
                elif now - renewed_at >= settings.BATCH_LEASE_S:
                    # NOTE: the lease lapsed during the outage: another run may hold the batch as PostgreSQL returns
                    # (its lines are its own: this run's answers are not stored, `store`)
                    reason = "lease"
                    progress.stopped = "lease" if progress.stopped == "outage" else progress.stopped
                else:
                    away_since = now if away_since is None else away_since
                    num_away_checks += 1
                    if now - away_since < settings.BATCH_OUTAGE_RETRY_S:
                        reason = ""  # checked again soon: a blip ends no slice
                # NOTE: read again: a change to what its engines start with (`Endpoint.engine_generation`) refuses the
                # lines of the configuration read before it (a 503, tried again), for the rest of the slice had the run
                # kept it.
                try:
                    found = await directory.find_endpoint(work.organization_id, work.model)
                except DATABASE_AWAY:
                    # NOTE: PostgreSQL away past the directory's cache and its stale grace (7 s): the endpoint in hand
                    # is kept. Raised, it ended the run, its lines in flight cut and run again (GPU work twice).
                    found = endpoint
                if found is None or found.id == work.endpoint_id:
                    endpoint = found or endpoint
                elif not progress.stopped:
                    progress.stopped = "gone"  # its name is another endpoint's now: no line starts
                # a line starts only while it has `LINE_MIN_WAIT_S` left to be waited for
                starts_until = (latest_end - LINE_MIN_WAIT_S if ends_at is None
                                else min(ends_at, answer_deadline - LINE_MIN_WAIT_S))
                if not progress.stopped:
                    progress.stopped = reason or ("slice" if now >= starts_until else "") or (
                        "expired" if time.time() >= work.expires_at else "")
            # NOTE: past the process's bound of answer bytes no line starts (those running may still answer: each
            # reads on once bytes are given back, or alone)
            if (not progress.stopped and away_since is None and pending.ready() and now >= max(pause_until, read_again_at)
                    and answer_bytes.room()):
                # NOTE: none while the usage journal is past its limit (PostgreSQL took no writes for a while): a
                # line's row could only go to it, as an interactive call's, which the gateway refuses then.
                try:
                    slots = await free_slots(work.organization_id, endpoint.id,
                                             target_concurrency=work.target_concurrency,
                                             num_batch_in_flight=len(running)) if usage_writer.usage_recordable() else 0
                except DATABASE_AWAY as exc:
                    # NOTE: PostgreSQL away since the last check, the replicas past the directory's cache (never read
                    # in this run: no room till now), or the read alone failing: no line starts until a read succeeds
                    # (`read_failing_since`). Raised, it ended the run, its lines in flight cut and run again (GPU work
                    # twice).
                    logger.warning("batch %s: its endpoint's replicas could not be read (%s): no line starts until "
                                   "PostgreSQL answers", work.batch_id, repr(exc))  # a string (`_through_outages`)
                    read_failing_since = now if read_failing_since is None else read_failing_since
                    num_failed_reads += 1
                    read_again_at, slots = now + outage_retry_pause_s(num_failed_reads), 0
                    if now - read_failing_since >= settings.BATCH_OUTAGE_RETRY_S:
                        progress.stopped = "outage"
                else:
                    read_failing_since, num_failed_reads = None, 0
                if read_failing_since is None:  # NOTE: else nothing was read: neither "cold" nor a wait for a slot
                    if slots is None and not running:
                        progress.stopped = "cold"  # nothing warm: batch work never wakes an endpoint here
                    if slots or running:
                        no_slot_since = None
                    elif no_slot_since is None:
                        no_slot_since = now
                    elif now - no_slot_since >= NO_SLOT_GIVE_UP_S:
                        progress.stopped = "full"  # the worker goes back to the queue: other batches may use it
                for _ in range(max(0, (slots or 0) - len(running))):
                    if not pending.ready() or not answer_bytes.room():  # NOTE: each takes the room of its first read
                        break
                    if (waiting_alone or running_alone) and running:
                        break  # a line refused for the reservations in flight waits for them to end, and runs alone
                    if answer_deadline is None:
                        ends_at, answer_deadline = now + slice_s, min(now + LINES_END_WITHIN_S, latest_end)
                    line, answer = pending.take(), answer_bytes.LineAnswer()
                    task = asyncio.create_task(run_line(work, endpoint, line, client, answer_deadline, answer))
                    started_with_company[task] = bool(running)
                    running[task], started_at[task] = (line, answer), now
                    line_use = line_use or scheduling.LineUse(began_at=now)
                    if line.index in waiting_alone:
                        waiting_alone.discard(line.index)
                        tried_alone.add(line.index)
                        running_alone.add(task)
                        break  # alone: its refusal now is not this run's doing
            if progress.stopped or not pending.ready() or running or storing or unstored or answer_bytes.room():
                no_room_since = None
            elif no_room_since is None:
                no_room_since = now
            elif now - no_room_since >= settings.BATCH_NO_ROOM_GIVE_UP_S:
                # NOTE: the bytes are held by the process's other runs (in threads: a prefork child runs one), or
                # leaked since this run started (one leaked before is forgotten as a run starts alone, `run_started`):
                # waited for with no bound, a leak held this run's worker slot until its task's time limit
                logger.error("batch %s: no line could start for %.0f s: this process's batch lines hold %d bytes of "
                             "answers (INFERPLANE_BATCH_ANSWER_BYTES %d), none of them this run's: held by its other "
                             "runs, or leaked while this one ran; its lines wait for a later run", work.batch_id,
                             now - no_room_since, answer_bytes.held_bytes(), settings.BATCH_ANSWER_BYTES)
                progress.stopped = "no_room"
            if not running and not storing:
                # NOTE: answers left unstored are tried again at each check until the run's lines must have ended
                if (progress.stopped or not pending) and (not unstored or now >= latest_end):
                    break
                if pending.reading is not None:
                    await asyncio.wait([pending.reading], timeout=0.2)
                else:
                    await asyncio.sleep(0.2)
                continue
            done, _ = await asyncio.wait([*running, *storing], timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task in storing:
                    outcome, answer = storing.pop(task)
                    try:
                        stored = task.result()  # a put S3 refused ends the run: the next one runs the line again, under its id
                    except DATABASE_AWAY as exc:
                        # NOTE: PostgreSQL away as its answer's room was counted (`store`): kept, and stored again once
                        # it is back (`unstored`); raised, it ended the run, its other lines cut mid-answer
                        logger.warning("batch %s: a line's answer could not be stored yet (%s)",
                                       work.batch_id, repr(exc))  # a string, not the exception (`_through_outages`)
                        unstored.append((outcome, answer))
                        away_since = time.monotonic() if away_since is None else away_since  # no start till checked
                        continue
                    except BaseException:
                        # NOTE: popped, so not among those the run gives back as it ends: a put S3 refused kept its
                        # bytes held for the process's life, and a later run of a small bound started no line, forever
                        answer.release()
                        raise
                    answer.release()
                    if not unstored:
                        away_since, num_away_checks = None, 0  # stored: PostgreSQL takes answers again
                    if stored.kept and stored.ok:
                        progress.num_completed += 1
                    elif stored.kept:
                        progress.num_failed += 1
                    if stored.kept:
                        progress.finished()
                    if stored.stop and not progress.stopped:
                        progress.stopped = stored.stop
                    continue
                line, answer = running.pop(task)
                line_started_at = started_at.pop(task)
                with_company = started_with_company.pop(task) or bool(running)
                running_alone.discard(task)
                try:
                    outcome = task.result()
                except BaseException:
                    answer.release()
                    raise
                if outcome.status_code == 402 and with_company and line.index not in tried_alone:
                    answer.release()
                    progress.refused()
                    waiting_alone.add(line.index)
                    pending.again(line)
                    continue
                not_before = 0.0
                if outcome.engine_failed:
                    num_failures, failed_for_s = await count_engine_failure(work.batch_id, line.index, work.expires_at)
                    if num_failures >= MAX_ENGINE_FAILURES and failed_for_s >= ENGINE_FAILURES_MIN_SPAN_S:
                        logger.warning("batch %s line %d: its engine failed it %d times in %.0f s; not tried again",
                                       work.batch_id, line.index, num_failures, failed_for_s)
                        outcome = replace(outcome, retry=False)  # its 502 `upstream_error`, kept in the error file
                    else:
                        not_before = time.monotonic() + engine_failure_pause_s(num_failures)
                if outcome.retry:
                    # NOTE: its try alone is spent only by a 402 (above, or failed below): one that met a transient
                    # refusal (a 503, a 429) is not, and its next 402 beside other lines waits to run alone again
                    tried_alone.discard(line.index)
                    answer.release()
                    progress.refused()
                    pending.again(line, not_before=not_before)
                    pause_until = time.monotonic() + RETRY_PAUSE_S
                    continue
                line_use.ended(line_started_at, time.monotonic())
                # NOTE: its thread's connection checked before and after (`connections_checked`): Django checks them
                # only around requests, and one a PostgreSQL restart cut stayed in its thread, broken
                storing[asyncio.ensure_future(asyncio.to_thread(store, outcome))] = outcome, answer
            # NOTE: a line's task holds its outcome (its row) as long as the task is named: not till the next ends
            done = task = outcome = None
    finally:
        # NOTE: a run that ends with lines running or storing (an error) gives their bytes back: the process runs others
        try:
            for _, answer in [*running.values(), *storing.values(), *unstored]:
                answer.release()
        finally:
            answer_bytes.run_ended()
        if unstored:
            # NOTE: never ended by this run (`services.run_batch`): the next runs them again, under their ids
            logger.warning("batch %s: %d line(s) answered but not stored: the next run runs them again",
                           work.batch_id, len(unstored))
            progress.stopped = "unstored"
        await client.close()
        await usage_writer.replay_before_the_loop_ends(REPLAY_JOURNAL_FOR_S)
    measure()
    await check(progress)  # the last counts
    pending.raise_failure()
    return progress
