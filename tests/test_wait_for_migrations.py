"""A pod of a new release waits for its migrations before it serves (`manage.py wait_for_migrations`, each Django
Deployment's init container: tests/infra/test_manifests.py)."""

import threading

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection


@pytest.mark.django_db(transaction=True)
def test_the_wait_ends_once_the_migrations_are_applied_and_fails_past_its_timeout():
    call_command("wait_for_migrations", timeout_s=0, interval_s=0.1)  # every one applied: at once
    call_command("migrate", "endpoints", "0026", verbosity=0)
    try:
        with pytest.raises(CommandError, match=r"endpoints\.0027_database_defaults_for_older_code"):
            call_command("wait_for_migrations", timeout_s=0.3, interval_s=0.1)
        outcome = []

        def waiting():
            try:
                call_command("wait_for_migrations", timeout_s=30, interval_s=0.1)
                outcome.append("served")
            finally:
                connection.close()

        thread = threading.Thread(target=waiting)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive() and not outcome  # still waiting
    finally:
        call_command("migrate", "endpoints", verbosity=0)  # what the migration Job does
    thread.join(10)
    assert outcome == ["served"]
