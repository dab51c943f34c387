import importlib
from datetime import timedelta
from decimal import Decimal

import pytest
from django.apps import apps
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.accounts import keys
from controlplane.accounts.members import NotPermitted
from controlplane.accounts.models import ApiKey, AuditEvent, Role, Scope
from controlplane.accounts.services import Actor
from controlplane.clock import database_now
from controlplane.tokens import hash_token
from tests.factories import signed_in_api_client

pytestmark = pytest.mark.django_db


def test_secret_is_shown_once_and_only_its_hash_is_stored(owner_client):
    created = owner_client.post("/api/v1/keys/", {"name": "ci", "scopes": ["inference"]}, format="json")
    assert created.status_code == 201
    secret = created.json()["secret"]
    key_id = created.json()["api_key"]["id"]
    assert secret.startswith("ip_") and created.json()["api_key"]["prefix"] == "_".join(secret.split("_", 2)[:2])

    assert "secret" not in owner_client.get(f"/api/v1/keys/{key_id}/").json()
    assert secret not in str(owner_client.get("/api/v1/keys/").json())
    key = ApiKey.objects.get(pk=key_id)
    assert key.digest == hash_token(secret)
    # The plain secret is nowhere in the database.
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            cursor.execute(f'SELECT count(*) FROM "{table}" WHERE CAST("{table}".* AS text) LIKE %s', [f"%{secret}%"])
            assert cursor.fetchone()[0] == 0, table


def test_a_revoked_key_stops_working(owner_client):
    created = owner_client.post("/api/v1/keys/", {"name": "temp", "scopes": ["manage"]}, format="json").json()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {created['secret']}")
    assert client.get("/api/v1/endpoints/").status_code == 200
    revoked = owner_client.post(f"/api/v1/keys/{created['api_key']['id']}/revoke/")
    assert revoked.json()["revoked_at"] is not None
    assert client.get("/api/v1/endpoints/").status_code == 401


def test_an_expired_key_stops_working(owner_client):
    created = owner_client.post("/api/v1/keys/", {"name": "short", "scopes": ["manage"]}, format="json").json()
    ApiKey.objects.filter(pk=created["api_key"]["id"]).update(expires_at=timezone.now() - timedelta(seconds=1))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {created['secret']}")
    assert client.get("/api/v1/endpoints/").status_code == 401


@pytest.mark.parametrize(("pod_off_by", "left", "status"), [(timedelta(minutes=-10), timedelta(minutes=-1), 401),
                                                           (timedelta(minutes=10), timedelta(minutes=5), 200)],
                         ids=["pod-behind-expired-key", "pod-ahead-live-key"])
def test_a_keys_expiry_is_judged_by_the_database_clock_not_the_pods(owner_client, monkeypatch, pod_off_by, left,
                                                                      status):
    # Before: `ApiKey.is_usable` judged `expires_at` by the clock of the pod that looked the key up: on a pod 10
    # minutes behind, a key that had expired (a leaked CI key given an hour) worked 10 minutes more; on one 10 minutes
    # ahead, a key with 5 minutes left was refused.
    created = owner_client.post("/api/v1/keys/", {"name": "short", "scopes": ["manage"]}, format="json").json()
    ApiKey.objects.filter(pk=created["api_key"]["id"]).update(expires_at=database_now() + left)
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() + pod_off_by)  # the pod that looks the key up
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {created['secret']}")
    assert client.get("/api/v1/endpoints/").status_code == status


def test_an_inference_only_key_cannot_manage(owner_client):
    created = owner_client.post("/api/v1/keys/", {"name": "app", "scopes": ["inference"]}, format="json").json()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {created['secret']}")
    response = client.get("/api/v1/endpoints/")
    assert response.status_code == 403
    assert "manage" in response.json()["detail"]


def test_use_sets_last_used_at(owner_client):
    key = ApiKey.objects.get(organization=owner_client.organization)
    assert key.last_used_at is None
    owner_client.get("/api/v1/endpoints/")
    key.refresh_from_db()
    assert key.last_used_at is not None


@pytest.mark.parametrize(
    "payload, field",
    [
        ({"scopes": ["inference"]}, "name"),
        ({"name": "x", "scopes": ["root"]}, "scopes"),
        ({"name": "x", "scopes": []}, "scopes"),
        ({"name": "x", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
        ({"name": "x", "requests_per_minute": 0}, "requests_per_minute"),
        ({"name": "x", "lookup": "abc"}, "lookup"),
    ],
)
def test_rejects_invalid_keys(owner_client, payload, field):
    response = owner_client.post("/api/v1/keys/", payload, format="json")
    assert response.status_code == 400 and field in response.json()
    assert ApiKey.objects.count() == 1


def test_members_cannot_mint_manage_keys_and_viewers_cannot_mint_any(org, member_client_factory):
    member = member_client_factory(org, Role.MEMBER)
    refused = member.post("/api/v1/keys/", {"name": "m", "scopes": ["manage"]}, format="json")
    assert refused.status_code == 403 and "'manage' scope" in refused.json()["detail"]
    assert member.post("/api/v1/keys/", {"name": "i", "scopes": ["inference"]}, format="json").status_code == 201
    viewer = member_client_factory(org, Role.VIEWER)
    assert viewer.post("/api/v1/keys/", {"name": "v", "scopes": ["inference"]}, format="json").status_code == 403


def test_only_owners_and_admins_give_a_key_a_priority_range_or_limits_above_the_defaults(org, member_client_factory, settings):
    settings.DEFAULT_KEY_REQUESTS_PER_MINUTE, settings.DEFAULT_KEY_TOKENS_PER_MINUTE = 600, 1_000_000
    member = member_client_factory(org, Role.MEMBER)
    for field, value in (("max_priority_boost", 5), ("requests_per_minute", 1_000_000), ("tokens_per_minute", 1_000_000_000)):
        refused = member.post("/api/v1/keys/", {"name": "m", "scopes": ["inference"], field: value}, format="json")
        assert refused.status_code == 403 and list(refused.json()) == ["detail"], refused.json()
        assert "Only owners and admins" in refused.json()["detail"]
    stricter = member.post("/api/v1/keys/", {"name": "s", "scopes": ["inference"], "requests_per_minute": 60,
                                            "tokens_per_minute": 10_000}, format="json")
    assert stricter.status_code == 201
    admin = member_client_factory(org, Role.ADMIN)
    admin.credentials()  # signed in, not with a key: a key mints no key beyond its own limits and priority range
    admin.force_login(admin.user)
    granted = admin.post("/api/v1/keys/", {"name": "a", "scopes": ["inference"], "max_priority_boost": 5,
                                          "requests_per_minute": 1_000_000}, format="json")
    assert granted.status_code == 201 and granted.json()["api_key"]["max_priority_boost"] == 5


def test_a_key_mints_only_keys_within_its_own_scopes_limits_and_spend_cap(owner_client):
    """Before, a `manage`-only key with low limits and a spend cap minted an `inference` key with the platform's
    limits and no cap: a leaked key, revoked by nobody, escaped every bound through its child."""
    created = owner_client.post("/api/v1/keys/", {"name": "ci", "scopes": ["manage"], "requests_per_minute": 100,
                                                  "tokens_per_minute": 5000}, format="json").json()
    ci_key = ApiKey.objects.get(pk=created["api_key"]["id"])
    assert owner_client.patch(f"/api/v1/billing/keys/{ci_key.pk}/", {"spend_cap": "2.00"}, format="json").status_code == 200
    ci = APIClient()
    ci.credentials(HTTP_AUTHORIZATION=f"Bearer {created['secret']}")
    for said, extra in (("scopes it has itself", {"scopes": ["inference"]}),
                        ("scopes it has itself", {"scopes": ["manage", "inference"]}),
                        ("no higher than its own (100)", {"requests_per_minute": 101}),
                        ("no higher than its own (5000)", {"tokens_per_minute": 5001}),
                        ("priority", {"max_priority_boost": 1})):
        refused = ci.post("/api/v1/keys/", {"name": "child", "scopes": ["manage"], **extra}, format="json")
        assert refused.status_code == 403 and list(refused.json()) == ["detail"], refused.json()
        assert said in refused.json()["detail"], refused.json()
    assert not ApiKey.objects.filter(name="child").exists()

    inherited = ci.post("/api/v1/keys/", {"name": "child", "scopes": ["manage"]}, format="json")
    assert inherited.status_code == 201
    child = ApiKey.objects.get(name="child")
    assert (child.scopes, child.requests_per_minute, child.tokens_per_minute) == (["manage"], 100, 5000)
    assert child.spend_cap.spend_cap == Decimal("2.00")
    stricter = ci.post("/api/v1/keys/", {"name": "stricter", "scopes": ["manage"], "requests_per_minute": 10},
                       format="json")
    assert stricter.status_code == 201 and stricter.json()["api_key"]["requests_per_minute"] == 10
    # The minting key cannot lift its child's cap either.
    refused = ci.patch(f"/api/v1/billing/keys/{child.pk}/", {"spend_cap": None}, format="json")
    assert refused.status_code == 403 and "capped at 2.00" in refused.json()["detail"]


def test_a_key_with_a_spend_cap_creates_no_key_that_infers(owner_client):
    """Before, a child got its parent's cap with nothing spent against it (spend is counted per key): a capped key that
    had spent its cap minted a child and spent as much again, and the child a grandchild, up to the organisation's cap."""
    created = owner_client.post("/api/v1/keys/", {"name": "capped", "scopes": ["manage", "inference"]},
                                format="json").json()
    capped = ApiKey.objects.get(pk=created["api_key"]["id"])
    assert owner_client.patch(f"/api/v1/billing/keys/{capped.pk}/", {"spend_cap": "5.00"}, format="json").status_code == 200
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {created['secret']}")
    refused = client.post("/api/v1/keys/", {"name": "child", "scopes": ["manage", "inference"]}, format="json")
    assert refused.status_code == 403 and list(refused.json()) == ["detail"], refused.json()
    assert "spend cap" in refused.json()["detail"] and not ApiKey.objects.filter(name="child").exists()
    assert client.post("/api/v1/keys/", {"name": "child", "scopes": ["manage"]}, format="json").status_code == 201


def test_a_key_with_rate_limits_of_its_own_creates_no_key_that_infers(owner_client):
    """Before, a child got its parent's limits in a window of its own (limits are counted per key): a key limited to
    3 calls a minute that may create keys made two children and called 9 times a minute, and so on. A key at the
    platform's limits may (its children get those, as a key made in the console does)."""
    created = owner_client.post("/api/v1/keys/", {"name": "limited", "scopes": ["manage", "inference"],
                                                  "requests_per_minute": 3}, format="json").json()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {created['secret']}")
    refused = client.post("/api/v1/keys/", {"name": "child", "scopes": ["manage", "inference"]}, format="json")
    assert refused.status_code == 403 and list(refused.json()) == ["detail"], refused.json()
    assert "rate limits" in refused.json()["detail"] and not ApiKey.objects.filter(name="child").exists()
    assert client.post("/api/v1/keys/", {"name": "child", "scopes": ["manage"]}, format="json").status_code == 201

    unlimited = owner_client.post("/api/v1/keys/", {"name": "at defaults", "scopes": ["manage", "inference"]},
                                  format="json").json()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {unlimited['secret']}")
    minted = client.post("/api/v1/keys/", {"name": "per customer", "scopes": ["inference"], "requests_per_minute": 10},
                         format="json")
    assert minted.status_code == 201 and minted.json()["api_key"]["requests_per_minute"] == 10


def test_a_key_dies_with_its_creators_membership(org, member_client_factory):
    member = member_client_factory(org, Role.ADMIN)
    assert member.get("/api/v1/endpoints/").status_code == 200
    org.memberships.filter(user=member.user).delete()
    assert member.get("/api/v1/endpoints/").status_code == 401


def _key_client(secret: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def test_revoking_a_key_revokes_the_keys_it_minted_and_theirs_each_audited(owner_client):
    """Before, revoking a leaked key left the keys its holder had minted with it working: same power, no expiry."""
    owner_client = signed_in_api_client(owner_client.user)  # its keys are minted by no key
    leaked = owner_client.post("/api/v1/keys/", {"name": "ci", "scopes": ["manage", "inference"]}, format="json").json()
    child = _key_client(leaked["secret"]).post("/api/v1/keys/", {"name": "ci", "scopes": ["manage", "inference"]},
                                               format="json").json()
    grandchild = _key_client(child["secret"]).post("/api/v1/keys/", {"name": "gc", "scopes": ["inference"]},
                                                   format="json").json()
    elsewhere = owner_client.post("/api/v1/keys/", {"name": "prod", "scopes": ["inference"]}, format="json").json()
    listed = {row["id"]: row for row in owner_client.get("/api/v1/keys/").json()["results"]}
    assert listed[child["api_key"]["id"]]["minted_by"] == leaked["api_key"]["id"]
    assert listed[grandchild["api_key"]["id"]]["minted_by"] == child["api_key"]["id"]
    assert listed[leaked["api_key"]["id"]]["minted_by"] is None and listed[elsewhere["api_key"]["id"]]["minted_by"] is None

    assert owner_client.post(f"/api/v1/keys/{leaked['api_key']['id']}/revoke/").status_code == 200

    for made in (leaked, child, grandchild):
        assert _key_client(made["secret"]).get("/api/v1/endpoints/").status_code == 401
        assert owner_client.get(f"/api/v1/keys/{made['api_key']['id']}/").json()["revoked_at"] is not None
    assert ApiKey.objects.get(pk=elsewhere["api_key"]["id"]).revoked_at is None
    events = AuditEvent.objects.filter(action="api_key.revoke").order_by("pk")
    assert [(event.target_id, event.details.get("minted_by")) for event in events] == [
        (str(leaked["api_key"]["id"]), None), (str(child["api_key"]["id"]), leaked["api_key"]["id"]),
        (str(grandchild["api_key"]["id"]), child["api_key"]["id"])]


def test_the_console_shows_which_key_minted_a_key_and_that_it_was_revoked_with_it(owner_client):
    parent = owner_client.post("/api/v1/keys/", {"name": "ci", "scopes": ["manage", "inference"]}, format="json").json()
    _key_client(parent["secret"]).post("/api/v1/keys/", {"name": "made-by-ci", "scopes": ["inference"]}, format="json")
    console = Client()
    console.force_login(owner_client.user)
    assert console.post(reverse("console:key-revoke", args=[parent["api_key"]["id"]])).status_code == 302
    page = console.get(reverse("console:keys")).content.decode()
    row = page[page.index("made-by-ci"):].split("</tr>")[0]
    assert f"{parent['api_key']['prefix']}…" in row and "Revoked" in row


def test_revoking_a_revoked_key_again_revokes_the_keys_it_minted_that_still_work(owner_client):
    """Keys minted before the link was recorded were not revoked with their parent; the migration links them, and
    revoking the parent again revokes them."""
    owner_client = signed_in_api_client(owner_client.user)
    parent = owner_client.post("/api/v1/keys/", {"name": "ci", "scopes": ["manage", "inference"]}, format="json").json()
    child = _key_client(parent["secret"]).post("/api/v1/keys/", {"name": "c", "scopes": ["inference"]},
                                               format="json").json()
    ApiKey.objects.filter(pk=parent["api_key"]["id"]).update(revoked_at=timezone.now())  # as revoked before
    assert ApiKey.objects.get(pk=child["api_key"]["id"]).revoked_at is None
    assert owner_client.post(f"/api/v1/keys/{parent['api_key']['id']}/revoke/").status_code == 200
    assert ApiKey.objects.get(pk=child["api_key"]["id"]).revoked_at is not None


def test_the_migration_links_each_key_to_the_key_that_minted_it_from_the_audit_log(owner_client):
    owners_key = ApiKey.objects.get(created_by=owner_client.user)  # made when signed in (the fixture's)
    parent = owner_client.post("/api/v1/keys/", {"name": "ci", "scopes": ["manage", "inference"]}, format="json").json()
    child = _key_client(parent["secret"]).post("/api/v1/keys/", {"name": "c", "scopes": ["inference"]},
                                               format="json").json()
    ApiKey.objects.update(minted_by=None)  # as before the link was recorded

    migration = importlib.import_module("controlplane.accounts.migrations.0009_api_key_minted_by")
    migration.link_minted_keys(apps, None)

    assert ApiKey.objects.get(pk=child["api_key"]["id"]).minted_by_id == parent["api_key"]["id"]
    assert ApiKey.objects.get(pk=parent["api_key"]["id"]).minted_by_id == owners_key.pk
    assert ApiKey.objects.get(pk=owners_key.pk).minted_by_id is None


def test_a_key_revoked_after_its_call_was_authenticated_mints_nothing(owner_client):
    parent = ApiKey.objects.get(created_by=owner_client.user)
    authenticated = ApiKey.objects.get(pk=parent.pk)  # as the call's authentication read it
    keys.revoke_api_key(Actor(user=owner_client.user), parent)
    with pytest.raises(NotPermitted, match="was revoked"):
        keys.create_api_key(Actor(user=owner_client.user, api_key=authenticated), owner_client.organization,
                            name="late", scopes=[Scope.INFERENCE])
    assert not ApiKey.objects.filter(name="late").exists()


def test_garbage_tokens_are_401(db):
    client = APIClient()
    for header in ["Bearer nope", "Bearer ip_123_abc", "Basic abc", "Bearer "]:
        client.credentials(HTTP_AUTHORIZATION=header)
        assert client.get("/api/v1/endpoints/").status_code == 401, header


def test_a_key_that_expires_cannot_mint_a_key_that_outlives_it(owner_client):
    # A manage key that expires (a leaked CI key, say) minted a key that never expired, for its creator: the leak
    # outlived the expiry that was meant to end it.
    expires = timezone.now() + timedelta(days=1)
    created = owner_client.post("/api/v1/keys/", {"name": "ci", "scopes": ["manage", "inference"],
                                                  "expires_at": expires.isoformat()}, format="json").json()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {created['secret']}")
    for extra in ({}, {"expires_at": (expires + timedelta(days=30)).isoformat()}):
        refused = client.post("/api/v1/keys/", {"name": "child", "scopes": ["manage"], **extra}, format="json")
        assert refused.status_code == 403 and "expire no later" in refused.json()["detail"]
    allowed = client.post("/api/v1/keys/", {"name": "child", "scopes": ["inference"],
                                            "expires_at": (expires - timedelta(hours=1)).isoformat()}, format="json")
    assert allowed.status_code == 201
    assert ApiKey.objects.filter(name="child").count() == 1
    # A key that never expires (and a signed-in owner) still mints either kind.
    assert owner_client.post("/api/v1/keys/", {"name": "forever", "scopes": ["inference"]}, format="json").status_code == 201


@pytest.mark.django_db(transaction=True)
def test_a_key_still_authenticates_while_postgresql_refuses_writes():
    # A failover's demoted primary serves reads and refuses writes: the gateway keeps answering from what it reads, its
    # usage going to the journal. But a key looked up again (its cache lasts seconds) whose last use was over a minute
    # ago was marked used with an UPDATE, which raised: every such key was refused (503) for the rest of the outage.
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connections

    from controlplane.accounts.keys import authenticate_api_key, create_api_key
    from controlplane.accounts.services import Actor
    from tests.factories import MembershipFactory
    from tests.outages import database_read_only

    membership = MembershipFactory(role=Role.OWNER)
    created = create_api_key(Actor(user=membership.user), membership.organization, name="k", scopes=["inference"])
    long_ago = timezone.now() - timedelta(hours=1)
    ApiKey.objects.filter(pk=created.api_key.pk).update(last_used_at=long_ago)

    def look_up():  # another connection than the test's own, which keeps writing
        try:
            return authenticate_api_key(created.plain)
        finally:
            connections.close_all()

    with database_read_only(), ThreadPoolExecutor(1) as pool:
        found = pool.submit(look_up).result(timeout=30)
    assert found is not None and found.pk == created.api_key.pk
    assert ApiKey.objects.get(pk=created.api_key.pk).last_used_at == long_ago  # not recorded meanwhile: no harm
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(look_up).result(timeout=30) is not None
    assert ApiKey.objects.get(pk=created.api_key.pk).last_used_at > long_ago  # recorded once writes are taken again


def test_a_role_refused_a_key_gets_the_403_a_refused_revoke_gets_and_the_schema_says_so(org, member_client_factory):
    # Creating a key the caller's role does not allow was a 400 naming a field, where revoking one it may not revoke,
    # and every other refusal of a role, is a 403 with a `detail`.
    owner = member_client_factory(org, Role.OWNER)
    owners_key = owner.post("/api/v1/keys/", {"name": "o", "scopes": ["inference"]}, format="json").json()["api_key"]
    member = member_client_factory(org, Role.MEMBER)

    created = member.post("/api/v1/keys/", {"name": "m", "scopes": ["manage"]}, format="json")
    revoked = member.post(f"/api/v1/keys/{owners_key['id']}/revoke/")

    assert (created.status_code, revoked.status_code) == (403, 403)
    assert list(created.json()) == list(revoked.json()) == ["detail"]
    assert "Only owners and admins" in created.json()["detail"]
    operation = owner.get("/api/schema/", {"format": "json"}).json()["paths"]["/api/v1/keys/"]["post"]
    forbidden = operation["responses"]["403"]
    assert "may not create this key" in forbidden["description"]
    assert forbidden["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}


def test_an_organisation_holds_no_more_live_keys_than_its_limit_and_a_revoked_or_expired_one_frees_its_place(
    owner_client, settings
):
    # NOTE: the gateway keeps 10,000 keys per process (`auth.KNOWN_KEYS_MAX`): one organisation calling with more keys
    # than that, in turn, pushed every other tenant's out, each of their calls a lookup queued behind its flood.
    settings.MAX_LIVE_API_KEYS_PER_ORG = 3
    made = [owner_client.post("/api/v1/keys/", {"name": f"k{n}", "scopes": ["inference"]}, format="json")
            for n in range(2)]  # the owner's own key is the first
    assert [response.status_code for response in made] == [201, 201]

    refused = owner_client.post("/api/v1/keys/", {"name": "one too many", "scopes": ["inference"]}, format="json")
    assert refused.status_code == 400
    assert "3 live API keys" in refused.json()["non_field_errors"][0]
    assert not ApiKey.objects.filter(name="one too many").exists()

    console = Client()
    console.force_login(owner_client.user)
    page = console.post("/console/keys/", {"name": "from the console", "scopes": ["inference"]})
    assert page.status_code == 400 and b"3 live API keys" in page.content
    assert not ApiKey.objects.filter(name="from the console").exists()

    assert owner_client.post(f"/api/v1/keys/{made[0].json()['api_key']['id']}/revoke/").status_code == 200
    ApiKey.objects.filter(pk=made[1].json()["api_key"]["id"]).update(expires_at=timezone.now() - timedelta(seconds=1))
    again = [owner_client.post("/api/v1/keys/", {"name": f"again {n}", "scopes": ["inference"]}, format="json")
             for n in range(2)]
    assert [response.status_code for response in again] == [201, 201]


@pytest.mark.django_db(transaction=True)
def test_two_keys_made_at_once_with_one_place_left_make_one(monkeypatch, settings):
    # Each creation counts the live keys and then inserts: two that both counted before either inserted would both
    # fit. The organisation's row lock (`create_api_key`) makes the second count after the first's commit: here each
    # waits (at most 2 s) for the other to have counted too, which only a creation without the lock does.
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connections

    from tests.factories import MembershipFactory

    membership = MembershipFactory(role=Role.OWNER)
    # two owners: each creation locks its own membership's row, never the other's
    owners = [membership.user, MembershipFactory(organization=membership.organization, role=Role.OWNER).user]
    settings.MAX_LIVE_API_KEYS_PER_ORG = 1
    counted = threading.Barrier(2)
    real = keys._ensure_room_for_a_key

    def counting_then_waiting(organization):
        real(organization)
        try:
            counted.wait(timeout=2)
        except threading.BrokenBarrierError:
            pass

    monkeypatch.setattr(keys, "_ensure_room_for_a_key", counting_then_waiting)

    def create(n):
        try:
            return keys.create_api_key(Actor(user=owners[n]), membership.organization, name=f"k{n}",
                                       scopes=[Scope.INFERENCE]).api_key.pk
        except keys.TooManyKeys:
            return None
        finally:
            connections.close_all()

    with ThreadPoolExecutor(2) as pool:
        made = list(pool.map(create, range(2)))

    assert made.count(None) == 1
    assert ApiKey.objects.filter(organization=membership.organization).count() == 1
