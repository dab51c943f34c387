"""endpoints/0034 (`Replica.moved_at` and its index built CONCURRENTLY, not atomic) runs again to its end after a run
that was interrupted: a pod killed in a rolling deploy, or `migrate`'s own retry after a lock it gave up on
(`controlplane/management/commands/migrate.py`)."""

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

MIGRATION = ("endpoints", "0034_replica_moved_at")


def _run_0034_again() -> None:
    """0034 as `migrate` runs it when not recorded as applied (other migrations left as they are)."""
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM django_migrations WHERE app = %s AND name = %s", MIGRATION)
    executor = MigrationExecutor(connection)
    state = executor.loader.project_state(("endpoints", "0033_replica_starts_index"))
    executor.apply_migration(state, executor.loader.get_migration(*MIGRATION))


def _index_valid() -> bool | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass('replica_endpoint_moved')")
        row = cursor.fetchone()
    return None if row is None else row[0]


@pytest.mark.django_db(transaction=True)
def test_0034_runs_again_after_a_run_cut_short_once_its_column_was_added():
    # Before (Django's AddField in a migration that is not atomic), the column stayed, and every retry failed at once:
    # DuplicateColumn "moved_at", the deploy's migrate stuck until someone dropped it by hand.
    with connection.cursor() as cursor:
        cursor.execute('DROP INDEX IF EXISTS "replica_endpoint_moved"')
    _run_0034_again()
    assert _index_valid() is True
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM django_migrations WHERE app = %s AND name = %s", MIGRATION)
        assert cursor.fetchone() == (1,)


@pytest.mark.django_db(transaction=True)
def test_0034_builds_again_an_index_whose_build_was_interrupted():
    with connection.cursor() as cursor:
        cursor.execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'replica_endpoint_moved'::regclass")
    _run_0034_again()
    assert _index_valid() is True
