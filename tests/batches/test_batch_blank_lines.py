"""Blank lines in a batch's input (whitespace alone as `str.strip` finds it: `\\r`, U+00A0, U+3000 ... included) are
skipped, a run of them in one scan: they are no requests, and the line numbers of the others stay the file's.

Before: each blank line was split out, decoded and stripped a line at a time, and blank lines count towards no limit
(`BATCH_MAX_LINES` counts requests): a 32 MiB file of `\\n` took ~11 s of a worker's CPU at its validation, and again
at each run as it read the input for its next lines (0.05 s now, on the same machine)."""

from __future__ import annotations

import json

import pytest

from endpoints.batches.validation import parse_lines, read_lines, split_lines

MiB = 1024 * 1024


class _CountedFinds(bytes):
    """A part of an input that counts the line ends looked for in it: one look a line, when lines are split one at a
    time."""

    num_finds = 0

    def find(self, *args) -> int:
        _CountedFinds.num_finds += 1
        return super().find(*args)


def _request(custom_id: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}).encode()


def test_a_file_of_blank_lines_alone_is_empty_and_read_in_a_few_scans_not_a_line_at_a_time():
    _CountedFinds.num_finds = 0
    parts = [_CountedFinds(b"\n" * MiB), _CountedFinds(b" \r\n\t\n" * 1000 + b"  "), _CountedFinds(b"\r\n" * MiB)]

    checked = parse_lines(parts, request_path="/v1/chat/completions", kind="chat", max_lines=10)

    assert checked.num_lines == 0 and [error.code for error in checked.errors] == ["empty_file"]
    assert list(read_lines(parts)) == []
    assert _CountedFinds.num_finds <= 2 * 2 * len(parts), "one look for a line's end a part, not one a line"


def test_requests_among_blank_lines_keep_the_files_line_numbers_and_their_own_indexes():
    data = (b"\n" * 1000 + _request("a") + b"\r\n" + b" \n" * 500 + b"  " + _request("b") + b"\n\n"
            + b"{not json}\n" + b"\t\n" * 3 + _request("c"))

    for size in (1, 7, 64, 4096, len(data)):
        parts = [_CountedFinds(data[i:i + size]) for i in range(0, len(data), size)]
        assert [number for number, _ in split_lines(parts)] == [1001, 1502, 1504, 1508]
        checked = parse_lines(parts, request_path="/v1/chat/completions", kind="chat", max_lines=10)
        assert [(error.line, error.code) for error in checked.errors] == [(1504, "invalid_json")]
        assert [(line.index, line.custom_id) for line in read_lines(parts)] == [(0, "a"), (1, "b"), (2, ""), (3, "c")]


def test_a_blank_line_longer_than_a_request_is_still_blank():
    assert list(split_lines([b"  " * 10, b" \n", b"x\n"], max_line_bytes=8)) == [(2, b"x")]
    assert list(split_lines([b" " * 20 + b"\nx"], max_line_bytes=8)) == [(2, b"x")]


# Whitespace `str.strip` strips and `bytes.strip` does not (the ends of its ranges): a line of it alone was blank before.
OTHER_WHITESPACE = "\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u200a\u2028\u2029\u202f\u205f\u3000"


@pytest.mark.parametrize("size", [1, 2, 5, 4096])
def test_a_line_of_other_whitespace_alone_is_blank_as_before_and_shifts_no_index(size):
    # Before (this release's first cut): such a line was a request, `invalid_json` at the check, and in a batch checked
    # by the release before (which skipped it) it shifted every later line's index: lines answered ran and were billed
    # again under the index of the line before them.
    blank_lines = [char.encode() + b" \r\n" for char in OTHER_WHITESPACE] + [OTHER_WHITESPACE.encode() + b"\n"]
    data = b"".join((_request("a"), b"\n", "\xa0".encode(), b"\n", _request("b"), b"\n", *blank_lines,
                     _request("c"), b"\n", "\u3000".encode()))
    parts = [data[i:i + size] for i in range(0, len(data), size)]  # a character split across parts too

    checked = parse_lines(parts, request_path="/v1/chat/completions", kind="chat", max_lines=10)

    assert (checked.num_lines, checked.errors) == (3, [])
    assert [(line.index, line.custom_id) for line in read_lines(parts)] == [(0, "a"), (1, "b"), (2, "c")]


def test_lines_of_other_whitespace_are_skipped_a_run_at_a_time_not_a_line_at_a_time():
    # Before: only ASCII whitespace was skipped a run at a time; a line of any other was split out, decoded and tested a
    # line at a time (~2.8 µs each): 20 MiB of `\x1c\n` took 28 s of a worker's CPU, and a 200 MiB input of them
    # (one request ahead of them) ~5 minutes at its check and again at each run, which reads the input to its end.
    _CountedFinds.num_finds = 0
    parts = [_CountedFinds(char.encode() * 3 + b" \r\n" + (char.encode() + b"\n") * 20_000)
             for char in OTHER_WHITESPACE]

    checked = parse_lines(parts, request_path="/v1/chat/completions", kind="chat", max_lines=10)

    assert checked.num_lines == 0 and [error.code for error in checked.errors] == ["empty_file"]
    assert list(read_lines(parts)) == []
    assert _CountedFinds.num_finds <= 2 * 2 * len(parts), "one look for a line's end a part, not one a line"


def test_the_lines_skipped_a_run_at_a_time_are_those_str_isspace_finds_blank_and_no_other():
    # NOTE: a line skipped that the check counted as a request (or the reverse) shifts the index of every line after it:
    # the lines skipped in one scan must be exactly those `_requests` finds blank (`str.isspace`), character by character
    chars = [chr(code) for code in [*range(0xD800), *range(0xE000, 0x10000), 0x10000, 0x1F600, 0xE0020, 0x10FFFF]
             if code != 0x0A]  # the line's end itself
    data = b"".join(char.encode() + b"\n" for char in chars)
    parts = [data[i:i + 4096] for i in range(0, len(data), 4096)]  # a character split across parts too

    kept = {number for number, _ in split_lines(parts)}

    assert kept == {number for number, char in enumerate(chars, start=1) if not char.isspace()}


def test_a_file_that_starts_with_a_byte_order_mark_reads_as_the_same_file_without_it():
    """Notepad and PowerShell write a UTF-8 byte-order mark at a file's start. Before: the first line was refused as
    "This line is not valid JSON." (`json.loads` refuses a leading U+FEFF), so the whole batch failed its check."""
    from endpoints.batches.validation import first_model

    data = _request("a") + b"\n" + _request("b") + b"\n"
    for with_mark in (b"\xef\xbb\xbf" + data, b"\xef\xbb\xbf\n\n" + data):
        for size in (1, 2, 5, 4096):
            parts = [with_mark[i:i + size] for i in range(0, len(with_mark), size)]
            checked = parse_lines(parts, request_path="/v1/chat/completions", kind="chat", max_lines=10)
            assert checked.errors == [] and checked.num_lines == 2
            assert [(line.index, line.custom_id) for line in read_lines(parts)] == [(0, "a"), (1, "b")]
        assert first_model(with_mark, is_whole_file=True) == "m"
    # A mark anywhere else is no mark of the file: that line is still not JSON.
    checked = parse_lines([data + b"\xef\xbb\xbf" + _request("c")], request_path="/v1/chat/completions", kind="chat",
                          max_lines=10)
    assert [(error.line, error.code) for error in checked.errors] == [(3, "invalid_json")]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_a_utf16_input_file_fails_its_check_with_one_error_that_says_to_save_it_as_utf8(encoding):
    """PowerShell 5's `>` writes UTF-16 with a byte-order mark. Before: its first line was "not UTF-8 text" and each
    other "not valid JSON" (each began with the NUL of the `\\n` before it), one line more than the file has."""
    text = (_request("a") + b"\n" + _request("b") + b"\n").decode()
    data = ("\ufeff" + text if encoding == "utf-16-be" else text).encode(encoding)
    for size in (1, 4096):
        parts = [data[i:i + size] for i in range(0, len(data), size)]
        checked = parse_lines(parts, request_path="/v1/chat/completions", kind="chat", max_lines=10)
        assert checked.num_lines == 0
        assert [error.as_openai() for error in checked.errors] == [
            {"code": "invalid_encoding", "line": 1, "param": None,
             "message": "The input file is UTF-16 (it starts with a UTF-16 byte-order mark): save it as UTF-8, one "
                        "JSON request a line."}]


def test_crlf_lines_a_nul_byte_and_invalid_utf8_each_get_their_lines_error_and_the_rest_read_as_written():
    crlf = _request("a") + b"\r\n" + _request("b") + b"\r\n"
    checked = parse_lines([crlf], request_path="/v1/chat/completions", kind="chat", max_lines=10)
    assert checked.errors == [] and [line.custom_id for line in read_lines([crlf])] == ["a", "b"]
    broken = _request("a") + b"\n" + _request("b").replace(b'"b"', b'"b\x00"') + b"\n" + b'{"custom_id": "\xff"}\n'
    checked = parse_lines([broken], request_path="/v1/chat/completions", kind="chat", max_lines=10)
    assert [(error.line, error.message) for error in checked.errors] == [
        (2, "This line is not valid JSON."), (3, "This line is not UTF-8 text.")]
    assert checked.num_lines == 0  # nothing runs, so nothing is billed
