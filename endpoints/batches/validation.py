"""A batch's input file, checked line by line before any line runs.

Every line must be a JSON object `{"custom_id", "method": "POST", "url", "body"}` whose `custom_id` is a
unique string without control characters or lone surrogates, whose `url` is the batch's endpoint, and whose `body` the gateway would accept for that
path (`endpoints.gateway.request.parse_payload`: the same checks as an interactive call) with a
`model` naming one of the organisation's endpoints, the same for every line, and no `stream`. A file
with any bad line fails the whole batch with one error per bad line (OpenAI's `errors.data`), and
nothing runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from endpoints.batches.text import is_plain, shown
from endpoints.gateway import errors as gateway_errors
from endpoints.gateway.request import MAX_BODY_BYTES, MAX_JSON_ITEMS, has_too_many_json_items, parse_payload

MAX_ERRORS = 100  # errors reported per batch; the rest of a bad file is not listed
MAX_CUSTOM_ID = 512


@dataclass(slots=True, frozen=True)
class Line:
    index: int  # 0-based line number among the file's non-empty lines
    custom_id: str
    body: dict


@dataclass(slots=True, frozen=True)
class LineError:
    line: int  # 1-based, as OpenAI reports it
    code: str
    message: str
    param: str | None = None

    def as_openai(self) -> dict:
        """OpenAI's error entry, its text escaped (`text.shown`): it is kept in PostgreSQL's jsonb."""
        return {"code": shown(self.code), "message": shown(self.message),
                "param": shown(self.param) if self.param is not None else None, "line": self.line}


@dataclass(slots=True, frozen=True)
class Checked:
    lines: list[Line]
    errors: list[LineError]
    model: str | None


def parse_lines(data: bytes, *, request_path: str, kind: str, max_lines: int) -> Checked:
    """The file's lines, or the errors that refuse it (model lookup is the caller's: `model`)."""
    lines: list[Line] = []
    problems: list[LineError] = []
    seen: set[str] = set()
    models: set[str] = set()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return Checked([], [LineError(1, "invalid_json", "The file is not UTF-8 text.")], None)
    raw_lines = [(number, raw) for number, raw in enumerate(text.splitlines(), start=1) if raw.strip()]
    if not raw_lines:
        return Checked([], [LineError(1, "empty_file", "The input file has no requests.")], None)
    if len(raw_lines) > max_lines:
        return Checked([], [LineError(max_lines + 1, "too_many_requests",
                                      f"A batch may hold at most {max_lines} requests.")], None)

    def refuse(number: int, code: str, message: str, param: str | None = None) -> None:
        if len(problems) < MAX_ERRORS:
            problems.append(LineError(number, code, message, param))

    for number, raw in raw_lines:
        # NOTE: before the line is decoded, as the gateway refuses such a body before decoding it: one line of 15 MiB
        # of `{},` took a batch worker ~1.2 GiB (its container's limit, with every other tenant's run in it).
        if len(raw) > MAX_BODY_BYTES or (len(raw) > MAX_BODY_BYTES // 4
                                          and len(raw.encode("utf-8", "surrogatepass")) > MAX_BODY_BYTES):
            refuse(number, "line_too_large", f"A line may hold at most {MAX_BODY_BYTES} bytes, as a request may.")
            continue
        if has_too_many_json_items(raw):
            refuse(number, "line_too_large", f"A line may hold at most {MAX_JSON_ITEMS:,} JSON elements, as a request may.")
            continue
        try:
            request = json.loads(raw)
        except (ValueError, RecursionError):
            refuse(number, "invalid_json", "This line is not valid JSON.")
            continue
        if not isinstance(request, dict):
            refuse(number, "invalid_request", "Each line must be a JSON object.")
            continue
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
            refuse(number, "missing_required_parameter", "Each line needs a custom_id string.", "custom_id")
            continue
        if not is_plain(custom_id):
            refuse(number, "invalid_value", "The custom_id must not contain control characters (such as NUL) or "
                                            "lone surrogates.", "custom_id")
            continue
        if custom_id in seen:
            refuse(number, "duplicate_custom_id", f"The custom_id '{custom_id}' appears more than once.", "custom_id")
            continue
        seen.add(custom_id)
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
        try:
            payload = parse_payload(json.dumps(body).encode(), kind)
        except gateway_errors.OpenAIError as exc:
            refuse(number, exc.code or "invalid_request", exc.message, f"body.{exc.param}" if exc.param else "body")
            continue
        models.add(payload["model"])
        lines.append(Line(len(lines), custom_id, payload))
    if not problems and len(models) > 1:
        problems.append(LineError(1, "mismatched_model", "Every request of a batch must name the same model.", "body.model"))
    return Checked(lines if not problems else [], problems, next(iter(models)) if len(models) == 1 else None)
