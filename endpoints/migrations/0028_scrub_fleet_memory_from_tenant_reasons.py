"""Takes what the fleet's nodes had free out of what tenants read: their endpoints' events and `status_message`.

Placement's reasons said "the most free on a l4 node is 1024 MB" (or "… is 0 free GPUs") and a failed wake "its node
has 1024 MB of GPU memory free, it needs 2048 MB": each was kept in the endpoint's event log, which its tenant reads,
and events are never pruned. The new reasons carry no such figure (`endpoints.placement.PlacementDecision`); this
rewrites the old ones as the new say it. One UPDATE per table and pattern, on the rows that match; reversed, it leaves
them as they are (the figures are gone for good, as they should be).
"""

from django.db import migrations

# (regular expression, replacement): PostgreSQL's `regexp_replace`, every match in a row ('g').
SCRUBS = (
    (r", the most free on (a|one) \S+ (node|GPU) is \d+ MB", ""),
    (r", the most on one \S+ node is \d+ free GPUs?", ""),
    (r"its node has \d+ MB of GPU memory free, it needs (\d+) MB", r"its node no longer has the \1 MB it needs free"),
)
COLUMNS = (("endpoints_endpointevent", "message"), ("endpoints_endpoint", "status_message"))


def scrub_fleet_memory(apps, schema_editor):
    from django.db import connection

    with connection.cursor() as cursor:
        for table, column in COLUMNS:
            for pattern, replacement in SCRUBS:
                cursor.execute(f'UPDATE "{table}" SET "{column}" = regexp_replace("{column}", %s, %s, \'g\') '
                               f'WHERE "{column}" ~ %s', [pattern, replacement, pattern])


class Migration(migrations.Migration):
    dependencies = [
        ('endpoints', '0027_database_defaults_for_older_code'),
    ]

    operations = [
        migrations.RunPython(scrub_fleet_memory, migrations.RunPython.noop),
    ]
