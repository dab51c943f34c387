"""A batch's input file, checked line by line before any line runs.

Every line must be a JSON object `{"custom_id", "method": "POST", "url", "body"}` whose `custom_id` is a
unique string without control characters or lone surrogates, whose `url` is the batch's endpoint, and whose `body` the gateway would accept for that
path (`endpoints.gateway.request.parse_payload`: the same checks as an interactive call) with a
`model` naming one of the organisation's endpoints or one of its LoRA adapters (`"<endpoint>:<adapter>"`, the
gateway's naming), the same endpoint for every line, and no `stream` or `priority`. A file
with any bad line fails the whole batch with one error per bad line (OpenAI's `errors.data`), and
nothing runs.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass

from controlplane.text import is_plain, shown
from endpoints.adapters import split_model_name
from endpoints.gateway import errors as gateway_errors
from endpoints.gateway.request import (
    MAX_BODY_BYTES,
    MAX_JSON_ITEMS,
    has_too_many_json_items,
    is_model_name,
    parse_payload,
)

MAX_ERRORS = 100  # errors reported per batch; the rest of a bad file is not listed
MAX_CUSTOM_ID = 512
MAX_ERROR_TEXT = 1_000  # characters of an error's message or param kept: a batch keeps up to MAX_ERRORS of them


@dataclass(slots=True, frozen=True)
class Line:
    index: int  # 0-based line number among the file's lines that are not blank (`_requests`)
    custom_id: str
    body: dict  # the request's body as the file has it (the gateway's checks run on it again as it runs)


@dataclass(slots=True, frozen=True)
class LineError:
    line: int  # 1-based, as OpenAI reports it
    code: str
    message: str
    param: str | None = None

    def as_openai(self) -> dict:
        """OpenAI's error entry, its text escaped (`text.shown`) and cut to `MAX_ERROR_TEXT`: it is kept in
        PostgreSQL's jsonb and returned with the batch, so no text a line quotes may grow it."""
        return {"code": shown(self.code), "message": _bounded(self.message),
                "param": _bounded(self.param) if self.param is not None else None, "line": self.line}


def _bounded(text: str) -> str:
    shown_text = shown(text)
    return shown_text if len(shown_text) <= MAX_ERROR_TEXT else shown_text[:MAX_ERROR_TEXT - 1] + "…"


@dataclass(slots=True, frozen=True)
class Checked:
    num_lines: int  # the requests of a file without errors (0 with any)
    errors: list[LineError]
    model: str | None  # the endpoint every line names (itself, or one of its adapters)
    num_custom_id_bytes: int = 0  # its requests' custom ids as JSON strings (ASCII, as the error file writes them)


# A line's `body.model` checked (`parse_lines`): the refusal (OpenAI's error: `model_not_found`, a model of the other
# task) or None.
ModelCheck = Callable[[str], gateway_errors.OpenAIError | None]


# Whitespace as `str.isspace` (and `str.strip`) finds it: a line of it alone is blank (`_requests`). None lies past
# U+FFFF; one Python adds there is found a line at a time, as before (never skipped where the check counted it).
_WHITESPACE = [chr(code) for code in range(0x10000) if chr(code).isspace()]
# A run of blank lines, in UTF-8: the ASCII ones (`bytes.strip`'s) first. NOTE: possessive (`++`, `*+`): else the
# nested repeat's matches are tried again in every split as a `fullmatch` fails (a blank-looking line that is not).
_BLANK = re.compile(b"(?:[" + re.escape(bytes(ord(char) for char in _WHITESPACE if char.isascii())) + b"]++|"
                    + b"|".join(re.escape(char.encode()) for char in _WHITESPACE if not char.isascii()) + b")*+")


# The byte-order mark Windows editors (Notepad, PowerShell's `Out-File -Encoding utf8`) write at a UTF-8 file's start.
UTF8_BOM = b"\xef\xbb\xbf"
# The byte-order marks a UTF-16 file starts with (little-endian first: PowerShell 5's `>` and `Out-File` default; a
# UTF-32 one starts with the same bytes).
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
UTF16_REFUSAL = ("The input file is UTF-16 (it starts with a UTF-16 byte-order mark): save it as UTF-8, one JSON "
                 "request a line.")


def _head(parts: Iterable[bytes], size: int) -> tuple[bytes, Iterator[bytes]]:
    """At least `size` bytes of a file's start read from `parts` (fewer for a shorter file), and the parts after them."""
    parts = iter(parts)
    head = b""
    for part in parts:
        head += part
        if len(head) >= size:
            break
    return head, parts


def _without_bom(parts: Iterable[bytes]) -> Iterator[bytes]:
    """A file's parts without the byte-order mark at its start, if it has one (read across parts shorter than it).

    NOTE: a file that starts with one failed its first line as "not valid JSON" before (the whole batch refused at its
    check), so no batch checked by an earlier release has a line whose index this moves."""
    head, parts = _head(parts, len(UTF8_BOM))
    if head := head.removeprefix(UTF8_BOM):
        yield head
    yield from parts


def split_lines(parts: Iterable[bytes], *, max_line_bytes: int = MAX_BODY_BYTES) -> Iterator[tuple[int, bytes | None]]:
    """Each line of a file read in `parts` but the blank ones (split at `\\n` alone, as JSON Lines are), with its
    1-based number, a byte-order mark at the file's start dropped (`_without_bom`); None for one longer than `max_line_bytes`, whose bytes are dropped as they come: never more than a
    line held. A blank line is whitespace alone as `str.isspace` finds it (`\\r`, a Windows file's, U+00A0, U+3000 ...
    included: `_WHITESPACE`), whatever its length; one whose character a part's end splits is left to `_requests`.

    NOTE: a run of blank lines is skipped in one scan of its bytes (`_BLANK`, its `\\n`s counted for the numbers
    that follow), never a line at a time: blank lines count towards no limit (`BATCH_MAX_LINES` counts requests), and a
    32 MiB file of `\\n` took ~11 s of a worker's CPU at its validation and again at each run, 33 million lines each
    split, decoded and stripped; 20 MiB of `\\x1c\\n` (or U+00A0) lines, skipped a line at a time by `_requests` while
    only ASCII whitespace was skipped here, 28 s (19 s)."""
    number, carried, size, oversized, blank = 0, [], 0, False, True  # the line so far: its bytes, too long, blank
    for part in _without_bom(parts):
        start = 0
        while True:
            if not size and (run_end := part.rfind(b"\n", start, _BLANK.match(part, start).end())) >= 0:
                number += part.count(b"\n", start, run_end + 1)  # at a line's start: the blank lines from here
                start = run_end + 1
            end = part.find(b"\n", start)
            if end < 0:
                break
            number += 1
            piece = part[start:end]
            if size and blank and _BLANK.fullmatch(piece):
                pass  # a blank line begun in an earlier part (one begun in this one was skipped above)
            elif oversized or size + len(piece) > max_line_bytes:
                yield number, None
            else:
                yield number, b"".join((*carried, piece)) if carried else piece
            carried, size, oversized, blank, start = [], 0, False, True, end + 1
        rest = part[start:]
        blank = blank and _BLANK.fullmatch(rest) is not None
        size += len(rest)
        if size > max_line_bytes:
            carried, oversized = [], True
        elif rest and not oversized:
            carried.append(rest)
    if size and not blank:
        yield number + 1, None if oversized else b"".join(carried)


def _requests(parts: Iterable[bytes]) -> Iterator[tuple[int, bytes | None, str | None]]:
    """Each line of a file but the blank ones (its requests, as `Line.index` counts them): its number, its bytes (None:
    too large) and its text (None: too large, or not UTF-8). A blank line is whitespace alone as `str.strip` finds it:
    skipped by `split_lines` a run at a time, and here a line at a time one it left (a character split by a part's end).

    NOTE: which lines are blank decides every request's index (`Line.index`: its result's key, its row's `id`, its
    usage row's request id), and a batch checked by one release is run by the next: a line of other whitespace alone
    counted as a request shifted the indexes of the lines after it in a batch checked before, which then ran (and were
    billed) again under the index of the line before them. `str.isspace` is `str.strip`'s whitespace, and reads a line
    only up to its first other character."""
    for number, raw in split_lines(parts):
        try:
            text = raw.decode("utf-8") if raw is not None else None
        except UnicodeDecodeError:
            text = None
        if text is None or (text and not text.isspace()):
            yield number, raw, text


def parse_lines(parts: Iterable[bytes], *, request_path: str, kind: str, max_lines: int,
                check_model: ModelCheck | None = None) -> Checked:
    """Check a file read in `parts`, a line at a time; each line's `body.model` by `check_model` (the caller's
    lookup, once a name), and all of them naming the same endpoint (itself or its adapters: `model`). What is kept
    besides a line is its custom id: a file is never held whole, nor its lines parsed (a 200 MiB input held as bytes,
    text and lines, then parsed, took a batch worker several times its memory limit)."""
    num_lines = 0
    problems: list[LineError] = []
    seen: set[str] = set()
    # NOTE: each name looked up once, and only while errors are still listed: every unknown name is an error, so at
    # most `MAX_ERRORS` of them and the endpoint's own names are ever looked up, however many lines name others.
    checked_models: dict[str, gateway_errors.OpenAIError | None] = {}
    served: str | None = None  # the endpoint the first line with a known model names
    num_custom_id_bytes = 0
    head, rest = _head(parts, max(len(mark) for mark in UTF16_BOMS))
    parts = itertools.chain((head,), rest)
    if head.startswith(UTF16_BOMS):
        # NOTE: split at its `\n` bytes, each line after the first began with the NUL of the `\n` before it: the
        # first was "not UTF-8 text", the others "not valid JSON", and one more line counted than the file has.
        return Checked(0, [LineError(1, "invalid_encoding", UTF16_REFUSAL)], None)

    def refuse(number: int, code: str, message: str, param: str | None = None) -> None:
        if len(problems) < MAX_ERRORS:
            problems.append(LineError(number, code, message, param))

    for number, raw, text in _requests(parts):
        num_lines += 1
        if num_lines > max_lines:
            return Checked(0, [LineError(number, "too_many_requests", f"A batch may hold at most {max_lines} requests.")],
                           None)
        # NOTE: its size before the line is decoded, as the gateway refuses such a body before decoding it: one line
        # of 15 MiB of `{},` took a batch worker ~1.2 GiB (its container's limit, with every other tenant's run in it).
        if raw is None:
            refuse(number, "line_too_large", f"A line may hold at most {MAX_BODY_BYTES} bytes, as a request may.")
            continue
        if text is None:
            refuse(number, "invalid_json", "This line is not UTF-8 text.")
            continue
        if has_too_many_json_items(text):
            refuse(number, "line_too_large", f"A line may hold at most {MAX_JSON_ITEMS:,} JSON elements, as a request may.")
            continue
        try:
            request = json.loads(text)
        except (ValueError, RecursionError):
            refuse(number, "invalid_json", "This line is not valid JSON.")
            continue
        if not isinstance(request, dict):
            refuse(number, "invalid_request", "Each line must be a JSON object.")
            continue
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            refuse(number, "missing_required_parameter", "Each line needs a custom_id string.", "custom_id")
            continue
        if len(custom_id) > MAX_CUSTOM_ID:
            # NOTE: said "Each line needs a custom_id string." of a line that had one, too long
            refuse(number, "invalid_value", f"The custom_id may hold at most {MAX_CUSTOM_ID} characters; this one has "
                                            f"{len(custom_id):,}.", "custom_id")
            continue
        if not is_plain(custom_id):
            refuse(number, "invalid_value", "The custom_id must not contain control characters (such as NUL) or "
                                            "lone surrogates.", "custom_id")
            continue
        if custom_id in seen:
            refuse(number, "duplicate_custom_id", f"The custom_id '{custom_id}' appears more than once.", "custom_id")
            continue
        seen.add(custom_id)
        num_custom_id_bytes += len(json.dumps(custom_id))
        if request.get("method") != "POST":
            refuse(number, "invalid_method", "The method must be POST.", "method")
            continue
        if request.get("url") != request_path:
            refuse(number, "invalid_url", f"The url must be the batch's endpoint, {request_path}.", "url")
            continue
        body = request.get("body")
        if not isinstance(body, dict):
            refuse(number, "invalid_request", "The body must be a JSON object.", "body")
            continue
        if body.get("stream"):
            refuse(number, "invalid_request", "Batch requests cannot stream.", "body.stream")
            continue
        if body.get("priority") is not None:
            # NOTE: a line runs at the batch's engine priority (`scheduling.BATCH_ENGINE_PRIORITY`), never its own: one
            # that named any, 0 included, passed here and then failed as it ran (`priority_not_allowed`, the runner
            # parsing it as a key that may set none), every line of the batch.
            refuse(number, "priority_not_allowed", "Batch requests cannot set 'priority': a batch's lines run at the "
                                                   "batch priority, after interactive calls.", "body.priority")
            continue
        try:
            payload = parse_payload(json.dumps(body).encode(), kind)
        except gateway_errors.OpenAIError as exc:
            refuse(number, exc.code or "invalid_request", exc.message, f"body.{exc.param}" if exc.param else "body")
            continue
        model = payload["model"]
        if check_model is not None and len(problems) < MAX_ERRORS:
            if model not in checked_models:
                checked_models[model] = check_model(model)
            if (refusal := checked_models[model]) is not None:
                # NOTE: this line alone, as OpenAI lists a bad line: an adapter of another endpoint or organisation,
                # or one deleted, failed every line of the batch as it ran (or the whole batch as one unknown model)
                refuse(number, refusal.code or "invalid_request", refusal.message, "body.model")
                continue
        endpoint_name = split_model_name(model)[0]
        if served is None:
            served = endpoint_name
        elif endpoint_name != served:
            refuse(number, "mismatched_model", f"Every request of a batch must name the same endpoint, '{served}' (or "
                                               f"one of its adapters, as '{served}:<adapter>').", "body.model")
    if not num_lines:
        return Checked(0, [LineError(1, "empty_file", "The input file has no requests.")], None)
    return Checked(num_lines if not problems else 0, problems, served, num_custom_id_bytes)



def first_model(start: bytes, *, is_whole_file: bool) -> str | None:
    """The `body.model` of the first request in `start`, a file's first bytes (all of them: `is_whole_file`), when that
    line is whole there, reads as one and names a model the gateway would look up (`is_model_name`: PostgreSQL refuses
    a NUL or a lone surrogate, and such a name was a 500 at the batch's creation); every line is `parse_lines`'s to
    judge. NOTE: only the first line that is not blank is cut out of `start`, never the whole of it split into lines."""
    start = start.removeprefix(UTF8_BOM)
    begin = _BLANK.match(start).end()
    if begin == len(start):
        return None
    end = start.find(b"\n", begin)
    if end < 0:
        if not is_whole_file:
            return None  # it may go on past `start`
        end = len(start)
    try:
        text = start[begin:end].decode("utf-8")
        request = json.loads(text) if not has_too_many_json_items(text) else None
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    body = request.get("body") if isinstance(request, dict) else None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and is_model_name(model) else None


def read_lines(parts: Iterable[bytes], *, skip: Container[int] = ()) -> Iterator[Line]:
    """The requests of a file `parse_lines` accepted, read a line at a time, but those whose index is in `skip` (parsed
    only when not skipped). A line that no longer reads as it did gives an empty body: the gateway's own checks
    refuse it when it runs, and it ends as a failed line rather than never ending."""
    for index, (_, _, text) in enumerate(_requests(parts)):
        if index in skip:
            continue
        try:
            request = json.loads(text) if text is not None else {}
        except (ValueError, RecursionError):
            request = {}
        request = request if isinstance(request, dict) else {}
        custom_id, body = request.get("custom_id"), request.get("body")
        yield Line(index, custom_id if isinstance(custom_id, str) else "", body if isinstance(body, dict) else {})
