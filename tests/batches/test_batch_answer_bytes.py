"""The bytes of line answers a batch worker holds are bounded across its lines in flight (`answer_bytes`).

Before: a run kept as many lines in flight as its endpoint had spare slots, each holding its answer (up to 64 MiB) two
or three times while it was read, checked and written, and nothing bounded them together: a few lines answering at once
took a batch worker (1 GiB, four runs) past its memory limit, with every run in it."""

from __future__ import annotations

import asyncio
import json
import os
import tracemalloc

import httpx
import pytest

from billing.models import UsageRecord
from endpoints.batches import answer_bytes, runner, services, storage
from endpoints.batches.models import Batch, BatchStatus
from endpoints.gateway import upstream
from tests.batches.conftest import logprob_lines, new_batch, run_in_a_thread
from tests.gateway.conftest import serve_endpoint

MiB = 2**20


class _Connection:
    """What `answer_bytes` sees of an upstream connection: it pauses when told to, resumes, and hands an answer too
    large to hold in memory on (to its holding's spool, or dropped)."""

    def __init__(self):
        self.loop = None
        self.paused = self.closed = self.dropped = False
        self.kept = None  # where the rest of its answer goes, past the largest held in memory

    def resume(self):
        self.paused = False

    def drop_whole_answer(self, keep=None):
        self.dropped = True
        self.kept = keep


def _read(answer: answer_bytes.LineAnswer, connection: _Connection, num_bytes: int) -> None:
    """`num_bytes` more read on `connection`, paused as `upstream` pauses it."""
    if answer.take(num_bytes, connection):
        connection.paused = True


BOUND = 8 * MiB
READ = 256 * 1024  # the most a connection reads at a time (`answer_bytes.READ_BYTES`)


@pytest.fixture
def bound(settings):
    settings.BATCH_ANSWER_BYTES = BOUND
    settings.BATCH_SPOOL_BYTES = 2 * upstream.MAX_WHOLE_BODY_BYTES
    assert answer_bytes.held_bytes() == 0
    yield
    try:
        assert answer_bytes.held_bytes() == 0, "a line's bytes were never given back"
        assert answer_bytes.num_spooled() == 0, "a line's spool was never given back"
    finally:
        answer_bytes._budget.__init__()


def test_the_largest_answer_is_half_the_bound_and_never_past_the_gateways_own_limit(settings):
    settings.BATCH_ANSWER_BYTES = 32 * MiB
    assert answer_bytes.largest_answer_bytes() == 16 * MiB
    assert answer_bytes.largest_answer_bytes(1024 * MiB) == upstream.MAX_WHOLE_BODY_BYTES


def test_a_lines_answer_counts_once_from_before_its_first_byte_until_it_is_released(bound):
    assert answer_bytes.READ_BYTES == READ
    answer, connection = answer_bytes.LineAnswer(), _Connection()
    assert answer_bytes.held_bytes() == READ  # the room of its first read, taken before it
    _read(answer, connection, 3 * MiB)
    _read(answer, connection, 1 * MiB)
    assert answer_bytes.held_bytes() == 4 * MiB + READ  # and of its next
    answer.done_reading()
    assert answer_bytes.held_bytes() == 4 * MiB
    answer.sent(4 * MiB)  # handed to the line's own `send`, which keeps it: still held, counted once
    answer.close()
    assert answer_bytes.held_bytes() == 4 * MiB
    answer.keep(4 * MiB + 200)  # its row, in place of the engine's bytes
    assert answer_bytes.held_bytes() == 4 * MiB + 200
    answer.release()
    answer.release()
    assert answer_bytes.held_bytes() == 0


def test_a_line_starts_only_with_the_room_of_its_first_read(bound):
    """Before, a line's first read came in before its connection could be paused, in no bound: many lines in flight,
    answering at once, each held one past it."""
    answers = []
    while answer_bytes.room() and len(answers) < 100:
        answers.append(answer_bytes.LineAnswer())
    starts_below = BOUND - answer_bytes.largest_answer_bytes() - READ
    assert len(answers) == starts_below // READ - 1
    assert answer_bytes.held_bytes() == len(answers) * READ
    answers[0].release()
    assert answer_bytes.room()
    for answer in answers:
        answer.release()


def test_past_half_the_bound_no_line_starts_one_answer_reads_on_within_it_and_the_others_wait(bound):
    first, second, third = (answer_bytes.LineAnswer() for _ in range(3))
    connections = [_Connection() for _ in range(3)]
    _read(first, connections[0], 2 * MiB)
    _read(second, connections[1], 1 * MiB + READ)  # past half the bound: read on, as the one reader
    assert not answer_bytes.room()
    _read(first, connections[0], 512 * 1024)  # another's read waits
    _read(third, connections[2], 64 * 1024)  # and a first one, its next read given no room
    assert [c.paused for c in connections] == [True, False, True]
    _read(second, connections[1], 2 * MiB + READ)  # the largest answer, in the half kept for it
    assert answer_bytes.held_bytes() <= BOUND
    second.done_reading()  # read whole: the next reads on only once what it holds is given back
    assert [c.paused for c in connections] == [True, False, True]
    second.release()  # stored: the one parked first reads on, one at a time
    assert [c.paused for c in connections] == [False, False, True]
    first.release()  # under half the bound again: the next parked reads on
    assert [c.paused for c in connections] == [False, False, False] and answer_bytes.room()
    third.release()
    assert not any(c.dropped for c in connections)


def test_an_answer_larger_than_the_largest_goes_on_to_disk_its_bytes_in_memory_given_back(bound):
    """Before, it failed with `response_too_large` (billed) though the same request succeeds outside a batch."""
    large, waiting = answer_bytes.LineAnswer(), answer_bytes.LineAnswer()
    connections = [_Connection(), _Connection()]
    _read(large, connections[0], 3 * MiB + READ)  # past half the bound: the one reader
    _read(waiting, connections[1], 1 * MiB)
    assert connections[1].paused
    _read(large, connections[0], 1 * MiB)  # past the largest: its bytes given back, the rest of it to its spool
    assert connections[0].dropped and not connections[0].paused
    assert connections[0].kept == large.spool.write and answer_bytes.num_spooled() == 1
    assert answer_bytes.held_bytes() == 1 * MiB + READ and not connections[1].paused
    large.give(4 * MiB)  # the connection hands its buffered bytes on (`upstream`): nothing more to give back
    _read(large, connections[0], 1 * MiB)  # nor to count
    large.spool.write(b"{}")
    large.done_reading()
    assert large.kept_on_disk and large.max_answer_bytes == upstream.MAX_WHOLE_BODY_BYTES
    large.keep(0)
    assert answer_bytes.held_bytes() == 1 * MiB + READ
    for answer in (large, waiting):
        answer.release()
    assert answer_bytes.num_spooled() == 0


def test_past_its_spools_an_answer_larger_than_the_largest_waits_for_one(bound, settings):
    settings.BATCH_SPOOL_BYTES = upstream.MAX_WHOLE_BODY_BYTES  # one at a time
    spooled, waiting = answer_bytes.LineAnswer(), answer_bytes.LineAnswer()
    connections = [_Connection(), _Connection()]
    _read(spooled, connections[0], 4 * MiB + 1)
    assert connections[0].dropped and answer_bytes.num_spooled() == 1
    _read(waiting, connections[1], 4 * MiB + 1)  # no spool left: it waits, its bytes held
    assert connections[1].paused and not connections[1].dropped
    assert answer_bytes.held_bytes() <= BOUND
    spooled.done_reading()
    spooled.keep(0)
    assert connections[1].paused
    spooled.release()  # stored: its spool given back, the one waiting reads on
    assert not connections[1].paused and not connections[1].dropped
    _read(waiting, connections[1], 64 * 1024)  # and goes on to disk with its next read
    assert connections[1].dropped and answer_bytes.num_spooled() == 1
    assert answer_bytes.held_bytes() == 0
    waiting.release()


def test_without_spools_an_answer_larger_than_the_largest_is_read_on_without_being_held(bound, settings):
    settings.BATCH_SPOOL_BYTES = 0
    large, other = answer_bytes.LineAnswer(), answer_bytes.LineAnswer()
    connections = [_Connection(), _Connection()]
    _read(large, connections[0], 4 * MiB + 1)
    assert connections[0].dropped and connections[0].kept is None and large.spool is None
    assert answer_bytes.held_bytes() == READ
    assert not large.kept_on_disk and large.max_answer_bytes == answer_bytes.largest_answer_bytes()
    large.keep(300)  # its error row
    for answer in (large, other):
        answer.release()


def test_answers_read_at_once_hold_within_the_bound_and_all_finish(bound):
    """Lines each answering the largest answer, read a piece at a time and stored a round after they are read whole.
    Before, each answer read on a piece past the bound before it could be paused: its first read, in no bound."""
    piece, largest = READ, BOUND // 2
    answers = []
    while len(answers) < 6 and answer_bytes.room():
        answers.append(answer_bytes.LineAnswer())
    connections = [_Connection() for _ in answers]
    num_read = [0] * len(answers)
    stored: list[answer_bytes.LineAnswer] = []
    most_held = 0
    for _ in range(1000):
        for answer in stored:
            answer.release()
        stored = []
        for index, (answer, connection) in enumerate(zip(answers, connections, strict=True)):
            if connection.paused or num_read[index] >= largest:
                continue
            _read(answer, connection, piece)
            num_read[index] += piece
            most_held = max(most_held, answer_bytes.held_bytes())
            if num_read[index] >= largest:
                answer.done_reading()
                answer.keep(num_read[index] + 200)
                stored.append(answer)
        if not stored and all(n >= largest for n in num_read):
            break
    assert len(answers) == 6
    assert all(n == largest for n in num_read), "a read waited for ever"
    assert not any(c.dropped for c in connections)
    assert most_held <= BOUND + len(answers) * 200, f"{most_held / MiB:.2f} MiB held"  # and the keeps' rows


def test_when_the_readers_read_fails_the_first_parked_reads_on(bound):
    answers = [answer_bytes.LineAnswer() for _ in range(4)]
    connections = [_Connection() for _ in answers]
    _read(answers[0], connections[0], 2 * MiB)
    _read(answers[1], connections[1], 460 * 1024)
    _read(answers[2], connections[2], 600 * 1024)  # past half the bound: the reader
    _read(answers[3], connections[3], 200 * 1024)  # parked first
    _read(answers[0], connections[0], 100 * 1024)
    _read(answers[1], connections[1], 100 * 1024)
    assert [c.paused for c in connections] == [True, True, False, True]
    answers[2].close()  # the reader's read failed
    assert not connections[3].paused
    for answer in answers:
        answer.release()


def test_a_read_that_fails_or_is_dropped_gives_its_bytes_back_and_the_waiting_read_on(bound):
    failed, dropped, waiting = (answer_bytes.LineAnswer() for _ in range(3))
    connections = [_Connection() for _ in range(3)]
    _read(failed, connections[0], 2 * MiB)
    _read(dropped, connections[1], 3 * MiB)
    _read(waiting, connections[2], 1 * MiB)
    assert connections[2].paused
    dropped.give(3 * MiB)  # handed on past what it keeps in memory
    failed.close()  # its read failed: nothing was handed to the line
    assert answer_bytes.held_bytes() == 1 * MiB + 2 * READ and not connections[2].paused
    waiting.release()
    _read(waiting, connections[2], 1 * MiB)  # a line still running as its run ended counts nothing more
    waiting.keep(1 * MiB)
    dropped.release()
    failed.release()
    assert answer_bytes.held_bytes() == 0


def test_a_closed_connection_never_takes_the_turn_of_one_that_waits(bound):
    holder, gone, waiting = (answer_bytes.LineAnswer() for _ in range(3))
    connections = [_Connection() for _ in range(3)]
    _read(holder, connections[0], 4 * MiB)
    holder.done_reading()  # read whole, past half the bound: no answer reads on into the room it leaves
    _read(gone, connections[1], 1 * MiB)
    _read(waiting, connections[2], 1 * MiB)
    assert connections[1].paused and connections[2].paused
    connections[1].closed = True
    gone.close()
    holder.keep(1 * MiB)
    assert not connections[2].paused
    for answer in (holder, gone, waiting):
        answer.release()


def test_a_parked_read_that_ended_never_takes_the_turn_of_one_that_waits(bound):
    holder, failed, waiting = (answer_bytes.LineAnswer() for _ in range(3))
    connections = [_Connection() for _ in range(3)]
    _read(holder, connections[0], 4 * MiB)
    holder.done_reading()
    _read(failed, connections[1], 1 * MiB)
    _read(waiting, connections[2], 1 * MiB)
    assert connections[1].paused and connections[2].paused
    failed.close()  # its read failed while it waited, its connection not closed yet
    holder.keep(1 * MiB)
    assert not connections[2].paused
    for answer in (holder, failed, waiting):
        answer.release()


def test_a_parked_read_of_another_event_loop_is_resumed_in_its_own(bound):
    holder, waiting = answer_bytes.LineAnswer(), answer_bytes.LineAnswer()
    loop = asyncio.new_event_loop()
    try:
        connection = _Connection()
        connection.loop = loop
        _read(holder, _Connection(), 4 * MiB)
        holder.done_reading()
        _read(waiting, connection, 1 * MiB)
        assert connection.paused
        holder.release()  # no loop runs here: resumed by the connection's own, when it runs
        assert connection.paused
        loop.run_until_complete(asyncio.sleep(0))
        assert not connection.paused
    finally:
        loop.close()
        waiting.release()


def test_a_read_parked_by_another_run_just_before_it_paused_is_still_resumed(bound):
    """Runs in threads share the budget: a read is parked under its lock and paused just after, on its own loop. Another
    run's thread freeing bytes in between dropped it as "not paused", and it was never resumed (a review's finding)."""
    holder, waiting = answer_bytes.LineAnswer(), answer_bytes.LineAnswer()
    loop = asyncio.new_event_loop()
    try:
        connection = _Connection()
        connection.loop = loop
        _read(holder, _Connection(), 4 * MiB)
        holder.done_reading()
        assert waiting.take(1 * MiB, connection)  # parked; its loop has not paused it yet
        holder.release()  # another thread frees bytes in that moment
        connection.paused = True  # its own loop pauses it now
        loop.run_until_complete(asyncio.sleep(0))
        assert not connection.paused
    finally:
        loop.close()
        waiting.release()


# --- a run's lines ------------------------------------------------------------------------------

ANSWER_BYTES = 6 * MiB
NUM_LINES = 6
BOUND_OF_RUNS = 2 * ANSWER_BYTES + 2 * MiB  # the largest answer, half of it, a little more than one of these
S3_PUT_BYTES = 2 * MiB  # what boto3 holds beside a row it puts (measured: 2 MiB for rows of 6 MiB and more)


def _peak_of_runs(monkeypatch) -> list[int]:
    """The most memory (`tracemalloc`, which the caller starts) held at once while each of the batch's runs ran its
    lines, above what was held as it began (the files' assembly after is bounded apart: `RESULTS_READ_AHEAD_BYTES`)."""
    peaks = []
    run = runner.run

    async def measured(*args, **kwargs):
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        try:
            return await run(*args, **kwargs)
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1] - base)

    monkeypatch.setattr(runner, "run", measured)
    return peaks


@pytest.mark.django_db(transaction=True)
def test_lines_answering_at_once_hold_their_answers_within_the_bound(files_bucket, tenant, start_mock_upstream,
                                                                     settings, monkeypatch):
    settings.BATCH_ANSWER_BYTES = BOUND_OF_RUNS
    # every line starts at once (six slots) and answers 6 MiB of logprobs after the same short wait
    upstream = start_mock_upstream(whole_answer_bytes=ANSWER_BYTES, token_delay_ms=50)
    endpoint = serve_endpoint(tenant.org, upstream, target_concurrency=NUM_LINES)
    batch = new_batch(endpoint, logprob_lines(endpoint.name, NUM_LINES))
    peaks = _peak_of_runs(monkeypatch)

    tracemalloc.start()
    try:
        services.run_batch(batch.pk)
    finally:
        tracemalloc.stop()

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed) == (BatchStatus.COMPLETED, NUM_LINES)
    rows = [json.loads(row) for row in storage.read_bytes(batch.output_file.s3_key).splitlines()]
    assert sorted(row["custom_id"] for row in rows) == [f"c{i}" for i in range(NUM_LINES)]
    assert all(len(row["response"]["body"]["choices"][0]["logprobs"]["content"]) > 5000 for row in rows)
    assert answer_bytes.held_bytes() == 0
    # NOTE: at most the bound (the largest answer included), one copy made in the loop (an answer's read joined, its
    # check or its row), the first read of each other line, and what boto3 buffers for each row being stored (22-24
    # MiB measured); before, the answers read at once, each held two or three times (32-39 MiB measured)
    limit = (BOUND_OF_RUNS + answer_bytes.largest_answer_bytes() + NUM_LINES * 256 * 1024
             + BOUND_OF_RUNS // ANSWER_BYTES * S3_PUT_BYTES)
    assert max(peaks) < limit, f"{max(peaks) / MiB:.0f} MiB held by {NUM_LINES} lines of {ANSWER_BYTES // MiB} MiB"


def _deleted_files_open() -> int:
    """This process's open files that have no name (a spool's, unlinked as it is made)."""
    return sum(os.readlink(f"/proc/self/fd/{fd}").endswith(" (deleted)") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


@pytest.mark.django_db(transaction=True)
def test_lines_larger_than_the_largest_answer_held_in_memory_go_on_to_disk_and_succeed(
        files_bucket, tenant, start_mock_upstream, settings):
    """Before, such a line failed with `response_too_large`, billed, though the same request succeeds outside a batch
    (the gateway keeps a whole answer of up to 64 MiB): with the default bound, every answer between 16 and 64 MiB."""
    settings.BATCH_ANSWER_BYTES = 1 * MiB
    settings.BATCH_SPOOL_BYTES = 2 * upstream.MAX_WHOLE_BODY_BYTES
    engine = start_mock_upstream(whole_answer_bytes=3 * MiB, token_delay_ms=20)
    endpoint = serve_endpoint(tenant.org, engine, target_concurrency=4)
    batch = new_batch(endpoint, logprob_lines(endpoint.name, 4))
    files_open = _deleted_files_open()

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 4, 0)
    assert answer_bytes.held_bytes() == 0 and answer_bytes.num_spooled() == 0
    assert _deleted_files_open() == files_open, "a spool's file was left open"
    text = storage.read_bytes(batch.output_file.s3_key)
    rows = [json.loads(row) for row in text.splitlines()]
    assert len(text) > 4 * 3 * MiB and batch.error_file is None
    assert sorted(row["custom_id"] for row in rows) == [f"c{i}" for i in range(4)]
    for row in rows:
        assert row["response"]["status_code"] == 200 and row["error"] is None
        assert len(row["response"]["body"]["choices"][0]["logprobs"]["content"]) > 3000  # of 1 KiB tokens
    usage = UsageRecord.objects.filter(batch_id=batch.pk)
    assert len(usage) == 4 and all(record.status == "ok" and record.completion_tokens > 0 for record in usage)


@pytest.mark.django_db(transaction=True)
def test_lines_larger_than_the_gateways_own_limit_each_fail_with_their_error_and_the_batch_completes(
        files_bucket, tenant, start_mock_upstream, settings, monkeypatch):
    """As outside a batch: read to its end for the usage it carries (billed: the engine computed it, and the line's
    error says so), none of it kept, in memory or on disk."""
    monkeypatch.setattr(upstream, "MAX_WHOLE_BODY_BYTES", 2 * MiB)
    settings.BATCH_ANSWER_BYTES = 1 * MiB
    settings.BATCH_SPOOL_BYTES = 2 * upstream.MAX_WHOLE_BODY_BYTES
    engine = start_mock_upstream(whole_answer_bytes=3 * MiB, token_delay_ms=20)
    endpoint = serve_endpoint(tenant.org, engine, target_concurrency=4)
    batch = new_batch(endpoint, logprob_lines(endpoint.name, 4))

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 0, 4)
    assert answer_bytes.held_bytes() == 0 and answer_bytes.num_spooled() == 0
    rows = [json.loads(row) for row in storage.read_bytes(batch.error_file.s3_key).splitlines()]
    assert sorted(row["custom_id"] for row in rows) == [f"c{i}" for i in range(4)]
    for row in rows:
        assert row["response"]["status_code"] == 400
        error = row["response"]["body"]["error"]
        assert error["code"] == "response_too_large"
        assert "larger than 2 MiB, the most a batch line's answer may be" in error["message"]
        assert "its tokens are billed" in error["message"] and "outside a batch" not in error["message"]
    usage = UsageRecord.objects.filter(batch_id=batch.pk)
    assert len(usage) == 4 and all(record.completion_tokens > 0 and record.cost > 0 for record in usage)


@pytest.mark.django_db(transaction=True)
def test_without_spools_lines_larger_than_the_largest_answer_fail_with_their_error(
        files_bucket, tenant, start_mock_upstream, settings):
    settings.BATCH_ANSWER_BYTES = 1 * MiB
    settings.BATCH_SPOOL_BYTES = 0
    engine = start_mock_upstream(whole_answer_bytes=3 * MiB, token_delay_ms=20)
    endpoint = serve_endpoint(tenant.org, engine, target_concurrency=4)
    batch = new_batch(endpoint, logprob_lines(endpoint.name, 2))

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 0, 2)
    rows = [json.loads(row) for row in storage.read_bytes(batch.error_file.s3_key).splitlines()]
    for row in rows:
        error = row["response"]["body"]["error"]
        assert error["code"] == "response_too_large"
        assert "larger than 0.5 MiB, the most a batch line's answer may be" in error["message"]
        assert "outside a batch" in error["message"]


@pytest.mark.django_db(transaction=True)
def test_a_run_with_no_room_for_a_first_read_and_no_line_of_its_own_gives_up_its_slice_and_says_so(
        files_bucket, tenant, start_mock_upstream, settings, caplog):
    """Before, such a run waited for bytes to be given back with no bound: bytes held by another run of the process
    (or leaked while it ran) held its worker slot until its task's time limit."""
    settings.BATCH_ANSWER_BYTES = 1 * MiB
    settings.BATCH_NO_ROOM_GIVE_UP_S = 1
    engine = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, engine)
    batch = new_batch(endpoint, logprob_lines(endpoint.name, 2))
    answer_bytes.run_started("batch_other")  # another run of the process (in a thread), holding a line's bytes
    try:
        held = answer_bytes.LineAnswer()
        assert not answer_bytes.room()
        worker, runs = run_in_a_thread(batch.pk)
        worker.join(timeout=60)  # NOTE: a guard against a hang, far past the second it waits
        assert not worker.is_alive(), "the run waited for the held bytes with no bound"
        held.release()
    finally:
        answer_bytes.run_ended()
    assert runs == ["no_room"]
    assert (Batch.objects.get(pk=batch.pk).status, _engine_requests(engine)) == (BatchStatus.IN_PROGRESS, 0)
    [error] = [record for record in caplog.records if record.levelname == "ERROR"]
    assert f"hold {256 * 1024} bytes of answers" in error.getMessage()

    assert services.run_batch(batch.pk) == "ran"  # the bytes given back, a later run runs its lines
    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed) == (BatchStatus.COMPLETED, 2)


@pytest.mark.django_db(transaction=True)
def test_bytes_leaked_while_no_run_of_the_process_ran_are_forgotten_as_the_next_run_starts(
        files_bucket, tenant, start_mock_upstream, settings, caplog):
    """Before, a batch worker process (Celery prefork: one run at a time) whose answer bytes leaked gave up every run it
    took with "no_room", for good (6 runs of 3 batches: 6 "no_room", no engine request)."""
    settings.BATCH_ANSWER_BYTES = 1 * MiB
    settings.BATCH_NO_ROOM_GIVE_UP_S = 1
    engine = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, engine)
    batches = [new_batch(endpoint, logprob_lines(endpoint.name, 2)) for _ in range(2)]
    leaked = answer_bytes.LineAnswer()  # a line's bytes never given back, no run of the process running
    assert not answer_bytes.room()

    assert [services.run_batch(batch.pk) for batch in batches] == ["ran", "ran"]

    assert [Batch.objects.get(pk=batch.pk).status for batch in batches] == [BatchStatus.COMPLETED] * 2
    assert _engine_requests(engine) == 4
    [error] = [record for record in caplog.records if record.levelname == "ERROR"]  # once, as the first run started
    assert "held 262144 bytes of answers and 0 answer(s) on disk with none of its runs running: leaked" in (
        error.getMessage())
    leaked.release()  # NOTE: given back to the budget it was forgotten with, never to the process's new one
    assert answer_bytes.held_bytes() == 0


def _engine_requests(engine: str) -> int:
    return httpx.get(f"{engine}/_stats").json()["num_requests"]
