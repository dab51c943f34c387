"""Per-request wiring for the console: the current organisation, the email-verification gate, throttles.

Each is async-capable and does its (synchronous) database or Redis work only on the requests it
concerns, so the async views behind them (the agent's long poll) pay no thread hop for them.
"""

from __future__ import annotations

import functools
import math

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.http import HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.functional import SimpleLazyObject

from controlplane.accounts import throttle
from controlplane.accounts.models import email_is_verified
from controlplane.accounts.services import client_ip
from controlplane.accounts.tenancy import session_membership


class AsyncCapableMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)


class CurrentOrganizationMiddleware(AsyncCapableMiddleware):
    """Puts the console's current membership on `request.membership`.

    Lazily, since most API calls never ask; async-capable, so the gateway's async
    views pay no thread hop for it.
    """

    def __call__(self, request):
        request.membership = SimpleLazyObject(lambda: session_membership(request))
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return self.get_response(request)

    async def __acall__(self, request):
        return await self.get_response(request)


# Paths a signed-in user with an unverified email may still reach.
UNGATED_PREFIXES = ("/verify-email/", "/logout/", "/login/", "/signup/", "/password-reset/", "/reset/", "/static/",
                    "/healthz", "/readyz", "/agent/", "/metrics")
VERIFIED_SESSION_KEY = "verified_email"


class EmailVerificationMiddleware(AsyncCapableMiddleware):
    """A signed-in user whose email is unverified sees the verify-email page and nothing else.

    The API answers such a session 403. Calls with an API key pass (only a verified user can
    mint one). Once verified, the session remembers the address, so the check costs no query.
    """

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return (self._gate(request) if _gated(request) else None) or self.get_response(request)

    async def __acall__(self, request):
        if _gated(request):
            refusal = await sync_to_async(self._gate)(request)
            if refusal is not None:
                return refusal
        return await self.get_response(request)

    @staticmethod
    def _gate(request):
        user = request.user
        if not user.is_authenticated:
            return None
        email = user.email.lower()
        if request.session.get(VERIFIED_SESSION_KEY) == email:
            return None
        if email_is_verified(user):
            request.session[VERIFIED_SESSION_KEY] = email
            return None
        if request.path.startswith("/api/"):
            return JsonResponse({"detail": "Verify your email address first: follow the link we emailed you."}, status=403)
        return redirect("verify-email")


def _gated(request) -> bool:
    # NOTE: a call with an API key has no signed-in session (`request.user` is anonymous), so the gate
    # lets it through by itself; exempting any request that carries an Authorization header let a
    # session add a meaningless one and skip verification.
    return request.path != "/" and not request.path.startswith(UNGATED_PREFIXES)


@functools.cache
def _throttled_paths() -> dict[str, tuple[throttle.Limit, ...]]:
    return {reverse(name): limits for name, limits in throttle.THROTTLED_VIEWS.items()}


class ThrottleMiddleware(AsyncCapableMiddleware):
    """Log-in, sign-up, password reset and change, resending a verification: over a limit is a 429 page.

    A log-in form (and the password change's) answers a wrong password with the form again (200) and a right one with
    a redirect: every attempt
    counts against the limits that count failures only before the view runs, and is taken out again unless the view
    answered 200 (`throttle.Attempt.refund`).
    """

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        if not _throttled(request):
            return self.get_response(request)
        subjects = _subjects(request)
        attempt, refusal = self._check(request, subjects)
        if refusal is not None:
            return refusal
        try:
            response = self.get_response(request)
        except BaseException:
            attempt.refund()
            raise
        self._note(attempt, response)
        return response

    async def __acall__(self, request):
        if not _throttled(request):
            return await self.get_response(request)
        subjects = await sync_to_async(_subjects)(request)
        attempt, refusal = await sync_to_async(self._check)(request, subjects)
        if refusal is not None:
            return refusal
        try:
            response = await self.get_response(request)
        except BaseException:
            await sync_to_async(attempt.refund)()
            raise
        await sync_to_async(self._note)(attempt, response)
        return response

    @staticmethod
    def _check(request, subjects) -> tuple[throttle.Attempt, HttpResponse | None]:
        attempt = throttle.take(_throttled_paths()[request.path], subjects)
        if attempt.retry_after_s is None:
            return attempt, None
        attempt.refund()  # refused here: no failure of the account's (nor an attacker's way to add to its count)
        response = render(request, "controlplane/throttled.html",
                          {"retry_after_min": max(1, math.ceil(attempt.retry_after_s / 60))}, status=429)
        response["Retry-After"] = str(attempt.retry_after_s)
        return attempt, response

    @staticmethod
    def _note(attempt: throttle.Attempt, response) -> None:
        """The form again (200) is a refused attempt: it stays counted; anything else (a log-in's redirect) is not."""
        if response.status_code != 200:
            attempt.refund()


def _subjects(request) -> dict[str, str]:
    """What the limits count by: the posted fields, the client address and the signed-in user, read before the view."""
    subjects = {name: value for name, value in request.POST.items() if isinstance(value, str)}
    subjects["ip"] = client_ip(request) or ""
    subjects["user"] = str(request.user.pk) if request.user.is_authenticated else ""
    return subjects


def _throttled(request) -> bool:
    return request.method == "POST" and request.path in _throttled_paths()
