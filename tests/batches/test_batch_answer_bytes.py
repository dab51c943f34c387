"""The bytes of line answers a batch worker holds are bounded across its lines in flight (`answer_bytes`).

Before: a run kept as many lines in flight as its endpoint had spare slots, each holding its answer (up to 64 MiB) two
or three times while it was read, checked and written, and nothing bounded them together: a few lines answering at once
took a batch worker (1 GiB, four runs) past its memory limit, with every run in it."""

from __future__ import annotations

import asyncio
import json
import tracemalloc

import pytest

from endpoints.batches import answer_bytes, runner, services, storage
from endpoints.batches.models import Batch, BatchStatus
from endpoints.gateway import upstream
from tests.batches.conftest import logprob_lines, new_batch
from tests.gateway.conftest import serve_endpoint

MiB = 2**20


class _Connection:
    """What `answer_bytes` sees of an upstream connection: it pauses when told to, resumes, and drops an answer too
    large to hold (read on without being held)."""

    def __init__(self):
        self.loop = None
        self.paused = self.closed = self.dropped = False

    def resume(self):
        self.paused = False

    def drop_whole_answer(self):
        self.dropped = True


def _read(answer: answer_bytes.LineAnswer, connection: _Connection, num_bytes: int) -> None:
    """`num_bytes` more read on `connection`, paused as `upstream` pauses it."""
    if answer.take(num_bytes, connection):
        connection.paused = True


BOUND = 8 * MiB


@pytest.fixture
def bound(settings):
    settings.BATCH_ANSWER_BYTES = BOUND
    assert answer_bytes.held_bytes() == 0
    yield
    try:
        assert answer_bytes.held_bytes() == 0, "a line's bytes were never given back"
    finally:
        answer_bytes._budget.__init__()


def test_the_largest_answer_is_half_the_bound_and_never_past_the_gateways_own_limit(settings):
    settings.BATCH_ANSWER_BYTES = 32 * MiB
    assert answer_bytes.largest_answer_bytes() == 16 * MiB
    assert answer_bytes.largest_answer_bytes(1024 * MiB) == upstream.MAX_WHOLE_BODY_BYTES


def test_a_lines_answer_counts_once_from_its_first_byte_until_it_is_released(bound):
    answer, connection = answer_bytes.LineAnswer(), _Connection()
    _read(answer, connection, 3 * MiB)
    _read(answer, connection, 1 * MiB)
    assert answer_bytes.held_bytes() == 4 * MiB
    answer.done_reading()
    answer.sent(4 * MiB)  # handed to the line's own `send`, which keeps it: still held, counted once
    answer.close()
    assert answer_bytes.held_bytes() == 4 * MiB
    answer.keep(4 * MiB + 200)  # its row, in place of the engine's bytes
    assert answer_bytes.held_bytes() == 4 * MiB + 200
    answer.release()
    answer.release()
    assert answer_bytes.held_bytes() == 0


def test_past_half_the_bound_no_line_starts_one_answer_reads_on_within_it_and_the_others_wait(bound):
    first, second, third = (answer_bytes.LineAnswer() for _ in range(3))
    connections = [_Connection() for _ in range(3)]
    _read(first, connections[0], 3 * MiB)
    _read(second, connections[1], 2 * MiB)  # past half the bound: read on, as the one reader
    assert not answer_bytes.room()
    _read(first, connections[0], 1 * MiB)  # another's read waits
    _read(third, connections[2], 64 * 1024)  # and a first one
    assert [c.paused for c in connections] == [True, False, True]
    _read(second, connections[1], 2 * MiB)  # the largest answer, in the half kept for it
    assert answer_bytes.held_bytes() <= BOUND + 64 * 1024
    second.done_reading()  # read whole: the next reads on only once what it holds is given back
    assert [c.paused for c in connections] == [True, False, True]
    second.release()  # stored: the one parked first reads on, one at a time
    assert [c.paused for c in connections] == [False, False, True]
    first.release()  # under half the bound again: the next parked reads on
    assert [c.paused for c in connections] == [False, False, False] and answer_bytes.room()
    third.release()
    assert not any(c.dropped for c in connections)


def test_an_answer_larger_than_the_largest_is_read_on_without_being_held(bound):
    """Before, one answer read on past the bound, up to 64 MiB: four worker processes each holding their bound, such an
    answer and its copy passed the batch worker's 1 GiB together."""
    large, reader, waiting = (answer_bytes.LineAnswer() for _ in range(3))
    connections = [_Connection() for _ in range(3)]
    _read(large, connections[0], 3 * MiB)
    _read(reader, connections[1], 1 * MiB + 512 * 1024)  # past half the bound: the one reader
    _read(waiting, connections[2], 512 * 1024)
    assert connections[2].paused
    _read(large, connections[0], 2 * MiB)  # past half the bound: its bytes given back, the rest read on unheld
    assert connections[0].dropped and not connections[0].paused
    assert answer_bytes.held_bytes() == 2 * MiB and not connections[2].paused
    large.give(5 * MiB)  # the connection hands its buffered bytes on (`upstream`): nothing more to give back
    _read(large, connections[0], 1 * MiB)  # nor to count
    large.keep(300)  # its error row
    assert answer_bytes.held_bytes() == 2 * MiB + 300
    for answer in (large, reader, waiting):
        answer.release()


def test_answers_read_at_once_hold_within_the_bound_and_all_finish(bound):
    """Lines each answering the largest answer, read a piece at a time and stored a round after they are read whole."""
    piece, largest = 256 * 1024, BOUND // 2
    answers = [answer_bytes.LineAnswer() for _ in range(6)]
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
    assert all(n == largest for n in num_read), "a read waited for ever"
    assert not any(c.dropped for c in connections)
    # the keeps' rows (200 bytes each) and a first piece of each other answer past it at most
    assert most_held <= BOUND + len(answers) * (piece + 200), f"{most_held / MiB:.1f} MiB held"


def test_when_every_byte_held_waits_for_a_reader_the_first_parked_reads_on(bound):
    """None of what is held was read whole, so none of it will be given back: the first parked reads on, though what
    the others hold (a first read each past half the bound) leaves it less than the largest answer."""
    answers = [answer_bytes.LineAnswer() for _ in range(4)]
    connections = [_Connection() for _ in answers]
    _read(answers[0], connections[0], 3584 * 1024)
    _read(answers[1], connections[1], 460 * 1024)
    _read(answers[2], connections[2], 300 * 1024)  # past half the bound: the reader
    _read(answers[3], connections[3], 200 * 1024)  # parked first
    _read(answers[0], connections[0], 100 * 1024)
    _read(answers[1], connections[1], 100 * 1024)
    assert [c.paused for c in connections] == [True, True, False, True]
    answers[2].close()  # the reader's read failed
    assert [c.paused for c in connections] == [True, True, False, False]
    for answer in answers:
        answer.release()


def test_a_read_that_fails_or_is_dropped_gives_its_bytes_back_and_the_waiting_read_on(bound):
    failed, dropped, waiting = (answer_bytes.LineAnswer() for _ in range(3))
    connections = [_Connection() for _ in range(3)]
    _read(failed, connections[0], 3 * MiB)
    _read(dropped, connections[1], 3 * MiB)
    _read(waiting, connections[2], 1 * MiB)
    assert connections[2].paused
    dropped.give(3 * MiB)  # past the largest answer: read on without being held
    failed.close()  # its read failed: nothing was handed to the line
    assert answer_bytes.held_bytes() == 1 * MiB and not connections[2].paused
    waiting.release()
    _read(waiting, connections[2], 1 * MiB)  # a line still running as its run ended counts nothing more
    waiting.keep(1 * MiB)
    assert answer_bytes.held_bytes() == 0
    dropped.release()
    failed.release()


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
    holder.keep(2 * MiB)
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
    holder.keep(2 * MiB)
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


@pytest.mark.django_db(transaction=True)
def test_lines_larger_than_the_largest_answer_each_fail_with_their_error_and_the_batch_completes(
        files_bucket, tenant, start_mock_upstream, settings):
    """Before, a line larger than the bound read on past it, alone, up to 64 MiB: with the bound and its copy, four
    worker processes at their worst passed the batch worker's memory limit together."""
    settings.BATCH_ANSWER_BYTES = 1 * MiB
    upstream = start_mock_upstream(whole_answer_bytes=3 * MiB, token_delay_ms=20)
    endpoint = serve_endpoint(tenant.org, upstream, target_concurrency=4)
    batch = new_batch(endpoint, logprob_lines(endpoint.name, 4))

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed, batch.num_failed) == (BatchStatus.COMPLETED, 0, 4)
    assert answer_bytes.held_bytes() == 0
    rows = [json.loads(row) for row in storage.read_bytes(batch.error_file.s3_key).splitlines()]
    assert sorted(row["custom_id"] for row in rows) == [f"c{i}" for i in range(4)]
    for row in rows:
        assert row["response"]["status_code"] == 400
        error = row["response"]["body"]["error"]
        assert error["code"] == "response_too_large"
        assert "larger than 0.5 MiB, the most a batch line's answer may be" in error["message"]
