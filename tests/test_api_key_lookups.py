"""Made-up API keys on `/api/v1` cost one query at most, and a flood of them holds a few lookups at once."""

import secrets
import threading
import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from controlplane.accounts import keys
from controlplane.accounts.services import Actor
from controlplane.credential_lookups import CredentialLookups

pytestmark = pytest.mark.django_db
NUM_MADE_UP_KEYS = 200


def _bogus_key() -> str:
    return f"ip_{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}"


def _client(plain: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plain}")
    return client


def test_a_made_up_key_sent_again_costs_no_query():
    client = _client(_bogus_key())
    with CaptureQueriesContext(connection) as queries:
        statuses = [client.get("/api/v1/keys/").status_code for _ in range(10)]
    assert statuses == [401] * 10
    assert len(queries) == 1


def test_a_key_created_after_refusals_works_at_once_and_a_revoked_one_stops(owner_client):
    for _ in range(3):
        assert _client(_bogus_key()).get("/api/v1/keys/").status_code == 401
    created = keys.create_api_key(
        Actor(user=owner_client.user), owner_client.organization, name="new", scopes=["manage"]
    )
    assert _client(created.plain).get("/api/v1/keys/").status_code == 200
    keys.revoke_api_key(Actor(user=owner_client.user), created.api_key)
    assert _client(created.plain).get("/api/v1/keys/").status_code == 401


def test_made_up_keys_whose_refusal_is_over_are_forgotten_as_others_come(settings):
    """Before, a refused key stayed remembered until 100,000 newer ones pushed it out, its time long over: ~200
    bytes per made-up key a web process was sent, for a day or more."""
    settings.API_KEY_NEGATIVE_CACHE_S = 0  # each refusal is over by the next request
    for _ in range(NUM_MADE_UP_KEYS):
        assert _client(_bogus_key()).get("/api/v1/keys/").status_code == 401
    assert len(keys.API_KEY_LOOKUPS.refused) <= 1


def test_a_flood_of_made_up_keys_runs_a_few_lookups_at_once(monkeypatch):
    active, peak, lock = [0], [0], threading.Lock()

    def slow_lookup(plain):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.2)
        with lock:
            active[0] -= 1

    monkeypatch.setattr(keys, "find_api_key", slow_lookup)
    threads = [threading.Thread(target=keys.authenticate_api_key, args=(_bogus_key(),)) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 1 <= peak[0] <= keys.API_KEY_LOOKUPS.slots.max_concurrent


def test_a_key_waits_briefly_for_a_lookup_slot_then_gets_a_503_that_says_when_to_retry(monkeypatch):
    busy = CredentialLookups(max_concurrent=1, refused_for_s=60, wait_s=0.05)
    monkeypatch.setattr(keys, "API_KEY_LOOKUPS", busy)
    with busy.slots.held():  # another lookup holds the only slot
        response = _client(_bogus_key()).get("/api/v1/keys/")
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert "retry" in response.json()["detail"]


def test_every_operation_that_takes_a_key_documents_the_503_a_busy_lookup_answers(owner_client):
    """The answer above is any keyed operation's while a flood holds the lookups: the schema said none could be a 503."""
    paths = owner_client.get("/api/schema/", {"format": "json"}).json()["paths"]
    keyed = {f"{method.upper()} {path}": operation for path, operations in paths.items()
             for method, operation in operations.items() if any(operation.get("security", []))}

    undocumented = [name for name, operation in keyed.items()
                    if "Retry-After" not in operation["responses"].get("503", {}).get("headers", {})]

    assert len(keyed) > 30 and undocumented == []


def test_a_key_that_worked_before_is_answered_while_made_up_keys_hold_every_lookup_and_stops_once_revoked(
        owner_client, monkeypatch):
    """Before: every call with a key on `/api/v1` took a lookup slot (it keeps no cache of keys, so a revoked key stops
    at once), the same four a flood of made-up keys takes: anyone sending well-formed keys fast enough had every
    tenant's automation on the management API answered 503 for as long as it went on."""
    busy = CredentialLookups(max_concurrent=1, refused_for_s=60, wait_s=0.05)
    monkeypatch.setattr(keys, "API_KEY_LOOKUPS", busy)
    created = keys.create_api_key(
        Actor(user=owner_client.user), owner_client.organization, name="automation", scopes=["manage"]
    )
    assert _client(created.plain).get("/api/v1/keys/").status_code == 200

    with busy.slots.held():  # the flood's lookups hold every slot
        assert _client(created.plain).get("/api/v1/keys/").status_code == 200
        assert _client(_bogus_key()).get("/api/v1/keys/").status_code == 503
        keys.revoke_api_key(Actor(user=owner_client.user), created.api_key)
        assert _client(created.plain).get("/api/v1/keys/").status_code == 401
    assert _client(created.plain).get("/api/v1/keys/").status_code == 401


def test_another_organisation_calling_in_turn_with_its_many_keys_never_pushes_a_tenants_key_behind_a_flood(
        owner_client, member_client_factory, monkeypatch):
    """Before: the keys remembered as real (`CredentialLookups.know`) were one list, least recently added dropped first,
    whoever's: an organisation calling in turn with as many keys as it holds (ten organisations at the live-key limit,
    sign-up being open) pushed every other tenant's key out, each of whose calls then waited for a slot behind a flood
    of made-up keys and was a 503, as before the known keys were remembered."""
    from tests.factories import OrganizationFactory

    busy = CredentialLookups(max_concurrent=1, refused_for_s=60, wait_s=0.05)
    busy.known.max_entries = 4
    monkeypatch.setattr(keys, "API_KEY_LOOKUPS", busy)
    assert owner_client.get("/api/v1/keys/").status_code == 200

    flooder = member_client_factory(OrganizationFactory())
    theirs = [keys.create_api_key(Actor(user=flooder.user), flooder.organization, name=f"k{i}", scopes=["manage"])
              for i in range(8)]
    for created in theirs:
        assert _client(created.plain).get("/api/v1/keys/").status_code == 200

    with busy.slots.held():  # the flood's lookups hold every slot
        assert owner_client.get("/api/v1/keys/").status_code == 200


def test_a_full_known_set_evicts_from_the_largest_group_and_members_of_no_group_oldest_first():
    from controlplane.credential_lookups import ExpiringSet

    known = ExpiringSet(3600, max_entries=3)
    known.add("tenant", group=1)
    for i in range(5):
        known.add(f"flood-{i}", group=2)
    assert "tenant" in known and len(known) == 3 and "flood-4" in known and "flood-2" not in known
    known.discard("flood-4")
    known.add("tenant", group=3)  # its group changed: counted in the new one alone
    assert len(known) == 2 and "tenant" in known

    ungrouped = ExpiringSet(3600, max_entries=2)
    for member in ("a", "b", "c"):
        ungrouped.add(member)
    assert "a" not in ungrouped and "b" in ungrouped and "c" in ungrouped


def test_a_made_up_keys_refusal_costs_no_redis_write_and_a_revoked_keys_takes_its_mark_away(
        owner_client, monkeypatch, django_capture_on_commit_callbacks):
    """Only a match or a mint marks a key (`known_credentials`): a made-up key has no mark to take away, and deleting
    it anyway cost Redis a write per made-up key (with Redis away, a 5 s connect timeout holding a web thread)."""
    discarded = []
    monkeypatch.setattr(keys.API_KEYS_KNOWN, "discard", discarded.append)
    assert _client(_bogus_key()).get("/api/v1/keys/").status_code == 401
    assert discarded == []

    with django_capture_on_commit_callbacks(execute=True):  # its mark is set once its transaction commits
        created = keys.create_api_key(Actor(user=owner_client.user), owner_client.organization, name="new",
                                      scopes=["manage"])
    keys.API_KEY_LOOKUPS.clear()  # known only by its shared mark, as in a process that never served it
    assert keys.API_KEYS_KNOWN.contains(keys.API_KEY_LOOKUPS.digest(created.plain))
    keys.revoke_api_key(Actor(user=owner_client.user), created.api_key)
    assert _client(created.plain).get("/api/v1/keys/").status_code == 401
    assert discarded == [keys.API_KEY_LOOKUPS.digest(created.plain)]
