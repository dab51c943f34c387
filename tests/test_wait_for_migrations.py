"""A pod of a new release waits for its migrations before it serves: its init container loops on Django's
`manage.py migrate --check` (infra/k8s/base/patches/wait-for-migrations.yaml, tests/infra/test_manifests.py). Our
`migrate` (controlplane/management/commands/migrate.py) replaces Django's: its `--check` must still only check."""

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor


def _unapplied() -> list:
    executor = MigrationExecutor(connection)
    return executor.migration_plan(executor.loader.graph.leaf_nodes())


def _before_the_last(app_label: str) -> str:
    """The name of the migration of `app_label` just before its last one."""
    graph = MigrationExecutor(connection).loader.graph
    [last] = [node for node in graph.leaf_nodes() if node[0] == app_label]
    [before] = [parent for parent in graph.node_map[last].parents if parent[0] == app_label]
    return before[1]


@pytest.mark.django_db(transaction=True)
def test_migrate_check_exits_non_zero_while_a_migration_is_unapplied_and_applies_nothing():
    call_command("migrate", check_unapplied=True, verbosity=0)  # every one applied: exits 0
    # NOTE: one migration unapplied is enough, and cheap: each migration taken back and applied again costs Django's
    # model states (endpoints back to 0026, six of them, took ~25 s of this test's ~28).
    call_command("migrate", "endpoints", _before_the_last("endpoints"), verbosity=0)
    try:
        with pytest.raises(SystemExit) as exited:
            call_command("migrate", check_unapplied=True, verbosity=0)
        assert exited.value.code == 1
        assert _unapplied(), "--check applied the migrations"
    finally:
        call_command("migrate", "endpoints", verbosity=0)  # what the migration Job does
    call_command("migrate", check_unapplied=True, verbosity=0)
