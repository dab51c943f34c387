"""billing/0030, 0033 and 0037 run again after a build of their usage index that was interrupted (a pod killed in a
rolling deploy): the invalid index it left is dropped and built again without stopping the usage table's reads and
writes."""

import threading
import time

import psycopg
import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

# (the migration, the one before it, the index it builds on billing_usagerecord)
MIGRATIONS = [("0030_credit_draw_and_held_rollups_indexes", "0029_spend_ceiling", "usage_org_prepaid_recorded"),
              ("0033_usage_batch_index", "0032_grandfather_spend_ceilings", "usage_org_batch"),
              ("0037_credit_given_back_and_unpaid", "0036_signed_rollup_adjustments", "usage_org_prepaid_overcharged")]


def _connect():
    settings = connection.settings_dict
    return psycopg.connect(dbname=settings["NAME"], user=settings["USER"], password=settings["PASSWORD"] or None,
                           host=settings["HOST"] or None, port=settings["PORT"] or None, autocommit=True)


def _run_again(migration: str, before: str) -> None:
    """`migration` as `migrate` runs it when not recorded as applied (other apps' later migrations left as they are)."""
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM django_migrations WHERE app = 'billing' AND name = %s", [migration])
    executor = MigrationExecutor(connection)
    state = executor.loader.project_state(("billing", before))
    executor.apply_migration(state, executor.loader.get_migration("billing", migration))


def _index_valid(index: str) -> bool | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", [index])
        row = cursor.fetchone()
    return None if row is None else row[0]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("migration", "before", "index"), MIGRATIONS)
def test_usage_is_read_and_written_while_a_migration_drops_an_interrupted_builds_index_behind_a_long_transaction(
        migration, before, index):
    """Before: the invalid index was dropped with a plain DROP INDEX (an ACCESS EXCLUSIVE lock): queued behind a
    transaction that writes usage, it held every later read and write of a usage row (the gateway's ledger) for as
    long as the migration waited. (0030's and 0037's ALTER TABLE before it lock other tables, not the usage table.)"""
    with connection.cursor() as cursor:  # what an interrupted CREATE INDEX CONCURRENTLY leaves: an invalid index
        cursor.execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid = %s::regclass", [index])
    long_transaction, ledger = _connect(), _connect()
    outcome = []

    def run_it_again():
        try:
            _run_again(migration, before)
        except Exception as exc:  # noqa: BLE001
            outcome.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run_it_again)
    try:
        long_transaction.execute("BEGIN")
        long_transaction.execute("LOCK TABLE billing_usagerecord IN ROW EXCLUSIVE MODE")  # as a usage write in its transaction
        thread.start()
        deadline = time.monotonic() + 20
        while not ledger.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> "
                                 "pg_backend_pid() AND query ILIKE %s", [f"%{index}%"]).fetchone()[0]:
            assert time.monotonic() < deadline, "the migration never waited on the long transaction"
            time.sleep(0.05)
        ledger.execute("SET lock_timeout = '4s'")
        started = time.monotonic()
        ledger.execute("SELECT count(*) FROM billing_usagerecord")  # a usage read: ACCESS SHARE
        ledger.execute("UPDATE billing_usagerecord SET batch_id = batch_id WHERE id = -1")  # a write: ROW EXCLUSIVE
        assert time.monotonic() - started < 1.5, "a usage read or write waited behind the invalid index's drop"
    finally:
        long_transaction.execute("ROLLBACK")
        thread.join(30)
        for open_connection in (long_transaction, ledger):
            open_connection.close()
    assert not outcome
    assert _index_valid(index) is True
