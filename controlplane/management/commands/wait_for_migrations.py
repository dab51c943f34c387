"""`wait_for_migrations`: return once every migration of this code is applied; fail after `--timeout` seconds.

Each pod of web, worker, batch-worker and beat runs it first (an init container, infra/k8s/base/patches/
wait-for-migrations.yaml): `kubectl apply -k` applies the migration Job and the Deployments together, and a pod of the
new code must not serve before the Job applied what it reads (README, *A rolling deploy*). Past the timeout the init
container fails and Kubernetes starts it again, later; the previous release's pods serve on meanwhile.
"""

from __future__ import annotations

import time

from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, OperationalError, connections
from django.db.migrations.executor import MigrationExecutor

POLL_INTERVAL_S = 5.0
TIMEOUT_S = 1800.0  # the migration Job's activeDeadlineSeconds


def unapplied_migrations(database: str = DEFAULT_DB_ALIAS) -> list[str]:
    """`app.name` of each migration on disk not yet applied, in the order `migrate` would apply them."""
    connection = connections[database]
    executor = MigrationExecutor(connection)
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    return [f"{migration.app_label}.{migration.name}" for migration, _backwards in plan]


class Command(BaseCommand):
    help = "Wait until every migration of this code is applied (a pod's init container)."

    def add_arguments(self, parser):
        parser.add_argument("--timeout", type=float, default=TIMEOUT_S, dest="timeout_s")
        parser.add_argument("--interval", type=float, default=POLL_INTERVAL_S, dest="interval_s")
        parser.add_argument("--database", default=DEFAULT_DB_ALIAS)

    def handle(self, *args, timeout_s, interval_s, database, **options):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                unapplied = unapplied_migrations(database)
            except OperationalError as exc:  # the database not reachable yet: wait as for the migrations
                unapplied = [f"(the database: {exc})"]
            finally:
                connections[database].close()
            if not unapplied:
                self.stdout.write("Every migration is applied.")
                return
            if time.monotonic() >= deadline:
                raise CommandError(f"Migrations still not applied after {timeout_s} s: {', '.join(unapplied)}")
            self.stdout.write(f"Waiting for {len(unapplied)} migration(s): {', '.join(unapplied[:5])}")
            time.sleep(interval_s)
