"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import json
import logging
import re

import django.db
import kombu.exceptions
import psycopg
import redis.exceptions

from controlplane.redis_circuit import Refused
from controlplane.redis_scripts import says_unavailable

# What a missing or silent Redis, PostgreSQL or Celery broker raises: the request gets a clean 503, never a 500 or a
# hang.
# NOTE: redis-py's replies that say the server cannot serve now (out of memory, a replica, a cluster
# reshaping) are outages too; this process's own Redis client raises `RedisUnavailable` (a
# ConnectionError) for the same replies (`controlplane.redis_scripts`). Celery's `send_task` raises kombu's
# `OperationalError` (no `ConnectionError`) once it gives up on the broker.
OUTAGES = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.OutOfMemoryError,
           redis.exceptions.ReadOnlyError, redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError,
           redis.exceptions.MasterDownError, ConnectionError, TimeoutError,
           django.db.OperationalError, django.db.InterfaceError, psycopg.OperationalError,
           kombu.exceptions.OperationalError)


def is_outage(exc: BaseException) -> bool:
    """An `OUTAGES` error, or a reply redis-py raises as a plain `ResponseError` that says Redis cannot serve
    now (`-MISCONF`, `-BUSY`, `-NOREPLICAS`, also wrapped in a script's error): a 503, never a 500."""
    return isinstance(exc, OUTAGES) or (isinstance(exc, redis.exceptions.ResponseError) and says_unavailable(str(exc)))


def log_outage(logger: logging.Logger, exc: BaseException, message: str, *args) -> None:
    """An outage's warning (`message % args`), none for a call the Redis circuit refused: it logs its opening and its
    closing, and refused calls come as fast as clients send them (`controlplane.redis_circuit.Refused`)."""
    if not isinstance(exc, Refused):
        logger.warning(message, *args)


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}).encode()


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def unknown_url(method: str, path: str) -> OpenAIError:
    """A `/v1` path nothing serves: the gateway's own, or one under `/v1/files` or `/v1/batches` that Django does not."""
    return OpenAIError(404, f"Unknown URL {method} {path}.", code="unknown_url")


def method_not_allowed(method: str, path: str, allowed: tuple[str, ...]) -> OpenAIError:
    """A method a `/v1` path does not serve: 405 with the `Allow` header HTTP requires of it (RFC 9110, 15.5.6), naming
    the methods the path does serve. NOTE: it had none: HTTP clients and API checkers (Schemathesis's
    `allow_header_conformance`) could not tell which method to use. HEAD is named wherever GET is: each GET route
    answers it (`answers_as_get`), as HTTP requires of a server (RFC 9110, 9.1 and 9.3.2)."""
    if "GET" in allowed and "HEAD" not in allowed:
        allowed = ("GET", "HEAD", *(name for name in allowed if name != "GET"))
    return OpenAIError(405, f"Method {method} not allowed on {path}.", headers={"allow": ", ".join(allowed)})


def answers_as_get(method: str) -> bool:
    """Whether a `/v1` GET route serves `method`: GET, and HEAD, answered as GET is without its body (RFC 9110, 9.3.2;
    the server sends none). NOTE: HEAD was a 405 whose `Allow` named GET alone, on every route a GET serves."""
    return method in ("GET", "HEAD")


def invalid_api_key(message: str = "Incorrect API key provided.") -> OpenAIError:
    return OpenAIError(401, message, type="invalid_request_error", code="invalid_api_key")


def missing_scope() -> OpenAIError:
    return OpenAIError(403, "This API key lacks the 'inference' scope.", type="permission_error", code="insufficient_permissions")


def role_forbids_inference() -> OpenAIError:
    return OpenAIError(403, "Viewers may not run inference: this key's creator (or this session's user) is a viewer "
                            "in the organisation; an admin can grant the member role.",
                       type="permission_error", code="insufficient_permissions")


def no_longer_member(message: str) -> OpenAIError:
    """A console session (the playground) whose chosen organisation is no longer its user's, or that never chose one
    (the gateway writes no session: the console pins one): it acts in none until they choose
    (`controlplane.accounts.tenancy.chosen_membership`), never in another they belong to."""
    return OpenAIError(403, message, type="permission_error", code="insufficient_permissions")


def organization_closed(message: str) -> OpenAIError:
    """A console session (the playground) acting in an organisation its owner closed
    (`controlplane.accounts.services.ORGANIZATION_CLOSED`)."""
    return OpenAIError(403, message, type="permission_error", code="organization_closed")


def cross_origin_session() -> OpenAIError:
    """A call riding a console session (the playground's path) from a page of another origin than the console's: a
    hostile page must never spend a signed-in user's money or read their answers (`auth.caller_from_session`). Pages of
    other origins call with an API key (`endpoints.gateway.cors`)."""
    return OpenAIError(403, "A console session may call /v1 only from the console's own pages; from another site, "
                            "send an API key ('Authorization: Bearer <API key>').",
                       type="permission_error", code="cross_origin_session", headers={"x-should-retry": "false"})


def page_organization_switched() -> OpenAIError:
    """A playground call from a page shown for another organisation than the one its session now acts in (switched
    in another tab): refused before its body is read, so nothing is run, reserved or charged. `x-should-retry:
    false`: sending it again cannot succeed; reloading the page can."""
    return OpenAIError(409, "This playground was opened for another organisation than the one this session now acts "
                            "in (switched in another tab). Reload the page. Nothing was run or charged.",
                       code="organization_switched", headers={"x-should-retry": "false"})


def model_not_found(name: str) -> OpenAIError:
    return OpenAIError(404, f"The model '{name}' does not exist or you do not have access to it.", param="model", code="model_not_found")


def prompt_factor_note(factor) -> str:
    """Said after a refusal that the call's reservation caused (a 429 for its tokens, a 402 for its cost), when its
    endpoint learned a prompt factor (`endpoints.models.PromptFactor`): that is why the reservation is so large."""
    if factor is None:
        return ""
    return (f" Prompts at this endpoint are reserved {factor.normalize():f}× their estimate since a prompt ran past "
            "it; staff can reset it.")


def insufficient_quota(message: str) -> OpenAIError:
    return OpenAIError(402, message, type="insufficient_quota", code="insufficient_quota")


def rate_limited(message: str, retry_after_s: int) -> OpenAIError:
    return OpenAIError(429, message, type="requests", code="rate_limit_exceeded", headers={"retry-after": str(max(1, retry_after_s))})


class RequestTooLarge(OpenAIError):
    """A request whose worst case (prompt and `max_tokens`) passes its key's whole minute of tokens, in OpenAI's shape
    for it: 429, type `tokens`, code `rate_limit_exceeded`, no `param`, and no `retry-after` (waiting admits it no
    sooner). OpenAI's clients raise their rate-limit error for it, as for OpenAI's own, and routers that fall back to a
    deployment with more tokens per minute on that error do so; `x-should-retry: false` keeps openai-python from
    retrying it.

    NOTE: retrying cannot admit it, so the batch runner fails such a line for good by this class (`runner.run_line`),
    not by its status (a 429 it would try again until the batch expired). It was a 400 `request_too_large` naming
    `max_tokens` for a while: not OpenAI's shape (openai-python raised BadRequestError), and wrong for embeddings."""

    def __init__(self, message: str):
        super().__init__(429, message, type="tokens", code="rate_limit_exceeded", headers={"x-should-retry": "false"})


def no_capacity(message: str, retry_after_s: int = 5) -> OpenAIError:
    return OpenAIError(503, message, type="server_error", code="no_capacity", headers={"retry-after": str(retry_after_s)})


def endpoint_paused(name: str) -> OpenAIError:
    """A call to an endpoint its organisation paused: refused until someone resumes it, so no retry is invited.

    NOTE: it said `retry-after: 60`, which openai-python honours (up to 60 s) and LangChain's and LlamaIndex's clients
    with it: with its default two retries a call slept two minutes and was sent three times before it raised.
    `x-should-retry: false` tells the OpenAI clients (Python and Node) not to retry it."""
    return OpenAIError(503, f"The endpoint '{name}' is paused; resume it to serve calls again.", type="server_error",
                       code="endpoint_paused", headers={"x-should-retry": "false"})


REQUEST_IN_PROGRESS_RETRY_AFTER_S = 5


def request_in_progress() -> OpenAIError:
    """A call under the id of a request still being served in this gateway process (a batch line's earlier try, still
    running): refused, never let free the running one's place; retried once that one has ended."""
    return OpenAIError(503, "A request with this id is still in progress; retry when it has ended.", type="server_error",
                       code="request_in_progress", headers={"retry-after": str(REQUEST_IN_PROGRESS_RETRY_AFTER_S)})


def upstream_failed(message: str = "The model's replica failed; please retry.") -> OpenAIError:
    return OpenAIError(502, message, type="server_error", code="upstream_error")


class EngineFailed(OpenAIError):
    """The replica's engine answered the request with an HTTP 500 of its own (or closed its connection with no answer,
    dead on it), its replica still READY (never sent to another: `InferenceCall._engine_failed`): the engine is up and
    this request fails there (a body vLLM cannot handle), as it may again. A batch line gives up after a few over a
    minute (`endpoints.batches.runner.MAX_ENGINE_FAILURES`); a replica that went away is `upstream_failed`."""


def engine_failed() -> EngineFailed:
    return EngineFailed(502, "The model's engine failed on this request; please retry.", type="server_error",
                        code="upstream_error")


ANSWER_WAIT_EXCEEDED = "answer_wait_exceeded"


def upstream_timeout() -> OpenAIError:
    return OpenAIError(504, "The model's replica stopped answering the request; please retry.", type="server_error",
                       code="upstream_timeout")


def answer_wait_exceeded(wait_s: float) -> OpenAIError:
    """A non-streamed answer still being generated after the longest a call (or a batch line) waits for one.

    NOTE: a 400, not a 504: the OpenAI clients send a 5xx again by themselves (twice by default), and each try
    would have the engine generate as long again, for nothing. As the size limit's, the fix is the request's."""
    return OpenAIError(400, f"The answer was still being generated after {wait_s:.0f} s, as long as this call may wait "
                            "for a whole answer; ask for fewer tokens or choices, or (not in a batch) for a stream "
                            "(\"stream\": true).", code=ANSWER_WAIT_EXCEEDED)


# What an answer is made of, to ask for less of, by kind of call (`request.KINDS`): a Responses call has no `n`.
_ANSWER_PARTS = {"responses": "tokens or logprobs"}
_GENERATED_PARTS = "choices, tokens or logprobs"


def response_too_large(kind: str, limit_bytes: int) -> OpenAIError:
    """A non-streamed answer past what the gateway holds whole (`upstream.MAX_WHOLE_BODY_BYTES`)."""
    what = ("send fewer inputs in one request, or ask for encoding_format \"base64\"" if kind == "embedding"
            else f"ask for it with \"stream\": true, or for fewer {_ANSWER_PARTS.get(kind, _GENERATED_PARTS)}")
    return OpenAIError(400, f"The answer is larger than {limit_bytes // 2**20} MiB, the most a non-streamed answer may "
                            f"be. The engine computed it, so its tokens are billed: {what}.", code="response_too_large")


def batch_answer_too_large(kind: str, limit_bytes: int, *, as_outside: bool = True) -> OpenAIError:
    """A batch line's answer past the most one may be (`endpoints.batches.answer_bytes`): as outside a batch
    (`upstream.MAX_WHOLE_BODY_BYTES`), or, not `as_outside`, the most a batch worker that keeps no answer on disk holds
    of one. A 400, the line's own error: run again, it would be as large."""
    what = ("send fewer inputs in one line" if kind == "embedding"
            else f"ask for fewer {_ANSWER_PARTS.get(kind, _GENERATED_PARTS)}")
    where = "" if as_outside else ", or send the request on its own, outside a batch"
    return OpenAIError(400, f"The answer is larger than {limit_bytes / 2**20:g} MiB, the most a batch line's answer may "
                            f"be. The engine computed it, so its tokens are billed: {what}{where}.",
                       code="response_too_large")


def event_too_large(limit_bytes: int) -> OpenAIError:
    """A streamed event past what the gateway relays (`sse.MAX_EVENT_BYTES`): the stream ends there."""
    return OpenAIError(400, f"An event of this stream is larger than {limit_bytes // 2**20} MiB, the most the gateway "
                            "relays (an echoed prompt with logprobs?), and the stream ends here; the tokens the engine "
                            "computed up to it are billed as it reported them. Ask for fewer logprobs, no echo, or a "
                            "shorter prompt.", code="response_too_large")


def service_unavailable(message: str = "The service is briefly unavailable; please retry.") -> OpenAIError:
    return OpenAIError(503, message, type="server_error", code="service_unavailable", headers={"retry-after": "1"})


USAGE_UNRECORDABLE_RETRY_AFTER_S = 5


def usage_unrecordable() -> OpenAIError:
    """A new call refused because its usage could not be recorded: the billing database has taken no writes for a
    while and this server's journal of usage is full (`billing.usage_writer.usage_recordable`). Its `/readyz` says not
    ready meanwhile, so a retry goes to another server."""
    return OpenAIError(503, "Usage cannot be recorded on this server now (its billing database takes no writes), so "
                            "no new call is taken; please retry.", type="server_error", code="service_unavailable",
                       headers={"retry-after": str(USAGE_UNRECORDABLE_RETRY_AFTER_S)})


def server_stopping() -> OpenAIError:
    """A call this server will not finish: it is stopping (`endpoints.gateway.drain`). Its connection is closed, so a
    retry goes to another server."""
    return OpenAIError(503, "This server is restarting and takes no new call; please retry.", type="server_error",
                       code="server_stopping", headers={"retry-after": "1", "connection": "close"})


# How vLLM says a prompt does not fit the model's context: the parameter its renderer names (`vllm.renderers.params`:
# text past its characters' bound, token ids past the context) or, from its input processor (no parameter), how its
# message starts (`vllm.v1.engine.input_processor`: "The decoder prompt (length 2100) is longer than the maximum model
# length of 2048", or "... plus the number of requested output tokens (at least 1) is longer ...").
# NOTE: the words anywhere in any 400 took another refusal for an overflow: vLLM quotes a caller's own grammar, regex or
# schema in its refusal of it (`Grammar error: {err}`), and a tenant's text holding the words was told to shorten its
# prompt (a client trimming its history on that code trimmed it for nothing, and retried the same refusal).
_ENGINE_CONTEXT_PARAMS = frozenset({"input_text", "input_tokens"})
_ENGINE_CONTEXT_MESSAGE = re.compile(
    r"This model's maximum context length is \d+ tokens\."
    r"|The \w+ prompt \(length \d+\) (?:plus the number of requested output tokens \(at least 1\) )?"
    r"is longer than the maximum model length of \d+\.")
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def engine_stream_error(data: bytes, *, prompt_param: str | None = None) -> OpenAIError:
    """An engine's error event mid-stream (`data: {"error": …}`), in OpenAI's shape: its 4xx as `engine_refused`, its 5xx
    a `server_error`.

    NOTE: vLLM writes its own type name (`InternalServerError`, `ServiceUnavailableError`) and the HTTP status as a
    numeric `code`: relayed as it was, the openai client raised an `APIError` whose `type` no client knows and whose
    `code` was a number."""
    try:
        detail = json.loads(data).get("error")
    except (ValueError, RecursionError, AttributeError):
        detail = None
    status = detail.get("code") if isinstance(detail, dict) else None
    if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599:
        status = 500
    error = engine_refused(status, json.dumps({"error": detail}).encode() if isinstance(detail, dict) else b"",
                           prompt_param=prompt_param)
    if status >= 500:
        error.type, error.param = "server_error", None
    return error


def engine_refused(status: int, body: bytes, *, prompt_param: str | None = None) -> OpenAIError:
    """The engine refused the request (a 4xx): relay its message in OpenAI's shape. A prompt too long for the model's
    context is OpenAI's `context_length_exceeded`, naming the request's prompt field (`prompt_param`: `messages`,
    `prompt`, `input`).

    NOTE: vLLM says it with its own parameter (`input_text`, which no client sent) and a numeric code, relayed as none:
    clients that tell an overflowing context by OpenAI's code (to trim the history, summarise, or fall back to a model
    with a longer context: LangChain's and LiteLLM's OpenAI clients) took it for any other 400."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = {}
    if not isinstance(data, dict):  # NOTE: an engine's 4xx body is not always an object
        data = {}
    detail = data.get("error") if isinstance(data.get("error"), dict) else data
    message = detail.get("message") or body.decode(errors="replace")[:500] or f"HTTP {status}"
    code = detail.get("code") if isinstance(detail.get("code"), str) else None
    param = detail.get("param") if isinstance(detail.get("param"), str) else None
    if status == 400 and (param in _ENGINE_CONTEXT_PARAMS
                          or (param is None and isinstance(message, str) and _ENGINE_CONTEXT_MESSAGE.match(message))):
        return OpenAIError(status, message, param=prompt_param, code=CONTEXT_LENGTH_EXCEEDED)
    return OpenAIError(status, message, param=param, code=code)
