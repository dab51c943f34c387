import json

import pytest
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from controlplane.accounts.models import ApiKey, Membership, Organization

pytestmark = pytest.mark.django_db


def test_create_org_prints_json_with_a_working_manage_and_inference_key(capsys):
    call_command("create_org", "acme", "--owner", "Ops@Acme.test", "--json")
    output = json.loads(capsys.readouterr().out)
    assert output["org"] == "acme" and output["owner"] == "ops@acme.test"
    organization = Organization.objects.get(slug="acme")
    assert Membership.objects.get(organization=organization).role == "owner"
    key = ApiKey.objects.get(organization=organization)
    assert sorted(key.scopes) == ["inference", "manage"]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {output['api_key']}")
    assert client.get("/api/v1/endpoints/").status_code == 200


def test_create_org_twice_reuses_org_and_owner_and_issues_a_new_key(capsys):
    call_command("create_org", "acme", "--owner", "ops@acme.test", "--json")
    first = json.loads(capsys.readouterr().out)
    call_command("create_org", "acme", "--owner", "ops@acme.test", "--json")
    second = json.loads(capsys.readouterr().out)
    assert first["api_key"] != second["api_key"]
    assert Organization.objects.filter(slug="acme").count() == 1
    assert ApiKey.objects.filter(organization__slug="acme").count() == 2


def test_create_org_refuses_bad_input():
    with pytest.raises(CommandError):
        call_command("create_org", "not a slug", "--owner", "ops@acme.test")
    with pytest.raises(CommandError):
        call_command("create_org", "acme", "--owner", "not-an-email")
    assert not Organization.objects.exists()


def test_create_org_refuses_an_owner_address_past_the_username_column():
    """The owner's address is also their username (150 characters), checked as stored: lower-cased, which lengthens
    "\u0130" (a `DataError` at the insert before)."""
    for owner in ("a" * 141 + "@acme.test", "a" * 120 + "@" + "\u0130" * 20 + ".com"):
        with pytest.raises(CommandError, match="at most 150 characters"):
            call_command("create_org", "acme", "--owner", owner)
    assert not Organization.objects.exists()


def test_create_org_for_an_organisation_at_its_live_key_limit_says_so_without_a_traceback(capsys, settings):
    # NOTE: `keys.TooManyKeys` (a ValueError) went up through the command: an operator saw a traceback.
    settings.MAX_LIVE_API_KEYS_PER_ORG = 1
    call_command("create_org", "acme", "--owner", "ops@acme.test", "--json")
    capsys.readouterr()
    with pytest.raises(CommandError, match="1 live API keys"):
        call_command("create_org", "acme", "--owner", "ops@acme.test", "--json")
    assert ApiKey.objects.filter(organization__slug="acme").count() == 1


@pytest.mark.parametrize("name", ["Acme\u202eCorp", "Acme\u200bCorp", "x" * 129])
def test_create_org_refuses_a_name_the_name_rule_refuses_or_past_its_column(name):
    """Sign-up refuses such an organisation name (`text.name_problem`, 128 characters once NFC); the operator's command
    stored it raw (a direction override shown to every member), or failed with a database error past the column."""
    with pytest.raises(CommandError):
        call_command("create_org", "acme", "--owner", "ops@acme.test", "--name", name)
    assert not Organization.objects.exists()


def test_create_org_stores_its_name_composed():
    call_command("create_org", "acme", "--owner", "ops@acme.test", "--name", "Cafe\u0301")
    assert Organization.objects.get().name == "Caf\u00e9"


def test_create_org_refused_at_the_live_key_limit_leaves_no_new_owner_behind(capsys, settings):
    # NOTE: the owner (created, or given the password) and its membership were committed before the key was refused:
    # the command said it failed, yet a new owner of the organisation could log in.
    from django.contrib.auth import get_user_model

    settings.MAX_LIVE_API_KEYS_PER_ORG = 1
    call_command("create_org", "acme", "--owner", "ops@acme.test", "--json")
    capsys.readouterr()
    with pytest.raises(CommandError, match="1 live API keys"):
        call_command("create_org", "acme", "--owner", "new@acme.test", "--password", "a long passphrase 42", "--json")
    assert not get_user_model().objects.filter(username="new@acme.test").exists()
    assert list(Membership.objects.values_list("user__username", flat=True)) == ["ops@acme.test"]


@pytest.mark.parametrize("username", ["ops-admin", "Ops@Acme.test"], ids=["another username", "an unfolded address"])
def test_create_org_makes_the_account_sign_in_finds_by_the_owners_address_its_owner(capsys, username):
    """Before: the owner was looked up by its folded address as a username alone: an operator's account made by
    `createsuperuser` (another username, this address), or one stored before addresses were folded, was not found; a
    second account with the address was made owner, and the first could no longer sign in by its address (two
    accounts had it) or, unfolded, signed in as the new one, with no password."""
    from django.contrib.auth import authenticate, get_user_model

    existing = get_user_model().objects.create_user(username=username, email="ops@acme.test", password="pw-0123456789")
    call_command("create_org", "acme", "--owner", "OPS@acme.test", "--json")
    assert json.loads(capsys.readouterr().out)["owner"] == "ops@acme.test"
    assert get_user_model().objects.count() == 1
    assert Membership.objects.get(organization__slug="acme").user == existing
    assert authenticate(username="ops@acme.test", password="pw-0123456789") == existing


def test_create_org_refuses_an_owner_address_two_accounts_have(capsys):
    """Sign-in names neither of two accounts sharing an address (made before that was refused): nor does create_org."""
    from django.contrib.auth import get_user_model

    for username in ("ops-a", "ops-b"):
        get_user_model().objects.create_user(username=username, email="ops@acme.test")
    with pytest.raises(CommandError, match="2 accounts"):
        call_command("create_org", "acme", "--owner", "ops@acme.test")
    assert not Organization.objects.exists() and get_user_model().objects.count() == 2
