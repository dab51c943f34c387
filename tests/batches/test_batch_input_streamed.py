"""A batch's input is read a part at a time, checked and run a line at a time: a worker never holds the file.

Before: the check read the whole input into memory, decoded it, split it into lines and kept every line's parsed
body, and each run did the same again. A batch worker has four runs in one 1 GiB container; one 200 MiB input
(the documented largest) took ~600 MiB as bytes and text before a line was parsed, and one whose lines hold many
small messages several GiB parsed: the worker was killed at every try, with the other tenants' runs in it."""

from __future__ import annotations

import json
import time

import boto3
import pytest

from endpoints.batches import runner, services, storage
from endpoints.batches.models import Batch, BatchStatus
from endpoints.batches.validation import parse_lines, read_lines, split_lines
from tests.batches.conftest import S3_KEY, S3_SECRET, new_batch, peak_bytes_while
from tests.factories import EndpointFactory
from tests.gateway.conftest import serve_endpoint

MiB = 1024 * 1024


def _request_line(model: str, custom_id: str, messages: list[dict]) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "messages": messages, "max_tokens": 4}}).encode() + b"\n"


# --- the pieces -----------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64])
def test_lines_split_across_parts_read_as_the_file_has_them(size):
    data = b'{"a": 1}\r\n\n  \n{"b": "\xe2\x80\xa8"}\n' + b"x" * 20 + b"\n" + b"last"
    parts = [data[i:i + size] for i in range(0, len(data), size)]

    assert list(split_lines(parts, max_line_bytes=25)) == [
        (1, b'{"a": 1}\r'), (4, b'{"b": "\xe2\x80\xa8"}'), (5, b"x" * 20), (6, b"last")]
    # NOTE: U+2028 is text inside a JSON string, not a line's end (`str.splitlines` split the line there); blank lines
    # (2 and 3) are not handed on (`test_batch_blank_lines.py`)


@pytest.mark.parametrize("size", [1, 4, 9, 100])
def test_a_line_too_long_is_dropped_as_it_comes(size):
    data = b"ok\n" + b"y" * 40 + b"\n" + b"z" * 12 + b"\nend"
    parts = [data[i:i + size] for i in range(0, len(data), size)]

    assert list(split_lines(parts, max_line_bytes=12)) == [(1, b"ok"), (2, None), (3, b"z" * 12), (4, b"end")]
    assert list(split_lines([b"w" * 13], max_line_bytes=12)) == [(1, None)]
    assert list(split_lines([], max_line_bytes=12)) == [] and list(split_lines([b"\n"], max_line_bytes=12)) == []


def test_a_line_that_is_not_utf8_is_refused_by_its_number_and_the_others_still_checked():
    good = _request_line("m", "a", [{"role": "user", "content": "hi"}])

    checked = parse_lines([good + b'{"custom_id": "\xff"}\n' + b'[1]\n'], request_path="/v1/chat/completions",
                          kind="chat", max_lines=10)

    assert [(error.line, error.code) for error in checked.errors] == [(2, "invalid_json"), (3, "invalid_request")]


def test_the_runs_lines_skip_what_is_done_and_a_line_that_no_longer_reads_gets_an_empty_body():
    data = (_request_line("m", "a", []) + b"\n" + _request_line("m", "b", []) + b"not json\n"
            + _request_line("m", "c", []))

    lines = list(read_lines([data], skip={1}))

    assert [(line.index, line.custom_id) for line in lines] == [(0, "a"), (2, ""), (3, "c")]
    assert lines[1].body == {} and lines[0].body["model"] == "m"


def test_an_input_is_read_in_ranged_parts_of_one_version(files_bucket, s3_server):
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id=S3_KEY,
                      aws_secret_access_key=S3_SECRET)
    s3.put_object(Bucket=files_bucket, Key="in", Body=b"0123456789")
    s3.put_object(Bucket=files_bucket, Key="empty", Body=b"")

    assert list(storage.read_parts("in", part_bytes=4)) == [b"0123", b"4567", b"89"]
    assert list(storage.read_parts("in", part_bytes=5)) == [b"01234", b"56789"]
    assert list(storage.read_parts("in", part_bytes=100)) == [b"0123456789"]
    assert list(storage.read_parts("empty", part_bytes=4)) == []
    with pytest.raises(storage.ObjectGone):
        list(storage.read_parts("missing", part_bytes=4))

    parts = storage.read_parts("in", part_bytes=4)
    assert next(parts) == b"0123"
    s3.put_object(Bucket=files_bucket, Key="in", Body=b"abcdefghij")  # replaced between two parts
    with pytest.raises(storage.ObjectGone):
        next(parts)


# --- a worker's memory ----------------------------------------------------------------------------

@pytest.fixture
def parts_of_a_mib(monkeypatch):
    """Inputs read a MiB at a time (8 in production): the tests' files need only be a few times that."""
    monkeypatch.setattr(storage, "INPUT_PART_BYTES", MiB)


@pytest.mark.django_db(transaction=True)
def test_checking_a_large_input_holds_a_part_and_a_line_not_the_file(files_bucket, parts_of_a_mib):
    # 6 MiB of lines of many short messages: parsed, ~10 times their text.
    endpoint = EndpointFactory(max_model_len=2048)  # scaled to zero: nothing runs by itself
    messages = [{"role": "user", "content": "hi"}] * 2_000
    data = b"".join(_request_line(endpoint.name, f"c{i}", messages) for i in range(96))
    assert len(data) > 6 * MiB
    batch = new_batch(endpoint, data)
    del data

    peak = peak_bytes_while(lambda: services.validate_batch(Batch.objects.select_related("input_file").get(pk=batch.pk)))

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_total) == (BatchStatus.IN_PROGRESS, 96)
    assert peak < 6 * MiB, f"{peak / MiB:.0f} MiB held to check a 6 MiB input"


@pytest.mark.django_db(transaction=True)
def test_a_run_reads_its_input_as_its_lines_start(files_bucket, parts_of_a_mib, tenant, start_mock_upstream):
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    prompt = [{"role": "user", "content": "z" * 100_000}]
    data = b"".join(_request_line(endpoint.name, f"c{i}", prompt) for i in range(200))
    assert len(data) > 19 * MiB
    batch = new_batch(endpoint, data)
    del data

    peak = peak_bytes_while(lambda: services.run_batch(batch.pk))

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_total, batch.num_completed) == (BatchStatus.COMPLETED, 200, 200)
    output = storage.read_bytes(batch.output_file.s3_key).splitlines()
    assert [json.loads(row)["custom_id"] for row in output] == [f"c{i}" for i in range(200)]
    # NOTE: ~10 MiB of it is the output file's upload (`storage.OUTPUT_TRANSFER`'s 8 MiB parts), whatever the input
    assert peak < 14 * MiB, f"{peak / MiB:.0f} MiB held to check, run and finalize a 19 MiB input"


def _lease_checks(monkeypatch) -> list[float]:
    """When each of the run's checks (its lease's renewal) ran, filled as the run goes."""
    checks, run = [], runner.run

    async def recording(work, todo, progress, *, keep_going, **kwargs):
        def renew(progress):
            checks.append(time.monotonic())
            return keep_going(progress)
        return await run(work, todo, progress, keep_going=renew, **kwargs)

    monkeypatch.setattr(runner, "run", recording)
    return checks


@pytest.mark.django_db(transaction=True)
def test_a_slow_read_of_the_input_never_holds_up_the_lease(files_bucket, tenant, start_mock_upstream, monkeypatch):
    # The run awaited each read of its input: a part's GET that S3 was slow to answer (or a long skip over the lines
    # done) held up the lease's renewal, and the batch was taken over by another worker with its lines in flight.
    upstream = start_mock_upstream(token_delay_ms=20)  # 150 tokens: a 3 s answer
    endpoint = serve_endpoint(tenant.org, upstream)
    data = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 150}}).encode() + b"\n" for i in range(2))
    batch = new_batch(endpoint, data)
    lines_of = services._input_lines

    def slow_second_read(batch, **kwargs):
        lines = lines_of(batch, **kwargs)
        yield next(lines)
        time.sleep(2.5)  # while the first line runs
        yield from lines

    checks = _lease_checks(monkeypatch)
    monkeypatch.setattr(services, "_input_lines", slow_second_read)
    services.run_batch(batch.pk)

    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.COMPLETED
    gaps = [later - earlier for earlier, later in zip(checks, checks[1:], strict=False)]
    assert max(gaps) < 2 * runner.CHECK_EVERY_S, gaps


@pytest.mark.django_db(transaction=True)
def test_a_slow_put_of_a_lines_result_never_holds_up_the_lease(files_bucket, tenant, start_mock_upstream, monkeypatch):
    # The run awaited each result's put in its loop: a put S3 was slow to answer (boto3 retrying) held up the lease's
    # renewal as a slow read did.
    upstream = start_mock_upstream(token_delay_ms=20)  # 150 tokens: a 3 s answer
    endpoint = serve_endpoint(tenant.org, upstream)
    data = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 2 if i == 0 else 150}}).encode() + b"\n" for i in range(2))
    batch = new_batch(endpoint, data)
    put_result = storage.put_result

    def slow_first_put(organization_id, batch_id, index, result, *, ok):
        if index == 0:
            time.sleep(2.5)  # while the second line runs
        put_result(organization_id, batch_id, index, result, ok=ok)

    checks = _lease_checks(monkeypatch)
    monkeypatch.setattr(storage, "put_result", slow_first_put)
    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.COMPLETED and batch.num_completed == 2
    gaps = [later - earlier for earlier, later in zip(checks, checks[1:], strict=False)]
    assert max(gaps) < 2 * runner.CHECK_EVERY_S, gaps
