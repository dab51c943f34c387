"""Indexes a migration builds CONCURRENTLY (in a migration with `atomic = False`), so the table is written on while
they build, each step safe to run again after a migration that was interrupted (a pod killed in a rolling deploy).

NOTE: an interrupted CREATE INDEX CONCURRENTLY leaves its index INVALID, which CREATE INDEX IF NOT EXISTS would keep:
it is dropped first, CONCURRENTLY too (a plain DROP INDEX takes an ACCESS EXCLUSIVE lock on the table). Only a database
where the migration has not run to its end has one; elsewhere the drop finds nothing. As batches/0013 does by hand.
"""

from __future__ import annotations

from django.db import migrations


def built_concurrently(table: str, indexes: dict[str, str]) -> list:
    """The database operations that build `indexes` (name: the body of CREATE INDEX after `ON <table>`) on `table`."""

    def drop_invalid_indexes(apps, schema_editor) -> None:
        with schema_editor.connection.cursor() as cursor:
            for name in indexes:
                cursor.execute("SELECT 1 FROM pg_index WHERE indexrelid = to_regclass(%s) AND NOT indisvalid",
                               [f'"{name}"'])
                if cursor.fetchone() is not None:
                    cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')

    return [
        migrations.RunPython(drop_invalid_indexes, migrations.RunPython.noop),
        *(migrations.RunSQL(f'CREATE INDEX CONCURRENTLY IF NOT EXISTS "{name}" ON "{table}" {body}',
                            reverse_sql=f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')
          for name, body in indexes.items()),
    ]
