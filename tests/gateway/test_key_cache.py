"""Bogus API keys cost the platform no database query once seen, and never push real keys out of
the gateway's key cache."""

import asyncio
import secrets

import pytest

from controlplane.accounts import keys
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Scope
from controlplane.accounts.services import Actor
from endpoints.gateway import auth
from tests.factories import MembershipFactory
from tests.gateway.slots import every_slot_held

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def lookups(monkeypatch):
    """Counts the gateway's key lookups (each one a database query), with empty caches."""
    calls = []
    real = keys.find_api_key

    def counted(plain):
        calls.append(plain)
        return real(plain)

    monkeypatch.setattr(keys, "find_api_key", counted)
    auth._callers_by_key.clear()
    auth._refused_keys.clear()
    yield calls
    auth._callers_by_key.clear()
    auth._refused_keys.clear()


def _bogus_key() -> str:
    return f"ip_{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}"


def _real_key() -> str:
    membership = MembershipFactory(role="owner")
    return create_api_key(Actor(user=membership.user), membership.organization, name="real", scopes=[Scope.INFERENCE]).plain


@pytest.mark.parametrize("token", [
    "sk-abcdef",  # another vendor's prefix
    "ip_000000000000_wrong",  # a secret too short
    "ip_00000000000_" + "a" * 43,  # a lookup too short
    "ip_ABCDEF000000_" + "a" * 43,  # a lookup that is not lowercase hex
    "ip_000000000000_" + "a" * 42 + "!",  # a character no key has
    "ip_000000000000_" + "a" * 44,  # a secret too long
])
def test_a_malformed_key_is_refused_without_any_lookup(lookups, token):
    async def scenario():
        return [await auth.caller_from_key(token) for _ in range(3)]

    assert asyncio.run(scenario()) == [None, None, None]
    assert lookups == []


def test_an_unknown_well_formed_key_costs_one_lookup_however_often_it_is_sent(lookups, settings):
    settings.API_KEY_CACHE_S = 0  # a known key would be reloaded every time
    bogus = _bogus_key()

    async def scenario():
        return [await auth.caller_from_key(bogus) for _ in range(20)]

    assert asyncio.run(scenario()) == [None] * 20
    assert lookups == [bogus]


def test_a_flood_of_bogus_keys_never_pushes_a_real_key_out_of_the_cache(lookups, monkeypatch, settings):
    monkeypatch.setattr(auth._callers_by_key, "max_entries", 20)
    # NOTE: the suite's 1 s cache would let the real key expire (not be evicted) on a busy machine.
    settings.API_KEY_CACHE_S = 600
    real = _real_key()

    async def scenario():
        first = await auth.caller_from_key(real)
        for _ in range(50):
            assert await auth.caller_from_key(_bogus_key()) is None
        return first, await auth.caller_from_key(real)

    first, again = asyncio.run(scenario())

    assert first is not None and again == first
    assert lookups.count(real) == 1  # answered from the cache after fifty bogus keys
    assert len(auth._callers_by_key.entries) == 1  # the refused keys live apart


def _keys_of(organization, owner, number: int) -> list[str]:
    return [create_api_key(Actor(user=owner), organization, name=f"k{n}", scopes=[Scope.INFERENCE]).plain
            for n in range(number)]


@pytest.mark.parametrize("num_flooding", [1, 3], ids=["one organisation", "three organisations"])
def test_a_flood_of_other_organisations_real_keys_never_pushes_a_quiet_tenants_key_out_of_the_cache(
        lookups, monkeypatch, settings, num_flooding):
    # NOTE: the cache held the 10,000 keys used last, whoever's: ten organisations at the live-key limit (1,000 each;
    # sign-up is open) calling in turn pushed every other tenant's key out, each of their calls then a PostgreSQL
    # lookup queued (4 at once a process) behind the flood's. Here: 20 places, floods of 30 keys.
    monkeypatch.setattr(auth._callers_by_key, "max_entries", 20)
    settings.API_KEY_CACHE_S = 600
    quiet = _real_key()
    floods = []
    for _ in range(num_flooding):
        membership = MembershipFactory(role="owner")
        floods += _keys_of(membership.organization, membership.user, 30 // num_flooding)

    async def scenario():
        first = await auth.caller_from_key(quiet)
        for _ in range(2):
            for plain in floods:
                assert await auth.caller_from_key(plain) is not None
        return first, await auth.caller_from_key(quiet)

    first, again = asyncio.run(scenario())

    assert first is not None and again == first
    assert lookups.count(quiet) == 1  # answered from the cache after the flood
    assert len(auth._callers_by_key.entries) == 20


def test_an_organisation_alone_in_the_cache_still_uses_all_of_it(lookups, monkeypatch, settings):
    monkeypatch.setattr(auth._callers_by_key, "max_entries", 20)
    settings.API_KEY_CACHE_S = 600
    membership = MembershipFactory(role="owner")
    plains = _keys_of(membership.organization, membership.user, 20)

    async def scenario():
        for _ in range(2):
            for plain in plains:
                assert await auth.caller_from_key(plain) is not None

    asyncio.run(scenario())
    assert sorted(lookups) == sorted(plains)  # each looked up once: none evicted


def test_a_bogus_key_never_pushes_a_real_key_out_of_a_full_cache(lookups, monkeypatch, settings):
    # NOTE: a key that names none was stored as known (None), the cache one over its bound dropped a real key, and
    # only then was the refused one forgotten: once a process knew its 10,000 keys, each new bogus key (anyone may send
    # them, no account needed) pushed one real key out, its next call a lookup queued behind the bogus ones.
    monkeypatch.setattr(auth._callers_by_key, "max_entries", 20)
    settings.API_KEY_CACHE_S = 600
    membership = MembershipFactory(role="owner")
    plains = _keys_of(membership.organization, membership.user, 20)

    async def scenario():
        for plain in plains:
            assert await auth.caller_from_key(plain) is not None
        for _ in range(5):
            assert await auth.caller_from_key(_bogus_key()) is None
        for plain in plains:
            assert await auth.caller_from_key(plain) is not None

    asyncio.run(scenario())
    assert [lookups.count(plain) for plain in plains] == [1] * 20
    assert len(auth._callers_by_key.entries) == 20


def test_a_key_never_seen_waits_briefly_for_a_lookup_slot_then_gets_a_503(lookups):
    # NOTE: the gateway's own bound on key lookups (`Memo`'s `max_concurrent_loads`) had no wait limit: behind a flood
    # of made-up keys (anyone may send them), a real key never seen (or pushed out of the cache) queued for as long as
    # the flood lasted, never the 503 with Retry-After that /api/v1 answers after `API_KEY_LOOKUPS.slots.wait_s`.
    from endpoints.gateway import errors

    async def scenario():
        async with every_slot_held(auth._callers_by_key._load_slots):
            return await asyncio.wait_for(auth.caller_from_key(_bogus_key()), keys.API_KEY_LOOKUPS.slots.wait_s + 3)

    with pytest.raises(errors.OpenAIError) as refused:
        asyncio.run(scenario())
    assert refused.value.status == 503 and refused.value.headers["retry-after"] == "1"
    assert lookups == []


def test_a_key_cached_but_stale_is_served_while_every_lookup_slot_is_taken(lookups):
    # A key already cached, even long past its TTL and stale grace, is reloaded without a slot: a flood of made-up keys
    # (each its caller's 503) never refuses a tenant whose key the process knows.
    plain = _real_key()

    async def scenario():
        first = await auth.caller_from_key(plain)
        digest = keys.API_KEY_LOOKUPS.digest(plain)
        entry = auth._callers_by_key.entries[digest]
        auth._callers_by_key.entries[digest] = (entry[0] - 3600, *entry[1:])
        async with every_slot_held(auth._callers_by_key._load_slots):
            return first, await asyncio.wait_for(auth.caller_from_key(plain), 1)

    first, again = asyncio.run(scenario())
    assert again is not None and again.organization_id == first.organization_id
    assert lookups == [plain, plain]


def test_a_cached_key_is_refused_once_it_expires(lookups, settings):
    # Before: the cache kept the key's caller whole for its TTL (and `STALE_FOR_S` more), and judged no expiry:
    # a key that expired while cached worked on for as long, however precisely its lookup judged it
    # (PostgreSQL's clock). Its expiry travels with it now and is judged at each call, by Redis's clock.
    import datetime
    import time

    from django.utils import timezone
    settings.API_KEY_CACHE_S = 600
    membership = MembershipFactory(role="owner")
    plain = create_api_key(Actor(user=membership.user), membership.organization, name="short", scopes=[Scope.INFERENCE],
                           expires_at=timezone.now() + datetime.timedelta(seconds=2)).plain

    async def call():
        return await auth.caller_from_key(plain)

    assert asyncio.run(call()) is not None
    time.sleep(2.5)
    assert asyncio.run(call()) is None
    assert len(lookups) == 1  # judged in the gateway: no lookup more


def _in_a_fresh_process():
    """This process forgets every key it served or refused, as a gateway process just started (a deploy, a
    scale-up, the load balancer's next pod) knows none."""
    auth._callers_by_key.clear()
    keys.API_KEY_LOOKUPS.clear()


def test_a_key_just_minted_is_served_while_a_flood_of_made_up_keys_holds_every_lookup_slot(lookups):
    # Before: a key no gateway process had served yet waited behind the flood's lookups (4 at once) and was a 503
    # for as long as the flood lasted: a new customer's first calls failed while anyone sent made-up keys.
    plain = _real_key()

    async def scenario():
        async with every_slot_held(auth._callers_by_key._load_slots):
            return await asyncio.wait_for(auth.caller_from_key(plain), keys.API_KEY_LOOKUPS.slots.wait_s + 3)

    caller = asyncio.run(scenario())
    assert caller is not None and caller.api_key_id is not None
    assert lookups == [plain]  # still looked up: a known key is never answered from the mark alone


def test_a_key_another_gateway_process_served_is_served_here_while_a_flood_holds_every_lookup_slot(lookups):
    plain = _real_key()
    keys.API_KEYS_KNOWN.discard(keys.API_KEY_LOOKUPS.digest(plain))  # as a key minted before the marks existed
    assert asyncio.run(auth.caller_from_key(plain)) is not None  # served by "another process"
    _in_a_fresh_process()

    async def scenario():
        async with every_slot_held(auth._callers_by_key._load_slots):
            return await asyncio.wait_for(auth.caller_from_key(plain), keys.API_KEY_LOOKUPS.slots.wait_s + 3)

    assert asyncio.run(scenario()) is not None
    assert lookups == [plain, plain]


def test_a_made_up_key_never_skips_the_lookup_slots_and_a_revoked_key_loses_its_mark(lookups):
    from controlplane.accounts.keys import revoke_api_key
    from controlplane.accounts.models import ApiKey
    from endpoints.gateway import errors

    membership = MembershipFactory(role="owner")
    created = create_api_key(Actor(user=membership.user), membership.organization, name="k", scopes=[Scope.INFERENCE])
    digest = keys.API_KEY_LOOKUPS.digest(created.plain)
    assert keys.API_KEYS_KNOWN.contains(digest)
    revoke_api_key(Actor(user=membership.user), ApiKey.objects.get(pk=created.api_key.pk))
    assert asyncio.run(auth.caller_from_key(created.plain)) is None  # still looked up: revoked at once
    assert not keys.API_KEYS_KNOWN.contains(digest)  # so its next sender waits for a slot, as any stranger's
    _in_a_fresh_process()

    async def flood_then(plain):
        async with every_slot_held(auth._callers_by_key._load_slots):
            return await asyncio.wait_for(auth.caller_from_key(plain), keys.API_KEY_LOOKUPS.slots.wait_s + 3)

    for plain in (created.plain, _bogus_key()):
        with pytest.raises(errors.OpenAIError) as refused:
            asyncio.run(flood_then(plain))
        assert refused.value.status == 503
    assert lookups == [created.plain]


def test_api_v1_serves_a_key_just_minted_while_a_flood_holds_every_lookup_slot(lookups):
    # /api/v1's lookups share the same few slots (threads, per process): a key new to this web process waited there.
    from controlplane.credential_lookups import LookupsBusy

    plain = _real_key()
    slots = keys.API_KEY_LOOKUPS.slots
    for _ in range(slots.max_concurrent):
        assert slots._threads.acquire(timeout=1)
    try:
        authenticated = keys.authenticate_api_key(plain)
        with pytest.raises(LookupsBusy):
            keys.authenticate_api_key(_bogus_key())
    finally:
        for _ in range(slots.max_concurrent):
            slots._threads.release()
    assert authenticated is not None


def test_one_addresss_flood_of_made_up_keys_never_holds_the_lookup_a_real_key_from_elsewhere_needs(monkeypatch):
    # Before: a first lookup's slot was first come, first served: one address's flood of made-up keys (each lookup
    # slow, as under load) took all four, and a real key new to every process (unused for a week, or before its mark),
    # sent from anywhere else, waited 2 s and was a 503 for as long as the flood lasted.
    import threading

    from endpoints.gateway import errors

    release, flood_keys = threading.Event(), {_bogus_key() for _ in range(12)}
    real = keys.find_api_key

    def slow_for_the_flood(plain):
        if plain in flood_keys:
            release.wait(30)  # a slow lookup, holding its slot
        return real(plain)

    monkeypatch.setattr(keys, "find_api_key", slow_for_the_flood)
    auth._callers_by_key.clear()
    auth._refused_keys.clear()
    plain = _real_key()
    keys.API_KEYS_KNOWN.discard(keys.API_KEY_LOOKUPS.digest(plain))  # a key no process has marked: a stranger's

    async def scenario():
        flood = [asyncio.ensure_future(auth.caller_from_key(key, source="203.0.113.7")) for key in flood_keys]
        await asyncio.sleep(0.5)  # the flood's lookups take what slots they may, the rest wait
        try:
            return await auth.caller_from_key(plain, source="198.51.100.20")
        finally:
            release.set()
            outcomes = await asyncio.gather(*flood, return_exceptions=True)
            assert all(outcome is None or isinstance(outcome, errors.OpenAIError) for outcome in outcomes)

    try:
        caller = asyncio.run(scenario())
    finally:
        release.set()
        auth._callers_by_key.clear()
        auth._refused_keys.clear()
    assert caller is not None and caller.api_key_id is not None


@pytest.mark.parametrize(("client", "source"), [
    (("203.0.113.7", 51000), "203.0.113.7"),
    (("2001:db8:1:2:aaaa::1", 51000), "2001:db8:1:2::/64"),  # what one subscriber holds
    (("::ffff:203.0.113.7", 51000), "203.0.113.7"),
    (None, None),
    (("unix-socket", 0), None),
])
def test_a_key_lookups_share_is_its_senders_address(client, source):
    assert auth.source_of({"client": client}) == source


def test_one_organisations_many_real_keys_never_hold_every_lookup_a_marked_key_of_another_needs(monkeypatch):
    # Before: a key marked known (`known_credentials`) was looked up with no bound at all. Sign-up is open and an
    # organisation holds up to 1,000 live keys, each marked at its mint: one organisation sending each of its keys'
    # first call (after a deploy, or past its share of the key cache) ran every lookup at once, each a PostgreSQL
    # query on the process's worker threads, and every other tenant's marked key (and every lookup of the process
    # behind them) waited for all of them.
    import threading

    from controlplane.accounts.models import Organization
    from endpoints.gateway import errors

    membership = MembershipFactory(role="owner")
    actor, organization = Actor(user=membership.user), membership.organization
    flood_keys = {create_api_key(actor, organization, name=f"k{n}", scopes=[Scope.INFERENCE]).plain
                  for n in range(40)}
    victim = _real_key()
    assert Organization.objects.count() == 2
    release, lock, running = threading.Event(), threading.Lock(), [0, 0]  # now, most at once
    real = keys.find_api_key

    def slow_for_the_flood(plain):
        if plain in flood_keys:
            with lock:
                running[0] += 1
                running[1] = max(running)
            release.wait(30)  # a slow lookup (a loaded database), holding its thread
            with lock:
                running[0] -= 1
        return real(plain)

    monkeypatch.setattr(keys, "find_api_key", slow_for_the_flood)
    _in_a_fresh_process()
    auth._refused_keys.clear()

    async def scenario():
        flood = [asyncio.ensure_future(auth.caller_from_key(key, source=f"203.0.113.{n}"))
                 for n, key in enumerate(flood_keys)]
        await asyncio.sleep(0.5)  # the flood's lookups take what they may
        try:
            return await asyncio.wait_for(auth.caller_from_key(victim, source="198.51.100.20"),
                                          keys.API_KEY_LOOKUPS.slots.wait_s + 3)
        finally:
            release.set()
            outcomes = await asyncio.gather(*flood, return_exceptions=True)
            assert all(not isinstance(outcome, BaseException) or isinstance(outcome, errors.OpenAIError)
                       for outcome in outcomes)

    try:
        caller = asyncio.run(scenario())
    finally:
        release.set()
        _in_a_fresh_process()
        auth._refused_keys.clear()
    assert caller is not None and caller.api_key_id is not None
    assert running[1] <= auth.MAX_KNOWN_KEY_LOOKUPS // 2  # one organisation's share of the marked keys' lookups
