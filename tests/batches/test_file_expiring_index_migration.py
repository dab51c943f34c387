"""The expiry sweep's index, `file_expiring`, is built without stopping writes to `batches_file` (batches/0012, CREATE
INDEX CONCURRENTLY), and built again whole after a build that was interrupted."""

import threading
import time

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.loader import MigrationLoader


def _connect():
    settings = connection.settings_dict
    return psycopg.connect(dbname=settings["NAME"], user=settings["USER"], password=settings["PASSWORD"] or None,
                           host=settings["HOST"] or None, port=settings["PORT"] or None, autocommit=True)


def _index_migration() -> tuple[str, str]:
    """The batches migration that builds `file_expiring`, and the one before it."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    for (app, name), migration in sorted(loader.disk_migrations.items()):
        if app == "batches" and "file_expiring" in repr(migration.operations):
            before = next(parent for parent_app, parent in migration.dependencies if parent_app == "batches")
            return name, before
    raise AssertionError("no batches migration builds file_expiring")


def _wait_for_the_migration_to_queue(observer, naming: str = "batches_file") -> None:
    """Until the migration waits on a lock the long transaction holds (pg_stat_activity; its statement `naming` it):
    never a write that goes first only because the migration had not started."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if observer.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> "
                            "pg_backend_pid() AND query ILIKE %s", (f"%{naming}%",)).fetchone()[0]:
            return
        time.sleep(0.05)
    raise AssertionError("the migration never waited on the long transaction")


def _index_valid() -> bool | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass('file_expiring')")
        row = cursor.fetchone()
    return None if row is None else row[0]


@pytest.mark.django_db(transaction=True)
def test_uploads_and_deletes_go_on_while_the_expiry_index_is_built_behind_a_long_transaction():
    """Before: 0011 built it with a plain CREATE INDEX (a SHARE lock): queued behind a transaction that writes files, it
    held every later write of a file (an upload's, a delete's) as long as its lock timeout, and once it had the lock,
    for as long as its scan of the table."""
    name, before = _index_migration()
    call_command("migrate", "batches", before, verbosity=0)
    assert _index_valid() is None
    long_transaction, uploader = _connect(), _connect()
    outcome = []

    def migration():
        try:
            call_command("migrate", "batches", name, verbosity=0, lock_timeout_s=5, num_lock_tries=1)
        except Exception as exc:  # noqa: BLE001
            outcome.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=migration)
    try:
        long_transaction.execute("BEGIN")
        long_transaction.execute("LOCK TABLE batches_file IN ROW EXCLUSIVE MODE")  # as an upload in its transaction
        thread.start()
        _wait_for_the_migration_to_queue(uploader)
        uploader.execute("SET lock_timeout = '4s'")
        started = time.monotonic()
        uploader.execute("UPDATE batches_file SET bytes = bytes WHERE id = ''")  # a file's write: ROW EXCLUSIVE
        assert time.monotonic() - started < 1.5, "a write of a file waited behind the index's build"
    finally:
        long_transaction.execute("ROLLBACK")
        thread.join(30)
        for open_connection in (long_transaction, uploader):
            open_connection.close()
        call_command("migrate", "batches", verbosity=0)
    assert not outcome
    assert _index_valid() is True


@pytest.mark.django_db(transaction=True)
def test_the_expiry_index_is_built_again_after_a_build_that_was_interrupted():
    name, before = _index_migration()
    call_command("migrate", "batches", before, verbosity=0)
    with connection.cursor() as cursor:  # what an interrupted CREATE INDEX CONCURRENTLY leaves: an invalid index
        cursor.execute('CREATE INDEX "file_expiring" ON batches_file ("expires_at")')
        cursor.execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'file_expiring'::regclass")
    call_command("migrate", "batches", verbosity=0)
    assert _index_valid() is True


@pytest.mark.django_db(transaction=True)
def test_writes_of_files_go_on_while_an_interrupted_builds_index_is_dropped_behind_a_long_transaction():
    """Before: the invalid index an interrupted build left was dropped with a plain DROP INDEX (an ACCESS EXCLUSIVE
    lock): queued behind a transaction that writes files, it held every later read and write of a file for as long
    as the migration's lock timeout."""
    name, before = _index_migration()
    call_command("migrate", "batches", before, verbosity=0)
    with connection.cursor() as cursor:  # what an interrupted CREATE INDEX CONCURRENTLY leaves: an invalid index
        cursor.execute('CREATE INDEX "file_expiring" ON batches_file ("expires_at")')
        cursor.execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'file_expiring'::regclass")
    long_transaction, uploader = _connect(), _connect()
    outcome = []

    def migration():
        try:
            call_command("migrate", "batches", name, verbosity=0, lock_timeout_s=5, num_lock_tries=1)
        except Exception as exc:  # noqa: BLE001
            outcome.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=migration)
    try:
        long_transaction.execute("BEGIN")
        long_transaction.execute("LOCK TABLE batches_file IN ROW EXCLUSIVE MODE")  # as an upload in its transaction
        thread.start()
        _wait_for_the_migration_to_queue(uploader, naming="file_expiring")  # its drop, or the build named so
        uploader.execute("SET lock_timeout = '4s'")
        started = time.monotonic()
        uploader.execute("SELECT count(*) FROM batches_file")  # a file's read: ACCESS SHARE
        uploader.execute("UPDATE batches_file SET bytes = bytes WHERE id = ''")  # a file's write: ROW EXCLUSIVE
        assert time.monotonic() - started < 1.5, "a file's read or write waited behind the invalid index's drop"
    finally:
        long_transaction.execute("ROLLBACK")
        thread.join(30)
        for open_connection in (long_transaction, uploader):
            open_connection.close()
        call_command("migrate", "batches", verbosity=0)
    assert not outcome
    assert _index_valid() is True
