"""Migration 0028 again: what pods of the code before it still wrote while it rolled out is scrubbed now.

0028 took the fleet's free-memory figures out of the endpoint events and statuses tenants read. A rolling deploy runs
it first, while pods of the code before it serve for minutes: each of their placement reasons and failed wakes in
that window wrote the old figure ("… the most free on a l4 node is 1024 MB") after 0028 had run, and events are never
pruned. This release's pods write none, so this run, shipped in the next release, finds the last of them (README,
*What a release may assume*: a data migration that repairs what the older code made runs again in the next release).

0028's function as it was (a migration never imports code that changes later): non-atomic, one short UPDATE per batch
of event ids and one for the endpoints, each its own transaction; run again it finds nothing left and changes nothing.
"""

import importlib

from django.db import migrations

_0028 = importlib.import_module("endpoints.migrations.0028_scrub_fleet_memory_from_tenant_reasons")


class Migration(migrations.Migration):
    atomic = False  # as 0028: each batch, and the endpoints' UPDATE, a short transaction of its own

    dependencies = [
        ('endpoints', '0028_scrub_fleet_memory_from_tenant_reasons'),
    ]

    operations = [
        migrations.RunPython(_0028.scrub_fleet_memory, migrations.RunPython.noop),
    ]
