"""A transactional test's database reset that keeps the rows post_migrate would make again.

Django empties every table after each transactional test (`TransactionTestCase._fixture_teardown`: `flush`), then
emits post_migrate, which makes every content type and permission again: ~70 queries, two thirds of an empty
transactional test's teardown (~0.1 s idle, ~0.4 s on a loaded machine; ~560 such tests in the suite). Here the
content type and permission tables are left as they are when they hold exactly what the last post_migrate made
(their rows' fingerprint, checked after each test); every other table that holds a row is emptied by DELETE
(`_empty`; TRUNCATE, as `flush` empties it, where a key refuses). When a test changed them, or under
`available_apps` or `serialized_rollback`, Django's own flush runs, post_migrate and all.
Every test still starts from the same rows: empty tables, and the content types and permissions post_migrate makes.
"""

from __future__ import annotations

import weakref

from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.core.management.color import no_style
from django.db import IntegrityError, connections, transaction
from django.db.models.signals import post_migrate
from django.test import TransactionTestCase

# The tables post_migrate fills, by its receivers' modules (`create_contenttypes`, `create_permissions`). NOTE: a
# receiver of any other module (one of the project's own, seeding rows) makes every reset Django's own.
POST_MIGRATE_TABLES = ("django_content_type", "auth_permission")
POST_MIGRATE_RECEIVERS = frozenset(
    {"django.contrib.contenttypes.management", "django.contrib.auth.management"}
)
# database alias -> the tables' fingerprint after post_migrate last ran
_made_by_post_migrate: dict[str, tuple[str, ...]] = {}
_django_fixture_teardown = TransactionTestCase._fixture_teardown


def _fingerprint(connection) -> tuple[str, ...]:
    with connection.cursor() as cursor:
        fingerprint = []
        for table in POST_MIGRATE_TABLES:
            cursor.execute(
                f"SELECT count(*) || ':' || coalesce(md5(string_agg(kept::text, ',' ORDER BY kept.id)), '') "  # noqa: S608
                f"FROM {connection.ops.quote_name(table)} AS kept"
            )
            fingerprint.append(cursor.fetchone()[0])
    return tuple(fingerprint)


def _tables_with_rows(connection) -> list[str]:
    """The tables but post_migrate's that hold a row, in one query: truncating every table costs ~0.2 s a test
    (each is given new files), most tests write to a few."""
    tables = [
        table
        for table in connection.introspection.django_table_names(only_existing=True, include_views=False)
        if table not in POST_MIGRATE_TABLES
    ]
    if not tables:
        return []
    quote = connection.ops.quote_name
    query = " UNION ALL ".join(
        f"SELECT %s WHERE EXISTS (SELECT 1 FROM {quote(table)})"  # noqa: S608 - the tables' own names, quoted
        for table in tables
    )
    with connection.cursor() as cursor:
        cursor.execute(query, tables)
        return [row[0] for row in cursor.fetchall()]


def _empty(connection, tables: list[str]) -> None:
    """Delete every row of `tables` in one transaction: a test leaves a few rows in a few tables, and deleting them
    takes milliseconds where TRUNCATE took ~0.1 s (~0.3 s loaded), giving each table and index new files. Django's
    foreign keys are DEFERRABLE INITIALLY DEFERRED, checked at the commit, when every table that held a row is
    empty. A key that is not, or a table outside Django's referencing one of these, refuses: then TRUNCATE empties
    them as `flush` does."""
    quote = connection.ops.quote_name
    try:
        with transaction.atomic(using=connection.alias):
            with connection.cursor() as cursor:
                for table in tables:
                    cursor.execute(f"DELETE FROM {quote(table)}")  # noqa: S608 - the tables' own names, quoted
    except IntegrityError:
        # NOTE: CASCADE: TRUNCATE refuses a table others reference unless those are in the same statement,
        # empty or not; they are emptied with it (never a post_migrate table: none references another's).
        connection.ops.execute_sql_flush(
            connection.ops.sql_flush(no_style(), tables, reset_sequences=False, allow_cascade=True)
        )


def _only_known_receivers() -> bool:
    modules = set()
    for receiver in post_migrate.receivers:
        function = receiver[1]
        if isinstance(function, weakref.ReferenceType):
            function = function()
        modules.add(getattr(function, "__module__", None))
    return modules <= POST_MIGRATE_RECEIVERS


def _fixture_teardown(self: TransactionTestCase) -> None:
    if self.available_apps is not None or self.serialized_rollback or not _only_known_receivers():
        _django_fixture_teardown(self)
        return
    for db_name in self._databases_names(include_mirrors=False):
        connection = connections[db_name]
        if _made_by_post_migrate.get(db_name) == _fingerprint(connection):
            tables = _tables_with_rows(connection)
            if tables:
                _empty(connection, tables)
            # NOTE: as flush's post_migrate does (`create_contenttypes`): a test may leave the rows as they were and
            # the cache not (a review saw a content type renamed and renamed back read as renamed by the next test).
            ContentType.objects.clear_cache()
            continue
        call_command(
            "flush",
            verbosity=0,
            interactive=False,
            database=db_name,
            reset_sequences=False,
            allow_cascade=False,
            inhibit_post_migrate=False,
        )
        _made_by_post_migrate[db_name] = _fingerprint(connection)


def pytest_configure(config):
    TransactionTestCase._fixture_teardown = _fixture_teardown
