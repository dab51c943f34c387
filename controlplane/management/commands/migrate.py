"""`migrate` that never holds a table's lock queue for long: each statement waits at most `--lock-timeout` seconds
(PostgreSQL's `lock_timeout`) for its lock, and the run is tried again, `--lock-tries` times in all, when one gave up.

Why: an `ALTER TABLE` (a database default's `SET DEFAULT`, the rolling deploy's migrations) takes ACCESS EXCLUSIVE. Queued
behind one long transaction on its table (a pg_dump, a slow report, a session idle in a transaction), it waited for as
long as that transaction lasted, and every later read of the table (the gateway's of `endpoints_endpoint`) waited
behind it. Now such a read waits at most the lock timeout; the migration gives up, waits, and tries again.

NOTE: trying again is safe: an atomic migration that gave up rolled back whole, and a non-atomic one (`atomic = False`:
each database default's migration) is re-run from its start, each of its `SET DEFAULT`s setting the same value again.
Past the last try the command fails as before; the migrate Job's pod is restarted (`backoffLimit`). An app's command
replaces Django's own of its name.
"""

from __future__ import annotations

import logging
import time

from django.core.management.commands import migrate
from django.db import OperationalError, connections, transaction

logger = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 2.0
NUM_LOCK_TRIES = 5
LOCK_RETRY_PAUSE_S = 5.0  # after the first give-up; twice that after the second, and so on
LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for a lock_timeout that ran out


def gave_up_on_a_lock(exc: BaseException) -> bool:
    return getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE


class Command(migrate.Command):
    help = migrate.Command.help + " Each statement waits at most --lock-timeout seconds for a lock; tried again."

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument("--lock-timeout", type=float, default=LOCK_TIMEOUT_S, dest="lock_timeout_s",
                            help=f"Seconds a statement may wait for a lock (default {LOCK_TIMEOUT_S}).")
        parser.add_argument("--lock-tries", type=int, default=NUM_LOCK_TRIES, dest="num_lock_tries",
                            help=f"Runs in all while a lock is not had in time (default {NUM_LOCK_TRIES}).")
        parser.add_argument("--lock-retry-pause", type=float, default=LOCK_RETRY_PAUSE_S, dest="lock_retry_pause_s",
                            help=f"Seconds before the second run, doubled before each later one "
                                 f"(default {LOCK_RETRY_PAUSE_S}).")

    def handle(self, *args, **options):
        connection = connections[options["database"]]
        if connection.vendor != "postgresql":
            return super().handle(*args, **options)
        num_tries, pause_s = max(1, options["num_lock_tries"]), options["lock_retry_pause_s"]
        with connection.execute_wrapper(LockTimeout(options["lock_timeout_s"])):
            for number in range(1, num_tries + 1):
                try:
                    return super().handle(*args, **options)
                except OperationalError as exc:
                    if number == num_tries or not gave_up_on_a_lock(exc):
                        raise
                    logger.warning("migrate: a lock not had within %s s (%s); run %d of %d in %s s",
                                   options["lock_timeout_s"], exc, number + 1, num_tries, pause_s)
                    self.stderr.write(f"A lock was not had within {options['lock_timeout_s']} s ({exc}); trying "
                                      f"again in {pause_s} s ({number + 1} of {num_tries}).")
                    time.sleep(pause_s)
                    pause_s *= 2


class LockTimeout:
    """A database execute wrapper: each statement runs under `SET LOCAL lock_timeout`, in its own transaction when
    none is open (a non-atomic migration's), in the migration's when one is.

    NOTE: `SET LOCAL`, never a session `SET`: through PgBouncer in transaction mode (README, *PgBouncer*) a session
    setting would stay on a server connection that application code uses next. A statement that cannot run in a
    transaction (`CREATE INDEX CONCURRENTLY`, which blocks no reader) runs as it is."""

    def __init__(self, lock_timeout_s: float):
        self.set_local = f"SET LOCAL lock_timeout = '{max(1, round(lock_timeout_s * 1000))}ms'"

    def __call__(self, execute, sql, params, many, context):
        connection = context["connection"]
        if not connection.in_atomic_block and "CONCURRENTLY" in str(sql).upper():
            return execute(sql, params, many, context)
        with transaction.atomic(using=connection.alias, savepoint=False):
            with connection.connection.cursor() as cursor:  # the driver's own: not a server-side one, not wrapped
                cursor.execute(self.set_local)
            return execute(sql, params, many, context)
