"""A body is taken in UTF-8 (or its ASCII and Latin-1 subsets) only: a request whose type names another `charset` (a form,
a multipart body, any other) is refused with a 400 before anything reads it, in the shape of where it was sent (OpenAI's on `/v1/`, DRF's
`{"detail"}` on `/api/`, the plain 400 page on the console and the rest).

Browsers, Django's test client, httpx, requests and curl send a form with no `charset`; jQuery says `UTF-8`, Apache's
HttpClient `ISO-8859-1` (Django itself refuses any but `utf-8` on a urlencoded `request.POST`, not DRF's parser).
NOTE: Django decodes `request.POST` (and DRF's form and multipart parsers their bodies) with the charset the request
names, any codec Python has. `charset=punycode` raises `UnicodeError` whatever the error handler: a 500
(`DjangoUnicodeDecodeError`) on every console form, anonymous log-in included, and an HTML 500 on `/v1/files`, which the
openai client retries, uploading again. `charset=utf-7` decodes `+2AA-` to a lone surrogate, past the JSON parser's
refusal (`controlplane.lone_surrogates`): a 400 echoing it made DRF's renderer raise (a 500), and a field could carry
it to PostgreSQL. The gateway's own `/v1` paths never reach Django and read only JSON.
"""

from __future__ import annotations

import codecs

from asgiref.sync import iscoroutinefunction
from django.http import HttpResponse, HttpResponseBadRequest, JsonResponse

from controlplane.accounts.middleware import AsyncCapableMiddleware
from endpoints.gateway import errors

TAKEN = frozenset({"utf-8", "ascii", "iso8859-1"})  # codecs' names: `utf8`, `US-ASCII`, `latin1` are these
MESSAGE = "The body's charset is not one this service takes: send a form in UTF-8."
# NOTE: not `django.views.defaults.bad_request`: it runs the CSRF check, which reads `request.POST`.
PAGE = ("<!doctype html><html lang=\"en\"><head><title>Bad Request (400)</title></head><body><h1>Bad Request (400)</h1>"
        f"<p>{MESSAGE}</p></body></html>")


def refused(request) -> bool:
    """Whether `request` names a `charset` that is not UTF-8 or a subset of it, whatever its content type.

    NOTE: every type, not only the two form types: DRF picks its parser by matching a wildcard in the request's type
    (`*/x-www-form-urlencoded`, `multipart/*` go to its form parsers, which decode with the charset named), and
    Django decodes the query string with it too; an exact match of the form types let those through to a 500 (a
    review's finding). JSON names UTF-8, or nothing."""
    if "charset" not in request.content_params:
        return False
    try:
        return codecs.lookup(request.content_params["charset"]).name not in TAKEN
    except (LookupError, ValueError):  # NOTE: a name Python has no codec for; ValueError: one with a NUL
        return True


def refusal(request) -> HttpResponse:
    if request.path_info.startswith("/v1/"):
        # NOTE: `x-should-retry: false`: the openai client retries a 5xx or a 409/429, uploading the same file again.
        error = errors.invalid_request(MESSAGE)
        response = HttpResponse(error.body(), status=400, content_type="application/json")
        response["x-should-retry"] = "false"
        return response
    if request.path_info.startswith("/api/"):
        return JsonResponse({"detail": MESSAGE}, status=400)
    return HttpResponseBadRequest(PAGE)


class FormCharsetMiddleware(AsyncCapableMiddleware):
    """Refuses a body in a charset other than UTF-8 (`refused`), before the session, CSRF or a view reads it."""

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return refusal(request) if refused(request) else self.get_response(request)

    async def __acall__(self, request):
        return refusal(request) if refused(request) else await self.get_response(request)
