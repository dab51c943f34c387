"""`manage.py migrate` never keeps a table's lock queue for long (`controlplane/management/commands/migrate.py`): a
migration's ALTER queued behind one long transaction on its table gives up within its lock timeout, and the reads
queued behind it (the gateway's of `endpoints_endpoint`) go on."""

import threading
import time

import psycopg
import pytest
from django.core.management import call_command
from django.db import OperationalError, connection


def _connect():
    settings = connection.settings_dict
    return psycopg.connect(dbname=settings["NAME"], user=settings["USER"], password=settings["PASSWORD"] or None,
                           host=settings["HOST"] or None, port=settings["PORT"] or None, autocommit=True)


@pytest.mark.django_db(transaction=True)
def test_a_migration_queued_behind_a_long_transaction_gives_up_within_its_lock_timeout_and_readers_go_on():
    """Before: the ALTER of endpoints/0027 waited for as long as the transaction lasted (a pg_dump, a session idle in a
    transaction), and a gateway's read of the endpoints, queued behind it, waited as long (here it ran out of its own
    3 s lock timeout: LockNotAvailable)."""
    call_command("migrate", "endpoints", "0026", verbosity=0)  # endpoints/0027 to apply again
    long_transaction, gateway = _connect(), _connect()
    outcome = []

    def migration():
        try:
            call_command("migrate", "endpoints", "0027", verbosity=0, lock_timeout_s=0.5, num_lock_tries=2,
                         lock_retry_pause_s=0.1)
        except Exception as exc:  # noqa: BLE001
            outcome.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=migration)
    try:
        long_transaction.execute("BEGIN")
        long_transaction.execute("SELECT count(*) FROM endpoints_endpoint")  # held until the transaction ends
        thread.start()
        time.sleep(0.3)
        gateway.execute("SET lock_timeout = '3s'")
        started = time.monotonic()
        gateway.execute("SELECT id FROM endpoints_endpoint LIMIT 1")
        assert time.monotonic() - started < 1.5
        thread.join(10)
        assert not thread.is_alive(), "the migration still waits behind the long transaction"
        assert len(outcome) == 1 and isinstance(outcome[0], OperationalError)
        assert isinstance(outcome[0].__cause__, psycopg.errors.LockNotAvailable)
    finally:
        long_transaction.execute("ROLLBACK")
        thread.join(30)
        for open_connection in (long_transaction, gateway):
            open_connection.close()
        call_command("migrate", "endpoints", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("SELECT column_default FROM information_schema.columns"
                       " WHERE table_name = 'endpoints_endpoint' AND column_name = 'engine_generation'")
        assert cursor.fetchone() == ("0",)  # applied once the long transaction ended
