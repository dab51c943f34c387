"""A batch line's answer is kept as the engine's bytes: never parsed whole into Python objects, never grown on its way
to S3.

Before: a line's answer was joined from its pieces, parsed, and written again as JSON; a non-streamed answer may be up
to 64 MiB (`n`, logprobs, `top_logprobs`), and parsed, one of many small logprobs took ~8 times that (a 64 MiB answer
~500 MB): a batch worker has four runs in one 1 GiB container, and was killed with them all."""

from __future__ import annotations

import json

import pytest

from endpoints.batches import runner, services, storage
from endpoints.batches.models import Batch, BatchStatus
from endpoints.batches.validation import Line
from tests.batches.conftest import logprob_lines, new_batch, peak_bytes_while
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MiB = 2**20
ANSWER_BYTES = 16 * MiB


def test_a_lines_long_answer_is_kept_without_being_parsed_whole(files_bucket, tenant, start_mock_upstream, settings):
    settings.BATCH_ANSWER_BYTES = 3 * ANSWER_BYTES  # a line's answer may be half of it (`answer_bytes`)
    # 16 MiB of logprobs of 4-byte tokens: ~490,000 small JSON objects, ~130 MiB parsed.
    upstream = start_mock_upstream(whole_answer_bytes=ANSWER_BYTES, logprob_token_bytes=4)
    endpoint = serve_endpoint(tenant.org, upstream)
    batch = new_batch(endpoint, logprob_lines(endpoint.name, 1))

    peak = peak_bytes_while(lambda: services.run_batch(batch.pk))

    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed) == (BatchStatus.COMPLETED, 1)
    [row] = storage.read_bytes(batch.output_file.s3_key).splitlines()
    result = json.loads(row)
    assert result["custom_id"] == "c0" and result["response"]["status_code"] == 200
    assert result["response"]["request_id"] == f"{batch.pk}-0" and result["error"] is None
    logprobs = result["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(logprobs) > 400_000 and logprobs[-1] == {"token": "xxxx", "logprob": -1.0}
    # NOTE: the gateway's own copy, the line's, its row and the output file's upload (~26 MiB): under 4 × the answer
    assert peak < 4 * ANSWER_BYTES, f"{peak / MiB:.0f} MiB held for a line's {ANSWER_BYTES / MiB:.0f} MiB answer"


def test_an_answer_is_written_to_its_file_as_one_line_of_the_same_json():
    body = runner.json_text(b'{\r\n  "text": "a\\nb \\u2028",\n  "logprob": -Infinity,\n  "n": [1, {"x": null}]\n}\n')
    line = Line(index=3, custom_id='c", "body": null}', body={})

    row = runner.answer_row("batch_abc", line, 200, "batch_abc-3", body)

    assert b"\n" not in row and b"\r" not in row
    assert json.loads(row) == {"id": "batch_req_abc_3", "custom_id": 'c", "body": null}', "error": None,
                               "response": {"status_code": 200, "request_id": "batch_abc-3",
                                            "body": {"text": "a\nb \u2028", "logprob": float("-inf"),
                                                     "n": [1, {"x": None}]}}}


@pytest.mark.parametrize("answer", [b'{"text": "cut', b'{"a": 1} {"b": 2}', b'\xff{}', b'{"a": "\n"}', b""])
def test_an_answer_that_is_not_one_json_text_is_refused(answer):
    assert runner.json_text(answer) is None


def test_an_answer_with_characters_past_latin_1_is_checked_without_a_text_of_4_bytes_a_character():
    # one emoji among 8 MiB of logprobs: decoded whole, every character of the text took 4 bytes (32 MiB)
    answer = json.dumps({"logprobs": [{"token": "xxxx", "logprob": -1.0}] * 240_000 + [{"token": "🙂"}]},
                        ensure_ascii=False).encode()
    assert len(answer) > 7 * MiB

    peak = peak_bytes_while(lambda: runner.json_text(answer))

    assert runner.json_text(answer) is answer  # on one line already: the engine's bytes themselves, no copy
    assert peak < 2 * len(answer), f"{peak / MiB:.0f} MiB to check an answer of {len(answer) / MiB:.0f} MiB"


@pytest.mark.parametrize(("answer", "is_json"), [
    ('{"a": "é€🙂"}'.encode(), True),
    (b'{"a": "' + b"x" * (runner.UTF8_CHECKED_BYTES - 9) + "🙂".encode() + b'"}', True),  # across two pieces
    (b'{"a": "\xc3"}', False),  # not UTF-8
    (b'{"a": "\xed\xa0\x80"}', False),  # a surrogate, encoded
    ('{"a": 1}\u00a0'.encode(), False),  # a space JSON does not know, outside the text's strings
    ('{"a": é}'.encode(), False),
    ('\ufeff{"a": 1}'.encode(), False),  # a byte-order mark
])
def test_an_answer_is_checked_as_utf_8_json(answer, is_json):
    assert (runner.json_text(answer) is not None) == is_json
