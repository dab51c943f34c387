"""The web process's access log: one line per HTTP request the console, the management API and the agent
API answer, and per `/v1` answer that is not an inference call.

uvicorn's own access line is off in the web process (`controlplane.serve`): it cost the gateway ~150–300 µs
of CPU per inference call (`bench/results/gateway_profile.md`, round 4) and repeated what the gateway's own
request line (`endpoints.gateway.call`, with the request id, organisation, key, endpoint, replica and tokens)
already says. Everything else is logged here, refusals on `/v1` included (a bad key, a rate limit), so
an operator still sees every request that reached the pod.

The line is `<client> "<METHOD> <path>" <status> <duration_ms>ms`, plus the request id where there is one,
on the `inferplane.access` logger. The query string is never logged: it may carry a token. Nor is a token
in the path (a password reset's, an email verification's, an invitation's link): every URL pattern with a
parameter named in `SECRET_PATH_PARAMETERS` has it written as `<name>` (`/reset/MQ/<token>/`). The path is decoded
(`%0a` is a line break): its control characters are written escaped (`\\n`), so a line is one line.
"""

from __future__ import annotations

import functools
import logging
import re
import time

from django.urls import Resolver404, URLResolver, get_resolver, resolve

from controlplane.text import shown

logger = logging.getLogger("inferplane.access")

# URL parameters whose value is a secret: a link mailed to one person.
SECRET_PATH_PARAMETERS = frozenset({"token"})
# The scope key under which the gateway names a request it hands to Django (the Files and Batch APIs), so that its
# access line carries the id its answer's `x-request-id` does.
REQUEST_ID_SCOPE_KEY = "inferplane.request_id"
_PARAMETER = re.compile(r"<(?:\w+:)?(\w+)>|\(\?P<(\w+)>")


def _routes(patterns, prefix: str = ""):
    for pattern in patterns:
        route = prefix + str(pattern.pattern)
        if isinstance(pattern, URLResolver):
            yield from _routes(pattern.url_patterns, route)
        else:
            yield route


@functools.cache
def _secret_prefixes() -> tuple[str, ...]:
    """The literal start of each route with a secret parameter (`/reset/`): only paths starting so are resolved."""
    prefixes = set()
    for route in _routes(get_resolver().url_patterns):
        parameters = {name for match in _PARAMETER.finditer(route) for name in match.groups() if name}
        if parameters & SECRET_PATH_PARAMETERS:
            prefixes.add("/" + re.split(r"[<(\[\\^$?*+]", route.lstrip("^"), maxsplit=1)[0])
    return tuple(sorted(prefixes))


def prepare() -> None:
    """Read the URL conf now (a web process's startup), not at the first access line.

    NOTE: the URL conf imports every view, the schema's and the admin's (megabytes, seconds): read at the first line
    written, that request paid for it (a refused caller's first 401 took 5 s here, and a test of the memory a refused
    body takes measured the imports when it ran alone)."""
    _secret_prefixes()


def redacted_path(path: str) -> str:
    """`path` with the value of each secret parameter of the URL pattern it matches written as `<name>`."""
    if not path.startswith(_secret_prefixes()):
        return path
    try:
        match = resolve(path)
    except Resolver404:
        # NOTE: a link cut short or lengthened (a mail client drops the last slash: `/reset/MQ/<token>`) resolves to
        # nothing, and was logged whole: everything after the route's literal start is written as `<redacted>`.
        prefix = max((p for p in _secret_prefixes() if path.startswith(p)), key=len)
        return prefix + "<redacted>" if len(path) > len(prefix) else path
    secrets = {str(value): name for name, value in match.kwargs.items() if name in SECRET_PATH_PARAMETERS}
    return "/".join(f"<{secrets[segment]}>" if segment in secrets else segment for segment in path.split("/"))


def log_answer(scope: dict, status: int, started_monotonic: float, request_id: str = "") -> None:
    """One access line for the HTTP request `scope`, answered with `status`."""
    if not logger.isEnabledFor(logging.INFO):
        return
    client = scope.get("client")
    logger.info(
        '%s "%s %s" %d %.1fms%s', f"{client[0]}:{client[1]}" if client else "-", scope.get("method", "-"),
        shown(redacted_path(scope.get("path", "-"))), status, (time.monotonic() - started_monotonic) * 1000,
        f" request_id={request_id}" if request_id else "",
    )


class AccessLog:
    """ASGI middleware: an access line for each HTTP request `app` answers (status 0: none was sent)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        status = 0

        async def send_noting_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            log_answer(scope, status, started, scope.get(REQUEST_ID_SCOPE_KEY, ""))
