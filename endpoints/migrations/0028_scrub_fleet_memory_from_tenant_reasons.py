"""Takes what the fleet's nodes had free out of what tenants read: their endpoints' events and `status_message`.

Placement's reasons said "the most free on a l4 node is 1024 MB" (or "… is 0 free GPUs") and a failed wake "its node
has 1024 MB of GPU memory free, it needs 2048 MB": each was kept in the endpoint's event log, which its tenant reads,
and events are never pruned. The old code printed a node's total less its replicas' reservations, unclamped: an
overcommitted node's figure was negative ("is -2000 MB"), and is taken out too. The new reasons carry no such figure
(`endpoints.placement.PlacementDecision`); this rewrites the old ones as the new say it. Reversed, it leaves rows as
they are (the figures are gone for good, as they should be).

NOTE: non-atomic, as `manage.py migrate` runs it beside live pods under a 2 s `lock_timeout`: one UPDATE per batch of
event ids (events are only inserted: their rows are locked by nothing else) and one for the endpoints, each its own
short transaction, so the endpoints' rows (which the scheduler's tick holds) are locked only for that statement and
never while the events are scanned. Each statement nests the three rewrites (one pass over a row, not three) and
touches only the rows a cheap `LIKE '%MB%'` then the patterns pick. Run again (`migrate`'s retry after a lock it did
not get, or a later migration that repeats it) it finds nothing left to rewrite and changes nothing.
"""

from django.db import migrations

# (regular expression, replacement): PostgreSQL's `regexp_replace`, every match in a row ('g').
SCRUBS = (
    (r", the most free on (a|one) \S+ (node|GPU) is -?\d+ MB", ""),
    (r", the most on one \S+ node is -?\d+ free GPUs?", ""),
    (r"its node has -?\d+ MB of GPU memory free, it needs (\d+) MB", r"its node no longer has the \1 MB it needs free"),
)
# Every old message with a figure says "MB" (the GPU-count reasons name the MB each GPU needs).
PREFILTER = "%MB%"
EVENT_IDS_PER_BATCH = 10_000


def _scrub(cursor, table: str, column: str, where: str = "TRUE", where_params: tuple = ()) -> None:
    """One UPDATE of `table`'s rows in `where` whose `column` holds an old figure: the rewrites nested, one pass."""
    rewritten, set_params = f'"{column}"', []
    for pattern, replacement in SCRUBS:
        rewritten = f"regexp_replace({rewritten}, %s, %s, 'g')"
        set_params += [pattern, replacement]
    any_pattern = "|".join(f"({pattern})" for pattern, _ in SCRUBS)
    cursor.execute(f'UPDATE "{table}" SET "{column}" = {rewritten} '
                   f'WHERE {where} AND "{column}" LIKE %s AND "{column}" ~ %s',
                   [*set_params, *where_params, PREFILTER, any_pattern])


def scrub_fleet_memory(apps, schema_editor):
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute('SELECT min("id"), max("id") FROM "endpoints_endpointevent"')
        low, high = cursor.fetchone()
        for start in range(low, high + 1, EVENT_IDS_PER_BATCH) if low is not None else ():
            _scrub(cursor, "endpoints_endpointevent", "message", '"id" >= %s AND "id" < %s',
                   (start, start + EVENT_IDS_PER_BATCH))
        _scrub(cursor, "endpoints_endpoint", "status_message")


class Migration(migrations.Migration):
    atomic = False  # each batch, and the endpoints' UPDATE, a short transaction of its own (above)

    dependencies = [
        ('endpoints', '0027_database_defaults_for_older_code'),
    ]

    operations = [
        migrations.RunPython(scrub_fleet_memory, migrations.RunPython.noop),
    ]
