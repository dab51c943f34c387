"""Roles on keys and owners: who may revoke which key, a demotion reaches existing keys, a removal revokes them,
roles change only when signed in, and an organisation keeps an owner however many demotions race."""

from __future__ import annotations

import asyncio
import importlib
import threading

import pytest
from django.apps import apps
from django.conf import settings
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.operations import RunPython
from django.middleware.csrf import _get_new_csrf_string
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts import invitations, keys, members, services
from controlplane.accounts.models import ApiKey, AuditEvent, Invitation, Membership, Role, Scope
from controlplane.hot_settings import hot
from endpoints.gateway.auth import authenticate
from endpoints.gateway.errors import OpenAIError
from tests.conftest import wait_until
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, signed_in_api_client


def _clients(org, member_client_factory):
    """API clients of an owner, an admin and two members of `org`, each with its own key."""
    return {
        "owner": member_client_factory(org, Role.OWNER),
        "admin": member_client_factory(org, Role.ADMIN),
        "member": member_client_factory(org, Role.MEMBER),
        "other_member": member_client_factory(org, Role.MEMBER),
    }


def _key_of(client) -> ApiKey:
    return ApiKey.objects.get(created_by=client.user)


def _revoke(client, api_key: ApiKey) -> int:
    return client.post(f"/api/v1/keys/{api_key.pk}/revoke/").status_code


@pytest.mark.django_db
def test_members_revoke_only_their_own_keys(org, member_client_factory):
    clients = _clients(org, member_client_factory)
    member = clients["member"]
    for other in ("owner", "admin", "other_member"):
        assert _revoke(member, _key_of(clients[other])) == 403, other
        assert _key_of(clients[other]).revoked_at is None
    assert _revoke(member, _key_of(member)) == 200


@pytest.mark.django_db
def test_admins_revoke_any_key_but_an_owners(org, member_client_factory):
    clients = _clients(org, member_client_factory)
    admin = clients["admin"]
    assert _revoke(admin, _key_of(clients["owner"])) == 403
    assert _key_of(clients["owner"]).revoked_at is None
    assert _revoke(admin, _key_of(clients["member"])) == 200
    assert _revoke(admin, _key_of(admin)) == 200


@pytest.mark.django_db
def test_owners_revoke_every_key(org, member_client_factory):
    clients = _clients(org, member_client_factory)
    second_owner = member_client_factory(org, Role.OWNER)
    for other in ("admin", "member", "owner"):
        assert _revoke(second_owner, _key_of(clients[other])) == 200, other


@pytest.mark.django_db
def test_the_console_offers_revoke_only_where_it_is_allowed(org, member_client_factory):
    clients = _clients(org, member_client_factory)
    console = Client()
    console.force_login(clients["member"].user)
    page = console.get(reverse("console:keys")).content.decode()
    assert reverse("console:key-revoke", args=[_key_of(clients["member"]).pk]) in page
    assert reverse("console:key-revoke", args=[_key_of(clients["owner"]).pk]) not in page
    response = console.post(reverse("console:key-revoke", args=[_key_of(clients["owner"]).pk]), follow=True)
    assert "only their own keys" in response.content.decode()
    assert _key_of(clients["owner"]).revoked_at is None


@pytest.mark.django_db
def test_roles_change_and_members_are_removed_only_when_signed_in_never_with_an_api_key(org, member_client_factory):
    """Before, a leaked key invited a stranger as owner, who then removed the real owners (tests/test_invitations.py):
    a key changes no membership at all."""
    clients = _clients(org, member_client_factory)
    member = Membership.objects.get(organization=org, user=clients["member"].user)
    owner = Membership.objects.get(organization=org, user=clients["owner"].user)
    for with_key, role in ((clients["owner"], Role.ADMIN), (clients["admin"], Role.VIEWER)):
        refused = with_key.patch(f"/api/v1/members/{member.pk}/", {"role": role}, format="json")
        assert refused.status_code == 403 and "never with an API key" in refused.json()["detail"]
    assert clients["owner"].delete(f"/api/v1/members/{owner.pk}/").status_code == 403
    assert clients["admin"].delete(f"/api/v1/members/{member.pk}/").status_code == 403
    assert Membership.objects.get(pk=member.pk).role == Role.MEMBER and Membership.objects.filter(pk=owner.pk).exists()
    assert not AuditEvent.objects.filter(action__startswith="member.").exists()
    with pytest.raises(members.SessionRequired):
        members.add_member(services.Actor(user=clients["owner"].user, api_key=_key_of(clients["owner"])), org,
                           user=UserFactory(), role=Role.OWNER)

    signed_in = signed_in_api_client(clients["admin"].user)
    assert signed_in.patch(f"/api/v1/members/{member.pk}/", {"role": Role.VIEWER}, format="json").status_code == 200
    assert signed_in.delete(f"/api/v1/members/{member.pk}/").status_code == 204


@pytest.mark.django_db
def test_what_the_callers_role_does_not_allow_is_a_403_as_the_schema_says_and_a_conflict_a_400(org, member_client_factory):
    """Before, an admin demoting an owner, promoting itself to owner, removing an owner, inviting an owner or revoking an
    owner's invitation had a 400 (`{"role": [...]}`), where the schema (and the keys' revoke) say 403."""
    owner_client = signed_in_api_client(member_client_factory(org, Role.OWNER).user)
    admin = signed_in_api_client(member_client_factory(org, Role.ADMIN).user)
    owner = Membership.objects.get(organization=org, user=owner_client.user)
    own = Membership.objects.get(organization=org, user=admin.user)
    invited_owner = owner_client.post("/api/v1/invitations/", {"email": "boss@example.test", "role": Role.OWNER},
                                      format="json").json()
    for refused in (admin.patch(f"/api/v1/members/{owner.pk}/", {"role": Role.MEMBER}, format="json"),
                    admin.patch(f"/api/v1/members/{own.pk}/", {"role": Role.OWNER}, format="json"),
                    admin.delete(f"/api/v1/members/{owner.pk}/"),
                    admin.post("/api/v1/invitations/", {"email": "boss2@example.test", "role": Role.OWNER}, format="json"),
                    admin.post(f"/api/v1/invitations/{invited_owner['id']}/revoke/")):
        assert refused.status_code == 403 and "Only owners may grant" in refused.json()["detail"]
    assert (Membership.objects.get(pk=owner.pk).role, Membership.objects.get(pk=own.pk).role) == (Role.OWNER, Role.ADMIN)
    assert [invitation.email for invitation in org.invitations.pending()] == ["boss@example.test"]
    paths = owner_client.get("/api/schema/?format=json").json()["paths"]
    for path, method in (("/api/v1/members/{id}/", "patch"), ("/api/v1/members/{id}/", "delete"),
                         ("/api/v1/invitations/", "post")):
        assert "role does not allow" in paths[path][method]["responses"]["403"]["description"]

    # What no role changes stays a 400 on its field: an address already invited, the last owner leaving.
    again = admin.post("/api/v1/invitations/", {"email": "boss@example.test", "role": Role.MEMBER}, format="json")
    assert again.status_code == 400 and "pending" in again.json()["email"][0]
    last = owner_client.patch(f"/api/v1/members/{owner.pk}/", {"role": Role.ADMIN}, format="json")
    assert last.status_code == 400 and "at least one owner" in last.json()["role"][0]
    assert owner_client.delete(f"/api/v1/members/{owner.pk}/").status_code == 400


@pytest.mark.django_db
def test_a_removed_members_keys_are_revoked_and_an_invitation_back_brings_none_of_them_back(org, member_client_factory):
    """Before, removal deleted the membership only: the keys looked live in the list, and came back, `manage` keys
    made as an admin included, when the person was invited again, even as a viewer."""
    clients = _clients(org, member_client_factory)
    bob = clients["admin"]
    child = bob.post("/api/v1/keys/", {"name": "made by bob's key", "scopes": ["inference"]}, format="json").json()
    owner = signed_in_api_client(clients["owner"].user)
    bobs_membership = Membership.objects.get(organization=org, user=bob.user)

    assert owner.delete(f"/api/v1/members/{bobs_membership.pk}/").status_code == 204

    listed = {row["id"]: row for row in owner.get("/api/v1/keys/").json()["results"]}
    bobs_keys = ApiKey.objects.filter(organization=org, created_by=bob.user)
    assert bobs_keys.count() == 2 and all(listed[key.pk]["revoked_at"] is not None for key in bobs_keys)
    assert _key_of(clients["member"]).revoked_at is None
    assert sorted((event.target_id, event.details["reason"]) for event in AuditEvent.objects.filter(
        action="api_key.revoke")) == sorted((str(key.pk), "member.remove") for key in bobs_keys)

    invited = owner.post("/api/v1/invitations/", {"email": bob.user.email, "role": Role.VIEWER}, format="json")
    assert invited.status_code == 201
    invitations.accept_invitation(services.Actor(user=bob.user), Invitation.objects.get(pk=invited.json()["id"]))
    keys.API_KEY_LOOKUPS.clear()
    assert bob.get("/api/v1/endpoints/").status_code == 401
    bob.credentials(HTTP_AUTHORIZATION=f"Bearer {child['secret']}")
    assert bob.get("/api/v1/endpoints/").status_code == 401


@pytest.mark.django_db
def test_removing_a_member_revokes_only_their_keys_in_that_organisation(org, member_client_factory):
    clients = _clients(org, member_client_factory)
    elsewhere = OrganizationFactory()
    MembershipFactory(organization=elsewhere, user=clients["member"].user, role=Role.OWNER)
    kept = keys.create_api_key(services.Actor(user=clients["member"].user), elsewhere, name="theirs",
                               scopes=[Scope.INFERENCE])
    members.remove_member(services.Actor(user=clients["owner"].user),
                          Membership.objects.get(organization=org, user=clients["member"].user))
    assert _key_of_in(clients["member"], org).revoked_at is not None
    assert ApiKey.objects.get(pk=kept.api_key.pk).revoked_at is None


def _key_of_in(client, organization) -> ApiKey:
    return ApiKey.objects.get(created_by=client.user, organization=organization)


@pytest.mark.django_db(transaction=True)
def test_a_member_demoted_to_viewer_has_keys_that_stop_inferring_within_the_cache_window():
    organization = OrganizationFactory()
    user = UserFactory()
    membership = MembershipFactory(organization=organization, user=user, role=Role.MEMBER)
    created = keys.create_api_key(services.Actor(user=user), organization, name="app", scopes=[Scope.INFERENCE])
    headers = {"authorization": f"Bearer {created.plain}"}
    assert asyncio.run(authenticate(headers)).organization_id == organization.pk

    members.change_member_role(services.SYSTEM, membership, role=Role.VIEWER)

    async def first_refusal() -> OpenAIError:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while loop.time() < deadline:
            try:
                await authenticate(headers)
            except OpenAIError as exc:
                return exc
            await asyncio.sleep(0.1)
        raise AssertionError("a viewer's key still infers a minute after the demotion")

    refusal = asyncio.run(first_refusal())
    assert refusal.status == 403 and "viewer" in refusal.message
    assert refusal.code == "insufficient_permissions"


def _waiting_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        # NOTE: asked inside the change's transaction, pg_stat_activity answers the snapshot its first read took: the
        # other change, blocked a moment after that read, was never seen waiting (60 s, then a failure now and then).
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()")
        return cursor.fetchone()[0] > 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", ["demote", "remove"])
def test_two_owners_demoting_each_other_at_once_leave_one_owner(monkeypatch, change):
    organization = OrganizationFactory()
    alice, bob = UserFactory(), UserFactory()
    memberships = {user: MembershipFactory(organization=organization, user=user, role=Role.OWNER) for user in (alice, bob)}
    arrived: list[object] = []
    record_audit = members.record_audit

    def record_audit_once_both_decided(actor, *args, **kwargs):
        # Each change holds here, after its checks, until the other change has also decided or
        # is queued behind a lock: without real locks both pass their checks against the old state.
        arrived.append(actor.user)
        wait_until(lambda: len(arrived) == 2 or _waiting_on_a_lock(), 60, message="the other change to decide or wait")
        return record_audit(actor, *args, **kwargs)

    monkeypatch.setattr(members, "record_audit", record_audit_once_both_decided)
    outcomes: dict[object, object] = {}

    def act(actor_user, target_user):
        try:
            target = Membership.objects.get(pk=memberships[target_user].pk)
            if change == "demote":
                members.change_member_role(services.Actor(user=actor_user), target, role=Role.ADMIN)
            else:
                members.remove_member(services.Actor(user=actor_user), target)
            outcomes[actor_user] = "done"
        except (members.LastOwnerError, members.NotPermitted) as exc:
            outcomes[actor_user] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=act, args=(alice, bob)), threading.Thread(target=act, args=(bob, alice))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(str(outcome) == "done" for outcome in outcomes.values()) == [False, True], outcomes
    assert Membership.objects.filter(organization=organization, role=Role.OWNER).count() == 1


@pytest.mark.django_db
def test_a_key_created_while_its_creator_is_being_removed_is_refused(monkeypatch):
    # The role was read before the removal committed and the key inserted after the removal had listed the keys to
    # revoke: an unrevoked manage key of a non-member, working again once they were invited back (the review of this
    # stop's diff).
    org = OrganizationFactory()
    owner, bob = UserFactory(), UserFactory()
    MembershipFactory(organization=org, user=owner, role=Role.OWNER)
    bobs = MembershipFactory(organization=org, user=bob, role=Role.ADMIN)
    read_role = keys.actor_role

    def role_then_removed(actor, organization):
        role = read_role(actor, organization)
        members.remove_member(services.Actor(user=owner), Membership.objects.get(pk=bobs.pk))
        return role

    monkeypatch.setattr(keys, "actor_role", role_then_removed)
    with pytest.raises(members.NotPermitted):
        keys.create_api_key(services.Actor(user=bob), org, name="x", scopes=[Scope.MANAGE, Scope.INFERENCE])
    assert not ApiKey.objects.filter(organization=org, created_by=bob, revoked_at__isnull=True).exists()


@pytest.mark.django_db
def test_an_admin_demoted_to_member_loses_the_keys_only_an_admin_may_make_and_keeps_the_others(settings):
    settings.DEFAULT_KEY_REQUESTS_PER_MINUTE = 600
    organization = OrganizationFactory()
    owner, admin = UserFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    membership = MembershipFactory(organization=organization, user=admin, role=Role.ADMIN)
    as_admin = services.Actor(user=admin)
    made = {
        "manage": keys.create_api_key(as_admin, organization, name="ops", scopes=[Scope.MANAGE, Scope.INFERENCE]),
        "priority": keys.create_api_key(as_admin, organization, name="urgent", scopes=[Scope.INFERENCE],
                                         max_priority_boost=50),
        "fast": keys.create_api_key(as_admin, organization, name="bulk", scopes=[Scope.INFERENCE],
                                    requests_per_minute=100_000),
        "plain": keys.create_api_key(as_admin, organization, name="app", scopes=[Scope.INFERENCE]),
    }
    minted = keys.create_api_key(services.Actor(user=admin, api_key=made["manage"].api_key), organization,
                                 name="child", scopes=[Scope.MANAGE])
    manage_client = Client(HTTP_AUTHORIZATION=f"Bearer {made['manage'].plain}")
    assert manage_client.get("/api/v1/organization/").json()["role"] == Role.ADMIN

    demoted = signed_in_api_client(owner).patch(f"/api/v1/members/{membership.pk}/", {"role": Role.MEMBER}, format="json")

    assert demoted.status_code == 200, demoted.json()
    # A member may make none of these (the 'manage' scope, a priority range, limits above the platform's): an admin
    # demoted kept them, a member's session holding an admin's key.
    revoked = set(ApiKey.objects.filter(revoked_at__isnull=False).values_list("name", flat=True))
    assert revoked == {"ops", "urgent", "bulk", "child"}
    assert manage_client.get("/api/v1/organization/").status_code == 401
    assert keys.authenticate_api_key_with_role(made["plain"].plain)[1] == Role.MEMBER
    assert sorted(AuditEvent.objects.filter(action="api_key.revoke").values_list("target_id", "details__reason")) == sorted(
        (str(created.api_key.pk), "member.change_role")
        for created in (made["manage"], made["priority"], made["fast"], minted))


@pytest.mark.django_db(transaction=True)
def test_a_removed_members_key_stops_on_v1_within_the_cache_window_and_their_playground_at_once():
    """A guard (it held before): removal revokes the keys, which the gateway's key cache lets through for at most its
    window and one reload; a console session is looked up on every call, so the playground stops with the removal."""
    organization = OrganizationFactory()
    owner, user = UserFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    membership = MembershipFactory(organization=organization, user=user, role=Role.MEMBER)
    created = keys.create_api_key(services.Actor(user=user), organization, name="app", scopes=[Scope.INFERENCE])
    browser = Client()
    browser.force_login(user)
    csrf = _get_new_csrf_string()
    playground = {"cookie": f"{settings.SESSION_COOKIE_NAME}={browser.cookies[settings.SESSION_COOKIE_NAME].value}; "
                            f"{settings.CSRF_COOKIE_NAME}={csrf}", "x-csrftoken": csrf}
    with_key = {"authorization": f"Bearer {created.plain}"}
    for headers in (with_key, playground):
        assert asyncio.run(authenticate(headers)).organization_id == organization.pk

    members.remove_member(services.Actor(user=owner), membership)

    with pytest.raises(OpenAIError) as refused:
        asyncio.run(authenticate(playground))
    # The session had chosen the organisation (its sign-in did): it is told it is no longer a member (a 401 "no API
    # key" before), and acts in no other (`tests/test_removed_member_sessions.py`).
    assert refused.value.status == 403 and "no longer a member" in refused.value.message

    async def key_refused() -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hot.API_KEY_CACHE_S + 30
        while loop.time() < deadline:
            try:
                await authenticate(with_key)
            except OpenAIError as exc:
                return exc.status == 401
            await asyncio.sleep(0.1)
        return False

    assert asyncio.run(key_refused()), "a removed member's key still infers past the cache window"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", ["remove", "demote"])
def test_a_removal_or_demotion_while_a_key_of_the_member_is_being_created_revokes_it(change):
    """The key's creation locked the membership's row, and its foreign keys lock the organisation's row only at its
    commit (PostgreSQL checks Django's foreign keys deferred); a removal or demotion takes the organisation's row, then
    waited on the membership's: each waited on the other, and PostgreSQL broke the deadlock by failing one (a 500)."""
    organization = OrganizationFactory()
    owner, bob = UserFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    bobs = MembershipFactory(organization=organization, user=bob, role=Role.ADMIN)
    failures: list[BaseException] = []
    change_role = threading.Thread(target=_change_then_close, args=(change, owner, bobs.pk, failures))

    def change_while_the_key_is_uncommitted(sender, *, api_key, **kwargs):
        change_role.start()
        wait_until(lambda: not change_role.is_alive() or _waiting_on_a_lock(), 60, message="the change to wait or end")

    keys.api_key_created.connect(change_while_the_key_is_uncommitted)
    try:
        created = keys.create_api_key(services.Actor(user=bob), organization, name="x", scopes=[Scope.MANAGE])
    finally:
        keys.api_key_created.disconnect(change_while_the_key_is_uncommitted)
    change_role.join(timeout=60)

    assert failures == []
    left = Membership.objects.filter(pk=bobs.pk).values_list("role", flat=True).first()
    assert left == (None if change == "remove" else Role.MEMBER)
    assert ApiKey.objects.get(pk=created.api_key.pk).revoked_at is not None


def _change_then_close(change: str, owner, membership_pk: int, failures: list) -> None:
    try:
        membership, actor = Membership.objects.get(pk=membership_pk), services.Actor(user=owner)
        if change == "remove":
            members.remove_member(actor, membership)
        else:
            members.change_member_role(actor, membership, role=Role.MEMBER)
    except Exception as exc:  # noqa: BLE001 - the test reports it
        failures.append(exc)
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", ["remove", "demote"])
def test_a_key_revoked_while_its_creator_is_removed_or_demoted_is_revoked_once_and_neither_fails(monkeypatch, change):
    """Revoking locked the key's row, and its audit event's foreign keys lock the organisation's row at commit; the
    creator's removal (or demotion below admin) takes the organisation's row, then revokes their keys: each waited on
    the other, and PostgreSQL failed one of them (a 500)."""
    organization = OrganizationFactory()
    owner, bob = UserFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    bobs = MembershipFactory(organization=organization, user=bob, role=Role.ADMIN)
    created = keys.create_api_key(services.Actor(user=bob), organization, name="ops", scopes=[Scope.MANAGE])
    failures: list[BaseException] = []
    changing = threading.Thread(target=_change_then_close, args=(change, owner, bobs.pk, failures))
    record_audit = keys.record_audit

    def record_audit_while_the_creator_changes(actor, organization, action, *args, **kwargs):
        if not changing.is_alive() and changing.ident is None:
            changing.start()
            wait_until(lambda: not changing.is_alive() or _waiting_on_a_lock(), 60, message="the change to wait or end")
        return record_audit(actor, organization, action, *args, **kwargs)

    monkeypatch.setattr(keys, "record_audit", record_audit_while_the_creator_changes)
    keys.revoke_api_key(services.Actor(user=owner), created.api_key)
    changing.join(timeout=60)

    assert failures == []
    assert ApiKey.objects.get(pk=created.api_key.pk).revoked_at is not None
    assert AuditEvent.objects.filter(action="api_key.revoke", target_id=str(created.api_key.pk)).count() == 1


def _accounts_data_migrations_after(name: str):
    """The data operations of the accounts migrations after `name` on disk: what the next release's `migrate` runs."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    later = sorted(key for key in loader.disk_migrations if key[0] == "controlplane" and key[1] > name)
    return [operation for key in later for operation in loader.disk_migrations[key].operations
            if isinstance(operation, RunPython)]


@pytest.mark.django_db
def test_what_an_older_pod_let_a_member_keep_while_the_revoking_migration_rolled_out_is_revoked_by_the_next_release():
    """Migration 0014 runs first in its deploy, while web pods of the code before it still serve: a demotion or removal
    there, after the migration, revoked nothing, and the member kept their `manage` key and invitations for good."""
    organization = OrganizationFactory()
    owner, demoted, removed = UserFactory(), UserFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    seats = {user: MembershipFactory(organization=organization, user=user, role=Role.ADMIN) for user in (demoted, removed)}
    ops = keys.create_api_key(services.Actor(user=demoted), organization, name="ops", scopes=[Scope.MANAGE]).api_key
    gone = keys.create_api_key(services.Actor(user=removed), organization, name="gone", scopes=[Scope.INFERENCE]).api_key
    sent = invitations.invite_member(services.Actor(user=demoted), organization, email="a@example.test", role=Role.MEMBER)
    importlib.import_module("controlplane.accounts.migrations.0014_revoke_what_roles_may_not_hold"
                            ).revoke_what_roles_may_not_hold(apps, None)
    assert not ApiKey.objects.filter(revoked_at__isnull=False).exists()  # nothing to revoke yet
    # Then, on a pod of the code before 0014: the role changed, the seat deleted, nothing else.
    Membership.objects.filter(pk=seats[demoted].pk).update(role=Role.MEMBER)
    Membership.objects.filter(pk=seats[removed].pk).delete()

    for operation in _accounts_data_migrations_after("0014_revoke_what_roles_may_not_hold"):
        operation.code(apps, None)

    # Before: no later migration: both keys live, the invitation pending.
    assert set(ApiKey.objects.filter(revoked_at__isnull=False).values_list("pk", flat=True)) == {ops.pk, gone.pk}
    assert Invitation.objects.get(pk=sent.pk).status == "revoked"


@pytest.mark.django_db
def test_the_migration_revokes_what_members_demoted_or_removed_before_it_kept_and_audits_each(settings):
    """A demotion or removal before those revoked anything left keys and pending invitations the role may not make;
    refused while the person was away, each was good again once they were invited back or promoted."""
    settings.DEFAULT_KEY_REQUESTS_PER_MINUTE = 600
    organization = OrganizationFactory()
    owner, demoted, removed, admin = UserFactory(), UserFactory(), UserFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    seats = {user: MembershipFactory(organization=organization, user=user, role=Role.ADMIN)
             for user in (demoted, removed, admin)}

    def key(user, name, **limits):
        return keys.create_api_key(services.Actor(user=user), organization, name=name, **limits).api_key

    ops = key(demoted, "ops", scopes=[Scope.MANAGE, Scope.INFERENCE])
    child = keys.create_api_key(services.Actor(user=demoted, api_key=ops), organization, name="child",
                                scopes=[Scope.MANAGE]).api_key
    urgent = key(demoted, "urgent", scopes=[Scope.INFERENCE], max_priority_boost=50)
    bulk = key(demoted, "bulk", scopes=[Scope.INFERENCE], requests_per_minute=100_000)
    plain = key(demoted, "app", scopes=[Scope.INFERENCE])
    gone = key(removed, "gone", scopes=[Scope.INFERENCE])
    kept = key(admin, "admins", scopes=[Scope.MANAGE])

    def invite(user, email, role):
        return invitations.invite_member(services.Actor(user=user), organization, email=email, role=role)

    from_demoted = invite(demoted, "a@example.test", Role.MEMBER)
    from_removed = invite(removed, "b@example.test", Role.MEMBER)
    owner_from_admin = invite(owner, "c@example.test", Role.OWNER)
    from_admin = invite(admin, "d@example.test", Role.ADMIN)
    # As a demotion and a removal before that revoked anything left them: the role changed, nothing else.
    Membership.objects.filter(pk=seats[demoted].pk).update(role=Role.MEMBER)
    Membership.objects.filter(pk=seats[removed].pk).delete()
    Membership.objects.filter(organization=organization, user=owner).update(role=Role.ADMIN)
    Membership.objects.filter(pk=seats[admin].pk).update(role=Role.OWNER)

    migration = importlib.import_module("controlplane.accounts.migrations.0014_revoke_what_roles_may_not_hold")
    migration.revoke_what_roles_may_not_hold(apps, None)

    revoked = set(ApiKey.objects.filter(revoked_at__isnull=False).values_list("pk", flat=True))
    assert revoked == {ops.pk, child.pk, urgent.pk, bulk.pk, gone.pk}
    assert {plain.pk, kept.pk}.isdisjoint(revoked)
    assert [Invitation.objects.get(pk=sent.pk).status for sent in (from_demoted, from_removed, owner_from_admin,
                                                                    from_admin)] == ["revoked", "revoked", "revoked",
                                                                                     "pending"]
    reasons = sorted(AuditEvent.objects.filter(action__in=["api_key.revoke", "invitation.revoke"]).values_list(
        "target_type", "target_id", "details__reason"))
    assert reasons == sorted([
        ("ApiKey", str(ops.pk), "beyond its creator's role"), ("ApiKey", str(child.pk), "minted by a revoked key"),
        ("ApiKey", str(urgent.pk), "beyond its creator's role"), ("ApiKey", str(bulk.pk), "beyond its creator's role"),
        ("ApiKey", str(gone.pk), "its creator is no longer a member"),
        ("Invitation", str(from_demoted.pk), "beyond its sender's role"),
        ("Invitation", str(from_removed.pk), "its sender is no longer a member"),
        ("Invitation", str(owner_from_admin.pk), "beyond its sender's role"),
    ])


_0016 = importlib.import_module("controlplane.accounts.migrations.0016_revoke_what_roles_may_not_hold_again")


def _run_0016_paused_before_its_first_judgement(changes_meanwhile, *, after_reading='"controlplane_membership"',
                                                at_a_lock=True):
    """0016 run as `migrate` runs it, paused where the live code of its release may still change the organisation: at
    its first lock of an organisation, or after its first read of the roles, whichever comes first."""
    paused, go_on, errors = threading.Event(), threading.Event(), []
    state = {"read": False}

    def pause_once(execute, sql, params, many, context):
        if not paused.is_set() and (state["read"] or (at_a_lock and "FOR NO KEY UPDATE" in sql)):
            paused.set()
            assert go_on.wait(20)
        result = execute(sql, params, many, context)
        state["read"] |= sql.startswith("SELECT") and after_reading in sql.split(" WHERE ")[0]
        return result

    def migration():
        try:
            with connection.execute_wrapper(pause_once):
                _0016.Migration.operations[0].code(apps, None)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=migration)
    thread.start()
    try:
        assert paused.wait(20)
        changes_meanwhile()
    finally:
        go_on.set()
        thread.join(30)
    assert not errors, errors


@pytest.mark.django_db(transaction=True)
def test_an_invitation_from_a_member_promoted_while_0016_runs_is_kept():
    """Before, 0016 (0014's function) read every role once, first: a member promoted by this release's pods meanwhile,
    who then invited a colleague, had the invitation revoked as "beyond its sender's role"."""
    organization = OrganizationFactory()
    owner, promoted = UserFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    seat = MembershipFactory(organization=organization, user=promoted, role=Role.MEMBER)
    keys.create_api_key(services.Actor(user=owner), organization, name="ops", scopes=[Scope.MANAGE])  # to judge
    sent = []

    def promoted_then_inviting():
        members.change_member_role(services.Actor(user=owner), seat, role=Role.ADMIN)
        sent.append(invitations.invite_member(services.Actor(user=promoted), organization,
                                              email="colleague@example.test", role=Role.MEMBER))

    _run_0016_paused_before_its_first_judgement(promoted_then_inviting)
    assert Invitation.objects.get(pk=sent[0].pk).revoked_at is None
    assert not AuditEvent.objects.filter(action="invitation.revoke").exists()


@pytest.mark.django_db(transaction=True)
def test_a_key_made_by_someone_who_joined_as_an_admin_while_0016_runs_is_kept():
    """Before, 0016 read every role once, first: a manage key made meanwhile by someone who had just accepted an
    invitation as an admin was revoked as "its creator is no longer a member"."""
    organization = OrganizationFactory()
    owner, joining = UserFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    keys.create_api_key(services.Actor(user=owner), organization, name="ops", scopes=[Scope.MANAGE])  # to judge
    made = []

    def joined_then_making_a_key():
        MembershipFactory(organization=organization, user=joining, role=Role.ADMIN)  # an accepted invitation's seat
        made.append(keys.create_api_key(services.Actor(user=joining), organization, name="deploys",
                                        scopes=[Scope.MANAGE]).api_key)

    _run_0016_paused_before_its_first_judgement(joined_then_making_a_key)
    assert ApiKey.objects.get(pk=made[0].pk).revoked_at is None
    assert not AuditEvent.objects.filter(action="api_key.revoke").exists()


@pytest.mark.django_db(transaction=True)
def test_an_invitation_accepted_while_0016_judges_it_is_neither_revoked_nor_audited():
    """Before, 0016's revocation of an invitation was unconditional: one accepted (or revoked) between its read of the
    pending invitations and its UPDATE was revoked all the same, and audited (again)."""
    organization = OrganizationFactory()
    owner, demoted = UserFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    seat = MembershipFactory(organization=organization, user=demoted, role=Role.ADMIN)
    sent = invitations.invite_member(services.Actor(user=demoted), organization, email="a@example.test",
                                     role=Role.MEMBER)
    Membership.objects.filter(pk=seat.pk).update(role=Role.MEMBER)  # on a pod of the code before 0014

    def accepted_meanwhile():  # by a pod of the code before, which takes no organisation's lock
        Invitation.objects.filter(pk=sent.pk).update(accepted_at=timezone.now())

    _run_0016_paused_before_its_first_judgement(accepted_meanwhile, after_reading='"controlplane_invitation"',
                                                at_a_lock=False)
    assert Invitation.objects.get(pk=sent.pk).revoked_at is None
    assert not AuditEvent.objects.filter(action="invitation.revoke").exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", ["promote", "remove", "revoke an invitation"])
def test_an_admin_demoted_while_their_change_of_a_member_waits_changes_nothing(change):
    """An admin's role was checked before the organisation's row was locked, and never again: an owner demoting a
    hostile admin at the moment that admin promoted their second account (or removed a colleague, or revoked the
    owner's invitation) saw the change go through after the demotion committed (the test saw the accomplice an
    admin, the colleague gone, the invitation revoked)."""
    from django.db import transaction

    from controlplane.accounts.models import lock_organizations

    organization = OrganizationFactory()
    owner, admin, other = UserFactory(), UserFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    admins = MembershipFactory(organization=organization, user=admin, role=Role.ADMIN)
    others = MembershipFactory(organization=organization, user=other, role=Role.MEMBER)
    invitation = invitations.invite_member(services.Actor(user=owner), organization, email="new@example.test",
                                           role=Role.MEMBER)
    answers = []

    def admins_request():
        try:
            api = signed_in_api_client(admin)
            if change == "promote":
                answers.append(api.patch(f"/api/v1/members/{others.pk}/", {"role": Role.ADMIN}, format="json"))
            elif change == "remove":
                answers.append(api.delete(f"/api/v1/members/{others.pk}/"))
            else:
                answers.append(api.post(f"/api/v1/invitations/{invitation.pk}/revoke/"))
        finally:
            connection.close()

    thread = threading.Thread(target=admins_request)
    with transaction.atomic():  # the owner's demotion, holding the organisation's row
        lock_organizations([organization.pk])
        thread.start()  # past its role's check (the demotion is not committed), then queued on the row
        wait_until(_waiting_on_a_lock, 30, message="the admin's change to queue on the organisation's row")
        members.change_member_role(services.Actor(user=owner), admins, role=Role.MEMBER)
    thread.join(60)

    [answer] = answers
    assert answer.status_code == 403, (answer.status_code, answer.content)
    assert Membership.objects.filter(pk=others.pk, role=Role.MEMBER).exists()
    assert Invitation.objects.get(pk=invitation.pk).status == "pending"


@pytest.mark.django_db(transaction=True)
def test_an_owner_demoted_to_admin_while_revoking_an_owners_invitation_revokes_nothing():
    """Revoking an invitation read the actor's role again under the organisation's row lock, but not the owner role's
    guard (`members.ensure_may_touch_owner_role`): an owner demoted to admin by another owner while their revocation
    of an owner's invitation waited on the row revoked it once the demotion committed, an admin taking away an
    owner's seat to be (the test saw 200 and the invitation revoked)."""
    from django.db import transaction

    from controlplane.accounts.models import lock_organizations

    organization = OrganizationFactory()
    owner, second = UserFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    seconds = MembershipFactory(organization=organization, user=second, role=Role.OWNER)
    invitation = invitations.invite_member(services.Actor(user=owner), organization, email="cfo@example.test",
                                           role=Role.OWNER)
    answers = []

    def seconds_request():
        try:
            answers.append(signed_in_api_client(second).post(f"/api/v1/invitations/{invitation.pk}/revoke/"))
        finally:
            connection.close()

    thread = threading.Thread(target=seconds_request)
    with transaction.atomic():  # the owner's demotion of the second owner, holding the organisation's row
        lock_organizations([organization.pk])
        thread.start()  # past its checks (the demotion is not committed), then queued on the row
        wait_until(_waiting_on_a_lock, 30, message="the revocation to queue on the organisation's row")
        members.change_member_role(services.Actor(user=owner), seconds, role=Role.ADMIN)
    thread.join(60)

    [answer] = answers
    assert answer.status_code == 403, (answer.status_code, answer.content)
    assert Invitation.objects.get(pk=invitation.pk).status == "pending"
