"""Who is calling: an API key (`Authorization: Bearer ip_…`) or a console session.

Key lookups are cached per process for `INFERPLANE_API_KEY_CACHE_S` seconds
(keyed by the token's hash, never the token; see `endpoints.gateway.memo`), so a
revoked key stops working within that many seconds (plus one reload) while a hot
key costs no database query per call.

Bogus keys cost no more: a malformed token (wrong prefix, length or characters) is refused before
any lookup, and a well-formed one that names no usable key is remembered as refused for
`INFERPLANE_API_KEY_NEGATIVE_CACHE_S`, apart from the known keys, so sending it again costs no
query and a flood of different ones never pushes a real key out of the cache.

Bogus session cookies likewise (`controlplane.credential_lookups`): an id that names no logged-in
session is remembered as refused, and at most `MAX_SESSION_LOOKUPS` sessions are looked up at once,
so a flood of made-up cookies (with a made-up CSRF pair, which anyone can forge) holds a few worker
threads and connections, never the pool that key and endpoint lookups need.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass, field
from http.cookies import SimpleCookie

from django.conf import settings
from django.contrib.auth import HASH_SESSION_KEY, SESSION_KEY, get_user_model
from django.http import HttpRequest, HttpResponse
from django.middleware.csrf import (
    CsrfViewMiddleware,
    InvalidTokenFormat,
    _check_token_format,
    _does_token_match,
)
from django.utils.crypto import constant_time_compare

from controlplane import tokens
from controlplane.accounts.keys import API_KEY_LOOKUPS, API_KEYS_KNOWN, authenticate_api_key_with_role
from controlplane.accounts.models import Scope, email_is_verified
from controlplane.accounts.services import ORGANIZATION_CLOSED
from controlplane.accounts.sessions import SessionStore
from controlplane.accounts.tenancy import NoLongerMember, NotChosen, chosen_membership
from controlplane.clock import redis_now
from controlplane.credential_lookups import CredentialLookups, LookupsBusy
from controlplane.hot_settings import hot
from controlplane.worker_threads import in_worker_thread
from endpoints.gateway import errors
from endpoints.gateway.memo import Memo

KNOWN_KEYS_MAX = 10_000
# API keys looked up in PostgreSQL at once, per gateway process: anyone may send well-formed keys never seen before,
# each a query (`_refused_keys` catches only a key sent again).
MAX_KEY_LOOKUPS = API_KEY_LOOKUPS.slots.max_concurrent
# Keys marked known to be real (`known_credentials`) looked up at once, per gateway process, besides those: at most
# half of them one organisation's (`Memo`'s `max_concurrent_known_loads`).
MAX_KNOWN_KEY_LOOKUPS = 2 * MAX_KEY_LOOKUPS
# Console sessions looked up at once, per gateway process (the playground's traffic is light); the rest wait
# briefly, then get a 503.
MAX_SESSION_LOOKUPS = 4
# NOTE: only an id that names no logged-in session is remembered: login always issues a new id, so such an id
# never becomes valid. A real session refused for now (its e-mail not yet verified, no organisation yet) is not.
REFUSED_SESSIONS_FOR_S = 60.0
# The header naming the organisation the playground's page was shown for (`static/js/playground.js`); read on the
# session path alone, so an API key's call costs nothing more.
PAGE_ORGANIZATION_HEADER = "x-inferplane-organization"


@dataclass(slots=True, frozen=True)
class Caller:
    organization_id: int
    api_key_id: int | None  # None for a console session (the playground)
    user_id: int | None
    can_infer: bool
    requests_per_minute: int | None
    tokens_per_minute: int | None
    role: str | None = None  # the key creator's (or session user's) current role in the organisation
    max_priority_boost: int | None = None  # the key's `ApiKey.max_priority_boost`: None, no `priority` allowed
    # The key's `expires_at` in Unix seconds (None: never), judged at each call by Redis's clock (`caller_from_key`)
    expires_at: float | None = None

    # Whose rate limits a call counts against: `key:<id>`, or `user:<id>` for a console session. Formed once, here (a
    # property formed it at each of a call's three reads).
    limit_subject: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "limit_subject", f"key:{self.api_key_id}" if self.api_key_id is not None
                           else f"user:{self.user_id}")




def _lookup_key(plain: str) -> Caller | None:
    authenticated = authenticate_api_key_with_role(plain)
    if authenticated is None:
        return None
    api_key, role = authenticated
    return Caller(
        organization_id=api_key.organization_id,
        api_key_id=api_key.pk,
        user_id=api_key.created_by_id,
        can_infer=api_key.has_scope(Scope.INFERENCE),
        role=role,
        requests_per_minute=api_key.requests_per_minute,
        tokens_per_minute=api_key.tokens_per_minute,
        max_priority_boost=api_key.max_priority_boost,
        expires_at=None if api_key.expires_at is None else api_key.expires_at.timestamp(),
    )


def _organization_of(caller: Caller | None) -> int | None:
    """The key's organisation: its group in the cache; None (a key that names none) is never kept."""
    return None if caller is None else caller.organization_id


# NOTE: shared fairly between organisations (`Memo`'s `group_of`): a full cache drops a key of the organisation holding
# the most. Least recently used first, whoever's, ten organisations at the live-key limit (sign-up is open) calling in
# turn pushed every other tenant's key out, each of their calls then a lookup queued (4 at once) behind the flood's.
# NOTE: a first lookup's slot is its sender's address's (`source_of`, `FairSlots`: at most half of them one
# address's, the last free one kept for an address holding none): first come, first served, one address's flood of
# made-up keys took all four, and a real key new to the process from anywhere else waited 2 s, then was a 503.
_callers_by_key = Memo(_lookup_key, lambda: hot.API_KEY_CACHE_S, max_entries=KNOWN_KEYS_MAX,
                       max_concurrent_loads=MAX_KEY_LOOKUPS, load_wait_s=API_KEY_LOOKUPS.slots.wait_s,
                       group_of=_organization_of, fair_loads=True,
                       max_concurrent_known_loads=MAX_KNOWN_KEY_LOOKUPS)
_refused_keys = API_KEY_LOOKUPS.refused
_session_lookups = CredentialLookups(max_concurrent=MAX_SESSION_LOOKUPS, refused_for_s=REFUSED_SESSIONS_FOR_S)


def source_of(scope: dict) -> str | None:
    """Whose a request's key lookup is among the fair slots: its client's address (as the server took it from the
    proxies it trusts: `FORWARDED_ALLOW_IPS`), an IPv6 one's /64 (what one subscriber holds); None when unknown."""
    client = scope.get("client")
    return _source_of_host(client[0]) if client else None


# NOTE: memoised: every call's lookup names its source (even a key this process knows, whose lookup never queues),
# and parsing an address is ~1-2 µs of the warm path (issue #20); a flood from many addresses only churns it.
@functools.lru_cache(maxsize=4096)
def _source_of_host(host: str) -> str | None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if address.version == 6:
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


async def caller_from_key(plain: str, *, source: str | None = None) -> Caller | None:
    """The caller `plain` names, or None; `source` (`source_of`) is whose a lookup's slot is."""
    if tokens.split_token(plain, tokens.API_KEY_KIND) is None:
        return None
    digest = API_KEY_LOOKUPS.digest(plain)
    if digest in _refused_keys:
        return None
    # NOTE: a key this process never served, but real to another (or just minted: `known_credentials`), is looked up
    # without waiting for a slot: every real key's first call in a process (a new key, after a deploy, a scale-up, the
    # load balancer's next pod) waited behind a flood of made-up ones, and was a 503 for as long as it lasted. Its
    # lookup waits among its organisation's (the mark's), never behind another's many real keys.
    was_cached = digest in _callers_by_key.entries
    known_owner = None if was_cached else await API_KEYS_KNOWN.owner_async(digest)
    try:
        caller = await _callers_by_key.get(digest, plain, known_owner=known_owner, owner=source)
    except LookupsBusy:
        # NOTE: as /api/v1: a key never seen waited behind a flood of made-up ones for as long as it lasted.
        raise errors.service_unavailable("Too many API keys are being checked at once; please retry.") from None
    # NOTE: a key that expired while cached was served for the cache's TTL and `STALE_FOR_S` more; its expiry is
    # judged at each call, by Redis's clock (kept in step with PostgreSQL's, which judged it at the lookup)
    if caller is not None and caller.expires_at is not None and caller.expires_at <= redis_now():
        caller = None
    if caller is None:
        # NOTE: a refused key leaves the known keys' cache, so it never evicts one that works.
        _callers_by_key.forget(digest)
        _refused_keys.add(digest)
        if was_cached or known_owner is not None:  # NOTE: a made-up key has no mark: its refusal costs Redis nothing
            await API_KEYS_KNOWN.discard_async(digest)
    return caller


class _NotLoggedIn(Exception):
    """The session id names no logged-in session: none, expired, or an anonymous one."""


def _lookup_session(session_key: str) -> Caller | None:
    session = SessionStore(session_key=session_key)
    user_id = session.get(SESSION_KEY)
    if user_id is None:
        raise _NotLoggedIn()
    user = get_user_model().objects.filter(pk=user_id, is_active=True).first()
    if user is None:
        return None
    # NOTE: as Django's `get_user`: a password change or reset since this session logged in ends it.
    session_hash = session.get(HASH_SESSION_KEY) or ""
    if not any(constant_time_compare(session_hash, known)
               for known in (user.get_session_auth_hash(), *user.get_session_auth_fallback_hash())):
        return None
    if not email_is_verified(user):
        return None
    try:
        membership = chosen_membership(user, session)
    except (NoLongerMember, NotChosen) as exc:
        raise errors.no_longer_member(str(exc)) from None
    if membership is None:
        return None
    if membership.organization.closed_at is not None:  # NOTE: its keys are revoked; its members' sessions call nothing
        raise errors.organization_closed(ORGANIZATION_CLOSED)
    return Caller(organization_id=membership.organization_id, api_key_id=None, user_id=user.pk,
                  can_infer=True, role=membership.role, requests_per_minute=None, tokens_per_minute=None)


async def caller_from_session(headers: dict[str, str]) -> Caller | None:
    """A console session may call the gateway (the playground) with the CSRF double-submit token."""

    cookies = SimpleCookie()
    cookies.load(headers.get("cookie", ""))
    session = cookies.get(settings.SESSION_COOKIE_NAME)
    csrf_cookie = cookies.get(settings.CSRF_COOKIE_NAME)
    csrf_header = headers.get("x-csrftoken", "")
    if session is None or csrf_cookie is None or not csrf_header:
        return None
    if _from_another_origin(headers):
        raise errors.cross_origin_session()
    try:
        _check_token_format(csrf_header)
        if not _does_token_match(csrf_header, csrf_cookie.value):
            return None
    except InvalidTokenFormat:
        return None
    return await _caller_of_session(session.value)


def _from_another_origin(headers: dict[str, str]) -> bool:
    """Whether a call riding a console session names, in `Origin`, another origin than the console's: its own host
    (`ALLOWED_HOSTS`; HTTPS as `SECURE_PROXY_SSL_HEADER` says) or one of `CSRF_TRUSTED_ORIGINS`, judged by Django's
    own CSRF check, as the console's forms are. A call without `Origin` (curl, a browser's same-origin GET) is judged
    by its CSRF pair alone, as before.

    NOTE: the double-submit pair alone let a page of another origin call as the signed-in user wherever it could
    plant the CSRF cookie (a sibling subdomain's page may set one for the parent domain), and `/v1` answers CORS for
    any origin (`endpoints.gateway.cors`); the console's forms were never open to it, since Django checks `Origin`
    first."""
    if "origin" not in headers:
        return False
    request = HttpRequest()
    # NOTE: no server name: a request without `Host` (HTTP/1.0 allows it) has no host of its own, and is judged by
    # `CSRF_TRUSTED_ORIGINS` alone. Django's check fell back to the WSGI `SERVER_NAME`, which this request lacked: a
    # KeyError, a 500 with an ERROR traceback, for anyone sending any session cookie (the review of CORS).
    request.META = {"SERVER_NAME": "", "SERVER_PORT": "",
                    **{f"HTTP_{name.upper().replace('-', '_')}": value for name, value in headers.items()}}
    return not CsrfViewMiddleware(_no_view)._origin_verified(request)


def _no_view(request: HttpRequest) -> HttpResponse:  # what `CsrfViewMiddleware` wraps: never called here
    raise NotImplementedError


async def caller_from_console_form(headers: dict[str, str]) -> Caller | None:
    """The console session that posts a form (its session cookie alone), or None: none, not logged in, unverified,
    in no organisation. For what must be known before the body is read (`Gateway._console_upload`): the form's CSRF
    token is in its body, and its view checks it."""
    cookies = SimpleCookie()
    cookies.load(headers.get("cookie", ""))
    session = cookies.get(settings.SESSION_COOKIE_NAME)
    return None if session is None else await _caller_of_session(session.value)


async def _caller_of_session(session_key: str) -> Caller | None:
    if _session_lookups.is_refused(session_key):
        return None
    try:
        # NOTE: none for a session that called before (`CredentialLookups.slot_for`): every playground call waited
        # among a flood of made-up session cookies, and was a 503 behind it
        async with _session_lookups.slot_for_async(session_key):
            caller = await in_worker_thread(_lookup_session)(session_key)
        if caller is not None:
            _session_lookups.know(session_key, owner=caller.organization_id)
        return caller
    except _NotLoggedIn:
        _session_lookups.refuse(session_key)
        return None
    except LookupsBusy:
        raise errors.service_unavailable("Too many sessions are being checked at once; please retry.") from None


async def authenticate(headers: dict[str, str], *, source: str | None = None) -> Caller:
    authorization = headers.get("authorization", "")
    if authorization:
        keyword, _, plain = authorization.partition(" ")
        if keyword.lower() != "bearer" or not plain.strip():
            raise errors.invalid_api_key("Send 'Authorization: Bearer <API key>'.")
        caller = await caller_from_key(plain.strip(), source=source)
        if caller is None:
            raise errors.invalid_api_key("Incorrect, expired or revoked API key provided.")
    else:
        caller = await caller_from_session(headers)
        if caller is None:
            raise errors.invalid_api_key("You didn't provide an API key. Send 'Authorization: Bearer <API key>'.")
        # NOTE: the switcher writes the session's organisation: a playground left open on A's page, sent from after a
        # switch to B in another tab, ran (and was billed) in B, or on B's endpoint of the same name. A call naming
        # none (curl with a session, a page cached from before) acts in the session's organisation as before.
        shown_for = headers.get(PAGE_ORGANIZATION_HEADER)
        if shown_for is not None and shown_for != str(caller.organization_id):
            raise errors.page_organization_switched()
    if not caller.can_infer:
        raise errors.missing_scope()
    # NOTE: inference spends money and a viewer is read-only: a viewer's keys (and playground)
    # stop inferring within one key-cache window of the demotion.
    if caller.role == "viewer":
        raise errors.role_forbids_inference()
    return caller
