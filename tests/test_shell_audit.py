"""What an operator does from a shell on the servers is audited as staff's same change in the admin, naming the
operating-system account that ran the command (`Actor.at_shell`: `<user>@<host>` in the event's `operator`): a staff
account made with `createsuperuser`, a password set with `changepassword`, a second factor reset."""

from __future__ import annotations

import getpass
import io
import socket

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError

from controlplane.accounts.models import AuditEvent
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PASSWORD = "correct horse battery staple 42"


@pytest.fixture
def operator(monkeypatch) -> str:
    """The operating-system account the commands run as (`getpass.getuser` reads LOGNAME first)."""
    monkeypatch.setenv("LOGNAME", "ops-alice")
    return f"ops-alice@{socket.gethostname()}"


def test_a_superuser_made_with_createsuperuser_is_audited_naming_the_operator(monkeypatch, operator):
    for name, value in {"username": "admin", "email": "ops@x.test", "password": PASSWORD}.items():
        monkeypatch.setenv(f"DJANGO_SUPERUSER_{name.upper()}", value)

    call_command("createsuperuser", interactive=False, verbosity=0)

    user = get_user_model().objects.get(username="admin")
    event = AuditEvent.objects.get(action="user.create")
    assert (event.target_type, event.target_id, event.actor, event.organization) == ("User", str(user.pk), None, None)
    assert event.details == {"command": "createsuperuser", "is_staff": True, "is_superuser": True, "operator": operator}


def test_a_password_set_with_changepassword_is_audited_naming_the_operator(monkeypatch, operator):
    user = UserFactory(username="ops@x.test", is_staff=True)
    monkeypatch.setattr(getpass, "getpass", lambda prompt="Password: ": PASSWORD)

    call_command("changepassword", "ops@x.test", verbosity=0)

    user.refresh_from_db()
    assert user.check_password(PASSWORD)
    event = AuditEvent.objects.get(action="user.set_password")
    assert (event.target_id, event.actor) == (str(user.pk), None)
    assert event.details == {"command": "changepassword", "usable": True, "operator": operator}


def test_a_changepassword_given_up_after_three_mismatches_changes_and_audits_nothing(monkeypatch, operator):
    user = UserFactory(username="ops@x.test")
    before = user.password
    answers = iter(["one long password 1", "another long password 2"] * 3)
    monkeypatch.setattr(getpass, "getpass", lambda prompt="Password: ": next(answers))

    with pytest.raises(CommandError, match="after 3 attempts"):
        call_command("changepassword", "ops@x.test", verbosity=0)

    user.refresh_from_db()
    assert user.password == before
    assert not AuditEvent.objects.filter(action="user.set_password").exists()


def test_a_second_factor_reset_from_a_shell_names_the_operator(operator):
    user = UserFactory(email="ops@x.test", is_staff=True)

    call_command("reset_staff_second_factor", "ops@x.test", stdout=io.StringIO())

    event = AuditEvent.objects.get(action="staff.second_factor.reset", target_id=str(user.pk))
    assert event.details["operator"] == operator
