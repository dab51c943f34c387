"""CORS on `/v1`: browser clients (the `openai` JS package with `dangerouslyAllowBrowser`, a chat UI calling the API
from its page, a notebook in the browser) call with an API key from any origin, as OpenAI's API lets them.

A page of another origin may: send a key-authenticated call to any `/v1` path, with the request headers OpenAI's
clients send (`ALLOWED_REQUEST_HEADERS`, `ALLOWED_REQUEST_HEADER_PREFIXES`), and read its answer, error or stream,
with the headers those clients read (`EXPOSED_HEADERS`). It may not ride the console's session cookie:
`Access-Control-Allow-Credentials` is never sent, so a browser sends no credentialed request that needs a preflight
and lets no page read a credentialed answer; `x-csrftoken` (the session path's header) is never allowed; and the
session path itself refuses a call whose `Origin` is not the console's (`auth.caller_from_session`), whatever the
browser. `/api/v1` and the console answer no CORS.

A preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) is answered from its path and headers alone:
no key lookup, no Redis, no database. An actual call's answer carries the CORS headers only when the call sent
`Origin` (every browser's cross-origin call does): a call without one (every server-side client) gets none.

Every `/v1` answer, a preflight's, an error's, and one to a call without `Origin` too, says `Vary: Origin` (merged
into a `Vary` it already has, as Django's answers do: `answer_headers`): since its CORS headers depend on the call's
`Origin`, a shared cache or CDN must not hand an answer stored for one caller to a caller that sent another (Fetch,
"CORS protocol and HTTP caches"). NOTE: without it, an answer stored for a server-side client (no CORS headers) was
served to a page, which the browser then refused to show.
"""

from __future__ import annotations

import re

from endpoints.gateway import anatomy, responses, standing
from endpoints.gateway.ratelimit_headers import HEADER_NAMES as RATELIMIT_HEADER_NAMES

ORIGIN_HEADER = "origin"
REQUEST_METHOD_HEADER = "access-control-request-method"
REQUEST_HEADERS_HEADER = "access-control-request-headers"
# How long a browser may reuse a preflight's answer: Chromium's cap (Firefox's is a day).
MAX_AGE_S = 7200

# Request headers a page may send: OpenAI's clients' (openai-node sends `x-stainless-*`, `openai-organization`,
# `openai-project`, `openai-beta`, and `idempotency-key` on its retries; Firefox lets it set `user-agent`), tracing's,
# and the gateway's own request options (`standing`, `anatomy`). NOTE: never `x-csrftoken` or
# `x-inferplane-organization`: they are the console session's, which no other origin may use.
ALLOWED_REQUEST_HEADERS = frozenset({
    "authorization", "content-type", "accept", "accept-language", "content-language", "user-agent",
    "idempotency-key", "traceparent", "tracestate", "x-request-id",
    standing.WAIT_FOR_CAPACITY_HEADER, anatomy.PROGRESS_HEADER,
})
ALLOWED_REQUEST_HEADER_PREFIXES = ("openai-", "x-stainless-")
# At most this many names of `Access-Control-Request-Headers` are read, each at most this long: a preflight's cost is
# bounded whatever it asks for.
MAX_REQUESTED_HEADERS = 64
MAX_HEADER_NAME_CHARS = 128
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")  # an HTTP token (RFC 9110, 5.6.2), lowercased

# Answer headers a page may read (beyond those every browser shows: `content-type` and the like): what the openai
# clients read (`x-request-id` as `_request_id`, `retry-after`, `x-should-retry`), the rate limits, an upload's
# replay mark and a cold start's time.
EXPOSED_HEADERS = ("x-request-id", *RATELIMIT_HEADER_NAMES, "retry-after", "x-should-retry", "idempotent-replayed",
                   anatomy.HEADER.decode())

# Every answer to a call that sent `Origin`.
ANSWER_HEADERS = [(b"access-control-allow-origin", b"*"),
                  (b"access-control-expose-headers", ", ".join(EXPOSED_HEADERS).encode())]

# The methods each `/v1` path takes, as its 405 names them (`errors.method_not_allowed`; tests/gateway/test_cors.py
# holds the two to each other). A path nothing serves is told every method: its 404 is then read by the page rather
# than hidden behind a failed preflight.
_GET = ("GET", "HEAD")
_POST = ("POST",)
_ANY = ("GET", "HEAD", "POST", "DELETE")
_METHODS_BY_PATH = {
    "/v1/models": _GET, "/v1/chat/completions": _POST, "/v1/completions": _POST, "/v1/embeddings": _POST,
    responses.PATH: _POST, "/v1/files": ("GET", "HEAD", "POST"), "/v1/batches": ("GET", "HEAD", "POST"),
}
# Paths with one id in them: (prefix, suffix) -> methods.
_METHODS_BY_ID_PATH = {
    ("/v1/models/", ""): _GET,
    ("/v1/files/", ""): ("GET", "HEAD", "DELETE"),
    ("/v1/files/", "/content"): _GET,
    ("/v1/batches/", ""): _GET,
    ("/v1/batches/", "/cancel"): _POST,
}


def methods_of(path: str) -> tuple[str, ...]:
    """The methods the `/v1` path takes."""
    methods = _METHODS_BY_PATH.get(path)
    if methods is not None:
        return methods
    for (prefix, suffix), methods in _METHODS_BY_ID_PATH.items():
        if path.startswith(prefix) and path.endswith(suffix):
            name = path[len(prefix):len(path) - len(suffix)]
            if name and "/" not in name:
                return methods
    return _ANY  # a stored response's route (a 400 saying why) or a path nothing serves (a 404)


def is_preflight(method: str, headers: dict[str, str]) -> bool:
    """Whether a request is a browser's CORS preflight (Fetch, "CORS-preflight request"); a plain `OPTIONS` is not,
    and is answered as before (405 naming the path's methods)."""
    return method == "OPTIONS" and ORIGIN_HEADER in headers and REQUEST_METHOD_HEADER in headers


def preflight_headers(path: str, headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """The headers of a preflight's 204: any origin, the path's methods, the requested headers that are allowed, for
    `MAX_AGE_S`; never `Access-Control-Allow-Credentials`. A header asked for that is not allowed is left out: the
    browser then refuses the call, naming it in its console."""
    answer = [(b"access-control-allow-origin", b"*"),
              (b"access-control-allow-methods", ", ".join(methods_of(path)).encode()),
              (b"access-control-max-age", str(MAX_AGE_S).encode()),
              # NOTE: the answer depends on the headers asked for, and whether it is a preflight at all (or a plain
              # `OPTIONS`'s 405) on `Origin` and the method asked for: a cache must not hand it to another request
              (b"vary", b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers")]
    allowed = allowed_request_headers(headers.get(REQUEST_HEADERS_HEADER, ""))
    if allowed:
        answer.append((b"access-control-allow-headers", ", ".join(allowed).encode()))
    return answer


def allowed_request_headers(requested: str) -> list[str]:
    """The names in `requested` (`Access-Control-Request-Headers`) a page may send, each once, as asked."""
    allowed: list[str] = []
    for name in requested.split(",", MAX_REQUESTED_HEADERS)[:MAX_REQUESTED_HEADERS]:
        name = name.strip().lower()
        if (len(name) <= MAX_HEADER_NAME_CHARS and _HEADER_NAME.fullmatch(name) and name not in allowed
                and (name in ALLOWED_REQUEST_HEADERS or name.startswith(ALLOWED_REQUEST_HEADER_PREFIXES))):
            allowed.append(name)
    return allowed



def answer_headers(headers, *, from_a_page: bool) -> list[tuple[bytes, bytes]]:
    """The headers of an actual call's answer (`headers`, as the ASGI start message holds them) with what CORS adds:
    `Origin` in its `Vary`, merged into the first `Vary` it has (one naming it already, or `*`, is left as it is), and,
    for a call that sent `Origin` (`from_a_page`), `ANSWER_HEADERS`."""
    headers = [(name, value) for name, value in headers]
    named = {token.strip().lower() for name, value in headers if name.lower() == b"vary" for token in value.split(b",")}
    if not named & {b"origin", b"*"}:
        for index, (name, value) in enumerate(headers):
            if name.lower() == b"vary":
                headers[index] = (name, value + b", Origin" if value.strip() else b"Origin")
                break
        else:
            headers.append((b"vary", b"Origin"))
    if from_a_page:
        headers += ANSWER_HEADERS
    return headers
