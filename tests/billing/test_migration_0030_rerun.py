"""billing/0030 (the credit draw's and the held rollups' indexes, built CONCURRENTLY, and the difference's columns)
runs again to its end after a run that was interrupted: a pod killed in a rolling deploy."""

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

MIGRATION = ("billing", "0030_credit_draw_and_held_rollups_indexes")


def _run_0030_again() -> None:
    """0030 as `migrate` runs it when not recorded as applied (other apps' later migrations left as they are)."""
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM django_migrations WHERE app = %s AND name = %s", MIGRATION)
    executor = MigrationExecutor(connection)
    state = executor.loader.project_state(("billing", "0029_spend_ceiling"))
    executor.apply_migration(state, executor.loader.get_migration(*MIGRATION))


def _valid_indexes() -> dict[str, bool]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexrelid::regclass::text, indisvalid FROM pg_index WHERE indexrelid::regclass::text "
                       "IN ('usage_org_prepaid_recorded', 'rollup_held')")
        return dict(cursor.fetchall())


@pytest.mark.django_db(transaction=True)
def test_0030_runs_again_after_a_run_cut_short_between_its_indexes():
    # Before (Django's AddIndexConcurrently), the retry failed at once: DuplicateTable "usage_org_prepaid_recorded".
    with connection.cursor() as cursor:
        cursor.execute('DROP INDEX IF EXISTS "rollup_held"')
        cursor.execute('ALTER TABLE billing_usagerollup DROP COLUMN IF EXISTS "difference_pending"')
    _run_0030_again()
    assert _valid_indexes() == {"usage_org_prepaid_recorded": True, "rollup_held": True}
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM django_migrations WHERE app = %s AND name = %s", MIGRATION)
        assert cursor.fetchone() == (1,)
        cursor.execute("SELECT difference_pending, difference_started_at FROM billing_usagerollup LIMIT 1")


@pytest.mark.django_db(transaction=True)
def test_0030_builds_again_an_index_whose_build_was_interrupted():
    # An interrupted CREATE INDEX CONCURRENTLY leaves the index INVALID: IF NOT EXISTS alone would keep it unused.
    with connection.cursor() as cursor:
        cursor.execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'rollup_held'::regclass")
    _run_0030_again()
    assert _valid_indexes() == {"usage_org_prepaid_recorded": True, "rollup_held": True}
