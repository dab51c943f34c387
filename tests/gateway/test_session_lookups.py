"""Made-up session cookies on the gateway's playground path (with a made-up CSRF pair, which anyone can forge) cost
one lookup at most, and a flood of them holds a few worker threads, never the pool that key lookups need."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time

import pytest
from django.conf import settings
from django.middleware.csrf import _get_new_csrf_string
from django.test import Client

from controlplane.accounts.models import EmailVerification, Role
from controlplane.credential_lookups import CredentialLookups
from controlplane.worker_threads import in_worker_thread
from endpoints.gateway import auth
from endpoints.gateway.errors import OpenAIError
from tests.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "correct horse battery"


def _headers(session_id: str) -> dict[str, str]:
    csrf = _get_new_csrf_string()
    return {
        "cookie": f"{settings.SESSION_COOKIE_NAME}={session_id}; {settings.CSRF_COOKIE_NAME}={csrf}",
        "x-csrftoken": csrf,
    }


async def _status(session_id: str) -> int:
    try:
        await auth.authenticate(_headers(session_id))
    except OpenAIError as exc:
        return exc.status
    return 200


@pytest.fixture
def counted_lookups(monkeypatch):
    """The session lookups the gateway makes (each a query), how many at once at most, each a little slow."""
    real, lock = auth._lookup_session, threading.Lock()
    counts = {"calls": 0, "active": 0, "peak": 0}

    def counted(session_key):
        with lock:
            counts["calls"] += 1
            counts["active"] += 1
            counts["peak"] = max(counts["peak"], counts["active"])
        try:
            time.sleep(0.1)
            return real(session_key)
        finally:
            with lock:
                counts["active"] -= 1

    monkeypatch.setattr(auth, "_lookup_session", counted)
    return counts


def test_a_made_up_session_sent_again_costs_no_second_lookup(counted_lookups):
    bogus = secrets.token_hex(16)

    async def scenario():
        return [await _status(bogus) for _ in range(10)]

    assert asyncio.run(scenario()) == [401] * 10
    assert counted_lookups["calls"] == 1


def test_a_flood_of_made_up_sessions_runs_a_few_lookups_and_never_queues_a_key_lookup(counted_lookups):
    async def key_lookup_wait_s():
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await in_worker_thread(lambda: None)()
        return time.monotonic() - started

    async def flood():
        victim = asyncio.ensure_future(key_lookup_wait_s())
        statuses = await asyncio.gather(*(_status(secrets.token_hex(16)) for _ in range(60)))
        return statuses, await victim

    statuses, waited_s = asyncio.run(flood())
    assert set(statuses) <= {401, 503}
    assert counted_lookups["peak"] <= auth.MAX_SESSION_LOOKUPS
    assert waited_s < 0.5


def test_a_session_waits_briefly_for_a_lookup_slot_then_gets_a_503(monkeypatch):
    busy = CredentialLookups(max_concurrent=1, refused_for_s=60, wait_s=0.05)
    monkeypatch.setattr(auth, "_session_lookups", busy)

    async def scenario():
        async with busy.slots.held_async():  # another lookup holds the only slot
            with pytest.raises(OpenAIError) as refused:
                await auth.authenticate(_headers(secrets.token_hex(16)))
        return refused.value

    refused = asyncio.run(scenario())
    assert refused.status == 503 and refused.code == "service_unavailable"


def test_a_real_session_refused_for_now_is_not_remembered(counted_lookups):
    user = UserFactory(username="new@example.test")
    MembershipFactory(user=user, role=Role.MEMBER)
    client = Client()
    assert client.login(username=user.username, password=PASSWORD)
    session_id = client.cookies[settings.SESSION_COOKIE_NAME].value
    verification = list(EmailVerification.objects.filter(user=user).values())
    EmailVerification.objects.filter(user=user).delete()
    assert asyncio.run(_status(session_id)) == 401  # not verified yet
    EmailVerification.objects.bulk_create(EmailVerification(**row) for row in verification)
    assert asyncio.run(_status(session_id)) == 200  # verified: the same session works at once


@pytest.mark.parametrize("session_id", ['"\\000aaaaaaaaaaaaaaaa"', '"\\000' + "a" * 31 + '"', "A" * 32, "a" * 31],
                         ids=["escaped_nul", "escaped_nul_32", "upper_case", "short"])
def test_a_session_id_django_never_issues_is_a_401_remembered_as_refused(counted_lookups, session_id):
    """A quoted cookie's octal escape unquotes to a NUL, which PostgreSQL refuses (a 500 before): such an id is
    refused before any query, and sent again costs no lookup, as any unknown id."""
    async def scenario():
        return [await _status(session_id) for _ in range(3)]

    assert asyncio.run(scenario()) == [401] * 3
    assert counted_lookups["calls"] == 1


def test_a_session_that_called_before_is_answered_while_made_up_sessions_hold_every_lookup(monkeypatch):
    """Before: every playground call took a session lookup slot (sessions are not cached: a log-out ends one at once),
    the same few a flood of made-up session cookies takes: anyone sending them had every tenant's playground answered
    503 for as long as it went on. Still looked up: a session logged out meanwhile is refused at once."""
    busy = CredentialLookups(max_concurrent=1, refused_for_s=60, wait_s=0.05)
    monkeypatch.setattr(auth, "_session_lookups", busy)
    user = UserFactory(username="playground@example.test")
    MembershipFactory(user=user, role=Role.MEMBER)
    client = Client()
    assert client.login(username=user.username, password=PASSWORD)
    session_id = client.cookies[settings.SESSION_COOKIE_NAME].value
    assert asyncio.run(_status(session_id)) == 200

    async def during_the_flood(logged_out_meanwhile: bool):
        async with busy.slots.held_async():  # the flood's lookups hold every slot
            if logged_out_meanwhile:
                await in_worker_thread(client.logout)()
            return await _status(session_id), await _status(secrets.token_hex(16))

    assert asyncio.run(during_the_flood(False)) == (200, 503)
    assert asyncio.run(during_the_flood(True)) == (401, 503)
