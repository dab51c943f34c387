"""A batch line's answer kept on disk (`endpoints.batches.spool`): checked to be JSON a piece at a time as
`runner.json_text` checks one in memory, its line ends taken out, and read back as its row."""

from __future__ import annotations

import io
import json
import random

import pytest

from endpoints.batches import runner, spool
from endpoints.gateway import upstream


def _spooled(data: bytes) -> spool.Spool:
    answer = spool.Spool()
    for start in range(0, len(data), 100_000):
        answer.write(data[start:start + 100_000])
    return answer


def _random_value(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth > 4 or roll < 0.3:
        return rng.choice([1, -2.5e3, "a\u00e9\"\\x", True, None, "", 12345678901234567890, 0.1, "\u2603"])
    if roll < 0.65:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randint(0, 5))}


def test_pieces_of_any_size_are_judged_json_exactly_as_a_whole_text_is():
    rng = random.Random(7)
    for _ in range(1500):
        data = json.dumps(_random_value(rng), indent=rng.choice([None, 1]), ensure_ascii=False).encode()
        if rng.random() < 0.5:  # one byte changed: JSON or not, as the json module says
            changed = bytearray(data)
            changed[rng.randrange(len(changed))] = rng.choice(b'{}[],:"x 0\\\x01')
            data = bytes(changed)
        try:
            json.loads(str(data, "latin-1"))  # NOTE: its UTF-8 is checked apart (`Spool.check_and_clean`)
            expected = True
        except ValueError:
            expected = False
        for piece_bytes in (1, 3, 64, 1 << 20):
            checker = spool._JsonPieces()
            judged = all(checker.feed(data[start:start + piece_bytes], final=start + piece_bytes >= len(data))
                         for start in range(0, len(data), piece_bytes)) and checker.done()
            assert judged == expected, (piece_bytes, data)


def test_a_spooled_answer_is_checked_its_line_ends_taken_out_and_read_back_as_its_row(monkeypatch):
    monkeypatch.setattr(spool, "PIECE_BYTES", 1000)  # many pieces, values cut across them
    entries = [{"token": f"t{i}", "logprob": -0.5, "bytes": [116], "text": "\u00e9\u2603"} for i in range(2000)]
    body = json.dumps({"choices": [{"logprobs": {"content": entries}}]}, indent=1, ensure_ascii=False).encode()
    answer = _spooled(body)
    assert answer.check_and_clean()
    row = spool.SpooledRow(b'{"head": ', answer, b"}")
    data = row.read()
    assert len(row) == len(data) and b"\n" not in data and b"\r" not in data
    assert json.loads(data) == {"head": json.loads(body)}
    row.seek(3)
    assert row.read(6) == data[3:9]  # S3's client may read it again
    answer.close()


@pytest.mark.parametrize("data", [b'{"a": [1, 2', b'{"a": "\xff"}', b'{"a": 1} {"b": 2}', b'{"a": "x\x01"}', b""])
def test_a_spooled_answer_that_is_not_json_is_refused(data):
    answer = _spooled(data)
    assert not answer.check_and_clean()
    answer.close()


def test_an_answer_past_the_gateways_limit_is_not_kept(monkeypatch):
    monkeypatch.setattr(upstream, "MAX_WHOLE_BODY_BYTES", 1000)
    answer = _spooled(b" " * 999 + b"{}")
    assert answer.too_large and not answer.whole and answer.file.seek(0, io.SEEK_END) == 0
    answer.close()


def test_a_row_as_runner_writes_it_around_a_spooled_answer_is_the_row_it_writes_in_memory():
    line = runner.Line(index=3, custom_id="c3", body={})
    body = b'{"id":"x","choices":[]}'
    answer = _spooled(body)
    assert answer.check_and_clean()
    head, tail = runner._row_around("batch_abc", line, 200, "batch_abc-3")
    assert spool.SpooledRow(head, answer, tail).read() == runner.answer_row("batch_abc", line, 200, "batch_abc-3", body)
    answer.close()


def test_a_spool_given_back_is_read_and_written_no_more():
    """A run that ends on an error gives back the answers of lines still being checked or stored (in worker threads):
    their file's descriptor, closed, may be another file's by the time they read it."""
    answer = _spooled(b'{"a": 1}')
    assert answer.check_and_clean()
    row = spool.SpooledRow(b"[", answer, b"]")
    answer.close()
    with pytest.raises(OSError):
        row.read()
    assert not answer.check_and_clean()
    answer.write(b"more")  # its connection still reading: nothing to write to, and no error raised into it
